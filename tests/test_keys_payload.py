"""The keys payload built chunk by chunk (tpflower.keys_payload): its chunks put together are the payload
built whole, which is what tpflower.mapping and tpflower.blind compute over the whole table (the same codes
into the same shuffled list, the same digests and blinded values), for every key kind and composite keys."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tests.mapping_reference import SECRET
from tpflower.blind import blind_keys, new_scalar
from tpflower.keys_payload import DistinctKeys, KeysPayload, first_appearance
from tpflower.mapping import canonical_tuples, distinct_digests, encode_values, join_seed, key_codes
from tpflower.schema import SpecError, parse_spec

SEED = bytes(range(16))


def frame(n: int = 300) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        {
            "i": rng.integers(-50, 50, n),
            "s": np.array([f"k{v}é" for v in rng.integers(0, 40, n)], dtype=object),
            "f": rng.integers(0, 9, n) / 4 - 1.0,
            "t": pd.Timestamp("2024-01-01") + pd.to_timedelta(rng.integers(0, 30, n), unit="D"),
            "b": rng.integers(0, 2, n).astype(bool),
            "u": rng.integers(0, 5, n).astype(np.uint8),
        }
    )


@pytest.mark.parametrize("columns", [["i"], ["s"], ["f"], ["t"], ["b"], ["u"], ["i", "s"], ["t", "f", "b"]])
def test_distinct_keys_code_and_encode_as_the_whole_table_factorization(columns):
    """First appearance order, codes and encodings equal pandas' factorize of the whole table and the
    value-by-value encoding, found in 7-row steps."""
    data = frame()
    codes, tuples, kinds = key_codes(data, columns)
    keys = DistinctKeys(data, columns, SEED, step=7)
    assert keys.n_distinct == len(tuples)
    rank = np.empty(len(tuples), dtype=np.int64)
    rank[keys.order] = np.arange(len(tuples))
    np.testing.assert_array_equal(
        np.concatenate([keys.codes(lo, lo + 7) for lo in range(0, len(data), 7)]), rank[codes]
    )
    encoded = canonical_tuples(tuples, kinds)
    assert keys.encoded(0, len(tuples)) == [encoded[i] for i in keys.order]
    if len(columns) == 1:
        assert encode_values(pd.Index([t[0] for t in tuples]), kinds[0]) == encoded


def test_first_appearance_merges_as_it_goes():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 3000, 50_000)
    got = first_appearance(pd.Index(values[i : i + 100]) for i in range(0, len(values), 100))
    np.testing.assert_array_equal(np.asarray(got), pd.unique(values))


def spec_of():
    return parse_spec(
        {
            "name": "t",
            "tables": {"fact": {"numeric": []}, "A": {}, "B": {}},
            "joins": [{"left": "fact", "right": "A", "on": "i"}, {"left": "fact", "right": "B", "on": ["s", "t"]}],
            "label": {"table": "fact", "column": "y", "task": "regression"},
        }
    )


@pytest.mark.parametrize("mode", ["hmac", "blind"])
@pytest.mark.parametrize("label_dp", [False, True])
def test_chunks_put_together_are_the_whole_payload(mode, label_dp):
    """7-row chunks of a payload equal the payload built whole and what mapping.distinct_digests and
    blind.blind_keys give for the same shuffle seed; labels under label DP: the training rows' only."""
    data = frame(103)
    spec = spec_of()
    scalar = new_scalar()
    is_test = np.arange(len(data)) % 5 == 0
    y = np.linspace(0, 1, len(data))
    y_sent = y[~is_test] if label_dp else y
    ids = np.arange(1000, 1000 + len(data))
    payload = KeysPayload(spec, "fact", data, ids, mode, SECRET, scalar, SEED, y_sent, is_test)
    whole = payload.whole()
    parts = [payload.chunk(lo, lo + 7) for lo in range(0, len(data), 7)]
    for name, a in whole.items():
        np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), a, err_msg=name)
    assert whole["row_ids"].dtype == np.int32 and whole["is_test"].dtype == np.uint8
    np.testing.assert_array_equal(whole["y"], y_sent)
    assert payload.n_values() == {0: data["i"].nunique(), 1: len(data[["s", "t"]].drop_duplicates())}
    for k, cols in ((0, ["i"]), (1, ["s", "t"])):
        if mode == "hmac":
            codes, values = distinct_digests(data, cols, SECRET, join_seed(SEED, k))
            np.testing.assert_array_equal(whole[f"digest.{k}"], values)
        else:
            codes, values = blind_keys(data, cols, scalar, join_seed(SEED, k))
            np.testing.assert_array_equal(whole[f"blind.{k}"], values)
        np.testing.assert_array_equal(whole[f"code.{k}"], codes)
        assert whole[f"code.{k}"].dtype == codes.dtype


def test_missing_key_values_are_refused():
    data = frame(20)
    data.loc[3, "i"] = None
    with pytest.raises(SpecError, match=r"key columns \['i'\] hold missing values"):
        DistinctKeys(data, ["i"], None)
