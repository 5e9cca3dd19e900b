"""The relational spec's validation errors and the table mapping against a pandas merge."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest

from tests.mapping_reference import SECRET, assert_mapping_equals_merge, mapping_of
from tpflower.mapping import (
    batch_segments,
    code_dtype,
    distinct_digests,
    key_digests,
    segment_sum,
    split_mapping,
)
from tpflower.schema import SpecError, parse_spec, validate_tables


def spec_of(tables: dict, joins: list, label: dict | None = None, **extra):
    cfg = {
        "name": "t",
        "tables": tables,
        "label": label or {"table": "fact", "column": "y", "task": "regression"},
        "joins": joins,
        **extra,
    }
    return parse_spec(cfg)


def frames_star_mn(seed: int = 0) -> dict[str, pd.DataFrame]:
    """fact(a, b, c) -> A (unique), B (two rows per key: many-to-many), C (some keys absent)."""
    rng = np.random.default_rng(seed)
    n = 300
    fact = pd.DataFrame(
        {"a": rng.integers(0, 20, n), "b": rng.integers(0, 10, n), "c": rng.integers(0, 15, n), "y": rng.normal(size=n)}
    )
    A = pd.DataFrame({"a": np.arange(20), "xa": rng.normal(size=20)})
    B = pd.DataFrame({"b": np.repeat(np.arange(10), 2), "xb": rng.normal(size=20)})
    C = pd.DataFrame({"c": np.arange(0, 15, 2), "xc": rng.normal(size=8)})  # odd keys drop out
    return {"fact": fact, "A": A, "B": B, "C": C}


STAR = dict(
    tables={"fact": {}, "A": {"numeric": ["xa"]}, "B": {"numeric": ["xb"]}, "C": {"numeric": ["xc"]}},
    joins=[
        {"left": "fact", "right": "A", "on": "a"},
        {"left": "fact", "right": "B", "on": "b"},
        {"left": "fact", "right": "C", "on": "c"},
    ],
)


def test_star_many_to_many_matches_merge():
    frames = frames_star_mn()
    spec = validate_tables(spec_of(**STAR), frames)
    m = assert_mapping_equals_merge(spec, frames)
    assert len(frames["fact"]) // 2 < m.N  # B doubles, C halves
    assert (m.G("B")[m.G("B") > 0] > 1).any()


def test_chain_and_snowflake_match_merge():
    rng = np.random.default_rng(1)
    fact = pd.DataFrame({"k1": rng.integers(0, 30, 200), "k3": rng.integers(0, 5, 200), "y": rng.normal(size=200)})
    d1 = pd.DataFrame({"k1": np.arange(30), "k2": rng.integers(0, 8, 30)})
    d2 = pd.DataFrame({"k2": np.repeat(np.arange(8), 3), "x": rng.normal(size=24)})  # many-to-many at depth 2
    d3 = pd.DataFrame({"k3": np.arange(5), "x": rng.normal(size=5)})
    frames = {"fact": fact, "d1": d1, "d2": d2, "d3": d3}
    chain = spec_of(
        tables={"fact": {}, "d1": {}, "d2": {"numeric": ["x"]}, "d3": {}},
        joins=[
            {"left": "fact", "right": "d1", "on": "k1"},
            {"left": "d1", "right": "d2", "on": "k2"},
            {"left": "d3", "right": "d2", "on": [["k3", "k2"]]},  # chain continues past d2; right-to-left edge
        ],
    )
    assert_mapping_equals_merge(validate_tables(chain, frames), frames)
    snowflake = spec_of(
        tables={"fact": {}, "d1": {}, "d2": {"numeric": ["x"]}, "d3": {"numeric": ["x"]}},
        joins=[
            {"left": "fact", "right": "d1", "on": "k1"},
            {"left": "d1", "right": "d2", "on": "k2"},
            {"left": "fact", "right": "d3", "on": "k3"},
        ],
    )
    assert_mapping_equals_merge(validate_tables(snowflake, frames), frames)


def test_composite_string_keys_match_merge():
    rng = np.random.default_rng(2)
    origins = np.array(["EWR", "JFK", "LGA"])
    hours = np.array([f"2013-01-01 {h:02d}:00:00" for h in range(24)])
    fact = pd.DataFrame(
        {"origin": rng.choice(origins, 500), "time_hour": rng.choice(hours, 500), "y": rng.normal(size=500)}
    )
    grid = pd.MultiIndex.from_product([origins, hours[:20]]).to_frame(index=False, name=["origin", "time_hour"])
    weather = grid.assign(temp=rng.normal(size=len(grid)))
    weather = pd.concat([weather, weather.iloc[:3]], ignore_index=True)  # duplicate hours (many-to-many)
    frames = {"fact": fact, "weather": weather}
    spec = validate_tables(
        spec_of(
            tables={"fact": {}, "weather": {"numeric": ["temp"]}},
            joins=[{"left": "fact", "right": "weather", "on": ["origin", "time_hour"]}],
        ),
        frames,
    )
    assert_mapping_equals_merge(spec, frames)


def test_digests_are_keyed_not_plain_sha256():
    frame = pd.DataFrame({"k": [1, 2, 2, 3]})
    d = key_digests(frame, ["k"], SECRET)
    assert d.shape == (4, 2) and d.dtype == np.uint64
    np.testing.assert_array_equal(d[1], d[2])
    assert not np.array_equal(d[0], d[1])
    plain = np.frombuffer(hashlib.sha256(b"i1").digest()[:16], dtype="<u8")
    plain_raw = np.frombuffer(hashlib.sha256(b"1").digest()[:16], dtype="<u8")
    assert not np.array_equal(d[0], plain) and not np.array_equal(d[0], plain_raw)
    other = key_digests(frame, ["k"], b"another-secret")
    assert not np.array_equal(d, other)  # the server cannot recompute digests without the secret


def test_keys_travel_as_narrow_codes_and_one_digest_per_distinct_value():
    """The keys reply's memory per row: a uint16 code per row while a key has at most 2^16 distinct values
    (uint32 beyond), one 16-byte digest per distinct value; gathered back, the per-row digests."""
    frame = pd.DataFrame({"k": np.arange(200_000) % 65_536})
    codes, digests = distinct_digests(frame, ["k"], SECRET)
    assert codes.dtype == np.uint16 and digests.shape == (65_536, 2)
    np.testing.assert_array_equal(digests[codes], key_digests(frame, ["k"], SECRET))
    assert distinct_digests(frame.assign(k=np.arange(200_000)), ["k"], SECRET)[0].dtype == np.uint32
    assert [code_dtype(n) for n in (1, 2**16, 2**16 + 1, 2**32, 2**32 + 1)] == [
        np.uint16,
        np.uint16,
        np.uint32,
        np.uint32,
        np.uint64,
    ]


def test_mapping_invariant_to_secret_and_int_widths():
    frames = frames_star_mn()
    spec = validate_tables(spec_of(**STAR), frames)
    m1 = mapping_of(spec, frames)
    frames32 = {**frames, "A": frames["A"].astype({"a": np.int32})}
    m2 = mapping_of(spec, frames32, secret=b"x")
    for t in spec.table_names:
        np.testing.assert_array_equal(m1.p[t], m2.p[t])


def test_segment_sum_and_batches():
    p = np.array([0, 2, 2, 1, 2])
    v = np.arange(10.0).reshape(5, 2)
    np.testing.assert_allclose(segment_sum(p, v, 4), [[0, 1], [6, 7], [2 + 4 + 8, 3 + 5 + 9], [0, 0]])
    np.testing.assert_allclose(segment_sum(p, v[:, 0], 4), [0, 6, 14, 0])
    U, inv = batch_segments(p[[1, 3, 4]])
    np.testing.assert_array_equal(U[inv], p[[1, 3, 4]])


def test_split_by_label_rows():
    frames = frames_star_mn()
    spec = validate_tables(spec_of(**STAR, split={"test_fraction": 0.2, "seed": 3}), frames)
    m = mapping_of(spec, frames)
    train, test = split_mapping(spec, m)
    assert train.N + test.N == m.N
    assert not set(train.p["fact"]) & set(test.p["fact"])  # a label row is in one split only


# ------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("fraction", [0, 0.0, 1, -0.1, "half"])
def test_test_fraction_outside_zero_one_is_refused_by_the_spec_check(fraction):
    with pytest.raises(SpecError, match=r"^dataset 't': split.test_fraction must be in \(0, 1\) .*got "):
        spec_of(**STAR, split={"test_fraction": fraction})  # 0: no test rows, no metric (after loading, before)


def test_unknown_table_in_join():
    with pytest.raises(SpecError, match="unknown table 'Z'"):
        spec_of(tables={"fact": {}, "A": {}}, joins=[{"left": "fact", "right": "Z", "on": "a"}])


def test_unknown_column():
    frames = frames_star_mn()
    frames["A"] = frames["A"].rename(columns={"xa": "other"})
    with pytest.raises(SpecError, match=r"table 'A' has no column 'xa'"):
        validate_tables(spec_of(**STAR), frames)


def test_unknown_key_column():
    frames = frames_star_mn()
    frames["C"] = frames["C"].rename(columns={"c": "cc"})
    with pytest.raises(SpecError, match=r"table 'C' has no column 'c'"):
        validate_tables(spec_of(**STAR), frames)


def test_key_dtype_mismatch():
    frames = frames_star_mn()
    frames["A"] = frames["A"].astype({"a": str})
    with pytest.raises(SpecError, match=r"key dtype mismatch: fact\.a is integer but A\.a is string"):
        validate_tables(spec_of(**STAR), frames)


def test_datetime_keys_join_as_instants_and_never_a_naive_column():
    """Time-zone-aware keys join instant for instant (the same time in two zones is one key); a naive column
    against an aware one (which zone it is in is not known) is refused naming both, not joined to nothing."""
    frames = frames_star_mn()
    when = pd.Timestamp("2024-03-01 12:00", tz="UTC") + pd.to_timedelta(np.arange(20), unit="h")
    frames["fact"]["a"] = when[frames["fact"]["a"].to_numpy()]
    frames["A"]["a"] = when.tz_convert("Asia/Tokyo")  # the same instants, another zone
    spec = validate_tables(spec_of(**STAR), frames)
    m = assert_mapping_equals_merge(spec, frames)
    assert (m.G("A") > 0).all()
    frames["A"]["a"] = when.tz_localize(None)
    with pytest.raises(SpecError, match=r"fact\.a is datetime with a time zone but A\.a is datetime; give both"):
        validate_tables(spec_of(**STAR), frames)


def test_nan_keys():
    frames = frames_star_mn()
    frames["fact"] = frames["fact"].astype({"b": float})
    frames["fact"].loc[5, "b"] = np.nan
    with pytest.raises(SpecError, match=r"table 'fact', key column 'b': 1 missing"):
        validate_tables(spec_of(**STAR), frames)


def test_no_label():
    frames = frames_star_mn()
    with pytest.raises(SpecError, match="no label"):
        validate_tables(spec_of(**STAR, label={"table": "fact", "column": "nope", "task": "regression"}), frames)
    with pytest.raises(SpecError, match="no label"):
        validate_tables(spec_of(**STAR, label={"column": "nope", "task": "regression"}), frames)
    with pytest.raises(SpecError, match="no label"):
        spec_of(**STAR, label={"task": "regression"})


def test_label_in_two_tables():
    frames = frames_star_mn()
    frames["A"]["y"] = 1.0
    with pytest.raises(SpecError, match=r"label column 'y' is in tables \['fact', 'A'\]"):
        validate_tables(spec_of(**STAR, label={"column": "y", "task": "regression"}), frames)
    tables = {**STAR["tables"], "A": {"numeric": ["xa", "y"]}}
    with pytest.raises(SpecError, match="label in two tables"):
        validate_tables(spec_of(tables=tables, joins=STAR["joins"]), frames)


def test_a_label_that_is_a_join_key_is_refused():
    """A label column that is also a join key: every joined row would hold the partner table's row of its own
    label (target leakage), and the server would see which rows share a label by their keys' digests."""
    frames = frames_star_mn()
    label = {"table": "fact", "column": "a", "task": "multiclass"}
    with pytest.raises(
        SpecError, match=r"table 'fact': the label column 'a' is also its join key to table\(s\) \['A'\]"
    ):
        validate_tables(spec_of(**STAR, label=label), frames)


def test_disconnected_join_graph():
    with pytest.raises(SpecError, match=r"disconnected: tables \[\['C'\]\] are not joined"):
        spec_of(tables=STAR["tables"], joins=STAR["joins"][:2])


def test_cycle_in_join_graph():
    joins = STAR["joins"] + [{"left": "A", "right": "B", "on": [["a", "b"]]}]
    with pytest.raises(SpecError, match="join graph has a cycle: join A.a = B.b"):
        spec_of(tables=STAR["tables"], joins=joins)


def test_empty_join():
    frames = frames_star_mn()
    frames["C"] = frames["C"].assign(c=frames["C"]["c"] + 1000)
    spec = validate_tables(spec_of(**STAR), frames)
    with pytest.raises(SpecError, match=r"join fact\.c = C\.c matched no rows"):
        mapping_of(spec, frames)


def test_binned_column_must_be_numeric_feature():
    tables = {**STAR["tables"], "A": {"numeric": ["xa"], "binned": {"other": 4}}}
    with pytest.raises(SpecError, match="table 'A': binned column 'other' must be one of its numeric columns"):
        spec_of(tables=tables, joins=STAR["joins"])
    tables = {**STAR["tables"], "A": {"numeric": ["xa"], "binned": {"xa": 1}}}
    with pytest.raises(SpecError, match="needs at least 2 bins"):
        spec_of(tables=tables, joins=STAR["joins"])


def test_declared_label_classes_code_every_shards_file_alike_and_differing_files_are_refused():
    """label.classes gives class ids in its order, whichever classes a shard's own file holds (binary: one of
    the two is enough); without it, two shards' files of different class lists (of the same count, which the
    count check cannot see) are refused at setup: each shard sends its class list keyed by the owners' secret."""
    from types import SimpleNamespace

    from strategies.setup import JoinSetup
    from tpflower.local_table import ShardData, encode_labels
    from tpflower.phases.setup import label_metrics

    def spec(classes=None, task="multiclass"):
        label = {"table": "fact", "column": "y", "task": task, **({"classes": classes} if classes else {})}
        return spec_of(tables={"fact": {"shards": {"parts": 2}}}, joins=[], label=label)

    east = pd.DataFrame({"y": ["TS", "HU", "TD", "HU"]})  # the two owners' files: no EX in one, no TD in the other
    west = pd.DataFrame({"y": ["EX", "HU", "TS", "TS"]})
    declared = spec(["TS", "HU", "TD", "EX"])
    assert encode_labels(declared, east["y"])[0].tolist() == [0, 1, 2, 1]
    assert encode_labels(declared, west["y"])[0].tolist() == [3, 1, 0, 0]
    assert encode_labels(spec(["no", "yes"], "binary"), pd.Series(["yes", "yes"]))[0].tolist() == [1.0, 1.0]
    with pytest.raises(SpecError, match="label column 'y': 1 labels are not among label.classes"):
        encode_labels(spec(["TS", "HU", "TD"]), west["y"])
    with pytest.raises(SpecError, match=r"label.classes must list two distinct classes, \[negative, positive\]"):
        spec(["a", "b", "c"], "binary")

    def reply(s, frame):
        client = SimpleNamespace(
            data=ShardData(s, "fact", frame, np.arange(len(frame))),
            settings=SimpleNamespace(secret=b"owners' secret", owner=SimpleNamespace(keys="hmac")),
            privacy=lambda: {"name": "none"},
        )
        return label_metrics(client)

    setup = SimpleNamespace(spec=spec())
    undeclared = {("fact", 0): ({}, reply(spec(), east)), ("fact", 1): ({}, reply(spec(), west))}
    assert undeclared[("fact", 0)][1]["n_classes"] == undeclared[("fact", 1)][1]["n_classes"] == 3
    with pytest.raises(RuntimeError, match="its shards' files hold different classes of the label, so their class"):
        JoinSetup._labels(setup, undeclared, 8)
    agreed = [reply(declared, f) for f in (east, west)]
    assert agreed[0]["classes_digest"] == agreed[1]["classes_digest"]
    assert "HU" not in str(agreed)  # the list travels keyed, never as names
    # under keys=blind the list is keyed by the table owner's own secret, which its shards share
    blind = {("fact", q): ({}, reply(spec(), f)) for q, f in enumerate((east, west))}
    with pytest.raises(RuntimeError, match="its shards' files hold different classes of the label"):
        JoinSetup._labels(setup, blind, 8)


def test_nodes_that_must_share_a_secret_and_do_not_are_refused_naming_them():
    """A node whose secret differs from the ones it must share (every node's join-key secret under keys=hmac,
    a sharded table's shards' secret under keys=blind) stops the run at the keys round, naming the nodes by the
    secret they hold; the server sees a keyed check value of each secret, never the secret."""
    from strategies.setup import key_mode
    from tpflower.phases.setup import secret_check

    ours, theirs = secret_check(b"owners' secret"), secret_check(b"another secret")
    assert ours == secret_check(b"owners' secret") != theirs and secret_check(b"") == ""
    assert "owners" not in ours and len(ours) == 32

    def replies(blind, **checks):
        return {
            (t, int(q)): ({}, {"blind_keys": int(blind), "secret_check": v})
            for (t, q), v in ((k.split("_"), v) for k, v in checks.items())
        }

    assert key_mode(replies(False, fact_0=ours, fact_1=ours, dim_0=ours)) == "hmac"
    with pytest.raises(ValueError, match=r"the nodes do not all hold the owners' join-key secret .*'dim' shard 0"):
        key_mode(replies(False, fact_0=ours, fact_1=ours, dim_0=theirs))
    # blind: each table's own secret (or none), its shards alike
    assert key_mode(replies(True, fact_0=ours, fact_1=ours, dim_0=theirs, other_0="")) == "blind"
    with pytest.raises(
        ValueError,
        match=r"table 'fact''s shards do not hold one secret .*'fact' shard 0 secret 1; 'fact' shard 1 no secret",
    ):
        key_mode(replies(True, fact_0=ours, fact_1="", dim_0=theirs))
