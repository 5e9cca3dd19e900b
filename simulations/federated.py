"""Run a federated algorithm: under Flower's simulation engine, or in-process without Flower's transport.

Both run the same strategy and client code; the in-process runner exists to measure the framework's
overhead (simulations/bench.py) and for fast tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flwr.common import Context, RecordDict
from flwr.simulation import run_simulation
from flwr.client import ClientApp
from flwr.server import ServerApp
from omegaconf import DictConfig

from simulations.client_app import client_fn_for, make_client
from simulations.server_app import make_strategy, server_fn_for
from strategies.loj import LoJStrategy
from strategies.phase import ClientKey, run_direct
from tpflower.datasets import load_spec
from tpflower.results import RunResults


def run_flower_simulation(cfg: DictConfig, run_dir: str | Path, base_dir: str | Path | None = None) -> RunResults:
    """One virtual SuperNode per table; client resources from conf/resources."""
    # Ray's future default (leave CUDA_VISIBLE_DEVICES alone when num_gpus=0) and no warning about it per run
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    created: list[LoJStrategy] = []
    server_app = ServerApp(server_fn=server_fn_for(cfg, run_dir, base_dir, created))
    client_app = ClientApp(client_fn=client_fn_for(cfg, base_dir))
    resources = {"num_cpus": float(cfg.resources.num_cpus), "num_gpus": float(cfg.resources.num_gpus)}
    num = len(load_spec(cfg.dataset, base_dir=base_dir).clients(str(cfg.scenario.name)))
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num,
        backend_config={"client_resources": resources, "init_args": {"logging_level": 30, "log_to_driver": True}},
    )
    if not created or created[0].results is None or not created[0].finished:
        raise RuntimeError("the Flower simulation ended before the algorithm finished; see the log above")
    return created[0].results


@dataclass
class InProcessRun:
    strategy: LoJStrategy
    contexts: dict[ClientKey, Context]  # each client's Flower context; its state holds the final theta

    def theta(self, key: ClientKey) -> dict[str, np.ndarray]:
        """The final local model parameters of one client."""
        return {k: v.numpy() for k, v in self.contexts[key].state["theta"].to_torch_state_dict().items()}


def run_in_process(cfg: DictConfig, run_dir: str | Path | None, base_dir: str | Path | None = None, log=print) -> InProcessRun:
    """The same strategy and clients, called directly (no Flower transport, no Ray)."""
    strategy = make_strategy(cfg, run_dir, base_dir, log=log)
    contexts = {}
    for pid, key in enumerate(strategy.clients):
        contexts[key] = Context(run_id=0, node_id=pid + 1, node_config={"table": key[0], "shard": key[1]},
                                state=RecordDict(), run_config={})
    run_direct(strategy, {k: (lambda c=c: make_client(cfg, c, base_dir)) for k, c in contexts.items()})
    return InProcessRun(strategy, contexts)
