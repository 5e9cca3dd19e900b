"""TP-Join-ADMM (TablePuppet Eq. 7, 8, 14-16) and the VFL-ADMM baseline (VIMADMM style).

One round trip per epoch: clients send f_i(theta_i) on all their rows (n_i x d_c); the server updates z and
lambda and scatters Y_i (Eq. 14); each client solves its theta-update (Eq. 16) and replies with its new
predictions, which also give the test predictions of that epoch. G_i (Eq. 15) is constant and sent once.

Feature DP (privacy=dpsgd): the theta-update is DP-SGD (DP-Adam, algorithm.local_*) over the table's active
rows instead of the closed form, linear models included; the client samples its rows itself (Poisson,
q = min(1, b / n_a)), ``admm_steps(epochs, local_epochs, n_a, b)`` steps in all. VFL-ADMM's client sums the
terms of each table row's duplicates first, which gives exactly the TP-Join-ADMM per-row term.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, logsumexp, softmax

from strategies.anderson import Anderson
from strategies.base import LoJStrategy
from strategies.subspace import TableSubspace
from tpflower.batches import joined_predictions, sum_in_first_dtype
from tpflower.join_counts import compact_counts
from tpflower.losses import adam_parameter_noise, check_np, loss_np
from tpflower.mapping import SegmentSums, TableMapping, chunks
from tpflower.phases.join_admm import ADMMParams
from tpflower.privacy import admm_steps

ADMM_VARIANTS = ("sharing", "paper")


@dataclass
class Balancing:
    """Residual balancing (Boyd et al. 2011, Sec. 3.4.1, Eq. 3.13): rho <- tau rho when the primal residual
    exceeds mu times the dual one, rho <- rho / tau in the opposite case, else unchanged. With ``patience``
    k > 0 a persistent imbalance also counts: a ratio beyond ``mu_persistent`` (< mu) in the same direction for
    k iterations in a row changes rho too (then the count restarts); the ratio of a stalled ADMM sits just
    under mu for many iterations."""

    mu: float = 10.0
    tau: float = 2.0
    warmup: int = 3  # iterations before the first change: their dual residual is the start's transient
    mu_persistent: float = 2.0
    patience: int = 0  # 0: the paper's rule alone
    run: int = 0  # signed count of consecutive iterations beyond mu_persistent (+ primal, - dual)

    def factor(self, primal: float, dual: float) -> float:
        """The factor rho is multiplied by (tau, 1 / tau or 1)."""
        if primal > self.mu * dual:
            self.run = 0
            return self.tau
        if dual > self.mu * primal:
            self.run = 0
            return 1.0 / self.tau
        if self.patience > 0:
            side = 1 if primal > self.mu_persistent * dual else -1 if dual > self.mu_persistent * primal else 0
            self.run = self.run + side if side and side * self.run >= 0 else side
            if abs(self.run) >= self.patience:
                self.run = 0
                return self.tau if side > 0 else 1.0 / self.tau
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
        return (
            f"primal residual {self.primal:.3g} <= {self.eps_primal:.3g} and dual residual "
            f"{self.dual:.3g} <= {self.eps_dual:.3g}"
        )


class ADMMServer:
    """Server state of TP-Join-ADMM: z, lambda over the N training rows (Eq. 7, 8, 14).

    ``variant`` = "sharing" (default: r = rho/M, s_ij = (H_j - z_j)/M - h_i[p_i(j)]; two-block ADMM that
    converges for convex f_i) or "paper" (r = rho, s_ij = H_j - h_i[p_i(j)] - z_j: Eq. 7-9 as printed, a
    Jacobi multi-block ADMM that can diverge). See docs/algorithms.md, "Two variants".

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

    def __init__(
        self,
        task: str,
        y: np.ndarray,
        mapping: TableMapping,
        d_c: int,
        rho: float,
        variant: str = "sharing",
        balancing: Balancing | None = None,
        tol: float = 0.0,
        dtype: np.dtype | type = np.float64,
        relax: float = 1.0,
        anderson: int = 0,
        subspace: int = 0,
    ):
        if variant not in ADMM_VARIANTS:
            raise ValueError(f"algorithm.variant must be one of {ADMM_VARIANTS}, got {variant!r}")
        if rho <= 0:
            raise ValueError(f"algorithm.rho must be > 0, got {rho}")
        if len(y) != mapping.N:
            raise ValueError(f"ADMMServer: {len(y)} labels for {mapping.N} joined rows")
        if subspace and (task != "regression" or variant != "sharing" or d_c != 1 or anderson):
            raise ValueError("algorithm.subspace applies to regression with the sharing variant, without anderson")
        self.task, self.y, self.mapping, self.variant = task, y, mapping, variant
        self.M = len(mapping.p)
        self.set_rho(rho)
        self.balancing = balancing if variant == "sharing" else None
        self.tol = float(tol)
        self.relax = float(relax)
        self.dtype = np.dtype(dtype)
        self.lam = np.zeros((mapping.N, d_c), dtype=self.dtype)
        self.D = np.zeros((mapping.N, d_c), dtype=self.dtype)  # z - H at the latest update
        self.residuals: Residuals | None = None
        self.iteration = 0
        self._h: dict[str, np.ndarray] | None = None  # the predictions of the latest update (n_i x d_c each)
        self._loss = float("nan")  # mean loss at the latest update's H
        self._primal = float("nan")  # ||H - z|| at the latest update
        # Anderson acceleration of the iteration over the server's state (h_i, D, lambda): :meth:`accelerate`
        self.anderson = Anderson(anderson) if anderson > 0 else None
        self._w: list[np.ndarray] | None = None  # the state the latest update started from
        self._anderson_rho = self.rho
        # per-table subspace acceleration (strategies/subspace.py): the pairs (Y_i, h_i) of the last epochs
        self.subspace = TableSubspace(subspace, mapping, y, self.dtype) if subspace > 0 else None
        self._Y: dict[str, np.ndarray] | None = None  # the latest scatter's messages and their rho
        self._Y_rho = self.rho

    def set_rho(self, rho: float) -> None:
        """The penalty of the next iterations (lambda is unscaled: nothing else changes)."""
        self.rho = float(rho)
        self.r = self.rho / self.M if self.variant == "sharing" else self.rho

    def G(self) -> dict[str, np.ndarray]:
        """G_iu (Eq. 15): constant, sent once; whole counts in the narrowest unsigned dtype (1 byte a row for
        counts below 256)."""
        return {t: compact_counts(self.mapping.G(t)) for t in self.mapping.p}

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
        prev = self._h
        if self.anderson is not None and prev is not None:  # the iterate this update maps (update overwrites D, lam)
            self._w = [*(prev[t] for t in p), self.D.copy(), self.lam.copy()]
        first = prev is None
        loss = primal_sq = x_sq = z_sq = dual_sq = lam_sq = 0.0
        relaxed = self.relax != 1.0 and prev is not None
        for s in chunks(self.mapping.N):
            xs = {t: h[t][p_t[s]] for t, p_t in p.items()}  # each table's predictions on these rows, as sent
            H = sum_in_first_dtype(list(xs.values())).astype(np.float64)  # = joined_predictions(p, h)[s]
            y = self.y[s]
            lam = self.lam[s].astype(np.float64)
            H_hat = H
            if relaxed:  # over-relaxation (Boyd Sec. 3.4.3): z and lambda see H^ = a H + (1 - a) z_prev
                assert prev is not None
                z_prev = sum(prev[t][p_t[s]].astype(np.float64) for t, p_t in p.items()) + self.D[s]
                H_hat = self.relax * H + (1 - self.relax) * z_prev
            z = z_update(self.task, H_hat, y, lam, r)  # Eq. 7
            D = z - H
            lam -= r * (z - H_hat)  # Eq. 8: lambda + r (H^ - z)
            loss += float(loss_np(self.task, H, y).sum())
            primal_sq += float(np.sum(D * D))
            lam_sq += float(np.sum(lam * lam))
            shift = D / M
            if not first:
                shift_change = shift - self.D[s].astype(np.float64) / M  # ((z - z_prev) - (H - H_prev)) / M
            for t, p_t in p.items():
                x = xs[t].astype(np.float64)  # h_i[p_i] in float64 (exact: h arrived in a float dtype)
                x_sq += float(np.sum(x * x))
                if not first:
                    assert prev is not None
                    d = (x - prev[t][p_t[s]].astype(np.float64)) + shift_change  # (h_i - h_i_prev)[p_i]
                    dual_sq += float(np.sum(d * d))
                x += shift  # z_i = x_i + (z - H) / M
                z_sq += float(np.sum(x * x))
            self.lam[s] = lam
            self.D[s] = D
        N = self.mapping.N
        # the outputs as received, in their dtype (float32 in a float32 run: a lossless copy of what was sent)
        # (a read-only array, as a message's arrays are, is kept as it is: nothing can change it)
        self._h = {t: v if not v.flags.writeable else np.array(v) for t, v in map(_as_array, h.items())}
        self._loss = loss / N if N else float("nan")
        self._primal = float(np.sqrt(primal_sq))
        # rho of this iteration: the one the clients' theta-update used (before any change below)
        dual = None if first else self.rho * float(np.sqrt(dual_sq))
        root = np.sqrt(M * self.D.size) * self.tol  # sqrt(p) eps_abs (p = n = M N d_c here)
        x_scale = float(np.sqrt(max(x_sq, z_sq)))
        y_scale = float(np.sqrt(M)) * float(np.sqrt(lam_sq))
        res = Residuals(
            self._primal / np.sqrt(M), dual, root + self.tol * x_scale, root + self.tol * y_scale, x_scale, y_scale
        )
        self.residuals = res
        self.iteration += 1
        if self.balancing is not None and res.dual is not None and self.iteration > self.balancing.warmup:
            self.set_rho(self.rho * self.balancing.factor(res.primal, res.dual))  # Boyd Eq. 3.13
        return res

    def accelerate(self, h: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """After :meth:`update` (h: the outputs it received): the outputs the next :meth:`scatter` uses.

        Without acceleration, ``h`` itself; with ``subspace`` > 0, :meth:`ritz`. With ``anderson`` = m > 0: one iteration of TP-Join-ADMM is a map G of
        the server's state w = (h_1..h_M, D, lambda): the clients' theta-update (Eq. 16) depends on their Y_i
        alone (closed form for a linear model), and Y_i, the next z and lambda depend on w alone. Safeguarded
        Anderson acceleration (strategies/anderson.py) replaces w by a combination of the last m + 1 values of G
        (h_i, D and lambda alike) when that lowers the fixed-point residual ||G(w) - w||, measured over the joined
        training rows (h_i weighted by G_iu, lambda scaled by 1 / r). Post-processing of values the server holds:
        no message changes, the fixed point is ADMM's. A new rho (residual balancing) is a new map: the window
        restarts. The outputs returned are in the dtype of ``h``; the server's D, lambda follow the combination."""
        if self.subspace is not None:
            return self.ritz(h)
        aa = self.anderson
        if aa is None or self._w is None:  # off, or the setup's update (no iterate mapped yet)
            return dict(h)
        p = list(self.mapping.p)
        # G(w): the outputs as received (h_i in the state's dtype: lossless, they arrived in it), D and lambda
        g = [*(self._h[t].astype(self.dtype) for t in p), self.D.copy(), self.lam.copy()]  # type: ignore[index]
        if self.rho != self._anderson_rho or not aa.weights:
            fresh = not aa.weights
            self._anderson_rho = self.rho
            aa.restart([*(self.mapping.G(t).astype(np.float64)[:, None] for t in p), 1.0, 1.0 / self.r**2])
            if not fresh:  # this pair belongs to the previous rho's map
                return dict(h)
        nxt = aa.step(self._w, g)
        self._w = None
        if nxt is g:
            return dict(h)
        out = {t: np.asarray(v, dtype=h[t].dtype) for t, v in zip(p, nxt[: len(p)], strict=True)}
        self._h = {t: np.array(v) for t, v in out.items()}
        self.D = np.array(nxt[len(p)], dtype=self.dtype)
        self.lam = np.array(nxt[len(p) + 1], dtype=self.dtype)
        return out

    def ritz(self, h: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-table subspace acceleration (strategies/subspace.py), after :meth:`update` (h: the outputs the
        latest scatter's Y produced): the Ritz point h* of the ridge objective over the span of each table's last
        outputs, and the server's state at it (z = H*: D = 0; lambda = H* - y). Returns h* in the dtype of h."""
        sub = self.subspace
        assert sub is not None
        if self._Y is None:  # the setup's update: no message sent yet
            return dict(h)
        sub.add(self._Y, h, self._Y_rho)
        self._Y = None
        out = {t: np.asarray(v, dtype=h[t].dtype) for t, v in sub.point().items()}
        self._h = {t: np.array(v) for t, v in out.items()}
        p = self.mapping.p
        for s in chunks(self.mapping.N):
            H = sum_in_first_dtype([out[t][p_t[s]] for t, p_t in p.items()]).astype(np.float64)
            self.D[s] = 0.0
            self.lam[s] = H - self.y[s].reshape(H.shape)  # dl/dz at z = H* (squared loss, Eq. 8's dual)
        return out

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
        Y = {t: sums[t].result(h[t].dtype) for t in p}
        if self.subspace is not None:  # the pair (Y_i, its theta-update's output) enters the subspace
            self._Y, self._Y_rho = Y, self.rho
        return Y

    def primal_residual(self) -> float:
        """||H - z|| over the training rows, after the latest step (the ADMM convergence check)."""
        return self._primal

    def train_loss(self) -> float:
        """(1/N) sum_j l(H_j; y_j) at the predictions of the latest step."""
        return self._loss


_EPS = np.finfo(np.float64).eps


_ARMIJO = 1e-4


_MAX_HALVINGS = 60


_ROUNDING_FLOOR = 128.0


# ---------------------------------------------------------------------------------------------- z-update
def z_update(
    task: str,
    H: np.ndarray,
    y: np.ndarray,
    lam: np.ndarray,
    r: float,
    tol: float = 1e-10,
    max_iter: int = 50,
) -> np.ndarray:
    """The ADMM z-update (TablePuppet Eq. 7; docs/algorithms.md "LoJ with ADMM" step 3), for every row at once:

        z_j = argmin_z  l(z; y_j) - lam_j^T z + r/2 ||H_j - z||^2,       r > 0.

    The optimality condition is ``dl/dz(z_j) - lam_j + r (z_j - H_j) = 0``.

    * regression: closed form ``z = (y + lam + r H) / (1 + r)`` (with l = 1/2 (z - y)^2);
    * binary: scalar Newton, Hessian ``sigma(z)(1 - sigma(z)) + r``;
    * multiclass: Newton with Hessian ``diag(p) - p p^T + r I`` per row (solved in O(C) per row by
      Sherman-Morrison, which equals the dense solve: see :func:`_multiclass_newton_direction`).

    Newton starts from H and is damped by a backtracking (Armijo) line search, so it converges from any start
    (the objective is r-strongly convex). A row stops when the Euclidean norm of its gradient is at most
    ``max(tol, 128 eps (1 + ||lam_j|| + r ||H_j||))``: the absolute ``tol`` unless float64 rounding of the
    gradient's terms makes it unreachable (only for huge |lam| or r |H|). RuntimeError if a row has not
    converged after ``max_iter`` Newton steps. Returns z with the shape of H (float64).

    Iterations (measured, C up to 50, |H| up to 1000): 2-6 Newton steps for r >= 1, at most ~20 for
    r >= 0.01. With ADMM duals (after Eq. 8, ``lam_j = dl/dz(z_j^prev)``, so ``e_y + lam_j`` is a probability
    vector) and r = 1e-4, 10-35, except with extreme logits (|H| ~ 1000, C = 50: ~60); arbitrary duals with
    r = 1e-4 can need ~150 (Newton zigzags between saturated classes). Raise ``max_iter`` for such inputs.
    """
    H, y = check_np(task, H, y)
    lam = np.asarray(lam, dtype=np.float64)
    if lam.shape != H.shape:
        raise ValueError(f"task {task!r}: lam must have the shape of H {H.shape}, got {lam.shape}")
    r = float(r)
    if not (np.isfinite(r) and r > 0.0):
        raise ValueError(f"z_update needs a penalty r > 0, got r={r!r}")
    if not (tol > 0.0):
        raise ValueError(f"z_update needs tol > 0, got tol={tol!r}")
    for name, arr in (("H", H), ("lam", lam), ("y", y)):
        if not np.all(np.isfinite(arr)):
            bad = int(np.flatnonzero(~np.isfinite(arr).reshape(arr.shape[0], -1).all(axis=1))[0])
            raise ValueError(f"z_update: {name} is not finite at row {bad} (did the models diverge?)")
    if task == "regression":
        return (y[:, None] + lam + r * H) / (1.0 + r)

    # float64 rounding floor of the gradient p - e_y - lam + r (z - H): a few eps times its terms
    floor = _ROUNDING_FLOOR * _EPS * (1.0 + np.linalg.norm(lam, axis=1) + r * np.linalg.norm(H, axis=1))
    tol_rows = np.maximum(tol, floor)
    if task == "binary":
        yb = y[:, None]

        def objective(z: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            softplus = np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))
            linear = (yb[idx] + lam[idx]) * z
            quad = 0.5 * r * (z - H[idx]) ** 2
            return (softplus - linear + quad)[:, 0], (softplus + np.abs(linear) + quad)[:, 0]

        def gradient(z: np.ndarray, idx: np.ndarray) -> np.ndarray:
            return expit(z) - yb[idx] - lam[idx] + r * (z - H[idx])

        def direction(z: np.ndarray, g: np.ndarray, idx: np.ndarray) -> np.ndarray:
            p = expit(z)
            return -g / (p * (1.0 - p) + r)

    else:
        onehot = np.zeros_like(H)
        onehot[np.arange(H.shape[0]), y] = 1.0

        def objective(z: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            lse = logsumexp(z, axis=1)
            linear = ((onehot[idx] + lam[idx]) * z).sum(axis=1)
            quad = 0.5 * r * ((z - H[idx]) ** 2).sum(axis=1)
            magnitude = np.abs(lse) + np.abs(z).sum(axis=1) + np.abs(lam[idx] * z).sum(axis=1) + quad
            return lse - linear + quad, magnitude

        def gradient(z: np.ndarray, idx: np.ndarray) -> np.ndarray:
            return softmax(z, axis=1) - onehot[idx] - lam[idx] + r * (z - H[idx])

        def direction(z: np.ndarray, g: np.ndarray, idx: np.ndarray) -> np.ndarray:
            return _multiclass_newton_direction(softmax(z, axis=1), g, r)

    return _damped_newton(task, H.copy(), tol_rows, max_iter, objective, gradient, direction)


def _multiclass_newton_direction(p: np.ndarray, g: np.ndarray, r: float) -> np.ndarray:
    """``-(diag(p) - p p^T + r I)^{-1} g`` per row, by Sherman-Morrison.

    With ``D = diag(p + r)``: ``A^{-1} g = D^{-1} g + D^{-1} p (p^T D^{-1} g) / (1 - p^T D^{-1} p)``, and the
    denominator ``1 - sum p_c^2 / (p_c + r) = r sum p_c / (p_c + r)`` is computed in that cancellation-free,
    positive form (sum p = 1).
    """
    inv_d = 1.0 / (p + r)
    dg = inv_d * g
    dp = inv_d * p
    denom = r * (p * inv_d).sum(axis=1, keepdims=True)
    return -(dg + dp * ((p * dg).sum(axis=1, keepdims=True) / denom))


def _damped_newton(
    task: str,
    z: np.ndarray,
    tol_rows: np.ndarray,
    max_iter: int,
    objective: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    gradient: Callable[[np.ndarray, np.ndarray], np.ndarray],
    direction: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """Newton with a per-row Armijo backtracking line search, vectorized over the rows not yet converged.

    ``objective(z, idx)`` returns the per-row objective and a magnitude (sum of absolute terms) used as the
    float64 rounding slack of the Armijo test, so that steps at rounding level near the optimum are accepted.
    """
    active = np.arange(z.shape[0])
    for step in range(max_iter + 1):
        za = z[active]
        g = gradient(za, active)
        gnorm = np.sqrt((g * g).sum(axis=1))
        todo = gnorm > tol_rows[active]
        if not todo.any():
            return z
        active, za, g, gnorm = active[todo], za[todo], g[todo], gnorm[todo]
        if step == max_iter:
            worst = int(np.argmax(gnorm / tol_rows[active]))
            raise RuntimeError(
                f"z_update({task!r}): {active.size} row(s) did not reach the gradient tolerance after "
                f"{max_iter} Newton steps; worst row {int(active[worst])} has gradient norm "
                f"{gnorm[worst]:.3e} > {tol_rows[active[worst]]:.3e}"
            )
        d = direction(za, g, active)
        f0, magnitude = objective(za, active)
        slope = (g * d).sum(axis=1)  # < 0: d is a descent direction (the Hessian is positive definite)
        slack = 64.0 * _EPS * magnitude
        t = np.ones(za.shape[0])
        pending = np.arange(za.shape[0])
        for _ in range(_MAX_HALVINGS):
            cand = za[pending] + t[pending, None] * d[pending]
            f1, _ = objective(cand, active[pending])
            ok = f1 <= f0[pending] + _ARMIJO * t[pending] * slope[pending] + slack[pending]
            za[pending[ok]] = cand[ok]
            pending = pending[~ok]
            if pending.size == 0:
                break
            t[pending] *= 0.5
        z[active] = za
    raise AssertionError("unreachable")  # the loop returns or raises at step == max_iter


#: algorithm.rho=auto: the penalty that reached the exact solution fastest on the bundled data (README):
#: the squared loss has curvature 1, the logistic/softmax losses at most 1/4 and far less once fitted.
AUTO_RHO = {"regression": 3.0, "binary": 0.1, "multiclass": 0.1}
#: ... with Anderson acceleration (fixed rho): measured on the schema matrix (docs/results.md), where rho = 1
#: left the correlated cells 1.5-2 times closer to the exact ridge after 10 epochs than rho = 3
AUTO_RHO_ANDERSON = {"regression": 1.0, "binary": 0.1, "multiclass": 0.1}


def admm_rho(value, task: str, anderson: bool = False) -> float:
    """algorithm.rho: a positive number, or `auto` (by task: AUTO_RHO, or AUTO_RHO_ANDERSON with acceleration)."""
    if value == "auto":
        return (AUTO_RHO_ANDERSON if anderson else AUTO_RHO)[task]
    return float(value)


def _as_array(item: tuple[str, np.ndarray]) -> tuple[str, np.ndarray]:
    return item[0], np.asarray(item[1])


class TPJoinADMM(LoJStrategy):
    algorithm = "tp_join_admm"
    params_type = ADMMParams
    resumable = True
    validation = "select"

    def protocol(self) -> None:
        done, loop = self.begin(self.start_admm)
        admm, h = loop["admm"], loop["h"]
        self.admm = admm
        last = done if not loop.get("stopped") else int(self.cfg.epochs)  # a resumed run that had stopped early
        for epoch in range(last + 1, int(self.cfg.epochs) + 1):
            Y, rho = admm.scatter(h), admm.rho
            config = {"phase": "admm_update", "epoch": epoch, "rho": rho, **self.checkpoint_config(epoch)}
            config.update(self.selection.config(self.selection.evaluations + 1))  # every update is evaluated
            replies = self.send(self.messages(lambda t: ({"Y": Y[t]}, config)))
            h = self.outputs(replies)
            res = admm.update(h)  # z, lambda (Eq. 7, 8), residuals and the next rho (Boyd Sec. 3.4.1)
            train_loss = admm.train_loss()  # at the H of this update (computed there, chunk by chunk)
            reg = sum(float(r[1]["R"]) for r in replies.values())
            selected = self.record_evaluation(
                epoch,
                joined_predictions(self.evaluated.p, h),
                train_loss,
                {"objective": train_loss + float(self.cfg.model.beta) * reg, **residual_extra(res, rho)},
            )
            stop = self.stop_early(epoch, res) or selected
            h = admm.accelerate(h)  # the state the next epoch starts from (h itself without acceleration)
            self.end_epoch(epoch, {"admm": admm, "h": h, "stopped": stop})
            if stop:
                break
        self.finish()

    def start_admm(self) -> dict:
        """Setup, then the admm_setup round (G_i, Eq. 15, sent once)."""
        self.setup()
        admm = self.admm_server()
        G = admm.G()
        config = {"phase": "admm_setup", "N": self.train.N, "d_out": self.d_out, "rho": admm.rho, **self.held_out()}
        self.send(self.messages(lambda t: ({"G": G[t]}, {**config, **self.dp_config((t, 0))})))
        # ADMM starts from x^0 = 0, z^0 = 0, lambda^0 = 0 (Boyd Sec. 3.1): not from the initial models' predictions
        # (the theta-update of Eq. 16 does not depend on them; the nodes keep theta_i^0 and send nothing of it)
        h = {t: np.zeros((len(g), self.d_out), dtype=self.cfg.precision) for t, g in G.items()}
        admm.update(h)
        return {"admm": admm, "h": h}

    def admm_server(self) -> ADMMServer:
        """The server's z, lambda and rho (algorithm.rho, adapt_rho, rho_mu, rho_tau, tol, relax, anderson,
        subspace)."""
        alg = self.params
        subspace = self.subspace_memory()
        memory = self.anderson_memory() if not (subspace and alg.anderson == "auto") else 0
        balancing = None
        if self.balancing_on(memory + subspace):
            balancing = Balancing(alg.rho_mu, alg.rho_tau, alg.rho_warmup, alg.rho_mu_persistent, alg.rho_patience)
        self.admm = ADMMServer(
            self.task,
            self.y_train,
            self.train,
            self.d_out,
            admm_rho(alg.rho, self.task, memory + subspace > 0),
            alg.variant,
            balancing,
            alg.tol,
            dtype=self.state_dtype,
            relax=alg.relax,
            anderson=memory,
            subspace=subspace,
        )
        return self.admm

    def held_out(self) -> dict[str, float]:
        """The config that tells the label owner which of its rows the validation part holds out (G = 0 there,
        as on its test rows: tpflower.join_counts); none without a validation part."""
        return {"validation_fraction": self.validation_fraction} if self.validation_fraction > 0 else {}

    def default_validation(self) -> float:
        """A validation part for an MLP (a non-convex model that ADMM may overfit); none for a linear model,
        whose ADMM converges to the exact solution (the exactness tests keep it so)."""
        return super().default_validation() if str(self.cfg.model.kind) == "mlp" else 0.0

    def balancing_on(self, anderson: int) -> bool:
        """algorithm.adapt_rho: true, false, or auto: residual balancing without acceleration (Anderson or subspace)
        only (a new rho is a new map, which restarts Anderson's window: measured slower on the schema matrix)."""
        value = self.params.adapt_rho
        return anderson == 0 if value == "auto" else bool(value)

    #: algorithm.anderson=auto's memory where it applies (measured on the schema matrix, docs/results.md)
    ANDERSON_AUTO = 10
    #: algorithm.subspace=auto's memory where it applies (measured on the schema matrix, docs/results.md)
    SUBSPACE_AUTO = 10

    def subspace_memory(self) -> int:
        """algorithm.subspace: a memory m >= 0, or auto: SUBSPACE_AUTO for regression with linear models, the
        sharing variant and no feature DP, unless algorithm.anderson is set (0: the paper's iteration, m: Anderson
        acceleration); else 0."""
        alg = self.params
        why = self.subspace_obstacle()
        if alg.subspace != "auto":
            if int(alg.subspace) > 0 and why:
                raise ValueError(f"algorithm.subspace={alg.subspace} needs {why}; use algorithm.subspace=0")
            return int(alg.subspace)
        if why or alg.anderson != "auto":  # anderson=0: the paper's iteration
            return 0
        fits = subspace_fit(self.train, np.dtype(self.state_dtype).itemsize, alg.subspace_mb)
        if fits < self.SUBSPACE_AUTO:
            self.log(
                f"algorithm.subspace=auto: memory {fits} (0: off), the most whose pairs fit algorithm.subspace_mb="
                f"{alg.subspace_mb:g} MB at {sum(self.train.n_rows.values()):,} table rows"
            )
        return min(self.SUBSPACE_AUTO, fits)

    def subspace_obstacle(self) -> str:
        """What the subspace acceleration needs and this run lacks ("" if nothing): its Ritz system holds for the
        closed-form theta-update of a linear model under the squared loss (strategies/subspace.py)."""
        if self.task != "regression" or self.d_out != 1:
            return "a regression label"
        if str(self.cfg.model.kind) != "linear":
            return "model=linear"
        if self.params.variant != "sharing":
            return "algorithm.variant=sharing"
        if self.feature_dp:
            return "no feature DP (its theta-update is DP-SGD, not the closed form)"
        return ""

    def anderson_memory(self) -> int:
        """algorithm.anderson: a memory m >= 0, or auto: ANDERSON_AUTO for the sharing variant with linear models
        and no feature DP (where it was measured), at most what fits in algorithm.anderson_mb, else 0 (the paper's
        iteration), with a line saying why."""
        alg = self.params
        if alg.anderson != "auto":
            return int(alg.anderson)
        if alg.variant != "sharing" or str(self.cfg.model.kind) != "linear" or self.feature_dp:
            return 0
        fits = anderson_fit(self.train, self.d_out, np.dtype(self.state_dtype).itemsize, alg.anderson_mb)
        memory = min(self.ANDERSON_AUTO, fits)
        if memory < self.ANDERSON_AUTO:
            self.log(
                f"algorithm.anderson=auto: memory {memory} (0: off), the most whose window fits algorithm.anderson_mb="
                f"{alg.anderson_mb:g} MB at {self.train.N:,} joined training rows"
            )
        return memory

    def stop_early(self, epoch: int, res: Residuals, inner: str = "") -> bool:
        """Record in results.stopped whether training stops after ``epoch``: "tol" (both residuals below
        algorithm.tol, Boyd Eq. 3.12) or "epochs" (the maximum); True to stop now."""
        assert self.results is not None
        done = self.params.tol > 0 and res.converged
        if done or epoch >= int(self.cfg.epochs):
            why = "tol" if done else "epochs"
            detail = res.reason() if done else f"epochs={epoch} reached (algorithm.tol={self.params.tol:g} not met)"
            self.results.stopped = {"epoch": epoch, "reason": why, "detail": detail + inner}
            if done:  # reaching the maximum needs no line of its own
                self.log(f"stopped after epoch {epoch}: {detail}{inner}")
        return done

    def plan_feature_dp(self) -> dict:
        """Per client: epochs x local_epochs x ceil(n_a / b) local DP steps at q = min(1, b / n_a), n_a = its
        rows that occur in the training join (the client's own Poisson sampling, DPLocalTrainer.admm_update)."""
        return {k: admm_dp_plan(self, k, 1) for k in self.clients}

    def dp_parameter_noise(self, plan: dict) -> float:
        return adam_parameter_noise(float(self.params.local_lr), plan)


def anderson_fit(mapping: TableMapping, d_c: int, itemsize: int, budget_mb: float) -> int:
    """The largest Anderson memory m whose server state fits ``budget_mb``: 2 (m + 1) iterates in the window plus
    two (the iterate before an update and its image), each of (sum_i n_i + 2 N) d_c values; 0 if m < 1 does."""
    iterate = (sum(int(n) for n in mapping.n_rows.values()) + 2 * int(mapping.N)) * d_c * itemsize
    m = int(budget_mb * 1e6 // (2 * iterate)) - 2
    return max(m, 0) if m >= 1 else 0


def subspace_fit(mapping: TableMapping, itemsize: int, budget_mb: float) -> int:
    """The largest subspace memory m whose pairs fit ``budget_mb``: per slot, every table's output and message
    (2 sum_i n_i values of ``itemsize`` bytes; strategies/subspace.py)."""
    slot = 2 * sum(int(n) for n in mapping.n_rows.values()) * itemsize
    return int(budget_mb * 1e6 // max(slot, 1))


def residual_extra(res: Residuals, rho: float) -> dict[str, float]:
    """The epoch line's ADMM entries: the residuals (Boyd Sec. 3.3) and the rho the epoch's theta-update used."""
    out = {"rho": rho, "primal_residual": res.primal}
    if res.dual is not None:
        out["dual_residual"] = res.dual
    return out


def admm_dp_plan(strategy: LoJStrategy, key, calls_per_epoch: int) -> tuple[int, float]:
    """(steps, q) of one client whose DP theta-update runs ``calls_per_epoch`` times per epoch."""
    alg = strategy.params
    n_a = int(np.count_nonzero(strategy.client_G(key)))
    b = alg.local_batch_size
    steps = calls_per_epoch * admm_steps(int(strategy.cfg.epochs), alg.local_epochs, n_a, b)
    return steps, (min(1.0, b / n_a) if n_a else 1.0)


class VFLADMM(TPJoinADMM):
    """VFL-ADMM: the same ADMM on the expanded tables (G = 1 per joined row): O(M N) traffic per epoch."""

    algorithm = "vfl_admm"
    expand = True
