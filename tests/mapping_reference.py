"""Reference for the table mapping: a pandas merge of the full tables (keys in the clear), as row-id tuples."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from tpflower.mapping import KeyProjection, TableMapping, build_mapping, project_keys
from tpflower.schema import RelationalSpec

SECRET = b"test-secret"


def mapping_of(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame], secret: bytes = SECRET) -> TableMapping:
    """The federated path: each table projects its keys to digests, the server joins the digests."""
    projections = {t: [project_keys(spec, t, frames[t], np.arange(len(frames[t])), secret)] for t in spec.table_names}
    return build_mapping(spec, projections)


def merged_row_ids(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame]) -> np.ndarray:
    """Row-id tuples (N, M) of the plain pandas merge of the full tables, columns in spec.table_names order."""
    renamed = {
        t: frames[t].rename(columns=lambda c, t=t: f"{t}.{c}").assign(**{f"rid.{t}": np.arange(len(frames[t]))})
        for t in spec.table_names
    }
    joined = renamed[spec.label_table]
    for edge, known, new in spec.join_order():
        left_on = [f"{known}.{c}" for c in edge.columns_of(known)]
        right_on = [f"{new}.{c}" for c in edge.columns_of(new)]
        joined = joined.merge(renamed[new], left_on=left_on, right_on=right_on, how="inner")
    return joined[[f"rid.{t}" for t in spec.table_names]].to_numpy(dtype=np.int64)


def as_sorted_tuples(rows: np.ndarray) -> np.ndarray:
    """Rows sorted lexicographically, so two multisets of tuples compare with array_equal."""
    return rows[np.lexsort(rows.T[::-1])]


def assert_mapping_equals_merge(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame]) -> TableMapping:
    mapping = mapping_of(spec, frames)
    ours = np.stack([mapping.p[t] for t in spec.table_names], axis=1)
    ref = merged_row_ids(spec, frames)
    assert ours.shape == ref.shape, f"N differs: mapping {ours.shape[0]} vs merge {ref.shape[0]}"
    np.testing.assert_array_equal(as_sorted_tuples(ours), as_sorted_tuples(ref))
    for t in spec.table_names:
        assert mapping.G(t).sum() == mapping.N
    return mapping


def pandas_build_mapping(spec: RelationalSpec, projections: Mapping[str, list[KeyProjection]]) -> TableMapping:
    """The table mapping as the server built it before the chunked build: pandas merges of the digest columns over the
    joined rows (int64 indices). The chunked build must give the same p_i, in the same order."""
    n_rows = {t: int(sum(len(p.row_ids) for p in projections[t])) for t in spec.table_names}
    digests = {}
    for t in spec.table_names:
        per_join: dict[int, np.ndarray] = {}
        for proj in projections[t]:
            for k in proj.digests:
                per_join.setdefault(k, np.zeros((n_rows[t], 2), dtype=np.uint64))[proj.row_ids] = proj.row_digests(k)
        digests[t] = per_join
    join_index = {j: k for k, j in enumerate(spec.joins)}
    root = spec.label_table
    joined = pd.DataFrame({root: np.arange(n_rows[root], dtype=np.int64)})
    for edge, known, new in spec.join_order():
        k = join_index[edge]
        left_keys = digests[known][k][joined[known].to_numpy()]
        left = joined.assign(_h0=left_keys[:, 0], _h1=left_keys[:, 1])
        right_keys = digests[new][k]
        right = pd.DataFrame(
            {new: np.arange(n_rows[new], dtype=np.int64), "_h0": right_keys[:, 0], "_h1": right_keys[:, 1]}
        )
        joined = left.merge(right, on=["_h0", "_h1"], how="inner", sort=False).drop(columns=["_h0", "_h1"])
    return TableMapping(p={t: joined[t].to_numpy(dtype=np.int64) for t in spec.table_names}, n_rows=n_rows)
