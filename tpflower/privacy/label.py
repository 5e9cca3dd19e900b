"""Label DP (TablePuppet Sec. 4.3.1, Eq. 25; docs/algorithms.md, Privacy): the label owner randomizes its
training labels once, before they leave it, with a generator seeded from the operating system."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from tpflower.owner import label_levels
from tpflower.params import positive_finite
from tpflower.privacy.settings import TASKS, label_range


def randomize_class_labels(y: np.ndarray, n_classes: int, lam: float, rng: np.random.Generator) -> np.ndarray:
    """Eq. 25: ``argmax(OneHot(y) + Laplace(scale = lam / sqrt(2)))`` per row; ``label_epsilon(lam)``-label-DP.

    ``y``: class ids in ``[0, n_classes)`` (binary: 0/1, bool, or floats 0.0/1.0). Returns the noisy labels
    with ``y``'s dtype (so float 0/1 stays float, int ids stay int). ``rng`` is a numpy ``Generator``.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    n_classes = int(n_classes)
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2, got {n_classes}")
    lam = positive_finite("label_lambda", lam)
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-d array, got shape {y.shape}")
    ids = y.astype(np.float64) if y.dtype.kind in "fb" else y
    bad = y.size and (not np.all(np.isfinite(ids)) or np.any(ids != np.round(ids)))
    if bad or (y.size and (ids.min() < 0 or ids.max() >= n_classes)):
        raise ValueError(f"labels must be class ids in [0, {n_classes}); got values in [{ids.min()}, {ids.max()}]")
    ids = ids.astype(np.int64)
    scores = rng.laplace(loc=0.0, scale=lam / math.sqrt(2.0), size=(len(ids), n_classes))
    scores[np.arange(len(ids)), ids] += 1.0
    return np.argmax(scores, axis=1).astype(y.dtype, copy=False)


def randomize_regression_labels(
    y: np.ndarray, lo: float, hi: float, epsilon: float, rng: np.random.Generator
) -> np.ndarray:
    """``clip(y, lo, hi) + Laplace(scale = (hi - lo) / epsilon)``: ``epsilon``-label-DP (sensitivity hi - lo).

    Returns float64 (float32 if ``y`` is float32). The result is not clipped again (the noise is unbiased).
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    lo, hi = label_range("label_range", (lo, hi))
    epsilon = positive_finite("label_epsilon", epsilon)
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-d array, got shape {y.shape}")
    dtype = y.dtype if y.dtype in (np.float32, np.float64) else np.float64
    yf = y.astype(np.float64)
    if not np.all(np.isfinite(yf)):
        raise ValueError("regression labels contain NaN or infinite values")
    noisy = np.clip(yf, lo, hi) + rng.laplace(loc=0.0, scale=(hi - lo) / epsilon, size=yf.shape)
    return noisy.astype(dtype, copy=False)


def randomize_labels(
    y: np.ndarray, task: str, privacy_cfg: Mapping[str, Any], rng: np.random.Generator, n_classes: int | None = None
) -> np.ndarray:
    """Label DP by task and config: the label owner calls this once, before sending its labels.

    ``task``: regression | binary | multiclass (``n_classes`` required for multiclass; binary is 2 classes).
    Classification draws at the setting's lambda, regression at its epsilon and ``label_range``: the same level
    whichever of ``label_lambda`` and ``label_epsilon`` it sets (:func:`~tpflower.owner.label_levels`).
    """
    lam, epsilon = label_levels(privacy_cfg)
    if task == "regression":
        lo, hi = label_range("label_range", privacy_cfg.get("label_range"))
        return randomize_regression_labels(y, lo, hi, epsilon, rng)
    if task == "binary":
        return randomize_class_labels(y, 2, lam, rng)
    if task == "multiclass":
        if n_classes is None:
            raise ValueError("randomize_labels: n_classes is required for task 'multiclass'")
        return randomize_class_labels(y, n_classes, lam, rng)
    raise ValueError(f"unknown task {task!r}; expected one of {list(TASKS)}")


def label_keep_probability(lam: float, n_classes: int) -> float:
    """P(y_hat = y) under :func:`randomize_class_labels`: ``E[F(1 + L)^(C-1)]``, L ~ Laplace(lam/sqrt 2).

    F is the Laplace CDF (a row keeps its label iff its own noisy score 1 + L_y beats the C - 1 others).
    Binary closed form: ``1 - exp(-1/b) (2 + 1/b) / 4``. Computed by quadrature (error < 1e-6). A wrong label
    is uniform over the other C - 1 classes (symmetry).
    """
    lam = positive_finite("label_lambda", lam)
    n_classes = int(n_classes)
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2, got {n_classes}")
    b = lam / math.sqrt(2.0)
    if n_classes == 2:
        return 1.0 - math.exp(-1.0 / b) * (2.0 + 1.0 / b) / 4.0
    x = np.linspace(-40.0 * b, 40.0 * b, 400_001)
    pdf = np.exp(-np.abs(x) / b) / (2.0 * b)
    z = x + 1.0
    cdf = np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0.0) / b), 1.0 - 0.5 * np.exp(-np.maximum(z, 0.0) / b))
    return float(np.trapezoid(pdf * cdf ** (n_classes - 1), x))


# ----------------------------------------------------------------------------------------------------------


def label_rng() -> np.random.Generator:
    """The numpy Generator of a label owner's label DP: seeded from the operating system's entropy, never from
    anything the server knows (a seed the server could guess would let it regenerate and subtract the noise)."""
    return np.random.default_rng(secrets.randbits(128))
