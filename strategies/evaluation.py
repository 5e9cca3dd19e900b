"""Test evaluation and the run record, as an object the strategy uses: :class:`RunRecord`.

It holds the run's results (tpflower.results.RunResults), the communication meter and the feature epsilon
each client reported, and turns every evaluation point into an epoch record: the test metrics of the
predictions (by the server, or with label DP by the label owner in an ``evaluate`` round), the training loss
in the label's units, the traffic so far and the privacy spent.

Label DP: the server never holds test labels, so the test metric of each epoch is computed by the label owner
in an extra ``evaluate`` round (not training traffic: not counted in the communication figures). Feature DP:
the clients report the epsilon they spent, shown as ``eps`` (max over clients) in the epoch line and kept in
results.privacy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from strategies.epoch_checkpoints import Saved
from strategies.transport import ClientKey, Kind, Payload, Reply
from tpflower import privacy as dp
from tpflower.comm import CommMeter, WanModel
from tpflower.losses import metrics, primary_metric
from tpflower.mapping import TableMapping
from tpflower.reference import as_reference, constant_predictions, reference_metrics, reference_text
from tpflower.results import EpochRecord, RunResults, epoch_line, new_run_results, write_results
from tpflower.schema import RelationalSpec

Send = Callable[..., dict[ClientKey, Reply]]


class SetupResult(Protocol):
    """What evaluation needs of the setup rounds' result (strategies.setup.JoinSetup)."""

    d_out: int | None
    evaluation_split: dict[ClientKey, tuple[np.ndarray, np.ndarray]]
    label_scale: Any
    y_train: np.ndarray | None
    y_test: np.ndarray | None


class RunRecord(Saved):
    """The results, the meters and the evaluation of one run.

    ``send``: the strategy's round (for label DP's ``evaluate`` rounds); ``setup``: what the setup rounds
    built (test labels, the label owner's evaluation split, the label scale, the prediction width); ``labelled``
    False: the algorithm ignores the label (k-means), so no constant predictor is scored as its reference."""

    SAVED = ("comm", "results", "eps_spent")  # what an epoch's checkpoint keeps of it

    def __init__(
        self,
        send: Send,
        setup: SetupResult,
        task: str,
        privacy: Mapping[str, Any],
        log: Callable[[str], None] = print,
        labelled: bool = True,
    ):
        self.send, self.setup, self.log, self.labelled = send, setup, log, labelled
        self.task = task
        self.metric = primary_metric(task)
        self.privacy = privacy
        self.label_dp = dp.uses_label_dp(privacy)
        self.feature_dp = dp.uses_feature_dp(privacy)
        self.results: RunResults | None = None
        self.comm: CommMeter | None = None
        self.eps_spent: dict[ClientKey, float] = {}  # feature DP: the latest epsilon each client reported
        self.test_predictions: np.ndarray | None = None  # the latest evaluation's test predictions (label units)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def open(
        self,
        cfg: Any,
        algorithm: str,
        spec: RelationalSpec,
        mapping: TableMapping,
        regions: Mapping[ClientKey, str],
        y_train: np.ndarray,
        shard_rows: Mapping[str, list[int]] | None = None,
    ) -> None:
        """After the keys round: the meter (with each client's region), the results and the reference
        (the constant predictor's metrics; ``y_train``: the training labels in the label's units; ``shard_rows``:
        a union's sharded tables' rows per shard)."""
        self.comm = CommMeter(WanModel.from_config(cfg.network, regions))
        self.results = new_run_results(cfg, algorithm, spec, mapping)
        self.results.shard_rows = {t: list(n) for t, n in (shard_rows or {}).items()}
        self.results.privacy = dp.privacy_summary(self.privacy, self.task, 0.0 if self.feature_dp else None)
        y_test, d_out = self.setup.y_test, self.setup.d_out
        if y_test is not None and self.labelled:  # label DP: the label owner scores it at the first evaluation
            self.results.reference = reference_metrics(self.task, y_train, y_test, d_out)  # label units

    def reference_text(self) -> str:
        assert self.results is not None
        return reference_text(self.task, self.results.reference)

    # ------------------------------------------------------------------------------------------ rounds

    def count(self, kind: Kind, down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> None:
        """Count a round's traffic. Setup rounds (mapping, preprocessing) come before the meter exists and are
        not training traffic; the VFL expansion is. "inner" rounds are the union's inner (coordinator) rounds.
        The label owner's evaluation rounds (label DP, "eval") are evaluation, not training: not counted."""
        if self.comm is not None and kind != "eval":
            self.comm.record(down, up, inner=kind == "inner")

    def note_epsilon(self, replies: Mapping[ClientKey, Reply]) -> None:
        """Feature DP: every reply after a DP step says what its client has spent."""
        for key, (_, m) in replies.items():
            if "eps" in m:
                self.eps_spent[key] = float(m["eps"])

    def feature_epsilon(self) -> float:
        """The feature epsilon spent so far: the max over clients (each row belongs to one client's table)."""
        return max(self.eps_spent.values(), default=0.0)

    # ------------------------------------------------------------------------------------------ evaluation

    def test_metrics(self, H_test: np.ndarray) -> dict[str, float]:
        """Metrics of the test predictions.

        Without label DP the server holds the test labels and computes them. With label DP it sends each
        label-table shard its part of H (one ``evaluate`` round) and combines the replies exactly: loss and
        accuracy as row-weighted means, rmse from the summed squared errors. AUC needs all scores and labels
        together: it is reported only when the label table has one shard (the join scenario).
        """
        setup = self.setup
        if setup.y_test is not None:
            return metrics(self.task, H_test, setup.y_test)
        assert self.results is not None
        ref = None  # the first evaluation also scores the constant predictor (results.json reference)
        if not self.results.reference:
            ref = setup.label_scale.to_label(constant_predictions(self.task, setup.y_train, len(H_test), setup.d_out))
        split = setup.evaluation_split
        messages: dict[ClientKey, Payload] = {
            k: ({"H": H_test[idx], "rows": pos, **({} if ref is None else {"H_ref": ref[idx]})}, {"phase": "evaluate"})
            for k, (idx, pos) in split.items()
        }
        replies = self.send(messages, kind="eval")
        parts = [(int(m["n"]), m) for _, m in (replies[k] for k in split)]
        if ref is not None:
            self.results.reference = as_reference(
                self.combine([(c, {k[4:]: v for k, v in m.items() if k.startswith("ref_")}) for c, m in parts])
            )
            self.log(f"reference: {reference_text(self.task, self.results.reference)} (scored by the label owner)")
        return self.combine([(c, {k: v for k, v in m.items() if not k.startswith("ref_")}) for c, m in parts])

    def combine(self, parts: list[tuple[int, Mapping[str, Any]]]) -> dict[str, float]:
        """The test metrics of the whole test split from each label shard's (row count, metrics)."""
        n = sum(c for c, _ in parts)
        if n == 0:
            raise RuntimeError("evaluate: the label owner scored no test rows")
        if len(parts) == 1:
            return {k: float(v) for k, v in parts[0][1].items() if k != "n"}
        live = [(c, m) for c, m in parts if c > 0]
        out = {"loss": sum(c * float(m["loss"]) for c, m in live) / n}
        if self.task == "regression":
            out["rmse"] = float(np.sqrt(sum(c * float(m["rmse"]) ** 2 for c, m in live) / n))
        else:
            out["accuracy"] = sum(c * float(m["accuracy"]) for c, m in live) / n
        return out

    def record_epoch(
        self,
        algorithm: str,
        epoch: int | float,
        H_test: np.ndarray,
        train_loss: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        """Evaluate the test predictions, append the epoch to the record and print its line.

        With label DP the evaluation is a round with the label owner. With feature DP the line shows ``eps``,
        the max over clients of the epsilon spent so far; ``train_loss`` is against the labels the server
        holds (the randomized ones under label DP)."""
        assert self.results is not None and self.comm is not None
        scale = self.setup.label_scale
        self.test_predictions = scale.to_label(H_test)  # the latest, in the label's units (docs/prediction.md)
        test = self.test_metrics(self.test_predictions)
        train_loss = scale.loss(train_loss)
        if "objective" in (extra or {}):
            extra = {**(extra or {}), "objective": scale.loss(extra["objective"])}  # type: ignore[index]
        if not np.isfinite(train_loss):
            raise RuntimeError(f"{algorithm} diverged in epoch {epoch} (train loss {train_loss})")
        feature_eps = self.feature_epsilon() if self.feature_dp else None
        self.results.privacy = dp.privacy_summary(self.privacy, self.task, feature_eps)
        privacy: dict[str, float] = {}
        if feature_eps is not None:
            privacy["eps"] = feature_eps
        if self.label_dp:
            privacy["label_eps"] = float(self.results.privacy["label_epsilon"])  # type: ignore[arg-type]
        rec = EpochRecord(
            epoch=epoch,
            test_metric=test[self.metric],
            train_loss=train_loss,
            wall_time_s=self.elapsed(),
            extra={
                **{f"test_{k}": v for k, v in test.items() if k not in (self.metric, "loss")},
                **(extra or {}),
                **privacy,
            },
            **self.comm.snapshot(),  # type: ignore[arg-type]
        )
        self.add(rec, self.metric)

    def add(self, rec: EpochRecord, metric: str) -> None:
        """Append an epoch record and print its line (``metric``: the name of its test metric)."""
        assert self.results is not None
        self.results.history.append(rec)
        self.log(epoch_line(metric, rec))

    def write(self, run_dir: Path | None) -> None:
        """Write results.json (atomically) into ``run_dir`` (None: nowhere)."""
        if run_dir is not None and self.results is not None:
            path = write_results(self.results, run_dir)
            self.log(f"results: {path}")
