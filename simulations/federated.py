"""Run a federated algorithm: under Flower's simulation engine, or in-process without Flower's transport.

Both run the same strategy, the same ClientApp and the same records; the in-process runner exists to measure
the framework's overhead (simulations/bench.py) and for fast tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, RecordDict
from omegaconf import DictConfig

from strategies.base import LoJStrategy
from strategies.transport import ClientKey, DirectTransport
from tpflower.app.client_app import client_app_for, make_client, node_identity
from tpflower.app.flower_patch import install_fast_fetch, install_node_actors
from tpflower.app.server_app import make_strategy, server_app_for
from tpflower.losses import metrics
from tpflower.params import nonnegative_finite, or_word, positive_finite, positive_int
from tpflower.results import RunResults

FLOWER_LOG = "flower.log"  # Flower's and Ray's own log lines go here (in the run dir), not to the console

#: Ray carries a task's arguments up to this size inside the task (``max_direct_call_object_size``, Ray's default
#: 100 KiB) instead of through its object store. Flower's messages are pickled bytes, so the store saves no copy:
#: an actor call with a 0.5 MB message took 1.9 ms inline against 3.4 ms through the store, and from about 1 MB
#: the store is the faster (docs/results.md, Flower's simulation engine).
RAY_INLINE_BYTES = 1 << 20
RAY_INLINE_ENV = "RAY_max_direct_call_object_size"  # Ray reads its settings from RAY_<name> when it starts


@contextlib.contextmanager
def flower_logs_to(path: Path) -> Iterator[None]:
    """Send the `flwr` logger (deprecation notices, DEBUG lines, engine errors) to ``path`` only."""
    logger = logging.getLogger("flwr")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        handler.close()
        logger.handlers, logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])


def run_flower_simulation(
    cfg: DictConfig,
    run_dir: str | Path | None,
    base_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    strategy: LoJStrategy | None = None,
    largest_table: int | None = None,
) -> RunResults:
    """One virtual SuperNode per table shard, client resources from conf/resources; Flower's log to flower.log.
    ``strategy``: the strategy built for ``cfg`` already (else built here), run by the ServerApp.
    ``largest_table``: the row count of the largest table, when known (:func:`simulation_actors`)."""
    # Flower 1.41 deprecates run_simulation in favour of `flwr run` (a CLI that starts a SuperLink process and
    # reads the app's pyproject), but it is the only in-Python way to start the simulation engine with a
    # config composed by Hydra: kept here, in this one function, with its notice sent to flower.log.
    t0 = time.perf_counter()
    log("engine: starting Flower's simulation engine (Ray)")
    from flwr.simulation import run_simulation  # noqa: PLC0415  Ray: only when the engine runs

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's future default, no warning per run
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault(RAY_INLINE_ENV, str(RAY_INLINE_BYTES))
    install_fast_fetch()
    node_actors = install_node_actors()
    resources = client_resources(cfg)
    actors = simulation_actors(cfg, largest_table, node_actors)
    if actors is None and resources["num_cpus"] > (os.cpu_count() or 1):  # Ray's CPUs: no actor would fit
        raise ValueError(too_many_cpus(cfg))
    created: list[LoJStrategy] = []
    if strategy is None:
        strategy = make_strategy(cfg, run_dir, base_dir, log=log)
    num = len(strategy.clients)
    init_args: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
    if actors is not None:  # Ray's logical CPUs: the pool has CPUs / num_cpus actors
        init_args["num_cpus"] = actors * max(float(cfg.resources.num_cpus), 1.0)
    log_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="tpflower-"))
    strategy.engine_t0 = t0  # the strategy says when the engine is up and the nodes are in
    with flower_logs_to(log_dir / FLOWER_LOG):
        run_simulation(
            server_app=server_app_for(cfg, run_dir, base_dir, created, log=log, strategy=strategy),
            client_app=client_app_for(cfg, base_dir, run_dir),
            num_supernodes=num,
            backend_config={
                "client_resources": resources,
                "init_args": init_args,
            },
        )
    if not created or created[0].results is None or not created[0].finished:
        raise RuntimeError(f"the Flower simulation ended before the algorithm finished; see {log_dir / FLOWER_LOG}")
    return created[0].results


#: resources.actors=auto: a table of at least this many rows gets the simulation one Ray actor
ONE_ACTOR_ROWS = 5_000_000


def simulation_actors(cfg: DictConfig, largest_table: int | None, node_actors: bool = False) -> int | None:
    """How many Ray actors run the virtual nodes (None: Flower's default, the CPUs / resources.num_cpus).

    Every actor process that serves a node loads and keeps that node's table (tpflower.app.client_app's
    caches). With ``node_actors`` (tpflower.app.flower_patch.install_node_actors) each node runs on one actor,
    so every table is held once; without, Flower hands a node's messages to whichever actor is idle and with two
    actors a large table is held twice. ``resources.actors``: a number caps the actors; ``auto`` (default)
    means Flower's default, or one actor when nodes move between actors and the largest table has at least
    ONE_ACTOR_ROWS rows."""
    setting = (cfg.get("resources") or {}).get("actors", "auto")
    if setting is None or str(setting) == "auto":
        large = largest_table is not None and largest_table >= ONE_ACTOR_ROWS
        return 1 if large and not node_actors else None
    return or_word(positive_int, "auto")("resources.actors", setting)


def check_engine_settings(cfg: DictConfig) -> None:
    """The simulation engine's settings (conf/resources) checked before any table is loaded, as the others
    are: each virtual client's share, the actors' number, and a share above the machine's CPUs whenever the
    tables' rows cannot change the actors (``resources.actors=auto`` with each node on its own actor, the
    node-actors adapter: only without it does a table of ONE_ACTOR_ROWS rows make one actor, checked in
    :func:`run_flower_simulation` once the rows are known)."""
    resources = client_resources(cfg)
    if simulation_actors(cfg, None) is None and resources["num_cpus"] > (os.cpu_count() or 1):
        from tpflower.app.flower_guard import enabled  # noqa: PLC0415  Flower's code: only for this case

        if enabled("node-actors", notice=False):
            raise ValueError(too_many_cpus(cfg))


def too_many_cpus(cfg: DictConfig) -> str:
    """Why a virtual client's ``resources.num_cpus`` above the machine's CPUs is refused."""
    return (
        f"resources.num_cpus={cfg.resources.num_cpus} is more than this machine's {os.cpu_count()} CPUs: no "
        "Ray actor would fit (Flower stops with 'ActorPool is empty'); give each virtual client fewer, or set "
        "resources.actors"
    )


def client_resources(cfg: DictConfig) -> dict[str, float]:
    """Each virtual client's share (conf/resources), checked before Ray starts: a bad value is one line naming
    it, and a GPU share where torch sees no GPU too (no Ray actor would get one: 'ActorPool is empty')."""
    res = cfg.get("resources") or {}
    out = {
        "num_cpus": positive_finite("resources.num_cpus", res.get("num_cpus", 1)),
        "num_gpus": nonnegative_finite("resources.num_gpus", res.get("num_gpus", 0)),
    }
    if out["num_gpus"] > 0 and not torch.cuda.is_available():
        raise ValueError(
            f"resources.num_gpus={res.get('num_gpus')} but no GPU is visible here: no Ray actor would get one "
            "(Flower stops with 'ActorPool is empty'); set resources.num_gpus=0"
        )
    return out


@dataclass
class InProcessRun:
    strategy: LoJStrategy
    contexts: dict[ClientKey, Context]  # each client's Flower context; its state holds the final theta
    base_dir: str | Path | None = None
    run_dir: str | Path | None = None

    def theta(self, key: ClientKey) -> dict[str, np.ndarray]:
        """The final local model parameters of one client."""
        return {k: v.numpy() for k, v in self.contexts[key].state["theta"].to_torch_state_dict().items()}

    def exact_test_metrics(self) -> dict[str, float]:
        """The last evaluation's test predictions scored against the true test labels, by the harness, which
        holds every table (one user plays every party). Under label DP the server only ever receives DP
        releases of these metrics (tpflower.label_dp); the release noise never reaches training, so this is
        the trained model's own quality, the number a run without the owner's evaluation bound would show."""
        record, setup = self.strategy.record, self.strategy.record.setup
        H = record.test_predictions
        if H is None:
            raise RuntimeError("the run made no evaluation: no test predictions to score")
        if setup.y_test is not None:  # no label DP: the server's own metrics are exact already
            return metrics(record.task, H, setup.y_test)
        state_dir = None if self.run_dir is None else str(Path(self.run_dir).resolve() / "node-state")
        order, labels = [], []
        for key, (idx, pos) in setup.evaluation_split.items():
            data = make_client(self.strategy.cfg, self.contexts[key], self.base_dir, state_dir=state_dir).data
            order.append(np.asarray(idx))
            labels.append(np.asarray(data.y)[np.asarray(pos)])
        idx = np.concatenate(order)
        return metrics(record.task, np.asarray(H)[idx], np.concatenate(labels))


def in_process_contexts(strategy: LoJStrategy, base_dir: str | Path | None = None) -> dict[ClientKey, Context]:
    """One Flower Context per client key, with the node config the simulation engine gives it (partition-id),
    keyed by the table and shard the client takes for that partition."""
    contexts = {}
    for pid in range(len(strategy.clients)):
        config = {"partition-id": pid}
        contexts[node_identity(strategy.cfg, config, base_dir)] = Context(
            run_id=0, node_id=pid + 1, node_config=config, state=RecordDict(), run_config={}
        )
    return contexts


def run_in_process(
    cfg: DictConfig,
    run_dir: str | Path | None,
    base_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    strategy: LoJStrategy | None = None,
) -> InProcessRun:
    """The same strategy and ClientApp, called directly (no Flower transport, no Ray); ``strategy``: the
    strategy built for ``cfg`` already (else built here)."""
    if strategy is None:
        strategy = make_strategy(cfg, run_dir, base_dir, log=log)
    contexts = in_process_contexts(strategy, base_dir)
    app = client_app_for(cfg, base_dir, run_dir)
    strategy.run(DirectTransport(app, {c.node_id: c for c in contexts.values()}))
    return InProcessRun(strategy, contexts, base_dir, run_dir)
