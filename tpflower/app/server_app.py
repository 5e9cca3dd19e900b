"""The ServerApp (Flower's Message API): ``@app.main()`` runs the configured algorithm's strategy over the Grid.

The strategy is looked up in tpflower.registry (algorithm x scenario), validated (its typed settings, the
run settings, privacy) before any node is contacted, and its start() runs the protocol. Under `flwr run .` the
run config's ``overrides`` string holds the Hydra overrides and ``run-dir`` the directory for results.json
(default outputs/flwr/ALGORITHM-DATASET). With ``predict.run_id`` in the config the run is a prediction request
for the model of that run dir instead (strategies/predict.py; docs/prediction.md).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from tpflower.app.client_app import config_from_run_config  # at import time: see the note in server_app_for
from tpflower.app.flower_patch import install_fast_fetch, install_fast_grid_pulls, install_node_actors
from tpflower.auto import resolve
from tpflower.config_errors import override_error
from tpflower.datasets import load_spec
from tpflower.errors import RunError
from tpflower.overrides import split_overrides
from tpflower.registry import check_model, entries, entry_of, prediction_strategy
from tpflower.schema import RelationalSpec, SpecError


def build_strategy(
    cfg: DictConfig,
    run_dir: str | Path | None,
    base_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    spec: RelationalSpec | None = None,
) -> Any:
    """The registered strategy of cfg's algorithm and scenario, federated or not (strategies/FAMILY.py, found
    by the registry); ``spec``: the dataset's spec if already loaded. Bad settings raise ValueError here.
    ``algorithm=auto`` is resolved here, in ``cfg`` (tpflower.auto), and the choice is the run's first line."""
    spec = spec if spec is not None else load_spec(cfg.dataset, base_dir=base_dir)
    resolve(cfg, spec, log=log)
    entry = entry_of(cfg)
    check_model(entry, str(cfg.model.kind))
    return entry.strategy(
        cfg,
        spec,
        run_dir,
        log=log,
        feature_dp=entry.feature_dp,
        label_dp=entry.label_dp,
        why_no_feature_dp=entry.why_no_feature_dp,
        why_no_label_dp=entry.why_no_label_dp,
    )


def make_strategy(
    cfg: DictConfig,
    run_dir: str | Path | None,
    base_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    spec: RelationalSpec | None = None,
) -> Strategy:
    """The registered Flower strategy of cfg's algorithm and scenario (a strategies.base.TablePuppetStrategy);
    bad settings, and an algorithm that does not run federated (centralized), raise ValueError here."""
    resolve(cfg, spec, base_dir, log=log)  # algorithm=auto: said once, here (build_strategy finds it resolved)
    entry = entry_of(cfg)
    if not entry.federated:
        scenario = str(cfg.scenario.name)
        choices = sorted(e.selector for e in entries() if e.scenario == scenario and e.federated)
        raise ValueError(f"algorithm {entry.name!r} is not a federated algorithm; choose one of {choices}")
    return build_strategy(cfg, run_dir, base_dir, log=log, spec=spec)


def server_app_for(
    cfg: DictConfig | None,
    run_dir: str | Path | None,
    base_dir: str | Path | None = None,
    created: list | None = None,
    log: Callable[[str], None] = print,
    strategy: Strategy | None = None,
) -> ServerApp:
    """A ServerApp for a fixed config (the Hydra entry point) or one composed from the run config (flwr run,
    ``cfg`` None); ``strategy``: the strategy built for ``cfg`` already (it runs once), else built here."""
    # Under `flwr run` on the simulation runtime the ServerApp thread and the ClientApp loader share a process:
    # Flower's loader takes a module already in sys.modules as loaded, so importing tpflower.app.client_app
    # lazily here could hand it a half-initialised module (LoadClientAppError "no attribute 'app'").
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_cfg = cfg if cfg is not None else run_config_of(context.run_config)
        out = run_dir or context.run_config.get("run-dir") or default_run_dir(run_cfg)
        root = base_dir if base_dir is not None else context.run_config.get("base-dir") or None
        run = strategy if strategy is not None else run_of(run_cfg, out, root, log)
        if created is not None:
            created.append(run)
        nodes = run_cfg.get("nodes") or {}
        run.start(grid, timeout=float(nodes.get("reply_timeout_s", 600)), node_wait_s=float(nodes.get("wait_s", 120)))

    return app


def run_config_of(run_config: dict[str, Any]) -> DictConfig:
    """The config of a `flwr run` job's overrides; an unknown name or a typo'd key is one line (SpecError), as on
    the command line, not Hydra's traceback in the ServerApp's log."""
    try:
        return config_from_run_config(run_config)
    except (HydraException, OmegaConfBaseException) as exc:
        raise SpecError(override_error(exc, split_overrides(str(run_config.get("overrides", ""))))) from None


def run_of(
    run_cfg: DictConfig, run_dir: str | Path, base_dir: str | Path | None, log: Callable[[str], None]
) -> Strategy:
    """The strategy a ServerApp runs for ``run_cfg``: a prediction request's (docs/prediction.md) or the run's.
    A setting it refuses (ValueError, before any message is sent) is a SpecError: one line in Flower's log, as
    on the command line (:class:`OneLineRefusals`)."""
    try:
        if run_cfg.get("predict"):  # a prediction request for the model in the run dir
            return prediction_strategy().from_run_dir(run_cfg, run_dir, base_dir, log=log)
        return make_strategy(run_cfg, run_dir, base_dir, log=log)
    except SpecError:
        raise
    except ValueError as exc:
        raise SpecError(str(exc)) from exc


class OneLineRefusals(logging.Filter):
    """Flower logs a ServerApp's exception with its traceback (flwr-serverapp's and the simulation's ``%s
    raised an exception``; the simulation engine's thread also its ``An exception occurred !!`` and the
    formatted traceback). A refusal tpflower raises on purpose (:func:`expected_refusal`) becomes one line,
    ``the run stopped: ...``; the run still ends failed (Flower's exit code, ``finished:failed``). Any other
    exception keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        refusal = expected_refusal(exc)
        if refusal is None:
            return True
        if not record.exc_info:  # the engine thread's own lines about it: the line below says it
            return False
        record.msg, record.args = "the run stopped: %s", ("; ".join(str(refusal).splitlines()),)
        record.exc_info, record.exc_text = None, None
        return True


def expected_refusal(exc: BaseException | None) -> BaseException | None:
    """``exc`` or the exception it wraps (its cause or context) when it is a refusal tpflower raises on
    purpose: a node's or the transport's (strategies.transport.RunError) or a data or spec problem
    (tpflower.schema.SpecError); None otherwise."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, (RunError, SpecError)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def one_line_refusals() -> None:
    """Install :class:`OneLineRefusals` on Flower's logger (once per process)."""
    flwr_log = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineRefusals) for f in flwr_log.filters):
        flwr_log.addFilter(OneLineRefusals())


def default_run_dir(cfg: Any) -> str:
    return str(Path("outputs") / "flwr" / f"{cfg.algorithm.name}-{cfg.dataset.name}")


install_fast_fetch(only_if_loaded=True)  # `flwr run` on the simulation runtime: the engine runs in this process
install_node_actors(only_if_loaded=True)  # (as above; an engine already running keeps its worker threads)
one_line_refusals()  # a refusal in the ServerApp's log: one line, not a traceback (Flower's exit code kept)
install_fast_grid_pulls()  # a deployed ServerApp (flwr-serverapp): reply objects pulled without 1 s retries
app = server_app_for(None, None)
