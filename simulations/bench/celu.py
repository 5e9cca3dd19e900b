"""CELU-VFL's benchmark (the CELU-VFL paper's Table 2): rounds to reach vanilla's final test metric.

    python -m simulations.bench celu [--datasets movielens,nycflights13_delayed] [--seeds 3] [--epochs 2]
        [--eval-every 10] [--variants vanilla,fedbcd,celu,...] [--full-variants vanilla,fedbcd,celu]
        [--jobs 2] [--flower-seed=0] [--out bench_results/celu.json]            -> bench_results/celu.json
    python -m simulations.bench.celu plot bench_results/celu.json docs/celu_rounds.png
    python -m simulations.bench.celu summarize bench_results/celu.json   # the table from the cases present

Per dataset and seed, vanilla TP-Join-SGD runs ``epochs`` epochs; its test metric after the last one is that
seed's target. Every other variant runs with the same seed (the same batches) and is read off at the first
evaluation (every ``eval_every`` rounds) at least as good as the target. The ``full`` variants run all their
epochs (their curves, final metric and stability are reported); the others stop at the evaluation that reaches
the target (or run to the end if they never do), which is what keeps the grid within a CPU budget. A run whose
training loss is not finite is recorded as diverged. The cases run in-process (the strategy and the ClientApp
called directly: the same rounds, bytes and metrics as under Flower, tests/test_flower.py); Flower's wall time
per round is measured separately, one seed of vanilla and of each full variant for one epoch under Flower's
simulation engine, and the wall time to the target is rounds x that time. The modelled WAN time is the
run's communication time (conf/network: the slowest link's latency + bytes / bandwidth per round) at the
evaluation that reached the target.

Each case runs in a fresh subprocess; ``--jobs`` of them at a time. The suite writes its JSON after every case
and reuses the cases already in ``--out`` (same settings), so an interrupted grid resumes.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from simulations.bench.common import WHOLE_TRAINING, fixed_epochs, run_isolated
from tpflower.config import compose_config

#: the variants of the paper's Table 2, as overrides (vanilla: TP-Join-SGD; every other: algorithm=celu)
CELU_VARIANTS: dict[str, tuple[str, ...]] = {
    "vanilla": ("algorithm=sgd",),
    "fedbcd": ("algorithm=celu", "algorithm.W=1", "algorithm.R=5", "algorithm.xi=null"),
    "celu": ("algorithm=celu",),
    "celu_R3": ("algorithm=celu", "algorithm.R=3"),
    "celu_R8": ("algorithm=celu", "algorithm.R=8"),
    "celu_xi90": ("algorithm=celu", "algorithm.xi=90"),
    "celu_xi30": ("algorithm=celu", "algorithm.xi=30"),
    "celu_xi_off": ("algorithm=celu", "algorithm.xi=null"),
    "celu_W3": ("algorithm=celu", "algorithm.W=3"),
    "celu_W8": ("algorithm=celu", "algorithm.W=8"),
}
FULL_VARIANTS = ("vanilla", "fedbcd", "celu")
DATASETS = ("movielens", "nycflights13_delayed")


class _Reached(Exception):
    """Raised from the evaluation that reaches the target: the case stops there."""


def lower_is_better(dataset: str) -> bool:
    """The test metric's direction: RMSE (regression) lower, accuracy (binary: nycflights13_delayed) higher."""
    from tpflower.losses import primary_metric  # noqa: PLC0415  torch: not in the suite's process (common.py)

    return primary_metric("binary" if "delayed" in dataset else "regression") == "rmse"


def celu_case(
    dataset: str,
    model: str,
    variant: str,
    seed: int,
    epochs: int,
    eval_every: int,
    stop_at: float | None = None,
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One run in-process: its evaluation history [(rounds, test metric, modelled comm s)], how it ended
    (done / target / diverged) and its wall time. ``stop_at``: stop at the first evaluation that reaches it."""
    # torch, flwr: imported in the case's own process only, never in the suite's (see common.py)
    from simulations.federated import client_app_for, in_process_contexts  # noqa: PLC0415
    from strategies.transport import DirectTransport  # noqa: PLC0415
    from tpflower.app.server_app import make_strategy  # noqa: PLC0415

    cfg = compose_config(
        *fixed_epochs(*CELU_VARIANTS[variant]),
        f"dataset={dataset}",
        f"model={model}",
        f"seed={seed}",
        f"epochs={epochs}",
        f"algorithm.eval_every={eval_every}",
        WHOLE_TRAINING,
        *overrides,
    )
    lower = lower_is_better(dataset)
    t0 = time.perf_counter()
    strategy = make_strategy(cfg, None, log=lambda _: None)
    record = strategy.record_epoch

    def record_and_check(*args, **kwargs):
        record(*args, **kwargs)
        m = strategy.results.history[-1].test_metric
        if stop_at is not None and ((m <= stop_at) if lower else (m >= stop_at)):
            raise _Reached

    strategy.record_epoch = record_and_check  # type: ignore[method-assign]
    contexts = in_process_contexts(strategy)
    end = "done"
    try:
        strategy.run(DirectTransport(client_app_for(cfg), {c.node_id: c for c in contexts.values()}))
    except _Reached:
        end = "target"
    except RuntimeError as err:  # record_epoch: a non-finite training loss
        if "diverged" not in str(err):
            raise
        end = "diverged"
    h = strategy.results.history
    return {
        "dataset": dataset,
        "variant": variant,
        "seed": seed,
        "end": end,
        "wall_s": round(time.perf_counter() - t0, 1),
        "local_steps_per_round": h[-1].extra.get("local_steps_per_round") if h else None,
        "history": [(x.rounds, x.test_metric, x.comm_time_s) for x in h],
    }


def flower_case(
    dataset: str, model: str, variant: str, runtime: str, overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One epoch (seed=0) under ``runtime`` (flower: Flower's simulation engine; inprocess): wall seconds per
    exchange round, setup excluded (the first evaluation's wall time counts from the first round)."""
    from simulations.run import run_job  # noqa: PLC0415  torch, flwr: in the case's process only (common.py)

    cfg = compose_config(
        *fixed_epochs(*CELU_VARIANTS[variant]),
        f"dataset={dataset}",
        f"model={model}",
        "seed=0",
        "epochs=1",
        f"runtime={runtime}",
        WHOLE_TRAINING,
        *overrides,
    )
    with tempfile.TemporaryDirectory() as tmp:
        h = run_job(cfg, Path(tmp)).history
    return {
        "dataset": dataset,
        "variant": variant,
        "runtime": runtime,
        "rounds": h[-1].rounds,
        "wall_s": round(h[-1].wall_time_s, 2),
        "s_per_round": round(h[-1].wall_time_s / h[-1].rounds, 4),
    }


CASES = {"celu": celu_case, "flower": flower_case}


def _run_isolated(case: str, args: dict[str, Any]) -> dict[str, Any]:
    return run_isolated("simulations.bench.celu", f"CASES[{case!r}]", args)


def rounds_to(history: list, target: float, lower: bool) -> tuple[int, float] | None:
    """(rounds, modelled comm s) at the first evaluation at least as good as ``target``; None if never."""
    for rounds, metric, comm in history:
        if (metric <= target) if lower else (metric >= target):
            return rounds, comm
    return None


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"mean": float(np.mean(values)) if values else None, "std": float(np.std(values)) if values else None}


def summarize(dataset: str, runs: dict[str, list[dict]], flower: dict[str, float]) -> dict[str, Any]:
    """Per variant: rounds / modelled WAN s / Flower wall s to each seed's target, mean and std over the seeds
    that reached it, and the change in mean rounds against vanilla."""
    lower = lower_is_better(dataset)
    targets = {r["seed"]: r["history"][-1][1] for r in runs["vanilla"]}
    rows: dict[str, Any] = {}
    for v, per_seed in runs.items():
        reached = [(r["seed"], rounds_to(r["history"], targets[r["seed"]], lower)) for r in per_seed]
        ok = [x for _, x in reached if x is not None]
        s_round = flower.get(v)  # measured for the full variants only
        rounds = [x[0] for x in ok]
        rows[v] = {
            "reached": f"{len(ok)}/{len(reached)}",
            "rounds_to_target": rounds,
            "rounds": _stats(rounds),
            "wan_s": _stats([x[1] for x in ok]),
            "flower_wall_s": _stats([x[0] * s_round for x in ok]) if s_round else None,
            "end": [r["end"] for r in per_seed],
            "final_metric": [r["history"][-1][1] if r["history"] else None for r in per_seed],
            "best_metric": [
                (min if lower else max)(m for _, m, _ in r["history"]) if r["history"] else None for r in per_seed
            ],
            "local_steps_per_round": [r["local_steps_per_round"] for r in per_seed],
            "wall_s_inprocess": [r["wall_s"] for r in per_seed],
        }
    base = rows["vanilla"]["rounds"]["mean"]
    for row in rows.values():
        m = row["rounds"]["mean"]
        row["vs_vanilla"] = None if (m is None or not base) else round(m / base - 1, 3)
    return {"targets": targets, "lower_is_better": lower, "variants": rows}


def celu_suite(
    datasets: list[str],
    model: str,
    variants: list[str],
    seeds: int,
    epochs: int,
    eval_every: int,
    full: list[str],
    jobs: int = 1,
    flower_seed: int | None = 0,
    out: Path | None = None,
    grid_seeds: int | None = None,
) -> dict[str, Any]:
    """The comparison (see the module docstring); ``out``: written after every case, reused on a rerun. The
    grid (the variants not in ``full``) runs seed-major over ``grid_seeds`` (default: ``seeds``) seeds, so that
    a cut-off run still has every variant on its first seeds."""
    settings = {"model": model, "epochs": epochs, "eval_every": eval_every}
    done: dict[str, Any] = {}
    if out is not None and out.exists():
        old = json.loads(out.read_text())
        if {k: old.get(k) for k in settings} == settings:
            done = old.get("cases", {})
    result: dict[str, Any] = {
        "case": "celu",
        **settings,
        "seeds": seeds,
        "full_variants": full,
        "cases": done,
        "flower": done.get("_flower", {}),
        "datasets": {},
    }

    def save() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")

    def run(key: str, case: str, args: dict[str, Any]) -> dict[str, Any]:
        if key not in done:
            done[key] = _run_isolated(case, args)
            print(key, json.dumps({k: v for k, v in done[key].items() if k != "history"}), flush=True)
            save()
        return done[key]

    base = {"model": model, "epochs": epochs, "eval_every": eval_every}
    firsts = [v for v in full if v in variants and v != "vanilla"]
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # vanilla and the full variants, then Flower, then the grid
        vanilla = {
            (d, s): pool.submit(
                run, f"{d}/vanilla/{s}", "celu", {**base, "dataset": d, "variant": "vanilla", "seed": s}
            )
            for d in datasets
            for s in range(seeds)
        }
        targets = {k: f.result()["history"][-1][1] for k, f in vanilla.items()}

        def stage(names: list[str], n_seeds: int) -> None:
            futures = [
                pool.submit(
                    run,
                    f"{d}/{v}/{s}",
                    "celu",
                    {**base, "dataset": d, "variant": v, "seed": s, "stop_at": None if v in full else targets[(d, s)]},
                )
                for s in range(n_seeds)
                for v in names
                for d in datasets
            ]
            for f in futures:
                f.result()

        stage(firsts, seeds)
        flower = result["flower"]
        if flower_seed is not None:
            for d in datasets:
                for v in ("vanilla", "celu"):
                    for runtime in ("flower",):
                        key = f"{d}/{v}/{runtime}"
                        if key not in flower:
                            flower[key] = _run_isolated(
                                "flower", {"dataset": d, "model": model, "variant": v, "runtime": runtime}
                            )
                            print(key, json.dumps(flower[key]), flush=True)
                            done["_flower"] = flower
                            save()
        stage([v for v in variants if v not in full], seeds if grid_seeds is None else grid_seeds)
    finalize(result, datasets, variants)
    save()
    return result


def finalize(
    result: dict[str, Any], datasets: list[str] | None = None, variants: list[str] | None = None
) -> dict[str, Any]:
    """The per-dataset summaries from the cases present (a variant over the seeds it has run)."""
    done, flower = result["cases"], result["cases"].get("_flower", {})
    datasets = datasets or sorted({k.split("/")[0] for k in done if not k.startswith("_")})
    variants = variants or list(CELU_VARIANTS)
    result["datasets"] = {}
    for d in datasets:
        runs = {
            v: [done[f"{d}/{v}/{s}"] for s in range(result["seeds"]) if f"{d}/{v}/{s}" in done]
            for v in ["vanilla"] + [v for v in variants if v != "vanilla"]
        }
        runs = {v: r for v, r in runs.items() if r}
        s_round = {v: flower[f"{d}/{v}/flower"]["s_per_round"] for v in runs if f"{d}/{v}/flower" in flower}
        result["datasets"][d] = summarize(d, runs, s_round)
        result["datasets"][d]["flower_s_per_round"] = s_round
    return result


def table(result: dict[str, Any]) -> str:
    """The README's table (markdown) from a suite result."""
    lines = [
        "| dataset (target) | variant | reached | rounds to target | vs vanilla | modelled WAN s | Flower wall s "
        "| final metric |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(s, p=0):
        return "-" if not s or s["mean"] is None else f"{s['mean']:.{p}f} +- {s['std']:.{p}f}"

    for d, res in result["datasets"].items():
        t = np.mean(list(res["targets"].values()))
        for v, row in res["variants"].items():
            r, w, f = row["rounds"], row["wan_s"], row["flower_wall_s"]
            finals = [x for x, e in zip(row["final_metric"], row["end"]) if e != "target" and x is not None]
            final = f"{np.mean(finals):.4f}" if finals else "(stopped at target)"
            if "diverged" in row["end"]:
                final += f" ({row['end'].count('diverged')} diverged)"
            vs = "-" if row["vs_vanilla"] is None else f"{100 * row['vs_vanilla']:+.0f}%"
            lines.append(
                f"| {d} ({t:.4f}) | {v} | {row['reached']} | {fmt(r)} | {vs} | {fmt(w, 1)} | {fmt(f, 0)} | {final} |"
            )
    return "\n".join(lines)


def plot(path: Path, png: Path, variants: tuple[str, ...] = FULL_VARIANTS) -> None:
    """Test metric vs exchange rounds, mean over seeds, of the full variants on every dataset."""
    # matplotlib: only the plot subcommand draws (the suite's cases never import it)
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    result = json.loads(path.read_text())
    cases = result["cases"]
    names = list(result["datasets"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    labels = {"vanilla": "vanilla TP-Join-SGD", "fedbcd": "FedBCD (W=1, R=5)", "celu": "CELU (W=5, R=5, xi=60)"}
    for ax, d in zip(axes[0], names):
        res = result["datasets"][d]
        for v in variants:
            hs = [cases[k]["history"] for k in cases if k.startswith(f"{d}/{v}/") and k.split("/")[-1].isdigit()]
            if not hs:
                continue
            n = min(len(h) for h in hs)
            x = [r for r, _, _ in hs[0][:n]]
            y = np.array([[m for _, m, _ in h[:n]] for h in hs])
            (line,) = ax.plot(x, y.mean(axis=0), label=f"{labels.get(v, v)} ({len(hs)} seeds)")
            if len(hs) > 1:
                ax.fill_between(x, y.min(axis=0), y.max(axis=0), color=line.get_color(), alpha=0.2)
        t = np.mean(list(res["targets"].values()))
        ax.axhline(t, color="gray", ls="--", lw=1, label=f"target (vanilla's final) {t:.4f}")
        lo = float(
            np.percentile(
                [
                    m
                    for k in cases
                    if k.startswith(f"{d}/") and k.split("/")[-1].isdigit()
                    for _, m, _ in cases[k]["history"]
                ],
                2,
            )
        )
        ax.set_title(f"{d}, model={result['model']}")
        ax.set_xlabel("exchange rounds")
        ax.set_ylabel("test RMSE" if res["lower_is_better"] else "test accuracy")
        if res["lower_is_better"]:
            ax.set_ylim(lo - 0.01, max(1.1, t + 0.1))
        else:
            ax.set_ylim(max(0.5, t - 0.03), min(1.0, t + 0.004))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("test metric vs exchange rounds (mean over seeds; band: min-max over seeds)", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def run_suite(a: Any) -> dict[str, Any]:
    """``python -m simulations.bench celu``'s entry (argparse namespace of simulations.bench)."""
    datasets = a.datasets.split(",")
    out = a.out or Path("bench_results") / "celu.json"
    result = celu_suite(
        datasets,
        a.model,
        a.variants.split(","),
        a.seeds,
        a.epochs if a.epochs != 3 else 2,
        a.eval_every,
        a.full_variants.split(","),
        a.jobs,
        None if a.flower_seed < 0 else a.flower_seed,
        out,
        a.grid_seeds,
    )
    print(table(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "plot":
        plot(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        print(table(json.loads(Path(sys.argv[2]).read_text())))
    elif len(sys.argv) == 3 and sys.argv[1] == "summarize":  # a cut-off suite: summarize the cases it has
        path = Path(sys.argv[2])
        path.write_text(json.dumps(finalize(json.loads(path.read_text())), indent=1) + "\n")
        print(table(json.loads(path.read_text())))
    else:
        sys.exit(__doc__)
