"""The ServerApp: the LoJ strategy of the configured algorithm, run by PhaseServer until its protocol ends.

Under `flwr run .` the run config's ``overrides`` string holds the Hydra overrides and ``run-dir`` the
directory for results.json (default outputs/flwr/ALGORITHM-DATASET).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from omegaconf import DictConfig

from simulations.client_app import config_from_run_config  # at import time: see the note at server_fn_for
from strategies.loj import LoJStrategy
from strategies.phase import PhaseServer
from strategies.tp_join_admm import TPJoinADMM, VFLADMM
from strategies.tp_join_sgd import TPJoinSGD, VFLSGD
from strategies.tp_ucq_admm import TPUCQADMM
from strategies.tp_ucq_sgd import TPUCQSGD
from tpflower.datasets import load_spec

STRATEGIES: dict[str, type[LoJStrategy]] = {
    "tp_join_sgd": TPJoinSGD,
    "tp_join_admm": TPJoinADMM,
    "vfl_sgd": VFLSGD,
    "vfl_admm": VFLADMM,
    "tp_ucq_sgd": TPUCQSGD,
    "tp_ucq_admm": TPUCQADMM,
}


def strategy_name(cfg: DictConfig) -> str:
    """The strategy of algorithm x scenario: algorithm=sgd|admm become tp_ucq_* under scenario=ucq."""
    name, scenario = str(cfg.algorithm.name), str(cfg.scenario.name)
    if scenario == "ucq":
        if not name.startswith("tp_join_"):
            raise ValueError(f"algorithm {name!r} has no union version; scenario=ucq takes algorithm=sgd or admm")
        return name.replace("tp_join_", "tp_ucq_")
    return name


def make_strategy(cfg: DictConfig, run_dir: str | Path | None, base_dir: str | Path | None = None, log=print) -> LoJStrategy:
    name = strategy_name(cfg)
    if name not in STRATEGIES:
        raise ValueError(f"algorithm {name!r} is not a federated algorithm; choose one of {sorted(STRATEGIES)}")
    spec = load_spec(cfg.dataset, base_dir=base_dir)
    return STRATEGIES[name](cfg, spec, run_dir, log=log)


def server_fn_for(cfg: DictConfig | None, run_dir: str | Path | None, base_dir: str | Path | None = None,
                  created: list | None = None) -> Callable[[Context], ServerAppComponents]:
    """A server_fn for a fixed config (run_simulation) or one composed from the run config (flwr run)."""

    # Under `flwr run` on the simulation runtime the ServerApp thread and the ClientApp loader share a process:
    # Flower's loader takes a module already in sys.modules as loaded, so importing simulations.client_app
    # lazily here could hand it a half-initialised module (LoadClientAppError "no attribute 'app'").
    def server_fn(context: Context) -> ServerAppComponents:
        run_cfg = cfg if cfg is not None else config_from_run_config(context.run_config)
        out = run_dir or context.run_config.get("run-dir") or default_run_dir(run_cfg)
        root = base_dir if base_dir is not None else context.run_config.get("base-dir") or None
        strategy = make_strategy(run_cfg, out, root)
        if created is not None:
            created.append(strategy)
        server = PhaseServer(client_manager=SimpleClientManager(), strategy=strategy)
        return ServerAppComponents(strategy=strategy, server=server, config=ServerConfig(num_rounds=1))

    return server_fn


def default_run_dir(cfg: Any) -> str:
    return str(Path("outputs") / "flwr" / f"{cfg.algorithm.name}-{cfg.dataset.name}")


app = ServerApp(server_fn=server_fn_for(None, None))
