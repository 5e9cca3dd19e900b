"""Losses l(H; y), their gradients dl/dH, evaluation metrics and the ADMM z-update.

ALGORITHMS.md, Notation: ``H_j = sum_i f_i(theta_i; T_{i,p_i(j)})`` is the joined prediction of row j, of
shape ``(N, d_c)``; ``l(H; y)`` is the loss of the objective (Eq. 2). Three tasks:

* ``"regression"``: ``l = 1/2 (H - y)^2``, H of shape ``(n, 1)``, y real;
* ``"binary"``: logistic loss on one logit, ``l = log(1 + e^H) - y H``, H ``(n, 1)``, y in {0, 1};
* ``"multiclass"``: softmax cross-entropy, ``l = logsumexp(H) - H_y``, H ``(n, C)``, y integer ids in [0, C).

Labels may be given as ``(n,)`` or ``(n, 1)``. The numpy functions run on the server (which holds the labels),
:func:`loss_torch` on the client / in the centralized baseline. All formulas are the numerically stable forms
(log-sum-exp, ``log1p(exp(-|x|))``) and vectorized over rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch.nn.functional as F
from scipy.special import expit, logsumexp, softmax
from torch import Tensor

from tpflower.owner import uses_feature_dp
from tpflower.schema import TASKS

_EPS = np.finfo(np.float64).eps
_ARMIJO = 1e-4
_MAX_HALVINGS = 60
_ROUNDING_FLOOR = 128.0


# ---------------------------------------------------------------------------------------------- tasks
def check_task(task: str) -> str:
    """``task`` if it is one of :data:`TASKS`, else a ValueError naming it."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {list(TASKS)}")
    return task


def output_dim(task: str, n_classes: int | None = None) -> int:
    """d_c, the output width of every local model: 1 for regression and binary, ``n_classes`` for multiclass."""
    check_task(task)
    if task == "regression":
        return 1
    if task == "binary":
        if n_classes not in (None, 2):
            raise ValueError(f"task 'binary' has 2 classes, got n_classes={n_classes!r}")
        return 1
    if n_classes is None or int(n_classes) < 2:
        raise ValueError(f"task 'multiclass' needs n_classes >= 2, got n_classes={n_classes!r}")
    return int(n_classes)


def primary_metric(task: str) -> str:
    """The metric reported as ``test_metric``: ``"rmse"`` (lower is better) or ``"accuracy"`` (higher)."""
    return "rmse" if check_task(task) == "regression" else "accuracy"


# ---------------------------------------------------------------------------------------------- validation
def _check_np(task: str, H: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """H as float64 ``(n, d_c)`` and y as float64 ``(n,)`` (regression, binary) or intp ``(n,)`` (multiclass)."""
    check_task(task)
    H = np.asarray(H, dtype=np.float64)
    if H.ndim != 2:
        raise ValueError(f"task {task!r}: H must be 2-D (n, d_c), got shape {H.shape}")
    n, width = H.shape
    if task in ("regression", "binary") and width != 1:
        raise ValueError(f"task {task!r}: H must have shape (n, 1), got {H.shape}")
    if task == "multiclass" and width < 2:
        raise ValueError(f"task 'multiclass': H must have shape (n, C) with C >= 2, got {H.shape}")
    y = np.asarray(y)
    if y.shape == (n, 1):
        y = y[:, 0]
    if y.shape != (n,):
        raise ValueError(f"task {task!r}: y must have shape ({n},) to match H {H.shape}, got {y.shape}")
    if task == "regression":
        return H, y.astype(np.float64, copy=False)
    if task == "binary":
        yf = y.astype(np.float64, copy=False)
        bad = ~((yf == 0.0) | (yf == 1.0))
        if bad.any():
            raise ValueError(f"task 'binary': labels must be 0 or 1, got {y[bad][:5].tolist()}")
        return H, yf
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating) or y.dtype == bool):
        raise ValueError(f"task 'multiclass': labels must be integer class ids, got dtype {y.dtype}")
    if np.issubdtype(y.dtype, np.floating) and not np.all(np.isfinite(y)):
        raise ValueError(f"task 'multiclass': labels must be class ids, got {y[~np.isfinite(y)][:5].tolist()}")
    yi = y.astype(np.intp)
    bad = (yi != y) | (yi < 0) | (yi >= width)
    if bad.any():
        raise ValueError(f"task 'multiclass': labels must be class ids in [0, {width}), got {y[bad][:5].tolist()}")
    return H, yi


# ---------------------------------------------------------------------------------------------- losses
def loss_torch(task: str, H: Tensor, y: Tensor) -> Tensor:
    """Mean of l(H_j; y_j) over the rows (the data term of Eq. 2), differentiable in H."""
    check_task(task)
    if H.dim() != 2:
        raise ValueError(f"task {task!r}: H must be 2-D (n, d_c), got shape {tuple(H.shape)}")
    n = H.shape[0]
    y = y.reshape(-1)
    if y.shape[0] != n:
        raise ValueError(f"task {task!r}: y has {y.shape[0]} labels for {n} rows of H")
    if task == "regression":
        if H.shape[1] != 1:
            raise ValueError(f"task 'regression': H must have shape (n, 1), got {tuple(H.shape)}")
        return 0.5 * (H[:, 0] - y.to(H.dtype)).pow(2).mean()
    if task == "binary":
        if H.shape[1] != 1:
            raise ValueError(f"task 'binary': H must have shape (n, 1), got {tuple(H.shape)}")
        return F.binary_cross_entropy_with_logits(H[:, 0], y.to(H.dtype))
    return F.cross_entropy(H, y.long())


def loss_np(task: str, H: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-row loss l(H_j; y_j), shape ``(n,)``, float64."""
    H, y = _check_np(task, H, y)
    if task == "regression":
        return 0.5 * (H[:, 0] - y) ** 2
    if task == "binary":
        h = H[:, 0]
        # log(1 + e^h) - y h, with log(1 + e^h) = max(h, 0) + log1p(e^{-|h|})
        return np.maximum(h, 0.0) + np.log1p(np.exp(-np.abs(h))) - y * h
    return logsumexp(H, axis=1) - H[np.arange(H.shape[0]), y]


def loss_grad_np(task: str, H: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dl(H_j; y_j)/dH_j per row, same shape as H: ``H - y``; ``sigmoid(H) - y``; ``softmax(H) - onehot(y)``.

    This is g_j of ALGORITHMS.md "LoJ with SGD" step 3 (summed into Y_iu by Eq. 10).
    """
    H, y = _check_np(task, H, y)
    if task == "regression":
        return H - y[:, None]
    if task == "binary":
        return expit(H) - y[:, None]
    grad = softmax(H, axis=1)
    grad[np.arange(H.shape[0]), y] -= 1.0
    return grad


# ---------------------------------------------------------------------------------------------- metrics
def binary_auc(scores: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC by the rank formula (Mann-Whitney U), ties averaged; NaN when only one class is present.

    ``AUC = (sum of the ranks of the positives - n_pos (n_pos + 1) / 2) / (n_pos n_neg)``.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    pos = np.asarray(y).reshape(-1) == 1
    n_pos = int(pos.sum())
    n_neg = pos.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    from scipy.stats import rankdata  # scipy.stats costs ~1 s to import; only AUC needs it

    ranks = rankdata(scores, method="average")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def metrics(task: str, H: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Evaluation metrics of predictions H against labels y, always with ``"loss"`` (the mean loss).

    regression: ``rmse``; binary: ``accuracy`` (predict 1 iff H > 0) and ``auc`` (:func:`binary_auc`);
    multiclass: ``accuracy`` (argmax of H).
    """
    H, y = _check_np(task, H, y)
    if H.shape[0] == 0:
        raise ValueError(f"task {task!r}: metrics of 0 rows are undefined")
    out = {"loss": float(loss_np(task, H, y).mean())}
    if task == "regression":
        out["rmse"] = float(np.sqrt(np.mean((H[:, 0] - y) ** 2)))
    elif task == "binary":
        out["accuracy"] = float(np.mean((H[:, 0] > 0.0) == (y == 1.0)))
        out["auc"] = binary_auc(H[:, 0], y)
    else:
        out["accuracy"] = float(np.mean(np.argmax(H, axis=1) == y))
    return out


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
    """The ADMM z-update (ALGORITHMS.md "LoJ with ADMM" step 3; paper Eq. 7), for every row at once:

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
    H, y = _check_np(task, H, y)
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


# ---------------------------------------------------------------------------------------------- label scale
def standardizes_label(cfg) -> bool:
    """Config ``standardize_label``: true | false | auto (true, except under feature DP: DP-SGD adds its noise
    to the parameters, and predictions on the standardized scale reach the label's units multiplied by its
    std, so the noise costs std times more there; README "Privacy" measures it)."""
    value = cfg.get("standardize_label", "auto")
    if value == "auto":
        return not uses_feature_dp(cfg.get("privacy") or {})
    if isinstance(value, bool):
        return value
    raise ValueError(f"standardize_label must be true, false or auto, got {value!r}")


@dataclass(frozen=True)
class LabelScale:
    """A regression label standardized on the training rows (config ``standardize_label``): training sees
    ``(y - mean) / std``; predictions go back to the label's units as ``H std + mean`` before any metric.

    Fitted by whoever holds the training labels (the server, on the labels the label owner sent: randomized
    ones under label DP, so the scale is post-processing of the DP release). Identity for classification."""

    mean: float = 0.0
    std: float = 1.0

    @classmethod
    def fit(cls, task: str, y: np.ndarray, on: bool = True) -> "LabelScale":
        """Mean and standard deviation of the training labels ``y`` (identity unless regression and ``on``)."""
        if not on or task != "regression" or len(y) == 0:
            return cls()
        y = np.asarray(y, dtype=np.float64)
        mean, std = float(y.mean()), float(y.std())
        return cls(mean, std if np.isfinite(std) and std > 0 else 1.0)

    def scaled(self, y: np.ndarray) -> np.ndarray:
        """The labels training sees."""
        if self.mean == 0.0 and self.std == 1.0:
            return y
        return (np.asarray(y, dtype=np.float64) - self.mean) / self.std

    def to_label(self, H: np.ndarray) -> np.ndarray:
        """Predictions in the label's own units."""
        if self.mean == 0.0 and self.std == 1.0:
            return H
        return np.asarray(H, dtype=np.float64) * self.std + self.mean

    def loss(self, value: float) -> float:
        """A squared-error loss (or objective) of the scaled problem in the label's units (times std^2)."""
        return float(value) * self.std**2
