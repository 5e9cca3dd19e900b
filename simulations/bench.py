"""Benchmarks: speed and memory goals, measured and written to JSON (quoted in the README).

    python -m simulations.bench mapping [--n-joined 10000000] [--out bench_results/mapping.json]

Each case runs in a fresh subprocess so that its peak RSS (ru_maxrss) is its own.
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


CASES = {"mapping": mapping_case}


def _run_isolated(case: str, args: dict[str, Any]) -> dict[str, Any]:
    code = (
        "import json,sys; from simulations.bench import CASES; "
        f"print(json.dumps(CASES[{case!r}](**json.loads(sys.argv[1]))))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--n-joined", type=int, default=10_000_000)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    result = _run_isolated(a.case, {"n_joined": a.n_joined})
    result["machine"] = {"cpus": __import__("os").cpu_count(), "python": platform.python_version()}
    out = a.out or Path("bench_results") / f"{a.case}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
