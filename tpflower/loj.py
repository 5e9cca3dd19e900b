"""The LoJ operator's math (server side; ALGORITHMS.md "LoJ with SGD" and "LoJ with ADMM").

Plain numpy over the table mapping: joined predictions H_j = sum_i h_i[p_i(j)], the per-batch aggregation
of dl/dH into Y_i (Eq. 10), and the ADMM state z, lambda with the aggregated Y_i of Eq. 14.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tpflower.losses import loss_grad_np, loss_np, z_update
from tpflower.mapping import TableMapping, batch_segments, segment_sum

ADMM_VARIANTS = ("sharing", "paper")


def joined_predictions(p: Mapping[str, np.ndarray], h: Mapping[str, np.ndarray]) -> np.ndarray:
    """H_j = sum_i h_i[p_i(j)] (p_i indexes the rows of h_i)."""
    tables = list(p)
    H = h[tables[0]][p[tables[0]]].copy()
    for t in tables[1:]:
        H += h[t][p[t]]
    return H


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
    def of(cls, mapping: TableMapping, rows: np.ndarray) -> "BatchPlan":
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


def sgd_aggregate(
    task: str, plan: BatchPlan, h: Mapping[str, np.ndarray], y: np.ndarray
) -> tuple[dict[str, np.ndarray], float]:
    """Y_iu = sum_{j in B, p_i(j) = u} dl(H_j; y_j)/dH_j for u in U_i (Eq. 10), and the batch's summed loss.

    h[t] holds f_i on the rows U_i (|U_i| x d_c); y the labels of the batch's joined rows.
    """
    H = joined_predictions(plan.inv, h)
    g = loss_grad_np(task, H, y)
    Y = {t: segment_sum(plan.inv[t], g, len(plan.U[t])).astype(h[t].dtype, copy=False) for t in plan.U}
    return Y, float(loss_np(task, H, y).sum())


class ADMMServer:
    """Server state of TP-Join-ADMM: z, lambda over the N training rows (Eq. 7, 8, 14).

    ``variant`` = "sharing" (default: r = rho/M, s_ij = (H_j - z_j)/M - h_i[p_i(j)]; two-block ADMM that
    converges for convex f_i) or "paper" (r = rho, s_ij = H_j - h_i[p_i(j)] - z_j: Eq. 7-9 as printed, a
    Jacobi multi-block ADMM that can diverge). See ALGORITHMS.md, "Two variants".
    """

    def __init__(self, task: str, y: np.ndarray, mapping: TableMapping, d_c: int, rho: float, variant: str = "sharing"):
        if variant not in ADMM_VARIANTS:
            raise ValueError(f"algorithm.variant must be one of {ADMM_VARIANTS}, got {variant!r}")
        if rho <= 0:
            raise ValueError(f"algorithm.rho must be > 0, got {rho}")
        self.task, self.y, self.mapping, self.variant = task, y, mapping, variant
        self.rho = float(rho)
        self.M = len(mapping.p)
        self.r = self.rho / self.M if variant == "sharing" else self.rho
        self.z = np.zeros((mapping.N, d_c))
        self.lam = np.zeros((mapping.N, d_c))
        self.H: np.ndarray | None = None

    def G(self) -> dict[str, np.ndarray]:
        """G_iu (Eq. 15): constant, sent once."""
        return {t: self.mapping.G(t).astype(np.float64) for t in self.mapping.p}

    def step(self, h: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One server step of an epoch, from f_i(theta_i^t) on every row of every table (n_i x d_c each).

        z-update (Eq. 7), dual update (Eq. 8), residuals s_ij and Y_iu = sum_{j in G_i(u)} (lambda_j + rho s_ij)
        (Eq. 14). Returns Y_i for every table, in the dtype of h.
        """
        p = self.mapping.p
        H = joined_predictions(p, h).astype(np.float64)
        self.H = H
        self.z = z_update(self.task, H, self.y, self.lam, self.r)  # Eq. 7
        self.lam = self.lam + self.r * (H - self.z)  # Eq. 8
        Y = {}
        for t, p_t in p.items():
            h_t = h[t][p_t]
            s = (H - self.z) / self.M - h_t if self.variant == "sharing" else H - h_t - self.z
            Y[t] = segment_sum(p_t, self.lam + self.rho * s, self.mapping.n_rows[t]).astype(h[t].dtype, copy=False)
        return Y

    def primal_residual(self) -> float:
        """||H - z|| over the training rows, after the latest step (the ADMM convergence check)."""
        assert self.H is not None
        return float(np.linalg.norm(self.H - self.z))

    def train_loss(self) -> float:
        """(1/N) sum_j l(H_j; y_j) at the predictions of the latest step."""
        assert self.H is not None
        return float(loss_np(self.task, self.H, self.y).mean())
