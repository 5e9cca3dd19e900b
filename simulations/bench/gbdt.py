"""Boosted trees over the join (algorithm=gbdt) against central LightGBM on the materialized join, side by side.

    python -m simulations.bench gbdt [--gbdt-datasets nycflights13,...] [--trees 300] [--flower]
        [--deployed-trees 100]   -> bench_results/gbdt.json
    python -m simulations.bench gbdt --categorical onehot,native [--gbdt-datasets ...] [--trees 300]
                                 -> bench_results/gbdt-categorical.json
    python -m simulations.bench gbdt --leaves-per-step 4,8,16 [--gbdt-datasets ...] [--trees 300]
                                 -> bench_results/gbdt-leaves.json

Per dataset, interleaved in one sitting: LightGBM (2 threads) on the materialized join's training rows with the
same number of trees, leaves, bins, learning rate, lambda and minimum leaf rows as gbdt's shipped defaults
(LightGBM's own binning); gbdt in-process with the shipped defaults; with ``--flower`` gbdt under Flower's
simulation engine; with ``--deployed-trees`` a run of that many trees on one secure deployment. Each case in
its own process. Reported: the test metric, training wall time (gbdt: the
run's wall time after setup, evaluations included), round trips and bytes per tree. With ``--categorical``
(``--leaves-per-step``): gbdt in-process with each way of splitting categorical columns (each number of leaves
split per step), the shipped defaults otherwise, the values in turn per dataset (their order alternating from
one round to the next).
"""

from __future__ import annotations

import os
import time
from typing import Any

from simulations.bench.common import run_isolated

DATASETS = ("nycflights13", "nycflights13_delayed", "movielens")


def lightgbm_case(data: str, trees: int) -> dict[str, Any]:
    """LightGBM on the materialized join (the relation's preprocessed features with their missing values, as
    gbdt bins them; train rows), gbdt's settings."""
    import lightgbm as lgb  # noqa: PLC0415  dev/bench extra

    from strategies.centralized import label_scale_of  # noqa: PLC0415
    from tpflower.config import compose_config  # noqa: PLC0415
    from tpflower.losses import metrics, primary_metric  # noqa: PLC0415
    from tpflower.owner import simulation_secret  # noqa: PLC0415
    from tpflower.phases.gbdt import GBDTParams  # noqa: PLC0415
    from tpflower.relation import load_relation  # noqa: PLC0415

    cfg = compose_config(f"dataset={data}", "algorithm=gbdt")
    p = GBDTParams.from_cfg(cfg.algorithm)
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    task = rel.spec.label.task
    X, Xt = (rel.joined_features(m, keep_missing=True) for m in (rel.train, rel.test))
    scale = label_scale_of(cfg, rel)
    y = scale.scaled(rel.labels(rel.train))
    objective = {"regression": "regression", "binary": "binary", "multiclass": "multiclass"}[task]
    params = {
        "objective": objective,
        "num_leaves": p.max_leaves,
        "max_depth": p.max_depth or -1,
        "learning_rate": p.learning_rate,
        "lambda_l2": p.lambda_l2,
        "min_data_in_leaf": p.min_child_rows,
        "min_sum_hessian_in_leaf": p.min_child_weight,
        "max_bin": p.max_bins,
        "num_threads": 2,
        "verbose": -1,
        **({"num_class": rel.d_out} if task == "multiclass" else {}),
    }
    t0 = time.perf_counter()
    model = lgb.train(params, lgb.Dataset(X, y), num_boost_round=trees)
    wall = time.perf_counter() - t0
    H = model.predict(Xt, raw_score=True).reshape(len(Xt), -1)
    test = metrics(task, scale.to_label(H), rel.labels(rel.test))
    return {"metric": test[primary_metric(task)], "wall_s": round(wall, 2), "trees": trees}


def gbdt_case(data: str, trees: int, runtime: str, setting: str = "") -> dict[str, Any]:
    """gbdt with the shipped defaults (``trees`` trees, one evaluation at the end) in-process or under Flower;
    ``setting``: one more override of an algorithm setting (``algorithm.categorical=onehot``; empty: none)."""
    import tempfile  # noqa: PLC0415

    from simulations.bench.common import run_results  # noqa: PLC0415
    from simulations.federated import run_flower_simulation  # noqa: PLC0415
    from tpflower.config import compose_config  # noqa: PLC0415

    cfg = compose_config(
        f"dataset={data}",
        "algorithm=gbdt",
        f"algorithm.trees={trees}",
        f"algorithm.eval_every={trees}",
        *([setting] if setting else []),
    )
    t0 = time.perf_counter()
    if runtime == "flower":
        with tempfile.TemporaryDirectory() as tmp:
            results = run_flower_simulation(cfg, tmp, log=lambda _: None)
    else:
        results = run_results(cfg)
    total = time.perf_counter() - t0
    last = results.history[-1]
    return {
        "metric": last.test_metric,
        "wall_s": round(last.wall_time_s, 2),
        "total_s": round(total, 2),
        "rounds": last.rounds,
        "rounds_per_tree": round(last.rounds / trees, 2),
        "mb_per_tree": round((last.bytes_up + last.bytes_down) / trees / 1e6, 2),
        "trees": trees,
        # which tables the trees use: each one's share of the split gain and its splits (results.json)
        "importance": {
            t: {"share": round(v["share"], 4), "splits": v["splits"]} for t, v in results.importance.items()
        },
    }


def deployed_case(data: str, trees: int) -> dict[str, Any]:
    """gbdt with the shipped defaults on one secure deployment (``simulations.deploy start``: a SuperLink and a
    node service per table, as ``bench deploy``): the run's wall time after setup, its round trips and the
    metric, for comparison with the same run in-process."""
    import json  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from simulations import deploy  # noqa: PLC0415
    from simulations.bench.deploy import _run, wait_for_warm_up  # noqa: PLC0415

    job = f"algorithm=gbdt dataset={data} algorithm.trees={trees} algorithm.eval_every={trees}"
    with tempfile.TemporaryDirectory(prefix="tpflower-bench-") as tmp:
        root = Path(tmp)
        dep = deploy.start(job, state_dir=root / "deploy", home=root / "home", cwd=root)
        try:
            wait_for_warm_up(dep)
            t0 = time.perf_counter()
            _run(deploy.flwr_run_command(dep.connection, job, root / "run"), dep.env(), 7200)
            total = time.perf_counter() - t0
            last = json.loads((root / "run" / "results.json").read_text())["history"][-1]
        finally:
            deploy.stop(dep)
    return {
        "metric": last["test_metric"],
        "wall_s": round(last["wall_time_s"], 2),
        "total_s": round(total, 2),
        "rounds": last["rounds"],
        "s_per_round": round(last["wall_time_s"] / last["rounds"], 4),
        "trees": trees,
    }


def gbdt_suite(datasets: list[str], trees: int, flower: bool, deployed_trees: int = 0) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for data in datasets:
        case: dict[str, Any] = {
            "load_at_start": round(os.getloadavg()[0], 2),
            "lightgbm": run_isolated("simulations.bench.gbdt", "lightgbm_case", {"data": data, "trees": trees}),
            "inprocess": run_isolated(
                "simulations.bench.gbdt", "gbdt_case", {"data": data, "trees": trees, "runtime": "inprocess"}
            ),
        }
        if flower:
            case["flower"] = run_isolated(
                "simulations.bench.gbdt", "gbdt_case", {"data": data, "trees": trees, "runtime": "flower"}
            )
        if deployed_trees:
            case["deployed"] = run_isolated(
                "simulations.bench.gbdt", "deployed_case", {"data": data, "trees": deployed_trees}
            )
        case["inprocess_vs_lightgbm"] = round(case["inprocess"]["wall_s"] / max(case["lightgbm"]["wall_s"], 1e-9), 1)
        cases[data] = case
        print(data, case, flush=True)
    return {"case": "gbdt", "trees": trees, "load": os.getloadavg()[0], "cases": cases}


#: the algorithm settings :func:`setting_suite` compares, each with its output case (bench_results/CASE.json)
SETTINGS = {"categorical": "gbdt-categorical", "leaves_per_step": "gbdt-leaves"}


def setting_suite(datasets: list[str], trees: int, setting: str, values: list[str], repeats: int = 2) -> dict[str, Any]:
    """gbdt in-process per value of one algorithm setting (:data:`SETTINGS`), side by side per dataset:
    ``repeats`` rounds of every value, their order alternating from one round to the next. Per value: the test
    metric (the same in every repeat: the runs are deterministic), each repeat's wall time and their mean."""
    cases: dict[str, Any] = {}
    for data in datasets:
        case: dict[str, Any] = {"load_at_start": round(os.getloadavg()[0], 2)}
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in values}
        for r in range(repeats):
            for value in values if r % 2 == 0 else values[::-1]:
                args = {"data": data, "trees": trees, "runtime": "inprocess", "setting": f"algorithm.{setting}={value}"}
                run = run_isolated("simulations.bench.gbdt", "gbdt_case", args)
                runs[value].append({**run, "load": round(os.getloadavg()[0], 2)})
        for value, done in runs.items():
            case[value] = {
                **{k: v for k, v in done[0].items() if k not in ("wall_s", "total_s", "load")},
                "metrics": [x["metric"] for x in done],
                "wall_s": [x["wall_s"] for x in done],
                "mean_wall_s": round(sum(x["wall_s"] for x in done) / len(done), 2),
                "loads": [x["load"] for x in done],
            }
        case["load_at_end"] = round(os.getloadavg()[0], 2)
        cases[data] = case
        print(data, case, flush=True)
    return {
        "case": SETTINGS[setting],
        "setting": setting,
        "trees": trees,
        "modes": values,
        "repeats": repeats,
        "cases": cases,
    }
