"""The memory-lean paths of a large fact table: the same results whatever their chunk sizes."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from simulations.federated import ONE_ACTOR_ROWS, simulation_actors
from strategies.replies import _distinct
from strategies.setup import ShardRouter
from tpflower import preprocess
from tpflower.datasets import synthetic
from tpflower.join_counts import count_dtype
from tpflower.records import npy_array, npy_bytes

KW = dict(schema="snowflake", n_fact=1000, n_dims=3, dim_rows=[5, 300, 7], widths=[3, 2, 0, 1], fanout=2, seed=4)


@pytest.mark.parametrize("task", ["regression", "binary", "multiclass"])
def test_the_generator_draws_the_same_tables_in_any_chunk_size(monkeypatch, task):
    whole = synthetic.generate(**KW, task=task)
    monkeypatch.setattr(synthetic, "GEN_CHUNK", 7)
    chunked = synthetic.generate(**KW, task=task)
    for t, frame in whole.items():
        pd.testing.assert_frame_equal(chunked[t], frame)
    fact = whole["fact"]
    assert fact["k1"].dtype == np.int8 and fact["k2"].dtype == np.int16  # 5 and 300 key values
    assert fact["x0"].dtype == np.float32


def test_the_transform_in_float32_rounds_the_float64_transform(monkeypatch):
    frame = pd.DataFrame({"a": np.arange(50, dtype=np.float32) / 7, "b": np.r_[np.nan, np.arange(49.0)], "c": 3})
    pre = preprocess.TablePreprocessor(["a", "b", "c"], [], table="t").fit(frame)
    full = pre.transform(frame)
    monkeypatch.setattr(preprocess, "TRANSFORM_CHUNK", 6)
    np.testing.assert_array_equal(pre.transform(frame), full)
    np.testing.assert_array_equal(pre.transform(frame, np.float32), full.astype(np.float32))


def test_resources_actors():
    cfg = OmegaConf.create({"resources": {"num_cpus": 1, "actors": "auto"}})
    assert simulation_actors(cfg, ONE_ACTOR_ROWS) == 1
    assert simulation_actors(cfg, ONE_ACTOR_ROWS, node_actors=True) is None  # each table on one actor anyway
    assert simulation_actors(cfg, ONE_ACTOR_ROWS - 1) is None and simulation_actors(cfg, None) is None
    assert simulation_actors(OmegaConf.create({"resources": {"actors": 3}}), 10**9) == 3
    with pytest.raises(ValueError, match="resources.actors"):
        simulation_actors(OmegaConf.create({"resources": {"actors": 0}}), 1)


def test_client_resources_no_ray_actor_could_get_are_one_line_before_ray_starts(monkeypatch):
    """resources.num_cpus=x, 0 or -1 were Python's or Ray's errors ('integer modulo by zero' per node); above the
    machine's CPUs or a GPU share with no GPU, Flower's 'ActorPool is empty' and a wait for nodes."""
    import os

    import torch

    from simulations.federated import client_resources, run_flower_simulation

    def refused(cpus, gpus=0.0, actors="auto"):
        with pytest.raises(ValueError) as err:
            cfg = OmegaConf.create({"resources": {"num_cpus": cpus, "num_gpus": gpus, "actors": actors}})
            run_flower_simulation(cfg, None, log=lambda _: None)
        return str(err.value)

    assert refused("x") == "resources.num_cpus must be a number, got 'x'"
    assert refused(0) == "resources.num_cpus must be a finite number > 0, got 0"
    assert refused(-1) == "resources.num_cpus must be a finite number > 0, got -1"
    assert refused(1, -1) == "resources.num_gpus must be a finite number >= 0, got -1"
    assert refused(1, 0, "abc") == "resources.actors must be a number, got 'abc' (or one of ['auto'])"
    assert refused(os.cpu_count() + 1).startswith(f"resources.num_cpus={os.cpu_count() + 1} is more than this ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert refused(1, 1).startswith("resources.num_gpus=1 but no GPU is visible here")
    assert client_resources(OmegaConf.create({"resources": {"num_cpus": 0.5, "num_gpus": 0}})) == {
        "num_cpus": 0.5,
        "num_gpus": 0.0,
    }


def test_a_runs_bad_engine_resources_are_refused_before_any_table_is_loaded(tmp_path, monkeypatch):
    """resources.num_cpus=0, a GPU share without a GPU or resources.actors=0 were refused after the tables were
    loaded and checked and the line 'engine: starting Flower's simulation engine (Ray)'; now with the other
    settings, before any table is read; so is a share above the machine's CPUs (was after the tables: its check
    took the rows, which change the actors only without the node-actors adapter, resources.actors=auto)."""
    import torch

    from simulations.job import run_job
    from tests.conftest import make_cfg

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("simulations.job.check_data", lambda *a, **k: pytest.fail("a table was loaded"))
    import os

    for setting, line in (
        (f"resources.num_cpus={os.cpu_count() + 1}", f"resources.num_cpus={os.cpu_count() + 1} is more than this "),
        ("resources.num_cpus=0", "resources.num_cpus must be a finite number > 0, got 0"),
        ("resources.num_gpus=1", "resources.num_gpus=1 but no GPU is visible here"),
        ("resources.actors=0", "resources.actors must be an integer >= 1, got 0"),
    ):
        lines: list[str] = []
        cfg = make_cfg("algorithm=pcg", "dataset=synthetic", "runtime=flower", setting)
        with pytest.raises(ValueError) as err:
            run_job(cfg, tmp_path / setting, log=lines.append)
        assert str(err.value).startswith(line) and lines == [], (err.value, lines)


def test_distinct_row_ids_by_bitmap_and_by_sort():
    assert _distinct(np.array([3, 0, 2, 1])) and not _distinct(np.array([3, 0, 3, 1]))
    assert _distinct(np.array([10**9, 5])) and not _distinct(np.array([10**9, 5, 10**9]))  # sparse: sorted


def test_a_whole_tables_router_maps_rows_to_themselves():
    whole = ShardRouter({0: np.arange(6, dtype=np.int32)}, 6)
    split = ShardRouter({0: np.array([4, 0, 2]), 1: np.array([1, 5, 3])}, 6)
    assert whole.whole and not split.whole
    rows = np.array([5, 1, 1, 0])
    assert whole.split(rows)[0].tolist() == rows.tolist()
    assert whole.shard_of.tolist() == [0] * 6 and whole.position.tolist() == list(range(6))  # built when asked
    values = np.arange(6.0) * 10
    assert whole.gather_all(whole.scatter_all(values)).tolist() == values.tolist()
    assert split.gather_all(split.scatter_all(values)).tolist() == values.tolist()


def test_message_arrays_are_read_only_views_equal_to_what_was_sent():
    for a in [np.arange(10, dtype=np.int16), np.ones((3, 2), order="F"), np.zeros((0, 2), np.uint64)]:
        b = npy_array(npy_bytes(a))
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b) and not b.flags.writeable


def test_message_arrays_of_every_header_numpy_writes_read_back_alike():
    """Plain dtypes' headers are written and read by a pattern, anything else by numpy's writer and reader: the
    bytes are np.save's, byte for byte (what Flower's Array and any npy reader expect), and read back."""
    rng = np.random.default_rng(0)
    arrays = [
        np.zeros(0),
        np.zeros((2, 0, 3), np.int8),
        rng.random((3, 4)),
        rng.random((4, 3)).T,  # not C-contiguous: sent as its C-ordered copy
        rng.random(7).astype(">f4"),
        np.array([True, False]),
        np.array(["ab", "c"]),
        np.zeros(4, np.complex128),
        np.arange(70_000, dtype=np.int64),
        np.zeros(3, dtype=[("a", "<f8"), ("b", "<i4")]),  # a structured dtype: numpy's reader
    ]
    for a in arrays:
        saved = io.BytesIO()
        np.save(saved, np.ascontiguousarray(a), allow_pickle=False)
        assert npy_bytes(a) == saved.getvalue(), (a.dtype, a.shape)
        b = npy_array(npy_bytes(a))
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
    pickled = io.BytesIO()
    np.save(pickled, np.array([{}, 1], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="Python objects"):
        npy_array(pickled.getvalue())


def test_count_dtype():
    assert count_dtype(np.array([0, 255])) == np.uint8 and count_dtype(np.array([256])) == np.uint16
    assert count_dtype(np.array([2**20])) == np.uint32 and count_dtype(np.zeros(0)) == np.uint8
