"""What one client holds: its table (or shard) as a preprocessed feature matrix, its row ids, and labels if it
owns them. Built locally from the raw frame; the raw frame never leaves the client."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tpflower.fedprep import bin_feature_names, bin_transform, local_quantile_edges
from tpflower.mapping import holdout_mask, index_dtype
from tpflower.preprocess import TablePreprocessor
from tpflower.schema import RelationalSpec, SpecError, binary_classes, class_codes


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
    # the fitted preprocessing that built X (own fit or global rule): a saved model part keeps it
    preprocessor: TablePreprocessor | None = None
    bin_edges: Mapping[str, np.ndarray] | None = None

    @property
    def width(self) -> int:
        return self.X.shape[1]


def with_class_names(frame: pd.DataFrame, classes: Sequence[Any]) -> pd.DataFrame:
    """``frame`` with a ``class`` column after ``prediction``: the name of each predicted class id."""
    names = np.asarray(list(classes), dtype=object)[frame["prediction"].to_numpy(dtype=np.int64)]
    out = frame.copy()
    out.insert(out.columns.get_loc("prediction") + 1, "class", names)
    return out


def encode_labels(
    spec: RelationalSpec, values: pd.Series, rows: np.ndarray | None = None
) -> tuple[np.ndarray, list[Any] | None]:
    """Labels as the loss expects them, of the rows ``rows`` of the table's label column ``values`` (None: all),
    and the classes: float for regression (no classes); binary 0.0/1.0, and when its two values are not 0/1
    already (``yes``/``no``), those values in the order of their codes (schema.binary_classes); for multiclass
    class ids 0..C-1 in the sorted order of the classes of the whole column (returned in that order), so every
    shard cut from one table gives a class the same id, whichever classes its own rows hold. Declared classes
    (``label.classes``) give the ids instead, in their order (binary: [negative, positive]), so shards held in
    separate files code them alike too; a label outside them: SpecError (counted, never shown)."""
    declared = spec.label.classes
    if declared is not None:
        codes = class_codes(values, declared)
        if (codes < 0).any():
            raise SpecError(
                f"label column {spec.label.column!r}: {int((codes < 0).sum())} labels are not among label.classes"
            )
        y = codes if spec.label.task == "multiclass" else codes.astype(np.float64)
        return (y if rows is None else y[rows]), list(declared)
    if spec.label.task == "multiclass":
        codes, classes = pd.factorize(values, sort=True)
        codes = codes.astype(np.int64)
        return (codes if rows is None else codes[rows]), classes.tolist()
    if spec.label.task == "binary":
        two = binary_classes(values)
        if two is not None:
            y = (values == two[1]).to_numpy(dtype=np.float64)
            return (y if rows is None else y[rows]), two
    return (values if rows is None else values.iloc[rows]).to_numpy(dtype=np.float64), None


def fit_rows(spec: RelationalSpec, name: str, n_table_rows: int, row_ids: np.ndarray) -> np.ndarray | None:
    """The rows (a boolean mask over ``row_ids``: 1 byte a row) that preprocessing may fit on: the label
    table's rows outside the test split; every row of the other tables (they hold no labels). None means all."""
    if name != spec.label_table:
        return None
    return ~holdout_mask(spec, n_table_rows)[row_ids]


def prepare_local_table(
    spec: RelationalSpec,
    name: str,
    frame: pd.DataFrame,
    rows: np.ndarray | None = None,
    preprocessor: TablePreprocessor | None = None,
    bin_edges: Mapping[str, np.ndarray] | None = None,
    dtype: np.dtype | type = np.float64,
) -> LocalTable:
    """Preprocess one table (or the shard ``rows`` of it) with statistics from its training rows only.

    The label table fits on its rows outside the test split; other tables hold no labels and fit on all rows.
    A fitted ``preprocessor`` and ``bin_edges`` (the global rule of federated preprocessing) replace the local
    fit. Binned columns (``binned`` in the spec) add one-hot quantile bins after the other features. ``X`` is
    built in ``dtype`` (the run's precision) directly.
    """
    t = spec.table(name)
    row_ids = np.arange(len(frame), dtype=index_dtype(len(frame))) if rows is None else np.asarray(rows, dtype=np.int64)
    local = frame if rows is None else frame.iloc[row_ids]  # the whole table: no copy
    is_label = name == spec.label_table
    is_test = holdout_mask(spec, len(frame))[row_ids] if is_label else None
    pre = preprocessor or TablePreprocessor(t.numeric, t.categorical, table=name).fit(
        local, fit_rows(spec, name, len(frame), row_ids)
    )
    y, classes = (
        encode_labels(spec, frame[spec.label.column], None if rows is None else row_ids) if is_label else (None, None)
    )
    X, names = pre.transform(local, dtype), list(pre.feature_names)
    if t.binned:
        if bin_edges is None:
            positions = fit_rows(spec, name, len(frame), row_ids)
            bin_edges = {c: local_quantile_edges(pre.observed_values(local, c, positions), b) for c, b in t.binned}
        X = np.concatenate([X, bin_transform(local, bin_edges, table=name).astype(dtype, copy=False)], axis=1)
        names += bin_feature_names(bin_edges)
    return LocalTable(
        name=name,
        row_ids=row_ids,
        X=X,
        feature_names=names,
        keys=local[list(spec.key_columns(name))].reset_index(drop=True),
        y=y,
        is_test=is_test,
        n_classes=None if classes is None else len(classes),
        preprocessor=pre,
        bin_edges=dict(bin_edges) if t.binned and bin_edges is not None else {},
    )


class ShardData:
    """One client's rows of its table (all of it, or one shard): the raw frame never leaves the client.

    What the client may send is derived here: global row ids, the key columns (digested before sending),
    labels and test flags (label owner), a preprocessing summary (union scenario). The feature matrix is
    built on demand, with a local fit or with a global preprocessing rule, and kept per rule.
    """

    def __init__(
        self,
        spec: RelationalSpec,
        name: str,
        frame: pd.DataFrame,
        rows: np.ndarray | None = None,
        precision: str = "float64",
    ):
        self.spec, self.name, self.frame = spec, name, frame
        self.whole = rows is None  # the whole table (join scenario): its rows are the frame itself, no copy
        self.row_ids = (
            np.arange(len(frame), dtype=index_dtype(len(frame))) if rows is None else np.asarray(rows, dtype=np.int64)
        )
        self.rows = self.frame if self.whole else self.frame.iloc[self.row_ids].reset_index(drop=True)
        self.keys = self.rows[list(spec.key_columns(name))]
        self.is_label = name == spec.label_table
        self.y, self.classes = (  # classes: a multiclass label's, in the order of their ids
            encode_labels(spec, frame[spec.label.column], None if self.whole else self.row_ids)
            if self.is_label
            else (None, None)
        )
        self.n_classes = None if self.classes is None else len(self.classes)
        self.is_test = holdout_mask(spec, len(frame))[self.row_ids] if self.is_label else None
        self.fit_positions = fit_rows(spec, name, len(frame), self.row_ids)
        self.dtype = np.float32 if precision == "float32" else np.float64
        self._tables: dict[str, LocalTable] = {}
        self.models: dict[tuple, Any] = {}  # the client's f_i modules, reused across messages (TableClient.model)

    def table(
        self,
        rule_id: str = "local",
        rule: Callable[[], tuple[TablePreprocessor, dict[str, np.ndarray]]] | None = None,
    ) -> LocalTable:
        """The LocalTable under a global preprocessing rule (``rule()`` gives the fitted preprocessor and the
        bin edges, built once per rule id); "local": the table's own fit."""
        if rule_id not in self._tables:
            pre, edges = rule() if rule else (None, None)
            local = prepare_local_table(
                self.spec, self.name, self.frame, None if self.whole else self.row_ids, pre, edges, self.dtype
            )
            local.X = local.X.astype(self.dtype, copy=False)  # the run's precision: no conversion per message
            if self.whole:  # the same ids 0..n-1: one array, not two
                local.row_ids = self.row_ids
            self._tables[rule_id] = local
        return self._tables[rule_id]
