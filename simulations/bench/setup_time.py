"""Setup time, HMAC vs blinded join keys: the keys round through the table mapping (docs/algorithms.md, Table
mapping and Blinded keys), on movielens and a synthetic star, side by side.

python -m simulations.bench setup [--n-joined 10000000] [--setup-data movielens,star] [--keys-memory-n 10000000]
                                                             -> bench_results/setup.json

Every owner runs in this one process, one after the other (a deployment runs them in parallel, one per node):
``keys_s`` is the sum of the owners' keys replies, ``reblind_s`` of their reblind replies, ``server_s`` the
server's digests of the blinded values and its mapping build; ``cpu_s`` the CPU seconds of all of it (every
thread), which other work on the machine does not inflate. Each case runs in a fresh process.

``keys_memory``: the label owner's node of a fanout-1 fact table of ``--keys-memory-n`` rows (the scale
schema) answers its keys round through the deployed handlers (``keys``, then every ``keys_chunk``) in chunks
of 2^22 (the default) and of 2^20 rows: its resident memory before the round (its table loaded) and its peak
during the round (VmHWM reset before it, Linux), in each key mode. A ``--setup-data`` without a data set keeps
that data set's cases of the last setup.json; ``--keys-memory-n 0`` keeps its keys_memory entries.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
from flwr.app import RecordDict

from simulations.bench.common import SECRET, peak_rss_mb, run_isolated
from strategies.setup import JoinSetup
from tpflower.config import compose_config
from tpflower.datasets import load_dataset, synthetic
from tpflower.keys_payload import KeysPayload
from tpflower.mapping import KeyProjection, TableMapping, build_mapping
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
    """The keys round (each owner's payload as its node builds it, tpflower.keys_payload), (blind) the
    reblind rounds, and the server's mapping build, timed."""
    times = {"keys_s": 0.0, "reblind_s": 0.0, "server_s": 0.0}
    if mode == "hmac":
        t0 = time.perf_counter()
        projections = {}
        for t in spec.table_names:
            a = KeysPayload(spec, t, frames[t], np.arange(len(frames[t])), "hmac", secret=SECRET).whole()
            digests = {int(n[7:]): d for n, d in a.items() if n.startswith("digest.")}
            projections[t] = [KeyProjection(t, a["row_ids"], {k: a[f"code.{k}"] for k in digests}, digests)]
        times["keys_s"] = time.perf_counter() - t0
    else:
        clients, replies = {}, {}
        t0 = time.perf_counter()
        for t in spec.table_names:
            owner = SimpleNamespace(state_dir=None, keys="blind", threads=None)
            c = SimpleNamespace(settings=SimpleNamespace(spec=spec, table=t, shard=0, owner=owner))
            c.state = ClientState(RecordDict())
            clients[(t, 0)] = c
            payload = KeysPayload(spec, t, frames[t], np.arange(len(frames[t])), "blind", scalar=blinding_scalar(c))
            replies[(t, 0)] = (payload.whole(), {})
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


def _status_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM) in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def keys_memory_case(n_fact: int, mode: str, chunk_rows: int) -> dict[str, Any]:
    """The fact table's node (fanout 1, ``n_fact`` rows) answers its keys round in chunks of ``chunk_rows``
    rows through the deployed handlers: resident MB before the round and the round's own peak (module
    docstring), the payload it sent and the round's wall time."""
    from flwr.app import Context  # noqa: PLC0415  (flwr, torch: not in the other cases' processes)

    from simulations.bench.common import scale_overrides  # noqa: PLC0415
    from tpflower.app.client_app import make_client  # noqa: PLC0415

    cfg = compose_config("algorithm=admm", *scale_overrides(n_fact, 1), f"mapping.keys={mode}")
    for pid in range(8):
        context = Context(
            run_id=0, node_id=pid + 1, node_config={"partition-id": pid}, state=RecordDict(), run_config={}
        )
        client = make_client(cfg, context)
        if client.settings.table == client.settings.spec.label_table:
            break
    data = client.data
    _ = data.keys, data.row_ids, data.y, data.is_test  # the table the node holds anyway
    before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on is the keys round's
    t0 = time.perf_counter()
    out, metrics = client.handle({}, {"phase": "keys", "run_id": "bench", "chunk_rows": chunk_rows})
    sent = sum(a.nbytes for a in out.values())
    del out
    for j in range(1, int(metrics.get("n_chunks", 1))):
        out, _ = client.handle({}, {"phase": "keys_chunk", "chunk": j})
        sent += sum(a.nbytes for a in out.values())
        del out
    return {
        "n_fact": n_fact,
        "mode": mode,
        "chunk_rows": chunk_rows,
        "n_chunks": int(metrics.get("n_chunks", 1)),
        "rss_before_mb": round(before, 1),
        "keys_round_peak_mb": round(_status_mb("VmHWM"), 1),
        "sent_mb": round(sent / 1e6, 1),
        "keys_round_s": round(time.perf_counter() - t0, 2),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }


def setup_suite(
    n_joined: int, data: tuple[str, ...] = ("movielens", "star"), keys_memory_n: int = 10_000_000
) -> dict[str, Any]:
    """Every (data, mode) case in a fresh process, HMAC then blind; the blind/HMAC ratio per data; the keys
    round's memory at ``keys_memory_n`` fact rows (0: none). Data sets not run keep their last cases."""
    last_path = Path("bench_results/setup.json")
    last = json.loads(last_path.read_text()) if last_path.is_file() else {}
    cases = [
        run_isolated("simulations.bench.setup_time", "setup_case", {"data": d, "mode": m, "n_joined": n_joined})
        for d in data
        for m in ("hmac", "blind")
    ]
    cases = [c for c in last.get("cases", []) if c["data"] not in data] + cases
    by = {(c["data"], c["mode"]): c for c in cases}
    names = list(dict.fromkeys(c["data"] for c in cases))
    ratio = {d: round(by[(d, "blind")]["setup_s"] / max(by[(d, "hmac")]["setup_s"], 1e-9), 2) for d in names}
    cpu = {d: round(by[(d, "blind")]["cpu_s"] / max(by[(d, "hmac")]["cpu_s"], 1e-9), 2) for d in names}
    memory = last.get("keys_memory", [])
    if keys_memory_n:
        memory = [
            run_isolated(
                "simulations.bench.setup_time",
                "keys_memory_case",
                {"n_fact": keys_memory_n, "mode": m, "chunk_rows": c},
            )
            for m in ("hmac", "blind")
            for c in (1 << 22, 1 << 20)
        ]
    return {
        "case": "setup",
        "n_joined_star": n_joined if "star" in data else last.get("n_joined_star", n_joined),
        "cases": cases,
        "blind_over_hmac": ratio,
        "blind_over_hmac_cpu": cpu,
        "keys_memory": memory,
    }
