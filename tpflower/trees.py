"""Second-order histogram gradient boosting (XGBoost, Chen & Guestrin 2016, Eq. 6-7; LightGBM's histograms,
subtraction and best-first growth): the math the federated family (strategies/gbdt.py, tpflower/phases/gbdt.py)
and the central reference (strategies/centralized.py, ``algorithm.solver=gbdt``) share, so the two cannot drift
(docs/algorithms.md, Boosted trees over the join).

* Binning (:func:`bin_edges`, :func:`bin_codes`): weighted quantiles of one column, the weight of a table row
  being G_iu (how often it occurs in the training join), so the owner's edges equal the central edges of the
  joined column (the weights are aggregated per distinct value either way); missing values in a bin of their
  own (:func:`column_edges`), sent to either side by the split search (Chen & Guestrin Alg. 3).
* Split finding (:func:`histograms`, :func:`best_splits`): per node, the per-bin sums of g, h and the row count,
  and the best (gain, feature, bin) with the tie rule smallest feature, then smallest bin.
* Growth (:func:`grow_forest`): best-first growth of the d_c trees of one boosting round over the server's
  joined rows, given ``evaluate`` (nodes -> each node's best candidate over the tables, the tie rule smallest
  table name). The federated server evaluates a step's nodes in one round trip; the central reference on the
  materialized join. Everything else (which leaves split, partitions, leaf values) is this one code.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

MAX_BINS = 256  # at most this many bins of values per feature (a bin of missing values besides)


def bin_edges(values: np.ndarray, weights: np.ndarray, max_bins: int) -> np.ndarray:
    """At most ``max_bins`` - 1 ascending edges of one column: bin b holds (edges[b-1], edges[b]].

    The distinct values of the rows with weight > 0 and their summed weights decide (so a table row of weight
    G_iu and G_iu joined copies of it give the same edges, bit for bit). With at most ``max_bins`` distinct
    values each has its own bin. Else, as LightGBM's binning, a value holding at least 1/max_bins of the
    weight gets a bin of its own and the other values share the remaining bins by equal weight (quantiles of
    their weight alone: a few heavy values do not leave the tail with a handful of bins). Edges sit halfway
    between consecutive distinct values."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    live = (weights > 0) & ~np.isnan(values)  # a missing value has a bin of its own (column_edges)
    v, inv = np.unique(values[live], return_inverse=True)
    if len(v) <= 1:
        return np.zeros(0)
    if len(v) <= max_bins:
        return (v[:-1] + v[1:]) / 2
    w = np.bincount(inv.reshape(-1), weights=weights[live], minlength=len(v))
    big = np.flatnonzero(w >= w.sum() / max_bins)
    light = np.cumsum(np.where(w >= w.sum() / max_bins, 0.0, w))
    budget = max(max_bins - 1 - 2 * len(big), 1)  # edges left for the light values
    for _ in range(8):  # quantiles that fall on one value merge: ask for finer ones until the edges are used
        cuts = np.searchsorted(light, light[-1] * np.arange(1, budget + 1) / (budget + 1), side="left")
        k = np.unique(np.concatenate([cuts, big - 1, big]))  # k: an edge between v[k] and v[k + 1]
        k = k[(k >= 0) & (k < len(v) - 1)]
        if len(k) >= max_bins - 1:
            break
        budget += max_bins - 1 - len(k)
    if len(k) > max_bins - 1:
        k = k[np.unique(np.linspace(0, len(k) - 1, max_bins - 1).round().astype(np.int64))]
    return (v[k] + v[k + 1]) / 2


def column_edges(
    X: np.ndarray, weights: np.ndarray, max_bins: int, missing: np.ndarray | None = None
) -> list[np.ndarray]:
    """:func:`bin_edges` of every column of ``X`` (rows weighted by ``weights``); a column with a missing
    value (NaN) on a row of weight > 0 (``missing``: these columns instead) ends its edges with NaN: one more
    bin, the last, holds its missing values (XGBoost's sparsity-aware split finding, Chen & Guestrin Alg. 3:
    :func:`best_splits` sends them to either side). A 0/1 column (a one-hot column) has the edge 0.5 where
    both values occur on rows of weight > 0, else none, as :func:`bin_edges` gives it; those are found for
    all such columns at once."""
    weighted = np.asarray(weights) > 0
    binary = binary_columns(X)
    ones = column_sums(X, weighted)  # per 0/1 column, its rows of weight > 0 at 1
    n_live = int(np.count_nonzero(weighted))
    edges: list[np.ndarray] = [np.array([0.5]) if 0 < c < n_live else np.zeros(0) for c in ones]
    nan = np.zeros(X.shape[1], dtype=bool)
    other = np.flatnonzero(~binary)
    for f, x in zip(other, columns(X, other)):
        edges[f] = bin_edges(x, weights, max_bins)
        nan[f] = bool((np.isnan(x) & weighted).any())
    missing = nan if missing is None else missing
    return [np.append(e, np.nan) if missing[f] else e for f, e in enumerate(edges)]


def row_blocks(X: np.ndarray, cells: int = 1 << 22) -> Iterator[slice]:
    """Consecutive slices of ``X``'s rows of about ``cells`` values each (a wide ``X`` read a block at a time,
    its temporaries a few MB)."""
    step = max(1, cells // max(X.shape[1], 1))
    return (slice(r, r + step) for r in range(0, X.shape[0], step))


def column_sums(X: np.ndarray, w: np.ndarray) -> np.ndarray:
    """w @ X in float64, a block of rows at a time (no float64 copy of a wide ``X``)."""
    out = np.zeros(X.shape[1])
    for rows in row_blocks(X):
        out += np.asarray(w[rows], dtype=np.float64) @ X[rows]
    return out


def binary_columns(X: np.ndarray) -> np.ndarray:
    """Which columns of ``X`` hold only the values 0 and 1 (a one-hot column; no missing value)."""
    out = np.ones(X.shape[1], dtype=bool)
    for rows in row_blocks(X):
        block = X[rows]
        out &= ((block == 0) | (block == 1)).all(axis=0)
    return out


def columns(X: np.ndarray, which: np.ndarray, cells: int = 1 << 22) -> Iterator[np.ndarray]:
    """The columns ``which`` of ``X`` (rows x columns), each as a contiguous float64 array, copied a block of
    columns (about ``cells`` values) at a time: a wide row-major ``X`` is not walked once per column."""
    step = max(1, cells // max(X.shape[0], 1))
    for first in range(0, len(which), step):
        yield from np.array(X[:, which[first : first + step]].T, dtype=np.float64, order="C")


@dataclass(frozen=True)
class BinLayout:
    """The features' bins side by side in one flat histogram: feature f's bins are offsets[f] ..
    offsets[f + 1] - 1 (len(edges[f]) + 1 bins each), so a node's histogram is one vector per statistic."""

    offsets: np.ndarray
    missing: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # features with a missing bin

    @classmethod
    def of(cls, edges: Sequence[np.ndarray]) -> BinLayout:
        """The layout of features binned on ``edges`` (a trailing NaN edge: the feature's last bin holds its
        missing values, :func:`column_edges`)."""
        offsets = np.concatenate([[0], np.cumsum([len(e) + 1 for e in edges])]).astype(np.int64)
        missing = np.array([f for f, e in enumerate(edges) if len(e) and np.isnan(e[-1])], dtype=np.int64)
        return cls(offsets, missing)

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    @cached_property
    def scan(self) -> SplitScan:
        """The bins :func:`best_splits` scans (:class:`SplitScan`)."""
        return SplitScan.of(self)

    @cached_property
    def _parts(self) -> dict[bytes, tuple[BinLayout, np.ndarray]]:
        return {}

    def part(self, features: np.ndarray) -> tuple[BinLayout, np.ndarray]:
        """The layout of the features ``features`` alone (ascending) and their flat bins in this layout, so that
        ``hists[..., bins]`` is their histogram in it (kept per set of features)."""
        key = np.asarray(features, dtype=np.int64).tobytes()
        if key not in self._parts:
            sizes = np.diff(self.offsets)[features]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            bins = np.repeat(self.offsets[features] - offsets[:-1], sizes) + np.arange(offsets[-1])
            missing = np.flatnonzero(np.isin(features, self.missing)).astype(np.int64)
            self._parts[key] = (BinLayout(offsets, missing), bins)
        return self._parts[key]


def bin_codes(
    X: np.ndarray, edges: Sequence[np.ndarray], filled: np.ndarray | None = None, empty: np.ndarray | None = None
) -> np.ndarray:
    """The flat bin (:class:`BinLayout`) of every value, feature-major: codes[f, u] = offsets[f] + b where
    X[u, f] lies in bin b of feature f, i.e. X[u, f] <= edges[f][b'] iff b <= b'. A missing value of a
    feature with a missing bin (its edges end with NaN) takes that bin; of one without (no training row
    missed it): the bin of ``filled[u, f]`` (the value preprocessing fills in, the median, as a linear model
    sees it), or with ``filled`` None the last bin, right of every split. ``empty``: the features whose missing
    bin no training row is in (a union's shards give every numeric column one): their missing values too take
    the filled value's bin."""
    layout = BinLayout.of(edges)
    codes = np.empty((len(edges), X.shape[0]), dtype=np.uint16 if layout.total < 2**16 else np.int32)
    first = layout.offsets[:-1]
    # columns of at most one edge and no missing bin (a one-hot block's): bin 1 where not x <= edge (a NaN too,
    # as searchsorted puts it), all at once
    split = np.array([len(e) == 1 and not np.isnan(e[0]) for e in edges], dtype=bool)
    simple = split | np.array([len(e) == 0 for e in edges], dtype=bool)
    edge = np.array([e[0] if len(e) else 0.0 for e in edges], dtype=np.float64)
    which = np.flatnonzero(simple)
    for run in np.split(which, np.flatnonzero(np.diff(which) != 1) + 1) if len(which) else []:
        cols = slice(run[0], run[-1] + 1)  # a run of consecutive columns, a block of rows at a time
        base, at, cut = first[cols, None].astype(codes.dtype), split[cols, None], edge[cols, None]
        for rows in row_blocks(X):
            np.add(base, ~np.less_equal(X[rows, cols].T, cut) & at, out=codes[cols, rows], casting="unsafe")
    other = np.flatnonzero(~simple)
    for f, x in zip(other, columns(X, other)):
        e = edges[f]
        with_bin = bool(len(e) and np.isnan(e[-1]))
        if filled is not None and (not with_bin or (empty is not None and empty[f])) and np.isnan(x).any():
            x = np.where(np.isnan(x), filled[:, f], x)  # no training row missed it: the filled value's bin
        if with_bin:  # the last bin: the missing values
            codes[f] = np.where(np.isnan(x), len(e), np.searchsorted(e[:-1], x, side="left")) + first[f]
        else:
            codes[f] = np.searchsorted(e, x, side="left") + first[f]
    return codes


@dataclass(frozen=True)
class Bundles:
    """Exclusive feature bundling (LightGBM: Ke et al., NeurIPS 2017, Sec. 4), exact: a feature whose rows are
    mostly in one bin (its default bin: a one-hot column's 0) is sparse; sparse features that are never off
    their default bins in the same row share one code per row (a one-hot block becomes one column), so a
    histogram pass costs one bincount per bundle instead of one per feature. A bundle's code is 0 where all its
    features are at their defaults, else 1 + the index of the one off-default (feature, bin) in ``to_flat``. A
    sparse feature's default bin is filled in as the node's totals minus its other bins."""

    offsets: np.ndarray  # the layout's (BinLayout.offsets)
    dense: np.ndarray  # features histogrammed one by one
    sparse: np.ndarray  # features in bundles
    default: np.ndarray  # the flat default bin of each sparse feature
    codes: np.ndarray  # (bundles, rows)
    to_flat: tuple[np.ndarray, ...]  # per bundle: the flat bin of each code >= 1
    # per dense feature its rows' bins within the feature (0 .. bins - 1; uint8 where 256 bins or fewer): a
    # histogram pass gathers one byte per row and counts into a node's bins of that feature alone
    local: tuple[np.ndarray, ...] = ()
    width: int = 1  # the most bins of a dense feature

    @classmethod
    def of(cls, codes: np.ndarray, layout: BinLayout, max_share: float = 0.2) -> Bundles:
        """Bundles of the features whose rows are off their most frequent bin in at most ``max_share`` of the
        rows, greedily (most off-default rows first; a bundle at most 2^16 - 1 codes)."""
        off, n = layout.offsets, codes.shape[1]
        dense, sparse = [], []  # sparse: (off-default rows, feature, its flat default bin)
        for f in range(codes.shape[0]):
            counts = np.bincount(codes[f] - off[f], minlength=int(off[f + 1] - off[f]))
            d = int(np.argmax(counts))
            if n - counts[d] <= max_share * n:  # (a feature of one bin: no row off it, no pass at all)
                sparse.append((n - int(counts[d]), f, int(off[f]) + d))
            else:
                dense.append(f)
        sparse.sort(key=lambda x: (-x[0], x[1]))
        members: list[list[int]] = []  # positions in ``sparse``
        occupied: list[np.ndarray] = []  # a bundle's rows off their default bin
        width: list[int] = []  # a bundle's codes
        off_rows: list[np.ndarray] = []  # per sparse feature, its rows off its default bin (few: a sparse feature)
        for i, (_, f, d) in enumerate(sparse):
            rows, bins = np.flatnonzero(codes[f] != d).astype(np.int32), int(off[f + 1] - off[f]) - 1
            j = next(
                (j for j in range(len(members)) if width[j] + bins < 2**16 and not occupied[j][rows].any()),
                len(members),
            )
            if j == len(members):
                members.append([])
                occupied.append(np.zeros(n, dtype=bool))
                width.append(1)
            members[j].append(i)
            occupied[j][rows] = True
            width[j] += bins
            off_rows.append(rows)
        lut = np.zeros(layout.total, dtype=np.int64)  # flat bin -> its code in its feature's bundle
        bundle_codes = np.zeros((len(members), n), dtype=np.uint16)
        to_flat = []
        for j, group in enumerate(members):
            to_flat.append(
                np.concatenate(
                    [np.setdiff1d(np.arange(off[sparse[i][1]], off[sparse[i][1] + 1]), sparse[i][2]) for i in group]
                )
            )
            lut[to_flat[-1]] = np.arange(1, len(to_flat[-1]) + 1)
            for i in group:
                rows = off_rows[i]
                bundle_codes[j, rows] = lut[codes[sparse[i][1], rows]]
        bins = np.diff(off)
        return cls(
            off,
            np.array(dense, dtype=np.int64),
            np.array([f for _, f, _ in sparse], dtype=np.int64),
            np.array([d for _, _, d in sparse], dtype=np.int64),
            bundle_codes,
            tuple(to_flat),
            tuple((codes[f] - off[f]).astype(np.uint8 if bins[f] <= 256 else np.uint16) for f in dense),
            int(max((bins[f] for f in dense), default=1)),
        )


def weighted_counts(b: np.ndarray, n: int, w: np.ndarray) -> np.ndarray:
    """np.bincount(b, weights=w, minlength=n) of int64 ``b`` and float64 ``w``, the same sums in the same order
    (each bin adds its values in turn), by torch's scatter_add, about twice as fast (one pass, no pass for the
    range of ``b``): on a vector, it adds the values one after the other on the calling thread (the zeros are
    numpy's: torch fills a large tensor on its worker threads). ``b`` and ``w`` writable (torch warns of a
    read-only array)."""
    out = np.zeros(n)
    torch.from_numpy(out).scatter_add_(0, torch.from_numpy(b), torch.from_numpy(w))
    return out


def _bincounts(
    b: np.ndarray, n: int, G: np.ndarray, H: np.ndarray | None, C: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The sums of G, H (None: not asked) and C (ones: one each) per value of ``b`` (0..n-1)."""
    return (
        weighted_counts(b, n, G),
        None if H is None else weighted_counts(b, n, H),
        weighted_counts(b, n, C),
    )


def histograms(
    codes: np.ndarray,
    rows: np.ndarray,
    G: np.ndarray,
    H: np.ndarray | None,
    C: np.ndarray | None,
    total: int,
    slot: np.ndarray | None = None,
    k: int = 1,
    bundles: Bundles | None = None,
) -> np.ndarray:
    """hist[n, s, b] for the statistics s = (sum g, sum h, rows) of the rows ``rows`` (their per-row sums G,
    H and counts C) of node n (``slot``: each row's node, 0..k-1; None: all of node 0) falling in flat bin b
    (:func:`bin_codes`): shape (k, 3, total). ``C`` None: one joined row each; ``H`` None: h = 1 (squared
    error), so the sums of h are the counts. One bincount per feature (per bundle, :class:`Bundles`) and
    statistic over every node at once (each node's bins offset); each bin sums its rows in their given order."""
    node = np.zeros(len(rows), dtype=np.int64) if slot is None else slot.astype(np.int64)
    # the sums add in float64: converted once, not per feature; writable (a message's arrays are read-only
    # views, which torch warns about: weighted_counts)
    G, H, C = (None if x is None else np.asarray(x, dtype=np.float64) for x in (G, H, C))
    G, H, C = (x if x is None or x.flags.writeable else x.copy() for x in (G, H, C))
    if C is None:
        C = np.ones(len(rows))
    out = np.zeros((3, k, total))
    flat = out.reshape(3, k * total)
    if bundles is None:
        base = node * total  # node n's bins start at n * total
        for f in range(codes.shape[0]):
            for s, x in enumerate(_bincounts(codes[f].take(rows) + base, k * total, G, H, C)):
                if x is not None:
                    flat[s] += x
    else:  # a dense feature's bins alone: node n's at n * width (a pass costs k * width, not k * total)
        width = bundles.width
        base = node * width
        for f, local in zip(bundles.dense, bundles.local):
            lo, hi = bundles.offsets[f], bundles.offsets[f + 1]
            for s, x in enumerate(_bincounts(local.take(rows) + base, k * width, G, H, C)):
                if x is not None:
                    out[s][:, lo:hi] = x.reshape(k, width)[:, : hi - lo]
    if bundles is not None and len(bundles.sparse):
        for codes_j, to_flat in zip(bundles.codes, bundles.to_flat):
            size = len(to_flat) + 1
            for s, x in enumerate(_bincounts(codes_j.take(rows) + node * size, k * size, G, H, C)):
                if x is not None:
                    out[s][:, to_flat] = x.reshape(k, size)[:, 1:]
        # a sparse feature's default bin: the node's totals minus the feature's other bins
        per_feature = np.add.reduceat(out, bundles.offsets[:-1], axis=2)
        for s, x in enumerate(_bincounts(node, k, G, H, C)):
            if x is not None:
                out[s][:, bundles.default] = x[:, None] - per_feature[s][:, bundles.sparse]
    if H is None:
        out[1] = out[2]
    return out.transpose(1, 0, 2)


def sparse_histograms(hist: np.ndarray) -> dict[str, np.ndarray]:
    """Histograms (k, 3, total) as their non-empty bins, the form a union's histograms travel in both ways
    (docs/algorithms.md, Union): ``mask``, one bit per bin (node-major, np.packbits: ceil(k * total / 8)
    bytes), set where any of the bin's three sums is not +0.0; ``hist``, those bins' sums of g and h in bin
    order, (bits set, 2), or of g only, (bits set, 1), where every sum of h is its count's (squared error: h =
    1); ``count``, their rows, whole numbers in the narrowest unsigned dtype (float64 if one is not). Every
    other bin holds +0.0 in each sum, so :func:`dense_histograms` gives back the same float64 array bit for bit
    (a bin of no rows may hold a rounding residue, a one-hot column's default bin: it is sent). A bit per bin
    is smaller than a 16-bit index per non-empty bin once a sixteenth of the bins are non-empty: 20%
    (synthetic) to 56% (a 3,000-value categorical column) were, measured."""
    hist = np.asarray(hist, dtype=np.float64)
    bits = hist.view(np.uint64)  # a float's bits: -0.0 is sent, as it is not +0.0
    at = np.flatnonzero(bits[:, 0] | bits[:, 1] | bits[:, 2])  # node n, bin b at n * total + b
    G, H, C = (hist[:, s].reshape(-1).take(at) for s in range(3))
    count = C
    if len(C) and np.isfinite(C).all() and C.min() >= 0 and C.max() < 2**53:
        whole = C.astype(np.uint64)
        if (whole.astype(np.float64).view(np.uint64) == C.view(np.uint64)).all():  # bit for bit
            count = whole.astype(np.min_scalar_type(int(whole.max())))
    mask = np.zeros(hist.shape[0] * hist.shape[2], dtype=bool)
    mask[at] = True
    same = (H.view(np.uint64) == C.view(np.uint64)).all()
    return {"mask": np.packbits(mask), "hist": np.stack([G] if same else [G, H], axis=1), "count": count}


def sparse_problem(mask: np.ndarray, values: np.ndarray, count: np.ndarray, k: int, total: int) -> str:
    """What is wrong with a sparse form of (k, 3, total) histograms (:func:`sparse_histograms`; empty: nothing)."""
    if mask.dtype != np.uint8 or mask.shape != ((k * total + 7) // 8,):
        return "mask is not one bit per bin, packed"
    bits = np.unpackbits(mask)
    if bits[k * total :].any():
        return "mask sets a bit past the last bin"
    m = int(bits.sum())
    if values.ndim != 2 or values.shape not in ((m, 1), (m, 2)) or (values.size and values.dtype.kind != "f"):
        return "hist is not the g (and h) sums of each bin the mask sets"
    if count.shape != (m,) or (count.size and (count.dtype.kind not in "iuf" or count.min() < 0)):
        return "count is not one non-negative count per bin the mask sets"
    if not np.isfinite(values).all() or not np.isfinite(count).all():
        return "hist or count holds a value that is not finite"
    return ""


def dense_histograms(mask: np.ndarray, values: np.ndarray, count: np.ndarray, k: int, total: int) -> np.ndarray:
    """The histograms (k, 3, total) of a sparse form (:func:`sparse_histograms`, checked by
    :func:`sparse_problem`): its bins' sums (h: the counts where only g came), +0.0 elsewhere."""
    out = np.zeros(k * 3 * total)
    at = np.flatnonzero(np.unpackbits(mask, count=k * total))  # node n, bin b at n * total + b
    at += at // max(total, 1) * (2 * total)  # its g sum's place in (k, 3, total): n * 3 * total + b
    rows = count.astype(np.float64)
    for s, x in enumerate((values[:, 0], values[:, 1] if values.shape[1] > 1 else rows, rows)):
        out[at + s * total] = x
    return out.reshape(k, 3, total)


def subtraction_plan(
    parents: Sequence[int], joined: Sequence[int], ids: Sequence[int], kept: Container[int]
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Histogram subtraction (LightGBM) over one step's nodes (their parents' ids, joined rows and own ids, in
    message order): of two children of a parent whose sums are ``kept``, the one with fewer joined rows (ties:
    the smaller id) is built from its rows and the other is the parent's minus it. Returns the positions built
    from rows (ascending) and, per derived node, (its position, its parent's id, its sibling's position). The
    server's per-table-row sums and the owners' histograms follow this one plan."""
    by_parent: dict[int, list[int]] = {}
    for i, q in enumerate(parents):
        by_parent.setdefault(q, []).append(i)
    direct, derived = [], []
    for q, kids in by_parent.items():
        if q >= 0 and len(kids) == 2 and q in kept:
            small, large = sorted(kids, key=lambda i: (joined[i], ids[i]))
            direct.append(small)
            derived.append((large, q, small))
        else:
            direct.extend(kids)
    return sorted(direct), derived


@dataclass(frozen=True)
class SplitRule:
    """What makes a split valid and how good it is (XGBoost Eq. 6-7; LightGBM's min_data_in_leaf and
    min_sum_hessian_in_leaf)."""

    lambda_l2: float = 1.0
    min_child_weight: float = 1e-3  # sum of h on each side
    min_child_rows: int = 20  # joined training rows on each side
    min_gain: float = 0.0  # a split must gain more than this


TIE = 1e-12
"""Gains within this relative distance of the best are a tie: the same split computed from per-row sums or from
joined rows differs in the last bits, and two features that split a node's rows alike have equal gains."""


def first_best(gains: np.ndarray) -> int:
    """The first index whose gain ties with the largest (within :data:`TIE`): the fixed tie rule (table name,
    feature, bin) when the candidates come in that order."""
    top = float(np.max(gains))
    return int(np.argmax(gains >= top - TIE * abs(top))) if np.isfinite(top) else int(np.argmax(gains))


def tied_with_best(gains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``gains`` (k, m): which entries tie with the row's best (within :data:`TIE`), and whether the
    row has a finite gain (a row without one: every entry ties)."""
    top = gains.max(axis=1, initial=-np.inf)
    found = np.isfinite(top)
    return gains >= (top - TIE * np.abs(np.where(found, top, 0.0)))[:, None], found


def first_best_rows(gains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`first_best` of each row of ``gains`` (k, m) at once: (its index, whether the row has a finite
    gain); a row without one gets index 0."""
    tied, found = tied_with_best(gains)
    return np.argmax(tied, axis=1), found


def score(G: np.ndarray, H: np.ndarray, lam: float) -> np.ndarray:
    """G^2 / (H + lambda); 0 where H + lambda is 0 (a side of no rows, lambda 0: masked by the caller)."""
    den = H + lam
    return np.divide(G * G, den, out=np.zeros(np.broadcast_shapes(np.shape(G), np.shape(den))), where=den > 0)


_SCAN_ROWS = 32767  # elements per torch scan call: below torch's grain size, so one thread runs it


def running_sums(x: np.ndarray) -> np.ndarray:
    """np.cumsum(x, axis=-1) of a float64 array, the same sums in the same order, by torch's scan (about 3x
    faster than numpy's), in calls small enough to run on the calling thread (no worker threads woken)."""
    if not x.size:
        return np.zeros(x.shape)
    flat = np.ascontiguousarray(x, dtype=np.float64).reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    step = max(1, _SCAN_ROWS // max(flat.shape[1], 1))
    for a in range(0, len(flat), step):
        torch.cumsum(torch.from_numpy(flat[a : a + step]), dim=1, out=torch.from_numpy(out[a : a + step]))
    return out.reshape(x.shape)


@dataclass(frozen=True)
class SplitScan:
    """The bins :func:`best_splits` scans: the layout's own (a feature's missing bin last: missing values go
    right), then, for each feature with a missing bin, its bins again with the missing bin first (missing
    values go left), as XGBoost's sparsity-aware split finding tries both default directions (Chen & Guestrin
    Alg. 3). ``order``: the layout's flat bins in scan order (None: the layout's own), ``offsets`` and each
    scanned bin's feature's first bin, ``no_split``: the scanned bins that split nothing off (a feature's last;
    a second view's first, missing values alone left: the first view's "every value left")."""

    order: np.ndarray | None
    offsets: np.ndarray
    first_bins: np.ndarray
    no_split: np.ndarray
    n_features: int
    missing: np.ndarray

    @classmethod
    def of(cls, layout: BinLayout) -> SplitScan:
        off = layout.offsets
        views = [np.r_[off[f + 1] - 1, off[f] : off[f + 1] - 1] for f in layout.missing]
        offsets = np.concatenate([off, off[-1] + np.cumsum([len(v) for v in views], dtype=np.int64)])
        no_split = np.concatenate([offsets[1:] - 1, offsets[len(off) - 1 : -1]])
        order = np.concatenate([np.arange(off[-1]), *views]) if views else None
        first_bins = np.repeat(offsets[:-1], np.diff(offsets))
        return cls(order, offsets, first_bins, no_split, len(off) - 1, layout.missing)


_SCAN_CELLS = 1 << 16
""":func:`best_splits` scans this many (node, bin) pairs at a time: a block's temporaries (a few per statistic)
stay in the CPU's cache, where a many-node step's (a multiclass round's: a tree per class) would not."""


def best_splits(
    hists: np.ndarray, layout: BinLayout, rule: SplitRule, bins: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(gain, feature, bin, missing_left) of the best split "bin <= b goes left" of each node from its flat
    histogram (hists: (k, 3, total); ``bins``: the flat bins of ``hists`` that are ``layout``'s, in its order,
    None: all of them): gain = 1/2 [G_L^2/(H_L+l) + G_R^2/(H_R+l) - G^2/(H+l)] (Chen & Guestrin Eq. 7). A
    feature with a missing bin (its last) splits with its missing values right, or left (``missing_left``:
    value bins up to b and the missing ones left; :class:`SplitScan`). Ties (:func:`first_best`) go to missing
    right, the smallest feature, then the smallest bin. A node without a valid split gets (-inf, -1, -1,
    False). Each side's score is :func:`score`'s, bit for bit (computed in place). Nodes are scanned a block of
    :data:`_SCAN_CELLS` bins at a time (each node's result is its own: the same, bit for bit)."""
    scan = layout.scan
    k = hists.shape[0]
    if not scan.n_features:  # a table with no feature column (only keys or the label): no split
        return np.full(k, -np.inf), np.full(k, -1), np.full(k, -1), np.zeros(k, dtype=bool)
    order = scan.order if bins is None else bins if scan.order is None else bins[scan.order]
    off = scan.offsets
    gains, j, found = np.full(k, -np.inf), np.zeros(k, dtype=np.int64), np.zeros(k, dtype=bool)
    step = max(1, _SCAN_CELLS // int(off[-1]))
    for a in range(0, k, step):
        block = hists[a : a + step] if order is None else hists[a : a + step].take(order, axis=2)
        gains[a : a + step], j[a : a + step], found[a : a + step] = _scan(block, scan, rule)
    features = np.searchsorted(off, j, side="right") - 1
    bins_at = j - off[features]
    missing_left = found & (features >= scan.n_features)
    if missing_left.any():  # a second view's bin c: the missing values and value bins 0..c-1 left
        view = np.maximum(features - scan.n_features, 0)
        features = np.where(missing_left, scan.missing[np.minimum(view, len(scan.missing) - 1)], features)
        bins_at = np.where(missing_left, bins_at - 1, bins_at)
    return gains, np.where(found, features, -1), np.where(found, bins_at, -1), missing_left


def _scan(hists: np.ndarray, scan: SplitScan, rule: SplitRule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`best_splits` of a block of nodes (hists: (k, 3, scanned bins), in scan order): per node its best
    gain, its scanned bin and whether it has one."""
    k, off = hists.shape[0], scan.offsets
    left = running_sums(hists)
    total = left[:, :, off[1] - 1].copy()  # (k, 3): every feature's bins add up to the node
    before = np.concatenate([np.zeros((k, 3, 1)), left], axis=2).take(scan.first_bins, axis=2)
    left -= before  # the left side of "bin <= b" within its feature: its bins up to b
    right = total[:, :, None] - left
    lam, min_weight, min_rows = rule.lambda_l2, rule.min_child_weight, rule.min_child_rows
    ok = hists[:, 2] > 0  # a bin of no rows splits as the bin before it: only the first of the two counts
    ok &= left[:, 2] >= min_rows
    ok &= right[:, 2] >= min_rows
    ok &= left[:, 1] >= min_weight
    ok &= right[:, 1] >= min_weight
    ok[:, scan.no_split] = False
    with np.errstate(divide="ignore", invalid="ignore"):  # where H + lambda <= 0: fixed below or masked
        den_left, den_right = left[:, 1] + lam, right[:, 1] + lam
        gain = left[:, 0] * left[:, 0]
        gain /= den_left
        score_right = right[:, 0] * right[:, 0]
        score_right /= den_right
    if not (min_weight > 0 or lam > 0):  # a side of valid split may have H + lambda = 0: it scores 0
        gain[~(den_left > 0)] = 0.0
        score_right[~(den_right > 0)] = 0.0
    gain += score_right
    gain -= score(total[:, 0], total[:, 1], lam)[:, None]
    gain *= 0.5
    gain[~ok] = -np.inf
    # per node the first scanned bin (missing right, smallest feature, smallest bin) that ties with its best
    j, found = first_best_rows(gain)
    return np.where(found, gain[np.arange(k), j], -np.inf), j, found


# ---------------------------------------------------------------------------------------------- losses


def init_scores(task: str, y: np.ndarray, d_out: int) -> np.ndarray:
    """The constant F_0 (one per output): the mean (regression), the log-odds of the mean (binary), 0 for every
    class (multiclass: LightGBM's and XGBoost's start; started at the log class priors, a rare class's rows
    have h = p(1 - p) near 0 from the first tree, its leaves' values -G / (H + lambda) swing by hundreds at
    lambda 0 and the training loss diverges)."""
    if task == "regression":
        return np.array([float(np.mean(y))]) if len(y) else np.zeros(1)
    if task == "binary":
        p = float(np.clip(np.mean(y), 1e-6, 1 - 1e-6)) if len(y) else 0.5
        return np.array([np.log(p / (1 - p))])
    return np.zeros(d_out)


def gradients(task: str, F: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g = dl/dF and h = d2l/dF^2 per joined row and output, (N, d_c) each: squared error 1/2 (F - y)^2 (g =
    F - y, h = 1); logistic (g = p - y, h = p(1 - p)); softmax with XGBoost's diagonal h = p_k(1 - p_k)."""
    if task == "regression":
        return F - y.reshape(-1, 1), np.ones_like(F)
    if task == "binary":
        p = 1.0 / (1.0 + np.exp(-F))
        return p - y.reshape(-1, 1), p * (1.0 - p)
    p = np.exp(F - F.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    g = p.copy()
    g[np.arange(len(y)), np.asarray(y, dtype=np.int64)] -= 1.0
    return g, p * (1.0 - p)


# ---------------------------------------------------------------------------------------------- growth


@dataclass(frozen=True)
class Growth:
    """How a round's trees grow: best-first (LightGBM's leaf-wise), ``leaves_per_step`` leaves of highest gain
    split per step (1: strictly best-first; large: level by level), up to ``max_leaves`` leaves and
    ``max_depth`` (0: no bound); leaf value -learning_rate G/(H + lambda) (Chen & Guestrin Eq. 5), 0 where
    H + lambda is 0 (no hessian at lambda 0: XGBoost's CalcWeight)."""

    max_leaves: int = 63
    max_depth: int = 0
    leaves_per_step: int = 1
    learning_rate: float = 0.1
    rule: SplitRule = field(default_factory=SplitRule)


@dataclass
class Candidate:
    """A node's best split over the tables: its gain, the table that found it and ``left``: the side of each
    of the node's joined rows (a bool array in the node's row order) when called with those rows."""

    gain: float
    table: str
    left: Callable[[np.ndarray], np.ndarray]
    # where the evaluator knows it (the central reference): (feature, flat code k, flat missing bin or -1): the
    # rows whose code is <= k (or the missing bin) go left
    split: tuple[int, ...] = (-1, -1, -1)
    categories: np.ndarray | None = None  # a native categorical split's left columns (the central reference)


@dataclass
class Node:
    """A tree node over the rows perm[start:end] of its tree's row order."""

    id: int
    out: int  # the output (class) of its tree
    start: int
    end: int
    depth: int
    G: float
    H: float
    parent: int = -1
    candidate: Candidate | None = None
    # set once split: the table whose split it is, and its children's node ids
    table: str = ""
    split: tuple[int, ...] = (-1, -1, -1)
    children: tuple[int, int] = (-1, -1)
    value: float = 0.0
    categories: np.ndarray | None = None  # where the evaluator knows it: the left columns of a categorical split
    gain: float = 0.0  # set once split: its split's gain (Chen & Guestrin Eq. 7)


@dataclass
class Tree:
    """One tree: ``nodes`` by id (the root first); internal nodes name their table and children."""

    out: int
    nodes: dict[int, Node]
    root: int

    def internal(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.children[0] >= 0]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.children[0] < 0]


#: evaluate(nodes, perms, g, h) -> each node's Candidate (None: no valid split); one step of a round.
Evaluate = Callable[[list[Node], list[np.ndarray], np.ndarray, np.ndarray], list[Candidate | None]]


def grow_forest(
    rows: np.ndarray, g: np.ndarray, h: np.ndarray, growth: Growth, evaluate: Evaluate, first_id: int = 0
) -> tuple[list[Tree], list[np.ndarray], int]:
    """The d_c trees of one boosting round over the joined rows ``rows`` (g, h: (len(rows), d_c), in that
    order), grown together: every step evaluates the new nodes of all trees at once (one call of ``evaluate``,
    one round trip when federated). Returns the trees, each tree's row order (rows of a leaf contiguous;
    positions into ``rows``) and the next free node id."""
    d_out = g.shape[1]
    perms = [np.arange(len(rows), dtype=np.int32 if len(rows) < 2**31 else np.int64) for _ in range(d_out)]
    trees, next_id = [], first_id
    pending: list[Node] = []
    for k in range(d_out):
        root = Node(next_id, k, 0, len(rows), 0, float(g[:, k].sum()), float(h[:, k].sum()))
        trees.append(Tree(k, {root.id: root}, root.id))
        pending.append(root)
        next_id += 1
    rule = growth.rule
    unit_h = [bool((h[:, k] == 1.0).all()) for k in range(d_out)]  # squared error: the sums of h are counts
    while True:
        if pending:
            for node, cand in zip(pending, evaluate(pending, perms, g, h)):
                node.candidate = cand if cand is not None and cand.gain > rule.min_gain else None
        pending, split_any = [], False
        for tree in trees:
            leaves = tree.leaves()
            room = growth.max_leaves - len(leaves)
            open_ = sorted((n for n in leaves if n.candidate is not None), key=lambda n: (-n.candidate.gain, n.id))
            chosen = open_[: max(0, min(room, growth.leaves_per_step))]
            split_any = split_any or bool(chosen)
            kids: list[Node] = []
            for node in chosen:
                h_k = None if unit_h[tree.out] else h[:, tree.out]
                kids.extend(_split(node, perms[tree.out], g[:, tree.out], h_k, next_id))
                next_id += 2
                node.children = (kids[-2].id, kids[-1].id)
            for kid in kids:
                tree.nodes[kid.id] = kid
            if room - len(chosen) > 0:
                pending.extend(
                    kid
                    for kid in kids
                    if (growth.max_depth <= 0 or kid.depth < growth.max_depth)
                    and kid.end - kid.start >= 2 * rule.min_child_rows
                )
        if not pending and not split_any:
            break
    for tree in trees:
        for leaf in tree.leaves():
            # a leaf of no hessian (saturated softmax, lambda 0) moves nothing, as XGBoost's CalcWeight
            den = leaf.H + rule.lambda_l2
            leaf.value = -growth.learning_rate * leaf.G / den if den > 0 else 0.0
            leaf.candidate = None  # an unused candidate holds its side bits (and cannot be pickled)
    return trees, perms, next_id


def _split(node: Node, perm: np.ndarray, g: np.ndarray, h: np.ndarray | None, first_id: int) -> list[Node]:
    """Split ``node`` by its candidate: its rows of ``perm`` reordered (left rows first, each side in its old
    order) and its two children (ids first_id, first_id + 1) with their sums of g and h (``h`` None: h = 1,
    the sums are the counts), each side's rows added in their order."""
    assert node.candidate is not None
    seg = perm[node.start : node.end]
    left = node.candidate.left(seg)
    G = np.bincount(left, weights=g.take(seg), minlength=2)  # (right, left)
    n_left = int(np.count_nonzero(left))
    H = (
        np.array([len(seg) - n_left, n_left], dtype=np.float64)
        if h is None
        else np.bincount(left, weights=h.take(seg), minlength=2)
    )
    right = seg.compress(~left)  # (seg is perm's: both sides taken before either is written)
    perm[node.start : node.start + n_left] = seg.compress(left)  # left rows first, each side in order
    perm[node.start + n_left : node.end] = right
    cand = node.candidate
    node.table, node.split, node.categories, node.gain = cand.table, cand.split, cand.categories, cand.gain
    node.candidate = None
    kids = []
    for i, (start, end, side) in enumerate(((node.start, node.start + n_left, 1), (node.start + n_left, node.end, 0))):
        kids.append(Node(first_id + i, node.out, start, end, node.depth + 1, float(G[side]), float(H[side]), node.id))
    return kids


def importance(splits: Iterable[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """LightGBM's split and gain importance of ``splits`` (what each split is on, its gain: Chen & Guestrin
    Eq. 7, in the training loss's units): per name, its number of splits, the sum of their gains and that sum's
    share of all their gains; largest gain first (ties: by name)."""
    out: dict[str, dict[str, float]] = {}
    for name, gain in splits:
        entry = out.setdefault(name, {"splits": 0, "gain": 0.0})
        entry["splits"] += 1
        entry["gain"] += gain
    total = sum(entry["gain"] for entry in out.values())
    for entry in out.values():
        entry["share"] = entry["gain"] / total if total > 0 else 0.0
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["gain"], kv[0])))


def table_importance(forest: Sequence[Sequence[Tree]]) -> dict[str, dict[str, float]]:
    """:func:`importance` per table of a forest's splits (the server's view: which table won each split, its
    gain)."""
    return importance((node.table, node.gain) for trees in forest for tree in trees for node in tree.internal())


def leaf_values(tree: Tree, n_rows: int, goes_left: Callable[[Node, np.ndarray], np.ndarray]) -> np.ndarray:
    """The leaf value of each of ``n_rows`` rows routed from the root; ``goes_left(node, idx)``: the side of
    the rows ``idx`` (indices 0..n_rows-1) at the internal node ``node``."""
    out = np.zeros(n_rows)
    stack = [(tree.root, np.arange(n_rows))]
    while stack:
        node_id, idx = stack.pop()
        node = tree.nodes[node_id]
        if node.children[0] < 0:
            out[idx] = node.value
            continue
        if len(idx):
            left = goes_left(node, idx)
            stack += [(node.children[0], idx[left]), (node.children[1], idx[~left])]
    return out


def add_leaves(F: np.ndarray, trees: Sequence[Tree], perms: Sequence[np.ndarray]) -> None:
    """F[rows of each leaf, its output] += the leaf's value (the rows the round's trees were grown on)."""
    for tree, perm in zip(trees, perms):
        for leaf in tree.leaves():
            F[perm[leaf.start : leaf.end], tree.out] += leaf.value
