"""Histogram gradient boosting over the join (docs/algorithms.md, Boosted trees over the join): the central
reference agrees with LightGBM where the bins coincide; the federated trees equal the central reference on the
materialized join (same splits, leaf values and predictions, float64) over star and snowflake joins with
many-to-many keys; what the owner answers and refuses."""

from __future__ import annotations

import re

import numpy as np
import pytest

from simulations.api import load
from simulations.job import unread_epochs
from simulations.node import main as node_main
from simulations.run import run_job
from strategies.centralized import central_gbdt, label_scale_of
from strategies.gbdt import JoinGBDT, node_sums
from tests.conftest import make_cfg
from tests.test_predict import train
from tests.test_privacy_e2e import Recorded
from tpflower import trees
from tpflower.app.server_app import build_strategy, make_strategy
from tpflower.auto import resolve
from tpflower.categorical import blocks_of
from tpflower.losses import loss_np, metrics
from tpflower.model_part import ModelPart
from tpflower.owner import simulation_secret
from tpflower.phases.gbdt import GBDTParams, tree_features
from tpflower.phases.predict import saved_splits
from tpflower.relation import load_relation
from tpflower.results import read_results
from tpflower.trees import (
    MAX_BINS,
    BinLayout,
    Bundles,
    Growth,
    SplitRule,
    best_splits,
    bin_codes,
    bin_edges,
    column_edges,
    gradients,
    grow_forest,
    histograms,
    running_sums,
    table_importance,
    weighted_counts,
)

CATEGORIES = ("+dataset.loader.categories=8", "algorithm.categorical=native")


def small(schema: str, task: str, *extra: str) -> tuple[str, ...]:
    """A synthetic join with many-to-many keys (fanout 2), small enough for a unit test, in float64."""
    return (
        "algorithm=gbdt",
        "precision=float64",
        "dataset=synthetic",
        f"dataset.loader.schema={schema}",
        f"dataset.loader.task={task}",
        "dataset.loader.n_fact=800",
        "dataset.loader.dim_rows=60",
        "dataset.loader.fanout=2",
        "dataset.loader.label=nonlinear",
        "algorithm.trees=4",
        "algorithm.eval_every=2",
        "algorithm.max_leaves=12",
        "algorithm.leaves_per_step=3",
        "algorithm.max_bins=32",
        *extra,
    )


def lgb_params(task: str, leaves: int) -> dict:
    """LightGBM with the reference's split rule: no bin merging, no pre-filter, one thread."""
    return dict(
        objective=task,
        num_leaves=leaves,
        learning_rate=0.1,
        min_data_in_leaf=20,
        min_sum_hessian_in_leaf=1e-3,
        lambda_l2=0.0,
        max_bin=255,
        min_data_in_bin=1,
        num_threads=1,
        deterministic=True,
        force_row_wise=True,
        feature_pre_filter=False,
        boost_from_average=True,
        verbose=-1,
    )


@pytest.mark.parametrize("task,trees,tol", [("regression", 30, 1e-6), ("binary", 5, 1e-6)])
@pytest.mark.parametrize("missing", [0.0, 0.15])
def test_central_reference_equals_lightgbm_where_the_bins_coincide(task, trees, tol, missing):
    """Integer features with fewer distinct values than bins: every value its own bin in both, so the central
    reference (strictly best-first, lambda 0) grows LightGBM's trees; predictions agree to LightGBM's float32
    gradients. (Binary: after a few trees a near-tie of gains in float32 may pick another split.) With missing
    values (a share of every column NaN, the first column's missingness part of the label): their own bin,
    sent to the better side, as LightGBM's missing values are."""
    import lightgbm as lgb  # the dev extra (make test installs it): a missing one fails, never skips

    rng = np.random.default_rng(0)
    X = rng.integers(1, 30, size=(3000, 5)).astype(np.float64)
    y = np.sin(X[:, 0] / 4) * 3 + (X[:, 1] > 10) * 2 + X[:, 2] * X[:, 3] / 100 + rng.normal(0, 0.3, len(X))
    lost = rng.random(X.shape) < missing
    y += 2.0 * lost[:, 0]
    X[lost] = np.nan
    if task == "binary":
        y = (y > np.median(y)).astype(np.float64)
    params = GBDTParams(
        trees=trees, learning_rate=0.1, max_leaves=15, leaves_per_step=1, lambda_l2=0.0, min_child_rows=20
    )
    forest, F, _ = central_gbdt({"a": X[:, :2], "b": X[:, 2:]}, y, task, 1, params)
    model = lgb.train(lgb_params(task, 15), lgb.Dataset(X, y), num_boost_round=trees)
    assert len(forest) == trees and all(len(t[0].leaves()) == 15 for t in forest)
    np.testing.assert_allclose(F[:, 0], model.predict(X, raw_score=True), atol=tol, rtol=0)


def test_bin_edges_of_a_weighted_table_equal_those_of_its_joined_column():
    rng = np.random.default_rng(1)
    x = rng.normal(size=500)
    G = rng.integers(0, 5, size=500)
    joined = np.repeat(x, G)
    for nb in (8, 64, MAX_BINS):
        e = bin_edges(x, G, nb)
        assert np.array_equal(e, bin_edges(joined, np.ones(len(joined)), nb))
        assert len(e) <= nb - 1
        codes = bin_codes(joined[:, None], [e])[0]
        assert codes.max() <= len(e)
        for b in range(len(e)):  # "bin <= b" is "x <= edges[b]"
            assert np.array_equal(codes <= b, joined <= e[b])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_column_edges_and_codes_of_a_wide_one_hot_block_equal_those_found_column_by_column(dtype):
    """The 0/1 columns (found and binned all at once) get what one column at a time gives: the edge 0.5 where
    both values occur on rows of weight > 0 (a category only on rows of weight 0, or on every weighted row,
    has none), and the numeric columns (with missing values) around them keep their own edges and codes."""
    rng = np.random.default_rng(3)
    n, m = 3000, 700
    cat = rng.integers(0, m - 1, n)
    G = rng.integers(0, 3, n).astype(float)
    cat[G == 0] = m - 1  # category m - 1 only on rows of weight 0: no edge
    num = rng.normal(size=(n, 2))
    num[rng.random(n) < 0.1, 1] = np.nan
    ones = np.ones((n, 1))  # on every row: one value, no edge
    X = np.column_stack([num[:, 0], np.eye(m)[cat], num[:, 1], ones, (rng.random(n) < 0.5) * 3.0]).astype(dtype)
    edges = column_edges(X, G, MAX_BINS)
    live = G > 0
    for f in range(X.shape[1]):  # by hand: distinct weighted values, edges halfway, a NaN edge for missing values
        x = X[:, f].astype(np.float64)
        v = np.unique(x[live & ~np.isnan(x)])
        expected = (v[:-1] + v[1:]) / 2 if len(v) <= MAX_BINS else bin_edges(x, G, MAX_BINS)
        if np.isnan(x[live]).any():
            expected = np.append(expected, np.nan)
        np.testing.assert_array_equal(edges[f], expected, err_msg=f"column {f}")
    assert len(edges[m]) == 0 and len(edges[m + 2]) == 0 and list(edges[5]) == [0.5]
    codes, off = bin_codes(X, edges), BinLayout.of(edges).offsets
    for f, e in enumerate(edges):
        x = X[:, f].astype(np.float64)
        if len(e) and np.isnan(e[-1]):
            expected = np.where(np.isnan(x), len(e), np.searchsorted(e[:-1], x))
        else:
            expected = np.searchsorted(e, x)
        np.testing.assert_array_equal(codes[f], expected + off[f], err_msg=f"column {f}")


def _best_split_by_hand(
    hist: np.ndarray, off: np.ndarray, missing: set[int], rule: SplitRule, skip: set[int]
) -> tuple[float, int, int, bool]:
    """One node's best split, candidate by candidate (Chen & Guestrin Eq. 7 and the split rule): "bin <= b"
    of every feature (a feature in ``missing`` has its missing values in its last bin: right), then, for each
    feature in ``missing``, its value bins up to b and its missing values left; the first of the best."""
    lam = rule.lambda_l2

    def score(G: float, H: float) -> float:
        return G * G / (H + lam) if H + lam > 0 else 0.0

    total = hist[:, off[0] : off[1]].sum(axis=1)
    candidates = []  # (left side's sums, feature, bin, missing left, is the bin empty)
    for f in range(len(off) - 1):
        for b in range(off[f], off[f + 1] - 1):
            if b not in skip:
                candidates.append((hist[:, off[f] : b + 1].sum(axis=1), f, b - off[f], False, hist[2, b] == 0))
    for f in sorted(missing):
        for b in range(off[f], off[f + 1] - 2):
            left = hist[:, off[f] : b + 1].sum(axis=1) + hist[:, off[f + 1] - 1]
            candidates.append((left, f, b - off[f], True, hist[2, b] == 0))
    best = (-np.inf, -1, -1, False)
    for left, f, b, missing_left, empty in candidates:
        right = total - left
        if empty or min(left[2], right[2]) < rule.min_child_rows or min(left[1], right[1]) < rule.min_child_weight:
            continue
        gain = 0.5 * (score(left[0], left[1]) + score(right[0], right[1]) - score(total[0], total[1]))
        if gain > best[0] * (1 + 1e-9) + 1e-12:
            best = (gain, f, b, missing_left)
    return best


@pytest.mark.parametrize("rule", [SplitRule(), SplitRule(0.0, 0.0, 1), SplitRule(2.0, 0.5, 5)])
@pytest.mark.parametrize("missing", [(), (2, 3)])
def test_best_splits_equal_a_candidate_by_candidate_scan(rule, missing):
    """The vectorised split search (running sums per feature, each side's score in place, the missing values'
    bins scanned on either side) finds the split a candidate-by-candidate scan finds, with its gain, on
    histograms with empty bins, sides of no hessian (h sums 0 with lambda 0 and no minimum weight: scored 0),
    features left out (BinLayout.part) and missing values; its running sums are np.cumsum's, bit for bit."""
    rng = np.random.default_rng(3)
    off = np.array([0, 5, 6, 40, 41 + 200])  # a feature of one bin (never split), a wide one
    k, total = 7, int(off[-1])
    hist = np.zeros((k, 3, total))
    for n in range(k):
        rows = rng.integers(0, total, size=int(rng.integers(30, 400)))
        for f in range(len(off) - 1):  # every feature holds every row of the node
            b = off[f] + rows % (off[f + 1] - off[f])
            np.add.at(hist[n, 2], b, 1.0)
            np.add.at(hist[n, 0], b, rng.normal(size=len(rows)) + (b == off[f + 1] - 1) * (n - 3))
            np.add.at(hist[n, 1], b, np.where(rows % 34 < 3, 0.0, rng.random(len(rows))))  # feature 2: bins 0-2 h = 0
    layout = BinLayout(off, np.array(missing, dtype=np.int64))
    gains, features, bins, missing_left = best_splits(hist, layout, rule)
    kept = np.array([0, 1, 3])  # feature 2 left out: its bins scanned by no one (layout.part)
    part, part_bins = layout.part(kept)
    part_found = best_splits(hist[:, :, part_bins], part, rule)
    for a, b in zip(best_splits(hist, part, rule, part_bins), part_found):  # the part's bins read in place
        assert np.array_equal(a, b)
    for a, b in zip(scanned_one_node_per_block(hist, layout, rule), (gains, features, bins, missing_left)):
        assert np.array_equal(a, b)  # a node's split is its own, whatever the block of nodes scanned with it
    for n in range(k):
        gain, f, b, left = _best_split_by_hand(hist[n], off, set(missing), rule, set())
        assert (features[n], bins[n], missing_left[n]) == (f, b, left)
        assert gains[n] == pytest.approx(gain, rel=1e-9) if f >= 0 else gains[n] == -np.inf
        gain, f, b, left = _best_split_by_hand(hist[n], off, set(missing) - {2}, rule, set(range(off[2], off[3])))
        p_gain, p_f, p_b, p_left = (x[n] for x in part_found)
        assert (kept[p_f] if p_f >= 0 else -1, p_b, p_left) == (f, b, left)
        assert p_gain == pytest.approx(gain, rel=1e-9) if f >= 0 else p_gain == -np.inf
    assert (features >= 0).sum() >= k - 1
    assert missing_left.any() == bool(missing)
    wide = rng.normal(size=(3, 2, 40_000))  # rows wider than one scan call
    for x in (hist, wide, hist[:0]):
        assert np.array_equal(running_sums(x), np.cumsum(x, axis=-1))
    for n, size in ((0, 3), (7, 1), (5_000, 40), (100_000, 60_000)):  # histogram sums: np.bincount's, bit for bit
        at = rng.integers(0, size, n)
        w = rng.normal(size=n) * 10.0 ** rng.integers(-12, 12, n)  # magnitudes whose sums depend on the order
        assert np.array_equal(weighted_counts(at, size, w), np.bincount(at, weights=w, minlength=size))


def test_histograms_of_a_messages_read_only_arrays_hand_torch_writable_ones(monkeypatch):
    """A message's arrays are read-only views (tpflower.records); torch warns of one (a float64 run printed
    'UserWarning: The given NumPy array is not writable ...' in its output): histograms hands weighted_counts
    writable copies, the same sums."""
    rng = np.random.default_rng(3)
    codes, rows = rng.integers(0, 8, (2, 50)).astype(np.uint16), np.arange(50)
    codes[1] += 8
    G, H, C = (rng.normal(size=50), rng.random(50), np.ones(50))
    expected = histograms(codes, rows, G, H, C, 16)
    seen = []
    real = trees.weighted_counts

    def checked(b, n, w):
        seen.append(b.flags.writeable and w.flags.writeable)
        return real(b, n, w)

    monkeypatch.setattr(trees, "weighted_counts", checked)
    read_only = [np.frombuffer(x.tobytes()) for x in (G, H, C)]
    assert np.array_equal(histograms(codes, rows, *read_only, 16), expected) and seen and all(seen)


def scanned_one_node_per_block(hist, layout, rule):
    """best_splits scanning one node per block (tpflower.trees._SCAN_CELLS)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trees, "_SCAN_CELLS", 1)
        return trees.best_splits(hist, layout, rule)


def test_bundled_one_hot_blocks_give_the_histograms_of_their_columns():
    """Exclusive feature bundling: each one-hot block becomes one bundle, and the histograms built through
    the bundles equal those built column by column (counts exactly, sums to rounding: a default bin is the
    node's total minus the column's other bins). A column of one bin (a category no training row has, a
    constant) costs no pass of its own: thousands of them come with a wide categorical column."""
    rng = np.random.default_rng(1)
    n = 600
    a, b = rng.integers(0, 8, n), rng.integers(0, 6, n)
    X = np.column_stack(
        [
            rng.random(n),
            rng.integers(0, 50, n),
            *(a == i for i in range(8)),
            *(b == i for i in range(6)),
            np.zeros(n),  # a category seen at fit time, in no training row
            np.full(n, 3.0),
        ]
    ).astype(float)
    edges = [bin_edges(X[:, f], np.ones(n), 32) for f in range(X.shape[1])]
    codes, layout = bin_codes(X, edges), BinLayout.of(edges)
    assert [len(e) for e in edges[-2:]] == [0, 0]  # one bin each
    bundles = Bundles.of(codes, layout)
    assert bundles.dense.tolist() == [0, 1] and len(bundles.to_flat) == 2  # the two blocks, one bundle each
    rows = rng.permutation(n)[:400]
    slot = np.sort(rng.integers(0, 5, len(rows)))
    G, H, C = rng.normal(size=len(rows)), rng.random(len(rows)), rng.integers(1, 4, len(rows)).astype(float)
    for h, c in [(None, None), (H, C), (H, None)]:
        direct = histograms(codes, rows, G, h, c, layout.total, slot, 5)
        bundled = histograms(codes, rows, G, h, c, layout.total, slot, 5, bundles)
        assert np.array_equal(direct[:, 2], bundled[:, 2])
        np.testing.assert_allclose(bundled, direct, rtol=0, atol=1e-12)


def table_X(rec: Recorded, t: str) -> np.ndarray:
    """Table t's feature matrix over its rows (a sharded table's shards put back in row order)."""
    router = rec.strategy.routers[t]
    parts = {q: tree_features(rec.client((t, q))) for q in router.shards}
    return router.gather_all(parts)


def central_of(rec: Recorded) -> tuple[list, np.ndarray]:
    """The central reference on the materialized join of the federated run's own training rows (the clients'
    feature matrices expanded by p_i), predicting its test and validation rows."""
    s = rec.strategy
    X = {t: table_X(rec, t) for t in s.tables}
    fit = s.fit_rows
    forest, _, F_eval = central_gbdt(
        {t: X[t][s.train.p[t][fit]] for t in s.tables},
        np.asarray(s.y_train)[fit],
        s.task,
        int(s.d_out),
        s.params,
        {t: X[t][s.eval_p[t]] for t in s.tables},
        blocks={t: blocks_of(rec.client((t, s.routers[t].shards[0])).local.preprocessor) for t in s.tables},
    )
    return forest, F_eval


def assert_same_forest(central: list, federated: list) -> None:
    assert len(central) == len(federated)
    for a, b in zip(central, federated):
        for ta, tb in zip(a, b):
            shape = lambda t: [(n.id, n.table, n.children, n.start, n.end) for n in t.nodes.values()]  # noqa: E731
            assert shape(ta) == shape(tb)
            va = np.array([n.value for n in ta.nodes.values()])
            vb = np.array([n.value for n in tb.nodes.values()])
            np.testing.assert_allclose(va, vb, atol=1e-9, rtol=0)
            gains = [np.array([n.gain for n in t.internal()]) for t in (ta, tb)]
            np.testing.assert_allclose(*gains, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "schema,task,extra",
    [
        ("star", "regression", ()),
        ("snowflake", "regression", ()),
        ("snowflake", "binary", ()),
        ("star", "multiclass", ()),
        ("snowflake", "regression", ("+dataset.loader.missing=0.3",)),
        ("star", "binary", ("+dataset.loader.missing=0.3", *CATEGORIES)),
    ],
)
def test_federated_trees_equal_the_central_reference_on_the_materialized_join(schema, task, extra):
    """Also with missing values (30% of every numeric column: each column's own bin, sent left or right by the
    split) beside native categorical columns."""
    rec = Recorded(*small(schema, task, *extra))
    s = rec.strategy
    assert s.mapping.n_rows["fact"] < s.mapping.N  # many-to-many: the join duplicates fact rows
    forest, F_eval = central_of(rec)
    assert_same_forest(forest, s.forest)
    if extra:  # the owners' splits that send missing values left are the central reference's
        owned = [rec.client((t, 0)).state.get("gbdt.splits") for t in s.tables]
        left = sum(int((o[:, 4] > 0).sum()) for o in owned if o is not None)
        assert left == sum(1 for trees in forest for t in trees for n in t.internal() if n.split[2] >= 0) > 0
    assert sum(len(t.internal()) for trees in s.forest for t in trees) > 10
    H = s.label_scale.to_label(F_eval[: s.test.N])
    np.testing.assert_allclose(s.record.test_predictions, H, atol=1e-9, rtol=0)
    assert len(s.forest[0]) == s.d_out  # one tree per output in every round


def test_importance_per_table_equals_the_central_one_and_each_owner_splits_its_gain_over_its_columns(tmp_path, capsys):
    """results.json's importance (each table's splits and their summed gain) equals the central reference's on
    the materialized join (float64, many-to-many snowflake); each owner's saved part attributes its table's
    splits and gain to its own columns (a categorical column's block to the column), summing to the server's
    figures for the table."""
    rec = Recorded(*small("snowflake", "regression", *CATEGORIES))
    forest, _ = central_of(rec)
    want, got = table_importance(forest), rec.strategy.results.importance
    assert list(got) == list(want) and len(got) >= 2  # tables by gain, largest first
    for t, v in want.items():
        assert got[t]["splits"] == v["splits"]
        np.testing.assert_allclose([got[t]["gain"], got[t]["share"]], [v["gain"], v["share"]], rtol=1e-9)
    assert sum(v["splits"] for v in got.values()) == sum(len(t.internal()) for f in rec.strategy.forest for t in f)
    assert sum(v["share"] for v in got.values()) == pytest.approx(1.0, abs=1e-12)

    strategy = train(tmp_path / "run", *small("snowflake", "regression", *CATEGORIES))
    server = read_results(tmp_path / "run" / "results.json")["importance"]
    columns = set()
    for t in strategy.tables:
        part = ModelPart.load(tmp_path / "run" / "node-state", strategy.run_id, t, 0)
        assert part is not None
        mine = part.importance()
        assert set(mine) <= set(part.columns)
        assert sum(c["splits"] for c in mine.values()) == server.get(t, {}).get("splits", 0)
        np.testing.assert_allclose(
            sum(c["gain"] for c in mine.values()), server.get(t, {}).get("gain", 0.0), rtol=1e-12
        )
        columns |= {(t, c) for c in mine}
    assert ("fact", "c") in columns  # the categorical column's splits, by its name
    # the owner's command line reads the same from its own part (its settings file says where its state is)
    owner = tmp_path / "owner.yaml"
    owner.write_text(f"table: fact\nsource: fact.csv\nkeys: blind\nstate_dir: {tmp_path / 'run' / 'node-state'}\n")
    assert node_main(["--client-config", str(owner), "--importance", strategy.run_id]) == 0
    out = capsys.readouterr().out
    assert f"{server['fact']['splits']} splits" in out and re.search(r"\n  c: \d+\.\d% \(\d+ splits\)", out)
    assert node_main(["--client-config", str(owner), "--importance", "abc123"]) == 1
    assert "no saved part of run abc123" in capsys.readouterr().err
    frame = load(tmp_path / "run").importance  # the Python API's view of results.json
    assert frame["table"].tolist() == list(server)
    assert frame["splits"].tolist() == [v["splits"] for v in server.values()]


@pytest.mark.parametrize("task", ["regression", "binary"])
def test_a_childs_row_sums_from_its_parents_equal_those_summed_from_its_joined_rows(task, monkeypatch):
    """The server sums the smaller child's per-table-row sums from its joined rows and takes the other's as the
    parent's minus it: every node's rows, counts and sums of g and h equal those summed from its own joined
    rows (sums to rounding, h sums never below 0), and the subtraction is used."""
    derived = []
    original = JoinGBDT.table_sums

    def checked(self, nodes, segs, seg_all, g_all, h_all):
        out = original(self, nodes, segs, seg_all, g_all, h_all)
        bounds = np.cumsum([0, *(len(s) for s in segs)])
        derived.append(sum(n.parent in {m.parent for m in nodes if m is not n} for n in nodes if n.parent >= 0))
        for t, parts in out.items():
            for i, seg in enumerate(segs):
                h = None if h_all is None else h_all[bounds[i] : bounds[i + 1]]
                (direct,) = node_sums(
                    self.p_fit[t][seg], np.array([len(seg)]), g_all[bounds[i] : bounds[i + 1]], h, self.train.n_rows[t]
                )
                got = parts[i]
                assert np.array_equal(got.rows, direct.rows) and np.array_equal(got.C, direct.C)
                np.testing.assert_allclose(got.G, direct.G, rtol=0, atol=1e-12)
                if h is not None:
                    assert (got.H >= 0).all()
                    np.testing.assert_allclose(got.H, direct.H, rtol=0, atol=1e-12)
        return out

    monkeypatch.setattr(JoinGBDT, "table_sums", checked)
    Recorded(*small("snowflake", task))
    assert sum(derived) > 10


def test_a_leaf_without_hessian_at_lambda_0_takes_the_value_0_not_a_division_by_zero():
    """Softmax scores that saturated (p_k exactly 0 or 1 in float64, as a rare class's swinging leaves reach at
    lambda_l2 0) give h_k = p_k(1 - p_k) = 0 on every row: a leaf summing no h (no split is valid, each side
    needs min_child_weight of it) takes the value 0, as XGBoost's CalcWeight gives a node without hessian,
    where -learning_rate G/(H + lambda) divided by zero and stopped the run."""
    F = np.tile([0.0, 800.0], (60, 1))  # class 1 certain: p = (0, 1) exactly
    y = np.r_[np.zeros(10, dtype=np.int64), np.ones(50, dtype=np.int64)]
    g, h = gradients("multiclass", F, y)
    assert not h.any() and g[:, 0].sum() == -10.0
    growth = Growth(rule=SplitRule(lambda_l2=0.0))
    trees, _, _ = grow_forest(np.arange(60), g, h, growth, lambda nodes, *_: [None] * len(nodes))
    assert [[leaf.value for leaf in tree.leaves()] for tree in trees] == [[0.0], [0.0]]


@pytest.mark.parametrize("algorithm", ["gbdt", "centralized_gbdt", "auto", "pcg"])
def test_epochs_set_on_boosted_trees_is_said_not_read_in_one_line(algorithm, tmp_path):
    """Boosted trees grow algorithm.trees rounds and do not read epochs: a run given another epochs than the
    default says so in one warning line (algorithm=auto with model=gbdt too, once resolved to gbdt); the
    default epochs, or an algorithm that reads epochs, says nothing."""
    model = ("model=gbdt",) if algorithm == "auto" else ()
    for epochs in ("epochs=3", "epochs=10"):
        cfg = make_cfg("dataset=synthetic", f"algorithm={algorithm}", *model, epochs)
        resolve(cfg)  # algorithm=auto: gbdt's settings, as the run's build_strategy puts them in place
        trees = algorithm != "pcg" and epochs == "epochs=3"
        name, plus = ("gbdt", "+") if algorithm == "auto" else (algorithm, "")
        assert unread_epochs(cfg) == (
            f"epochs=3 is not read by algorithm={name}: it grows algorithm.trees=300 boosting rounds "
            f"({plus}algorithm.trees=N sets them)"
            if trees
            else None
        )


def test_the_centralized_run_bins_its_tables_rows_as_the_joined_columns(tmp_path):
    """algorithm=centralized_gbdt bins each table's rows weighted by their joined training rows and gives the
    join's rows their table rows' bins: its test metric at every evaluation is that of central_gbdt on the
    materialized join's floats (many-to-many keys, float64)."""
    overrides = ("algorithm=centralized_gbdt", *small("snowflake", "regression")[1:])
    cfg = make_cfg(*overrides)
    results = run_job(cfg, tmp_path)
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    scale = label_scale_of(cfg, rel)
    X = {t: rel.tables[t].X[rel.train.p[t]].astype(np.float64) for t in rel.spec.table_names}
    X_test = {t: rel.tables[t].X[rel.test.p[t]].astype(np.float64) for t in rel.spec.table_names}
    blocks = {t: blocks_of(rel.tables[t].preprocessor) for t in rel.spec.table_names}
    params = GBDTParams.from_cfg(cfg.algorithm)
    seen = []
    central_gbdt(
        X,
        scale.scaled(rel.labels(rel.train)),
        "regression",
        1,
        params,
        X_test,
        lambda r, trees, F, F_test: seen.append(metrics("regression", scale.to_label(F_test), rel.labels(rel.test))),
        blocks,
    )
    got = [h.test_metric for h in results.history]
    want = [m["rmse"] for r, m in enumerate(seen, 1) if r % params.eval_every == 0 or r == params.trees]
    assert len(got) == len(want) == params.trees // params.eval_every
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_validation_rows_take_no_part_and_early_stopping_keeps_the_best_trees():
    rec = Recorded(
        *small(
            "star",
            "regression",
            "algorithm.trees=30",
            "algorithm.learning_rate=1",
            "algorithm.early_stopping=1",
            "algorithm.min_child_rows=1",
            "algorithm.max_leaves=40",
        ),
        "validation_fraction=0.3",
    )
    s = rec.strategy
    val = np.ones(s.train.N, dtype=bool)
    val[s.fit_rows] = False
    label_rows = s.train.p["fact"]
    assert not set(label_rows[val]) & set(label_rows[~val])  # a labelled row is on one side only
    forest, F_eval = central_of(rec)
    assert len(s.forest) < 30  # stopped early
    assert_same_forest(forest[: len(s.forest)], s.forest)
    assert s.results.history[-1].extra["trees"] == len(s.forest)
    # results.json says so as the model-selecting algorithms do: the stop, the kept trees, the kept record
    assert s.results.stopped["reason"] == "validation" and s.results.stopped["epoch"] > len(s.forest)
    assert s.results.selection["kept_epoch"] == len(s.forest) and s.results.selection["validation_fraction"] == 0.3
    kept = [r for r in s.results.history if r.epoch == len(s.forest) and "val_loss" in r.extra]
    assert s.results.selection["val_loss"] == kept[0].extra["val_loss"]
    assert s.results.history[-1].extra["kept"] == 1.0


def test_one_round_trip_per_expansion_step_and_replies_hold_gains_and_bits_only():
    rec = Recorded(*small("star", "multiclass"))
    s = rec.strategy
    steps = [(k, g, o) for (k, ph, g, _), (_, _, o, _) in zip(rec.got, rec.sent) if ph == "gbdt_split"]
    n_tables = len(s.tables)
    assert len(steps) % n_tables == 0
    for _key, got, out in steps:
        assert set(out) == {"gain", "bits"}
        assert out["gain"].shape == got["nodes"].shape and out["gain"].dtype == np.float64
        assert out["bits"].dtype == np.uint8 and len(out["bits"]) == (len(got["rows"]) + 7) // 8
    roots = [g for _, g, _ in steps if (g["parent"] < 0).any()]
    assert all((g["parent"] < 0).sum() == s.d_out for g in roots)  # all classes of a round in one trip


def test_gbdt_is_refused_under_a_feature_dp_floor_in_one_line():
    cfg = make_cfg(*small("star", "regression"), "privacy=dpsgd")
    with pytest.raises(ValueError, match="cannot be honoured by algorithm 'gbdt'") as err:
        make_strategy(cfg, None, log=lambda _: None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "algorithm,model",
    [("gbdt", "mlp"), ("centralized_gbdt", "mlp"), ("kmeans", "mlp"), ("coreset_kmeans", "gbdt"), ("admm", "gbdt")],
)
def test_an_algorithm_refuses_a_model_it_does_not_train_in_one_line(algorithm, model):
    cfg = make_cfg("dataset=synthetic", f"algorithm={algorithm}", f"model={model}")
    with pytest.raises(ValueError, match=f"^algorithm={algorithm} does not take model={model} ") as err:
        build_strategy(cfg, None, log=lambda _: None)  # before any table is loaded
    assert "\n" not in str(err.value)


def test_trees_take_the_default_model_and_their_own(trained):
    for model in ((), ("model=gbdt",)):  # conf/config.yaml's default (linear, unused by trees), or model=gbdt
        assert isinstance(make_strategy(make_cfg(*small("star", "regression"), *model), None), JoinGBDT)
    assert trained.strategy.results.model == "gbdt"  # results.json names the trees, not the unused default


@pytest.fixture(scope="module")
def trained() -> Recorded:
    return Recorded(*small("star", "regression"))


@pytest.mark.parametrize(
    "phase,arrays,problem",
    [
        ("gbdt_split", {"nodes": np.array([0])}, "its arrays are not the phase's inputs"),
        ("gbdt_route", {"rows": np.array([10**9]), "splits": np.array([0]), "won": np.zeros(0, int)}, "names rows"),
        ("gbdt_route", {"rows": np.array([0.5]), "splits": np.array([0]), "won": np.zeros(0, int)}, "not integer"),
        ("gbdt_route", {"rows": np.array([0]), "splits": np.array([-3]), "won": np.zeros(0, int)}, "negative"),
        ("gbdt_route", {"rows": np.array([0]), "splits": np.array([987654]), "won": np.zeros(0, int)}, "split"),
    ],
)
def test_the_owner_refuses_bad_inputs_naming_the_table_and_no_number_about_it(trained, phase, arrays, problem):
    from tpflower.guard import ProtocolRefusal
    from tpflower.phases import gbdt

    client = trained.client(("d1", 0))
    with pytest.raises(ProtocolRefusal, match=problem) as err:
        getattr(gbdt, phase)(client, arrays, {"phase": phase})
    assert "table 'd1'" in str(err.value) and not re.search(r"\d", str(err.value).replace("d1", ""))


def test_split_inputs_must_be_consistent(trained):
    from tpflower.guard import ProtocolRefusal
    from tpflower.phases import gbdt

    client = trained.client(("d1", 0))
    good = {
        "nodes": np.array([5000]),
        "parent": np.array([-1]),
        "sizes": np.array([2]),
        "rows": np.array([0, 1]),
        "G": np.array([0.5, -0.5]),
        "C": np.array([1, 1]),
        "won": np.zeros(0, dtype=np.int64),
    }
    for name, value, problem in [
        ("sizes", np.array([3]), "do not match"),
        ("G", np.array([np.nan, 1.0]), "not finite"),
        ("C", np.array([0, 1]), "no joined row"),
        ("H", np.array([1.0, 1.0]), "not the phase's inputs"),  # squared error: h = 1, H is the counts
        ("G", np.array([1, 2]), "not floating point"),
    ]:
        with pytest.raises(ProtocolRefusal, match=problem):
            gbdt.gbdt_split(client, {**good, name: value}, {"phase": "gbdt_split"})


def test_a_saved_split_of_every_value_against_the_missing_ones_has_threshold_inf():
    """The split "every value left, only the missing ones right" (the plain scan's last split of a column with
    missing values) is saved with threshold inf in both units, so a new row's value goes left and its missing
    value right; "value bins up to b and the missing values left" keeps the bin's edge and sends a missing value
    left."""
    rec = Recorded(*small("star", "regression", "+dataset.loader.missing=0.3"))
    client = rec.client(("fact", 0))
    edges = client.state.get_list("gbdt.edges")
    f = next(f for f, e in enumerate(edges) if len(e) and np.isnan(e[-1]))  # a column with a missing bin
    last = len(edges[f]) - 1  # its last bin of values
    gain = np.float64(1.0).view(np.int64)
    saved = saved_splits(client, np.array([[900, f, last, gain, 0], [901, f, 0, gain, 1]], dtype=np.int64))
    assert np.isinf(saved["thresholds"][0]) and np.isinf(saved["raw_thresholds"][0])
    assert saved["thresholds"][1] == edges[f][0] and saved["missing_left"].tolist() == [False, True]
    part = ModelPart("00", "gbdt", "fact", 0, {}, len(edges), 1, "float64", 0, {}, (), (), **saved)
    X = np.zeros((3, len(edges)))
    X[:, f] = [edges[f][0] - 1.0, 1e9, np.nan]  # a value of the first bin, a large value, a missing one
    assert part.split_sides(X).tolist() == [[True, True], [True, False], [False, True]]


@pytest.mark.filterwarnings("error::RuntimeWarning")  # (a shard's NaN column sums were cast to integers)
@pytest.mark.parametrize("missing", [(), ("+dataset.loader.missing=0.3",)])
def test_union_equals_the_join(missing):
    """Over the union (fact and d1 in two shards each) the shards bin on the edges the server merged from their
    sketches (exact here: each shard holds fewer weighted values than the sketch size) and their histograms are
    summed: the same trees as the central reference on the materialized union, as the join's are. Every shard
    gives each numeric column a bin of missing values (empty where the table has none): the same trees."""
    shape = ("dataset.loader.n_fact=120", "dataset.loader.dim_rows=20", "min_sketch_rows=1", *missing)
    rec = Recorded(*small("star", "regression", *shape), "scenario=ucq")
    s = rec.strategy
    assert s.algorithm == "ucq_gbdt" and set(s.shared_edges) == {"fact", "d1"}
    forest, F_eval = central_of(rec)
    assert_same_forest(forest, s.forest)
    np.testing.assert_allclose(s.record.test_predictions, s.label_scale.to_label(F_eval[: s.test.N]), atol=1e-9, rtol=0)
    join = Recorded(*small("star", "regression", *shape))
    assert_same_forest(join.strategy.forest, s.forest)
    phases = [ph for _, ph, _, _ in rec.got]
    assert phases.count("gbdt_shard_split") == phases.count("gbdt_hist")  # two round trips per step
    # histogram subtraction at the summed level: the larger of two siblings travels neither way
    hist_steps = [(a, out) for (_, ph, a, _), (_, _, out, _) in zip(rec.got, rec.sent) if ph == "gbdt_hist"]
    down = [a["mask"] for _, ph, a, _ in rec.got if ph == "gbdt_shard_split"]
    assert sum(len(a["derive"]) for a, _ in hist_steps) > len(hist_steps) / 4
    for (a, out), summed in zip(hist_steps, down):  # both ways: a bit per bin of the nodes built from rows
        built, total = out["shape"].tolist()
        assert (
            built == len(a["nodes"]) - len(a["derive"]) and len(out["mask"]) == len(summed) == (built * total + 7) // 8
        )
    # only the non-empty bins travel: fewer than half of them here
    sent = sum(len(out["hist"]) for _, out in hist_steps)
    assert 0 < sent < sum(np.prod(out["shape"]) for _, out in hist_steps) / 2


@pytest.mark.parametrize(
    "derive,problem",
    [
        ([900000001], "parent's summed histogram this shard does not keep"),
        ([900000001, 900000001], "names a node twice"),
        ([900000005], "not in the step"),
    ],
)
def test_a_forged_subtraction_plan_is_refused_in_one_line(derive, problem):
    """Over the union the server tells the shards which nodes' summed histograms they derive (their kept summed
    parent's minus their sibling's): a plan deriving a node whose parent no shard keeps, or a node twice, is
    refused naming the table, before any histogram is built."""
    from tpflower.guard import ProtocolRefusal
    from tpflower.phases import gbdt

    shape = ("dataset.loader.n_fact=120", "dataset.loader.dim_rows=20", "min_sketch_rows=1", "algorithm.trees=2")
    rec = Recorded(*small("star", "regression", *shape), "scenario=ucq")
    client = rec.client(("fact", 0))
    step = {
        "nodes": np.array([900000000, 900000001]),
        "parent": np.array([899999999, 899999999]),
        "sizes": np.array([1, 1]),
        "rows": np.array([0, 1]),
        "G": np.array([0.5, -0.5]),
        "C": np.array([1, 1]),
        "won": np.zeros(0, dtype=np.int64),
    }
    with pytest.raises(ProtocolRefusal, match=problem) as err:
        gbdt.gbdt_hist(client, {**step, "derive": np.array(derive)}, {"phase": "gbdt_hist"})
    assert str(err.value).startswith("table 'fact' (gbdt_hist) refuses the message") and "\n" not in str(err.value)
    # both siblings derived, or a node of no sibling in the step: nothing to subtract from the parent
    one_child = {"nodes": np.array([900000000]), "parent": np.array([899999999]), "derive": np.array([900000000])}
    for plan in ({**step, "derive": np.array([900000000, 900000001])}, one_child):
        assert gbdt.check_plan(plan["nodes"], plan["parent"], plan["derive"], {899999999}) == (
            "derive names a node without one sibling built from its rows"
        )


def test_a_malformed_sparse_summed_histogram_is_refused_in_one_line():
    """The server sends a shard the summed histograms of the nodes built from rows as their non-empty bins (a bit
    per bin, the sums of g (and h) and a count per set bit, tpflower.trees.sparse_histograms): a mask of another
    length, a bit past the last bin, sums of another number, negative counts or values not finite are refused
    naming the table, before any split is sought."""
    from tpflower.guard import ProtocolRefusal
    from tpflower.phases import gbdt
    from tpflower.trees import dense_histograms

    shape = ("dataset.loader.n_fact=120", "dataset.loader.dim_rows=20", "min_sketch_rows=1", "algorithm.trees=2")
    rec = Recorded(*small("star", "regression", *shape), "scenario=ucq")
    client = rec.client(("fact", 0))
    step = {
        "nodes": np.array([900000000]),
        "parent": np.array([-1]),
        "sizes": np.array([2]),
        "rows": np.array([0, 1]),
        "G": np.array([0.5, -0.25]),
        "C": np.array([1, 1]),
        "won": np.zeros(0, dtype=np.int64),
        "derive": np.zeros(0, dtype=np.int64),
    }
    own, _ = gbdt.gbdt_hist(client, step, {"phase": "gbdt_hist"})
    k, total = own["shape"].tolist()
    assert k == 1 and 0 < len(own["hist"]) < total  # two rows: few of the bins
    dense = dense_histograms(own["mask"], own["hist"], own["count"], k, total)
    assert own["hist"].shape[1] == 1 and own["count"].dtype == np.uint8  # squared error: h = 1, g sums only
    assert dense[0, 2].sum() == 2 * len(gbdt.OwnerTrees(client).codes)  # its two rows in each column
    sums = {name: own[name] for name in ("mask", "hist", "count")}
    gbdt.gbdt_shard_split(client, {"nodes": step["nodes"], **sums}, {})
    past = own["mask"].copy()
    past[-1] |= 1 if total % 8 else 0
    bad = {
        "mask is not one bit per bin": {**sums, "mask": own["mask"][:-1]},
        "hist is not the g \\(and h\\) sums of each bin": {**sums, "hist": own["hist"][1:]},
        "count is not one non-negative count per bin": {**sums, "count": -own["count"].astype(np.int64)},
        "not finite": {**sums, "hist": np.full_like(own["hist"], np.inf)},
        **({"past the last bin": {**sums, "mask": past}} if total % 8 else {}),
    }
    for problem, arrays in bad.items():
        gbdt.gbdt_hist(client, step, {"phase": "gbdt_hist"})
        with pytest.raises(ProtocolRefusal, match=problem) as err:
            gbdt.gbdt_shard_split(client, {"nodes": step["nodes"], **arrays}, {"phase": "gbdt_shard_split"})
        assert str(err.value).startswith("table 'fact' (gbdt_shard_split) refuses the message")
        assert "\n" not in str(err.value)


def test_a_shard_that_loses_its_memory_between_messages_gets_every_summed_histogram(monkeypatch):
    """A shard whose summed parent histograms are gone (a node process per message, as a stock SuperNode's
    without isolation) cannot derive a node's: it builds every node's part and the server sends it every node's
    sum (the others still derive), and the trees stay the join's."""
    from tpflower.phases import gbdt

    init = gbdt.OwnerTrees.__init__

    def forgetful(self, client):
        init(self, client)
        if client.settings.table == "fact" and client.settings.shard == 0:
            self.cache = {}  # nothing kept from one message to the next

    monkeypatch.setattr(gbdt.OwnerTrees, "__init__", forgetful)
    shape = ("dataset.loader.n_fact=120", "dataset.loader.dim_rows=20", "min_sketch_rows=1")
    rec = Recorded(*small("star", "regression", *shape), "scenario=ucq")
    down = {(key, len(a["derive"]), len(a["nodes"])) for key, ph, a, _ in rec.got if ph == "gbdt_hist"}
    full = [len(a["mask"]) for key, ph, a, _ in rec.got if ph == "gbdt_shard_split" and key == ("fact", 0)]
    part = [len(a["mask"]) for key, ph, a, _ in rec.got if ph == "gbdt_shard_split" and key == ("fact", 1)]
    assert any(d for _, d, _ in down) and sum(full) > sum(part)
    monkeypatch.undo()
    assert_same_forest(Recorded(*small("star", "regression", *shape)).strategy.forest, rec.strategy.forest)


def test_union_shards_below_min_sketch_rows_are_refused_in_one_line_with_the_counts_and_the_setting():
    """A union whose shards hold fewer training rows than min_sketch_rows: one line naming the shards, each one's
    count, the bound and how to set it (it said neither, once per shard)."""
    from simulations.federated import run_in_process
    from strategies.transport import RunError

    shape = ("dataset.loader.n_fact=120", "dataset.loader.dim_rows=20", "min_sketch_rows=100000")
    with pytest.raises(RunError) as info:
        run_in_process(make_cfg(*small("star", "regression", *shape), "scenario=ucq"), None, log=lambda _: None)
    d1, fact = str(info.value).splitlines()  # one line per sharded table, not per shard
    assert re.search(
        r"^table 'd1' shards 0, 1 \(gbdt_bins\) refuses the message: a union's shard holds fewer "
        r"training rows than min_sketch_rows=100000, .*; set min_sketch_rows=N, N at most the smallest shard's "
        r"training rows \(20 training rows\)$",  # both shards alike: said once
        d1,
    ), d1
    assert re.search(r"^table 'fact' shards 0, 1 .* \(shard 0: \d+ training rows; shard 1: \d+ training rows\)$", fact)


def test_union_shards_of_only_one_hot_columns_need_no_min_sketch_rows():
    """Sharded tables whose features are all one-hot (a categorical column each) send counts of 1s for their
    bins, no value: at the default min_sketch_rows (2048) their shards of 20-60 training rows take part (they
    were refused as if they sent order statistics) and the trees are the join's."""
    shape = ("dataset.loader.n_fact=120", "dataset.loader.dim_rows=20", "dataset.loader.widths=[1,1,2,2]")
    categorical = ("+dataset.loader.categories=3",)  # each table's last feature: here fact's and d1's only one
    rec = Recorded(*small("star", "regression", *shape, *categorical), "scenario=ucq")
    assert rec.cfg.min_sketch_rows == 2048 and set(rec.strategy.shared_edges) == {"fact", "d1"}
    join = Recorded(*small("star", "regression", *shape, *categorical))
    assert_same_forest(join.strategy.forest, rec.strategy.forest)
    # their counts are aggregates: a shard of fewer rows than min_group_rows sends none (its stats refuse first)
    from simulations.federated import run_in_process
    from strategies.transport import RunError

    cfg = make_cfg(*small("star", "regression", *shape, *categorical), "scenario=ucq", "min_group_rows=30")
    with pytest.raises(
        RunError, match=r"^table 'd1' shards 0, 1: a summary of fewer fit rows than min_group_rows = 30"
    ):
        run_in_process(cfg, None, log=lambda _: None)


@pytest.mark.parametrize("scenario", ["join", "ucq"])
def test_a_table_of_no_feature_column_takes_part_and_never_splits(scenario):
    """A table that holds only its keys (and the label) has no split to offer: it answers no gain, and the
    trees are the central reference's, over the join and over the union (fact and d1 sharded, both without
    features)."""
    shape = ("dataset.loader.n_fact=120", "dataset.loader.dim_rows=20", "min_sketch_rows=1")
    rec = Recorded(*small("star", "regression", *shape, "dataset.loader.widths=[0,0,3,2]"), f"scenario={scenario}")
    s = rec.strategy
    forest, F_eval = central_of(rec)
    assert_same_forest(forest, s.forest)
    assert {n.table for trees in s.forest for t in trees for n in t.internal()} == {"d2", "d3"}
    np.testing.assert_allclose(s.record.test_predictions, s.label_scale.to_label(F_eval[: s.test.N]), atol=1e-9, rtol=0)


def test_a_rare_class_does_not_make_the_softmax_trees_diverge_at_lambda_0():
    """Multiclass trees start every class at 0 (as LightGBM and XGBoost do): started at the log class priors, a
    class of a few rows has h = p(1 - p) near 0 on every row, its leaves -G / H swing by hundreds at lambda_l2
    0 and the training loss grows without bound."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(3000, 4))
    y = np.digitize(X[:, 0] + 0.5 * X[:, 1] + rng.normal(0, 0.5, len(X)), [-1.5, -0.5, 0.0, 0.5, 1.5]).astype(float)
    y[np.argsort(X[:, 2])[-12:]] = 6  # a seventh class of 12 rows
    params = GBDTParams(trees=60, learning_rate=0.1, lambda_l2=0.0)
    losses = []
    central_gbdt(
        {"a": X[:, :2], "b": X[:, 2:]},
        y,
        "multiclass",
        7,
        params,
        on_round=lambda r, trees, F, _: losses.append(float(loss_np("multiclass", F, y).mean())),
    )
    assert np.all(np.diff(losses) < 0), losses  # the training loss falls every round
