"""L-BFGS over the join against TP-Join-SGD: round trips until the test metric is within 1% of the centralized
model's (the same model trained on the materialized join with the shipped defaults), side by side.

    python -m simulations.bench lbfgs [--cases nycflights13_delayed/mlp,...] [--epochs 3]  -> bench_results/lbfgs.json

Per dataset and model (linear: logistic regression on a binary label; MLP): the centralized baseline's final
test metric is the target; TP-Join-SGD (shipped defaults, evaluated every few rounds) and L-BFGS (shipped
defaults, evaluated every iteration) report the first round whose test metric is within 1% of it (accuracy:
>= 0.99 target; RMSE: <= 1.01 target), their final metric, rounds and bytes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from simulations.bench.common import run_isolated, run_results

#: (dataset, model) cases; nycflights13_delayed has a binary label (linear = logistic regression)
LBFGS_CASES: tuple[tuple[str, str], ...] = (
    ("nycflights13_delayed", "linear"),
    ("nycflights13_delayed", "mlp"),
)
SGD_EVAL_EVERY = 5  # rounds between TP-Join-SGD's evaluations (its resolution in rounds)


def lbfgs_case(data: str, model: str, algorithm: str, epochs: int) -> dict[str, Any]:
    """One run in-process with the shipped defaults: its evaluations (epoch, rounds, bytes, metric)."""
    # torch, flwr: imported in the case's own process only, never in the suite's (see common.py)
    from tpflower.config import compose_config  # noqa: PLC0415

    extra = [f"algorithm.eval_every={SGD_EVAL_EVERY}"] if algorithm == "sgd" else []
    cfg = compose_config(f"dataset={data}", f"model={model}", f"algorithm={algorithm}", f"epochs={epochs}", *extra)
    t0 = time.perf_counter()
    results = run_results(cfg)
    return {
        "metric_name": results.metric,
        "history": [
            {"epoch": h.epoch, "rounds": h.rounds, "bytes": h.bytes_up + h.bytes_down, "metric": h.test_metric}
            for h in results.history
        ],
        "stopped": results.stopped,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def within(metric: str, value: float, target: float, rel: float = 0.01) -> bool:
    return value >= (1 - rel) * target if metric == "accuracy" else value <= (1 + rel) * target


def first_within(run: dict[str, Any], target: float) -> dict[str, Any] | None:
    """The first evaluation within 1% of ``target`` (its rounds, bytes, metric); None if none is."""
    return next((h for h in run["history"] if within(run["metric_name"], h["metric"], target)), None)


def lbfgs_suite(cases: list[tuple[str, str]], epochs: int = 3, iterations: int = 30) -> dict[str, Any]:
    """Per case: the centralized baseline and TP-Join-SGD for ``epochs`` epochs, L-BFGS for ``iterations``."""
    rows: dict[str, Any] = {}
    for data, model in cases:
        runs = {
            alg: run_isolated(
                "simulations.bench.lbfgs",
                "lbfgs_case",
                {"data": data, "model": model, "algorithm": alg, "epochs": iterations if alg == "lbfgs" else epochs},
            )
            for alg in ("centralized", "sgd", "lbfgs")
        }
        target = runs["centralized"]["history"][-1]["metric"]
        row: dict[str, Any] = {"metric": runs["centralized"]["metric_name"], "centralized": target}
        for alg, name in (("sgd", "tp_join_sgd"), ("lbfgs", "tp_join_lbfgs")):
            r, hit = runs[alg], first_within(runs[alg], target)
            row[name] = {
                "rounds_to_1pct": hit and hit["rounds"],
                "bytes_to_1pct": hit and hit["bytes"],
                "metric_at_1pct": hit and hit["metric"],
                "final": r["history"][-1]["metric"],
                "rounds": r["history"][-1]["rounds"],
                "stopped": r["stopped"],
                "wall_s": r["wall_s"],
            }
        rows[f"{data}/{model}"] = row
        print(f"{data}/{model}", json.dumps(row, default=str), flush=True)
    return {"case": "lbfgs", "epochs_sgd": epochs, "iterations_lbfgs": iterations, "cases": rows}
