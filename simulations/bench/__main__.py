"""`python -m simulations.bench SUITE ...`: the command line of the benchmark suites (see simulations.bench)."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import simulations.bench as bench
from simulations.bench.common import ints, machine_info
from simulations.bench.scale import SCALE_N

DEFAULT_CELU_DATA = "movielens,nycflights13_delayed"


def _suite(name: str) -> ModuleType:
    """The module of one suite, imported when chosen: the others (torch, flwr) stay out of this process, whose
    state the benchmark subprocesses inherit (see simulations/bench/common.py)."""
    return importlib.import_module(f"simulations.bench.{name}")


def _convergence(a: argparse.Namespace) -> dict[str, Any]:
    convergence = _suite("convergence")
    if a.matrix and a.gbdt:
        keep = (a.out or Path("bench_results/convergence-matrix-gbdt.json")) if a.keep else None
        return convergence.gbdt_matrix_suite(a.epochs if a.epochs != 3 else 10, a.quick, not a.no_bundled, keep)
    if a.matrix:
        return convergence.matrix_suite(a.epochs if a.epochs != 3 else 10, a.quick, not a.no_bundled)
    datasets = a.datasets.split(",") if a.datasets != DEFAULT_CELU_DATA else list(convergence.CONVERGENCE_DATA)
    return convergence.convergence_suite(a.epochs if a.epochs != 3 else 10, datasets, a.mlp)


def _deploy(a: argparse.Namespace) -> dict[str, Any]:
    deploy = _suite("deploy")
    cases = a.datasets.split(",") if a.datasets != DEFAULT_CELU_DATA else list(deploy.DEPLOY_CASES)
    return deploy.deploy_suite(cases, a.epochs if a.epochs != 3 else 6)


def _adapters(a: argparse.Namespace) -> dict[str, Any]:
    out = a.out or Path("bench_results/adapters.json")
    reps = a.reps if a.reps != 10 else 3
    return _suite("adapters").adapters_suite(a.variant, reps, a.epochs, out, a.parts, a.sgd_epochs)


SUITES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "mapping": lambda a: _suite("mapping").mapping_suite(a.n_joined),
    "setup": lambda a: _suite("setup_time").setup_suite(
        a.n_joined, tuple(d for d in a.setup_data.split(",") if d), a.keys_memory_n
    ),
    "loj": lambda a: _suite("loj").loj_suite(a.epochs),
    "flower": lambda a: _suite("flower").flower_suite(),
    "startup": lambda a: _suite("startup").startup_suite(a.reps if a.reps != 10 else 3),
    "convergence": _convergence,
    "scale": lambda a: _suite("scale").scale_suite(
        ints(a.scale_n),
        a.epochs,
        a.mapping_n,
        ints(a.server_n),
        ints(a.fact_n),
        2,
        ints(a.fact_mapping_n),
        ints(a.budget_n),
        tuple(x for x in a.fact_algorithms.split(",") if x),
        tuple(x for x in a.budget_families.split(",") if x),
        ints(a.gbdt_n),
        a.gbdt_trees,
    ),
    "celu": lambda a: _suite("celu").run_suite(a),
    "deploy": _deploy,
    "adapters": _adapters,
    "coreset": lambda a: _suite("coreset").coreset_suite(a),
    "predict": lambda a: _suite("predict").predict_suite(a.n_joined if a.n_joined != 10_000_000 else 100_000),
    "lbfgs": lambda a: _suite("lbfgs").lbfgs_suite(
        [tuple(c.split("/")) for c in a.cases.split(",")] if a.cases else list(_suite("lbfgs").LBFGS_CASES), a.epochs
    ),
    "privacy": lambda a: _suite("privacy").privacy_suite(a.jobs, a.out or Path("bench_results/privacy.json")),
    "auto": lambda a: (
        _suite("auto").auto_suite(
            a.epochs if a.epochs != 3 else 10,
            list(_suite("auto").LINEAR_CLASS_DATA),
            _suite("auto").LINEAR_CLASS_RUNS,
            "auto-linear",
        )
        if a.linear_class
        else _suite("auto").auto_suite(
            a.epochs if a.epochs != 3 else 10,
            a.datasets.split(",") if a.datasets != DEFAULT_CELU_DATA else list(_suite("auto").AUTO_DATA),
            tuple(tuple(c.split("/")) for c in a.cases.split(",")) if a.cases else _suite("auto").AUTO_RUNS,
        )
    ),
    "selection": lambda a: _suite("selection").selection_suite(a.epochs if a.epochs != 3 else 10),
    "gbdt": lambda a: (
        _suite("gbdt").setting_suite(
            [d for d in (a.gbdt_datasets or ",".join(_suite("gbdt").DATASETS)).split(",") if d],
            a.trees,
            "categorical" if a.categorical else "leaves_per_step",
            (a.categorical or a.leaves_per_step).split(","),
            a.categorical_repeats,
        )
        if a.categorical or a.leaves_per_step
        else _suite("gbdt").gbdt_suite(
            [d for d in (a.gbdt_datasets or "nycflights13").split(",") if d], a.trees, a.flower, a.deployed_trees
        )
    ),
    "wide": lambda a: _suite("wide").wide_suite(ints(a.categories_wide), a.n_fact),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(SUITES))
    ap.add_argument(
        "--n-joined",
        type=int,
        default=10_000_000,
        help="mapping, setup: joined rows (predict: new rows, default 100000)",
    )
    ap.add_argument("--setup-data", default="movielens,star", help="setup: data sets ('': keep the last ones)")
    ap.add_argument(
        "--keys-memory-n", type=int, default=10_000_000, help="setup: fact rows of the keys memory (0: keep)"
    )
    ap.add_argument(
        "--epochs", type=int, default=3, help="loj: epochs per run (convergence, selection: 10 unless given)"
    )
    ap.add_argument("--datasets", default=DEFAULT_CELU_DATA, help="celu, convergence, auto: datasets")
    ap.add_argument("--mlp", action="store_true", help="convergence: also MLP vs linear for every algorithm")
    ap.add_argument("--matrix", action="store_true", help="convergence: the schema matrix (convergence-matrix.json)")
    ap.add_argument("--quick", action="store_true", help="convergence --matrix: the quick cells only")
    ap.add_argument(
        "--gbdt", action="store_true", help="convergence --matrix: boosted trees per cell (convergence-matrix-gbdt)"
    )
    ap.add_argument("--no-bundled", action="store_true", help="convergence --matrix: without the bundled datasets")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="convergence --matrix --gbdt: keep the cells already in the output JSON, run only the others",
    )
    ap.add_argument("--model", default="mlp", help="celu: model")
    ap.add_argument(
        "--variants",
        default="vanilla,fedbcd,celu,celu_R3,celu_R8,celu_xi90,celu_xi30,celu_xi_off,celu_W3,celu_W8",
        help="celu: variants (vanilla always runs)",
    )
    ap.add_argument(
        "--full-variants",
        default="vanilla,fedbcd,celu",
        help="celu: variants run to the end (others stop at the target)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="celu, privacy: cases at a time")
    ap.add_argument("--grid-seeds", type=int, default=None, help="celu: seeds of the grid variants (default: --seeds)")
    ap.add_argument("--flower-seed", type=int, default=0, help="celu: seed of the Flower wall-time runs (-1: none)")
    ap.add_argument("--seeds", type=int, default=3, help="celu: seeds per variant")
    ap.add_argument("--eval-every", type=int, default=10, help="celu: rounds between evaluations")
    ap.add_argument(
        "--scale-n", default=",".join(str(n) for n in SCALE_N), help="scale: joined rows N of the Flower runs"
    )
    ap.add_argument(
        "--server-n", default="10000000", help="scale: N of the server-state measurement (float32 and float64)"
    )
    ap.add_argument("--fact-n", default="100000000", help="scale: fact-table rows of the fanout-1 runs ('': none)")
    ap.add_argument("--fact-mapping-n", default="100000000", help="scale: fact-table rows of the mapping alone ('')")
    ap.add_argument("--budget-n", default="10000000", help="scale: N of the per-family memory budgets ('': keep)")
    ap.add_argument("--fact-algorithms", default="auto,admm", help="scale: algorithms of the fact-table runs")
    ap.add_argument("--budget-families", default="", help="scale: families of the budgets ('': all)")
    ap.add_argument("--gbdt-n", default="10000000", help="scale: N of boosted trees' server state ('': keep)")
    ap.add_argument("--gbdt-trees", type=int, default=50, help="scale: trees of that run")
    ap.add_argument("--mapping-n", type=int, default=100_000_000, help="scale: N of the mapping alone (0: skip)")
    ap.add_argument("--dataset", default="movielens", help="coreset: the dataset")
    ap.add_argument("--task", choices=("ridge", "kmeans"), default="ridge", help="coreset: ridge or k-means")
    ap.add_argument(
        "--reps", type=int, default=10, help="coreset: repetitions per m and sampling (startup: repeats, default 3)"
    )
    ap.add_argument("--ms", default="500,1000,2000,4000", help="coreset: coreset sizes")
    ap.add_argument(
        "--cases",
        default="",
        help="lbfgs: DATASET/MODEL[/ucq] cases (default: lbfgs.LBFGS_CASES); auto: MODEL/ALGORITHM runs",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="adapters: NAME=PYTHON[@CODE_ROOT][+ADAPTERS_OFF], repeatable (default: each adapter off in turn)",
    )
    ap.add_argument("--parts", default="sim,deploy", help="adapters: sim and/or deploy")
    ap.add_argument("--sgd-epochs", type=int, default=2, help="adapters: deployed SGD epochs (< 2: none)")
    ap.add_argument("--gbdt-datasets", default="", help="gbdt: datasets (default nycflights13)")
    ap.add_argument("--trees", type=int, default=300, help="gbdt: trees of both LightGBM and gbdt")
    ap.add_argument("--flower", action="store_true", help="gbdt: also under Flower's simulation engine")
    ap.add_argument("--deployed-trees", type=int, default=0, help="gbdt: also a deployed run of that many trees")
    ap.add_argument(
        "--categorical", default="", help="gbdt: compare these algorithm.categorical modes (gbdt-categorical.json)"
    )
    ap.add_argument(
        "--leaves-per-step", default="", help="gbdt: compare these algorithm.leaves_per_step values (gbdt-leaves.json)"
    )
    ap.add_argument(
        "--categorical-repeats",
        type=int,
        default=2,
        help="gbdt --categorical / --leaves-per-step: rounds of every value",
    )
    ap.add_argument("--categories", dest="categories_wide", default="0,1000,5000", help="wide: categories")
    ap.add_argument("--n-fact", type=int, default=200_000, help="wide: fact-table rows")
    ap.add_argument(
        "--linear-class", action="store_true", help="auto: the linear model on class labels (auto-linear.json)"
    )
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    result = SUITES[a.case](a)
    result["machine"] = machine_info()
    out = (
        a.out
        or Path("bench_results")
        / f"{result['case'] if a.case in ('coreset', 'convergence', 'gbdt', 'auto') else a.case}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written: {out}")
    if result.get("failures"):  # a measured goal missed (scale: a memory budget): loudly, after the JSON
        raise SystemExit("FAILED:\n" + "\n".join(result["failures"]))


if __name__ == "__main__":
    main()
