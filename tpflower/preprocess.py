"""Local feature preprocessing of one table: impute, standardize, one-hot.

A :class:`TablePreprocessor` turns the feature columns of one table into a float64 matrix
``T_i`` (docs/algorithms.md, Notation: table i has n_i rows and d_i feature columns). It is fitted on the
training rows only; every fitted statistic is a public attribute, so that the federated preprocessing of a
union (TablePuppet Sec. 4.4; docs/algorithms.md, Federated preprocessing for UCQ) can build one from merged
statistics with :meth:`TablePreprocessor.from_stats` (or by setting the attributes) and get the same transform
on every shard.

Rules (column by column, output columns in the order ``numeric`` then ``categorical``):

* numeric (bool counts as numeric): NaN -> the fit-rows median of the observed values (0 if none), then
  ``(x - mean) / std`` with mean and population std (ddof 0) of the *observed* (non-NaN) fit-row values;
  a std of 0 (or no observed value) becomes 1 and a column without observed values gets mean 0. Using the
  observed values makes mean/std mergeable from (count, sum, sum of squares) per shard. Infinite values are
  rejected.
* categorical: each value as a string (integral numbers without a decimal point, so an int column and the
  same column read as float because of a NaN agree), NaN as its own category ``"<NA>"``; one-hot over the
  categories seen in the fit rows, in sorted order; a category not seen at fit time gives an all-zero block.

Feature names: ``"year"`` for a numeric column, ``"genre=Comedy"`` for a one-hot column.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from tpflower.schema import SpecError

NA_CATEGORY = "<NA>"
"""The category that stands for a missing categorical value."""

_EXACT_INT = 2.0**53  # floats below this magnitude that are integral print exactly as integers


class TablePreprocessor:
    """Impute, standardize and one-hot encode the feature columns of one table.

    Fitted state (``None`` until :meth:`fit` or :meth:`from_stats`):

    * ``medians``, ``means``, ``stds``: ``dict[column, float]`` for every numeric column (``stds`` > 0);
    * ``categories``: ``dict[column, tuple[str, ...]]`` for every categorical column (the one-hot order).

    These attributes may be replaced (e.g. by federated, merged statistics); :attr:`feature_names` and
    :attr:`width` follow them, and :meth:`transform` validates them.
    """

    def __init__(self, numeric: Sequence[str], categorical: Sequence[str], table: str = "?") -> None:
        self.table = str(table)
        self.numeric: tuple[str, ...] = _column_names(numeric, "numeric", self.table)
        self.categorical: tuple[str, ...] = _column_names(categorical, "categorical", self.table)
        both = sorted(set(self.numeric) & set(self.categorical))
        if both:
            raise SpecError(f"table {self.table!r}: column(s) {both} are declared both numeric and categorical")
        self.medians: dict[str, float] | None = None
        self.means: dict[str, float] | None = None
        self.stds: dict[str, float] | None = None
        self.categories: dict[str, tuple[str, ...]] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_stats(
        cls,
        numeric: Sequence[str],
        categorical: Sequence[str],
        *,
        medians: Mapping[str, float],
        means: Mapping[str, float],
        stds: Mapping[str, float],
        categories: Mapping[str, Sequence[str]],
        table: str = "?",
    ) -> TablePreprocessor:
        """A fitted preprocessor from given statistics (e.g. merged over the shards of a union).

        ``categories[col]`` is used in the given order (the global one-hot index); it must hold unique
        strings. ``stds`` must be positive and finite. Keys must be exactly the declared columns.
        """
        pre = cls(numeric, categorical, table=table)
        pre.medians = {c: float(v) for c, v in medians.items()}
        pre.means = {c: float(v) for c, v in means.items()}
        pre.stds = {c: float(v) for c, v in stds.items()}
        pre.categories = {c: tuple(str(v) for v in vals) for c, vals in categories.items()}
        pre._check_fitted()
        return pre

    def stats(self) -> dict[str, Any]:
        """The fitted statistics as plain dicts: the keyword arguments of :meth:`from_stats`."""
        self._check_fitted()
        assert self.medians is not None and self.means is not None
        assert self.stds is not None and self.categories is not None
        return {
            "medians": dict(self.medians),
            "means": dict(self.means),
            "stds": dict(self.stds),
            "categories": {c: tuple(v) for c, v in self.categories.items()},
        }

    # ------------------------------------------------------------------ fit / transform
    def fit(self, frame: pd.DataFrame, rows: np.ndarray | None = None) -> TablePreprocessor:
        """Fit the statistics on ``frame`` restricted to ``rows`` (row positions; ``None``: all rows).

        ``rows`` may also be a boolean mask of length ``len(frame)``. Returns ``self``.
        """
        self._check_columns(frame)
        positions = _row_positions(rows, len(frame), self.table)
        medians: dict[str, float] = {}
        means: dict[str, float] = {}
        stds: dict[str, float] = {}
        for col in self.numeric:
            observed = self.observed_values(frame, col, positions)
            if observed.size == 0:
                medians[col], means[col], stds[col] = 0.0, 0.0, 1.0
                continue
            medians[col] = float(np.median(observed))
            means[col] = float(observed.mean())
            std = float(observed.std())
            stds[col] = std if std > 0.0 else 1.0
        categories: dict[str, tuple[str, ...]] = {}
        for col in self.categorical:
            values = _category_strings(frame[col])
            if positions is not None:
                values = values[positions]
            categories[col] = tuple(str(v) for v in np.unique(values))
        self.medians, self.means, self.stds, self.categories = medians, means, stds, categories
        return self

    def transform(self, frame: pd.DataFrame, dtype: np.dtype | type = np.float64) -> np.ndarray:
        """The feature matrix of every row of ``frame``: shape ``(len(frame), width)``, C-contiguous, in
        ``dtype`` (float32: each value computed in float64, then rounded). Numeric columns are standardized
        in chunks of rows: a few MB of float64 temporaries whatever the table's size."""
        self._check_fitted()
        self._check_columns(frame)
        assert self.medians is not None and self.means is not None
        assert self.stds is not None and self.categories is not None
        n = len(frame)
        out = np.zeros((n, self.width), dtype=dtype)
        for k, col in enumerate(self.numeric):
            column = self._numeric_column(frame, col)
            self._check_finite(col, column)
            for start in range(0, n, TRANSFORM_CHUNK):
                x = np.array(column[start : start + TRANSFORM_CHUNK], dtype=np.float64)
                x = np.where(np.isnan(x), self.medians[col], x)
                out[start : start + TRANSFORM_CHUNK, k] = (x - self.means[col]) / self.stds[col]
        offset = len(self.numeric)
        rows = np.arange(n)
        for col in self.categorical:
            cats = self.categories[col]
            codes = pd.Index(cats, dtype=object).get_indexer(_category_strings(frame[col]))
            seen = codes >= 0  # unseen categories have code -1: their block stays zero
            out[rows[seen], offset + codes[seen].astype(np.intp)] = 1.0
            offset += len(cats)
        return out

    # ------------------------------------------------------------------ derived
    @property
    def fitted(self) -> bool:
        return self.categories is not None

    @property
    def feature_names(self) -> list[str]:
        """Output column names: numeric columns, then ``"col=category"`` per one-hot column."""
        self._check_fitted()
        assert self.categories is not None
        names = list(self.numeric)
        for col in self.categorical:
            names.extend(f"{col}={cat}" for cat in self.categories[col])
        return names

    @property
    def width(self) -> int:
        """Number of output columns d_i."""
        self._check_fitted()
        assert self.categories is not None
        return len(self.numeric) + sum(len(self.categories[c]) for c in self.categorical)

    def __repr__(self) -> str:
        state = f"width={self.width}" if self.fitted else "unfitted"
        return (
            f"TablePreprocessor(table={self.table!r}, numeric={list(self.numeric)}, "
            f"categorical={list(self.categorical)}, {state})"
        )

    # ------------------------------------------------------------------ validation helpers
    def _check_columns(self, frame: pd.DataFrame) -> None:
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"table {self.table!r}: expected a pandas DataFrame, got {type(frame).__name__}")
        missing = [c for c in self.numeric + self.categorical if c not in frame.columns]
        if missing:
            raise SpecError(
                f"table {self.table!r}: feature column(s) {missing} not found; "
                f"columns present: {list(map(str, frame.columns))}"
            )

    def _check_fitted(self) -> None:
        stats = (self.medians, self.means, self.stds, self.categories)
        if all(s is None for s in stats):
            raise RuntimeError(f"table {self.table!r}: TablePreprocessor is not fitted (call fit or from_stats)")
        if any(s is None for s in stats):
            raise RuntimeError(f"table {self.table!r}: TablePreprocessor statistics are partly unset")
        assert self.medians is not None and self.means is not None
        assert self.stds is not None and self.categories is not None
        for name, stat in (("medians", self.medians), ("means", self.means), ("stds", self.stds)):
            if set(stat) != set(self.numeric):
                raise SpecError(
                    f"table {self.table!r}: {name} has columns {sorted(stat)}, expected the numeric "
                    f"columns {sorted(self.numeric)}"
                )
            bad = [c for c, v in stat.items() if not np.isfinite(v)]
            if bad:
                raise SpecError(f"table {self.table!r}: {name} is not finite for column(s) {bad}")
        bad_std = {c: v for c, v in self.stds.items() if v <= 0.0}
        if bad_std:
            raise SpecError(f"table {self.table!r}: stds must be positive, got {bad_std}")
        if set(self.categories) != set(self.categorical):
            raise SpecError(
                f"table {self.table!r}: categories has columns {sorted(self.categories)}, expected the "
                f"categorical columns {sorted(self.categorical)}"
            )
        for col, cats in self.categories.items():
            if len(set(cats)) != len(cats):
                raise SpecError(f"table {self.table!r}: categories of column {col!r} are not unique: {cats}")

    def missing(self, frame: pd.DataFrame) -> np.ndarray:
        """Which values of the numeric columns are missing (NaN), rows x numeric columns: the entries that
        :meth:`transform` fills with the median."""
        out = np.zeros((len(frame), len(self.numeric)), dtype=bool)
        for k, col in enumerate(self.numeric):
            column = self._numeric_column(frame, col)
            if column.dtype.kind == "f":
                out[:, k] = np.isnan(column)
        return out

    def with_missing(self, X: np.ndarray, frame: pd.DataFrame) -> np.ndarray:
        """:meth:`transform`'s features ``X`` of ``frame``'s rows with the numeric columns' missing values kept
        missing (NaN) instead of the median: boosted trees give them a bin of their own. ``X`` itself where no
        value is missing, else a copy in its own floating dtype (a wide one-hot block is not widened)."""
        missing = self.missing(frame)
        if not missing.any():
            return X
        X = np.array(X, dtype=X.dtype if X.dtype.kind == "f" else np.float64)
        X[:, : missing.shape[1]][missing] = np.nan
        return X

    def observed_values(self, frame: pd.DataFrame, col: str, positions: np.ndarray | None) -> np.ndarray:
        """The non-missing values of numeric column ``col`` on the fit rows ``positions`` (None: all rows)."""
        column = self._numeric_column(frame, col)
        if positions is not None:
            column = column[positions]  # the fit rows first, in the column's own dtype
        x = np.asarray(column, dtype=np.float64)
        self._check_finite(col, x)
        missing = np.isnan(x)
        return x[~missing] if missing.any() else x

    def _numeric_column(self, frame: pd.DataFrame, col: str) -> np.ndarray:
        """The column's values as they are held (no copy where possible; missing values as NaN)."""
        series = frame[col]
        if not (pd.api.types.is_numeric_dtype(series.dtype) or pd.api.types.is_bool_dtype(series.dtype)):
            raise SpecError(
                f"table {self.table!r}: numeric column {col!r} has non-numeric dtype {series.dtype}; "
                "declare it categorical or convert it"
            )
        if isinstance(series.dtype, np.dtype) and series.dtype.kind in "fiu":
            return series.to_numpy()
        return series.to_numpy(dtype=np.float64, na_value=np.nan)

    def _check_finite(self, col: str, x: np.ndarray) -> None:
        n_inf = int(np.isinf(x).sum()) if x.dtype.kind == "f" else 0
        if n_inf:
            raise SpecError(f"table {self.table!r}: numeric column {col!r} has {n_inf} infinite value(s)")

    def _numeric_values(self, frame: pd.DataFrame, col: str) -> np.ndarray:
        x = np.array(self._numeric_column(frame, col), dtype=np.float64)
        self._check_finite(col, x)
        return x


#: rows per chunk of :meth:`TablePreprocessor.transform`'s numeric pass
TRANSFORM_CHUNK = 1 << 20


def _column_names(columns: Sequence[str], kind: str, table: str) -> tuple[str, ...]:
    if isinstance(columns, str):
        raise SpecError(f"table {table!r}: {kind} columns must be a list of names, got the string {columns!r}")
    names = tuple(columns)
    dup = sorted({c for c in names if names.count(c) > 1})
    if dup:
        raise SpecError(f"table {table!r}: {kind} column(s) {dup} listed more than once")
    return names


def _row_positions(rows: np.ndarray | None, n: int, table: str) -> np.ndarray | None:
    """Validated integer row positions (or None for all rows)."""
    if rows is None:
        return None
    arr = np.asarray(rows)
    if arr.dtype == bool:
        if arr.shape != (n,):
            raise ValueError(f"table {table!r}: boolean row mask has shape {arr.shape}, expected ({n},)")
        return np.flatnonzero(arr)
    if arr.size == 0:
        return np.zeros(0, dtype=np.intp)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"table {table!r}: rows must be a 1-D array of integer positions, got dtype {arr.dtype} "
            f"and shape {arr.shape}"
        )
    if arr.min() < 0 or arr.max() >= n:
        raise ValueError(
            f"table {table!r}: row positions must lie in [0, {n}), got min {arr.min()} and max {arr.max()}"
        )
    return arr.astype(np.intp, copy=False)


def unseen_categories(categories: Mapping[str, Sequence[str]], frame: pd.DataFrame) -> dict[str, tuple[int, int, str]]:
    """Per categorical column of ``frame`` (``categories``: the fitted ones, :meth:`TablePreprocessor.stats`),
    the rows whose category the fit never saw, missing values aside: (count, first row, its value). Their
    one-hot block is zero, the block of a category of no training row."""
    out = {}
    for col, cats in categories.items():
        if col not in frame.columns:
            continue
        values = _category_strings(frame[col])
        unseen = (pd.Index(cats, dtype=object).get_indexer(values) < 0) & ~frame[col].isna().to_numpy(dtype=bool)
        if unseen.any():
            first = int(np.flatnonzero(unseen)[0])
            out[col] = (int(unseen.sum()), first, str(values[first]))
    return out


def missing_categories(categories: Mapping[str, Sequence[str]], frame: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Per categorical column of ``frame`` whose training rows had no missing value (no :data:`NA_CATEGORY`
    among ``categories``, the fitted ones), the rows missing it: (count, first row). Their one-hot block is zero,
    as an unseen category's (:func:`unseen_categories`); where training had missing values, missing is a
    category of its own and needs no notice."""
    out = {}
    for col, cats in categories.items():
        if col not in frame.columns or NA_CATEGORY in cats:
            continue
        missing = frame[col].isna().to_numpy(dtype=bool)
        if missing.any():
            out[col] = (int(missing.sum()), int(np.flatnonzero(missing)[0]))
    return out


def _category_strings(series: pd.Series) -> np.ndarray:
    """The values of a categorical column as an object array of str, NaN as :data:`NA_CATEGORY`."""
    missing = series.isna().to_numpy(dtype=bool)
    if pd.api.types.is_float_dtype(series.dtype):
        x = series.to_numpy(dtype=np.float64, na_value=np.nan)
        out = x.astype(str).astype(object)
        integral = ~missing & np.isfinite(x) & (np.abs(x) < _EXACT_INT) & (x == np.round(x))
        out[integral] = x[integral].astype(np.int64).astype(str)
    else:
        out = series.astype(str).to_numpy(dtype=object)
    out[missing] = NA_CATEGORY
    return out
