"""One training job: the data checked, the strategy built, the run under Flower's simulation engine or in-process
(``runtime``), results.json written; and what a failed run says. The Hydra entry point is simulations.run, the
Python API simulations.api."""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from simulations.federated import InProcessRun, check_engine_settings, run_flower_simulation, run_in_process
from strategies.transport import RunError
from tpflower.app.server_app import build_strategy
from tpflower.checkpoint import CHECKPOINT
from tpflower.checks import DataProblems, errors, shard_problems
from tpflower.config import CONF_DIR
from tpflower.datasets import check_dataset, compile_sql, load_spec, release_tables
from tpflower.registry import entry_of
from tpflower.results import RESULTS_FILE, RunResults, figure
from tpflower.schema import SpecError, canonical_joins

QUIET_LOGGERS = ("alembic", "flwr")  # INFO lines per Flower round or DB plugin would drown the epoch lines


def print_line(line: str) -> None:
    print(line, flush=True)


def run_job(
    cfg: DictConfig, run_dir: Path, base_dir: str | Path | None = None, log: Callable[[str], None] = print_line
) -> RunResults:
    """Run one configured job and write its results.json into ``run_dir`` (held by this run alone:
    :func:`run_dir_lock`); ``log`` prints its progress lines."""
    with run_dir_lock(Path(run_dir)):
        unfinished = (Path(run_dir) / CHECKPOINT).exists() and not (Path(run_dir) / RESULTS_FILE).exists()
        if unfinished and not cfg.get("resume"):
            log(
                f"warning: {run_dir} holds the checkpoint of an unfinished run, which this run replaces "
                "(resume=true would continue it)"
            )
        return _run_job(cfg, Path(run_dir), base_dir, log)


LOCK = ".run.lock"  # in a run dir: the process id of the run that holds it


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for this process while a run writes into it: a second run into the same folder (the same
    hydra.run.dir, or two runs started in the same second) is refused in one line instead of overwriting the
    first one's results; a lock left by a run that died is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = lock_holder(lock)
            if holder is not None:
                raise SpecError(
                    f"run dir {run_dir} is in use by another run (process {holder}); give this run its own "
                    "(hydra.run.dir=..., or fit's run_dir)"
                ) from None
            lock.unlink(missing_ok=True)  # its run died: the lock is stale
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        break
    else:
        raise SpecError(f"run dir {run_dir} is in use by another run; give this run its own") from None
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def lock_holder(lock: Path) -> int | None:
    """The live process that holds ``lock`` (None: it died, or the lock is gone; a lock whose holder has not
    written its id yet is held)."""
    try:
        text = lock.read_text().strip()
    except OSError:
        return None
    if not text:
        return 0  # just made by its holder, which writes its id next
    if not text.isdigit():
        return None  # not a lock of ours
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's live process
    return int(text)


def _run_job(cfg: DictConfig, run_dir: Path, base_dir: str | Path | None, log: Callable[[str], None]) -> RunResults:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    canonical_joins(cfg.dataset)  # a bare `on:` of the user's YAML (read as True) as "on"
    compile_query(cfg, base_dir, log=log)
    # the spec parsed and the strategy built once, here: its settings are checked before any table is loaded,
    # and the runners run this very object
    spec = load_spec(cfg.dataset, base_dir=base_dir)
    strategy = build_strategy(cfg, run_dir, base_dir, log=log, spec=spec)
    if base_dir is not None:  # recorded in its model.json (a deployment's ServerApp records none)
        strategy.source_dir = Path(base_dir).expanduser().resolve()
    if entry_of(cfg).federated and cfg.get("runtime", "flower") == "flower":
        check_engine_settings(cfg)  # resources.*: a bad value before any table is loaded, as every setting
    note = unread_epochs(cfg)
    if note is not None:
        log(f"warning: {note}")
    t0 = time.perf_counter()
    n_rows = check_data(cfg, base_dir, log=log)  # and every table, all problems at once
    log(f"data: {len(n_rows)} tables loaded and checked in {time.perf_counter() - t0:.1f} s")
    if not entry_of(cfg).federated:
        return strategy.run_local(base_dir)
    release_tables()  # the server holds no table during the run: each client loads its own
    if cfg.get("runtime", "flower") == "inprocess":
        run = run_in_process(cfg, run_dir, base_dir, log=log, strategy=strategy)
        results = run.strategy.results
        line = exact_metric_line(run)
        if line is not None:
            log(line)
    else:
        results = run_flower_simulation(
            cfg, run_dir, base_dir, log=log, strategy=strategy, largest_table=max(n_rows.values())
        )
    assert results is not None
    return results


def exact_metric_line(run: InProcessRun) -> str | None:
    """Under label DP the progress lines show the label owner's DP releases of the test metric (noised, and a
    regression's labels and predictions clipped to its label range: tpflower.label_dp), not the model's own;
    the in-process harness, which holds every table, scores the final model exactly: one line saying so.
    None without label DP (the lines are exact) or without an evaluation."""
    res = run.strategy.results
    if res.privacy.get("label_epsilon") is None or run.strategy.record.test_predictions is None:
        return None
    exact = run.exact_test_metrics()
    if res.metric not in exact:
        return None
    how = "noised, its labels and predictions clipped to the label range" if res.task == "regression" else "noised"
    return (
        f"label DP: the test {res.metric} above is the label owner's DP release ({how}); this simulation holds "
        f"every table and scores the final model exactly: test {res.metric}={figure(exact[res.metric])}"
    )


def unread_epochs(cfg: DictConfig) -> str | None:
    """The line for an ``epochs`` other than conf/config.yaml's on boosted trees (``algorithm=auto`` resolved),
    which do not read it: ``algorithm.trees`` counts their boosting rounds (docs/settings.md; under auto given
    as ``+algorithm.trees``); None otherwise."""
    trees = (cfg.get("algorithm") or {}).get("trees")
    default = OmegaConf.load(Path(CONF_DIR) / "config.yaml").get("epochs")
    if trees is None or cfg.get("epochs") in (None, default):
        return None
    plus = "+" if cfg.get("algorithm_auto") else ""  # auto's choice takes its settings in the + form
    return (
        f"epochs={cfg.epochs} is not read by algorithm={cfg.algorithm.name}: it grows algorithm.trees={trees} "
        f"boosting rounds ({plus}algorithm.trees=N sets them)"
    )


def compile_query(cfg: DictConfig, base_dir: str | Path | None = None, log: Callable[[str], None] = print) -> None:
    """A dataset declared as SQL (``dataset.sql``) becomes, in place, the spec it compiles to (tpflower.sql);
    the normalized query is the run's first line."""
    if not cfg.dataset.get("sql"):
        return
    compiled = compile_sql(cfg.dataset, base_dir)
    log(f"query: {compiled['query']}")
    for note in compiled.pop("notes", ()):
        log(f"warning: {note}")
    scenario = str((cfg.get("scenario") or {}).get("name", "join"))
    union = " UNION ALL " in str(compiled.get("query", "")).upper()
    tables_of = (compiled.get("tables") or {}).items()
    sharded = {t: s["shards"].get("by") for t, s in tables_of if (s or {}).get("shards", {}).get("by")}
    if union and sharded and scenario != "ucq":  # the union's shards are the union scenario's (docs/datasets.md)
        tables = ", ".join(f"table {t!r} by {by}" for t, by in sharded.items())
        log(
            f"note: the query's UNION ALL splits {tables} into shards, which apply under scenario=ucq; this run "
            f"(scenario={scenario}) trains over the join of the union's rows, whole (the same model)"
        )
    with open_dict(cfg):
        cfg.dataset = OmegaConf.create(compiled)


def check_data(
    cfg: DictConfig, base_dir: str | Path | None = None, log: Callable[[str], None] = print
) -> dict[str, int]:
    """Load and check every table before anything runs (the user owns them all in a simulation): raise
    DataProblems with every error found; print each warning (e.g. a join that drops labelled rows). Returns
    each table's row count."""
    spec, frames, problems = check_dataset(cfg.dataset, base_dir)
    if str(cfg.scenario.name) == "ucq":
        problems = [*problems, *shard_problems(spec, frames)]
    if errors(problems):
        raise DataProblems(errors(problems), spec.name)
    for p in problems:
        log(f"warning: {p.line()}")
    return {t: len(f) for t, f in frames.items()}


def log_file(run_dir: Path) -> Path:
    """The run's log file: Hydra's job log (RUN_DIR/run.log) when logging to a file, else RUN_DIR/error.log."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return run_dir / "error.log"


def failure_message(exc: BaseException, run_dir: Path) -> str:
    """What a failed run says (no traceback; after ``error:`` on the console, the message of the Python API's
    TpflowerError); the full traceback is appended to the run's log file."""
    path = log_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if isinstance(exc, DataProblems):
        return exc.report()
    if isinstance(exc, (RunError, SpecError, ValueError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc} (traceback in {path})"


def report_failure(exc: BaseException, run_dir: Path) -> str:
    """The console text of a failed run: ``error:`` and :func:`failure_message`."""
    return f"error: {failure_message(exc, run_dir)}"
