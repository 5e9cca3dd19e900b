"""Table mapping of a synthetic star schema (fact table + 3 dimensions): the clients' digests and the server's join.

python -m simulations.bench mapping [--n-joined 10000000]      -> bench_results/mapping.json
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from simulations.bench.common import SECRET, peak_rss_mb, run_isolated
from tpflower.datasets import synthetic
from tpflower.mapping import build_mapping, project_keys
from tpflower.schema import parse_spec, validate_tables


def mapping_case(n_joined: int, dim_rows: tuple[int, ...] = (1_000_000, 100_000, 1_000)) -> dict[str, Any]:
    """Table mapping for a synthetic star schema: a fact table of n_joined rows and 3 many-to-one dimensions,
    so N = n_joined. Times the clients' digests and the server's join separately."""
    kwargs = dict(schema="star", n_fact=n_joined, dim_rows=list(dim_rows), n_dims=3, widths=2, fanout=1, seed=0)
    t0 = time.perf_counter()
    frames = synthetic.generate(**kwargs)
    t_gen = time.perf_counter() - t0
    rss_data = peak_rss_mb()
    spec = validate_tables(parse_spec({"name": "bench-star", **synthetic.describe(**kwargs)}), frames)
    t0 = time.perf_counter()
    projections = {t: [project_keys(spec, t, frames[t], np.arange(len(frames[t])), SECRET)] for t in spec.table_names}
    t_digest = time.perf_counter() - t0
    t0 = time.perf_counter()
    mapping = build_mapping(spec, projections)
    G = {t: mapping.G(t) for t in spec.table_names}
    t_join = time.perf_counter() - t0
    assert n_joined == mapping.N and all(int(g.sum()) == n_joined for g in G.values())
    return {
        "case": "mapping_star",
        "tables": {t: len(f) for t, f in frames.items()},
        "n_joined": mapping.N,
        "generate_s": round(t_gen, 2),
        "digest_s": round(t_digest, 2),
        "join_s": round(t_join, 2),
        "mapping_total_s": round(t_digest + t_join, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "rss_after_generate_mb": round(rss_data, 1),
    }


def mapping_suite(n_joined: int) -> dict[str, Any]:
    """The mapping case in a fresh process (its peak RSS its own)."""
    return run_isolated("simulations.bench.mapping", "mapping_case", {"n_joined": n_joined})
