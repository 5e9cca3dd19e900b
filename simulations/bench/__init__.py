"""Benchmarks: speed and memory goals, measured and written to JSON (quoted in the README).

    python -m simulations.bench mapping [--n-joined 10000000]      -> bench_results/mapping.json
    python -m simulations.bench loj [--epochs 3]                   -> bench_results/loj.json
    python -m simulations.bench flower                             -> bench_results/flower.json
    python -m simulations.bench celu [--datasets ...] [--seeds 3]  -> bench_results/celu.json (simulations/bench/celu.py)
    python -m simulations.bench convergence [--epochs 10] [--mlp]  -> bench_results/convergence.json
    python -m simulations.bench scale [--scale-n 1e6,1e7,4e7,1e8] [--server-n 1e7] [--mapping-n 100000000]
                                                                  -> bench_results/scale.json
    python -m simulations.bench deploy [--datasets movielens,star_2m] -> bench_results/deploy.json
    python -m simulations.bench coreset --dataset D --task ridge|kmeans [--reps 10] [--ms 500,1000,2000,4000]
                                                                  -> bench_results/coreset-D-TASK.json
    python -m simulations.bench privacy [--jobs 2]             -> bench_results/privacy.json (simulations/bench/privacy.py)

Each case runs in a fresh subprocess so that its peak RSS (ru_maxrss) is its own; the cases of one
invocation run one after the other on the same machine, so their ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import pickle
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

    from tpflower.config import compose_config
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

    from tpflower.app.client_app import client_app_for
    from tpflower.config import compose_config
    from simulations.federated import flower_logs_to, in_process_contexts
    from tpflower.app.flower_patch import install_fast_fetch
    from tpflower.app.server_app import make_strategy
    from strategies.base import TablePuppetStrategy
    from strategies.transport import DirectTransport
    from tpflower.records import HELLO_PHASE
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


#: CELU-VFL's comparison lives in simulations/bench/celu.py (`python -m simulations.bench celu`)


#: issue 10: the datasets of the convergence table (overrides); synthetic labels in three units
CONVERGENCE_DATA: dict[str, tuple[str, ...]] = {
    "movielens": ("dataset=movielens",),
    # the weather shards hold fewer than 2048 wind_gust values: their owners lower min_sketch_rows for the union
    "nycflights13": ("dataset=nycflights13", "min_sketch_rows=1000"),
    **{f"synthetic_{schema}_x{scale}": ("dataset=synthetic", f"dataset.loader.schema={schema}",
                                         f"+dataset.loader.label_scale={scale}")
       for schema in ("star", "chain", "snowflake") for scale in (1, 100, 10000)},
}


def convergence_case(data: str, overrides: list[str], epochs: int) -> dict[str, Any]:
    """Shipped defaults: the test metric per epoch of one run (in-process), and where and why it stopped."""
    from tpflower.config import compose_config
    from simulations.federated import run_in_process

    cfg = compose_config(*CONVERGENCE_DATA[data], f"epochs={epochs}", *overrides)
    t0 = time.perf_counter()
    if str(cfg.algorithm.name) == "centralized":
        from strategies.centralized import train_centralized
        from tpflower.owner import simulation_secret
        from tpflower.relation import load_relation
        from tpflower.results import new_run_results

        rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
        results = new_run_results(cfg, "centralized", rel.spec, rel.mapping)
        train_centralized(cfg, rel, results, log=lambda _: None)
    else:
        results = run_in_process(cfg, None, log=lambda _: None).strategy.results
    return {"metric": [h.test_metric for h in results.history], "stopped": results.stopped,
            "wall_s": round(time.perf_counter() - t0, 1)}


def epochs_within(metric: list[float], target: float, rel: float = 0.01) -> int | None:
    """The first epoch (1-based) whose metric is within ``rel`` above ``target``; None if none is."""
    return next((k + 1 for k, m in enumerate(metric) if m <= (1 + rel) * target), None)


def convergence_suite(epochs: int, datasets: list[str], mlp: bool) -> dict[str, Any]:
    """Issue 10's table: TP-Join-ADMM (linear) against the exact ridge solution and TP-UCQ-ADMM against
    TP-Join-ADMM, shipped defaults, ``epochs`` at most; with ``mlp`` also MLP vs linear for every algorithm."""
    rows: dict[str, Any] = {}
    for data in datasets:
        exact = _run_isolated("convergence", {"data": data, "overrides": ["algorithm=centralized", "algorithm.solver=exact"], "epochs": 1})
        join = _run_isolated("convergence", {"data": data, "overrides": ["algorithm=admm"], "epochs": epochs})
        ucq = _run_isolated("convergence", {"data": data, "overrides": ["algorithm=admm", "scenario=ucq"], "epochs": epochs})
        ref, j, u = exact["metric"][-1], join["metric"], ucq["metric"]
        rows[data] = {
            "exact_rmse": ref,
            "join": {"final": j[-1], "gap_to_exact": round(j[-1] / ref - 1, 5), "epochs_to_1pct": epochs_within(j, ref),
                     "stopped": join["stopped"], "history": j},
            "ucq": {"final": u[-1], "gap_to_join": round(u[-1] / j[-1] - 1, 5), "gap_to_exact": round(u[-1] / ref - 1, 5),
                    "epochs_to_1pct_of_exact": epochs_within(u, ref), "stopped": ucq["stopped"], "history": u},
        }
        print(data, json.dumps({k: v for k, v in rows[data].items()}, default=str)[:400], flush=True)
    out: dict[str, Any] = {"case": "convergence", "epochs": epochs, "datasets": rows}
    if mlp:
        table: dict[str, Any] = {}
        for data in ("movielens", "nycflights13"):
            for alg, extra in (("centralized", ["algorithm=centralized"]), ("tp_join_sgd", ["algorithm=sgd"]),
                               ("tp_join_admm", ["algorithm=admm"]), ("tp_ucq_sgd", ["algorithm=sgd", "scenario=ucq"]),
                               ("tp_ucq_admm", ["algorithm=admm", "scenario=ucq"])):
                for model in ("linear", "mlp"):
                    r = _run_isolated("convergence", {"data": data, "overrides": [*extra, f"model={model}"], "epochs": epochs})
                    table[f"{data}/{alg}/{model}"] = {"final": r["metric"][-1], "history": r["metric"], "wall_s": r["wall_s"]}
                    print(data, alg, model, r["metric"][-1], flush=True)
        out["mlp_vs_linear"] = table
    return out


# ------------------------------------------------------------------------------------------------ scale (issue 14)

#: the synthetic star schema of the scale benchmark: a fact table and 3 dimensions with 2 rows per key, so every
#: fact row joins 2 x 2 x 2 rows: N = 8 n_fact (4 tables; conf/dataset/synthetic.yaml's widths and dim_rows)
SCALE_DIMS, SCALE_FANOUT = 3, 2
SCALE_N = (1_000_000, 10_000_000, 40_000_000, 100_000_000)


def scale_loader(n_joined: int) -> dict[str, Any]:
    """The synthetic loader settings of the scale benchmark at N = ``n_joined`` joined rows."""
    return {"name": "synthetic", "schema": "star", "n_fact": n_joined // SCALE_FANOUT**SCALE_DIMS, "n_dims": SCALE_DIMS,
            "fanout": SCALE_FANOUT, "dim_rows": 200, "widths": 4, "seed": 0}


def scale_overrides(n_joined: int) -> list[str]:
    """Hydra overrides selecting that dataset (conf/dataset/synthetic.yaml with a star schema)."""
    loader = scale_loader(n_joined)
    return ["dataset=synthetic", *(f"dataset.loader.{k}={v}" for k, v in loader.items() if k != "name")]


def _scale_projections(n_joined: int):
    """The clients' part of the keys round, each table made alone: the spec, every table's key projection, the
    label table's labels and every table's row count (what the server receives)."""
    from tpflower.datasets import load_spec, load_tables

    loader = scale_loader(n_joined)
    kwargs = {k: v for k, v in loader.items() if k != "name"}
    spec = load_spec({"name": "scale", "loader": loader, "split": {"test_fraction": 0.15, "seed": 42}})
    projections, n_rows, y_rows = {}, {}, None
    for t in spec.table_names:
        frame = load_tables("synthetic", kwargs, (t,))[t]
        projections[t] = [project_keys(spec, t, frame, np.arange(len(frame)), SECRET)]
        n_rows[t] = len(frame)
        if t == spec.label_table:
            y_rows = frame[spec.label.column].to_numpy(dtype=np.float64)
        del frame
    return spec, projections, n_rows, y_rows


def server_state_case(n_joined: int, precision: str = "float32", epochs: int = 2) -> dict[str, Any]:
    """TP-Join-ADMM's server side (d_c = 1, 4 tables) called directly, as strategies/loj.py's setup and
    strategies/join_admm.py's epoch call it: mapping build, train/test partition, labels, ADMM state, then
    epochs of scatter + update + test predictions. numpy allocations traced (tracemalloc): bytes per joined row
    of the mapping, of everything the server keeps after setup and an epoch, and the peaks of the build and of
    an epoch."""
    import tempfile
    import tracemalloc

    from tpflower.checkpoint import atomic_write
    from strategies.join_admm import ADMMServer
    from tpflower.batches import joined_predictions
    from tpflower.losses import LabelScale, metrics
    from tpflower.mapping import holdout_mask

    spec, projections, n_rows, y_rows = _scale_projections(n_joined)
    label = spec.label_table
    dtype = np.float32 if precision == "float32" else np.float64
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    t0 = time.perf_counter()
    mapping = build_mapping(spec, projections)
    t_build = time.perf_counter() - t0
    _, build_peak = tracemalloc.get_traced_memory()
    mapping_bytes = sum(p.nbytes for p in mapping.p.values())
    del projections  # the server drops the digests once the mapping is built (LoJStrategy.setup)
    tracemalloc.reset_peak()
    N = mapping.N
    train, test = mapping.partition(holdout_mask(spec, n_rows[label])[mapping.p[label]])
    y_train = y_rows[train.p[label]]
    scale = LabelScale.fit("regression", y_train)
    y_train = scale.scaled(y_train).astype(dtype, copy=False)
    y_test = y_rows[test.p[label]]
    admm = ADMMServer("regression", y_train, train, 1, 3.0, dtype=dtype)
    G = admm.G()
    h = {t: np.zeros((n, 1), dtype=dtype) for t, n in n_rows.items()}
    admm.update(h)
    _, setup_peak = tracemalloc.get_traced_memory()
    rng = np.random.default_rng(0)
    epoch_s, epoch_peak = [], 0
    for _ in range(epochs):
        tracemalloc.reset_peak()
        t0 = time.perf_counter()
        Y = admm.scatter(h)
        h = {t: (0.1 * rng.standard_normal((n, 1))).astype(dtype) for t, n in n_rows.items()}  # the clients' reply
        admm.update(h)
        admm.train_loss()
        H_test = joined_predictions(test.p, h)
        metrics("regression", scale.to_label(H_test), y_test)
        del H_test, Y
        epoch_s.append(time.perf_counter() - t0)
        epoch_peak = max(epoch_peak, tracemalloc.get_traced_memory()[1])
    state, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del G
    # what the per-epoch checkpoint pickles of it (strategies/checkpoint.py): the views pickle as ranges of the base
    t0 = time.perf_counter()
    blob = pickle.dumps({"mapping": mapping, "train": train, "test": test, "y_train": y_train, "y_test": y_test,
                         "loop": {"admm": admm, "h": h}}, protocol=pickle.HIGHEST_PROTOCOL)
    t_pickle, checkpoint_bytes = time.perf_counter() - t0, len(blob)
    with tempfile.TemporaryDirectory() as tmp:  # and writes (fsync'ed, tpflower.checkpoint.atomic_write)
        t0 = time.perf_counter()
        atomic_write(Path(tmp) / "checkpoint.pkl", blob)
        t_write = time.perf_counter() - t0
    del blob
    per_row = lambda b: round((b - base) / N, 1)  # noqa: E731
    arrays = {"mapping p (all N rows, train + test views)": mapping_bytes, "y_train": y_train.nbytes,
              "y_test": y_test.nbytes, "ADMM lambda": admm.lam.nbytes, "ADMM D = z - H": admm.D.nbytes}
    return {
        "case": "server_state", "n_joined": N, "n_train": train.N, "tables": n_rows, "precision": precision,
        "index_dtype": str(mapping.p[label].dtype),
        "mapping_bytes_per_row": round(mapping_bytes / N, 1),
        "state_bytes_per_row": per_row(state),
        "arrays_bytes_per_row": {k: round(v / N, 2) for k, v in arrays.items()},
        "build_peak_bytes_per_row": per_row(build_peak),
        "setup_peak_bytes_per_row": per_row(setup_peak),
        "epoch_peak_bytes_per_row": per_row(epoch_peak),
        "build_s": round(t_build, 2),
        "epoch_s": round(float(np.mean(epoch_s)), 3),
        "checkpoint_bytes_per_row": round(checkpoint_bytes / N, 1), "checkpoint_pickle_s": round(t_pickle, 2),
        "checkpoint_write_s": round(t_write, 2),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }


def mapping_scale_case(n_joined: int) -> dict[str, Any]:
    """The table mapping alone at N joined rows of the scale schema: the server's build from the clients'
    digests (time, traced peak, process peak RSS; the clients' tables and digests are made in the same process
    first, one table at a time)."""
    import tracemalloc

    t0 = time.perf_counter()
    spec, projections, n_rows, _ = _scale_projections(n_joined)
    t_clients = time.perf_counter() - t0
    rss_before = _peak_rss_mb()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    t0 = time.perf_counter()
    mapping = build_mapping(spec, projections)
    G = {t: mapping.G(t) for t in spec.table_names}
    t_build = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(int(g.sum()) == mapping.N for g in G.values())
    digest_mb = sum(d.nbytes for ps in projections.values() for p in ps for d in p.arrays()) / 1e6
    return {"case": "mapping_scale", "n_joined": mapping.N, "tables": n_rows, "clients_generate_and_digest_s": round(t_clients, 1),
            "build_s": round(t_build, 2), "digests_received_mb": round(digest_mb, 1),
            "result_mb": round(sum(p.nbytes for p in mapping.p.values()) / 1e6, 1),
            "build_traced_peak_mb": round((peak - base) / 1e6, 1),
            "build_traced_peak_bytes_per_row": round((peak - base) / mapping.N, 1),
            "peak_rss_before_build_mb": round(rss_before, 1), "peak_rss_mb": round(_peak_rss_mb(), 1)}


class TreeMonitor:
    """Samples the memory of a process and all its descendants (from /proc) every ``interval`` seconds: the
    peaks of the root's RSS, of the tree's summed RSS and of its summed PSS (shared pages split between the
    processes that map them: Ray's object store counted once)."""

    def __init__(self, pid: int, interval: float = 0.5):
        import threading

        self.pid, self.interval = pid, interval
        self.peak = {"root_rss_mb": 0.0, "tree_rss_mb": 0.0, "tree_pss_mb": 0.0, "processes": 0}
        self.samples: list[tuple[float, float, float]] = []  # (t, root RSS, tree PSS) in MB
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            kids.setdefault(ppid, []).append(int(entry.name))
        return kids

    @staticmethod
    def _memory_kb(pid: int) -> tuple[int, int]:
        rss = pss = 0
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
        except OSError:
            pass
        return rss, pss

    def tree(self) -> list[int]:
        kids, out, todo = self._children(), [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += kids.get(p, [])
        return out

    def sample(self) -> None:
        pids = self.tree()
        mem = [self._memory_kb(p) for p in pids]
        root_rss = mem[0][0] / 1024
        tree_rss, tree_pss = sum(m[0] for m in mem) / 1024, sum(m[1] for m in mem) / 1024
        pk = self.peak
        pk["root_rss_mb"] = max(pk["root_rss_mb"], root_rss)
        pk["tree_rss_mb"] = max(pk["tree_rss_mb"], tree_rss)
        pk["tree_pss_mb"] = max(pk["tree_pss_mb"], tree_pss)
        pk["processes"] = max(pk["processes"], len(pids))
        self.samples.append((round(time.perf_counter() - self._t0, 1), round(root_rss), round(tree_pss)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {k: round(v, 1) for k, v in self.peak.items()}


def simulation_case(n_joined: int, epochs: int = 3, runtime: str = "flower", timeout_s: float = 3600) -> dict[str, Any]:
    """TP-Join-ADMM (linear, float32) on the scale schema at N joined rows: ``python -m simulations.run`` in a
    child process under Flower's simulation engine, its process tree watched (TreeMonitor). Setup time is the
    time from the start to the first epoch line minus that epoch's own time (imports, the data check, Ray's
    start, the clients' loads and digests, the keys round, the mapping, the ADMM setup round)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "simulations.run", "algorithm=admm", *scale_overrides(n_joined), f"epochs={epochs}",
               f"runtime={runtime}", "algorithm.tol=0", f"hydra.run.dir={tmp}"]
        t0 = time.perf_counter()
        # this checkout first on the path of the run and of Ray's workers (an installed copy elsewhere must not win)
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
        monitor = TreeMonitor(proc.pid)
        lines: list[tuple[float, str]] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((round(time.perf_counter() - t0, 2), line.rstrip()))
            print(f"[{lines[-1][0]:8.1f}s] {line.rstrip()}", flush=True)
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
        proc.wait()
        total = time.perf_counter() - t0
        peaks = monitor.stop()
        results = Path(tmp) / "results.json"
        history = json.loads(results.read_text())["history"] if results.is_file() else []
    epoch_lines = [t for t, line in lines if line.startswith("epoch ")]
    mapping_line = next((t for t, line in lines if "joined rows N=" in line), None)
    walls = [h["wall_time_s"] for h in history]
    per_epoch = float(np.mean(np.diff(walls))) if len(walls) > 1 else (walls[0] if walls else None)
    out = {
        "case": "simulation", "n_joined": n_joined, "n_fact": scale_loader(n_joined)["n_fact"], "runtime": runtime,
        "epochs": len(history), "returncode": proc.returncode, "command": " ".join(cmd[1:-1]),
        "mapping_line_s": mapping_line, "first_epoch_line_s": epoch_lines[0] if epoch_lines else None,
        "setup_s": round(epoch_lines[0] - per_epoch, 1) if epoch_lines and per_epoch is not None else None,
        "epoch_s": round(per_epoch, 3) if per_epoch is not None else None,
        "epoch_wall_s": walls, "total_s": round(total, 1),
        "test_rmse": history[-1]["test_metric"] if history else None,
        "server_process_peak_rss_mb": peaks["root_rss_mb"],
        "tree_peak_pss_mb": peaks["tree_pss_mb"], "tree_peak_rss_sum_mb": peaks["tree_rss_mb"], "processes": peaks["processes"],
        "memory_timeline": monitor.samples[:: max(1, len(monitor.samples) // 200)],
    }
    if proc.returncode != 0:
        out["tail"] = [line for _, line in lines[-15:]]
    return out


def scale_suite(ns: list[int], epochs: int, mapping_n: int, server_ns: list[int]) -> dict[str, Any]:
    """Issue 14's benchmark: bytes per joined row of the server state (float32 and float64), TP-Join-ADMM under
    Flower's simulation engine at each N, and the mapping alone at ``mapping_n``. Each case in a fresh process."""
    out: dict[str, Any] = {"case": "scale", "schema": {k: v for k, v in scale_loader(0).items() if k != "n_fact"},
                           "server_state": [], "simulation": [], "mapping": None}
    for n in server_ns:
        for precision in ("float32", "float64"):
            out["server_state"].append(_run_isolated("server_state", {"n_joined": n, "precision": precision}))
            print(json.dumps(out["server_state"][-1]), flush=True)
    for n in ns:
        out["simulation"].append(simulation_case(n, epochs))
        print(json.dumps({k: v for k, v in out["simulation"][-1].items() if k != "memory_timeline"}), flush=True)
    if mapping_n:
        out["mapping"] = _run_isolated("mapping_scale", {"n_joined": mapping_n})
        print(json.dumps(out["mapping"]), flush=True)
    return out


CASES = {"mapping": mapping_case, "algorithm": algorithm_case, "empty_rounds": empty_rounds_case,
         "first_epoch": first_epoch_case,
         "convergence": convergence_case, "server_state": server_state_case,
         "mapping_scale": mapping_scale_case, "simulation": simulation_case}
SUITES = {"mapping": lambda a: _run_isolated("mapping", {"n_joined": a.n_joined}), "loj": lambda a: loj_suite(a.epochs),
          "flower": lambda a: flower_suite(),
          "convergence": lambda a: convergence_suite(a.epochs if a.epochs != 3 else 10,
                                                     a.datasets.split(",") if a.datasets != DEFAULT_CELU_DATA else list(CONVERGENCE_DATA),
                                                     a.mlp),
          "scale": lambda a: scale_suite(_ints(a.scale_n), a.epochs, a.mapping_n, _ints(a.server_n)),
          "celu": lambda a: __import__("simulations.bench.celu", fromlist=["run_suite"]).run_suite(a),
          "deploy": lambda a: _deploy(a),
          "coreset": lambda a: __import__("simulations.bench.coreset", fromlist=["_"]).coreset_suite(a),
          "privacy": lambda a: __import__("simulations.bench.privacy", fromlist=["_"]).privacy_suite(
              a.jobs, a.out or Path("bench_results/privacy.json"))}


def _deploy(a: argparse.Namespace) -> dict[str, Any]:
    from simulations.bench.deploy import DEPLOY_CASES, deploy_suite

    cases = a.datasets.split(",") if a.datasets != DEFAULT_CELU_DATA else list(DEPLOY_CASES)
    return deploy_suite(cases, a.epochs if a.epochs != 3 else 6)


DEFAULT_CELU_DATA = "movielens,nycflights13_delayed"


def _ints(text: str) -> list[int]:
    """A comma-separated list of integers ("" -> none); 1e6-style and 10_000_000 spellings accepted."""
    return [int(float(x)) for x in text.replace("_", "").split(",") if x.strip()]


def run_isolated(module: str, call: str, args: dict[str, Any], echo_stderr: bool = False) -> Any:
    """``module.<call>(**args)`` in a fresh Python process (its peak RSS its own): the JSON result it prints
    last. ``call`` is a function name or an item of one (``CASES['loj']``); ``echo_stderr`` passes the case's
    progress lines on."""
    code = f"import json,sys; import {module} as m; print(json.dumps(m.{call}(**json.loads(sys.argv[1]))))"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    if echo_stderr:
        sys.stderr.write(out.stderr[-20000:])
    if out.returncode != 0:
        raise RuntimeError(f"benchmark case {call} {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_isolated(case: str, args: dict[str, Any]) -> dict[str, Any]:
    return run_isolated("simulations.bench", f"CASES[{case!r}]", args)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(SUITES))
    ap.add_argument("--n-joined", type=int, default=10_000_000, help="mapping: joined rows")
    ap.add_argument("--epochs", type=int, default=3, help="loj: epochs per run (convergence: 10 unless given)")
    ap.add_argument("--datasets", default=DEFAULT_CELU_DATA, help="celu, convergence: datasets")
    ap.add_argument("--mlp", action="store_true", help="convergence: also MLP vs linear for every algorithm")
    ap.add_argument("--model", default="mlp", help="celu: model")
    ap.add_argument("--variants", default="vanilla,fedbcd,celu,celu_R3,celu_R8,celu_xi90,celu_xi30,celu_xi_off,celu_W3,celu_W8",
                    help="celu: variants (vanilla always runs)")
    ap.add_argument("--full-variants", default="vanilla,fedbcd,celu", help="celu: variants run to the end (others stop at the target)")
    ap.add_argument("--jobs", type=int, default=1, help="celu, privacy: cases at a time")
    ap.add_argument("--grid-seeds", type=int, default=None, help="celu: seeds of the grid variants (default: --seeds)")
    ap.add_argument("--flower-seed", type=int, default=0, help="celu: seed of the Flower wall-time runs (-1: none)")
    ap.add_argument("--seeds", type=int, default=3, help="celu: seeds per variant")
    ap.add_argument("--eval-every", type=int, default=10, help="celu: rounds between evaluations")
    ap.add_argument("--scale-n", default=",".join(str(n) for n in SCALE_N), help="scale: joined rows N of the Flower runs")
    ap.add_argument("--server-n", default="10000000", help="scale: N of the server-state measurement (float32 and float64)")
    ap.add_argument("--mapping-n", type=int, default=100_000_000, help="scale: N of the mapping alone (0: skip)")
    ap.add_argument("--dataset", default="movielens", help="coreset: the dataset")
    ap.add_argument("--task", choices=("ridge", "kmeans"), default="ridge", help="coreset: ridge or k-means")
    ap.add_argument("--reps", type=int, default=10, help="coreset: repetitions per m and sampling")
    ap.add_argument("--ms", default="500,1000,2000,4000", help="coreset: coreset sizes")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    result = SUITES[a.case](a)
    result["machine"] = {"cpus": __import__("os").cpu_count(), "python": platform.python_version()}
    out = a.out or Path("bench_results") / f"{result['case'] if a.case == 'coreset' else a.case}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
