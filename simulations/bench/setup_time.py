"""Setup time, HMAC vs blinded join keys: the keys round through the table mapping (docs/algorithms.md, Table
mapping and Blinded keys), on movielens and a synthetic star, side by side.

python -m simulations.bench setup [--n-joined 10000000]      -> bench_results/setup.json

Every owner runs in this one process, one after the other (a deployment runs them in parallel, one per node):
``keys_s`` is the sum of the owners' keys replies, ``reblind_s`` of their reblind replies, ``server_s`` the
server's digests of the blinded values and its mapping build; ``cpu_s`` the CPU seconds of all of it (every
thread), which other work on the machine does not inflate. Each case runs in a fresh process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
from flwr.app import RecordDict

from simulations.bench.common import SECRET, peak_rss_mb, run_isolated
from strategies.setup import JoinSetup
from tpflower.blind import blind_keys
from tpflower.config import compose_config
from tpflower.datasets import load_dataset, synthetic
from tpflower.mapping import KeyProjection, TableMapping, build_mapping, narrow_ids, project_keys
from tpflower.phases.setup import blinding_scalar, reblind_keys
from tpflower.schema import RelationalSpec, parse_spec, validate_tables
from tpflower.state import ClientState

#: the star of the mapping suite: a fact table of N rows and three many-to-one dimensions
STAR_DIMS = (1_000_000, 100_000, 1_000)


def star(n_joined: int) -> tuple[RelationalSpec, dict[str, pd.DataFrame]]:
    kwargs = dict(schema="star", n_fact=n_joined, dim_rows=list(STAR_DIMS), n_dims=3, widths=2, fanout=1, seed=0)
    frames = synthetic.generate(**kwargs)
    return validate_tables(parse_spec({"name": "bench-star", **synthetic.describe(**kwargs)}), frames), frames


def setup_once(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame], mode: str) -> tuple[TableMapping, dict]:
    """The keys round, (blind) the reblind rounds, and the server's mapping build, timed."""
    times = {"keys_s": 0.0, "reblind_s": 0.0, "server_s": 0.0}
    if mode == "hmac":
        t0 = time.perf_counter()
        projections = {
            t: [project_keys(spec, t, frames[t], np.arange(len(frames[t])), SECRET)] for t in spec.table_names
        }
        times["keys_s"] = time.perf_counter() - t0
    else:
        clients, replies = {}, {}
        t0 = time.perf_counter()
        for t in spec.table_names:
            owner = SimpleNamespace(state_dir=None, keys="blind")
            c = SimpleNamespace(settings=SimpleNamespace(spec=spec, table=t, shard=0, owner=owner))
            c.state = ClientState(RecordDict())
            clients[(t, 0)] = c
            out: dict[str, np.ndarray] = {"row_ids": narrow_ids(np.arange(len(frames[t])))}
            for k, j in enumerate(spec.joins):
                if t in (j.left, j.right):
                    out[f"code.{k}"], out[f"blind.{k}"] = blind_keys(frames[t], j.columns_of(t), blinding_scalar(c))
            replies[(t, 0)] = (out, {})
        times["keys_s"] = time.perf_counter() - t0

        def send(messages: dict) -> dict:
            t1 = time.perf_counter()
            back = {key: reblind_keys(clients[key], arrays, config) for key, (arrays, config) in messages.items()}
            times["reblind_s"] += time.perf_counter() - t1
            return back

        t0 = time.perf_counter()
        JoinSetup(send, spec, {}, list(clients), {}).blind_rounds(replies)
        times["server_s"] = time.perf_counter() - t0 - times["reblind_s"]
        projections = {}
        for (t, _), (a, _) in replies.items():
            digests = {int(n[7:]): d for n, d in a.items() if n.startswith("digest.")}
            projections[t] = [KeyProjection(t, a["row_ids"], {k: a[f"code.{k}"] for k in digests}, digests)]
    t0 = time.perf_counter()
    mapping = build_mapping(spec, projections)
    times["server_s"] += time.perf_counter() - t0
    return mapping, {k: round(v, 2) for k, v in times.items()}


def setup_case(data: str, mode: str, n_joined: int = 10_000_000) -> dict[str, Any]:
    """One (data, mode) case: ``data`` a bundled dataset name or ``star`` (N = n_joined)."""
    if data == "star":
        spec, frames = star(n_joined)
    else:
        spec, frames = load_dataset(compose_config(f"dataset={data}").dataset)
        frames = {t: f.reset_index(drop=True) for t, f in frames.items()}
    distinct = {
        f"{j.left}-{j.right}": int(frames[j.left][list(j.columns_of(j.left))].drop_duplicates().shape[0])
        + int(frames[j.right][list(j.columns_of(j.right))].drop_duplicates().shape[0])
        for j in spec.joins
    }
    load, cpu0 = os.getloadavg()[0], time.process_time()
    mapping, times = setup_once(spec, frames, mode)
    cpu_s = time.process_time() - cpu0  # every thread of this process: the work, whatever else shares the CPUs
    total = sum(times.values())
    return {
        "data": data,
        "mode": mode,
        "tables": {t: len(f) for t, f in frames.items()},
        "distinct_keys_per_join": distinct,
        "n_joined": mapping.N,
        **times,
        "setup_s": round(total, 2),
        "cpu_s": round(cpu_s, 2),
        "load_avg_1min": round(load, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def setup_suite(n_joined: int, data: tuple[str, ...] = ("movielens", "star")) -> dict[str, Any]:
    """Every (data, mode) case in a fresh process, HMAC then blind; the blind/HMAC ratio per data."""
    cases = [
        run_isolated("simulations.bench.setup_time", "setup_case", {"data": d, "mode": m, "n_joined": n_joined})
        for d in data
        for m in ("hmac", "blind")
    ]
    by = {(c["data"], c["mode"]): c for c in cases}
    ratio = {d: round(by[(d, "blind")]["setup_s"] / max(by[(d, "hmac")]["setup_s"], 1e-9), 2) for d in data}
    cpu = {d: round(by[(d, "blind")]["cpu_s"] / max(by[(d, "hmac")]["cpu_s"], 1e-9), 2) for d in data}
    return {
        "case": "setup",
        "n_joined_star": n_joined,
        "cases": cases,
        "blind_over_hmac": ratio,
        "blind_over_hmac_cpu": cpu,
    }
