"""L-BFGS over the join and the union against TP-Join-SGD and TP-UCQ-SGD: round trips until the test metric is
within 1% of the centralized model's (the same model trained on the materialized join with the shipped
defaults), side by side.

    python -m simulations.bench lbfgs [--cases nycflights13_delayed/mlp,nycflights13_delayed/mlp/ucq,...]
        [--epochs 3]  -> bench_results/lbfgs.json

Per dataset, model (linear: logistic regression on a binary label; MLP) and scenario (join, or ucq: the union,
nycflights13_delayed's flights and weather in 3 shards each by origin, min_sketch_rows=1000 as in the
convergence suite): the centralized baseline's final test
metric is the target (the materialized join, the same for both scenarios); SGD (TP-Join-SGD or TP-UCQ-SGD,
shipped defaults, evaluated every few rounds) and L-BFGS (shipped defaults, evaluated every iteration) report
the first round whose test metric is within 1% of it (accuracy: >= 0.99 target; RMSE: <= 1.01 target), their
final metric, rounds and bytes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from simulations.bench.common import WHOLE_TRAINING, run_isolated, run_results

#: (dataset, model) cases; nycflights13_delayed has a binary label (linear = logistic regression)
LBFGS_CASES: tuple[tuple[str, ...], ...] = (
    ("nycflights13_delayed", "linear"),
    ("nycflights13_delayed", "mlp"),
    ("nycflights13_delayed", "linear", "ucq"),
    ("nycflights13_delayed", "mlp", "ucq"),
)
SGD_EVAL_EVERY = 5  # rounds between TP-Join-SGD's evaluations (its resolution in rounds)


def lbfgs_case(data: str, model: str, algorithm: str, epochs: int, scenario: str = "join") -> dict[str, Any]:
    """One run in-process with the shipped defaults: its evaluations (epoch, rounds, bytes, metric)."""
    # torch, flwr: imported in the case's own process only, never in the suite's (see common.py)
    from tpflower.config import compose_config  # noqa: PLC0415

    extra = [f"algorithm.eval_every={SGD_EVAL_EVERY}"] if algorithm == "sgd" else []
    if scenario == "ucq":  # the weather shards hold fewer than 2048 wind_gust values: their owners allow 1000
        extra.append("min_sketch_rows=1000")
    cfg = compose_config(
        f"dataset={data}",
        f"model={model}",
        f"algorithm={algorithm}",
        f"epochs={epochs}",
        f"scenario={scenario}",
        WHOLE_TRAINING,
        *extra,
    )
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


def lbfgs_suite(cases: list[tuple[str, ...]], epochs: int = 3, iterations: int = 30) -> dict[str, Any]:
    """Per case (dataset, model[, scenario]): the centralized baseline (once per dataset and model) and SGD for
    ``epochs`` epochs, L-BFGS for ``iterations``."""
    rows: dict[str, Any] = {}
    targets: dict[tuple[str, str], dict[str, Any]] = {}
    for data, model, *rest in cases:
        scenario = rest[0] if rest else "join"
        if (data, model) not in targets:
            targets[(data, model)] = run_isolated(
                "simulations.bench.lbfgs",
                "lbfgs_case",
                {"data": data, "model": model, "algorithm": "centralized", "epochs": epochs},
            )
        runs = {
            alg: run_isolated(
                "simulations.bench.lbfgs",
                "lbfgs_case",
                {
                    "data": data,
                    "model": model,
                    "algorithm": alg,
                    "epochs": iterations if alg == "lbfgs" else epochs,
                    "scenario": scenario,
                },
            )
            for alg in ("sgd", "lbfgs")
        }
        central = targets[(data, model)]
        target = central["history"][-1]["metric"]
        row: dict[str, Any] = {"metric": central["metric_name"], "centralized": target, "scenario": scenario}
        prefix = "tp_join" if scenario == "join" else "tp_ucq"
        for alg in ("sgd", "lbfgs"):
            r, hit = runs[alg], first_within(runs[alg], target)
            row[f"{prefix}_{alg}"] = {
                "rounds_to_1pct": hit and hit["rounds"],
                "bytes_to_1pct": hit and hit["bytes"],
                "metric_at_1pct": hit and hit["metric"],
                "final": r["history"][-1]["metric"],
                "rounds": r["history"][-1]["rounds"],
                "stopped": r["stopped"],
                "wall_s": r["wall_s"],
            }
        name = f"{data}/{model}" + (f"/{scenario}" if scenario != "join" else "")
        rows[name] = row
        print(name, json.dumps(row, default=str), flush=True)
    return {"case": "lbfgs", "epochs_sgd": epochs, "iterations_lbfgs": iterations, "cases": rows}
