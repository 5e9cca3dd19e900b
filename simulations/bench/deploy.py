"""Deployed round time on the owner's node service, side by side with Flower's simulation engine.

On one secure deployment (``simulations.deploy start``: TLS + node authentication, one node service per
table): the empty phase (the hello query to every node: no table work) timed round by round, then a
TP-Join-SGD and a TP-Join-ADMM run whose epochs are timed from their history (epochs 2..); the same runs
under the simulation engine in the same invocation. The empty-phase app is tpflower's identity (the node
service refuses any other app) with a timing ServerApp; every node answers it with its installed tpflower.
Used by ``python -m simulations.bench deploy`` (bench_results/deploy.json).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from simulations import deploy
from simulations.bench.loj import run_algorithm

EMPTY_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tpflower"
version = "{version}"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "tpflower"

[tool.flwr.app.components]
serverapp = "empty_rounds:server"
clientapp = "empty_rounds:client"

[tool.flwr.app.config]
overrides = "algorithm=admm"
run-dir = ""
base-dir = ""
rounds = 10
nodes = 1
out = ""
state-dir = ""
"""

EMPTY_APP = '''"""The empty phase, timed: rounds of tpflower's hello query to every node (the nodes answer with their own
installed tpflower; this file's ClientApp is never run by a node service)."""
import json
import os
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from strategies.transport import GridTransport
from tpflower.app.flower_patch import install_fast_grid_pulls
from tpflower.records import HELLO_PHASE, error_reason, pack_payload

install_fast_grid_pulls()  # as tpflower's own ServerApp does
server = ServerApp()
client = ClientApp()
ROLES = {"tpflower.app.superlink": "superlink", "simulations.node": "node services", "tpflower.app.supernode": "supernodes"}


def cpu_by_role(state_dir: str) -> dict[str, float]:
    """CPU seconds so far of this deployment's processes (their command lines name its state dir) by role,
    and this ServerApp's."""
    tick, out = os.sysconf("SC_CLK_TCK"), {"serverapp": sum(os.times()[:2])}
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        role = next((r for m, r in ROLES.items() if m in argv), None)
        if role and any(state_dir in a for a in argv):
            out[role] = out.get(role, 0.0) + (int(stat[11]) + int(stat[12])) / tick
    return out


@server.main()
def main(grid: Grid, context: Context) -> None:
    rounds, nodes = int(context.run_config["rounds"]), int(context.run_config["nodes"])
    while len(ids := sorted(grid.get_node_ids())) < nodes:
        time.sleep(0.2)
    transport, times = GridTransport(grid), []
    cpu = {}
    for r in range(rounds):
        if r == 1:  # rounds 2..: the first loads each node's config and table
            cpu = cpu_by_role(str(context.run_config["state-dir"]))  # each round as strategies.base sends it: the hello query, tpflower's own transport
        start = time.perf_counter()
        hello = [Message(pack_payload({}, {"phase": HELLO_PHASE}), n, "query") for n in ids]
        for reply in transport.exchange(hello):
            if reply.has_error():
                raise RuntimeError(error_reason(reply))
        times.append(time.perf_counter() - start)
    after = cpu_by_role(str(context.run_config["state-dir"]))
    cpu = {role: (after[role] - cpu.get(role, 0.0)) / (rounds - 1) for role in after}
    Path(str(context.run_config["out"])).write_text(json.dumps({"times": times, "cpu_s_per_round": cpu}))
'''


def wait_for_warm_up(dep: deploy.Deployment, timeout: float = 300.0) -> None:
    """Until every node service has logged the end of its torch warm-up (simulations.node.WARMED), so that
    the measured rounds do not share the CPUs with it."""
    from simulations.node import WARMED  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    logs = [Path(p["log"]) for p in dep.processes if p["name"] != "superlink"]
    while not all(log.exists() and WARMED in log.read_text(errors="replace") for log in logs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the node services did not finish their warm-up within {timeout:.0f} s")
        time.sleep(0.5)


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    done = subprocess.run(cmd, env=env, cwd=deploy.APP_DIR, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {(done.stdout + done.stderr)[-2000:]}")


GOALS = {"empty_round_s": 0.3, "tp_join_sgd": 3.0, "tp_join_admm": 2.0}  # deployed / simulation engine
# mini-batches of 8192 rows (28 rounds per movielens epoch instead of 221 at the default 1024): the same
# per-round overhead, measured in minutes rather than a quarter of an hour per deployed epoch
# (algorithm.min_steps=0: the epochs named, not more for the few batches of 8192: common.fixed_epochs)
EXTRA = {"sgd": ("algorithm.batch_size=8192", "algorithm.min_steps=0"), "admm": ()}


def _epochs(history: list[dict[str, Any]]) -> list[float]:
    walls = [h["wall_time_s"] for h in history]
    return [b - a for a, b in itertools.pairwise(walls)]


def deploy_case(
    name: str, dataset: str, admm_epochs: int = 6, sgd_epochs: int = 3, rounds: int = 20, timeout: float = 3600.0
) -> dict[str, Any]:
    """Empty-phase rounds, TP-Join-SGD and TP-Join-ADMM epochs (medians, epochs 2..) on one deployment of
    ``dataset``'s tables, and the same epochs under the simulation engine."""
    overrides = f"algorithm=sgd dataset={dataset}"
    load = os.getloadavg()[0]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tpflower-bench-") as tmp:
        root = Path(tmp)
        app = root / "empty"
        app.mkdir()
        (app / "pyproject.toml").write_text(EMPTY_PYPROJECT.format(version=version("tpflower")))
        (app / "empty_rounds.py").write_text(EMPTY_APP)
        dep = deploy.start(overrides, state_dir=root / "deploy", home=root / "home", cwd=root)
        try:
            wait_for_warm_up(dep)
            nodes = len(dep.processes) - 1
            out = root / "empty.json"
            config = (
                f"overrides={json.dumps(overrides)} rounds={rounds + 1} nodes={nodes} out={json.dumps(str(out))} "
                f"state-dir={json.dumps(str(root / 'deploy'))}"
            )
            _run(["flwr", "run", str(app), dep.connection, "--stream", "--run-config", config], dep.env(), timeout)
            measured = json.loads(out.read_text())
            empty = measured["times"][1:]  # the first round loads each node's config and table
            for algorithm, epochs in (("sgd", sgd_epochs), ("admm", admm_epochs)):
                run_dir = root / f"run-{algorithm}"
                job = " ".join([f"algorithm={algorithm} dataset={dataset} epochs={epochs}", *EXTRA[algorithm]])
                _run(deploy.flwr_run_command(dep.connection, job, run_dir), dep.env(), timeout)
                result = json.loads((run_dir / "results.json").read_text())
                runs[result["algorithm"]] = {"job": job, "deployed_epoch_s": _epochs(result["history"])}
        finally:
            deploy.stop(dep)
    for algorithm, epochs in (("sgd", sgd_epochs), ("admm", admm_epochs)):
        sim = run_algorithm(
            {
                "algorithm": algorithm,
                "dataset": dataset,
                "epochs": epochs,
                "runtime": "flower",
                "overrides": EXTRA[algorithm],
            }
        )
        row = runs[sim["algorithm"]]
        row["simulation_epoch_s"] = sim["epoch_wall_s"]
        row["rounds_per_epoch"] = sim["rounds_per_epoch"]
        row["median_deployed_epoch_s"] = statistics.median(row["deployed_epoch_s"])
        row["deployed_over_simulation"] = round(row["median_deployed_epoch_s"] / sim["epoch_wall_s"], 2)
        row["goal"] = GOALS[sim["algorithm"]]
    return {
        "case": name,
        "dataset": dataset,
        "nodes": nodes,
        "empty_round_s": empty,
        "median_empty_round_s": statistics.median(empty),
        "empty_round_cpu_s": {k: round(v, 4) for k, v in measured["cpu_s_per_round"].items()},
        "load_avg_1min": load,
        "empty_round_goal_s": GOALS["empty_round_s"],
        "algorithms": runs,
    }


DEPLOY_CASES = {"movielens": "movielens"}


def deploy_suite(cases: list[str], epochs: int) -> dict[str, Any]:
    return {"case": "deploy", "runs": [deploy_case(c, DEPLOY_CASES[c], admm_epochs=epochs) for c in cases]}
