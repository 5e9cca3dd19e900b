"""Scale: bytes per joined row of the server state (float32 and float64), TP-Join-ADMM under Flower's simulation
engine at each N, and the table mapping alone at a large N.

    python -m simulations.bench scale [--scale-n 1e6,1e7,4e7,1e8] [--server-n 1e7] [--mapping-n 100000000]
                                      [--fact-n 100000000] [--fact-mapping-n 100000000] [--budget-n 1e7]
                                      [--budget-families gbdt] [--gbdt-n 1e7] [--gbdt-trees 50]
                                                                  -> bench_results/scale.json

``--fact-n``: the shipped default (algorithm=auto: PCG) and TP-Join-ADMM, 2 epochs, on a fact table of that many
rows (fanout 1, so N = its rows), the process tree killed at 16 GB. ``--budget-n``: every family's server state
against its documented budget (simulations/bench/memory.py). A section given as empty (``--scale-n ''``,
``--mapping-n 0``, ...) keeps its entries of the last scale.json. The bench exits non-zero, after writing its
JSON, when a budget is exceeded or a fact-table run fails.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from simulations.bench.common import (
    REPO_ROOT,
    SCALE_FANOUT,
    SECRET,
    TreeMonitor,
    code_commit,
    peak_rss_mb,
    run_isolated,
    scale_loader,
    scale_overrides,
)
from simulations.bench.memory import FAMILIES, budget_fit, over_budget
from tpflower.batches import joined_predictions
from tpflower.datasets import load_spec, load_tables
from tpflower.mapping import build_mapping, holdout_mask, project_keys
from tpflower.results import PROGRESS_PREFIXES

#: the synthetic star schema of the scale benchmark: a fact table and 3 dimensions with 2 rows per key, so every
#: fact row joins 2 x 2 x 2 rows: N = 8 n_fact (4 tables; conf/dataset/synthetic.yaml's widths and dim_rows)
SCALE_N = (1_000_000, 10_000_000, 40_000_000, 100_000_000)
#: boosted trees' scale goal: this many trees on the star at N = 10M with at most GBDT_STATE_GOAL bytes of server
#: state (simulations/bench/memory.py's state walk at each evaluation) per joined row
GBDT_SCALE_TREES, GBDT_STATE_GOAL = 50, 64.0
#: the goal for the fanout-1 fact-table runs: the whole process tree under 16 GB (a run passing it is killed)
FACT_LIMIT_MB = 16_000


def _scale_projections(n_joined: int, fanout: int = SCALE_FANOUT):
    """The clients' part of the keys round, each table made alone: the spec, every table's key projection, the
    label table's labels and every table's row count (what the server receives)."""
    loader = scale_loader(n_joined, fanout)
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
    """TP-Join-ADMM's server side (d_c = 1, 4 tables) called directly, as strategies/setup.py's JoinSetup and
    strategies/join_admm.py's epoch call it: mapping build, train/test partition, labels, ADMM state, then
    epochs of scatter + update + test predictions. numpy allocations traced (tracemalloc): bytes per joined row
    of the mapping, of everything the server keeps after setup and an epoch, and the peaks of the build and of
    an epoch."""
    # torch and flwr (strategies.join_admm, tpflower.losses, tpflower.checkpoint): imported here, not at the
    # top, so that the mapping_scale case's peak RSS (same module, its own process) does not count them
    from strategies.join_admm import ADMMServer  # noqa: PLC0415
    from tpflower.files import atomic_write  # noqa: PLC0415
    from tpflower.losses import LabelScale, metrics  # noqa: PLC0415

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
    del projections  # the server drops the digests once the mapping is built (JoinSetup.build)
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
    blob = pickle.dumps(
        {
            "mapping": mapping,
            "train": train,
            "test": test,
            "y_train": y_train,
            "y_test": y_test,
            "loop": {"admm": admm, "h": h},
        },
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    t_pickle, checkpoint_bytes = time.perf_counter() - t0, len(blob)
    with tempfile.TemporaryDirectory() as tmp:  # and writes (fsync'ed, tpflower.files.atomic_write)
        t0 = time.perf_counter()
        atomic_write(Path(tmp) / "checkpoint.pkl", blob)
        t_write = time.perf_counter() - t0
    del blob
    per_row = lambda b: round((b - base) / N, 1)  # noqa: E731
    arrays = {
        "mapping p (all N rows, train + test views)": mapping_bytes,
        "y_train": y_train.nbytes,
        "y_test": y_test.nbytes,
        "ADMM lambda": admm.lam.nbytes,
        "ADMM D = z - H": admm.D.nbytes,
    }
    return {
        "case": "server_state",
        "n_joined": N,
        "n_train": train.N,
        "tables": n_rows,
        "precision": precision,
        "index_dtype": str(mapping.p[label].dtype),
        "mapping_bytes_per_row": round(mapping_bytes / N, 1),
        "state_bytes_per_row": per_row(state),
        "arrays_bytes_per_row": {k: round(v / N, 2) for k, v in arrays.items()},
        "build_peak_bytes_per_row": per_row(build_peak),
        "setup_peak_bytes_per_row": per_row(setup_peak),
        "epoch_peak_bytes_per_row": per_row(epoch_peak),
        "build_s": round(t_build, 2),
        "epoch_s": round(float(np.mean(epoch_s)), 3),
        "checkpoint_bytes_per_row": round(checkpoint_bytes / N, 1),
        "checkpoint_pickle_s": round(t_pickle, 2),
        "checkpoint_write_s": round(t_write, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def mapping_scale_case(n_joined: int, fanout: int = SCALE_FANOUT) -> dict[str, Any]:
    """The table mapping alone at N joined rows of the scale schema (``fanout`` 1: a fact table of N rows): the
    server's build from the clients' codes and digests (time, traced peak, process peak RSS; the clients' tables
    and key projections are made in the same process first, one table at a time)."""
    t0 = time.perf_counter()
    spec, projections, n_rows, _ = _scale_projections(n_joined, fanout)
    t_clients = time.perf_counter() - t0
    rss_before = peak_rss_mb()
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
    return {
        "case": "mapping_scale",
        "n_joined": mapping.N,
        "fanout": fanout,
        "keys_bytes_per_fact_row": round(digest_mb * 1e6 / n_rows[spec.label_table], 2),
        "tables": n_rows,
        "clients_generate_and_digest_s": round(t_clients, 1),
        "build_s": round(t_build, 2),
        "digests_received_mb": round(digest_mb, 1),
        "result_mb": round(sum(p.nbytes for p in mapping.p.values()) / 1e6, 1),
        "build_traced_peak_mb": round((peak - base) / 1e6, 1),
        "build_traced_peak_bytes_per_row": round((peak - base) / mapping.N, 1),
        "peak_rss_before_build_mb": round(rss_before, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def simulation_case(
    n_joined: int,
    epochs: int = 3,
    runtime: str = "flower",
    timeout_s: float = 3600,
    fanout: int = SCALE_FANOUT,
    limit_mb: float | None = None,
    overrides: Sequence[str] = (),
    algorithm: str = "admm",
) -> dict[str, Any]:
    """``algorithm`` (linear, float32; admm: TP-Join-ADMM with ``algorithm.tol=0``, auto: the shipped default,
    PCG, with its own settings) on the scale schema at N joined rows (``fanout`` 1: a fact table of N rows):
    ``python -m simulations.run`` in a child process under Flower's simulation engine, its process tree watched
    (TreeMonitor: PSS every 0.25 s, each process's share at the peak). Setup time is the
    time from the start to the first epoch line minus that epoch's own time (imports, the data check, Ray's
    start, the clients' loads and digests, the keys round, the mapping, the ADMM setup round)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "simulations.run",
            f"algorithm={algorithm}",
            *scale_overrides(n_joined, fanout),
            f"epochs={epochs}",
            f"runtime={runtime}",
            *(["algorithm.tol=0"] if algorithm == "admm" else []),
            *overrides,
            f"hydra.run.dir={tmp}",
        ]
        t0 = time.perf_counter()
        # this checkout first on the path of the run and of Ray's workers (an installed copy elsewhere must not win)
        root = REPO_ROOT
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=root,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
        )
        monitor = TreeMonitor(proc.pid, limit_mb=limit_mb)
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
        record = json.loads(results.read_text()) if results.is_file() else {}
        history = record.get("history", [])
    epoch_lines = [t for t, line in lines if line.startswith(PROGRESS_PREFIXES)]
    mapping_line = next((t for t, line in lines if "joined rows N=" in line), None)
    walls = [h["wall_time_s"] for h in history]
    per_epoch = float(np.mean(np.diff(walls))) if len(walls) > 1 else (walls[0] if walls else None)
    out = {
        "case": "simulation",
        "commit": code_commit(root),
        "algorithm": algorithm,
        "resolved": record.get("algorithm"),
        "n_joined": n_joined,
        "n_fact": scale_loader(n_joined, fanout)["n_fact"],
        "fanout": fanout,
        "runtime": runtime,
        "epochs": len(history),
        "returncode": proc.returncode,
        "command": " ".join(cmd[1:-1]),
        "mapping_line_s": mapping_line,
        "first_epoch_line_s": epoch_lines[0] if epoch_lines else None,
        "setup_s": round(epoch_lines[0] - per_epoch, 1) if epoch_lines and per_epoch is not None else None,
        "epoch_s": round(per_epoch, 3) if per_epoch is not None else None,
        "epoch_wall_s": walls,
        "total_s": round(total, 1),
        "test_rmse": history[-1]["test_metric"] if history else None,
        "server_process_peak_rss_mb": peaks["root_rss_mb"],
        "tree_peak_pss_mb": peaks["tree_pss_mb"],
        "tree_peak_rss_sum_mb": peaks["tree_rss_mb"],
        "processes": peaks["processes"],
        "killed_at_tree_pss_mb": monitor.killed_at_mb,
        "peak_by_process": monitor.at_peak(),
        "process_peaks": monitor.processes(),
        "memory_timeline": monitor.samples[:: max(1, len(monitor.samples) // 200)],
    }
    if proc.returncode != 0:
        out["tail"] = [line for _, line in lines[-15:]]
    return out


def scale_suite(
    ns: list[int],
    epochs: int,
    mapping_n: int,
    server_ns: list[int],
    fact_ns: Sequence[int] = (),
    fact_epochs: int = 2,
    fact_mapping_ns: Sequence[int] = (),
    budget_ns: Sequence[int] = (),
    fact_algorithms: Sequence[str] = ("auto", "admm"),
    budget_families: Sequence[str] = (),
    gbdt_ns: Sequence[int] = (),
    gbdt_trees: int = GBDT_SCALE_TREES,
) -> dict[str, Any]:
    """Bytes per joined row of the server state (float32 and float64), TP-Join-ADMM under
    Flower's simulation engine at each N, the mapping alone at ``mapping_n``, and TP-Join-ADMM on a fact table
    of each N in ``fact_ns`` rows (fanout 1, ``fact_epochs`` epochs), and the mapping alone on a fact table of
    each N in ``fact_mapping_ns`` rows, and the server state of every algorithm family (``budget_families``:
    only those; the others keep their last entries) at each N in ``budget_ns`` against its documented budget
    (simulations/bench/memory.py), and boosted trees' server state after ``gbdt_trees`` trees at each N in
    ``gbdt_ns`` against GBDT_STATE_GOAL. Each case in a fresh process; a
    section not run this time (empty list, 0) keeps its entries of the last bench_results/scale.json.
    ``failures``: a measured budget over the documented one, a fact-table run that failed or passed 16 GB (the
    bench exits non-zero after writing its JSON)."""
    last_path = Path("bench_results/scale.json")
    last = json.loads(last_path.read_text()) if last_path.is_file() else {}
    out: dict[str, Any] = {
        **last,
        "case": "scale",
        "schema": {k: v for k, v in scale_loader(0).items() if k != "n_fact"},
    }
    if server_ns:
        out["server_state"] = []
    for n in server_ns:
        for precision in ("float32", "float64"):
            out["server_state"].append(_run_case("server_state_case", {"n_joined": n, "precision": precision}))
            print(json.dumps(out["server_state"][-1]), flush=True)
    if ns:
        out["simulation"] = []
    for n in ns:
        out["simulation"].append(simulation_case(n, epochs))
        print(json.dumps({k: v for k, v in out["simulation"][-1].items() if k != "memory_timeline"}), flush=True)
    if mapping_n:
        out["mapping"] = _run_case("mapping_scale_case", {"n_joined": mapping_n})
        print(json.dumps(out["mapping"]), flush=True)
    if fact_mapping_ns:
        out["fact_table_mapping"] = []
    for n in fact_mapping_ns:  # the keys round's projections and the mapping alone: what the server receives
        out["fact_table_mapping"].append(_run_case("mapping_scale_case", {"n_joined": n, "fanout": 1}))
        print(json.dumps(out["fact_table_mapping"][-1]), flush=True)
    failures: list[str] = []
    families = list(budget_families) or list(FAMILIES)
    if budget_ns:
        out["budgets"] = [
            b for b in out.get("budgets", []) if b["family"] not in families and b["n_joined"] in budget_ns
        ]
    for n in budget_ns:  # every family at fanout 2 and 1: state = per_joined N + per_table sum_i n_i
        for family in families:
            runs = [
                run_isolated("simulations.bench.memory", "family_state", {"family": family, "n_joined": n, "fanout": f})
                for f in (2, 1)
            ]
            fit = budget_fit(runs)
            doc = FAMILIES[family]
            entry = {
                "family": family,
                "n_joined": n,
                **fit,
                "budget_per_joined": doc.per_joined,
                "budget_per_table": doc.per_table,
                "note": doc.note,
                "runs": runs,
            }
            entry["over"] = over_budget(family, fit)
            failures += entry["over"]
            out["budgets"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "runs"}), flush=True)
    if budget_ns:
        out["budgets"].sort(key=lambda b: (b["n_joined"], list(FAMILIES).index(b["family"])))
    if gbdt_ns:
        out["gbdt_scale"] = []
    for n in gbdt_ns:  # the scale goal of boosted trees: gbdt_trees trees of the shipped defaults on the star
        every = max(gbdt_trees // 5, 1)
        run = run_isolated(
            "simulations.bench.memory",
            "family_state",
            {
                "family": "gbdt",
                "n_joined": n,
                "fanout": SCALE_FANOUT,
                "overrides": [
                    f"algorithm.trees={gbdt_trees}",
                    f"algorithm.eval_every={every}",
                    "algorithm.learning_rate=0.1",
                ],
            },
        )
        run["state_bytes_per_joined_row"] = round(run["state_bytes"] / run["n_joined"], 1)
        run["trees"] = gbdt_trees
        run["load"] = f"1-minute load {os.getloadavg()[0]:.1f} at the end"
        run["goal_bytes_per_joined_row"] = GBDT_STATE_GOAL
        out["gbdt_scale"].append(run)
        print(json.dumps(run), flush=True)
        if run["state_bytes_per_joined_row"] > GBDT_STATE_GOAL:
            failures.append(
                f"gbdt at {n:,} joined rows: {run['state_bytes_per_joined_row']} bytes of server state per joined "
                f"row, goal {GBDT_STATE_GOAL}"
            )
    if fact_ns:
        out["fact_table"] = []
    for n in fact_ns:
        for algorithm in fact_algorithms:
            run = simulation_case(n, fact_epochs, timeout_s=5400, fanout=1, limit_mb=FACT_LIMIT_MB, algorithm=algorithm)
            out["fact_table"].append(run)
            print(
                json.dumps({k: v for k, v in run.items() if k not in ("memory_timeline", "process_peaks")}), flush=True
            )
            if run["returncode"] != 0 or run["killed_at_tree_pss_mb"] is not None:
                failures.append(
                    f"fact table of {n:,} rows, algorithm={algorithm}: exit {run['returncode']}, tree peak "
                    f"{run['tree_peak_pss_mb']:.0f} MB PSS (killed at {run['killed_at_tree_pss_mb']})"
                )
    out["failures"] = failures
    out.pop("machine", None)
    return out


def _run_case(case: str, args: dict[str, Any]) -> dict[str, Any]:
    return run_isolated("simulations.bench.scale", case, args)
