"""Table mapping (TablePuppet Sec. 3.1.1): p_i, G_i and segment sums, built from keyed digests of join keys.

Clients send, per row, a keyed digest of each join key they take part in plus the row id (a
:class:`KeyProjection`); the server joins those along the join tree of the spec and obtains, for every
table i, p_i: [N] -> [n_i] (joined row j comes from row p_i(j) of T_i). Features never take part.

Digests are HMAC-SHA256 under a secret that the clients share and the server does not know, truncated to
128 bits, so the server can test keys for equality but cannot dictionary-attack them (ALGORITHMS.md, Privacy).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tpflower.schema import RelationalSpec, SpecError, key_kind

DIGEST_WORDS = 2  # a digest is 128 bits = two uint64 words


# -------------------------------------------------------------------------------------------- digests


def _canonical(value: object, kind: str) -> bytes:
    """A byte encoding of one key value that is equal across tables for equal keys of the same kind."""
    if kind == "integer" or kind == "bool":
        return b"i" + str(int(value)).encode()  # type: ignore[call-overload]
    if kind == "float":
        return b"f" + repr(float(value)).encode()  # type: ignore[arg-type]
    if kind == "datetime":
        return b"t" + pd.Timestamp(value).isoformat().encode()  # type: ignore[arg-type]
    return b"s" + str(value).encode("utf-8")


def key_digests(frame: pd.DataFrame, columns: Sequence[str], secret: bytes) -> np.ndarray:
    """Keyed digests of the key tuple ``frame[columns]`` per row: a (n, 2) uint64 array.

    HMAC-SHA256(secret, canonical key tuple), first 128 bits. The HMAC runs once per distinct key, not
    per row: rows are factorized first and the digests gathered back.
    """
    if not secret:
        raise ValueError("the join-key secret is empty; set mapping.secret (shared by the clients)")
    kinds = [key_kind(frame[c].dtype) for c in columns]
    if len(columns) == 1:
        codes, uniques = pd.factorize(frame[columns[0]], sort=False)
        tuples: Sequence[tuple] = [(u,) for u in uniques]
    else:
        codes, uniq = pd.factorize(pd.MultiIndex.from_frame(frame[list(columns)]), sort=False)
        tuples = list(uniq)
    if len(codes) and codes.min() < 0:
        raise SpecError(f"key columns {list(columns)} hold missing values; keys must be complete")
    sep = b"\x1f"
    blob = b"".join(
        hmac.digest(secret, sep.join(_canonical(v, k) for v, k in zip(t, kinds)), hashlib.sha256)[:16]
        for t in tuples
    )
    per_key = np.frombuffer(blob, dtype="<u8").reshape(-1, DIGEST_WORDS)
    return per_key[codes]


@dataclass
class KeyProjection:
    """What one client (a table, or one shard of it) sends for table mapping: no features, no raw keys.

    row_ids: global row ids of the table (int64, shape (n,)); digests[k]: (n, 2) uint64 digests of the
    key columns of join k of the spec (only joins that involve this table).
    """

    table: str
    row_ids: np.ndarray
    digests: dict[int, np.ndarray]

    def arrays(self) -> list[np.ndarray]:
        """Flat ndarray payload (row ids, then digests in join order) for a Flower message."""
        return [self.row_ids] + [self.digests[k] for k in sorted(self.digests)]


def project_keys(spec: RelationalSpec, table: str, frame: pd.DataFrame, row_ids: np.ndarray, secret: bytes) -> KeyProjection:
    """The client side of table mapping: digests of every join key that ``table`` takes part in."""
    digests = {
        k: key_digests(frame, j.columns_of(table), secret)
        for k, j in enumerate(spec.joins)
        if table in (j.left, j.right)
    }
    return KeyProjection(table=table, row_ids=np.asarray(row_ids, dtype=np.int64), digests=digests)


# -------------------------------------------------------------------------------------------- mapping


@dataclass
class TableMapping:
    """p_i for every table over the N joined rows, and the row counts n_i.

    p[t] is an int64 array of length N: joined row j takes row p[t][j] of table t.
    """

    p: dict[str, np.ndarray]
    n_rows: dict[str, int]

    @property
    def N(self) -> int:
        return len(next(iter(self.p.values())))

    @property
    def tables(self) -> tuple[str, ...]:
        return tuple(self.p)

    def G(self, table: str) -> np.ndarray:
        """G_iu = |G_i(u)|: how often each row u of the table occurs in the join (Eq. 11 over all rows)."""
        return np.bincount(self.p[table], minlength=self.n_rows[table])

    def subset(self, rows: np.ndarray) -> "TableMapping":
        """The mapping restricted to the joined rows ``rows`` (indices or a boolean mask), in that order."""
        return TableMapping(p={t: p[rows] for t, p in self.p.items()}, n_rows=dict(self.n_rows))

    def segment_sum(self, table: str, values: np.ndarray) -> np.ndarray:
        """(S_i v)_u = sum_{j in G_i(u)} v_j over all rows u of the table (Eq. 10/14 with B = [N])."""
        return segment_sum(self.p[table], values, self.n_rows[table])


def segment_sum(index: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """out[u] = sum of values[j] over j with index[j] == u; values (N,) or (N, d). Vectorized (bincount).

    The result keeps the dtype of ``values`` (bincount accumulates in float64).
    """
    values = np.asarray(values)
    if values.ndim == 1:
        return np.bincount(index, weights=values, minlength=size).astype(values.dtype, copy=False)
    out = np.empty((size, values.shape[1]), dtype=values.dtype)
    for k in range(values.shape[1]):  # over the d_c output columns, never over rows
        out[:, k] = np.bincount(index, weights=values[:, k], minlength=size)
    return out


def batch_segments(p_batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """U_i = unique(p_i[B]) and the inverse map: p_batch == U[inverse] (LoJ with SGD, step 1)."""
    U, inverse = np.unique(p_batch, return_inverse=True)
    return U, inverse.reshape(-1)


def _union_shards(table: str, projections: Sequence[KeyProjection], n_rows: int) -> dict[int, np.ndarray]:
    """Per join k: digests indexed by global row id, from all shards of one table."""
    out: dict[int, np.ndarray] = {}
    covered = np.zeros(n_rows, dtype=bool)
    for proj in projections:
        if proj.row_ids.size and (proj.row_ids.min() < 0 or proj.row_ids.max() >= n_rows):
            raise SpecError(f"table {table!r}: a shard sent row ids outside [0, {n_rows})")
        if covered[proj.row_ids].any():
            raise SpecError(f"table {table!r}: two shards sent the same row id")
        covered[proj.row_ids] = True
        for k, d in proj.digests.items():
            arr = out.setdefault(k, np.zeros((n_rows, DIGEST_WORDS), dtype=np.uint64))
            arr[proj.row_ids] = d
    if not covered.all():
        raise SpecError(f"table {table!r}: rows {np.flatnonzero(~covered)[:5].tolist()}... were sent by no shard")
    return out


def build_mapping(spec: RelationalSpec, projections: Mapping[str, Sequence[KeyProjection]]) -> TableMapping:
    """The server side of table mapping: join the key projections along the spec's join tree.

    Inner-join semantics (a row with no partner drops out); one-to-one, many-to-one and many-to-many
    edges; composite keys. Memory O(N * M) integers. Raises SpecError naming the join that matched nothing.
    """
    n_rows = {t: int(sum(len(p.row_ids) for p in projections[t])) for t in spec.table_names}
    digests = {t: _union_shards(t, projections[t], n_rows[t]) for t in spec.table_names}
    join_index = {j: k for k, j in enumerate(spec.joins)}
    root = spec.label_table
    joined = pd.DataFrame({root: np.arange(n_rows[root], dtype=np.int64)})
    for edge, known, new in spec.join_order():
        k = join_index[edge]
        left_keys = digests[known][k][joined[known].to_numpy()]
        left = joined.assign(_h0=left_keys[:, 0], _h1=left_keys[:, 1])
        right_keys = digests[new][k]
        right = pd.DataFrame({new: np.arange(n_rows[new], dtype=np.int64), "_h0": right_keys[:, 0], "_h1": right_keys[:, 1]})
        joined = left.merge(right, on=["_h0", "_h1"], how="inner", sort=False).drop(columns=["_h0", "_h1"])
        if joined.empty:
            raise SpecError(f"join {edge} matched no rows: the join comes out empty (check the key values)")
    return TableMapping(
        p={t: joined[t].to_numpy(dtype=np.int64) for t in spec.table_names},
        n_rows=n_rows,
    )


def holdout_mask(spec: RelationalSpec, n_label_rows: int) -> np.ndarray:
    """Boolean mask over the label table's rows: True for the test split (fraction and seed of the spec)."""
    rng = np.random.default_rng(spec.split.seed)
    mask = np.zeros(n_label_rows, dtype=bool)
    mask[rng.permutation(n_label_rows)[: int(round(spec.split.test_fraction * n_label_rows))]] = True
    return mask


def split_mapping(spec: RelationalSpec, mapping: TableMapping) -> tuple[TableMapping, TableMapping]:
    """(train, test) mappings: a joined row is a test row when its label-table row is in the test split."""
    is_test = holdout_mask(spec, mapping.n_rows[spec.label_table])[mapping.p[spec.label_table]]
    return mapping.subset(~is_test), mapping.subset(is_test)
