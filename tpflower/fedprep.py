"""Federated preprocessing of a table that is split by rows over several clients (UCQ; TablePuppet Sec. 4.4).

docs/algorithms.md, Federated preprocessing for UCQ: every shard of a union table must be preprocessed with ONE
global rule, equal to the :class:`~tpflower.preprocess.TablePreprocessor` fitted on the unioned fit rows,
while no shard sends raw rows or raw category strings to the server. Three pure steps (the Flower wiring
only moves the ``.arrays()`` payloads):

1. client: ``summary = local_summary(frame, numeric, categorical, secret, rows=fit_rows, sketch_columns=...)``
   -> :class:`ShardSummary` (send ``summary.arrays()``; the server decodes with
   ``ShardSummary.from_arrays(arrays, numeric, categorical)``);
2. server: ``rule = merge_summaries([summary_1, ..., summary_S])`` -> :class:`GlobalRule`
   (send ``rule.arrays(with_sketch=False)``; for binning also ``quantile_bin_edges(rule, col, n_bins)`` or
   ``uniform_bin_edges(rule, col, n_bins)`` per column, a float64 array each);
3. client: ``pre = apply_rule(rule, frame, secret, table=...)`` -> a fitted TablePreprocessor with the global
   statistics; ``pre.transform(frame)`` as usual. Binning: ``bin_transform(frame, edges)``.

What a shard sends, per numeric column (observed = non-NaN values of its fit rows): the count, the sum and the
sum of squared deviations from the shard mean (``m2``); only for the columns the server asks order statistics
of (``sketch_columns``) also min, max and a :class:`RankSketch` (NaN and an empty sketch otherwise). Per
categorical column: the sorted keyed digests of the categories its fit rows hold (HMAC-SHA256 under the
clients' shared secret, with a per-column sub-key; see :func:`category_digests`) and a count per digest.

The client checks the request first (:func:`check_stats_request`): it must name exactly the table's feature
columns (``columns``), and the sketch columns (``sketch``, default none) must be numeric feature columns.

Exactness (Result must equal the unioned preprocessing):

* mean = sum / count and the population std (ddof 0, as TablePreprocessor) from Chan et al.'s pairwise
  merge ``M2 = sum_s M2_s + sum_s n_s (mean_s - mean)^2``: exact up to float rounding (relative ~1e-15). Raw
  sums of squares are not sent because ``sumsq/n - mean^2`` loses ``log10(mean^2/var)`` digits.
* one-hot: the global index is the sorted union of the digests, so every shard gets the same columns, in
  digest order (a permutation of the sorted-string order of the unioned fit). A category the shard holds in
  any row keeps its raw string as name; a global category it never holds is named ``"#" + 16 hex digits``
  of its digest (its column is all zeros in this shard). Unseen-at-fit categories give all-zero blocks.
* median (imputation) and quantile bin edges come from the merged :class:`RankSketch` (error bound below);
  they are exact whenever every shard holds at most ``sketch_size`` observed values of the column (which
  needs a ``min_sketch_rows`` below the default; see the privacy notes). Without a sketch (no missing fit
  value anywhere) the mean stands in for the median, which then only imputes rows outside the fit rows.

Rank-sketch error bound: a shard with n_s observed values sends its sorted values' block maxima for at most
``sketch_size`` = m contiguous blocks of at most ceil(n_s/m) values, each with its block size as weight. The
merged sketch answers "the k-th smallest value" (1-based, 1 <= k <= n) with an observed value ``x_(r)`` of
the union, where ``k <= r <= k + E`` and ``E = sum_s (largest block of shard s - 1) < n / m`` (stored as
``NumericRule.rank_error``). E = 0 (exact) if every n_s <= m.

Privacy notes: the server learns per shard and numeric column the count, sum and m2, and per categorical
column how many fit rows hold each category digest (it cannot invert a digest without the secret). Raw values
leave a shard only for the sketch columns the server asks for (strategies ask only where a fit value is
missing somewhere or the column is binned: :func:`sketch_columns_needed`): the column's min and max and its
order statistics (up to m values, unlinked across columns and to rows). A shard with fewer than
``min_sketch_rows`` observed values of a sketch column (default :data:`DEFAULT_MIN_SKETCH_ROWS` = 4m, set by
the table owner) refuses to send them (a shard with none sends nothing), so apart from the min every value
sent is the largest of a block of at least ``floor(n_s / m) >= 4`` of its values. A request without the
exact column list, or one naming any other column, is refused. ``rule.arrays(with_sketch=False)`` keeps the
merged order statistics on the server; the merged rule's min/max are NaN for columns without a sketch (only
:func:`uniform_bin_edges` uses them; :func:`apply_rule` and :func:`quantile_bin_edges` do not).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tpflower.mapping import DIGEST_WORDS, key_digests
from tpflower.preprocess import TablePreprocessor, _category_strings, _row_positions
from tpflower.schema import SpecError

DEFAULT_SKETCH_SIZE = 512
"""Default m: at most m (value, weight) pairs per shard and numeric column; rank error < n/m."""

DEFAULT_MIN_SKETCH_ROWS = 4 * DEFAULT_SKETCH_SIZE
"""Default fewest observed values of a column a shard sends order statistics (and min/max) of: with n >= 4m
every value of its sketch is the largest of a block of at least 4 values. The table owner may lower it."""

UNSEEN_PREFIX = "#"
"""Name prefix of a global category a shard never holds: ``"#"`` + the first 16 hex digits of its digest."""

_FORMAT = 1  # version of the .arrays() layout
_CATEGORY_DOMAIN = b"tpflower.fedprep.category\x1f"


# -------------------------------------------------------------------------------------------- rank sketch


@dataclass(frozen=True)
class RankSketch:
    """A mergeable quantile summary: sorted ``values`` (float64) with positive int64 ``weights``.

    Contract: for every t, ``W(t) = sum(weights[values <= t])`` satisfies ``F(t) - error <= W(t) <= F(t)``,
    where F(t) counts the summarized values <= t and ``sum(weights)`` is their number. The values are
    themselves summarized values (order statistics), so a rank query returns an observed value.
    """

    values: np.ndarray
    weights: np.ndarray
    error: int = 0

    @property
    def count(self) -> int:
        return int(self.weights.sum())

    @classmethod
    def empty(cls) -> RankSketch:
        return cls(np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64), 0)

    @classmethod
    def build(cls, x: np.ndarray, size: int) -> RankSketch:
        """Sketch of the finite values ``x``: block maxima of at most ``size`` blocks of the sorted values.

        Block j (1-based) ends at sorted position ceil(j n / size); blocks hold at most ceil(n / size)
        values, so ``error = largest block - 1 <= ceil(n / size) - 1 < n / size`` (0 if n <= size).
        """
        if size < 1:
            raise ValueError(f"sketch size must be >= 1, got {size}")
        x = np.sort(np.asarray(x, dtype=np.float64))
        n = x.size
        if n == 0:
            return cls.empty()
        j = np.arange(1, size + 1, dtype=np.int64)
        ends = np.unique(-((-j * n) // size))  # ceil(j n / size), 1-based block ends, strictly increasing
        weights = np.diff(ends, prepend=0).astype(np.int64)
        return cls(x[ends - 1], weights, int(weights.max()) - 1)

    @classmethod
    def two_values(cls, zeros: int, ones: int, size: int) -> RankSketch:
        """:meth:`build` of ``zeros`` values 0 and ``ones`` values 1 (a one-hot column), from the counts alone."""
        n = zeros + ones
        if n == 0:
            return cls.empty()
        j = np.arange(1, size + 1, dtype=np.int64)
        ends = np.unique(-((-j * n) // size))
        weights = np.diff(ends, prepend=0).astype(np.int64)
        return cls(np.where(ends > zeros, 1.0, 0.0), weights, int(weights.max()) - 1)

    @classmethod
    def merge(cls, sketches: Sequence[RankSketch]) -> RankSketch:
        """Union of sketches: the contract holds with ``error = sum of the errors``."""
        parts = [s for s in sketches if s.values.size]
        if not parts:
            return cls.empty()
        values = np.concatenate([s.values for s in parts])
        weights = np.concatenate([s.weights for s in parts])
        order = np.argsort(values, kind="stable")
        return cls(values[order], weights[order], int(sum(s.error for s in parts)))

    def rank_value(self, k: np.ndarray | int) -> np.ndarray:
        """For 1-based ranks k (1 <= k <= count): the smallest sketch value v with W(v) >= k.

        Guarantee: the result is ``x_(r)``, the r-th smallest summarized value, for some r with
        ``k <= r <= k + error``; ``x_(k)`` exactly when ``error == 0``.
        """
        k = np.asarray(k, dtype=np.int64)
        n = self.count
        if n == 0:
            raise ValueError("rank query on an empty sketch")
        if np.any((k < 1) | (k > n)):
            raise ValueError(f"ranks must lie in [1, {n}], got {k}")
        cum = np.cumsum(self.weights)
        return self.values[np.searchsorted(cum, k, side="left")]


# -------------------------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class NumericSummary:
    """One shard's numeric column over its observed fit-row values: count, sum, m2 = sum (x - mean_s)^2;
    for a sketch column also min, max and a :class:`RankSketch` (else NaN, NaN and an empty sketch; NaN
    too if count is 0)."""

    count: int
    total: float
    m2: float
    min: float
    max: float
    sketch: RankSketch


@dataclass(frozen=True)
class CategoricalSummary:
    """One shard's categorical column: (k, 2) uint64 digests in global (lexicographic) order, int64 counts."""

    digests: np.ndarray
    counts: np.ndarray


@dataclass
class ShardSummary:
    """What one shard sends for federated preprocessing (no raw rows, no raw category strings).

    ``numeric`` / ``categorical`` are keyed (and ordered) by the declared columns; ``n_rows`` is the
    number of fit rows. ``arrays()`` / ``from_arrays()`` give the positional ndarray payload.
    """

    numeric: dict[str, NumericSummary]
    categorical: dict[str, CategoricalSummary]
    n_rows: int
    sketch_size: int = DEFAULT_SKETCH_SIZE

    def arrays(self) -> list[np.ndarray]:
        """Flat payload: header, then per numeric column (stats, sketch values, sketch weights), then per
        categorical column (digests, counts). Only numeric dtypes."""
        out: list[np.ndarray] = [
            np.array([_FORMAT, self.n_rows, len(self.numeric), len(self.categorical), self.sketch_size], dtype=np.int64)
        ]
        for s in self.numeric.values():
            out.append(np.array([s.count, s.total, s.m2, s.min, s.max, s.sketch.error], dtype=np.float64))
            out.extend([s.sketch.values.astype(np.float64), s.sketch.weights.astype(np.int64)])
        for c in self.categorical.values():
            out.extend([c.digests.astype(np.uint64), c.counts.astype(np.int64)])
        return out

    @classmethod
    def from_arrays(
        cls, arrays: Sequence[np.ndarray], numeric: Sequence[str], categorical: Sequence[str]
    ) -> ShardSummary:
        """Inverse of :meth:`arrays`; the column names come from the (shared) table schema."""
        header = _header(arrays, 5, "shard summary")
        n_rows, n_num, n_cat, size = (int(v) for v in header[1:])
        _check_layout(arrays, n_num, n_cat, len(numeric), len(categorical), 3, 2, "shard summary")
        num: dict[str, NumericSummary] = {}
        pos = 1
        for col in numeric:
            st, values, weights = arrays[pos], arrays[pos + 1], arrays[pos + 2]
            pos += 3
            sketch = RankSketch(np.asarray(values, np.float64), np.asarray(weights, np.int64), int(st[5]))
            num[col] = NumericSummary(int(st[0]), float(st[1]), float(st[2]), float(st[3]), float(st[4]), sketch)
        cat: dict[str, CategoricalSummary] = {}
        for col in categorical:
            cat[col] = CategoricalSummary(_digest_array(arrays[pos]), np.asarray(arrays[pos + 1], np.int64))
            pos += 2
        return cls(num, cat, n_rows, size)


def category_digests(strings: np.ndarray, column: str, secret: bytes) -> np.ndarray:
    """(n, 2) uint64 keyed digests of category strings (as :func:`tpflower.preprocess._category_strings`).

    HMAC-SHA256 under the sub-key ``HMAC(secret, domain || column)`` of the :func:`key_digests`
    construction, so digests of different columns (and of join keys) are unlinkable for the server.
    One HMAC per distinct string.
    """
    if not secret:
        raise ValueError("the preprocessing secret is empty; it must be shared by the clients")
    subkey = hmac.digest(secret, _CATEGORY_DOMAIN + str(column).encode("utf-8"), hashlib.sha256)
    frame = pd.DataFrame({"c": pd.Series(np.asarray(strings, dtype=object), dtype=object)})
    if len(frame) == 0:
        return np.zeros((0, DIGEST_WORDS), dtype=np.uint64)
    return key_digests(frame, ["c"], subkey)


def check_stats_request(
    config: Mapping[str, Any],
    numeric: Sequence[str],
    categorical: Sequence[str],
    *,
    table: str = "?",
    shard: int | str | None = None,
) -> tuple[list[str], list[str]]:
    """The client's guard on a ``stats`` request: ``(columns, sketch_columns)`` parsed from the config, or a
    ValueError naming the table, the shard and what is wrong.

    ``config["columns"]`` (comma-separated) must be present and equal the table's feature columns
    ``numeric + categorical`` exactly (same names, same order); ``config["sketch"]`` (optional, default: no
    column) must name numeric feature columns only. Without this check a request could ask for the order
    statistics of every column, or of a column that is not a feature.
    """
    who = _who(table, shard)
    expected = [*numeric, *categorical]
    if config.get("columns") is None:
        raise ValueError(f"{who}: stats without a column list (config 'columns')")
    columns = _column_list(config["columns"])
    unknown = sorted({c for c in columns if c not in expected})
    if unknown:
        raise ValueError(
            f"{who}: stats asks for column(s) {unknown}, which are not feature columns of the table "
            f"(numeric + categorical: {expected})"
        )
    if columns != expected:
        missing = [c for c in expected if c not in columns]
        what = f"lacks {missing}" if missing else "repeats or reorders columns"
        raise ValueError(f"{who}: the stats column list (config 'columns') {what}; it must be exactly {expected}")
    sketch = list(dict.fromkeys(_column_list(config.get("sketch") or "")))
    outside = [c for c in sketch if c not in numeric]
    if outside:
        raise ValueError(
            f"{who}: stats asks for order statistics (config 'sketch') of column(s) {outside}, "
            f"which are not numeric feature columns of the table ({list(numeric)})"
        )
    return columns, sketch


def local_summary(
    frame: pd.DataFrame,
    numeric: Sequence[str],
    categorical: Sequence[str],
    secret: bytes,
    rows: np.ndarray | None = None,
    *,
    sketch_size: int = DEFAULT_SKETCH_SIZE,
    table: str = "?",
    shard: int | str | None = None,
    sketch_columns: Collection[str] = (),
    min_sketch_rows: int | None = None,
) -> ShardSummary:
    """The client side, step 1: summary of ``frame`` restricted to the fit ``rows`` (positions or a boolean
    mask; ``None``: all rows; may be empty). Same column rules and errors as TablePreprocessor.fit.

    Order statistics, min and max only for the numeric ``sketch_columns`` (default: none). A sketch column
    with ``0 < count < min_sketch_rows`` observed values (``None``: :data:`DEFAULT_MIN_SKETCH_ROWS`, read at
    call time) is refused with a ValueError: its order statistics would be (nearly) its raw values.
    """
    pre = TablePreprocessor(numeric, categorical, table=table)
    pre._check_columns(frame)
    wanted = set(sketch_columns)
    outside = sorted(wanted - set(pre.numeric))
    if outside:
        raise ValueError(
            f"{_who(table, shard)}: sketch column(s) {outside} are not numeric columns {list(pre.numeric)}"
        )
    min_rows = DEFAULT_MIN_SKETCH_ROWS if min_sketch_rows is None else int(min_sketch_rows)
    positions = _row_positions(rows, len(frame), pre.table)
    n_fit = len(frame) if positions is None else int(positions.size)
    num: dict[str, NumericSummary] = {}
    for col in pre.numeric:
        x = pre.observed_values(frame, col, positions)
        if x.size == 0:
            num[col] = NumericSummary(0, 0.0, 0.0, np.nan, np.nan, RankSketch.empty())
            continue
        total = float(x.sum())
        m2 = float(np.square(x - total / x.size).sum())
        if col not in wanted:  # raw values (order statistics, extremes) only for the columns the server asks for
            num[col] = NumericSummary(int(x.size), total, m2, np.nan, np.nan, RankSketch.empty())
            continue
        if x.size < min_rows:
            raise ValueError(  # the shard's count last: the server says the shards' refusals in one line
                f"{_who(table, shard)}: column {col!r} has fewer observed fit values than "
                f"min_sketch_rows={min_rows}, so its order statistics (asked for a binned column, or one with "
                f"missing values, filled with the union's median) would be (nearly) raw values: refused. The table "
                f"owner can lower min_sketch_rows to at most the count in parentheses, the smallest where shards "
                f"list theirs (min_sketch_rows=N; a node: its client config), or the dataset can leave {col!r} out "
                f"of the table's binned columns, or keep only the rows that hold it (where: {col} IS NOT NULL) "
                f"({x.size} observed fit values)"
            )
        sketch = RankSketch.build(x, sketch_size)
        num[col] = NumericSummary(int(x.size), total, m2, float(x.min()), float(x.max()), sketch)
    cat: dict[str, CategoricalSummary] = {}
    for col in pre.categorical:
        strings = _category_strings(frame[col])
        if positions is not None:
            strings = strings[positions]
        uniques, counts = np.unique(strings.astype(str), return_counts=True)
        digests = category_digests(uniques, col, secret)
        order = _digest_order(digests)
        cat[col] = CategoricalSummary(digests[order], counts[order].astype(np.int64))
    return ShardSummary(num, cat, n_fit, sketch_size)


# -------------------------------------------------------------------------------------------- global rule


@dataclass(frozen=True)
class NumericRule:
    """Merged statistics of one numeric column over the observed fit values of all shards.

    ``std`` is the raw population std (ddof 0; may be 0); ``median`` is the sketch median (0 if count is
    0), ``rank_error`` the E of the merged sketch (module docstring); min/max are NaN if count is 0 or some
    shard holding observed values did not send them (a column without a sketch).
    """

    count: int
    mean: float
    std: float
    min: float
    max: float
    median: float
    rank_error: int
    sketch: RankSketch


@dataclass
class GlobalRule:
    """The server's merged rule: ``numeric[col]`` and, per categorical column, the global one-hot index
    ``categories[col]`` ((k, 2) uint64 digests, sorted) with the global fit counts ``category_counts[col]``.
    """

    numeric: dict[str, NumericRule]
    categories: dict[str, np.ndarray]
    category_counts: dict[str, np.ndarray] = field(default_factory=dict)
    n_rows: int = 0

    def arrays(self, with_sketch: bool = True) -> list[np.ndarray]:
        """Flat payload: header, per numeric column (stats, sketch values, sketch weights), per categorical
        column (digests, counts). ``with_sketch=False`` sends empty sketches (medians and bounds stay)."""
        out: list[np.ndarray] = [
            np.array([_FORMAT, self.n_rows, len(self.numeric), len(self.categories), int(with_sketch)], dtype=np.int64)
        ]
        for r in self.numeric.values():
            out.append(np.array([r.count, r.mean, r.std, r.min, r.max, r.median, r.rank_error], dtype=np.float64))
            sketch = r.sketch if with_sketch else RankSketch.empty()
            out.extend([sketch.values.astype(np.float64), sketch.weights.astype(np.int64)])
        for col, d in self.categories.items():
            counts = self.category_counts.get(col, np.zeros(len(d), dtype=np.int64))
            out.extend([d.astype(np.uint64), np.asarray(counts, dtype=np.int64)])
        return out

    @classmethod
    def from_arrays(
        cls, arrays: Sequence[np.ndarray], numeric: Sequence[str], categorical: Sequence[str]
    ) -> GlobalRule:
        """Inverse of :meth:`arrays`; the column names come from the (shared) table schema."""
        header = _header(arrays, 5, "global rule")
        n_rows, n_num, n_cat = int(header[1]), int(header[2]), int(header[3])
        _check_layout(arrays, n_num, n_cat, len(numeric), len(categorical), 3, 2, "global rule")
        num: dict[str, NumericRule] = {}
        pos = 1
        for col in numeric:
            st, values, weights = arrays[pos], arrays[pos + 1], arrays[pos + 2]
            pos += 3
            sketch = RankSketch(np.asarray(values, np.float64), np.asarray(weights, np.int64), int(st[6]))
            num[col] = NumericRule(
                int(st[0]), float(st[1]), float(st[2]), float(st[3]), float(st[4]), float(st[5]), int(st[6]), sketch
            )
        cats: dict[str, np.ndarray] = {}
        counts: dict[str, np.ndarray] = {}
        for col in categorical:
            cats[col] = _digest_array(arrays[pos])
            counts[col] = np.asarray(arrays[pos + 1], dtype=np.int64)
            pos += 2
        return cls(num, cats, counts, n_rows)


def sketch_columns_needed(summaries: Sequence[ShardSummary], binned: Collection[str] = ()) -> list[str]:
    """The numeric columns whose order statistics the rule needs: those with a missing fit value in some
    shard (median imputation) and the binned ones. Every other column's sketch is never requested, so its
    values (raw, as order statistics) never leave the shards."""
    first = summaries[0]
    return [col for col in first.numeric if col in binned or any(s.numeric[col].count < s.n_rows for s in summaries)]


def merge_summaries(summaries: Sequence[ShardSummary]) -> GlobalRule:
    """The server side, step 2: merge the summaries of all shards of one table into the global rule.

    Exact: count, mean, population std (Chan's pairwise merge of m2), min, max (NaN unless every shard with
    observed values sent them: sketch columns only), the digest union (sorted
    lexicographically as uint64 pairs) with summed counts. Median from the merged sketch: the mean of the
    rank-floor((n+1)/2) and rank-(floor(n/2)+1) queries (np.median's definition when the sketch is exact),
    each within ``rank_error`` ranks above its target.
    """
    if not summaries:
        raise ValueError("merge_summaries needs at least one shard summary")
    numeric, categorical = list(summaries[0].numeric), list(summaries[0].categorical)
    for s in summaries[1:]:
        if list(s.numeric) != numeric or list(s.categorical) != categorical:
            raise SpecError(
                f"shard summaries disagree on the columns: {list(s.numeric)}/{list(s.categorical)} "
                f"vs {numeric}/{categorical}"
            )
    rules: dict[str, NumericRule] = {}
    for col in numeric:
        parts = [s.numeric[col] for s in summaries if s.numeric[col].count > 0]
        n = sum(p.count for p in parts)
        if n == 0:
            rules[col] = NumericRule(0, 0.0, 0.0, np.nan, np.nan, 0.0, 0, RankSketch.empty())
            continue
        counts = np.array([p.count for p in parts], dtype=np.float64)
        totals = np.array([p.total for p in parts], dtype=np.float64)
        mean = float(totals.sum() / n)
        m2 = float(sum(p.m2 for p in parts) + (counts * np.square(totals / counts - mean)).sum())
        sketch = RankSketch.merge([p.sketch for p in parts])
        if sketch.count == 0:  # no sketch was asked for (no missing fit value anywhere): the mean stands in
            median = mean  # for the median, used only for a missing value outside the fit rows
        elif sketch.count != n:
            raise SpecError(f"column {col!r}: sketch weights sum to {sketch.count}, expected the count {n}")
        else:
            lo, hi = sketch.rank_value(np.array([(n + 1) // 2, n // 2 + 1]))
            median = float(lo) if lo == hi else float((lo + hi) / 2)
        rules[col] = NumericRule(
            n,
            mean,
            float(np.sqrt(max(m2, 0.0) / n)),
            float(np.min([p.min for p in parts])),  # NaN (unknown) unless every shard sent its extremes
            float(np.max([p.max for p in parts])),
            median,
            sketch.error,
            sketch,
        )
    cats: dict[str, np.ndarray] = {}
    cat_counts: dict[str, np.ndarray] = {}
    for col in categorical:
        digests = np.concatenate([s.categorical[col].digests.reshape(-1, DIGEST_WORDS) for s in summaries])
        counts = np.concatenate([s.categorical[col].counts for s in summaries]).astype(np.int64)
        digests = digests.astype(np.uint64, copy=False)
        order = _digest_order(digests)
        digests, counts = digests[order], counts[order]
        new = np.ones(len(digests), dtype=bool)
        new[1:] = np.any(digests[1:] != digests[:-1], axis=1)
        group = np.cumsum(new) - 1
        cats[col] = np.ascontiguousarray(digests[new])
        cat_counts[col] = np.bincount(group, weights=counts, minlength=int(new.sum())).astype(np.int64)
    return GlobalRule(rules, cats, cat_counts, int(sum(s.n_rows for s in summaries)))


# -------------------------------------------------------------------------------------------- apply


def apply_rule(rule: GlobalRule, frame: pd.DataFrame, secret: bytes, table: str = "?") -> TablePreprocessor:
    """The client side, step 3: a fitted TablePreprocessor (columns of ``rule``) holding the global rule.

    medians/means/stds from the rule (a std of 0, or no observed value, becomes 1, as in
    TablePreprocessor.fit); ``categories[col]`` in global digest order, named by the raw string when any row
    of ``frame`` holds the category, else ``"#" + 16 hex digits`` of the digest. Rows whose category is not
    in the global index get an all-zero block.
    """
    numeric, categorical = list(rule.numeric), list(rule.categories)
    checker = TablePreprocessor(numeric, categorical, table=table)
    checker._check_columns(frame)
    categories: dict[str, tuple[str, ...]] = {}
    for col in categorical:
        strings = np.unique(_category_strings(frame[col]).astype(str))
        held = category_digests(strings, col, secret)
        name_of = {d.tobytes(): s for d, s in zip(held, strings)}  # over distinct categories, not rows
        names: list[str] = []
        placeholders: set[str] = set()
        for d in rule.categories[col]:
            name = name_of.get(d.tobytes())
            if name is None:
                name = digest_name(d)
                placeholders.add(name)
            names.append(name)
        clash = placeholders & set(strings.tolist())  # a raw value equal to a digest name would be mis-encoded
        if clash:
            raise SpecError(f"table {table!r}, column {col!r}: value(s) {sorted(clash)} collide with digest names")
        categories[col] = tuple(names)
    return TablePreprocessor.from_stats(
        numeric,
        categorical,
        medians={c: r.median for c, r in rule.numeric.items()},
        means={c: r.mean for c, r in rule.numeric.items()},
        stds={c: (r.std if r.std > 0.0 else 1.0) for c, r in rule.numeric.items()},
        categories=categories,
        table=table,
    )


def name_placeholders(
    categories: Mapping[str, Sequence[str]], frame: pd.DataFrame, secret: bytes
) -> dict[str, tuple[str, ...]]:
    """``categories`` (a shard's fitted ones, :func:`apply_rule`) with each placeholder of a category the shard
    never held (``"#"`` + digest) named by the value of ``frame`` that digests to it: new rows to score hold
    categories only other shards saw in training, which the shard knows by their digests alone. Without a
    secret the names stay."""
    out: dict[str, tuple[str, ...]] = {}
    for col, names in categories.items():
        names = tuple(names)
        if secret and col in frame.columns and any(n.startswith(UNSEEN_PREFIX) for n in names):
            known = set(names)
            fresh = np.array([v for v in np.unique(_category_strings(frame[col]).astype(str)) if v not in known])
            if len(fresh):
                named = {digest_name(d): v for d, v in zip(category_digests(fresh, col, secret), fresh.tolist())}
                names = tuple(named.get(n, n) if n.startswith(UNSEEN_PREFIX) else n for n in names)
        out[col] = names
    return out


def digest_name(digest: np.ndarray) -> str:
    """Name of a category known only by its digest: ``"#"`` + the first 16 hex digits of its 16 bytes."""
    return UNSEEN_PREFIX + np.asarray(digest, dtype="<u8").tobytes().hex()[:16]


# -------------------------------------------------------------------------------------------- binning


def quantile_bin_edges(rule: GlobalRule, column: str, n_bins: int) -> np.ndarray:
    """Interior edges for ``n_bins`` equal-frequency bins of ``column`` from the merged sketch (server side).

    Edge j (1 <= j < n_bins) is the rank query at k_j = ceil(j n / n_bins), i.e. np.quantile(...,
    method="inverted_cdf") at j/n_bins when the sketch is exact; in general it is the union's r-th smallest
    observed value with k_j <= r <= k_j + rank_error. Duplicate edges (ties) are dropped, so fewer bins may
    result. No observed value: no edges (one bin).
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    r = rule.numeric[column]
    if r.count == 0 or n_bins == 1:
        return np.zeros(0, dtype=np.float64)
    if r.sketch.count != r.count:
        raise ValueError(f"column {column!r}: the rule carries no sketch (sent with with_sketch=False)")
    j = np.arange(1, n_bins, dtype=np.int64)
    return np.unique(r.sketch.rank_value(-((-j * r.count) // n_bins)))


def local_quantile_edges(values: np.ndarray, n_bins: int) -> np.ndarray:
    """The same edges as :func:`quantile_bin_edges` computed exactly from one party's observed ``values``:
    np.quantile(..., method="inverted_cdf") at j / n_bins, duplicates dropped (the unsharded case)."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if values.size == 0 or n_bins == 1:
        return np.zeros(0, dtype=np.float64)
    return np.unique(np.quantile(values, np.arange(1, n_bins) / n_bins, method="inverted_cdf"))


def uniform_bin_edges(rule: GlobalRule, column: str, n_bins: int) -> np.ndarray:
    """Interior edges of ``n_bins`` equal-width bins over the exact global [min, max] of ``column``.

    The shards send min and max only with a sketch: a column without them raises a ValueError."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    r = rule.numeric[column]
    if r.count == 0 or n_bins == 1:
        return np.zeros(0, dtype=np.float64)
    if np.isnan(r.min) or np.isnan(r.max):
        raise ValueError(f"column {column!r}: the rule carries no min/max (the shards send them with a sketch only)")
    if r.min == r.max:
        return np.zeros(0, dtype=np.float64)
    return np.linspace(r.min, r.max, n_bins + 1)[1:-1]


def bin_transform(
    frame: pd.DataFrame, edges: Mapping[str, np.ndarray], *, one_hot: bool = True, table: str = "?"
) -> np.ndarray:
    """Bin the numeric columns ``edges`` (in that order) of every row of ``frame``.

    Bin index = number of edges <= x (``np.searchsorted(edges, x, side="right")``), in [0, len(edges)].
    ``one_hot=False``: an int64 (n, columns) matrix, NaN -> -1. ``one_hot=True``: float64 one-hot blocks of
    width len(edges) + 1 per column (names: :func:`bin_feature_names`), NaN -> all-zero block.
    """
    pre = TablePreprocessor(list(edges), [], table=table)
    pre._check_columns(frame)
    n = len(frame)
    blocks = []
    for col, e in edges.items():
        e = np.asarray(e, dtype=np.float64)
        if e.ndim != 1 or np.any(np.diff(e) <= 0) or not np.all(np.isfinite(e)):
            raise ValueError(f"column {col!r}: bin edges must be finite and strictly increasing")
        x = pre._numeric_values(frame, col)
        idx = np.where(np.isnan(x), -1, np.searchsorted(e, x, side="right")).astype(np.int64)
        if not one_hot:
            blocks.append(idx[:, None])
            continue
        block = np.zeros((n, e.size + 1), dtype=np.float64)
        seen = idx >= 0
        block[np.flatnonzero(seen), idx[seen]] = 1.0
        blocks.append(block)
    if not blocks:
        return np.zeros((n, 0), dtype=np.float64 if one_hot else np.int64)
    return np.ascontiguousarray(np.concatenate(blocks, axis=1))


def bin_feature_names(edges: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the one-hot bin columns: ``"col#bin0"`` ... ``"col#bin{len(edges)}"`` per column."""
    return [f"{col}#bin{j}" for col, e in edges.items() for j in range(len(e) + 1)]


# -------------------------------------------------------------------------------------------- helpers


def _who(table: str, shard: int | str | None) -> str:
    return f"table {table!r}" if shard is None else f"table {table!r} shard {shard}"


def _column_list(value: Any) -> list[str]:
    """A comma-separated column list (config value) as names; empty entries dropped."""
    return [c for c in (p.strip() for p in str(value).split(",")) if c]


def _digest_order(digests: np.ndarray) -> np.ndarray:
    """Permutation sorting (k, 2) uint64 digests lexicographically (word 0, then word 1)."""
    digests = np.asarray(digests).reshape(-1, DIGEST_WORDS)
    return np.lexsort((digests[:, 1], digests[:, 0]))


def _digest_array(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.uint64:
        raise SpecError(f"category digests must be uint64, got {a.dtype}")
    return np.ascontiguousarray(a.reshape(-1, DIGEST_WORDS))


def _header(arrays: Sequence[np.ndarray], length: int, what: str) -> np.ndarray:
    if not arrays:
        raise SpecError(f"empty {what} payload")
    header = np.asarray(arrays[0])
    if header.shape != (length,) or not np.issubdtype(header.dtype, np.integer) or int(header[0]) != _FORMAT:
        raise SpecError(f"{what} payload has an unknown header {header!r}")
    return header


def _check_layout(
    arrays: Sequence[np.ndarray],
    n_num: int,
    n_cat: int,
    want_num: int,
    want_cat: int,
    per_num: int,
    per_cat: int,
    what: str,
) -> None:
    if (n_num, n_cat) != (want_num, want_cat):
        raise SpecError(
            f"{what} payload has {n_num} numeric and {n_cat} categorical columns, expected {want_num} and {want_cat}"
        )
    expected = 1 + per_num * n_num + per_cat * n_cat
    if len(arrays) != expected:
        raise SpecError(f"{what} payload has {len(arrays)} arrays, expected {expected}")
