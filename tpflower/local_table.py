"""What one client holds: its table (or shard) as a preprocessed feature matrix, its row ids, and labels if it
owns them. Built locally from the raw frame; the raw frame never leaves the client."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from tpflower.mapping import holdout_mask
from tpflower.preprocess import TablePreprocessor
from tpflower.schema import RelationalSpec


@dataclass
class LocalTable:
    """A client's table. ``X[k]`` is the preprocessed feature row of global row id ``row_ids[k]``.

    Label owner only: ``y`` (float labels for regression/binary, int class ids for multiclass),
    ``is_test`` (the test split over its rows) and ``n_classes``.
    """

    name: str
    row_ids: np.ndarray
    X: np.ndarray
    feature_names: list[str]
    keys: pd.DataFrame  # the join-key columns of these rows: digested before anything leaves the client
    y: np.ndarray | None = None
    is_test: np.ndarray | None = None
    n_classes: int | None = None

    @property
    def width(self) -> int:
        return self.X.shape[1]


def encode_labels(spec: RelationalSpec, values: pd.Series) -> tuple[np.ndarray, int | None]:
    """Labels as the loss expects them: float for regression/binary; class ids 0..C-1 for multiclass."""
    if spec.label.task == "multiclass":
        codes, classes = pd.factorize(values, sort=True)
        return codes.astype(np.int64), len(classes)
    return values.to_numpy(dtype=np.float64), None


def prepare_local_table(
    spec: RelationalSpec, name: str, frame: pd.DataFrame, rows: np.ndarray | None = None
) -> LocalTable:
    """Preprocess one table (or the shard ``rows`` of it) with statistics from its training rows only.

    The label table fits on its rows outside the test split; other tables hold no labels and fit on all rows.
    """
    t = spec.table(name)
    row_ids = np.arange(len(frame), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    local = frame.iloc[row_ids]
    is_label = name == spec.label_table
    is_test = holdout_mask(spec, len(frame))[row_ids] if is_label else None
    fit_rows = np.flatnonzero(~is_test) if is_test is not None else None
    pre = TablePreprocessor(t.numeric, t.categorical, table=name).fit(local, fit_rows)
    y, n_classes = encode_labels(spec, local[spec.label.column]) if is_label else (None, None)
    return LocalTable(
        name=name,
        row_ids=row_ids,
        X=pre.transform(local),
        feature_names=list(pre.feature_names),
        keys=local[list(spec.key_columns(name))].reset_index(drop=True),
        y=y,
        is_test=is_test,
        n_classes=n_classes,
    )
