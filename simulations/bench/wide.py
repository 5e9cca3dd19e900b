"""Tables with a categorical column of many categories (each table's one-hot block thousands of columns wide):
boosted trees (gbdt), exact ridge (pcg) and TP-Join-ADMM (admm) in-process on the synthetic star, by number of categories, side by
side with the same tables without the categorical column.

    python -m simulations.bench wide [--categories 0,1000,5000] [--n-fact 200000]  -> bench_results/wide.json

Each case in its own process: the run's time to its first epoch line (setup, binning or the Gram blocks
included), its time per later epoch (gbdt: per boosting round of one tree), its peak resident memory and its
test metric. ``categories`` 0: no categorical column (each table's last feature stays numeric).
"""

from __future__ import annotations

import time
from typing import Any

from simulations.bench.common import code_commit, machine_info, run_isolated

#: (algorithm, its overrides, epochs or trees)
RUNS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("gbdt", ("algorithm=gbdt", "algorithm.eval_every=1"), 10),
    ("pcg", ("algorithm=pcg",), 5),
    ("admm", ("algorithm=admm",), 5),
)


def wide_case(algorithm: str, categories: int, n_fact: int) -> dict[str, Any]:
    """One in-process run of ``algorithm`` on the synthetic star of ``n_fact`` fact rows with a categorical
    column of ``categories`` categories in place of each table's last feature (0: none)."""
    from simulations.bench.common import peak_rss_mb, run_results  # noqa: PLC0415  torch: the case's process
    from tpflower.config import compose_config  # noqa: PLC0415

    overrides, rounds = next((o, r) for a, o, r in RUNS if a == algorithm)
    count = f"algorithm.trees={rounds}" if algorithm == "gbdt" else f"epochs={rounds}"
    extra = (f"+dataset.loader.categories={categories}",) if categories else ()
    cfg = compose_config("dataset=synthetic", f"dataset.loader.n_fact={n_fact}", *overrides, count, *extra)
    t0 = time.perf_counter()
    results = run_results(cfg)
    total = time.perf_counter() - t0
    history = results.history
    first, last = history[0].wall_time_s, history[-1].wall_time_s
    return {
        "algorithm": algorithm,
        "categories": categories,
        "n_fact": n_fact,
        "epochs": len(history),
        "first_epoch_s": round(first, 2),
        "per_epoch_s": round((last - first) / max(len(history) - 1, 1), 3),
        "total_s": round(total, 2),
        "peak_rss_mb": round(peak_rss_mb()),
        "test_metric": history[-1].test_metric,
    }


def wide_suite(categories: list[int], n_fact: int) -> dict[str, Any]:
    """Every (algorithm, categories) case, the categories in turn per algorithm."""
    runs = []
    for algorithm, _, _ in RUNS:
        for k in categories:
            args = {"algorithm": algorithm, "categories": k, "n_fact": n_fact}
            runs.append(run_isolated("simulations.bench.wide", "wide_case", args))
            print(runs[-1], flush=True)
    return {
        "case": "wide",
        "command": "python -m simulations.bench wide",
        "machine": machine_info(),
        "code_commit": code_commit(),
        "runs": runs,
    }
