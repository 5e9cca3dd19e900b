"""Hydra entry point: ``python -m simulations.run algorithm=... dataset=... model=... epochs=K``.

Writes results.json into the Hydra run dir (``hydra.run.dir=...`` moves it) and prints its path.
Privacy settings (conf/privacy) are checked first, before any data is loaded (tpflower.privacy.validate_privacy).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd
from omegaconf import DictConfig

from simulations.config import CONF_DIR
from simulations.centralized import check_settings, constant_predictor_metric, train_centralized
from strategies.protocol import RunError
from tpflower import privacy as dp
from tpflower.checks import DataProblems, errors
from tpflower.datasets import check_dataset, load_spec, release_tables
from tpflower.owner import redact_run_dir, simulation_secret
from tpflower.reference import as_reference, reference_text
from tpflower.relation import Relation, load_relation, summary_line
from tpflower.results import RunResults, new_run_results, write_results
from tpflower.schema import SpecError

QUIET_LOGGERS = ("alembic", "flwr")  # INFO lines per Flower round or DB plugin would drown the epoch lines


def run_job(cfg: DictConfig, run_dir: Path, base_dir: str | Path | None = None) -> RunResults:
    """Run one configured job and write its results.json into ``run_dir``."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    algorithm = str(cfg.algorithm.name)
    if algorithm != "centralized":
        from simulations.federated import run_flower_simulation, run_in_process
        from simulations.server_app import make_strategy

        make_strategy(cfg, run_dir, base_dir, log=lambda _: None)  # every setting checked before Flower starts
        check_data(cfg, base_dir)  # and every table, all problems at once
        release_tables()  # the server holds no table during the run: each client loads its own

        if cfg.get("runtime", "flower") == "inprocess":
            results = run_in_process(cfg, run_dir, base_dir).strategy.results
        else:
            results = run_flower_simulation(cfg, run_dir, base_dir)
        assert results is not None
        return results
    check_settings(cfg.algorithm)
    check_privacy(cfg, base_dir)
    check_data(cfg, base_dir)
    rel = load_relation(cfg.dataset, simulation_secret(cfg), base_dir=base_dir, verbose=False)
    privacy = cfg.get("privacy") or {"name": "none"}
    if dp.uses_label_dp(privacy):
        randomize_training_labels(rel, privacy)
    results = new_run_results(cfg, algorithm, rel.spec, rel.mapping)
    results.privacy = dp.privacy_summary(privacy, rel.spec.label.task)
    results.reference = as_reference(constant_predictor_metric(rel))
    print(f"{summary_line(rel.spec, rel.mapping)} | {reference_text(rel.spec.label.task, results.reference)}", flush=True)
    train_centralized(cfg, rel, results)
    path = write_results(results, run_dir)
    print(f"results: {path}", flush=True)
    return results


#: Why the centralized baseline refuses feature DP (shown in the error).
CENTRALIZED_NO_FEATURE_DP = (
    "the centralized baseline trains one model on the materialized join (features of all tables in one place); "
    "there is no per-client local model whose table row could be the privacy unit"
)


def check_data(cfg: DictConfig, base_dir: str | Path | None = None, log: Callable[[str], None] = print) -> None:
    """Load and check every table before anything runs (the user owns them all in a simulation): raise
    DataProblems with every error found; print each warning (e.g. a join that drops labelled rows)."""
    spec, _, problems = check_dataset(cfg.dataset, base_dir)
    if errors(problems):
        raise DataProblems(errors(problems), spec.name)
    for p in problems:
        log(f"warning: {p.line()}")


def check_privacy(cfg: DictConfig, base_dir: str | Path | None = None) -> None:
    """The centralized baseline: refuse impossible privacy settings before any data is loaded (ValueError).

    Needs the task, so it parses the dataset spec (never a table). The federated strategies check their
    own settings in their constructor (run_job builds one before Flower starts; `flwr run` gets it too).
    """
    privacy = cfg.get("privacy") or {"name": "none"}
    if str(privacy.get("name", "none")) == "none":
        return
    task = load_spec(cfg.dataset, base_dir=base_dir).label.task
    dp.validate_privacy(privacy, "centralized", task, feature_dp=False, why_not=CENTRALIZED_NO_FEATURE_DP)


def randomize_training_labels(rel: Relation, privacy) -> None:
    """Label DP for the centralized baseline: the training labels randomized exactly as the federated label
    owner does (noise from the OS entropy); test labels stay true."""
    label = rel.label
    assert label.y is not None and label.is_test is not None
    train = ~label.is_test
    rng = dp.label_rng()
    y = label.y.copy()
    y[train] = dp.randomize_labels(label.y[train], rel.spec.label.task, privacy, rng, label.n_classes)
    label.y = y


def log_file(run_dir: Path) -> Path:
    """The run's log file: Hydra's job log (RUN_DIR/run.log) when logging to a file, else RUN_DIR/error.log."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return run_dir / "error.log"


def report_failure(exc: BaseException, run_dir: Path) -> str:
    """The console text of a failed run (no traceback); the full traceback is appended to the run's log file."""
    path = log_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if isinstance(exc, DataProblems):
        return f"error: {exc.report()}"
    if isinstance(exc, (RunError, SpecError, ValueError)):
        return f"error: {exc}"
    return f"error: {type(exc).__name__}: {exc} (traceback in {path})"


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> Any:
    """Exit status 1 for a refused setting, bad data or a failed run, with the reason on stderr and the
    traceback in the run's log file only (TPFLOWER_TRACEBACK=1: raise)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    redact_run_dir(run_dir / ".hydra", simulation_secret(cfg))  # Hydra saved the command line: no secret in it
    try:
        results = run_job(cfg, run_dir, base_dir=get_original_cwd())
    except Exception as exc:
        if os.environ.get("TPFLOWER_TRACEBACK"):
            raise
        print(report_failure(exc, run_dir), file=sys.stderr, flush=True)
        sys.exit(1)
    return results.history[-1].test_metric if results.history else None


if __name__ == "__main__":
    main()
