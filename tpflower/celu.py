"""CELU-VFL's cache of exchanged statistics (seed 002: Alg. 1-2, Eq. 1; ALGORITHMS.md "CELU-VFL local updates").

A client's workset holds at most W batches it took part in, each with the rows U_i of the batch, the
reference it had when it SENT its predictions of them (h_u, or with ``similarity=hidden`` the MLP's last
hidden activation, never sent), the Y_i it RECEIVED (Eq. 10), |B|, how often it was used and when it was last
picked. Between two exchanges the client takes up to R local steps on cached batches: round robin over the
entries used fewer than R times and not picked in the last W - 1 local steps; each step weights a row by the
cosine of its fresh and its cached reference (0 below cos(xi)) and steps on
``(1/|B|) sum_u w_u <Y_u, f_i(theta; x_u)> + beta R_i(theta)``. Everything is arrays in context.state, bounded
by W x max|U_i| x (d_ref + d_c) numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tpflower.state import StateRecord


@dataclass
class Workset(StateRecord):
    """The entries, concatenated: ``rows``/``ref``/``Y`` hold every entry's rows in entry order (``sizes``
    rows each); per entry ``batch`` (|B|), ``uses`` and ``picked`` (the local step of its last use, -1: never);
    ``step`` counts the local steps taken."""

    rows: np.ndarray | None = None
    ref: np.ndarray | None = None
    Y: np.ndarray | None = None
    sizes: np.ndarray | None = None
    batch: np.ndarray | None = None
    uses: np.ndarray | None = None
    picked: np.ndarray | None = None
    step: int = 0

    @classmethod
    def empty(cls, d_ref: int, d_c: int) -> "Workset":
        ints = np.zeros(0, dtype=np.int64)
        return cls(ints, np.zeros((0, d_ref)), np.zeros((0, d_c)), ints, ints, ints, ints, 0)

    def __len__(self) -> int:
        return 0 if self.sizes is None else len(self.sizes)

    def _offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)])

    def entry(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(rows, ref, Y, |B|) of entry ``k``."""
        o = self._offsets()
        s = slice(o[k], o[k + 1])
        return self.rows[s], self.ref[s], self.Y[s], int(self.batch[k])

    def _keep(self, keep: np.ndarray) -> None:
        """Keep the entries where ``keep`` is True (rows vectorised: one mask over the concatenation)."""
        row_mask = np.repeat(keep, self.sizes)
        self.rows, self.ref, self.Y = self.rows[row_mask], self.ref[row_mask], self.Y[row_mask]
        self.sizes, self.batch, self.uses, self.picked = (a[keep] for a in (self.sizes, self.batch, self.uses, self.picked))

    def insert(self, rows: np.ndarray, ref: np.ndarray, Y: np.ndarray, batch: int, W: int) -> None:
        """Alg. 1: cache the exchanged batch; keep the W newest entries."""
        self.rows = np.concatenate([self.rows, np.asarray(rows, dtype=np.int64)])
        self.ref = np.concatenate([self.ref, np.asarray(ref, dtype=np.float64).reshape(len(rows), -1)])
        self.Y = np.concatenate([self.Y, np.asarray(Y, dtype=np.float64).reshape(len(rows), -1)])
        self.sizes = np.append(self.sizes, len(rows))
        self.batch, self.uses, self.picked = np.append(self.batch, batch), np.append(self.uses, 0), np.append(self.picked, -1)
        if len(self) > W:
            keep = np.zeros(len(self), dtype=bool)
            keep[-W:] = True
            self._keep(keep)

    def pick(self, W: int, R: int) -> int | None:
        """Alg. 2, round robin: among entries used fewer than R times and not picked in the last W - 1 local
        steps, the least recently picked (never picked first; ties: the oldest). None: a bubble, stop."""
        if len(self) == 0:
            return None
        fresh = (self.uses < R) & ((self.picked < 0) | (self.picked < self.step - (W - 1)))
        if not fresh.any():
            return None
        candidates = np.flatnonzero(fresh)
        return int(candidates[np.argmin(self.picked[candidates])])  # argmin takes the first (oldest) on ties

    def used(self, k: int, R: int) -> None:
        """Count one local step on entry ``k``; drop it once used R times."""
        self.uses[k] += 1
        self.picked[k] = self.step
        self.step += 1
        if self.uses[k] >= R:
            keep = np.ones(len(self), dtype=bool)
            keep[k] = False
            self._keep(keep)


def staleness_weights(fresh: np.ndarray, cached: np.ndarray, xi: float | None) -> np.ndarray:
    """w_u = cos(fresh_u, cached_u) if it is >= cos(xi) else 0 (xi in degrees; None: all ones). Norms are
    floored at 1e-12; the weight is a constant of the local step (no gradient flows through it)."""
    if xi is None:
        return np.ones(len(fresh))
    a, b = np.asarray(fresh, dtype=np.float64).reshape(len(fresh), -1), np.asarray(cached, dtype=np.float64).reshape(len(fresh), -1)
    cos = (a * b).sum(axis=1) / (np.maximum(np.linalg.norm(a, axis=1), 1e-12) * np.maximum(np.linalg.norm(b, axis=1), 1e-12))
    return np.where(cos >= math.cos(math.radians(xi)), cos, 0.0)
