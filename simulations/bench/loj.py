"""Every learning-over-join algorithm and the centralized baseline on movielens and nycflights13, and the same
ADMM / SGD epochs under Flower's simulation engine vs called in-process.

    python -m simulations.bench loj [--epochs 3]                   -> bench_results/loj.json
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from simulations.bench.common import WHOLE_TRAINING, fixed_epochs, peak_rss_mb, run_isolated
from tpflower.config import compose_config


def algorithm_case(
    algorithm: str, dataset: str, epochs: int, runtime: str = "inprocess", overrides: tuple = ()
) -> dict[str, Any]:
    """One training run; per-epoch wall time from the run's own history (setup excluded for federated runs)."""
    from simulations.run import run_job  # noqa: PLC0415  torch, flwr: in the case's process only (common.py)

    # the whole training split (no validation part): the rows measured before model selection stay comparable
    cfg = compose_config(
        *fixed_epochs(f"algorithm={algorithm}"),
        f"dataset={dataset}",
        f"epochs={epochs}",
        f"runtime={runtime}",
        WHOLE_TRAINING,
        *overrides,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_job(cfg, Path(tmp))
    total = time.perf_counter() - t0
    h = [r for r in res.history if "kept" not in r.extra]  # the evaluations (not the kept model's record again)
    per_epoch = (h[-1].wall_time_s - h[0].wall_time_s) / (len(h) - 1) if len(h) > 1 else h[-1].wall_time_s
    return {
        "algorithm": res.algorithm,
        "dataset": dataset,
        "runtime": runtime if algorithm != "centralized" else "-",
        "epochs": len(h),
        "epoch_wall_s": round(per_epoch, 3),
        "total_wall_s": round(total, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "test_metric": res.history[-1].test_metric,  # the kept model's (strategies.selection)
        "rounds_per_epoch": (h[-1].rounds - h[0].rounds) / max(len(h) - 1, 1),
        "bytes_per_epoch": (h[-1].bytes_up + h[-1].bytes_down - h[0].bytes_up - h[0].bytes_down) / max(len(h) - 1, 1),
    }


def loj_suite(epochs: int = 3) -> dict[str, Any]:
    """Every LoJ algorithm and the centralized baseline on movielens and nycflights13,
    and the same ADMM / SGD epochs under Flower's simulation engine vs called in-process."""
    runs = []
    for dataset in ("movielens", "nycflights13"):
        for algorithm in ("centralized", "admm", "sgd", "vfl_admm", "vfl_sgd"):
            runs.append(run_algorithm({"algorithm": algorithm, "dataset": dataset, "epochs": epochs}))
            print(json.dumps(runs[-1]), flush=True)
    overhead = []
    for algorithm, dataset, ep in (("admm", "movielens", 6), ("admm", "nycflights13", 6), ("sgd", "movielens", 2)):
        pair = runtime_pair(algorithm, dataset, ep)
        overhead.append(
            {
                "algorithm": pair["flower"]["algorithm"],
                "dataset": dataset,
                "epoch_wall_s_inprocess": pair["inprocess"]["epoch_wall_s"],
                "epoch_wall_s_flower": pair["flower"]["epoch_wall_s"],
                "flower_over_inprocess": round(pair["flower"]["epoch_wall_s"] / pair["inprocess"]["epoch_wall_s"], 2),
                "rounds_per_epoch": pair["flower"]["rounds_per_epoch"],
                "flower_s_per_round": round(
                    (pair["flower"]["epoch_wall_s"] - pair["inprocess"]["epoch_wall_s"])
                    / pair["flower"]["rounds_per_epoch"],
                    4,
                ),
            }
        )
    return {"case": "loj", "epochs": epochs, "runs": runs, "flower_overhead": overhead}


def runtime_pair(algorithm: str, dataset: str, epochs: int) -> dict[str, dict[str, Any]]:
    """The same run in-process and under Flower's simulation engine, one after the other (each case printed)."""
    pair = {}
    for runtime in ("inprocess", "flower"):
        pair[runtime] = run_algorithm(
            {"algorithm": algorithm, "dataset": dataset, "epochs": epochs, "runtime": runtime}
        )
        print(json.dumps(pair[runtime]), flush=True)
    return pair


def run_algorithm(args: dict[str, Any]) -> dict[str, Any]:
    """``algorithm_case(**args)`` in a fresh process (its peak RSS its own)."""
    return run_isolated("simulations.bench.loj", "algorithm_case", args)
