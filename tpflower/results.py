"""The results.json record of one run: its schema (written by write_results, checked by read_results), and the
per-epoch progress line."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tpflower.files import atomic_write
from tpflower.owner import redact

RESULTS_FILE = "results.json"
#: the keys every results.json has (RunResults.to_json writes them all; a reader may rely on these)
REQUIRED_KEYS = ("algorithm", "dataset", "metric", "history")
#: the numeric fields of a history entry (EpochRecord); epoch and test_metric are required
NUMERIC_EPOCH_FIELDS = ("epoch", "test_metric", "rounds", "bytes_up", "bytes_down", "comm_time_s", "wall_time_s")


class ResultsError(ValueError):
    """A file that is not a readable, valid results.json; the message names the file and the field."""


class Unpickled:
    """A dataclass kept in checkpoints: unpickled, a field added since the checkpoint was written takes its
    default, so that a run checkpointed by an earlier tpflower resumes (it failed on the missing attribute; a
    plain default is the class's attribute already, a default factory is called here)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            if f.name not in state and f.default_factory is not MISSING:
                state[f.name] = f.default_factory()
        self.__dict__.update(state)


@dataclass
class EpochRecord(Unpickled):
    """One epoch; rounds, bytes and times are cumulative since the start of training."""

    epoch: int | float  # an int at an epoch's end; a fraction for evaluations inside an epoch (eval_every)
    test_metric: float
    train_loss: float
    rounds: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    comm_time_s: float = 0.0
    wall_time_s: float = 0.0
    rounds_inner: int = 0  # union scenario: coordinator rounds and their bytes, included in the totals above
    bytes_inner: int = 0
    extra: dict[str, float] = field(default_factory=dict)  # other test metrics (auc, ...), privacy spent

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


@dataclass
class RunResults(Unpickled):
    algorithm: str
    scenario: str
    dataset: str
    model: str
    task: str
    metric: str
    n_joined: int
    table_rows: dict[str, int]
    # a union: each sharded table's rows per shard, in shard order (tpflower.relation.shard_rows)
    shard_rows: dict[str, list[int]] = field(default_factory=dict)
    history: list[EpochRecord] = field(default_factory=list)
    privacy: dict[str, float | None] = field(
        default_factory=lambda: {"label_epsilon": None, "feature_epsilon": None, "delta": None}
    )
    config: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, float] = field(default_factory=dict)  # e.g. exact ridge / mean-predictor metrics
    # the epoch training stopped at, why and its detail (ADMM's and PCG's tolerance, early stopping)
    stopped: dict[str, Any] = field(default_factory=dict)
    # model selection on the validation part of the training join (strategies.selection): its share and rows, the
    # epoch of the kept model (the last history entry) and its validation loss, the early stopping patience
    selection: dict[str, Any] = field(default_factory=dict)
    # boosted trees: each table's splits, their summed gain and its share (tpflower.trees.table_importance)
    importance: dict[str, dict[str, float]] = field(default_factory=dict)
    # regression: how training scaled the label (config standardize_label): scaling (standardize | dp | raw),
    # mean and divisor (training sees (y - mean) / divisor); under feature DP also the training labels' std,
    # the DP noise of a parameter and the target std (tpflower.losses.dp_label_divisor)
    label_scale: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["history"] = [h.to_json() for h in self.history]
        for key in ("shard_rows", "reference", "stopped", "selection", "importance", "label_scale"):
            if not out[key]:
                out.pop(key)
        return out


def model_kind(cfg: Any, algorithm: str) -> str:
    """The model a run trains: ``model.kind``, ``gbdt`` for an algorithm of boosted trees and ``kmeans`` for
    k-means' centres (both take the default ``model=linear`` and leave it unused)."""
    from tpflower.registry import by_name  # noqa: PLC0415  the registry imports the phases (torch)

    try:
        entry = by_name(algorithm)
    except ValueError:  # not a registered algorithm (a benchmark's own record)
        return str(cfg.model.kind)
    if "gbdt" in entry.models:
        return "gbdt"
    return "kmeans" if entry.family == "kmeans" else str(cfg.model.kind)


def new_run_results(cfg: Any, algorithm: str, spec: Any, mapping: Any) -> RunResults:
    """An empty record for a run of ``algorithm`` on the dataset of ``spec`` (N and n_i from ``mapping``)."""
    from tpflower.losses import primary_metric  # noqa: PLC0415  torch: reading results (reproduce) needs none

    return RunResults(
        algorithm=algorithm,
        scenario=str(cfg.scenario.name),
        dataset=spec.name,
        model=model_kind(cfg, algorithm),
        task=spec.label.task,
        metric=primary_metric(spec.label.task),
        n_joined=mapping.N,
        table_rows=dict(mapping.n_rows),
        # the join-key secret belongs to the table owners: never in a results file
        config=redact(OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)),
    )


def write_results(results: RunResults, run_dir: str | Path) -> Path:
    """Write results.json atomically (temp file + rename): a crash never leaves a half-written record."""
    path = Path(run_dir) / RESULTS_FILE
    text = json.dumps(results.to_json(), indent=2)  # (a value JSON cannot hold fails here, before any file)
    atomic_write(path, text.encode(), mode=0o666 & ~current_umask())  # readable like the run's other files
    return path


def current_umask() -> int:
    """The process's umask (read by setting it and restoring it at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_results(record: Any, path: str | Path) -> dict[str, Any]:
    """``record`` if it has results.json's schema (the keys of REQUIRED_KEYS, a history list of epochs with a
    numeric or null epoch, test_metric and counters); else ResultsError naming ``path`` and the field."""
    bad = f"{path}: not a valid {RESULTS_FILE}"
    if not isinstance(record, dict):
        raise ResultsError(f"{bad} (top level is {type(record).__name__}, not an object)")
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ResultsError(f"{bad} (missing keys {missing})")
    history = record["history"]
    if not isinstance(history, list):
        raise ResultsError(f"{bad} (history is {type(history).__name__}, not a list)")
    for i, rec in enumerate(history):
        if not isinstance(rec, dict) or "epoch" not in rec or "test_metric" not in rec:
            raise ResultsError(f"{bad} (history[{i}] lacks epoch/test_metric: {rec!r})")
        for key in NUMERIC_EPOCH_FIELDS:
            value = rec.get(key, 0)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ResultsError(f"{bad} (history[{i}].{key} = {value!r} is not a number)")
    return record


def importance_line(
    importance: Mapping[str, Mapping[str, float]], fit_rows: int | None = None, min_child_rows: int | None = None
) -> str:
    """The run's line of each table's share of the split gain (RunResults.importance). No split: every tree is
    one leaf, the constant predictor, and when the trees were fit on fewer than 2 ``min_child_rows`` joined
    rows (``fit_rows``) the line says that no split could have both sides that large."""
    parts = [f"{t} {100 * v['share']:.1f}% ({int(v['splits']):,} splits)" for t, v in importance.items()]
    if parts:
        return "importance (share of the trees' split gain): " + ", ".join(parts)
    line = "importance (share of the trees' split gain): no split, every tree is one leaf (the constant predictor)"
    if fit_rows is not None and min_child_rows is not None and fit_rows < 2 * min_child_rows:
        line += (
            f"; a split needs algorithm.min_child_rows={min_child_rows} joined rows on each side and the trees "
            f"were fit on {fit_rows:,}: set algorithm.min_child_rows={max(1, fit_rows // 4)} or less"
        )
    return line


def read_results(path: str | Path) -> dict[str, Any]:
    """The record of a results.json file (or of a run directory's), its schema checked (check_results).

    Raises ResultsError naming the file when it cannot be read, is not JSON or lacks a field."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not a valid {RESULTS_FILE} (invalid JSON: {exc})") from None
    return check_results(record, path)


def figure(x: float) -> str:
    """A metric or loss as the progress line shows it: 4 decimals, or 5 significant digits for a value in
    small or large units (a loss of 1e-4, an RMSE of 2e7 dollars)."""
    return f"{x:.4f}" if x == 0 or 1e-2 <= abs(x) < 1e5 or not math.isfinite(x) else f"{x:.5g}"


#: how every progress line begins: an epoch's, or boosted trees' (their count so far)
PROGRESS_PREFIXES = ("epoch ", "trees ")


#: history numbers that stay the same for the whole run (a coreset's, said once in its construction line):
#: kept in results.json, left out of the progress lines
CONSTANT_EXTRA = frozenset({"coreset_rows", "coreset_m", "construction_rounds", "construction_bytes"})


def epoch_line(metric: str, rec: EpochRecord) -> str:
    """The one-line progress report of an epoch (boosted trees: of the trees so far, ``extra["trees"]``)."""
    extra = "".join(f" {k}={v:.4g}" for k, v in rec.extra.items() if k != "trees" and k not in CONSTANT_EXTRA)
    if "trees" in rec.extra:
        head = f"trees {int(rec.extra['trees']):4d}"
    else:
        head = f"epoch {rec.epoch:3d}" if isinstance(rec.epoch, int) else f"epoch {rec.epoch:6.2f}"
    return (
        f"{head} | test {metric}={figure(rec.test_metric)}{extra} | train loss={figure(rec.train_loss)} | "
        f"rounds={rec.rounds} | MB up/down={rec.bytes_up / 1e6:.2f}/{rec.bytes_down / 1e6:.2f} | "
        f"comm={rec.comm_time_s:.2f}s | wall={rec.wall_time_s:.1f}s"
    )
