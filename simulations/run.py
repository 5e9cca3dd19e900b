"""Hydra entry point: ``python -m simulations.run algorithm=... dataset=... model=... epochs=K`` (``tpflower train``).

Writes results.json into the Hydra run dir (``hydra.run.dir=...`` moves it) and prints its path.
Privacy settings (conf/privacy) are checked first, before any data is loaded (tpflower.privacy.validate_privacy).
The first line, printed before torch and Flower are imported (seconds), says what runs and where its results
go; the job itself is simulations.job (imported after it, also as ``simulations.run.run_job``).
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpflower.errors import traceback_wanted

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # tpflower.config.CONF_DIR, without its imports
JOB_MODULE = "simulations.job"
#: Hydra's flags after which no run starts (help, config printing) or runs sweep (their dirs are Hydra's)
NO_FIRST_LINE = (
    "-h",
    "--help",
    "--hydra-help",
    "-c",
    "--cfg",
    "-i",
    "--info",
    "--version",
    "-sc",
    "--shell-completion",
)
MULTIRUN = ("-m", "--multirun")
MISSING_CHOICE = re.compile(r"Could not find '(\w+)/([^']+)'")  # Hydra's error for GROUP=NAME of no config
SWEEP_FUNCTION = re.compile(r"^\w+\(")  # Hydra's sweep functions: choice(a,b), glob(a*), range(1,3) ...
VALUE_FLAGS = ("-cd", "--config-dir", "-cp", "--config-path", "-cn", "--config-name", "-p", "--package")


def __getattr__(name: str) -> Any:
    """``simulations.run.run_job`` and the other job functions (simulations.job), imported on first use."""
    if name in ("run_job", "check_data", "compile_query", "failure_message", "report_failure", "log_file"):
        return getattr(importlib.import_module(JOB_MODULE), name)
    raise AttributeError(f"module 'simulations.run' has no attribute {name!r}")


def override_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The ``KEY=VALUE`` overrides of a command line as written (flags and their values aside) and its flags."""
    overrides: list[str] = []
    flags: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            flags.append(arg.split("=", 1)[0])
            skip = arg in VALUE_FLAGS
        elif "=" in arg:
            overrides.append(arg)
    return overrides, flags


def choices(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The ``KEY=VALUE`` overrides of a command line by key (without ``+``/``~``) and its Hydra flags."""
    overrides, flags = override_args(argv)
    return {k.lstrip("+~"): v for k, _, v in (o.partition("=") for o in overrides)}, flags


def unknown_choice(overrides: dict[str, str], config_dirs: list[str]) -> str | None:
    """The line for a ``GROUP=NAME`` override that names no config of the group (conf/GROUP/NAME.yaml or a
    ``--config-dir``'s): the public choices only (Hydra's own message also lists the algorithms' private
    defaults nodes, ``_admm`` ..., that tpflower.config stores)."""
    for group, value in overrides.items():
        folders = [Path(CONF_DIR) / group, *(Path(d).expanduser() / group for d in config_dirs)]
        if "." in group or not (Path(CONF_DIR) / group).is_dir() or SWEEP_FUNCTION.match(value):
            continue  # (Hydra's choice(...), glob(...) ... sweeps: Hydra checks what they expand to)
        options = sorted(
            {f.stem for d in folders if d.is_dir() for f in d.glob("*.yaml") if not f.stem.startswith("_")}
        )
        for name in value.split(","):  # a sweep's list: each of its names
            if name not in options:
                return (
                    f"{group}={name}: no such {group}; choose one of {', '.join(options)}"
                    + path_hint(group, name)
                    + folder_hint(group, name, config_dirs)
                )
    return None


def folder_hint(group: str, name: str, config_dirs: list[str]) -> str:
    """For a config dir that holds NAME.yaml itself (the group's folder given in place of its parent): the
    folder to give instead; else nothing."""
    for d in config_dirs:
        folder = Path(d).expanduser()
        if (folder / f"{name}.yaml").is_file():
            fix = f"give its parent, {folder.parent}" if folder.name == group else f"move it to {folder / group}/"
            return f"; config dir {d} holds {name}.yaml itself, not in a folder {group}/: {fix}"
    return ""


def path_hint(group: str, value: str) -> str:
    """For a choice that looks like a file (``dataset=conf/dataset/shop.yaml``): how the command line names it,
    ``--config-dir DIR GROUP=NAME`` for DIR/GROUP/NAME.yaml (docs/datasets.md); else nothing."""
    path = Path(value)
    if "/" not in value and path.suffix not in (".yaml", ".yml"):
        return ""
    name = path.stem if path.suffix in (".yaml", ".yml") else path.name
    if path.parent.name == group:
        return f"; for the file {value}: --config-dir {path.parent.parent} {group}={name}"
    return f"; a {group} file is chosen by name from a folder {group}/: --config-dir DIR {group}={name} for DIR/{group}/{name}.yaml"


def config_dirs_of(argv: list[str]) -> list[str]:
    """The ``--config-dir`` / ``-cd`` folders of a command line."""
    out = []
    for k, arg in enumerate(argv):
        if arg in ("-cd", "--config-dir") and k + 1 < len(argv):
            out.append(argv[k + 1])
        elif arg.startswith("--config-dir="):
            out.append(arg.split("=", 1)[1])
    return out


def announce(argv: list[str], now: datetime | None = None) -> tuple[str | None, list[str]]:
    """The run's first line (what runs, where its results go) and the command line to give Hydra: without a
    ``hydra.run.dir`` the run dir conf/config.yaml's pattern makes, fixed now so that the line names it."""
    overrides, flags = choices(argv)
    if any(f in NO_FIRST_LINE for f in flags):
        return None, argv
    algorithm, dataset = overrides.get("algorithm", "auto"), overrides.get("dataset", "movielens")
    runtime = overrides.get("runtime", "flower")
    engine = "Flower's simulation engine" if runtime == "flower" else f"runtime={runtime}"
    more = [k for k in overrides if k not in ("algorithm", "dataset") and not k.startswith("hydra.")]
    what = f"tpflower train: algorithm={algorithm} dataset={dataset}" + (
        f" ({len(more)} more setting{'s' if len(more) > 1 else ''})" if more else ""
    )
    if any(f in MULTIRUN for f in flags):
        where = overrides.get("hydra.sweep.dir", "multirun/DATE/TIME")
        return f"{what}, a sweep on {engine}; results under {where}/ (one dir per job)", argv
    run_dir = overrides.get("hydra.run.dir")
    if run_dir is None:
        now = now or datetime.now()
        run_dir = base = f"outputs/{now:%Y-%m-%d}/{now:%H-%M-%S}-{algorithm}-{dataset}"
        for k in range(2, 1000):  # a run started in the same second holds it already: the next free -K
            if not Path(run_dir).exists():
                break
            run_dir = f"{base}-{k}"
        argv = [*argv, f"hydra.run.dir={run_dir}"]
    return f"{what} on {engine}; results: {run_dir}/results.json", argv


def job(cfg: DictConfig) -> Any:
    """The Hydra job: exit status 1 for a refused setting, bad data or a failed run, with the reason on stderr
    and the traceback in the run's log file only (TPFLOWER_TRACEBACK=1: raise; 0, false, no or empty: off)."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415  start-up: after the first line
    from hydra.types import RunMode  # noqa: PLC0415  start-up: after the first line
    from hydra.utils import get_original_cwd  # noqa: PLC0415  start-up: after the first line
    from omegaconf import open_dict  # noqa: PLC0415  start-up: after the first line

    from simulations.job import report_failure, run_job  # noqa: PLC0415  start-up: after the first line
    from tpflower.checkpoint import CHECKPOINT  # noqa: PLC0415  start-up: after the first line
    from tpflower.owner import redact_run_dir, simulation_secret  # noqa: PLC0415  start-up: after the first line

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if HydraConfig.get().mode == RunMode.MULTIRUN and cfg.get("resume") is True and not (run_dir / CHECKPOINT).exists():
        # the sweep stopped before this job's first checkpoint (or before the job): nothing to continue, so the
        # same sweep with resume=true runs it from the start instead of failing it
        print(f"resume: {run_dir} holds no checkpoint yet; this job starts from the beginning", flush=True)
        with open_dict(cfg):
            cfg.resume = False
    try:
        redact_run_dir(run_dir / ".hydra", simulation_secret(cfg))  # Hydra saved the command line: no secret in it
        results = run_job(cfg, run_dir, base_dir=get_original_cwd())
    except Exception as exc:
        if traceback_wanted():
            raise
        print(report_failure(exc, run_dir), file=sys.stderr, flush=True)
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # the sweep's other jobs still run (main says which failed)
            FAILED_JOBS.append(f"#{HydraConfig.get().job.num} ({run_dir.name})")
            return None
        sys.exit(1)
    return results.history[-1].test_metric if results.history else None


#: the sweep jobs that failed (their number and folder), said once the sweep ends
FAILED_JOBS: list[str] = []


def main() -> Any:
    """The first line at once, then torch, Flower and the algorithms' defaults (Hydra's ConfigStore nodes that
    conf/algorithm/*.yaml extend), then the Hydra job."""
    wrong = unknown_choice(choices(sys.argv[1:])[0], config_dirs_of(sys.argv[1:])) or mixed_modes(sys.argv[1:])
    if wrong is not None:
        print(f"error: {wrong}", file=sys.stderr, flush=True)
        sys.exit(1)
    line, sys.argv[1:] = announce(sys.argv[1:])
    if line is not None:
        print(line, flush=True)
    try:  # Ctrl-C during the imports too (seconds) is the interrupted line below, not a traceback
        import hydra  # noqa: PLC0415  start-up: after the first line
        from hydra.errors import HydraException  # noqa: PLC0415  start-up: after the first line
        from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415  start-up: after the first line

        from tpflower.config import register_algorithm_defaults  # noqa: PLC0415  start-up: after the first line

        register_algorithm_defaults()
        run = hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")(job)
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or traceback_wanted():
            out = run()
        else:
            before = os.environ.get("HYDRA_FULL_ERROR")  # a user's HYDRA_FULL_ERROR=0, say: put back after
            os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises a composition error (to the line below), not prints it
            try:
                out = run()
            except (HydraException, OmegaConfBaseException) as exc:
                print(f"error: {composition_error(exc, sys.argv[1:])}", file=sys.stderr, flush=True)
                sys.exit(1)
            finally:
                if before is None:
                    os.environ.pop("HYDRA_FULL_ERROR", None)
                else:
                    os.environ["HYDRA_FULL_ERROR"] = before
    except OSError as exc:  # Hydra making the run dir (a job's own errors are the job's lines)
        if traceback_wanted():
            raise
        hint = (  # a sweep's job folder is named by the job's overrides: a long dataset.sql is too long a name
            "; a sweep's job folder is named by its overrides: 'hydra.sweep.subdir=${hydra.job.num}' numbers them"
            if exc.errno == errno.ENAMETOOLONG
            else ""
        )
        print(f"error: {exc.filename}: {exc.strerror} (hydra.run.dir / hydra.sweep.dir){hint}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"error: {interrupted_line(sys.argv[1:])}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        logging.shutdown()
        # os._exit: Flower's ServerApp thread would wait out its reply timeout before the interpreter exits, and an
        # interrupt that passed through code CPython ran as a nested program leaves its "unhandled
        # KeyboardInterrupt" flag set, so the interpreter would end by SIGINT (status -2), not 130, though handled
        # here (seen: Ctrl-C 1.15 s into a synthetic run, 1 of 36 delays). The run's own cleanup (its run dir's
        # lock, its checkpoint) ran as the interrupt unwound it.
        os._exit(130)
    if FAILED_JOBS:
        print(f"error: {len(FAILED_JOBS)} job(s) of the sweep failed: {', '.join(FAILED_JOBS)}", file=sys.stderr)
        sys.exit(1)
    return out


#: Hydra's run modes, of which a command line takes one (Hydra raises a ValueError, a traceback, for two)
MODES = (("-m", "--multirun"), ("-c", "--cfg"), ("-i", "--info"), ("-sc", "--shell-completion"), ("-r", "--run"))


def mixed_modes(argv: list[str]) -> str | None:
    """The line for a command line of two of Hydra's modes (``-m --cfg job``, say), else None."""
    given = [names[-1] for names in MODES if any(a in names or a.startswith(f"{names[-1]}=") for a in argv)]
    if len(given) < 2:
        return None
    return f"{' and '.join(given)}: Hydra takes one of --run, --multirun, --cfg, --info and --shell-completion"


def interrupted_line(argv: list[str]) -> str:
    """What an interrupted run (Ctrl-C) says instead of a traceback: how to continue it."""
    overrides, flags = choices(argv)
    if any(f in MULTIRUN for f in flags):
        return (
            "interrupted (Ctrl-C); a job continues from its last checkpoint when the sweep runs again with resume=true"
        )
    where = overrides.get("hydra.run.dir", "the run dir")
    if "hydra.run.dir" in overrides and not (Path(where) / "checkpoint.pkl").exists():  # tpflower.checkpoint's
        return (
            f"interrupted (Ctrl-C) before the run's first checkpoint: nothing to continue; the same command without "
            f"resume=true starts it again (results: {where})"
        )
    return (
        f"interrupted (Ctrl-C); the run continues from its last checkpoint (docs/deployment.md, checkpoint and resume) "
        f"with the same command and resume=true (results: {where})"
    )


def composition_error(exc: BaseException, argv: list[str]) -> str:
    """The one line of a Hydra error composing the command line's config (tpflower.config_errors.override_error)."""
    from hydra.core.global_hydra import GlobalHydra  # noqa: PLC0415  start-up: after the first line

    from tpflower.config_errors import NO_SUCH_KEY, override_error  # noqa: PLC0415  start-up: after the first line
    from tpflower.overrides import searchpath_override  # noqa: PLC0415  start-up: after the first line

    GlobalHydra.instance().clear()  # the failed main's, so that the error's own compositions can start
    if any(f in MULTIRUN for f in override_args(argv)[1]):  # a job of the sweep, whose choices the line lacks
        missing = MISSING_CHOICE.search(str(exc))  # a sweep function's name (choice(a,b), glob(...)): no such file
        line = unknown_choice({missing[1]: missing[2]}, config_dirs_of(argv)) if missing else None
        if line is not None:
            return f"a job of the sweep: {line} (Hydra checks every job first: none ran)"
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        hint = "; a swept algorithm lacks that setting: sweep it over the algorithms that take it" * bool(
            NO_SUCH_KEY.match(str(exc))
        )
        return f"a job of the sweep: {text}{hint} (Hydra checks every job first: none ran)"
    overrides = [o for o in override_args(argv)[0] if not o.startswith("hydra.")]
    folders = [str(Path(d).expanduser().resolve()) for d in config_dirs_of(argv)]
    if folders:
        overrides.append(searchpath_override(*folders))
    return override_error(exc, overrides, base_dir=os.getcwd())


if __name__ == "__main__":
    main()
