"""Model selection on the validation part of the training join, server side (docs/algorithms.md, Model
selection; the nodes' side: tpflower/selection.py).

The iterative trainers (TP-Join/UCQ-SGD, CELU, L-BFGS, ADMM with an MLP) evaluate the validation rows with
the test rows at every evaluation point; :class:`ModelSelection` keeps the evaluation with the lowest mean
validation loss (the training loss of the model on the validation rows, in the label's units, as boosted
trees' early stopping), stops the run after ``patience`` evaluations without a lower one, and makes the nodes
keep that evaluation's model:

- a message after which a node's theta_i is the model of evaluation n carries ``snapshot: n`` (SGD, ADMM: the
  message that evaluates; L-BFGS: the next one, which takes the accepted step); the node keeps a copy;
- once evaluation n is the best and its snapshot was taken, the next message (or ``save_part``) carries
  ``keep: n``: the node keeps that copy as its kept model, which ``save_part`` saves (prediction uses it).
  At the end of every protocol the nodes' theta_i is the last evaluation's model: when that one is the best,
  ``save_part`` saves it as it is.

Two config scalars and no array: the phases' declared inputs do not change (tpflower.guard). The test metric
of the run (the last history entry) is the kept model's: when it is not the last evaluated one, its record
is appended again at the end, with ``kept`` in its extra values.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from strategies.epoch_checkpoints import Saved
from tpflower.losses import LabelScale, loss_np
from tpflower.results import EpochRecord


class ModelSelection(Saved):
    """The best validation evaluation of a run so far and its early stopping (module docstring).

    ``y_valid``: the validation rows' labels as training sees them (none: no selection; the run keeps its last
    model); ``patience``: evaluations without a lower validation loss that stop the run (0: never stop early)."""

    SAVED = ("evaluations", "best", "best_loss", "best_record", "best_predictions", "bad", "snapshot", "kept")

    def __init__(self, task: str, scale: LabelScale, y_valid: np.ndarray | None, patience: int):
        self.task, self.scale, self.patience = task, scale, int(patience)
        self.y_valid = None if y_valid is None or len(y_valid) == 0 else y_valid
        self.evaluations = 0  # evaluations recorded so far (numbered from 1)
        self.best = 0  # the evaluation of the lowest validation loss (0: none yet)
        self.best_loss = math.inf
        self.best_record: EpochRecord | None = None
        self.best_predictions: np.ndarray | None = None  # its test predictions (label units)
        self.bad = 0  # evaluations since the best
        self.snapshot = 0  # the latest evaluation whose model the nodes copied
        self.kept = 0  # the evaluation the nodes were last told to keep

    @property
    def on(self) -> bool:
        return self.y_valid is not None

    @property
    def n_valid(self) -> int:
        return 0 if self.y_valid is None else len(self.y_valid)

    def config(self, snapshot: int | None = None) -> dict[str, Any]:
        """The selection's part of a training message's config: ``keep`` once the best evaluation's model was
        copied, ``snapshot`` when after this message the nodes hold the model of evaluation ``snapshot``."""
        if not self.on:
            return {}
        out: dict[str, Any] = {}
        if self.best and self.best != self.kept and self.best <= self.snapshot:
            out["keep"] = self.kept = self.best
        if snapshot is not None and snapshot > self.snapshot:
            out["snapshot"] = self.snapshot = snapshot
        return out

    def save_config(self) -> dict[str, Any]:
        """The config of ``save_part``: keep the best evaluation's model. At the end of a protocol the nodes'
        theta_i is the last evaluation's model, so when that one is the best they save it as it is."""
        if not self.on or not self.best or self.best == self.evaluations:
            return {}
        if self.best > self.snapshot:
            raise RuntimeError(f"model selection: the model of evaluation {self.best} was never copied")
        self.kept = self.best
        return {"keep": self.best}

    def validation_loss(self, H_valid: np.ndarray) -> float:
        """The mean loss of the validation predictions (training's units), in the label's units for regression."""
        assert self.y_valid is not None
        loss = float(loss_np(self.task, H_valid, self.y_valid).mean())
        return self.scale.loss(loss) if self.task == "regression" else loss

    def observe(self, record: EpochRecord, test_predictions: np.ndarray | None, val_loss: float) -> None:
        """Evaluation ``record`` (its test predictions in the label's units) scored ``val_loss``."""
        self.evaluations += 1
        if val_loss < self.best_loss:
            self.best, self.best_loss, self.bad = self.evaluations, val_loss, 0
            self.best_record = replace(record, extra=dict(record.extra))
            self.best_predictions = None if test_predictions is None else np.array(test_predictions, copy=True)
        else:
            self.bad += 1

    @property
    def stopped(self) -> bool:
        """``patience`` evaluations without a lower validation loss: the run stops."""
        return self.on and self.patience > 0 and self.bad >= self.patience

    def summary(self, fraction: float) -> dict[str, float]:
        """results.json's ``selection``: the validation part and the kept evaluation."""
        assert self.best_record is not None
        return {
            "validation_fraction": fraction,
            "validation_rows": self.n_valid,
            "kept_epoch": self.best_record.epoch,
            "val_loss": self.best_loss,
            "early_stopping": self.patience,
        }

    def stop_line(self) -> str:
        """The line of an early stop."""
        assert self.best_record is not None
        return (
            f"early stopping: no lower validation loss in {self.bad} evaluations; keeping the model of epoch "
            f"{self.best_record.epoch} (val_loss={self.best_loss:.4g})"
        )
