"""The LoU operator's bookkeeping: which shard of a table holds which of its rows (TablePuppet Sec. 3.2).

Built from the row ids every shard sent in the keys round. The LoJ operator works on whole tables (rows U_i
of table i); the router splits such a request into one per shard (in the shard's own row positions) and
puts the shards' replies back together in the order of U_i.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tpflower.mapping import index_dtype


class ShardRouter:
    """Row ownership of one table: shard_of[u] and position[u] (row u's position within its shard)."""

    def __init__(self, row_ids_by_shard: Mapping[int, np.ndarray], n_rows: int):
        self.shards = sorted(row_ids_by_shard)
        self.ids = {q: np.asarray(ids, dtype=np.int64) for q, ids in row_ids_by_shard.items()}  # in shard order
        self.shard_of = np.full(n_rows, -1, dtype=np.int32)
        self.position = np.full(n_rows, -1, dtype=index_dtype(n_rows))
        for q, ids in row_ids_by_shard.items():
            self.shard_of[ids] = q
            self.position[ids] = np.arange(len(ids))

    def split(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Table rows -> {shard: positions of those rows within the shard}, in the order of ``rows``."""
        owner = self.shard_of[rows]
        return {q: self.position[rows[owner == q]] for q in self.shards}

    def masks(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        owner = self.shard_of[rows]
        return {q: owner == q for q in self.shards}

    def scatter_all(self, values: np.ndarray) -> dict[int, np.ndarray]:
        """A per-row array of the whole table, cut into each shard's rows (in shard order)."""
        return {q: values[ids] for q, ids in self.ids.items()}

    def gather_all(self, parts: Mapping[int, np.ndarray]) -> np.ndarray:
        """Each shard's per-row reply (in shard order) put back over the whole table."""
        first = next(iter(parts.values()))
        out = np.empty((len(self.shard_of),) + first.shape[1:], dtype=first.dtype)
        for q, ids in self.ids.items():
            out[ids] = parts[q]
        return out

    def gather(self, rows: np.ndarray, parts: Mapping[int, np.ndarray]) -> np.ndarray:
        """The shards' replies for ``split(rows)`` put back in the order of ``rows``."""
        first = next(iter(parts.values()))
        out = np.empty((len(rows),) + first.shape[1:], dtype=first.dtype)
        for q, mask in self.masks(rows).items():
            out[mask] = parts[q]
        return out
