"""The LoJ operator's math (server side; ALGORITHMS.md "LoJ with SGD" and "LoJ with ADMM").

Plain numpy over the table mapping: joined predictions H_j = sum_i h_i[p_i(j)], the per-batch aggregation
of dl/dH into Y_i (Eq. 10), and the ADMM state z, lambda with the aggregated Y_i of Eq. 14.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tpflower.losses import loss_grad_np, loss_np, z_update
from tpflower.mapping import SegmentSums, TableMapping, batch_segments, chunks, segment_sum

ADMM_VARIANTS = ("sharing", "paper")


def joined_predictions(p: Mapping[str, np.ndarray], h: Mapping[str, np.ndarray], rows: slice | None = None,
                       chunk: int | None = None) -> np.ndarray:
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


@dataclass(frozen=True)
class Balancing:
    """Residual balancing (Boyd et al. 2011, Sec. 3.4.1, Eq. 3.13): rho <- tau rho when the primal residual
    exceeds mu times the dual one, rho <- rho / tau in the opposite case, else unchanged."""

    mu: float = 10.0
    tau: float = 2.0
    warmup: int = 3  # iterations before the first change: their dual residual is the start's transient

    def factor(self, primal: float, dual: float) -> float:
        """The factor rho is multiplied by (tau, 1 / tau or 1)."""
        if primal > self.mu * dual:
            return self.tau
        if dual > self.mu * primal:
            return 1.0 / self.tau
        return 1.0


@dataclass(frozen=True)
class Residuals:
    """Primal and dual residual norms of one ADMM iteration and their tolerances (Boyd Sec. 3.3.1, Eq. 3.12,
    with eps_abs = eps_rel = tol); ``dual`` is None on the first iteration (no previous z)."""

    primal: float
    dual: float | None
    eps_primal: float
    eps_dual: float
    x_scale: float = 1.0  # max(||x||, ||z||): the primal residual's relative scale (Eq. 3.12)
    y_scale: float = 1.0  # ||y||: the dual residual's

    @property
    def converged(self) -> bool:
        return self.dual is not None and self.primal <= self.eps_primal and self.dual <= self.eps_dual

    def reason(self) -> str:
        return (f"primal residual {self.primal:.3g} <= {self.eps_primal:.3g} and dual residual "
                f"{self.dual:.3g} <= {self.eps_dual:.3g}")


class ADMMServer:
    """Server state of TP-Join-ADMM: z, lambda over the N training rows (Eq. 7, 8, 14).

    ``variant`` = "sharing" (default: r = rho/M, s_ij = (H_j - z_j)/M - h_i[p_i(j)]; two-block ADMM that
    converges for convex f_i) or "paper" (r = rho, s_ij = H_j - h_i[p_i(j)] - z_j: Eq. 7-9 as printed, a
    Jacobi multi-block ADMM that can diverge). See ALGORITHMS.md, "Two variants".

    One iteration is :meth:`update` (z and lambda from the clients' predictions, the residuals, rho) then
    :meth:`scatter` (Y_i for the clients' theta-update). lambda is kept unscaled (lambda = rho u in Boyd's
    scaled form), so a new rho needs no rescaling of the duals. ``balancing`` (sharing variant only) adapts
    rho from the residuals (Boyd Sec. 3.4.1); ``tol`` sets the stopping tolerances (Eq. 3.12).

    The residuals are those of the sharing problem (Boyd Sec. 7.3) over the joined training rows, with
    x_i = h_i[p_i] and z_i = x_i - H/M + z/M (the per-table copies the z-update implies):
    primal ||x - z||_stacked = ||H - z|| / sqrt(M), dual rho ||z_i^k - z_i^(k-1)||_stacked. The server computes
    them from the predictions it receives anyway.

    Memory (per joined training row, d_c = 1): lambda and D = z - H in ``dtype`` (float32 for a float32 run)
    and the labels the caller holds; H and z are never stored (z = H + D is :attr:`z`, computed on demand),
    every pass runs over chunks of CHUNK_ROWS joined rows, and the previous iteration's D is overwritten chunk
    by chunk once its dual residual term is summed. Everything else is O(sum n_i).
    """

    def __init__(self, task: str, y: np.ndarray, mapping: TableMapping, d_c: int, rho: float, variant: str = "sharing",
                 balancing: Balancing | None = None, tol: float = 0.0, dtype: np.dtype | type = np.float64):
        if variant not in ADMM_VARIANTS:
            raise ValueError(f"algorithm.variant must be one of {ADMM_VARIANTS}, got {variant!r}")
        if rho <= 0:
            raise ValueError(f"algorithm.rho must be > 0, got {rho}")
        if len(y) != mapping.N:
            raise ValueError(f"ADMMServer: {len(y)} labels for {mapping.N} joined rows")
        self.task, self.y, self.mapping, self.variant = task, y, mapping, variant
        self.M = len(mapping.p)
        self.set_rho(rho)
        self.balancing = balancing if variant == "sharing" else None
        self.tol = float(tol)
        self.dtype = np.dtype(dtype)
        self.lam = np.zeros((mapping.N, d_c), dtype=self.dtype)
        self.D = np.zeros((mapping.N, d_c), dtype=self.dtype)  # z - H at the latest update
        self.residuals: Residuals | None = None
        self.iteration = 0
        self._h: dict[str, np.ndarray] | None = None  # the predictions of the latest update (n_i x d_c each)
        self._loss = float("nan")  # mean loss at the latest update's H
        self._primal = float("nan")  # ||H - z|| at the latest update

    def set_rho(self, rho: float) -> None:
        """The penalty of the next iterations (lambda is unscaled: nothing else changes)."""
        self.rho = float(rho)
        self.r = self.rho / self.M if self.variant == "sharing" else self.rho

    def G(self) -> dict[str, np.ndarray]:
        """G_iu (Eq. 15): constant, sent once."""
        return {t: self.mapping.G(t).astype(np.float64) for t in self.mapping.p}

    @property
    def z(self) -> np.ndarray:
        """z (float64, N x d_c) at the latest update: H + D, computed on demand (not kept)."""
        assert self._h is not None, "z before update()"
        return joined_predictions(self.mapping.p, self._h).astype(np.float64) + self.D

    def step(self, h: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One server step of an epoch: :meth:`update`, then :meth:`scatter`."""
        self.update(h)
        return self.scatter(h)

    def update(self, h: Mapping[str, np.ndarray]) -> Residuals:
        """From f_i(theta_i^t) on every row of every table (n_i x d_c each): z-update (Eq. 7), dual update
        (Eq. 8), the residuals of this iteration and, with balancing, the rho of the next (Boyd Sec. 3.4.1).

        One pass over chunks of joined rows: H (in the clients' dtype, as they sent it, then float64), z, lambda,
        the loss and every residual sum; H and z exist only per chunk."""
        p, M, r = self.mapping.p, self.M, self.r
        h64 = {t: np.asarray(v, dtype=np.float64) for t, v in h.items()}
        prev = self._h
        dh = None if prev is None else {t: h64[t] - prev[t] for t in p}
        loss = primal_sq = x_sq = z_sq = dual_sq = lam_sq = 0.0
        for s in chunks(self.mapping.N):
            xs = {t: h[t][p_t[s]] for t, p_t in p.items()}  # each table's predictions on these rows, as sent
            H = sum_in_first_dtype(list(xs.values())).astype(np.float64)  # = joined_predictions(p, h)[s]
            y = self.y[s]
            lam = self.lam[s].astype(np.float64)
            z = z_update(self.task, H, y, lam, r)  # Eq. 7
            D = z - H
            lam -= r * D  # Eq. 8: lambda + r (H - z)
            loss += float(loss_np(self.task, H, y).sum())
            primal_sq += float(np.sum(D * D))
            lam_sq += float(np.sum(lam * lam))
            shift = D / M
            if dh is not None:
                shift_change = shift - self.D[s].astype(np.float64) / M  # ((z - z_prev) - (H - H_prev)) / M
            for t, p_t in p.items():
                x = xs[t].astype(np.float64)  # = h64[t][p_t[s]]
                x_sq += float(np.sum(x * x))
                x += shift  # z_i = x_i + (z - H) / M
                z_sq += float(np.sum(x * x))
                if dh is not None:
                    d = dh[t][p_t[s]] + shift_change
                    dual_sq += float(np.sum(d * d))
            self.lam[s] = lam
            self.D[s] = D
        N = self.mapping.N
        self._h = {t: v.copy() if v is h[t] else v for t, v in h64.items()}  # the caller keeps its h
        self._loss = loss / N if N else float("nan")
        self._primal = float(np.sqrt(primal_sq))
        # rho of this iteration: the one the clients' theta-update used (before any change below)
        dual = None if dh is None else self.rho * float(np.sqrt(dual_sq))
        root = np.sqrt(M * self.D.size) * self.tol  # sqrt(p) eps_abs (p = n = M N d_c here)
        x_scale = float(np.sqrt(max(x_sq, z_sq)))
        y_scale = float(np.sqrt(M)) * float(np.sqrt(lam_sq))
        res = Residuals(self._primal / np.sqrt(M), dual, root + self.tol * x_scale, root + self.tol * y_scale,
                        x_scale, y_scale)
        self.residuals = res
        self.iteration += 1
        if self.balancing is not None and res.dual is not None and self.iteration > self.balancing.warmup:
            self.set_rho(self.rho * self.balancing.factor(res.primal, res.dual))  # Boyd Eq. 3.13
        return res

    def scatter(self, h: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Residuals s_ij and Y_iu = sum_{j in G_i(u)} (lambda_j + rho s_ij) (Eq. 14) at the latest update;
        Y_i for every table, in the dtype of h. Chunked: per chunk, one term array per table."""
        assert self._h is not None, "scatter() before update()"
        p, M = self.mapping.p, self.M
        sums = {t: SegmentSums(self.mapping.n_rows[t], self.D.shape[1]) for t in p}
        for s in chunks(self.mapping.N):
            base = np.negative(self.D[s], dtype=np.float64)  # H - z
            if self.variant == "sharing":
                base /= M  # (H - z) / M
            lam = self.lam[s].astype(np.float64)
            for t, p_t in p.items():
                h_t = h[t][p_t[s]]
                s_t = base - h_t  # s_ij (Eq. 9)
                s_t *= self.rho
                s_t += lam
                sums[t].add(p_t[s], s_t)
        return {t: sums[t].result(h[t].dtype) for t in p}

    def primal_residual(self) -> float:
        """||H - z|| over the training rows, after the latest step (the ADMM convergence check)."""
        return self._primal

    def train_loss(self) -> float:
        """(1/N) sum_j l(H_j; y_j) at the predictions of the latest step."""
        return self._loss
