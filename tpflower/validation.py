"""The validation part of the training join: rows held out of training for early stopping and model selection
(never the test split)."""

from __future__ import annotations

import numpy as np


def validation_mask(label_rows: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask over the training join's rows, True for a row held out for validation (never the test
    split). The unit is the label table's row (label_rows[j] = p_label(j), the label table's row of joined row
    j), so all joined copies of one labelled row fall on the same side."""
    if fraction <= 0:
        return np.zeros(len(label_rows), dtype=bool)
    if not fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {fraction}")
    u = np.random.default_rng(seed).random(int(label_rows.max()) + 1 if len(label_rows) else 0)
    return u[label_rows] < fraction


#: ``validation_fraction`` of the algorithms that keep the model of the best validation evaluation (SGD, CELU,
#: L-BFGS, MLPs) when the config leaves it at null; the solvers (PCG, linear ADMM) default to 0
SELECTION_FRACTION = 0.1


def validation_fraction_of(value: object, default: float) -> float:
    """The run's ``validation_fraction``: ``default`` (the algorithm's) for null, else a number in [0, 1)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"validation_fraction must be a number in [0, 1) or null (the algorithm's default), got {value!r}"
        )
    return float(value)


#: ``algorithm.early_stopping`` of those algorithms: evaluations without a lower validation loss that stop a run
PATIENCE = 5
