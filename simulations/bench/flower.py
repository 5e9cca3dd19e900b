"""Flower's overhead: its simulation engine vs in-process per epoch (TP-Join-SGD, TP-Join-ADMM on movielens and
nycflights13), the cost of an empty round, and `make run`'s time to its first epoch line.

    python -m simulations.bench flower                             -> bench_results/flower.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from simulations.bench.common import run_isolated
from simulations.bench.loj import runtime_pair
from tpflower.config import compose_config
from tpflower.results import PROGRESS_PREFIXES


def empty_rounds_case(rounds: int = 200, dataset: str = "movielens") -> dict[str, Any]:
    """The cost of the transport alone: ``rounds`` rounds of the hello query (no table work) to every node,
    under Flower's simulation engine (with tpflower's fetch adapter) and in-process."""
    # torch, flwr, ray: imported in the case's own process only, never in the suite's (see common.py)
    from flwr.app import Message  # noqa: PLC0415
    from flwr.serverapp import Grid, ServerApp  # noqa: PLC0415
    from flwr.simulation import run_simulation  # noqa: PLC0415

    from simulations.federated import flower_logs_to, in_process_contexts  # noqa: PLC0415
    from strategies.base import TablePuppetStrategy  # noqa: PLC0415
    from strategies.transport import DirectTransport  # noqa: PLC0415
    from tpflower.app.client_app import client_app_for  # noqa: PLC0415
    from tpflower.app.flower_patch import install_fast_fetch  # noqa: PLC0415
    from tpflower.app.server_app import make_strategy  # noqa: PLC0415
    from tpflower.records import HELLO_PHASE, pack_payload  # noqa: PLC0415

    cfg = compose_config(f"dataset={dataset}")
    built = make_strategy(cfg, None, log=lambda _: None)  # its clients and config name the nodes
    clients = built.clients
    timing: dict[str, float] = {}

    class EmptyRounds(TablePuppetStrategy):
        def protocol(self) -> None:
            assert self.transport is not None
            t0 = time.perf_counter()
            for _ in range(rounds):
                self.transport.exchange(
                    [Message(pack_payload({}, {"phase": HELLO_PHASE}), node, "query") for node in self.keys]
                )
            timing[self.runtime] = (time.perf_counter() - t0) / rounds

    inproc = EmptyRounds(clients, log=lambda _: None)
    inproc.runtime = "inprocess"
    contexts = in_process_contexts(built)
    inproc.run(DirectTransport(client_app_for(cfg), {c.node_id: c for c in contexts.values()}))

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:
        strategy = EmptyRounds(clients, log=lambda _: None)
        strategy.runtime = "flower"
        strategy.start(grid)

    install_fast_fetch()
    with tempfile.TemporaryDirectory() as tmp, flower_logs_to(Path(tmp) / "flower.log"):
        run_simulation(
            server_app=app,
            client_app=client_app_for(cfg),
            num_supernodes=len(clients),
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"logging_level": 40, "log_to_driver": False},
            },
        )
    return {
        "case": "empty_rounds",
        "dataset": dataset,
        "nodes": len(clients),
        "rounds": rounds,
        "s_per_round_flower": round(timing["flower"], 5),
        "s_per_round_inprocess": round(timing["inprocess"], 5),
    }


def first_epoch_case(overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """`make run` as a user sees it: seconds from process start to the first epoch line and to the end."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "simulations.run", *overrides, f"hydra.run.dir={tmp}"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        first = None
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if first is None and line.startswith(PROGRESS_PREFIXES):
                first = time.perf_counter() - t0
        proc.wait()
        total = time.perf_counter() - t0
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{cmd} failed: {proc.stderr.read() if proc.stderr else ''}")
    return {
        "case": "first_epoch",
        "command": "python -m simulations.run " + " ".join(overrides),
        "first_epoch_line_s": round(first, 2),
        "total_s": round(total, 2),
        "lines": len(lines),
    }


def flower_suite() -> dict[str, Any]:
    """Flower's simulation engine vs in-process per epoch (TP-Join-SGD, TP-Join-ADMM on
    movielens and nycflights13), the cost of an empty round, and `make run`'s time to its first epoch line."""
    pairs = []
    for algorithm, dataset, ep in (
        ("sgd", "movielens", 2),
        ("sgd", "nycflights13", 2),
        ("admm", "movielens", 6),
        ("admm", "nycflights13", 6),
    ):
        pair = runtime_pair(algorithm, dataset, ep)
        pairs.append(
            {
                "algorithm": pair["flower"]["algorithm"],
                "dataset": dataset,
                "rounds_per_epoch": pair["flower"]["rounds_per_epoch"],
                "epoch_wall_s_inprocess": pair["inprocess"]["epoch_wall_s"],
                "epoch_wall_s_flower": pair["flower"]["epoch_wall_s"],
                "flower_over_inprocess": round(pair["flower"]["epoch_wall_s"] / pair["inprocess"]["epoch_wall_s"], 2),
                "same_test_metric": abs(pair["flower"]["test_metric"] - pair["inprocess"]["test_metric"]) < 1e-6,
            }
        )
    empty = run_isolated("simulations.bench.flower", "empty_rounds_case", {})
    print(json.dumps(empty), flush=True)
    first = run_isolated("simulations.bench.flower", "first_epoch_case", {})
    print(json.dumps(first), flush=True)
    return {"case": "flower", "per_epoch": pairs, "empty_rounds": empty, "first_epoch": first}
