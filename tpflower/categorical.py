"""Native categorical splits for the histogram GBDT (LightGBM's many-vs-many split, Ke et al., NeurIPS 2017,
and its feature_histogram: categories ordered by gradient statistics), shared by the federated owner
(tpflower/phases/gbdt.py) and the central reference (strategies/centralized.py) so the two cannot drift
(docs/algorithms.md, Boosted trees over the join, Categorical columns).

A categorical column reaches the trees as its one-hot block (tpflower/preprocess.py: one 0/1 column per
category seen at fit time, in sorted order). With ``algorithm.categorical=native`` the block is one feature whose
bins are its categories: category j's per-node sums of g, h and rows are bin 1 (value 1) of the block's column j
in the node's histogram (tpflower.trees.histograms), so nothing new is counted. Per node and block:

* at most ``max_cat_to_onehot`` categories: one category against the rest (the usual gain, lambda_l2);
* else the categories with at least ``cat_smooth`` rows, sorted by G / (H + cat_smooth), and the best prefix of
  that order scanned from either end (at most ``max_cat_threshold`` categories and half of them on the left; a
  prefix is scored once its last scored prefix is ``min_data_per_group`` rows behind, and the rest keeps at
  least ``min_data_per_group`` rows); gain 1/2 [G_L^2/(H_L + l + cat_l2) + G_R^2/(H_R + l + cat_l2) -
  G^2/(H + l)] (Chen & Guestrin Eq. 7 with LightGBM's extra cat_l2 on the children).

The split sends the chosen categories left; every other row goes right, including a row whose category was
not seen at fit time (an all-zero block). Ties: the smallest feature (a block is numbered by its first column),
then the first position (ascending scan before descending, shorter prefix first), as LightGBM's strict ">"
keeps the first best. Categories whose G / (H + cat_smooth) agree to :data:`tpflower.trees.TIE` keep their
column order, so sums computed per table row or per joined row sort alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpflower.preprocess import TablePreprocessor
from tpflower.trees import TIE, BinLayout, SplitRule, best_splits, first_best_rows, score, tied_with_best

MODES = ("onehot", "native")


@dataclass(frozen=True)
class CategoricalRule:
    """LightGBM's defaults (its docs, Parameters: max_cat_to_onehot 4, cat_smooth 10, cat_l2 10,
    max_cat_threshold 32, min_data_per_group 100)."""

    max_cat_to_onehot: int = 4
    cat_smooth: float = 10.0
    cat_l2: float = 10.0
    max_cat_threshold: int = 32
    min_data_per_group: int = 100


def blocks_of(pre: TablePreprocessor) -> list[np.ndarray]:
    """The feature columns of each categorical column's one-hot block (tpflower.preprocess: numeric columns
    first, then one column per category of each categorical column, in order)."""
    assert pre.categories is not None
    out, start = [], len(pre.numeric)
    for cats in (pre.categories[c] for c in pre.categorical):
        if len(cats):
            out.append(np.arange(start, start + len(cats), dtype=np.int64))
        start += len(cats)
    return out


def category_codes(codes: np.ndarray, layout: BinLayout, block: np.ndarray) -> np.ndarray:
    """Each row's category in ``block`` (0..m-1: the column whose value is 1, i.e. in bin 1), m: none (a
    category not seen at fit time, or a column with one bin: never split on)."""
    m = len(block)
    out = np.full(codes.shape[1], m, dtype=np.int32)
    for j, f in enumerate(block):
        if layout.offsets[f + 1] - layout.offsets[f] == 2:
            out[codes[f] == layout.offsets[f] + 1] = j
    return out


def _block_stats(hists: np.ndarray, layout: BinLayout, block: np.ndarray) -> np.ndarray:
    """(k, 3, m): category j's sums of g, h and rows per node, from bin 1 of its column (0: a column with one
    bin, whose category has no training row or holds every row)."""
    two = layout.offsets[block + 1] - layout.offsets[block] == 2
    out = np.zeros((hists.shape[0], 3, len(block)))
    out[:, :, two] = hists[:, :, layout.offsets[block[two]] + 1]
    return out


def _sorted_order(S: np.ndarray, eligible: np.ndarray, smooth: float) -> np.ndarray:
    """Per node, the eligible categories by G / (H + cat_smooth) ascending (ratios within TIE: column order),
    the others after them."""
    k, m = eligible.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(eligible, S[:, 0] / (S[:, 1] + smooth), np.inf)
    order = np.argsort(ratio, axis=1, kind="stable")
    r = np.take_along_axis(ratio, order, axis=1)
    a, b = r[:, :-1], r[:, 1:]
    with np.errstate(invalid="ignore"):
        tie = np.isfinite(a) & np.isfinite(b) & (np.abs(b - a) <= TIE * np.maximum(np.abs(a), np.abs(b)))
    new = ~tie
    group = np.concatenate([np.zeros((k, 1), dtype=np.int64), np.cumsum(new, axis=1)], axis=1)
    group_of = np.empty_like(group)
    np.put_along_axis(group_of, order, group, axis=1)
    return np.lexsort((np.broadcast_to(np.arange(m), (k, m)), group_of), axis=-1)


def _one_vs_rest(S: np.ndarray, T: np.ndarray, rule: SplitRule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of S (k, 3, m), a node's category sums with its totals T (k, 3): the best gain of one category
    against the rest, its category and whether there is one."""
    lam = rule.lambda_l2
    L, R = S, T[:, :, None] - S
    ok = (
        (L[:, 2] >= rule.min_child_rows)
        & (L[:, 2] > 0)
        & (L[:, 1] >= rule.min_child_weight)
        & (R[:, 2] >= rule.min_child_rows)
        & (R[:, 1] >= rule.min_child_weight)
    )
    gain = 0.5 * (
        score(L[:, 0], L[:, 1], lam) + score(R[:, 0], R[:, 1], lam) - score(T[:, None, 0], T[:, None, 1], lam)
    )
    gain = np.where(ok, gain, -np.inf)
    j, found = first_best_rows(gain)
    return gain[np.arange(len(j)), j], j, found


def _many_vs_many(
    S: np.ndarray, T: np.ndarray, rule: SplitRule, cat: CategoricalRule
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """Per row of S (k, 3, m), a node's category sums with its totals T (k, 3): the best gain of a sorted
    prefix (module docstring) and the positions of its categories going left (None: no split). Rows are
    independent: the rows of several blocks (zero-padded to one m: a category of no rows is never eligible)
    are scanned in one pass."""
    k, m = S.shape[0], S.shape[2]
    lam = rule.lambda_l2
    gains, sets = np.full(k, -np.inf), [None] * k
    eligible = S[:, 2] >= cat.cat_smooth
    used = eligible.sum(axis=1)
    order = _sorted_order(S, eligible, cat.cat_smooth)
    max_num = np.minimum(cat.max_cat_threshold, (used + 1) // 2)
    width = int(max_num.max()) if k else 0
    if width == 0:
        return gains, sets
    i = np.arange(width)
    in_scan = i[None, :] < max_num[:, None]
    scans = []  # per direction: (k, 3, width) left sums of the prefixes of 1..width categories
    for forward in (True, False):
        pos = i[None, :] if forward else np.maximum(used[:, None] - 1 - i[None, :], 0)
        cats = np.take_along_axis(order, np.minimum(pos, m - 1), axis=1)
        step = np.take_along_axis(S, cats[:, None, :], axis=2)
        scans.append(np.cumsum(np.where(in_scan[:, None, :], step, 0.0), axis=2))
    left = np.concatenate(scans)  # (2k, 3, width): the ascending scans, then the descending ones
    right = np.concatenate([T, T])[:, :, None] - left
    ok = (
        np.concatenate([in_scan, in_scan])
        & (left[:, 2] >= rule.min_child_rows)
        & (left[:, 1] >= rule.min_child_weight)
        & (right[:, 2] >= rule.min_child_rows)
        & (right[:, 2] >= cat.min_data_per_group)
        & (right[:, 1] >= rule.min_child_weight)
    )
    rows = np.diff(left[:, 2], axis=1, prepend=0.0)  # each prefix's new rows (0 past the scan: a flat sum)
    scored = np.zeros_like(ok)
    group = np.zeros(2 * k)
    for t in range(width):  # rows since the last scored prefix (LightGBM's cnt_cur_group)
        group += rows[:, t]
        scored[:, t] = ok[:, t] & (group >= cat.min_data_per_group)
        group[scored[:, t]] = 0.0
    lam_c = lam + cat.cat_l2
    gain = 0.5 * (
        score(left[:, 0], left[:, 1], lam_c)
        + score(right[:, 0], right[:, 1], lam_c)
        - np.concatenate([score(T[:, None, 0], T[:, None, 1], lam)] * 2)
    )
    gain = np.where(scored, gain, -np.inf)
    all_gains = np.concatenate([gain[:k], gain[k:]], axis=1)  # (k, 2 width): ascending first, shorter first
    best, found = first_best_rows(all_gains)
    for n in np.flatnonzero(found):
        d, t = divmod(int(best[n]), width)
        gains[n], sets[n] = all_gains[n, best[n]], order[n, : t + 1] if d == 0 else order[n, used[n] - 1 - t : used[n]]
    return gains, sets


def best_block_splits(
    hists: np.ndarray, layout: BinLayout, blocks: Sequence[np.ndarray], rule: SplitRule, cat: CategoricalRule
) -> list[tuple[np.ndarray, list[np.ndarray | None]]]:
    """Per block and node: the best gain of a split of the block (-inf: none) and the columns of its categories
    going left (module docstring). The blocks of more than ``max_cat_to_onehot`` categories are scanned
    together."""
    T = hists[:, :, : layout.offsets[1]].sum(axis=2)  # the node's sums (every feature's bins add up to them)
    k, stats = hists.shape[0], [_block_stats(hists, layout, block) for block in blocks]
    out: list[tuple[np.ndarray, list[np.ndarray | None]]] = []
    for block, S in zip(blocks, stats):
        if len(block) <= cat.max_cat_to_onehot:  # one category against the rest
            g, j, found = _one_vs_rest(S, T, rule)
            out.append((np.where(found, g, -np.inf), [block[j[n] : j[n] + 1] if found[n] else None for n in range(k)]))
        else:
            out.append((np.zeros(0), []))
    many = [b for b, block in enumerate(blocks) if len(block) > cat.max_cat_to_onehot]
    if many:
        m = max(len(blocks[b]) for b in many)
        S = np.zeros((len(many) * k, 3, m))
        for i, b in enumerate(many):
            S[i * k : (i + 1) * k, :, : len(blocks[b])] = stats[b]
        gains, sets = _many_vs_many(S, np.concatenate([T] * len(many)), rule, cat)
        for i, b in enumerate(many):
            block = blocks[b]
            chosen = sets[i * k : (i + 1) * k]
            out[b] = (gains[i * k : (i + 1) * k], [None if c is None else np.sort(block[c]) for c in chosen])
    return out


def best_native_splits(
    hists: np.ndarray, layout: BinLayout, blocks: Sequence[np.ndarray], rule: SplitRule, cat: CategoricalRule
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray | None]]:
    """(gain, feature, bin, missing_left, categories) of each node's best split: the other features' thresholds
    (tpflower.trees.best_splits without the blocks' columns) or a block's category set (feature: the block's
    first column, bin -1, categories: the columns of the categories going left; None for a threshold). Ties:
    the smallest feature."""
    k = hists.shape[0]
    # the thresholds of the other features, scanned on their bins alone (a block's thousands of columns: none)
    others = np.setdiff1d(np.arange(len(layout.offsets) - 1), np.concatenate([[], *blocks])).astype(np.int64)
    part, part_bins = layout.part(others)
    gains, found, bins, missing_left = best_splits(hists, part, rule, part_bins)
    features = np.append(others, -1)[found]  # (found -1: none, the appended -1)
    sets: list[np.ndarray | None] = [None] * k
    if not blocks:
        return gains, features, bins, missing_left, sets
    found = best_block_splits(hists, layout, blocks, rule, cat)
    cand_gain = np.column_stack([gains, *(g for g, _ in found)])  # (k, 1 + blocks)
    cand_feature = np.column_stack([features, *(np.full(k, b[0]) for b in blocks)])
    # per node the candidate of the smallest feature among those tied with the best (first_best in feature
    # order: a threshold's feature is never a block's column)
    tied, any_found = tied_with_best(cand_gain)
    c = np.argmin(np.where(tied, cand_feature, np.iinfo(np.int64).max), axis=1)
    for n in np.flatnonzero(any_found & (c > 0)):
        gains[n], features[n], bins[n], sets[n] = cand_gain[n, c[n]], blocks[c[n] - 1][0], -1, found[c[n] - 1][1][n]
        missing_left[n] = False
    return gains, features, bins, missing_left, sets


def set_sides(block: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """The side of each category of ``block`` (:func:`category_codes`' 0..m, the last: none) at the split that
    sends the columns ``chosen`` left: True for those, False for the others and for no category."""
    lut = np.zeros(len(block) + 1, dtype=bool)
    lut[np.searchsorted(block, chosen)] = True
    return lut


def in_set(categories: np.ndarray, block: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """The side of rows whose categories in ``block`` are ``categories`` (:func:`category_codes`): True where
    the row's category is one of the columns ``chosen``; a row of no category goes right."""
    return set_sides(block, chosen)[categories]
