"""`make run`'s start, stage by stage: seconds from the command to each start-up line (what runs, the data
checked, Flower's engine, the nodes, the keys, the table mapping, the first epoch), under Flower's simulation
engine and with ``runtime=inprocess``, interleaved; and the floor under it: a fresh process importing torch,
importing Flower's simulation engine, and starting Ray.

    python -m simulations.bench startup [--reps 3]                 -> bench_results/startup.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

#: (stage, the start of its line), in the order a run prints them (simulations.run, simulations.job,
#: simulations.federated, strategies.base, strategies.setup)
STAGES: tuple[tuple[str, str], ...] = (
    ("first line", "tpflower train:"),
    ("algorithm chosen", "algorithm=auto:"),
    ("data checked", "data:"),
    ("engine starting", "engine: starting"),
    ("ServerApp up", "engine: ServerApp up"),
    ("nodes connected", "nodes:"),
    ("keys asked", "keys:"),
    ("table mapping built", "["),
    ("first epoch line", "epoch "),
)

#: the floor: what any run on this machine waits for before its first epoch, each in a fresh process
FLOOR: dict[str, str] = {
    "python": "pass",
    "import torch": "import torch",
    "import flwr.simulation (Ray)": "import flwr.simulation",
    "import ray + ray.init()": "import ray; ray.init(num_cpus=2, include_dashboard=False, logging_level=40); "
    "ray.shutdown()",
}


def timed_run(overrides: tuple[str, ...]) -> dict[str, float]:
    """Seconds from the command to the first line of each stage of ``python -m simulations.run OVERRIDES``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "simulations.run", *overrides, f"hydra.run.dir={tmp}"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        seen: dict[str, float] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            for stage, start in STAGES:
                if stage not in seen and line.startswith(start):
                    seen[stage] = round(time.perf_counter() - t0, 2)
                    break
        proc.wait()
        seen["end"] = round(time.perf_counter() - t0, 2)
    if proc.returncode != 0 or "first epoch line" not in seen:
        raise RuntimeError(f"{cmd} failed: {proc.stderr.read() if proc.stderr else ''}")
    return seen


def floor_case(code: str) -> float:
    """Wall seconds of ``python -c CODE`` in a fresh process."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return round(time.perf_counter() - t0, 2)


def startup_suite(reps: int = 3) -> dict[str, Any]:
    """``reps`` interleaved repeats of `make run` (Flower) and the same with runtime=inprocess, and the floor."""
    runs: list[dict[str, Any]] = []
    floor: dict[str, list[float]] = {name: [] for name in FLOOR}
    for rep in range(reps):
        for runtime in ("flower", "inprocess"):
            overrides = () if runtime == "flower" else ("runtime=inprocess",)
            load = os.getloadavg()[0]
            runs.append({"runtime": runtime, "rep": rep, "load_1min": round(load, 2), "stages": timed_run(overrides)})
            print(runs[-1], file=sys.stderr, flush=True)
        for name, code in FLOOR.items():
            floor[name].append(floor_case(code))
    return {
        "case": "startup",
        "command": "make run (python -m simulations.run), and with runtime=inprocess",
        "stages": [s for s, _ in STAGES],
        "runs": runs,
        "floor": floor,
    }
