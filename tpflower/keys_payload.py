"""A node's keys payload, built chunk by chunk (TablePuppet Sec. 3.1.1; docs/algorithms.md, Table mapping).

The keys reply: row ids, per join of the node's table each row's code into a shuffled list of its distinct key
tuples and per listed tuple a keyed digest (keys=hmac, tpflower.mapping) or a blinded value (keys=blind,
tpflower.blind), and the label owner's labels and test flags. :class:`KeysPayload` holds what every chunk
needs -- per join the distinct key tuples (:class:`DistinctKeys`: found chunk by chunk, hash tables of the
distinct values only) and their shuffle -- and builds chunk j (rows and listed values j*c .. (j+1)*c - 1)
when it is asked for: a row's code is looked up in its chunk, a value is encoded, digested or blinded in its
chunk only. Peak memory: the table the node holds, O(distinct values) and O(chunk), never a whole-table
payload.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from tpflower.mapping import (
    CHUNK_ROWS,
    KEY_SEP,
    chunks,
    code_dtype,
    encode_values,
    hmac_digests,
    index_dtype,
    join_seed,
    require_secret,
    shuffled,
)
from tpflower.records import Arrays
from tpflower.schema import RelationalSpec, SpecError, key_kind


def first_appearance(parts: Iterable[pd.Index]) -> pd.Index:
    """The distinct values of ``parts`` put one after the other, in order of first appearance, merging as it
    goes (memory: the distinct values and a few parts, never all of them)."""
    held: list[pd.Index] = []
    size = 0
    distinct: pd.Index | None = None
    for part in parts:
        held.append(part.unique())
        size += len(held[-1])
        if size > 4 * (len(held[0]) + len(held[-1])) + 1024:  # collapse: the distinct values so far
            held = [held[0].append(held[1:]).unique()]
            size = len(held[0])
    if held:
        distinct = held[0].append(held[1:]).unique() if len(held) > 1 else held[0]
    return distinct if distinct is not None else pd.Index([])


class DistinctKeys:
    """The distinct tuples of the key columns ``columns`` of ``frame`` (order of first appearance, as
    pandas' factorize), shuffled by ``seed`` (OS entropy when None: :func:`tpflower.mapping.shuffled`).

    :meth:`codes` gives the rows' codes into the shuffled list (:func:`tpflower.mapping.code_dtype`),
    :meth:`encoded` the canonical encodings of listed values, both for a range only."""

    def __init__(self, frame: pd.DataFrame, columns: Sequence[str], seed: bytes | None, step: int = CHUNK_ROWS):
        self.series = [frame[c] for c in columns]
        self.kinds = [key_kind(s.dtype) for s in self.series]
        self.n_rows = len(frame)
        if any(bool(s.isna().any()) for s in self.series):
            raise SpecError(f"key columns {list(columns)} hold missing values; keys must be complete")
        self.levels = [first_appearance(pd.Index(s.array[sl]) for sl in chunks(self.n_rows, step)) for s in self.series]
        self.strides: list[int] = []
        self.distinct: pd.Index | None = None  # several columns: the distinct tuples as one integer each
        if len(self.levels) > 1:
            stride = 1
            for level in reversed(self.levels):
                self.strides.insert(0, stride)
                stride *= max(len(level), 1)
            if stride >= 2**62:
                raise SpecError(f"key columns {list(columns)}: too many combinations of distinct values to code")
            self.distinct = first_appearance(pd.Index(self._tuple_ids(sl)) for sl in chunks(self.n_rows, step))
        self.n_distinct = len(self.levels[0]) if self.distinct is None else len(self.distinct)
        rank, self.order = shuffled(self.n_distinct, seed)
        self.rank = rank.astype(code_dtype(self.n_distinct))

    def _tuple_ids(self, rows: slice) -> np.ndarray:
        """Several columns: each row's tuple as sum_c (its value's position in level c) * stride_c."""
        ids = np.zeros(rows.stop - rows.start, dtype=np.int64)
        for s, level, stride in zip(self.series, self.levels, self.strides):
            ids += level.get_indexer(s.array[rows]).astype(np.int64) * stride
        return ids

    def codes(self, lo: int, hi: int) -> np.ndarray:
        """The codes of rows lo..hi-1 into the shuffled list of distinct tuples."""
        rows = slice(lo, max(lo, min(hi, self.n_rows)))
        if self.distinct is None:
            positions = self.levels[0].get_indexer(self.series[0].array[rows])
        else:
            positions = self.distinct.get_indexer(self._tuple_ids(rows))
        return self.rank[positions]

    def encoded(self, lo: int, hi: int) -> list[bytes]:
        """The canonical encodings (:func:`tpflower.mapping.encode_values`) of the listed tuples lo..hi-1."""
        picked = self.order[lo:hi]
        if self.distinct is None:
            return encode_values(self.levels[0].take(picked), self.kinds[0])
        ids = np.asarray(self.distinct.take(picked), dtype=np.int64)
        parts = [
            encode_values(level.take((ids // stride) % max(len(level), 1)), kind)
            for level, stride, kind in zip(self.levels, self.strides, self.kinds)
        ]
        return [KEY_SEP.join(t) for t in zip(*parts)]


class KeysPayload:
    """The keys payload of rows ``keys`` (the rows' join-key columns) with global ids ``row_ids``, for the
    joins of ``table`` in ``spec``: ``mode`` hmac (``secret``) or blind (``scalar``); ``y`` and ``is_test``:
    the label owner's labels (all rows', or under label DP the training rows' only) and test flags. The
    shuffles come from ``seed`` (the node's secret; None: OS entropy); ``threads``: of the blinding
    (tpflower.blind.threads)."""

    def __init__(
        self,
        spec: RelationalSpec,
        table: str,
        keys: pd.DataFrame,
        row_ids: np.ndarray,
        mode: str,
        secret: bytes = b"",
        scalar: bytes = b"",
        seed: bytes | None = None,
        y: np.ndarray | None = None,
        is_test: np.ndarray | None = None,
        threads: int | None = None,
    ):
        self.mode, self.secret, self.scalar, self.threads = mode, secret, scalar, threads
        self.row_ids = np.asarray(row_ids)
        self.n_rows = len(self.row_ids)
        self.id_dtype = index_dtype(int(self.row_ids.max()) + 1 if self.n_rows else 0)
        self.lists = {
            k: DistinctKeys(keys, j.columns_of(table), join_seed(seed, k))
            for k, j in enumerate(spec.joins)
            if table in (j.left, j.right)
        }
        if mode == "hmac" and self.lists:
            require_secret(secret)
        self.y, self.is_test = y, is_test

    def n_values(self) -> dict[int, int]:
        """Per join: the length of its list of distinct values."""
        return {k: d.n_distinct for k, d in self.lists.items()}

    def values(self, k: int, lo: int, hi: int) -> np.ndarray:
        """The listed values lo..hi-1 of join k: digests (hmac) or blinded values (blind)."""
        from tpflower.blind import as_array, blind_encoded  # noqa: PLC0415  (tpflower.blind imports mapping)

        encoded = self.lists[k].encoded(lo, hi)
        if self.mode == "blind":
            return blind_encoded(encoded, self.scalar, self.threads) if encoded else as_array([])
        return hmac_digests(encoded, self.secret)

    def chunk(self, lo: int, hi: int) -> Arrays:
        """Rows lo..hi-1 (ids, codes, labels, test flags) and listed values lo..hi-1 of every join (a table's
        distinct values are at most its rows, so ceil(rows / c) chunks of c carry them all). Under label DP
        ``y`` holds the labels of the training rows among rows lo..hi-1."""
        rows = slice(lo, min(hi, self.n_rows))
        out: Arrays = {"row_ids": self.row_ids[rows].astype(self.id_dtype, copy=False)}
        value = "blind" if self.mode == "blind" else "digest"
        for k, d in sorted(self.lists.items()):
            out[f"code.{k}"] = d.codes(lo, hi)
            out[f"{value}.{k}"] = self.values(k, lo, hi)
        if self.y is not None and self.is_test is not None:
            is_test = np.asarray(self.is_test[rows], dtype=np.uint8)
            if len(self.y) == self.n_rows:
                out["y"] = self.y[rows]
            else:  # label DP: the training rows' labels only
                a_lo = int(np.count_nonzero(np.asarray(self.is_test[:lo]) == 0))
                out["y"] = self.y[a_lo : a_lo + int(np.count_nonzero(is_test == 0))]
            out["is_test"] = is_test
        return out

    def whole(self) -> Arrays:
        """The payload as one message."""
        return self.chunk(0, max(self.n_rows, 1))
