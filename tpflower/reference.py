"""The constant predictor: the reference every run reports (results.json ``reference``, the summary line).

Fitted on the training labels the server holds (over the training join, so weighted as the join weights
them): their mean for regression, the log-odds of the positive rate for binary, the log class prior for
multiclass. A model that does not beat it has learned nothing from the features.
"""

from __future__ import annotations

import numpy as np

from tpflower.losses import metrics, primary_metric
from tpflower.results import figure


def constant_predictions(task: str, y_train: np.ndarray, n: int, d_out: int) -> np.ndarray:
    """H (n, d_out) of the constant predictor fitted on ``y_train``."""
    if task == "regression":
        return np.full((n, 1), float(np.mean(y_train)))
    if task == "binary":
        p = float(np.clip(np.mean(y_train), 1e-12, 1 - 1e-12))
        return np.full((n, 1), np.log(p / (1 - p)))
    prior = np.bincount(np.asarray(y_train, dtype=np.int64), minlength=d_out) / max(len(y_train), 1)
    return np.tile(np.log(np.clip(prior, 1e-12, None)), (n, 1))


def reference_metrics(task: str, y_train: np.ndarray, y_test: np.ndarray, d_out: int) -> dict[str, float]:
    """The constant predictor's test metrics as results.json stores them: ``{"constant_rmse": ..., ...}``."""
    H = constant_predictions(task, y_train, len(y_test), d_out)
    return as_reference(metrics(task, H, y_test))


def as_reference(test_metrics: dict[str, float]) -> dict[str, float]:
    return {f"constant_{k}": float(v) for k, v in test_metrics.items()}


def reference_text(task: str, reference: dict[str, float]) -> str:
    """``constant predictor rmse=1.1234`` for the summary line ('' when unknown), the value as the progress lines
    show theirs (:func:`tpflower.results.figure`: 5 significant digits for a label in tiny or huge units)."""
    metric = primary_metric(task)
    value = reference.get(f"constant_{metric}")
    return "" if value is None else f"constant predictor {metric}={figure(value)}"


def below_constant(task: str, test: dict[str, float], reference: dict[str, float]) -> str:
    """``test rmse 3.1750 against the constant predictor's 2.9600`` when the final model's test metrics
    (``test``: name -> value) are worse than the constant predictor's: RMSE for regression, AUC for a binary
    label (accuracy would flag every model of a rare positive class, below the majority's accuracy), accuracy for
    several classes; '' when they are not, or either is unknown."""
    metric = "auc" if task == "binary" else primary_metric(task)
    value, constant = test.get(metric), reference.get(f"constant_{metric}")
    if value is None or constant is None or not np.isfinite(value):
        return ""
    worse = value > constant if metric == "rmse" else value < constant
    return f"test {metric} {figure(value)} against the constant predictor's {figure(constant)}" if worse else ""


#: a boosted-trees training loss this much (relative) above its first evaluation's grew; less is rounding
GREW = 1e-9


def loss_grew(losses: list[tuple[int, float]]) -> str:
    """Boosted trees: ``training loss grew from 1.4000 (trees 10) to 8.7165 (trees 200)`` when the training loss
    of the last evaluation (``losses``: (trees, training loss) per evaluation, in order) is above the first's;
    '' when it is not. Each boosting round is a Newton step on the training loss (Chen & Guestrin Eq. 3-6), so
    a loss that ends above where it started is not overfitting but leaves whose values diverge: a leaf summing
    almost no hessian (a class of few rows, softmax saturated, at lambda_l2 0) takes a value -G/H far from 0
    that the next rounds overshoot back."""
    if len(losses) < 2 or not np.isfinite(losses[0][1]):
        return ""
    (t0, first), (t1, last) = losses[0], losses[-1]
    if not (last > first * (1 + GREW) or not np.isfinite(last)):
        return ""  # the same loss to rounding: trees of one leaf each keep the constant predictor's loss
    return f"training loss grew from {first:.4f} (trees {t0}) to {last:.4g} (trees {t1})"


#: an SGD epoch whose training loss is this many times the lowest of the epochs before it overshot
LOSS_ROSE = 1.25


def loss_rose(losses: list[tuple[int | float, float]], factor: float = LOSS_ROSE) -> str:
    """Mini-batch SGD: ``training loss rose from 0.7346 (epoch 11) to 1.142 (epoch 14)`` when an epoch's training
    loss (``losses``: (epoch, training loss) per evaluation, in order) is above ``factor`` times the lowest of the
    epochs before it, the largest such rise; '' when none is. An epoch's mean loss on its mini-batches moves by a few
    per cent from sampling; a rise of a quarter is a step size past SGD's stable range (the step overshoots the
    minimum along the sharpest direction: lr above 2 / the largest Hessian eigenvalue)."""
    if len(losses) < 2:
        return ""
    loss = np.array([value for _, value in losses], dtype=np.float64)
    loss = np.where(np.isfinite(loss), loss, np.inf)
    lowest = np.minimum.accumulate(loss)[:-1]  # the lowest before each later epoch
    ratio, known = np.zeros(len(lowest)), np.isfinite(lowest) & (lowest > 0)
    ratio[known] = loss[1:][known] / lowest[known]  # inf: a later loss that is not finite
    if not (ratio > factor).any():
        return ""
    at = int(np.argmax(ratio)) + 1
    low = int(np.argmin(loss[:at]))
    return f"training loss rose from {loss[low]:.4g} (epoch {losses[low][0]}) to {loss[at]:.4g} (epoch {losses[at][0]})"
