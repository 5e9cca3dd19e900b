"""Mini-batches over the training join and joined predictions (TablePuppet Sec. 3.2; docs/algorithms.md).

Plain numpy over the table mapping: joined predictions H_j = sum_i h_i[p_i(j)] and the SGD schedule of
mini-batches of joined rows with, per batch, the table rows it touches (a :class:`BatchPlan`). The server
strategies and the centralized baseline draw the same batches from the same seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tpflower.mapping import TableMapping, batch_segments, chunks


def joined_predictions(
    p: Mapping[str, np.ndarray], h: Mapping[str, np.ndarray], rows: slice | None = None, chunk: int | None = None
) -> np.ndarray:
    """H_j = sum_i h_i[p_i(j)] (p_i indexes the rows of h_i), for all joined rows or the slice ``rows``.

    One output array (in the first table's dtype), filled chunk by chunk: no N-sized temporaries."""
    tables = list(p)
    first = h[tables[0]]
    span = range(len(p[tables[0]]))[rows if rows is not None else slice(None)]
    if span.step != 1:
        raise ValueError(f"joined_predictions: rows must be a contiguous slice, got {rows}")
    H = np.empty((len(span),) + first.shape[1:], dtype=first.dtype)
    for s in chunks(len(span), chunk):
        src = slice(span.start + s.start, span.start + s.stop)
        out = H[s]
        out[...] = first[p[tables[0]][src]]
        for t in tables[1:]:
            out += h[t][p[t][src]]
    return H


def sum_in_first_dtype(parts: list[np.ndarray]) -> np.ndarray:
    """parts[0] + parts[1] + ... accumulated in parts[0]'s dtype (as :func:`joined_predictions` sums)."""
    out = parts[0].copy()
    for part in parts[1:]:
        out += part
    return out


def batch_size_of(value: object, n: int) -> int:
    """algorithm.batch_size: a positive integer or `full` (= n, full-batch gradient descent)."""
    if value == "full":
        return n
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"algorithm.batch_size must be a positive integer or 'full', got {value!r}") from None
    if size < 1:
        raise ValueError(f"algorithm.batch_size must be a positive integer or 'full', got {value!r}")
    return min(size, n)


def epoch_batches(N: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Joined-row indices of each mini-batch of one epoch: a fresh shuffle of [N] unless B = N."""
    order = rng.permutation(N) if batch_size < N else np.arange(N)
    return [order[s : s + batch_size] for s in range(0, N, batch_size)]


@dataclass
class BatchPlan:
    """One mini-batch B: its joined rows, and per table U_i = unique(p_i[B]) with p_i[B] == U_i[inv_i]."""

    rows: np.ndarray
    U: dict[str, np.ndarray]
    inv: dict[str, np.ndarray]

    @classmethod
    def of(cls, mapping: TableMapping, rows: np.ndarray) -> BatchPlan:
        U, inv = {}, {}
        for t, p in mapping.p.items():
            U[t], inv[t] = batch_segments(p[rows])
        return cls(rows=rows, U=U, inv=inv)


class SGDSchedule:
    """The mini-batches of a whole SGD run, each with the plan of the batch after it (for pipelining).

    Iterating yields (epoch, rows, plan, next_plan, last): ``next_plan`` is None after the run's final batch,
    ``last`` marks an epoch's last batch. Epoch e + 1's shuffle is drawn at epoch e's last batch, from one
    generator, so the federated runs and the centralized baseline see the same batches for the same seed.
    """

    def __init__(self, mapping: TableMapping, batch_size: int, epochs: int, rng: np.random.Generator):
        self.mapping, self.batch_size, self.epochs, self.rng = mapping, batch_size, epochs, rng
        self._batches = epoch_batches(mapping.N, batch_size, rng)
        self.first = BatchPlan.of(mapping, self._batches[0])
        self.per_epoch = len(self._batches)  # batches (exchange rounds) per epoch

    def __iter__(self):
        batches, plan = self._batches, self.first
        for epoch in range(1, self.epochs + 1):
            for b, rows in enumerate(batches):
                last = b == len(batches) - 1
                if last:
                    batches = epoch_batches(self.mapping.N, self.batch_size, self.rng) if epoch < self.epochs else []
                upcoming = (batches[0] if batches else None) if last else batches[b + 1]
                nxt = None if upcoming is None else BatchPlan.of(self.mapping, upcoming)
                yield epoch, rows, plan, nxt, last
                plan = nxt
