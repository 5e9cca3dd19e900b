"""Convergence of the shipped defaults: TP-Join-ADMM (linear) against the exact ridge solution and TP-UCQ-ADMM
against TP-Join-ADMM; with --mlp also MLP vs linear for every algorithm.

    python -m simulations.bench convergence [--epochs 10] [--mlp]  -> bench_results/convergence.json
"""

from __future__ import annotations

import json
import time
from typing import Any

from simulations.bench.common import run_isolated
from tpflower.config import compose_config

#: the datasets of the convergence table (overrides); synthetic labels in three units
CONVERGENCE_DATA: dict[str, tuple[str, ...]] = {
    "movielens": ("dataset=movielens",),
    # the weather shards hold fewer than 2048 wind_gust values: their owners lower min_sketch_rows for the union
    "nycflights13": ("dataset=nycflights13", "min_sketch_rows=1000"),
    **{
        f"synthetic_{schema}_x{scale}": (
            "dataset=synthetic",
            f"dataset.loader.schema={schema}",
            f"+dataset.loader.label_scale={scale}",
        )
        for schema in ("star", "chain", "snowflake")
        for scale in (1, 100, 10000)
    },
}


def convergence_case(data: str, overrides: list[str], epochs: int) -> dict[str, Any]:
    """Shipped defaults: the test metric per epoch of one run (in-process), and where and why it stopped."""
    # torch, flwr: imported in the case's own process only, never in the suite's (see common.py)
    from simulations.federated import run_in_process  # noqa: PLC0415
    from strategies.centralized import train_centralized  # noqa: PLC0415
    from tpflower.owner import simulation_secret  # noqa: PLC0415
    from tpflower.relation import load_relation  # noqa: PLC0415
    from tpflower.results import new_run_results  # noqa: PLC0415

    cfg = compose_config(*CONVERGENCE_DATA[data], f"epochs={epochs}", *overrides)
    t0 = time.perf_counter()
    if str(cfg.algorithm.name) == "centralized":
        rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
        results = new_run_results(cfg, "centralized", rel.spec, rel.mapping)
        train_centralized(cfg, rel, results, log=lambda _: None)
    else:
        results = run_in_process(cfg, None, log=lambda _: None).strategy.results
    return {
        "metric": [h.test_metric for h in results.history],
        "stopped": results.stopped,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def epochs_within(metric: list[float], target: float, rel: float = 0.01) -> int | None:
    """The first epoch (1-based) whose metric is within ``rel`` above ``target``; None if none is."""
    return next((k + 1 for k, m in enumerate(metric) if m <= (1 + rel) * target), None)


def convergence_suite(epochs: int, datasets: list[str], mlp: bool) -> dict[str, Any]:
    """The convergence table: TP-Join-ADMM (linear) against the exact ridge solution and TP-UCQ-ADMM against
    TP-Join-ADMM, shipped defaults, ``epochs`` at most; with ``mlp`` also MLP vs linear for every algorithm."""
    rows: dict[str, Any] = {}
    for data in datasets:
        exact = _run_case({"data": data, "overrides": ["algorithm=centralized", "algorithm.solver=exact"], "epochs": 1})
        join = _run_case({"data": data, "overrides": ["algorithm=admm"], "epochs": epochs})
        ucq = _run_case({"data": data, "overrides": ["algorithm=admm", "scenario=ucq"], "epochs": epochs})
        ref, j, u = exact["metric"][-1], join["metric"], ucq["metric"]
        rows[data] = {
            "exact_rmse": ref,
            "join": {
                "final": j[-1],
                "gap_to_exact": round(j[-1] / ref - 1, 5),
                "epochs_to_1pct": epochs_within(j, ref),
                "stopped": join["stopped"],
                "history": j,
            },
            "ucq": {
                "final": u[-1],
                "gap_to_join": round(u[-1] / j[-1] - 1, 5),
                "gap_to_exact": round(u[-1] / ref - 1, 5),
                "epochs_to_1pct_of_exact": epochs_within(u, ref),
                "stopped": ucq["stopped"],
                "history": u,
            },
        }
        print(data, json.dumps({k: v for k, v in rows[data].items()}, default=str)[:400], flush=True)
    out: dict[str, Any] = {"case": "convergence", "epochs": epochs, "datasets": rows}
    if mlp:
        table: dict[str, Any] = {}
        for data in ("movielens", "nycflights13"):
            for alg, extra in (
                ("centralized", ["algorithm=centralized"]),
                ("tp_join_sgd", ["algorithm=sgd"]),
                ("tp_join_admm", ["algorithm=admm"]),
                ("tp_ucq_sgd", ["algorithm=sgd", "scenario=ucq"]),
                ("tp_ucq_admm", ["algorithm=admm", "scenario=ucq"]),
            ):
                for model in ("linear", "mlp"):
                    r = _run_case({"data": data, "overrides": [*extra, f"model={model}"], "epochs": epochs})
                    table[f"{data}/{alg}/{model}"] = {
                        "final": r["metric"][-1],
                        "history": r["metric"],
                        "wall_s": r["wall_s"],
                    }
                    print(data, alg, model, r["metric"][-1], flush=True)
        out["mlp_vs_linear"] = table
    return out


def _run_case(args: dict[str, Any]) -> dict[str, Any]:
    return run_isolated("simulations.bench.convergence", "convergence_case", args)
