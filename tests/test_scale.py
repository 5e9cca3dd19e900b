"""Scale: memory per joined row. The chunked mapping build equals the pandas merges it replaces (order
included); train/test are views of one partition that pickle once; the chunked ADMM server equals the one-chunk
computation; the synthetic generator makes one table alone; a simulated client loads and holds only its table."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest

from strategies.join_admm import ADMMServer, Balancing
from tests.conftest import make_cfg
from tests.mapping_reference import SECRET, pandas_build_mapping
from tpflower import mapping as mapping_mod
from tpflower.batches import joined_predictions
from tpflower.datasets import LOADERS, load_dataset, synthetic
from tpflower.mapping import (
    RowRange,
    SegmentSums,
    TableMapping,
    build_mapping,
    index_dtype,
    project_keys,
    segment_sum,
)


def projections_of(spec, frames, shards: int = 1):
    """Each table's key projection, in ``shards`` interleaved shards (row ids out of order)."""
    out = {}
    for t in spec.table_names:
        ids = np.arange(len(frames[t]))
        parts = [ids[q::shards] for q in range(shards)] if len(ids) >= shards else [ids]
        out[t] = [project_keys(spec, t, frames[t].iloc[part].reset_index(drop=True), part, SECRET) for part in parts]
    return out


DATASETS = [
    {
        "name": "star",
        "loader": {
            "name": "synthetic",
            "schema": "star",
            "n_fact": 700,
            "dim_rows": [9, 4, 30],
            "fanout": 2,
            "widths": 1,
        },
    },
    {
        "name": "chain",
        "loader": {
            "name": "synthetic",
            "schema": "chain",
            "n_fact": 400,
            "dim_rows": [20, 10, 5],
            "fanout": 3,
            "widths": 1,
            "composite": True,
        },
    },
    {
        "name": "snowflake",
        "loader": {
            "name": "synthetic",
            "schema": "snowflake",
            "n_fact": 300,
            "dim_rows": [7, 5, 6, 3],
            "n_dims": 4,
            "fanout": 2,
            "widths": 1,
        },
    },
]


@pytest.mark.parametrize("cfg", DATASETS, ids=lambda c: c["name"])
@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("shards", [1, 3])
def test_chunked_build_equals_the_pandas_merges_in_order(cfg, chunk, shards):
    spec, frames = load_dataset(cfg)
    projections = projections_of(spec, frames, shards)
    ours = build_mapping(spec, projections, chunk=chunk)
    ref = pandas_build_mapping(spec, projections)
    assert ours.n_rows == ref.n_rows
    for t in spec.table_names:
        assert ours.p[t].dtype == np.int32
        np.testing.assert_array_equal(ours.p[t], ref.p[t])


@pytest.mark.parametrize("cfg", DATASETS, ids=lambda c: c["name"])
def test_chunked_build_equals_the_pandas_merges_when_rows_drop_out_deep_in_the_tree(cfg):
    """Dimension rows removed at random: label rows lose their partners one, two or three joins away (a
    partner that drops out further down is never expanded); the result and its order are the merges'."""
    spec, frames = load_dataset(cfg)
    rng = np.random.default_rng(5)
    for t in spec.table_names[1:]:
        frames[t] = frames[t].iloc[rng.random(len(frames[t])) > 0.35].reset_index(drop=True)
    projections = projections_of(spec, frames)
    ref = pandas_build_mapping(spec, projections)
    assert ref.N > 0
    for chunk in (None, 5):
        ours = build_mapping(spec, projections, chunk=chunk)
        for t in spec.table_names:
            np.testing.assert_array_equal(ours.p[t], ref.p[t])


def test_chunked_build_with_dropped_rows_and_empty_chunks():
    """Fact rows whose key has no partner drop out (whole chunks of them), many-to-many partners keep order."""
    rng = np.random.default_rng(4)
    fact = pd.DataFrame({"a": np.concatenate([np.full(50, 99), rng.integers(0, 6, 200)]), "y": rng.normal(size=250)})
    A = pd.DataFrame({"a": rng.permutation(np.repeat(np.arange(5), 3)), "x": rng.normal(size=15)})
    from tpflower.schema import parse_spec, validate_tables

    spec = validate_tables(
        parse_spec(
            {
                "name": "d",
                "tables": {"fact": {}, "A": {"numeric": ["x"]}},
                "label": {"table": "fact", "column": "y", "task": "regression"},
                "joins": [{"left": "fact", "right": "A", "on": "a"}],
            }
        ),
        {"fact": fact, "A": A},
    )
    projections = projections_of(spec, {"fact": fact, "A": A})
    ours, ref = build_mapping(spec, projections, chunk=16), pandas_build_mapping(spec, projections)
    for t in ("fact", "A"):
        np.testing.assert_array_equal(ours.p[t], ref.p[t])
    assert ours.p["fact"].min() >= 50 and len(ours.p["fact"]) == 3 * int(np.isin(fact["a"], np.arange(5)).sum())


def test_digest_codes_tell_apart_digests_that_share_their_first_word():
    left = np.array([[1, 10], [1, 11], [2, 10], [1, 10]], dtype=np.uint64)
    right = np.array([[1, 11], [3, 10], [1, 10]], dtype=np.uint64)
    cl, cr, n = mapping_mod._digest_codes(left, right)
    assert n == 4 and cl[0] == cl[3] == cr[2] and cl[1] == cr[0] and len({cl[0], cl[1], cl[2], cr[1]}) == 4
    cl, cr, n = mapping_mod._digest_codes(left[[0, 2]], right[[1, 2]])  # first words decide: the fast path
    assert n == 3 and cl[0] == cr[1] and len({cl[0], cl[1], cr[0]}) == 3


def test_index_dtype_is_the_narrowest_that_holds_the_rows():
    assert index_dtype(10) == np.int32 and index_dtype(2**31 - 1) == np.int32 and index_dtype(2**31) == np.int64


def test_partition_gives_views_equal_to_subsets_and_pickles_the_base_once():
    rng = np.random.default_rng(0)
    p = {"a": rng.integers(0, 50, 1000).astype(np.int32), "b": rng.integers(0, 7, 1000).astype(np.int32)}
    is_test = rng.random(1000) < 0.2
    m = TableMapping({t: v.copy() for t, v in p.items()}, {"a": 50, "b": 7})
    want_train, want_test = m.subset(~is_test), m.subset(is_test)
    train, test = m.partition(is_test)
    for t in p:
        np.testing.assert_array_equal(train.p[t], want_train.p[t])
        np.testing.assert_array_equal(test.p[t], want_test.p[t])
        assert np.shares_memory(train.p[t], m.p[t]) and np.shares_memory(test.p[t], m.p[t])
    state = {"mapping": m, "train": train, "test": test, "loop": {"admm_mapping": train}}
    blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(blob) < 1000 * 2 * 4 * 1.2  # the base's arrays once, not once more per range
    back = pickle.loads(blob)
    assert isinstance(back["train"], RowRange) and back["loop"]["admm_mapping"] is back["train"]
    for t in p:
        np.testing.assert_array_equal(back["train"].p[t], train.p[t])
        assert np.shares_memory(back["train"].p[t], back["mapping"].p[t])
    assert int(is_test.sum()) == back["test"].N and back["train"].G("b").sum() == train.N


def test_segment_sums_in_chunks_equal_one_bincount():
    rng = np.random.default_rng(1)
    index = np.sort(rng.integers(0, 300, 5000)).astype(np.int32)  # sorted (a label table) and shuffled
    for idx in (index, rng.permutation(index)):
        v = rng.normal(size=(5000, 2))
        sums = SegmentSums(300, 2)
        for s in mapping_mod.chunks(5000, 333):
            sums.add(idx[s], v[s])
        np.testing.assert_allclose(sums.result(), segment_sum(idx, v, 300), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(segment_sum(idx, v[:, 0], 300), np.bincount(idx, weights=v[:, 0], minlength=300))


@pytest.mark.parametrize("task, d_c", [("regression", 1), ("binary", 1), ("multiclass", 3)])
@pytest.mark.parametrize("variant", ["sharing", "paper"])
def test_chunked_admm_server_equals_one_chunk(monkeypatch, task, d_c, variant):
    """The same iterations with chunks of 37 rows and with one chunk: z, lambda, Y, residuals and rho agree."""
    rng = np.random.default_rng(2)
    N, n = 1000, {"a": 300, "b": 40, "c": 9}
    m = TableMapping({t: rng.integers(0, k, N).astype(np.int32) for t, k in n.items()}, dict(n))
    y = (rng.normal(size=N) if task == "regression" else rng.integers(0, 2 if task == "binary" else d_c, N)).astype(
        np.float64 if task != "multiclass" else np.int64
    )
    hs = [{t: rng.normal(size=(k, d_c)) * 0.5 for t, k in n.items()} for _ in range(5)]

    def run(chunk: int):
        monkeypatch.setattr(mapping_mod, "CHUNK_ROWS", chunk)
        server = ADMMServer(
            task, y, m, d_c, 1.0, variant, Balancing(10.0, 2.0, warmup=1) if variant == "sharing" else None, 1e-3
        )
        out = []
        for h in hs:
            res = server.update(h)
            out.append((res, server.rho, server.train_loss(), server.primal_residual(), server.scatter(h)))
        return server, out

    one, a = run(10**6)
    many, b = run(37)
    np.testing.assert_allclose(many.z, one.z, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(many.lam, one.lam, rtol=1e-10, atol=1e-12)
    for (ra, rho_a, la, pa, Ya), (rb, rho_b, lb, pb, Yb) in zip(a, b):
        assert rho_a == rho_b and la == pytest.approx(lb, rel=1e-12) and pa == pytest.approx(pb, rel=1e-12)
        assert rb.primal == pytest.approx(ra.primal, rel=1e-12) and rb.eps_dual == pytest.approx(ra.eps_dual, rel=1e-12)
        assert (ra.dual is None) == (rb.dual is None) and (
            ra.dual is None or rb.dual == pytest.approx(ra.dual, rel=1e-10)
        )
        for t in n:
            np.testing.assert_allclose(Yb[t], Ya[t], rtol=1e-10, atol=1e-12)


def test_float32_state_stays_close_to_float64():
    rng = np.random.default_rng(3)
    N, n = 2000, {"a": 500, "b": 30}
    m = TableMapping({t: rng.integers(0, k, N).astype(np.int32) for t, k in n.items()}, dict(n))
    y = rng.normal(size=N)
    s64 = ADMMServer("regression", y, m, 1, 2.0)
    s32 = ADMMServer("regression", y.astype(np.float32), m, 1, 2.0, dtype=np.float32)
    assert s32.lam.dtype == np.float32 and s32.D.dtype == np.float32
    for _ in range(3):
        h = {t: rng.normal(size=(k, 1)).astype(np.float32) for t, k in n.items()}
        s64.update(h), s32.update(h)
        Y64, Y32 = s64.scatter(h), s32.scatter(h)
        for t in n:
            assert Y32[t].dtype == np.float32
            np.testing.assert_allclose(Y32[t], Y64[t], rtol=1e-4, atol=1e-4)
    H = joined_predictions(m.p, h)
    np.testing.assert_allclose(H, h["a"][m.p["a"]] + h["b"][m.p["b"]])


# ------------------------------------------------------------------------------------------------ clients

SYNTHETIC = [
    dict(),
    dict(schema="chain", fanout=2, composite=True, n_fact=300),
    dict(
        schema="snowflake",
        n_dims=5,
        widths=[2, 0, 3, 1, 2, 4],
        fanout=3,
        label="nonlinear",
        task="multiclass",
        n_classes=4,
        seed=3,
        n_fact=200,
    ),
]


@pytest.mark.parametrize("kwargs", SYNTHETIC)
def test_synthetic_makes_one_table_equal_to_its_table_of_the_whole(kwargs):
    whole = synthetic.generate(**kwargs)
    for name, frame in whole.items():
        alone = synthetic.generate(**kwargs, tables=[name])
        assert list(alone) == [name]
        pd.testing.assert_frame_equal(alone[name], frame)


def test_a_simulated_client_loads_and_holds_only_its_table(monkeypatch):
    """Every client of a simulation (the ClientApp the simulation engine runs) asks the loader for its own table
    alone, and what it keeps (its prepared data) has its table's rows and columns only."""
    from simulations.federated import run_in_process
    from tpflower.app import client_app

    calls: list[tuple | None] = []
    real = LOADERS["synthetic"]

    def spy(*args, tables=None, **kwargs):
        calls.append(None if tables is None else tuple(tables))
        return real(*args, tables=tables, **kwargs)

    monkeypatch.setitem(LOADERS, "synthetic", spy)
    client_app._load.cache_clear()
    client_app._SETTINGS.clear()
    cfg = make_cfg("algorithm=admm", "dataset=synthetic", "epochs=1", "dataset.loader.n_fact=1500")
    run = run_in_process(cfg, None, log=lambda _: None)
    tables = run.strategy.spec.table_names
    assert sorted(calls) == sorted((t,) for t in tables)  # one load per client, of its own table, never all
    whole = synthetic.generate(**{k: v for k, v in cfg.dataset.loader.items() if k != "name"})
    held = {settings.table: data for settings, data, *_ in client_app._SETTINGS.values()}
    assert sorted(held) == sorted(tables)
    for t, data in held.items():
        assert len(data.frame) == len(whole[t]) == run.strategy.mapping.n_rows[t]
        assert set(data.frame.columns) <= set(whole[t].columns)
    assert "y" in held["fact"].frame.columns and all("y" not in held[t].frame.columns for t in tables if t != "fact")
