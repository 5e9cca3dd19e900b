"""Native categorical splits of the boosted trees (tpflower.categorical; docs/algorithms.md, Boosted trees over the
join, Categorical columns): the split LightGBM's many-vs-many rule picks on a hand-made node, federated = central
on the materialized join with categorical columns (float64), the saved part and prediction (an unseen category
goes right)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from simulations.predict import predict_run
from tests.test_gbdt import assert_same_forest, central_of, small
from tests.test_predict import QUIET, assert_same_as_the_run, held_out_rows, train
from tests.test_privacy_e2e import Recorded
from tpflower.categorical import CategoricalRule, best_block_splits, best_native_splits, category_codes, in_set
from tpflower.datasets import load_table
from tpflower.model_part import ModelPart
from tpflower.owner import simulation_secret
from tpflower.phases.gbdt import OwnerTrees, route_bits
from tpflower.phases.predict import read_rows
from tpflower.trees import BinLayout, SplitRule, bin_codes

NATIVE = ("+dataset.loader.categories=8", "algorithm.categorical=native")


def node_histogram(rows: dict[str, int], grads: dict[str, float]) -> tuple[np.ndarray, BinLayout, np.ndarray]:
    """One node's histogram (1, 3, total) over a numeric column of one bin (no split) and the one-hot block of
    the categories ``rows`` (squared error: h = 1, so H is the count), each column's bin 1 its category."""
    m = len(rows)
    layout = BinLayout.of([np.zeros(0)] + [np.array([0.5])] * m)
    n, g = np.array(list(rows.values()), float), np.array(list(grads.values()), float)
    hist = np.zeros((1, 3, layout.total))
    hist[0, :, 0] = [g.sum(), n.sum(), n.sum()]
    for j in range(m):
        hist[0, :, 1 + 2 * j + 1] = [g[j], n[j], n[j]]
        hist[0, :, 1 + 2 * j] = hist[0, :, 0] - hist[0, :, 1 + 2 * j + 1]
    return hist, layout, np.arange(1, m + 1)


def test_the_native_split_picks_lightgbms_prefix_on_a_hand_made_node():
    """Seven categories, LightGBM's defaults. C has fewer rows than cat_smooth (10): out of the order. The rest by
    G / (H + 10): A -1.875, G -1.8, D -0.476, F 0.186, B 1.846, E 2.75; at most min(32, (6 + 1) // 2) = 3 on the
    left. Ascending: A (150 rows), A+G is only 40 rows on (< min_data_per_group 100: not scored), A+G+D; descending:
    E, E+B, E+B+F. Gains by hand, 1/2 [G_L^2/(n_L + 10) + G_R^2/(n_R + 10) - G^2/n] (cat_l2 10, lambda 0):
    A 382.21, A+G+D 695.54, E 508.98, E+B 921.71, E+B+F 837.94 (A+G, were it scored: 551.14). Best: {B, E}."""
    rows = dict(A=150, B=120, C=5, D=200, E=110, F=130, G=40)
    grads = dict(A=-300.0, B=240.0, C=-50.0, D=-100.0, E=330.0, F=26.0, G=-90.0)
    hist, layout, block = node_histogram(rows, grads)
    rule = SplitRule(lambda_l2=0.0, min_child_rows=20)
    gains, features, bins, _, sets = best_native_splits(hist, layout, [block], rule, CategoricalRule())
    names = list(rows)
    assert features[0] == block[0] and bins[0] == -1
    assert [names[j - 1] for j in sets[0]] == ["B", "E"]
    n, g = sum(rows.values()), sum(grads.values())
    expected = 0.5 * (570**2 / (230 + 10) + (g - 570) ** 2 / (n - 230 + 10) - g**2 / n)
    assert gains[0] == pytest.approx(expected, rel=1e-12) and expected == pytest.approx(921.7103, abs=1e-4)
    # scored every prefix (min_data_per_group 1), A+G still loses to E+B; with E's rows under the per-side
    # minimum the descending scan starts at E+B anyway
    loose = CategoricalRule(min_data_per_group=1)
    assert [names[j - 1] for j in best_native_splits(hist, layout, [block], rule, loose)[4][0]] == ["B", "E"]
    # four categories or fewer: one against the rest (lambda without cat_l2)
    few = dict(A=150, B=120, D=200, E=110)
    hist4, layout4, block4 = node_histogram(few, {k: grads[k] for k in few})
    gains4, _, _, _, sets4 = best_native_splits(hist4, layout4, [block4], rule, CategoricalRule())
    n4, g4 = sum(few.values()), sum(grads[k] for k in few)
    one = {k: 0.5 * (grads[k] ** 2 / few[k] + (g4 - grads[k]) ** 2 / (n4 - few[k]) - g4**2 / n4) for k in few}
    best = max(one, key=one.get)
    assert [list(few)[j - 1] for j in sets4[0]] == [best] and gains4[0] == pytest.approx(one[best], rel=1e-12)


def test_a_threshold_that_ties_with_a_category_set_loses_to_the_smaller_feature():
    """The fixed tie rule: feature order. A numeric column after the block that splits the node's rows as the
    category set does has the same gain; the block (the smaller feature) keeps the split."""
    rng = np.random.default_rng(0)
    cat = rng.integers(0, 6, 900)
    X = np.column_stack([*(cat == j for j in range(6)), np.isin(cat, [1, 4]).astype(float)]).astype(float)
    g = np.where(np.isin(cat, [1, 4]), 2.0, -1.0) + 0.01 * rng.standard_normal(900)
    edges = [np.array([0.5])] * 7
    codes, layout = bin_codes(X, edges), BinLayout.of(edges)
    block = np.arange(6)
    hist = np.zeros((1, 3, layout.total))
    for f in range(7):
        for s, w in enumerate((g, np.ones(900), np.ones(900))):
            hist[0, s, layout.offsets[f] : layout.offsets[f + 1]] = np.bincount(codes[f] - layout.offsets[f], w, 2)
    rule = SplitRule(lambda_l2=0.0)
    tie = CategoricalRule(cat_l2=0.0)  # the same gain formula as the threshold's
    gains, features, bins, _, sets = best_native_splits(hist, layout, [block], rule, tie)
    assert features[0] == 0 and bins[0] == -1 and sets[0].tolist() == [1, 4]
    assert np.array_equal(in_set(category_codes(codes, layout, block), block, sets[0]), X[:, 6] > 0.5)


def test_blocks_scanned_together_split_as_each_block_alone():
    """The many-vs-many scans of several blocks (of different sizes, zero-padded to the largest) and of several
    nodes run as one batch: each block's gains and category sets are those it gets scanned alone."""
    rng = np.random.default_rng(7)
    sizes = [3, 6, 17, 40]  # one block one-vs-rest (<= max_cat_to_onehot), three many-vs-many
    layout = BinLayout.of([np.arange(9) + 0.5] + [np.array([0.5])] * sum(sizes))
    starts = np.cumsum([1, *sizes[:-1]])
    blocks = [np.arange(a, a + m) for a, m in zip(starts, sizes)]
    hists = np.zeros((6, 3, layout.total))
    for node in range(6):
        n = int(rng.integers(300, 5000))
        for f in range(1 + sum(sizes)):
            lo, hi = layout.offsets[f], layout.offsets[f + 1]
            c = rng.multinomial(n, rng.dirichlet(np.full(hi - lo, 0.5)))
            hists[node, :, lo:hi] = [rng.normal(size=hi - lo) * c, c * rng.random(), c]
    rule, cat = SplitRule(0.0, 1e-3, 20, 0.0), CategoricalRule()
    together = best_block_splits(hists, layout, blocks, rule, cat)
    found = 0
    for block, (gains, sets) in zip(blocks, together):
        alone_gains, alone_sets = best_block_splits(hists, layout, [block], rule, cat)[0]
        assert np.array_equal(gains, alone_gains)
        assert [None if c is None else c.tolist() for c in sets] == [
            None if c is None else c.tolist() for c in alone_sets
        ]
        found += sum(c is not None and len(c) > 1 for c in sets)
    assert found >= 6  # many-vs-many sets were chosen


@pytest.mark.parametrize("schema,task", [("star", "regression"), ("snowflake", "multiclass")])
def test_native_federated_trees_equal_the_central_reference_with_categorical_columns(schema, task):
    """Every table has a categorical column of 8 levels (the label depends on it); the owners split it natively
    and the central reference on the materialized join finds the same category sets: same trees, leaf values and
    predictions to 1e-9. Only the owners know the sets: the server's trees name (table, split id)."""
    rec = Recorded(*small(schema, task, *NATIVE))
    s = rec.strategy
    forest, F_eval = central_of(rec)
    assert_same_forest(forest, s.forest)
    central_sets = [n.categories for trees in forest for t in trees for n in t.internal() if n.categories is not None]
    assert len(central_sets) >= 3
    assert all(n.categories is None for trees in s.forest for t in trees for n in t.nodes.values())
    owned = [rec.client((t, 0)).state.get("gbdt.category_splits") for t in s.tables]
    assert sum(len(np.unique(o[:, 0])) for o in owned if o is not None) == len(central_sets)
    np.testing.assert_allclose(s.record.test_predictions, s.label_scale.to_label(F_eval[: s.test.N]), atol=1e-9)
    kinds = set()
    for t in s.tables:  # the routing round's bits (one gather per feature) are each row's side at each split
        owner = OwnerTrees(rec.client((t, 0)))
        chosen, rows = owner.table("splits"), np.arange(len(owner.codes[0]))[::-1]
        f, k = owner.flat(chosen)
        codes = owner.codes[f[None, :], rows[:, None]]
        missing_bin = owner.layout.offsets[f + 1] - 1  # a split with missing left: its feature's last bin too
        sides = (codes <= k[None, :]) | ((chosen[:, 4] > 0)[None, :] & (codes == missing_bin[None, :]))
        for j in np.flatnonzero(chosen[:, 2] < 0):
            sides[:, j] = owner.category_sides(int(chosen[j, 1]), owner.split_categories(int(chosen[j, 0])), rows)
        kinds |= set((chosen[:, 2] < 0).tolist())
        assert np.array_equal(route_bits(owner, chosen, rows), np.packbits(sides, axis=1))
    assert kinds == {True, False}  # category splits and thresholds


def test_native_union_equals_the_join():
    """Over the union (fact and d1 in two shards each) the shards' summed histograms give the same category sets:
    the union's trees equal the central reference's and the join's."""
    shape = ("dataset.loader.n_fact=300", "dataset.loader.dim_rows=40", "min_sketch_rows=1")
    cells = (*shape, *NATIVE, "algorithm.min_data_per_group=20")
    rec = Recorded(*small("star", "regression", *cells), "scenario=ucq")
    forest, _ = central_of(rec)
    assert_same_forest(forest, rec.strategy.forest)
    assert sum(n.categories is not None for trees in forest for t in trees for n in t.internal()) >= 3
    assert_same_forest(Recorded(*small("star", "regression", *cells)).strategy.forest, rec.strategy.forest)


def test_native_splits_differ_from_one_hot_ones():
    """The same run with one-hot columns grows other trees (the switch is live)."""
    native = Recorded(*small("star", "regression", *NATIVE)).strategy
    onehot = Recorded(*small("star", "regression", NATIVE[0], "algorithm.categorical=onehot")).strategy
    shape = lambda f: [(n.table, n.start, n.end) for trees in f for t in trees for n in t.nodes.values()]  # noqa: E731
    assert shape(native.forest) != shape(onehot.forest)


def test_a_saved_native_part_predicts_as_the_run_and_sends_an_unseen_category_right(tmp_path, caplog):
    """The owner's saved part holds its category splits with the raw category values; prediction of the held-out
    rows equals the run's test predictions; a row whose category the owner never saw goes right at every
    category split of its table."""
    run = ("algorithm=gbdt", "dataset=synthetic", "algorithm.trees=5", "algorithm.eval_every=5", *NATIVE)
    strategy = train(tmp_path / "run", *run)
    part = ModelPart.load(tmp_path / "run" / "node-state", strategy.run_id, "fact", 0)
    assert part is not None and part.category_splits is not None and np.isnan(part.thresholds).any()
    cats = set(part.preprocessing["categories"]["c"])
    assert set(part.category_values.tolist()) <= cats and len(part.category_values) == len(part.category_splits)
    rows, ids = held_out_rows(strategy, tmp_path)
    pred = predict_run(tmp_path / "run", rows, **QUIET)
    assert_same_as_the_run(strategy, [(pred, ids)])
    _, frame = load_table(strategy.cfg.dataset, "fact")
    unseen = frame.iloc[:50].assign(c="never-seen")
    X = part.features(pd.DataFrame(unseen))
    sides = part.split_sides(X)
    assert not sides[:, np.isnan(part.thresholds)].any()
    seen = part.split_sides(part.features(frame.iloc[:400]))
    assert seen[:, np.isnan(part.thresholds)].any()  # rows of the sets' categories go left
    # a deployed owner's node reading such rows says so in its own log (a simulation's driver prints it)
    unseen.to_csv(tmp_path / "unseen.csv", index=False)
    owner = SimpleNamespace(origin="deployed", prediction_rows_name=None, loader=None)
    secret = simulation_secret(OmegaConf.to_container(strategy.cfg, resolve=True))
    settings = SimpleNamespace(spec=strategy.spec, table="fact", owner=owner, key_kinds={}, secret=secret)
    node = SimpleNamespace(settings=settings)
    with caplog.at_level(logging.WARNING, logger="tpflower"):
        assert len(read_rows(str(tmp_path / "unseen.csv"), node, part)) == 50
    assert "50 row(s) hold a category of column 'c' no training row had, like 'never-seen' (the first" in caplog.text
    lines: list[str] = []  # a simulation's driver: one line
    predict_run(tmp_path / "run", tmp_path / "unseen.csv", log=lines.append)
    assert any(
        line.endswith(
            "rows file " + str(tmp_path / "unseen.csv") + ": 50 row(s) hold a category of column "
            "'c' no training row had, like 'never-seen' (the first in row 0): scored as a category "
            "the model never saw"
        )
        for line in lines
    ), lines
