"""The README's privacy table: every privacy mode of TP-Join-ADMM and TP-Join-SGD on three datasets.

    python -m simulations.bench privacy [--jobs 2]          -> bench_results/privacy.json
    python -m simulations.bench.privacy --table bench_results/privacy.json   # the README's rows

Each cell is one run with the shipped defaults (10 epochs; conf/privacy: epsilon 1, delta 1e-5, C 1, label
lambda 0.5), in its own process (the in-process runtime: the same strategy and ClientApp as under Flower). The
"paper accounting" columns add ``privacy.sample_rate=batch`` (SGD only: q = B / N). Cells finished before are
kept (the JSON is written after each one), so an interrupted suite resumes.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from simulations.bench.common import WHOLE_TRAINING, run_isolated
from tpflower.config import compose_config

DATASETS = ("movielens", "nycflights13", "nycflights13_delayed")
ALGORITHMS = {"admm": "TP-Join-ADMM", "sgd": "TP-Join-SGD"}
#: (column, privacy group, extra overrides, algorithms it applies to)
COLUMNS = (
    ("none", "none", (), ("admm", "sgd")),
    ("label", "label", (), ("admm", "sgd")),
    ("dpsgd", "dpsgd", (), ("admm", "sgd")),
    ("label_dpsgd", "label_dpsgd", (), ("admm", "sgd")),
    ("dpsgd, paper accounting", "dpsgd", ("privacy.sample_rate=batch",), ("sgd",)),
    ("label_dpsgd, paper accounting", "label_dpsgd", ("privacy.sample_rate=batch",), ("sgd",)),
)


def privacy_case(dataset: str, algorithm: str, privacy: str, extra: list[str]) -> dict[str, Any]:
    """One run: the final model's test metric (``metric``; and ``released_metric``, the one the server got),
    the epsilons spent (``spent``) and the wall time. Label DP and DP-SGD noise come from the clients' own
    unseeded generators (the server must not predict it), so a DP cell differs from run to run."""
    from simulations.federated import run_in_process  # noqa: PLC0415  torch, flwr: in the case's process only

    t0 = time.perf_counter()
    cfg = compose_config(f"dataset={dataset}", f"algorithm={algorithm}", f"privacy={privacy}", WHOLE_TRAINING, *extra)
    run = run_in_process(cfg, None, log=lambda _: None)
    res = run.strategy.results
    last = res.history[-1]
    return {
        "metric_name": res.metric,
        # the trained model's test metric, scored by the harness (it holds every table); under label DP the
        # server receives only the label owner's DP release of it (``released_metric``), whose noise never
        # reaches training (docs/threat-model.md, label-DP evaluation)
        "metric": run.exact_test_metrics()[res.metric],
        "released_metric": last.test_metric,
        "epochs": last.epoch,
        "spent": res.privacy,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def privacy_suite(jobs: int = 2, out: Path | None = None, datasets: tuple[str, ...] = DATASETS) -> dict[str, Any]:
    """Every (dataset, algorithm, column) cell, ``jobs`` at a time; resumes from ``out`` if it exists."""
    result: dict[str, Any] = {"case": "privacy", "cells": {}}
    if out is not None and out.exists():
        result = json.loads(out.read_text())

    def run(key: str, args: dict[str, Any]) -> None:
        if key in result["cells"]:
            return
        result["cells"][key] = {**args, **run_isolated("simulations.bench.privacy", "privacy_case", args)}
        print(key, json.dumps(result["cells"][key]), flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")

    cells = [
        (f"{d}/{a}/{col}", {"dataset": d, "algorithm": a, "privacy": group, "extra": list(extra)})
        for d in datasets
        for a in ALGORITHMS
        for col, group, extra, algs in COLUMNS
        if a in algs
    ]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for f in [pool.submit(run, key, args) for key, args in cells]:
            f.result()
    return result


def table(result: dict[str, Any]) -> str:
    """The README's markdown rows: one per (dataset, algorithm), a metric per column (blank: not run)."""
    cells = result["cells"]
    lines = []
    for d in DATASETS:
        for a, name in ALGORITHMS.items():
            row = [cells.get(f"{d}/{a}/{col}") for col, *_ in COLUMNS]
            if not any(row):
                continue
            metric = next(c["metric_name"] for c in row if c)
            digits = 3 if d == "nycflights13" else 4
            values = [f"{c['metric']:.{digits}f}" if c else "" for c in row]
            lines.append(f"| {d} ({metric}) | {name} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def spent(result: dict[str, Any]) -> str:
    """The epsilons the runs report: the range of feature epsilon over DP-SGD cells, the label epsilons."""
    feat = [c["spent"]["feature_epsilon"] for c in result["cells"].values() if c["spent"].get("feature_epsilon")]
    label = sorted(
        {round(c["spent"]["label_epsilon"], 2) for c in result["cells"].values() if c["spent"].get("label_epsilon")}
    )
    return f"feature epsilon {min(feat):.3f}-{max(feat):.3f} over {len(feat)} runs; label epsilon {label}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_results/privacy.json"))
    ap.add_argument("--table", type=Path, help="print the README's rows of this JSON file and stop")
    a = ap.parse_args(argv)
    if a.table:
        result = json.loads(a.table.read_text())
        print(table(result))
        print(spent(result))
        return
    privacy_suite(a.jobs, a.out)
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
