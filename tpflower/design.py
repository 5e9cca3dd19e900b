"""A table's design matrix T_i = [X_i, 1] (the column of ones when its linear model has a bias) and the products
of the closed-form linear solvers with it (TP-Join-ADMM's theta-update, Eq. 16, and PCG: docs/algorithms.md),
never built whole: X stays in the run's precision and T's products are summed in float64 over blocks of rows
of a few MB (the float64 T of a block only); a wide, mostly-zero X (SPARSE_WIDTH, SPARSE_SHARE: one-hot blocks
of many categories) in a float64 sparse copy of T instead (its nonzeros only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse

from tpflower.mapping import chunks

if TYPE_CHECKING:
    from tpflower.client import TableClient

#: a table of at least SPARSE_WIDTH features at most SPARSE_SHARE of them nonzero (one-hot blocks of many
#: categories) has its products computed on a sparse copy of T: T^T diag(G) T in O(rows x nonzeros per row^2),
#: not O(rows x width^2)
SPARSE_WIDTH, SPARSE_SHARE = 64, 0.05
#: values of T per block of rows (32 MB in float64): a wide table's blocks hold fewer rows
BLOCK_CELLS = 1 << 22


class Design:
    """T_i of the feature rows ``X`` (module doc)."""

    def __init__(self, X: np.ndarray, bias: bool):
        self.X, self.bias = X, bias
        self.d = X.shape[1] + int(bias)
        self.rows_per_block = max(1, BLOCK_CELLS // self.d)
        self.sparse: scipy.sparse.csr_array | None = None
        if X.shape[1] >= SPARSE_WIDTH and np.count_nonzero(X) <= SPARSE_SHARE * X.size:
            blocks = chunks(len(X), self.rows_per_block)
            S = scipy.sparse.vstack([scipy.sparse.csr_array(X[s], dtype=np.float64) for s in blocks])
            self.sparse = scipy.sparse.hstack([S, np.ones((len(X), 1))] if bias else [S], format="csr")

    def __len__(self) -> int:
        return len(self.X)

    def _blocks(self) -> Iterator[tuple[slice, np.ndarray]]:
        for s in chunks(len(self.X), self.rows_per_block):
            T = np.ones((s.stop - s.start, self.d))
            T[:, : self.X.shape[1]] = self.X[s]
            yield s, T

    def gram(self, G: np.ndarray) -> np.ndarray:
        """T^T diag(G) T."""
        if self.sparse is not None:
            S = self.sparse
            return (S.T @ (S * np.asarray(G, dtype=np.float64)[:, None])).toarray()
        out = np.zeros((self.d, self.d))
        for s, T in self._blocks():
            out += (T.T * G[s]) @ T
        return out

    def tdot(self, v: np.ndarray) -> np.ndarray:
        """T^T v (v: one value, or one row of values, per row of T)."""
        v = np.asarray(v)
        if self.sparse is not None:
            return np.asarray(self.sparse.T @ np.asarray(v, dtype=np.float64))
        out = np.zeros((self.d, *v.shape[1:]))
        for s, T in self._blocks():
            out += T.T @ np.asarray(v[s], np.float64)
        return out

    def apply(self, z: np.ndarray, dtype: str) -> np.ndarray:
        """T z as a column in ``dtype`` (computed in float64 per block)."""
        if self.sparse is not None:
            return (self.sparse @ np.asarray(z, dtype=np.float64)).astype(dtype)[:, None]
        out = np.empty((len(self.X), 1), dtype=dtype)
        for s, T in self._blocks():
            out[s, 0] = T @ z
        return out


def node_design(client: TableClient, bias: bool, rows: np.ndarray | None = None) -> Design:
    """T_i of the client's rows ``rows`` (default all; TableClient.rows_X). A sparse T is kept in the node's
    memory (one, the last run's) for the run's next messages built from the same rows (its sparse copy costs a
    pass over X)."""
    expand, run = client.state.get("expand"), str(client.state.scalar("run_id", ""))
    held = client.data.models.get(("design",))
    if held is not None and held[0] == run and held[3].bias == bias and _same(held[1], rows) and _same(held[2], expand):
        return held[3]
    T = Design(client.rows_X(rows), bias)
    if T.sparse is not None:
        client.data.models[("design",)] = (run, rows, expand, T)
    return T


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))
