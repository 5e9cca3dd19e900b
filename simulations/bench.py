"""Benchmarks: speed and memory goals, measured and written to JSON (quoted in the README).

    python -m simulations.bench mapping [--n-joined 10000000]      -> bench_results/mapping.json
    python -m simulations.bench loj [--epochs 3]                   -> bench_results/loj.json
    python -m simulations.bench flower                             -> bench_results/flower.json
    python -m simulations.bench coreset --dataset D --task ridge|kmeans [--reps 10] [--ms 500,1000,2000,4000]
                                                                   -> bench_results/coreset-D-TASK.json

Each case runs in a fresh subprocess so that its peak RSS (ru_maxrss) is its own; the cases of one
invocation run one after the other on the same machine, so their ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tpflower.datasets import synthetic
from tpflower.mapping import build_mapping, project_keys
from tpflower.schema import parse_spec, validate_tables

SECRET = b"bench-secret"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def mapping_case(n_joined: int, dim_rows: tuple[int, ...] = (1_000_000, 100_000, 1_000)) -> dict[str, Any]:
    """Table mapping for a synthetic star schema: a fact table of n_joined rows and 3 many-to-one dimensions,
    so N = n_joined. Times the clients' digests and the server's join separately."""
    kwargs = dict(schema="star", n_fact=n_joined, dim_rows=list(dim_rows), n_dims=3, widths=2, fanout=1, seed=0)
    t0 = time.perf_counter()
    frames = synthetic.generate(**kwargs)
    t_gen = time.perf_counter() - t0
    rss_data = _peak_rss_mb()
    spec = validate_tables(parse_spec({"name": "bench-star", **synthetic.describe(**kwargs)}), frames)
    t0 = time.perf_counter()
    projections = {
        t: [project_keys(spec, t, frames[t], np.arange(len(frames[t])), SECRET)] for t in spec.table_names
    }
    t_digest = time.perf_counter() - t0
    t0 = time.perf_counter()
    mapping = build_mapping(spec, projections)
    G = {t: mapping.G(t) for t in spec.table_names}
    t_join = time.perf_counter() - t0
    assert mapping.N == n_joined and all(int(g.sum()) == n_joined for g in G.values())
    return {
        "case": "mapping_star",
        "tables": {t: len(f) for t, f in frames.items()},
        "n_joined": mapping.N,
        "generate_s": round(t_gen, 2),
        "digest_s": round(t_digest, 2),
        "join_s": round(t_join, 2),
        "mapping_total_s": round(t_digest + t_join, 2),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "rss_after_generate_mb": round(rss_data, 1),
    }


def algorithm_case(algorithm: str, dataset: str, epochs: int, runtime: str = "inprocess", overrides: tuple = ()) -> dict[str, Any]:
    """One training run; per-epoch wall time from the run's own history (setup excluded for federated runs)."""
    import tempfile

    from simulations.config import compose_config
    from simulations.run import run_job

    cfg = compose_config(f"algorithm={algorithm}", f"dataset={dataset}", f"epochs={epochs}", f"runtime={runtime}", *overrides)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_job(cfg, Path(tmp))
    total = time.perf_counter() - t0
    h = res.history
    per_epoch = (h[-1].wall_time_s - h[0].wall_time_s) / (len(h) - 1) if len(h) > 1 else h[-1].wall_time_s
    return {
        "algorithm": res.algorithm,
        "dataset": dataset,
        "runtime": runtime if algorithm != "centralized" else "-",
        "epochs": len(h),
        "epoch_wall_s": round(per_epoch, 3),
        "total_wall_s": round(total, 1),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "test_metric": h[-1].test_metric,
        "rounds_per_epoch": (h[-1].rounds - h[0].rounds) / max(len(h) - 1, 1),
        "bytes_per_epoch": (h[-1].bytes_up + h[-1].bytes_down - h[0].bytes_up - h[0].bytes_down) / max(len(h) - 1, 1),
    }


def loj_suite(epochs: int = 3) -> dict[str, Any]:
    """Issue 3's benchmark: every LoJ algorithm and the centralized baseline on movielens and nycflights13,
    and the same ADMM / SGD epochs under Flower's simulation engine vs called in-process."""
    runs = []
    for dataset in ("movielens", "nycflights13"):
        for algorithm in ("centralized", "admm", "sgd", "vfl_admm", "vfl_sgd"):
            runs.append(_run_isolated("algorithm", {"algorithm": algorithm, "dataset": dataset, "epochs": epochs}))
            print(json.dumps(runs[-1]), flush=True)
    overhead = []
    for algorithm, dataset, ep in (("admm", "movielens", 6), ("admm", "nycflights13", 6), ("sgd", "movielens", 2)):
        pair = {}
        for runtime in ("inprocess", "flower"):
            pair[runtime] = _run_isolated(
                "algorithm", {"algorithm": algorithm, "dataset": dataset, "epochs": ep, "runtime": runtime}
            )
            print(json.dumps(pair[runtime]), flush=True)
        overhead.append(
            {
                "algorithm": pair["flower"]["algorithm"],
                "dataset": dataset,
                "epoch_wall_s_inprocess": pair["inprocess"]["epoch_wall_s"],
                "epoch_wall_s_flower": pair["flower"]["epoch_wall_s"],
                "flower_over_inprocess": round(pair["flower"]["epoch_wall_s"] / pair["inprocess"]["epoch_wall_s"], 2),
                "rounds_per_epoch": pair["flower"]["rounds_per_epoch"],
                "flower_s_per_round": round(
                    (pair["flower"]["epoch_wall_s"] - pair["inprocess"]["epoch_wall_s"]) / pair["flower"]["rounds_per_epoch"], 4
                ),
            }
        )
    return {"case": "loj", "epochs": epochs, "runs": runs, "flower_overhead": overhead}


def empty_rounds_case(rounds: int = 200, dataset: str = "movielens") -> dict[str, Any]:
    """The cost of the transport alone: ``rounds`` rounds of the hello query (no table work) to every node,
    under Flower's simulation engine (with tpflower's fetch adapter) and in-process."""
    import tempfile

    from flwr.app import Message
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from simulations.client_app import client_app_for
    from simulations.config import compose_config
    from simulations.federated import flower_logs_to, in_process_contexts
    from simulations.flower_adapter import install_fast_fetch
    from simulations.server_app import make_strategy
    from strategies.base import TablePuppetStrategy
    from strategies.protocol import HELLO_PHASE, DirectTransport
    from tpflower.records import pack_payload

    cfg = compose_config(f"dataset={dataset}")
    clients = make_strategy(cfg, None, log=lambda _: None).clients
    timing: dict[str, float] = {}

    class EmptyRounds(TablePuppetStrategy):
        def protocol(self) -> None:
            assert self.transport is not None
            t0 = time.perf_counter()
            for _ in range(rounds):
                self.transport.exchange([Message(pack_payload({}, {"phase": HELLO_PHASE}), node, "query")
                                         for node in self.keys])
            timing[self.runtime] = (time.perf_counter() - t0) / rounds

    inproc = EmptyRounds(clients, log=lambda _: None)
    inproc.runtime = "inprocess"
    contexts = in_process_contexts(inproc)
    inproc.run(DirectTransport(client_app_for(cfg), {c.node_id: c for c in contexts.values()}))

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:
        strategy = EmptyRounds(clients, log=lambda _: None)
        strategy.runtime = "flower"
        strategy.start(grid)

    install_fast_fetch()
    with tempfile.TemporaryDirectory() as tmp, flower_logs_to(Path(tmp) / "flower.log"):
        run_simulation(server_app=app, client_app=client_app_for(cfg), num_supernodes=len(clients),
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"logging_level": 40, "log_to_driver": False}})
    return {"case": "empty_rounds", "dataset": dataset, "nodes": len(clients), "rounds": rounds,
            "s_per_round_flower": round(timing["flower"], 5), "s_per_round_inprocess": round(timing["inprocess"], 5)}


def first_epoch_case(overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """`make run` as a user sees it: seconds from process start to the first epoch line and to the end."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "simulations.run", *overrides, f"hydra.run.dir={tmp}"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        first = None
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if first is None and line.startswith("epoch "):
                first = time.perf_counter() - t0
        proc.wait()
        total = time.perf_counter() - t0
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{cmd} failed: {proc.stderr.read() if proc.stderr else ''}")
    return {"case": "first_epoch", "command": "python -m simulations.run " + " ".join(overrides),
            "first_epoch_line_s": round(first, 2), "total_s": round(total, 2), "lines": len(lines)}


def flower_suite() -> dict[str, Any]:
    """Issue 9's benchmark: Flower's simulation engine vs in-process per epoch (TP-Join-SGD, TP-Join-ADMM on
    movielens and nycflights13), the cost of an empty round, and `make run`'s time to its first epoch line."""
    pairs = []
    for algorithm, dataset, ep in (("sgd", "movielens", 2), ("sgd", "nycflights13", 2),
                                   ("admm", "movielens", 6), ("admm", "nycflights13", 6)):
        pair = {}
        for runtime in ("inprocess", "flower"):
            pair[runtime] = _run_isolated(
                "algorithm", {"algorithm": algorithm, "dataset": dataset, "epochs": ep, "runtime": runtime})
            print(json.dumps(pair[runtime]), flush=True)
        pairs.append({
            "algorithm": pair["flower"]["algorithm"],
            "dataset": dataset,
            "rounds_per_epoch": pair["flower"]["rounds_per_epoch"],
            "epoch_wall_s_inprocess": pair["inprocess"]["epoch_wall_s"],
            "epoch_wall_s_flower": pair["flower"]["epoch_wall_s"],
            "flower_over_inprocess": round(pair["flower"]["epoch_wall_s"] / pair["inprocess"]["epoch_wall_s"], 2),
            "same_test_metric": abs(pair["flower"]["test_metric"] - pair["inprocess"]["test_metric"]) < 1e-6,
        })
    empty = _run_isolated("empty_rounds", {})
    print(json.dumps(empty), flush=True)
    first = _run_isolated("first_epoch", {})
    print(json.dumps(first), flush=True)
    return {"case": "flower", "per_epoch": pairs, "empty_rounds": empty, "first_epoch": first}


CASES = {"mapping": mapping_case, "algorithm": algorithm_case, "empty_rounds": empty_rounds_case,
         "first_epoch": first_epoch_case}


def _run_quiet(*overrides: str) -> Any:
    """One in-process run (the same strategy and ClientApp as under Flower), its results record."""
    from simulations.config import compose_config
    from simulations.federated import run_in_process

    return run_in_process(compose_config(*overrides), None, log=lambda _: None).strategy.results


def _summary(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "n": len(a)}


def coreset_case(dataset: str, task: str, ms: list[int], reps: int, epochs: int = 10, full_reps: int = 3) -> dict[str, Any]:
    """Issue 13 (seed 004 Table 1 over joins): coreset vs uniform sampling at each m, ``reps`` repetitions (seeds
    0..reps-1), next to the full data: ridge (test RMSE; full = TP-Join-ADMM ``epochs`` epochs and the exact
    ridge) or k-means (cost per point on the full join; full = DistDim, ``full_reps`` seeds). Bytes: measured
    payload bytes of all training rounds (construction included; evaluation rounds excluded)."""
    t0 = time.perf_counter()
    base = (f"dataset={dataset}", f"epochs={epochs}")
    total_bytes = lambda r: r.history[-1].bytes_up + r.history[-1].bytes_down  # noqa: E731
    full: dict[str, Any] = {}
    if task == "ridge":
        admm = _run_quiet(*base, "algorithm=admm")
        import tempfile

        from simulations.config import compose_config
        from simulations.run import run_job

        with tempfile.TemporaryDirectory() as tmp:
            exact = run_job(compose_config(*base, "algorithm=centralized", "algorithm.solver=exact"), Path(tmp))
        full = {"tp_join_admm": {"metric": admm.history[-1].test_metric, "bytes": total_bytes(admm),
                                 "rounds": admm.history[-1].rounds},
                "exact_ridge": {"metric": exact.history[-1].test_metric}}
        algorithm, ref_bytes = "coreset", total_bytes(admm)
    else:
        runs = [_run_quiet(*base, "algorithm=kmeans", f"seed={s}") for s in range(full_reps)]
        full = {"distdim": {"metric": _summary([r.history[-1].test_metric for r in runs]),
                            "bytes": total_bytes(runs[0]), "rounds": runs[0].history[-1].rounds}}
        algorithm, ref_bytes = "coreset_kmeans", total_bytes(runs[0])
    rows = []
    for m in ms:
        for sampling in ("sensitivity", "uniform"):
            metric, nbytes, cbytes = [], [], []
            for rep in range(reps):
                r = _run_quiet(*base, f"algorithm={algorithm}", f"algorithm.m={m}", f"algorithm.sampling={sampling}",
                               f"seed={rep}")
                metric.append(r.history[-1].test_metric)
                nbytes.append(total_bytes(r))
                cbytes.append(r.history[-1].extra["construction_bytes"])
            rows.append({"m": m, "sampling": sampling, "metric": _summary(metric), "bytes": _summary(nbytes),
                         "construction_bytes": _summary(cbytes), "less_traffic_than_full": ref_bytes / np.mean(nbytes),
                         "values": metric})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "values"}), file=sys.stderr, flush=True)
    return {"case": f"coreset-{dataset}-{task}", "dataset": dataset, "task": task, "reps": reps, "epochs": epochs,
            "full": full, "runs": rows, "wall_s": round(time.perf_counter() - t0, 1)}


CASES["coreset"] = coreset_case


SUITES = {"mapping": lambda a: _run_isolated("mapping", {"n_joined": a.n_joined}), "loj": lambda a: loj_suite(a.epochs),
          "flower": lambda a: flower_suite(),
          "coreset": lambda a: _run_isolated("coreset", {"dataset": a.dataset, "task": a.task, "reps": a.reps,
                                                         "ms": [int(x) for x in a.ms.split(",")]})}


def _run_isolated(case: str, args: dict[str, Any]) -> dict[str, Any]:
    code = (
        "import json,sys; from simulations.bench import CASES; "
        f"print(json.dumps(CASES[{case!r}](**json.loads(sys.argv[1]))))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark case {case} {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(SUITES))
    ap.add_argument("--n-joined", type=int, default=10_000_000, help="mapping: joined rows")
    ap.add_argument("--epochs", type=int, default=3, help="loj: epochs per run")
    ap.add_argument("--dataset", default="movielens", help="coreset: the dataset")
    ap.add_argument("--task", choices=("ridge", "kmeans"), default="ridge", help="coreset: ridge or k-means")
    ap.add_argument("--reps", type=int, default=10, help="coreset: repetitions per m and sampling")
    ap.add_argument("--ms", default="500,1000,2000,4000", help="coreset: coreset sizes")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    result = SUITES[a.case](a)
    result["machine"] = {"cpus": __import__("os").cpu_count(), "python": platform.python_version()}
    name = f"coreset-{a.dataset}-{a.task}" if a.case == "coreset" else a.case
    out = a.out or Path("bench_results") / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
