"""Deployment round time against Flower's own floor, side by side on one SuperLink and its SuperNodes.

The floor: a no-op app (written to a temporary directory: a ServerApp that sends one empty message per
node per round and waits for the replies, a ClientApp that answers at once) run on the same secure
deployment (TLS + node authentication) right before tpflower's TP-Join-ADMM run; one ADMM epoch is one
round. Used by ``python -m simulations.bench deploy`` (bench_results/deploy.json).
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from simulations import deploy

NOOP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "noop"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "tpflower"

[tool.flwr.app.components]
serverapp = "noop:server"
clientapp = "noop:client"

[tool.flwr.app.config]
rounds = 10
nodes = 1
out = ""
"""

NOOP_APP = '''"""A no-op Flower app: the floor of a deployment round."""
import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    rounds, nodes = int(context.run_config["rounds"]), int(context.run_config["nodes"])
    while len(ids := sorted(grid.get_node_ids())) < nodes:
        time.sleep(0.2)
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        pending = set(grid.push_messages([Message(RecordDict({"c": ConfigRecord({"r": r})}), n, "train") for n in ids]))
        while pending:  # pulled as tpflower's GridTransport does (millisecond polling)
            for reply in grid.pull_messages(list(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
            time.sleep(0.005)
        times.append(time.perf_counter() - start)
    Path(str(context.run_config["out"])).write_text(json.dumps(times))


@client.train()
def train(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"c": ConfigRecord({"ok": 1})}), reply_to=msg)
'''


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    done = subprocess.run(cmd, env=env, cwd=deploy.APP_DIR, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {(done.stdout + done.stderr)[-2000:]}")


def deploy_case(name: str, overrides: str, epochs: int = 6, rounds: int = 6, timeout: float = 3600.0) -> dict[str, Any]:
    """Floor round and TP-Join-ADMM epoch (medians, epochs 2..) on one deployment of ``overrides``' tables."""
    with tempfile.TemporaryDirectory(prefix="tpflower-bench-") as tmp:
        root = Path(tmp)
        noop = root / "noop"
        noop.mkdir()
        (noop / "pyproject.toml").write_text(NOOP_PYPROJECT)
        (noop / "noop.py").write_text(NOOP_APP)
        dep = deploy.start(overrides, state_dir=root / "deploy", home=root / "home", cwd=root)
        try:
            nodes = len(dep.processes) - 1
            floor_out = root / "floor.json"
            _run(
                [
                    "flwr",
                    "run",
                    str(noop),
                    dep.connection,
                    "--stream",
                    "--run-config",
                    f'rounds={rounds + 1} nodes={nodes} out="{floor_out}"',
                ],
                dep.env(),
                timeout,
            )
            floor = json.loads(floor_out.read_text())[1:]  # the first round starts the nodes' app processes
            run_dir = root / "run"
            _run(deploy.flwr_run_command(dep.connection, f"{overrides} epochs={epochs}", run_dir), dep.env(), timeout)
            history = json.loads((run_dir / "results.json").read_text())["history"]
            walls = [h["wall_time_s"] for h in history]
            epoch_s = [b - a for a, b in itertools.pairwise(walls)]
        finally:
            deploy.stop(dep)
    floor_s, admm_s = statistics.median(floor), statistics.median(epoch_s)
    return {
        "case": name,
        "overrides": overrides,
        "nodes": nodes,
        "floor_round_s": floor,
        "admm_epoch_s": epoch_s,
        "median_floor_s": floor_s,
        "median_admm_epoch_s": admm_s,
        "above_floor_s": admm_s - floor_s,
    }


DEPLOY_CASES = {
    "movielens": "algorithm=admm dataset=movielens",
    "star_2m": "algorithm=admm dataset=synthetic dataset.loader.schema=star dataset.loader.n_fact=2000000",
}


def deploy_suite(cases: list[str], epochs: int) -> dict[str, Any]:
    return {"case": "deploy", "runs": [deploy_case(c, DEPLOY_CASES[c], epochs=epochs) for c in cases]}
