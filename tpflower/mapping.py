"""Table mapping (TablePuppet Sec. 3.1.1): p_i, G_i and segment sums, built from keyed digests of join keys.

Clients send the row ids and, for each join key they take part in, per row a narrow integer code of its key
value and per distinct value one keyed digest (a :class:`KeyProjection`: 2 or 4 bytes per row and key, not a
16-byte digest); the server joins those along the join tree of the spec and obtains, for every table i,
p_i: [N] -> [n_i] (joined row j comes from row p_i(j) of T_i). Features never take part.

Digests are HMAC-SHA256 under a secret that the clients share and the server does not know, truncated to
128 bits, so the server can test keys for equality but cannot dictionary-attack them (docs/algorithms.md, Privacy).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tpflower.schema import DATETIME_TZ, RelationalSpec, SpecError, key_kind

DIGEST_WORDS = 2  # a digest is 128 bits = two uint64 words
KEY_SEP = b"\x1f"  # between the canonical encodings of a composite key's values


# -------------------------------------------------------------------------------------------- digests


def _canonical(value: object, kind: str) -> bytes:
    """A byte encoding of one key value that is equal across tables for equal keys of the same kind."""
    if kind == "integer" or kind == "bool":
        return b"i" + str(int(value)).encode()  # type: ignore[call-overload]
    if kind == "float":
        return b"f" + repr(float(value)).encode()  # type: ignore[arg-type]
    if kind == "datetime":
        return b"t" + pd.Timestamp(value).isoformat().encode()  # type: ignore[arg-type]
    if kind == DATETIME_TZ:  # the instant, in UTC: the same time in two zones joins
        return b"t" + pd.Timestamp(value).tz_convert("UTC").isoformat().encode()  # type: ignore[arg-type]
    return b"s" + str(value).encode("utf-8")


def key_codes(frame: pd.DataFrame, columns: Sequence[str]) -> tuple[np.ndarray, Sequence[tuple], list[str]]:
    """(codes, distinct key tuples, key kinds) of the key tuple ``frame[columns]``: row r holds tuple codes[r]."""
    kinds = [key_kind(frame[c].dtype) for c in columns]
    if len(columns) == 1:
        codes, uniques = pd.factorize(frame[columns[0]], sort=False)
        tuples: Sequence[tuple] = [(u,) for u in uniques]
    else:
        codes, uniq = pd.factorize(pd.MultiIndex.from_frame(frame[list(columns)]), sort=False)
        tuples = list(uniq)
    if len(codes) and codes.min() < 0:
        raise SpecError(f"key columns {list(columns)} hold missing values; keys must be complete")
    return codes, tuples, kinds


def encode_values(values: pd.Index, kind: str) -> list[bytes]:
    """The canonical encodings of the values of one key column of kind ``kind``, the same bytes as
    :func:`_canonical` value by value (one formatting per value, no dispatch per value)."""
    if kind in ("integer", "bool"):
        return [b"i%d" % v for v in values.tolist()]
    if kind == "float":
        return [b"f%r" % v for v in map(float, values.tolist())]
    if kind == "datetime":
        return [b"t" + pd.Timestamp(v).isoformat().encode() for v in values]
    if kind == DATETIME_TZ:
        return [b"t" + pd.Timestamp(v).tz_convert("UTC").isoformat().encode() for v in values]
    return [b"s" + str(v).encode("utf-8") for v in values.tolist()]


def require_secret(secret: bytes) -> None:
    """The join-key secret of keys=hmac: refused when empty (ValueError)."""
    if not secret:
        raise ValueError("the join-key secret is empty; set mapping.secret (shared by the clients)")


def hmac_digests(encoded: Sequence[bytes], secret: bytes) -> np.ndarray:
    """Keyed digests of canonical key encodings: HMAC-SHA256(secret, e), first 128 bits ((n, 2) uint64)."""
    require_secret(secret)
    blob = b"".join(hmac.digest(secret, e, hashlib.sha256)[:16] for e in encoded)
    return np.frombuffer(blob, dtype="<u8").reshape(-1, DIGEST_WORDS).copy()


def canonical_tuples(tuples: Sequence[tuple], kinds: Sequence[str]) -> list[bytes]:
    """The canonical byte encoding of each key tuple (equal across tables for equal keys)."""
    return [KEY_SEP.join(_canonical(v, k) for v, k in zip(t, kinds)) for t in tuples]


def key_digests(frame: pd.DataFrame, columns: Sequence[str], secret: bytes) -> np.ndarray:
    """Keyed digests of the key tuple ``frame[columns]`` per row: a (n, 2) uint64 array (see
    :func:`distinct_digests`, gathered back to the rows)."""
    codes, per_key = distinct_digests(frame, columns, secret)
    return per_key[codes]


def code_dtype(n_distinct: int) -> np.dtype:
    """The narrowest unsigned dtype of the codes 0..n_distinct-1 of a key column: uint16, uint32 or uint64."""
    for dtype in (np.uint16, np.uint32):
        if n_distinct <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def distinct_digests(
    frame: pd.DataFrame, columns: Sequence[str], secret: bytes, seed: bytes | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(codes, digests): each row's code (:func:`code_dtype`) into the table's distinct key tuples of
    ``frame[columns]`` (in a random order, :func:`shuffled` with ``seed``), and one keyed digest per distinct
    tuple ((n_distinct, 2) uint64).

    HMAC-SHA256(secret, canonical key tuple), first 128 bits: the HMAC runs once per distinct key, not per row.
    """
    require_secret(secret)
    codes, tuples, kinds = key_codes(frame, columns)
    per_key = hmac_digests(canonical_tuples(tuples, kinds), secret)
    rank, order = shuffled(len(per_key), seed)
    return rank.astype(code_dtype(len(per_key)))[codes], per_key[order]


def shuffled(n: int, seed: bytes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rank, order) of a random permutation of n distinct values (OS entropy, or the node's secret ``seed``: the
    same permutation again, for a node that recomputes its keys reply): value v goes to position rank[v] of the
    list ``values[order]``. The codes a client sends then follow neither its rows' order nor its key values."""
    order = np.random.default_rng(int.from_bytes(seed or os.urandom(16), "little")).permutation(n)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    return rank, order


@dataclass
class KeyProjection:
    """What one client (a table, or one shard of it) sends for table mapping: no features, no raw keys.

    row_ids: global row ids of the table (shape (n,)); per join k of the spec that involves this table,
    codes[k]: each row's code (a narrow unsigned integer, shape (n,)) into digests[k], one 128-bit digest per
    distinct key value ((n_distinct, 2) uint64; keyed HMAC digests, or digests of fully blinded values).
    """

    table: str
    row_ids: np.ndarray
    codes: dict[int, np.ndarray]
    digests: dict[int, np.ndarray]

    def row_digests(self, k: int) -> np.ndarray:
        """The digest of every row's key of join k ((n, 2) uint64)."""
        return self.digests[k][self.codes[k]]

    def arrays(self) -> list[np.ndarray]:
        """Flat ndarray payload (row ids, then codes and digests in join order) for a Flower message."""
        return [self.row_ids] + [a for k in sorted(self.codes) for a in (self.codes[k], self.digests[k])]


def project_keys(
    spec: RelationalSpec,
    table: str,
    frame: pd.DataFrame,
    row_ids: np.ndarray,
    secret: bytes,
    seed: bytes | None = None,
) -> KeyProjection:
    """The client side of table mapping: codes and digests of every join key that ``table`` takes part in
    (shuffled by :func:`join_seed` of ``seed``, else by OS entropy)."""
    codes, digests = {}, {}
    for k, j in enumerate(spec.joins):
        if table in (j.left, j.right):
            codes[k], digests[k] = distinct_digests(frame, j.columns_of(table), secret, join_seed(seed, k))
    return KeyProjection(table, narrow_ids(row_ids), codes, digests)


def join_seed(seed: bytes | None, k: int) -> bytes | None:
    """The shuffle seed of join ``k`` derived from a node's secret ``seed`` (None: OS entropy)."""
    return None if seed is None else hashlib.sha256(seed + k.to_bytes(4, "little")).digest()[:16]


def narrow_ids(row_ids: np.ndarray) -> np.ndarray:
    """Row ids in the narrowest :func:`index_dtype` that holds them (int32 below 2^31)."""
    row_ids = np.asarray(row_ids)
    return row_ids.astype(index_dtype(int(row_ids.max()) + 1 if row_ids.size else 0), copy=False)


# -------------------------------------------------------------------------------------------- mapping

#: joined rows per chunk of the chunked server passes (segment sums, predictions, the mapping build): a few
#: MB of temporaries per chunk, whatever N is
CHUNK_ROWS = 1 << 18


def index_dtype(n: int) -> np.dtype:
    """The narrowest index dtype that holds row ids 0..n-1: int32 below 2^31 rows, else int64."""
    return np.dtype(np.int32) if n < 2**31 else np.dtype(np.int64)


def chunks(n: int, size: int | None = None) -> Iterator[slice]:
    """Consecutive slices of [0, n), ``size`` (default CHUNK_ROWS) rows each (the last may be shorter)."""
    size = int(size or CHUNK_ROWS)
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


@dataclass
class TableMapping:
    """p_i for every table over the N joined rows, and the row counts n_i.

    p[t] is an integer array of length N (int32 while n_t < 2^31, see :func:`index_dtype`): joined row j takes
    row p[t][j] of table t.
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

    def subset(self, rows: np.ndarray) -> TableMapping:
        """The mapping restricted to the joined rows ``rows`` (indices or a boolean mask), in that order (a copy)."""
        return TableMapping(p={t: p[rows] for t, p in self.p.items()}, n_rows=dict(self.n_rows))

    def rows(self, start: int, stop: int) -> TableMapping:
        """The joined rows [start, stop) as views of this mapping's arrays (no copy; see :class:`RowRange`)."""
        return RowRange(self, start, stop)

    def partition(self, is_test: np.ndarray) -> tuple[TableMapping, TableMapping]:
        """(train, test): the joined rows with ``is_test`` False, then those with True, each in their order.

        Reorders this mapping IN PLACE (train rows first, then test rows; one table at a time, no copy of the
        whole mapping) and returns views of it, so train and test cost no memory of their own. The result
        equals ``(subset(~is_test), subset(is_test))``.
        """
        is_test = np.asarray(is_test, dtype=bool)
        if is_test.shape != (self.N,):
            raise ValueError(f"partition: is_test must have shape ({self.N},), got {is_test.shape}")
        train, test = self.groups(is_test.view(np.uint8), 2)  # a view: no copy of the flags
        return train, test

    def groups(self, group: np.ndarray, n_groups: int) -> list[TableMapping]:
        """The joined rows of group 0, then of group 1, ... (``group[j]`` in [0, n_groups)), each in their order:
        as :meth:`partition`, reordered IN PLACE and returned as views."""
        bounds = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=n_groups))])
        for t, p in self.p.items():
            out = np.empty_like(p)
            for g in range(n_groups):  # one mask at a time: N bytes beside the group codes
                np.compress(group == g, p, out=out[bounds[g] : bounds[g + 1]])
            self.p[t] = out
        return [self.rows(int(bounds[g]), int(bounds[g + 1])) for g in range(n_groups)]

    def segment_sum(self, table: str, values: np.ndarray) -> np.ndarray:
        """(S_i v)_u = sum_{j in G_i(u)} v_j over all rows u of the table (Eq. 10/14 with B = [N])."""
        return segment_sum(self.p[table], values, self.n_rows[table])


class RowRange(TableMapping):
    """The joined rows [start, stop) of a ``base`` mapping: its p arrays are views of the base's.

    Pickles as (base, start, stop), so a checkpoint that holds the base and its ranges holds the base's arrays
    once, and the ranges are views again after loading."""

    def __init__(self, base: TableMapping, start: int, stop: int):
        if not 0 <= start <= stop <= base.N:
            raise ValueError(f"rows [{start}, {stop}) outside the mapping's [0, {base.N})")
        super().__init__({t: p[start:stop] for t, p in base.p.items()}, dict(base.n_rows))
        self.base, self.start, self.stop = base, int(start), int(stop)

    def __reduce__(self) -> tuple:
        return (RowRange, (self.base, self.start, self.stop))


class SegmentSums:
    """Chunked segment sums into the rows of one table: ``add`` the values of some joined rows (any order),
    then ``result``. Accumulates in float64; a chunk costs O(chunk + range of its indices)."""

    def __init__(self, size: int, width: int | None = None):
        self.size = int(size)
        self.out = np.zeros(self.size if width is None else (self.size, width), dtype=np.float64)

    def add(self, index: np.ndarray, values: np.ndarray) -> None:
        """out[u] += sum of values[j] over j with index[j] == u."""
        if len(index) == 0:
            return
        lo, hi = int(index.min()), int(index.max()) + 1
        local = index - lo if lo else index
        if values.ndim == 1:
            self.out[lo:hi] += np.bincount(local, weights=values, minlength=hi - lo)
        else:
            for k in range(values.shape[1]):  # over the d_c output columns, never over rows
                self.out[lo:hi, k] += np.bincount(local, weights=values[:, k], minlength=hi - lo)

    def result(self, dtype: np.dtype | type | None = None) -> np.ndarray:
        return self.out if dtype is None else self.out.astype(dtype, copy=False)


def segment_sum(index: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """out[u] = sum of values[j] over j with index[j] == u; values (N,) or (N, d). Vectorized (bincount).

    The result keeps the dtype of ``values`` (bincount accumulates in float64).
    """
    values = np.asarray(values)
    sums = SegmentSums(size, None if values.ndim == 1 else values.shape[1])
    sums.add(index, values)
    return sums.result(values.dtype)


def batch_segments(p_batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """U_i = unique(p_i[B]) and the inverse map: p_batch == U[inverse] (LoJ with SGD, step 1)."""
    U, inverse = np.unique(p_batch, return_inverse=True)
    return U, inverse.reshape(-1)


def _union_shards(
    table: str, projections: Sequence[KeyProjection], n_rows: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per join k: (codes indexed by global row id, digests), from all shards of one table: each shard's codes
    are moved past the digests of the shards before it. A table sent whole by one client, rows in order, is
    used as sent: no copy."""
    if len(projections) == 1 and len(projections[0].row_ids) == n_rows:
        ids, proj = projections[0].row_ids, projections[0]
        if n_rows == 0 or (ids[0] == 0 and ids[-1] == n_rows - 1 and bool(np.all(np.diff(ids) == 1))):
            return {k: (proj.codes[k], proj.digests[k]) for k in proj.codes}
    covered = np.zeros(n_rows, dtype=bool)
    for proj in projections:
        if proj.row_ids.size and (proj.row_ids.min() < 0 or proj.row_ids.max() >= n_rows):
            raise SpecError(f"table {table!r}: a shard sent row ids outside [0, {n_rows})")
        if covered[proj.row_ids].any():
            raise SpecError(f"table {table!r}: two shards sent the same row id")
        covered[proj.row_ids] = True
    if not covered.all():
        raise SpecError(f"table {table!r}: rows {np.flatnonzero(~covered)[:5].tolist()}... were sent by no shard")
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for k in projections[0].codes:
        n_codes = sum(len(p.digests[k]) for p in projections)
        codes = np.zeros(n_rows, dtype=code_dtype(n_codes))
        offset = 0
        for proj in projections:
            codes[proj.row_ids] = proj.codes[k].astype(codes.dtype) + codes.dtype.type(offset)
            offset += len(proj.digests[k])
        out[k] = (codes, np.concatenate([p.digests[k] for p in projections]))
    return out


def _digest_codes(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Integer codes of 128-bit digests, equal codes for equal digests on either side: (codes of ``left``
    rows, codes of ``right`` rows, number of codes). Exact: the first 64-bit word is factorized; if any value
    of it comes with two second words (two keys agreeing on 64 bits: practically never for HMAC digests), both
    words are factorized and then the pair."""
    n_left = len(left)
    both = np.concatenate([left, right])
    codes, uniq = pd.factorize(both[:, 0])
    second = np.empty(len(uniq), dtype=np.uint64)
    second[codes] = both[:, 1]
    if not np.array_equal(second[codes], both[:, 1]):
        c1, u1 = pd.factorize(both[:, 1])
        if len(uniq) > (2**62) // max(len(u1), 1):
            raise SpecError(f"table mapping: too many distinct keys ({len(uniq)} x {len(u1)}) to pair")
        codes, uniq = pd.factorize(codes.astype(np.int64) * len(u1) + c1)
    del both
    codes = codes.astype(index_dtype(len(uniq)), copy=False)
    return codes[:n_left], codes[n_left:], len(uniq)


def _edge_codes(
    left: tuple[np.ndarray, np.ndarray], right: tuple[np.ndarray, np.ndarray]
) -> tuple[_RowCodes, _RowCodes, int]:
    """Per-row equality codes of one join edge from both sides' (row codes, distinct digests): the digests
    (one per distinct value, few) are coded jointly; each row's code is its value's, looked up on demand
    (:class:`_RowCodes`: the rows' narrow codes as sent and one code per distinct value, no per-row copy)."""
    code_left, code_right, n_codes = _digest_codes(left[1], right[1])
    return _RowCodes(left[0], code_left), _RowCodes(right[0], code_right), n_codes


class _RowCodes:
    """The equality codes of a table's rows on one edge: ``of[value]`` of each row's ``value`` (its code into
    the distinct digests). Indexing gathers (``codes[rows]``); ``len``: the rows."""

    def __init__(self, value: np.ndarray, of: np.ndarray):
        self.value, self.of = value, of

    def __len__(self) -> int:
        return len(self.value)

    def __getitem__(self, rows: np.ndarray | slice) -> np.ndarray:
        return self.of[self.value[rows]]

    def all(self) -> np.ndarray:
        return self.of[self.value]


class _EdgeIndex:
    """One join edge, on the table level: for each row u of the known table, its partners in the new table,
    ``order[first[c] : first[c] + per_code[c]]`` with c = u's code (the new table's rows in their own order).
    Only ``alive`` new rows (rows that complete their own subtree of the join) are partners. Everything is per
    code or per new row: a known row's code is looked up when its joined rows are expanded."""

    def __init__(self, code_known: _RowCodes, code_new: _RowCodes, n_codes: int, alive: np.ndarray):
        live = np.flatnonzero(alive)
        live_codes = code_new[live]
        self.per_code = np.bincount(live_codes, minlength=n_codes)
        self.first = np.zeros(n_codes, dtype=np.int64)
        np.cumsum(self.per_code[:-1], out=self.first[1:])
        self.code_known = code_known
        self.order = live[np.argsort(live_codes, kind="stable")].astype(index_dtype(len(code_new)))

    def expand(self, joined: dict[str, np.ndarray], known: str, new: str) -> dict[str, np.ndarray]:
        """The joined rows after this join: each joined row followed by its partners in ``new``, in order."""
        codes = self.code_known[joined[known]]
        count = self.per_code[codes].astype(np.int64)
        m = int(count.sum())
        out = {t: np.repeat(p, count) for t, p in joined.items()}
        # the k-th partner of a joined row is order[first + k]: first repeated, plus the rank within the repeat
        pos = np.repeat(self.first[codes] - (np.cumsum(count) - count), count)
        pos += np.arange(m, dtype=np.int64)
        out[new] = self.order[pos]
        return out


def _completions(
    edges: Sequence[tuple[str, str, _RowCodes, _RowCodes, int]], n_rows: Mapping[str, int], chunk: int
) -> dict[str, np.ndarray]:
    """Per table row: how many joined rows its subtree of ``edges`` yields (children first; 0: it drops out).
    Counts are exact integers (bincount sums them in float64, exact below 2^53); a known table's counts are
    multiplied chunk by chunk of its rows."""
    count = {t: np.ones(n, dtype=np.int64) for t, n in n_rows.items()}
    for known, new, code_known, code_new, n_codes in reversed(edges):
        per_code = np.bincount(code_new.all(), weights=count[new], minlength=n_codes).astype(np.int64)
        for s in chunks(n_rows[known], chunk):
            count[known][s] *= per_code[code_known[s]]
    return count


def rows_without_partner(
    spec: RelationalSpec, projections: Mapping[str, Sequence[KeyProjection]], table: str
) -> dict[int, np.ndarray]:
    """Per join k of ``table``: the (global) row ids of ``table`` whose key on that join no row of the other
    table holds (from the same projections as :func:`build_mapping`); joins every row has a partner on are left
    out. A row may still drop out further along the join tree (its partner's own partner missing)."""
    edges = {k: j.right if j.left == table else j.left for k, j in enumerate(spec.joins) if table in (j.left, j.right)}
    digests = {
        t: _union_shards(t, projections[t], int(sum(len(p.row_ids) for p in projections[t])))
        for t in {table, *edges.values()}
    }
    out: dict[int, np.ndarray] = {}
    for k, other in edges.items():
        codes_mine, codes_theirs, _ = _edge_codes(digests[table][k], digests[other][k])
        lonely = np.flatnonzero(~np.isin(codes_mine.all(), codes_theirs.all()))
        if len(lonely):
            out[k] = lonely
    return out


def build_mapping(
    spec: RelationalSpec, projections: Mapping[str, Sequence[KeyProjection]], chunk: int | None = None
) -> TableMapping:
    """The server side of table mapping: join the key projections along the spec's join tree.

    Inner-join semantics (a row with no partner drops out); one-to-one, many-to-one and many-to-many
    edges; composite keys. Everything before the joined rows is on the table level: each edge's digests
    become integer codes, each table row learns how many joined rows its subtree yields (so N is known and
    rows that drop out are never expanded), and each edge groups the new table's rows by code. The label
    table's rows are then expanded through every edge in ranges of about ``chunk`` (CHUNK_ROWS) joined rows,
    straight into the result arrays, allocated once: peak memory is the result (N x M indices of
    :func:`index_dtype`) plus the label table's row counts (8 bytes a row) plus O(chunk) and the codes as sent;
    no per-row copy of the codes, no join of digest columns, no intermediate join. Joined rows come in the
    order of the label table's rows, each followed by its partners in table order, edge after edge (pandas'
    inner merge order). Raises SpecError naming the first join (in join order) after which the join is empty.
    """
    size = int(chunk or CHUNK_ROWS)
    n_rows = {t: int(sum(len(p.row_ids) for p in projections[t])) for t in spec.table_names}
    digests = {t: _union_shards(t, projections[t], n_rows[t]) for t in spec.table_names}
    join_index = {j: k for k, j in enumerate(spec.joins)}
    root = spec.label_table
    order = list(spec.join_order())
    edges = []
    for edge, known, new in order:
        k = join_index[edge]
        edges.append((known, new, *_edge_codes(digests[known][k], digests[new][k])))
    del digests
    count = _completions(edges, n_rows, size)
    N = int(count[root].sum())
    if N == 0:
        for k, (edge, _, _) in enumerate(order):  # the first join after which the join is empty
            if int(_completions(edges[: k + 1], n_rows, size)[root].sum()) == 0:
                raise SpecError(f"join {edge} matched no rows: the join comes out empty (check the key values)")
    index = [
        _EdgeIndex(code_known, code_new, n_codes, count[new] > 0) for known, new, code_known, code_new, n_codes in edges
    ]
    del edges
    per_root = count.pop(root)  # joined rows of each label-table row
    del count
    p = {t: np.empty(N, dtype=index_dtype(n_rows[t])) for t in spec.table_names}
    at = 0
    for block in chunks(len(per_root), size):  # label rows in blocks; each block in ranges of ~size joined rows
        live = np.flatnonzero(per_root[block] > 0) + block.start
        ends = np.cumsum(per_root[live])  # joined rows of this block up to and including each live label row
        a, done = 0, 0
        while a < len(live):
            b = max(a + 1, int(np.searchsorted(ends, done + size, side="right")))  # at least one label row
            joined = {root: live[a:b].astype(p[root].dtype)}
            for (_, known, new), edge_index in zip(order, index):
                joined = edge_index.expand(joined, known, new)
            m = len(joined[root])
            for t, rows in joined.items():
                p[t][at : at + m] = rows
            at, done, a = at + m, done + m, b
    assert at == N
    return TableMapping(p=p, n_rows=n_rows)


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
