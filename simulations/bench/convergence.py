"""Convergence of the shipped defaults: TP-Join-ADMM (linear) against the exact ridge solution and TP-UCQ-ADMM
against TP-Join-ADMM; with --mlp also MLP vs linear for every algorithm.

    python -m simulations.bench convergence [--epochs 10] [--mlp]  -> bench_results/convergence.json
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from simulations.bench.common import WHOLE_TRAINING, code_commit, fixed_epochs, run_isolated, run_results
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

    cfg = compose_config(*fixed_epochs(*CONVERGENCE_DATA[data], f"epochs={epochs}", WHOLE_TRAINING, *overrides))
    t0 = time.perf_counter()
    results = run_results(cfg)
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


# ---------------------------------------------------------------------------------------------- schema matrix
#: the algorithms of a matrix cell: name -> overrides (ADMM with its shipped defaults (per-table subspace
#: acceleration for regression, Anderson acceleration for classification, fixed rho); with the previous defaults
#: (Anderson acceleration for regression too); with no acceleration (over-relaxation 1.5, persistent residual
#: balancing, rho 3); with the paper's iteration and Boyd's residual balancing, the old defaults)
MATRIX_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "pcg": ("algorithm=pcg", "algorithm.tol=0"),
    # the classic block-Jacobi PCG recurrence (one search direction, not one per table)
    "pcg_classic": ("algorithm=pcg", "algorithm.tol=0", "algorithm.window=0"),
    "admm": ("algorithm=admm", "algorithm.tol=0"),
    "admm_anderson": ("algorithm=admm", "algorithm.tol=0", "algorithm.subspace=0"),
    "admm_prev": ("algorithm=admm", "algorithm.tol=0", "algorithm.subspace=0", "algorithm.anderson=0"),
    "admm_old": (
        "algorithm=admm",
        "algorithm.tol=0",
        "algorithm.subspace=0",
        "algorithm.anderson=0",
        "algorithm.relax=1",
        "algorithm.rho_patience=0",
    ),
    "sgd": ("algorithm=sgd",),
}


#: boosted trees beside the matrix's rows, and on the nonlinear cells the linear and MLP rows they compete with,
#: every one with its shipped defaults (gbdt: 300 trees; the others: 10 epochs)
GBDT_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "gbdt": ("algorithm=gbdt",),
    "linear": ("algorithm=auto",),  # pcg (regression), admm (classification)
    "mlp_admm": ("algorithm=admm", "model=mlp"),
    "mlp_lbfgs": ("algorithm=lbfgs", "model=mlp"),
}


def cell_overrides(cell: dict[str, Any]) -> list[str]:
    """A matrix cell as synthetic-dataset overrides: ``dup`` fact rows per dimension row (fanout 1), so
    n_fact = dim_rows * dup joined rows."""
    n_fact = int(cell["dim_rows"]) * int(cell["dup"])
    loader = {
        "schema": cell["schema"],
        "n_fact": n_fact,
        "dim_rows": cell["dim_rows"],
        "n_dims": cell.get("n_dims", 3),
        "fanout": 1,
        "task": cell.get("task", "regression"),
        "n_classes": cell.get("n_classes", 3),
        "noise": cell.get("noise", 0.5),
        "seed": cell.get("seed", 0),
        "label": cell.get("label", "linear"),
    }
    out = ["dataset=synthetic", *(f"dataset.loader.{k}={v}" for k, v in loader.items())]
    out += [f"+dataset.loader.correlation={cell.get('correlation', 0.0)}"]
    out += [f"+dataset.loader.label_scale={cell.get('label_scale', 1.0)}"]
    return out


def rounds_within(history: list[dict[str, float]], target: float, rel: float, lower_is_better: bool) -> int | None:
    """Round trips (cumulative training rounds) of the first epoch within ``rel`` of ``target``; None if none."""
    for h in history:
        m = h["metric"]
        if (m <= (1 + rel) * target) if lower_is_better else (m >= (1 - rel) * target):
            return int(h["rounds"])
    return None


def matrix_cell(overrides: list[str], epochs: int, algorithms: list[str]) -> dict[str, Any]:
    """One cell, every algorithm in this process (in-process runs): the exact ridge (regression) or the
    centralized model's metric, each algorithm's metric and training round trips per epoch, the constant
    predictor's metric, and bytes per training round trip."""
    from simulations.federated import run_in_process  # noqa: PLC0415
    from strategies.centralized import constant_predictor_metric, train_centralized  # noqa: PLC0415
    from tpflower.owner import simulation_secret  # noqa: PLC0415
    from tpflower.relation import load_relation  # noqa: PLC0415
    from tpflower.results import new_run_results  # noqa: PLC0415

    base = compose_config(*overrides, "epochs=1")
    out: dict[str, Any] = {"algorithms": {}}
    rel = load_relation(base.dataset, simulation_secret(base), verbose=False)
    task = rel.spec.label.task
    central = ["algorithm=centralized", "algorithm.solver=exact"] if task == "regression" else ["algorithm=centralized"]
    cfg = compose_config(*overrides, *central, f"epochs={1 if task == 'regression' else epochs}")
    results = new_run_results(cfg, "centralized", rel.spec, rel.mapping)
    train_centralized(cfg, rel, results, log=lambda _: None)
    out.update(
        task=task,
        metric=results.metric,
        n_joined=int(rel.mapping.N),
        table_rows={t: int(n) for t, n in rel.mapping.n_rows.items()},
        reference=results.history[-1].test_metric,
        constant_metric=float(constant_predictor_metric(rel)[results.metric]),
    )
    for name in algorithms:
        if name.startswith("pcg") and task != "regression":
            continue
        cfg = compose_config(
            *fixed_epochs(
                *overrides, *{**MATRIX_ALGORITHMS, **GBDT_ALGORITHMS}[name], f"epochs={epochs}", WHOLE_TRAINING
            )
        )
        t0 = time.perf_counter()
        res = run_in_process(cfg, None, log=lambda _: None).strategy.results
        hist = [{"metric": h.test_metric, "rounds": h.rounds, "bytes": h.bytes_up + h.bytes_down} for h in res.history]
        out["algorithms"][name] = {"history": hist, "wall_s": round(time.perf_counter() - t0, 1)}
    return out


def _cell(schema: str, dim_rows: int, dup: int, correlation: float, **more: Any) -> dict[str, Any]:
    return {"schema": schema, "dim_rows": dim_rows, "dup": dup, "correlation": correlation, **more}


#: the schema matrix (--quick: the first QUICK cells); joined rows = dim_rows * dup
MATRIX_CELLS: list[dict[str, Any]] = [
    _cell("star", 20, 1000, 0.9, n_dims=2),  # small dimension tables correlated with the fact table
    _cell("star", 20, 15, 0.0),  # 300 joined rows
    _cell("chain", 50, 200, 0.95),
    _cell("snowflake", 1000, 10, 0.0),
    _cell("snowflake", 100, 100, 0.9, label_scale=10000.0),
    _cell("star", 100, 3, 0.5, label_scale=0.001),
    _cell("star", 20, 50, 0.5, task="binary"),
    _cell("star", 60, 5, 0.0, task="multiclass", n_classes=5, imbalance=1.0),  # 300 rows, 5 imbalanced classes
    _cell("chain", 1000, 1, 0.5),
    _cell("snowflake", 2000, 20, 0.95),
    _cell("star", 100000, 1, 0.0),
    _cell("snowflake", 100000, 10, 0.5),  # 1,000,000 joined rows
]
QUICK = 8
#: cells whose label is the generator's nonlinear teacher (tanh(x A_t) B_t per table, hidden 8): exact ridge is
#: not the true model there; a regression, a correlated snowflake and a multiclass one, 10,000 joined rows each
NONLINEAR_CELLS: list[dict[str, Any]] = [
    _cell("star", 200, 50, 0.0, label="nonlinear"),
    _cell("snowflake", 200, 50, 0.5, label="nonlinear"),
    _cell("star", 200, 50, 0.0, label="nonlinear", task="multiclass", n_classes=4),
]
#: cells whose label is the generator's interaction teacher (the nonlinear teacher, each child dimension's effect
#: switched by a column of its parent table: interactions across tables, which no model additive over the tables
#: fits); the nonlinear cells' sizes, a star and a correlated snowflake regression (switches on two levels) and a
#: multiclass star
INTERACTION_CELLS: list[dict[str, Any]] = [
    _cell("star", 200, 50, 0.0, label="interaction"),
    _cell("snowflake", 200, 50, 0.5, label="interaction"),
    _cell("star", 200, 50, 0.0, label="interaction", task="multiclass", n_classes=4),
]
#: every bundled dataset (overrides)
BUNDLED: dict[str, tuple[str, ...]] = {
    "movielens": ("dataset=movielens",),
    "nycflights13": ("dataset=nycflights13",),
    "nycflights13_delayed": ("dataset=nycflights13_delayed",),
    "movielens1m": ("dataset=movielens1m",),
}


#: the files a loader reads from its ``loader.path`` folder (datasets not shipped with tpflower)
LOADER_FILES: dict[str, tuple[str, ...]] = {"movielens1m": ("ratings.dat", "movies.dat", "users.dat")}


def absent_data(overrides: list[str]) -> str | None:
    """Why a dataset cannot load on this machine (the files its loader needs are absent), else None."""
    loader = compose_config(*overrides).dataset.get("loader") or {}
    files = LOADER_FILES.get(str(loader.get("name")), ())
    folder = Path(str(loader.get("path", "."))).expanduser()
    absent = [f for f in files if not (folder / f).is_file()]
    return f"{', '.join(absent)} not found in {str(folder)!r}" if absent else None


def cell_name(cell: dict[str, Any]) -> str:
    extra = "".join(f" {k}={v}" for k, v in cell.items() if k not in ("schema", "dim_rows", "dup", "correlation"))
    return f"{cell['schema']} dim={cell['dim_rows']} dup={cell['dup']} corr={cell['correlation']}{extra}"


def summarize(cell: dict[str, Any], epochs: int) -> dict[str, Any]:
    """Per algorithm: round trips to within 0.1% and 1% of the reference, the final gap, bytes per round trip,
    whether it ends below the constant predictor."""
    lower = cell["metric"] in ("rmse", "mse", "mae", "logloss")
    ref, const = cell["reference"], cell.get("constant_metric")
    out = {}
    for name, run in cell["algorithms"].items():
        hist = run["history"]
        last = hist[-1]
        worse_than_constant = None
        if const is not None:
            worse_than_constant = bool(last["metric"] > const if lower else last["metric"] < const)
        out[name] = {
            "rounds_to_0.1pct": rounds_within(hist, ref, 1e-3, lower),
            "rounds_to_1pct": rounds_within(hist, ref, 1e-2, lower),
            "gap_after": round(last["metric"] / ref - 1, 6),
            "rounds": last["rounds"],
            # steady state: the training round trips after the first epoch's (setup rounds excluded)
            "bytes_per_round": round(
                (last["bytes"] - hist[0]["bytes"]) / max(last["rounds"] - hist[0]["rounds"], 1)
                if len(hist) > 1
                else last["bytes"] / max(last["rounds"], 1)
            ),
            "below_constant": worse_than_constant,
        }
    return out


def run_cells(
    cases: dict[str, tuple[list[str], list[str]]],
    epochs: int,
    partial: Path | None = None,
    kept: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each case (its overrides and algorithms) as one matrix cell in a fresh process, summarized; a dataset whose
    files are absent is skipped, with why. ``partial``: the cells measured so far are written there after each
    (a long run stopped early keeps its part). ``kept``: cells of an earlier run of the same epochs, taken as
    they are where they hold every algorithm of their case (not run again; a cell measured at another commit
    than the checkout's is named as such: the code may have changed since). Each cell records its commit."""
    rows: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    commit = code_commit()
    for name, (overrides, algorithms) in cases.items():
        old = (kept or {}).get(name)
        if old is not None and set(algorithms) <= set(old["algorithms"]):
            rows[name] = old
            measured = old.get("commit", "an unrecorded commit")
            stale = "" if measured == commit else f" (measured at {measured}, the code is now {commit})"
            print(f"{name}: kept{stale}", flush=True)
            continue
        why = absent_data(overrides)
        if why is not None:
            skipped[name] = why
            print(f"{name}: skipped ({why})", flush=True)
            continue
        t0 = time.perf_counter()
        cell = run_isolated(
            "simulations.bench.convergence",
            "matrix_cell",
            {"overrides": overrides, "epochs": epochs, "algorithms": algorithms},
        )
        cell["summary"] = summarize(cell, epochs)
        cell["wall_s"] = round(time.perf_counter() - t0, 1)
        cell["load"] = round(os.getloadavg()[0], 1)  # 1-minute load at the cell's end
        cell["commit"] = commit
        rows[name] = cell
        print(name, json.dumps(cell["summary"]), flush=True)
        if partial is not None:
            partial.write_text(json.dumps({"epochs": epochs, "cells": rows, "skipped": skipped, "partial": True}))
    return rows, skipped


def matrix_suite(epochs: int, quick: bool, bundled: bool) -> dict[str, Any]:
    """The schema matrix (docs/results.md): every cell (the first QUICK with ``quick``) and, with ``bundled``,
    every bundled dataset; PCG, ADMM (shipped and old defaults), TP-Join-SGD against the exact ridge (or the
    centralized model's metric for classification)."""
    every = list(MATRIX_ALGORITHMS)
    cases = {cell_name(c): (cell_overrides(c), every) for c in (MATRIX_CELLS[:QUICK] if quick else MATRIX_CELLS)}
    if bundled:
        cases.update({k: (list(v), every) for k, v in BUNDLED.items() if not quick or k != "movielens1m"})
    rows, skipped = run_cells(cases, epochs)
    return {"case": "convergence-matrix", "epochs": epochs, "quick": quick, "cells": rows, "skipped": skipped}


def gbdt_matrix_suite(epochs: int, quick: bool, bundled: bool, keep: Path | None = None) -> dict[str, Any]:
    """Boosted trees on the schema matrix: the nonlinear and interaction cells (gbdt, the linear model by
    algorithm=auto and the MLP by ADMM and L-BFGS, ``epochs`` each), then gbdt (shipped defaults) on every cell
    of the matrix (the first QUICK with ``quick``) and, with ``bundled``, every bundled dataset, beside the rows
    of convergence-matrix.json. ``keep``: an earlier run's JSON whose cells (same epochs) are kept, not run
    again; only the others run."""
    kept: dict[str, Any] = {}
    earlier = json.loads(keep.read_text()) if keep is not None and keep.is_file() else {}
    if earlier.get("epochs") == epochs:
        kept = earlier.get("cells", {})
    cases = {cell_name(c): (cell_overrides(c), list(GBDT_ALGORITHMS)) for c in [*NONLINEAR_CELLS, *INTERACTION_CELLS]}
    cases.update(
        {cell_name(c): (cell_overrides(c), ["gbdt"]) for c in (MATRIX_CELLS[:QUICK] if quick else MATRIX_CELLS)}
    )
    if bundled:
        cases.update({k: (list(v), ["gbdt"]) for k, v in BUNDLED.items() if not quick or k != "movielens1m"})
    partial = Path("bench_results/convergence-matrix-gbdt.partial.json")
    rows, skipped = run_cells(cases, epochs, partial, kept)
    partial.unlink(missing_ok=True)  # complete: the suite's JSON replaces it
    load = f"1-minute load {os.getloadavg()[0]:.1f} at the end"
    if any(rows.get(name) is cell for name, cell in kept.items()):
        old = str(earlier.get("load", "not recorded")).removesuffix(" (each cell's in its JSON)")
        old = old if old.startswith("kept cells: ") else f"kept cells: {old}"  # one prefix after several --keep runs
        load = f"{old}; new cells: {load} (each cell's in its JSON)"
    return {
        "case": "convergence-matrix-gbdt",
        "epochs": epochs,
        "quick": quick,
        "bundled": bundled,
        "load": load,
        "cells": rows,
        "skipped": skipped,
    }
