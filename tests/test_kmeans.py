"""DistDim k-means over the join and its coreset version (VFL coresets, Alg. 3; docs/algorithms.md): the
factorized cost equals the cost on the materialized join, what a table sends, the k-means sensitivities, and
the refusals."""

from __future__ import annotations

import re

import numpy as np
import pytest

from simulations.federated import run_in_process
from tests.conftest import make_cfg
from tests.test_coreset import F64, quiet
from tests.test_privacy_e2e import Recorded, assert_absent, raw_columns
from tpflower import clustering
from tpflower.app.server_app import make_strategy
from tpflower.phases import coreset as cs


@pytest.fixture(scope="module")
def kmeans_run() -> Recorded:
    return Recorded("algorithm=kmeans", F64, "algorithm.k=4")


def materialized_distdim_cost(rec: Recorded, label_phase: str) -> tuple[float, float, dict[str, float]]:
    """On the MATERIALIZED full join (N x d, float64): every joined row placed in the grid cell of its tables'
    local labels (the replies of ``label_phase``), the cell assigned to the nearest final centre: (the mean
    cost of that assignment, the mean nearest-centre cost, each table's block of the summed cost)."""
    s = rec.strategy
    reply = {(k[0], ph): out for k, ph, out, _ in rec.sent}
    blocks = {t: np.asarray(rec.client((t, 0)).local.X, dtype=np.float64)[p] for t, p in s.mapping.p.items()}
    X = np.hstack(list(blocks.values()))
    point = np.hstack(
        [
            reply[(t, "kmeans_local")]["C"][reply[(t, label_phase)]["labels"].astype(np.int64)[p]]
            for t, p in s.mapping.p.items()
        ]
    )
    C = s.centres
    c = ((point[:, None, :] - C[None]) ** 2).sum(-1).argmin(1)
    D = ((X[:, None, :] - C[None]) ** 2).sum(-1)
    bounds = np.cumsum([0, *(b.shape[1] for b in blocks.values())])
    per_table = {t: float(((blocks[t] - C[c, bounds[i] : bounds[i + 1]]) ** 2).sum()) for i, t in enumerate(blocks)}
    return float(D[np.arange(len(X)), c].mean()), float(D.min(1).mean()), per_table


def test_factorized_kmeans_cost_equals_the_cost_on_the_materialized_join(kmeans_run):
    """The metric is the cost of DistDim's induced assignment (grid cell -> nearest final centre) over the full
    join: from one number per table, equal (float64) to the cost computed on the materialized join; an upper
    bound on the nearest-centre cost."""
    rec, s = kmeans_run, kmeans_run.strategy
    cost, nearest, per_table = materialized_distdim_cost(rec, "kmeans_local")
    assert abs(s.results.history[-1].test_metric - cost) < 1e-9 * cost
    for t, v in per_table.items():
        assert abs(s.table_costs[t] - v) < 1e-9 * max(v, 1.0)
    assert cost >= nearest - 1e-12
    assert s.centres.shape == (4, sum(b.shape[1] for b in [rec.client((t, 0)).local.X for t in s.mapping.p]))
    # what the cost round exchanged: per table sparse counts down, one number up
    for _key, phase, out, _ in rec.sent:
        if phase == "kmeans_cost":
            assert set(out) == {"cost"} and out["cost"].size == 1


def test_a_table_of_no_feature_column_adds_nothing_to_the_cost():
    """A table holding only its keys (the fact table here) has centres of width 0 and a cost of 0: the
    factorized cost still equals the one on the materialized join."""
    rec = Recorded("algorithm=kmeans", F64, "algorithm.k=4", "dataset.loader.widths=[0,3,2,2]")
    s = rec.strategy
    cost, _, per_table = materialized_distdim_cost(rec, "kmeans_local")
    assert abs(s.results.history[-1].test_metric - cost) < 1e-9 * cost
    assert s.table_costs["fact"] == per_table["fact"] == 0.0


def test_distdim_sends_one_label_per_table_row_and_k_centres(kmeans_run):
    rec, s = kmeans_run, kmeans_run.strategy
    for key, phase, arrays, _ in rec.sent:
        if phase == "kmeans_local":
            assert arrays["labels"].shape == (s.mapping.n_rows[key[0]],) and arrays["labels"].dtype == np.uint8
            assert arrays["C"].shape[0] == 4
    keys, features, _ = raw_columns(rec)
    assert_absent(rec, keys)
    assert_absent(rec, features)


def test_kmeans_sensitivities_over_the_join_equal_the_materialized_slice(kmeans_run):
    """Alg. 3 with G_iu on the table's rows == the formula on the table's expanded slice X_i[p_i] (G = 1)."""
    rec, s = kmeans_run, kmeans_run.strategy
    rng = np.random.default_rng(5)
    for t, p in s.mapping.p.items():
        X = np.asarray(rec.client((t, 0)).local.X, dtype=np.float64)
        C = X[rng.choice(len(X), 3, replace=False)] + 0.01
        g = cs.cluster_sensitivities(X, s.mapping.G(t), C)
        np.testing.assert_allclose(g[p], cs.cluster_sensitivities(X[p], np.ones(len(p)), C), rtol=1e-9)


def test_kmeans_restarts_keep_the_lowest_cost_seeding():
    """restarts = R runs Lloyd from R k-means++ seedings drawn one after the other from the same generator and
    keeps the lowest weighted cost: never above the first seeding's (restarts = 1), below it on some data."""

    def cost(X, w, C):
        return float((w * clustering.sq_distances(X, C).min(1)).sum())

    lower = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        X = np.concatenate([rng.normal(size=(60, 2)) + c for c in ([0, 0], [6, 0], [0, 6], [6, 6], [3, 3])])
        w = rng.integers(1, 4, len(X)).astype(float)
        C1, _ = clustering.weighted_kmeans(X, w, 5, np.random.default_rng(seed), restarts=1)
        C10, labels = clustering.weighted_kmeans(X, w, 5, np.random.default_rng(seed), restarts=10)
        assert cost(X, w, C10) <= cost(X, w, C1) + 1e-9
        np.testing.assert_array_equal(labels, clustering.sq_distances(X, C10).argmin(1))
        lower += cost(X, w, C10) < cost(X, w, C1) - 1e-6
    assert lower >= 1


def test_weighted_kmeans_with_integer_weights_is_kmeans_on_repeated_rows():
    """Lloyd from the same start: weights w_u give the centres and labels of the rows repeated w_u times."""
    rng = np.random.default_rng(2)
    X, w = rng.normal(size=(40, 3)), rng.integers(1, 5, 40)
    C0 = X[:3].copy()
    Xr = np.repeat(X, w, axis=0)
    C, labels = clustering.weighted_kmeans(X, w.astype(float), 3, rng, iters=50, tol=0.0, init=C0)
    Cr, labels_r = clustering.weighted_kmeans(Xr, np.ones(len(Xr)), 3, rng, iters=50, tol=0.0, init=C0)
    np.testing.assert_allclose(C, Cr, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.repeat(labels, w), labels_r)


def test_coreset_kmeans_runs_sends_no_feature_and_its_cost_is_the_materialized_one():
    rec = Recorded("algorithm=coreset_kmeans", F64, "algorithm.k=4", "algorithm.m=300")
    keys, features, _ = raw_columns(rec)
    assert_absent(rec, keys)
    assert_absent(rec, features)
    s = rec.strategy
    assert s.construction["rounds"] == 3 and np.isfinite(s.results.history[-1].test_metric)
    assert {p for _, p, _, _ in rec.sent} >= {
        "sensitivity",
        "sample",
        "weigh",
        "kmeans_local",
        "kmeans_assign",
        "kmeans_cost",
    }
    cost, nearest, _ = materialized_distdim_cost(rec, "kmeans_assign")
    assert abs(s.results.history[-1].test_metric - cost) < 1e-9 * cost and cost >= nearest - 1e-12
    for _key, phase, arrays, _ in rec.got:  # the coreset's rows only, at most m per table
        if phase == "kmeans_local":
            assert len(arrays["rows"]) <= 300


@pytest.mark.parametrize("algorithm", ["kmeans", "coreset_kmeans"])
def test_bad_k_is_refused_before_any_node(algorithm):
    with pytest.raises(ValueError, match="algorithm.k must be an integer >= 1"):
        make_strategy(make_cfg(f"algorithm={algorithm}", "dataset=synthetic", "algorithm.k=0"), None, log=quiet)


def test_why_the_cost_is_one_number_per_table_per_run():
    """Why the k-means metric is not the nearest-centre cost (README, Coresets): that needs each row's squared
    distances to k centres the server chose, and with k - 1 >= d_i affinely independent centres those give
    away the rows' features (differences of ||x||^2 - 2 c^T x + ||c||^2 are linear in x). The attack on the
    n_i x k distances the first version sent; tests/test_curious_server.py shows the client now refuses it."""
    rng = np.random.default_rng(4)
    X = rng.normal(size=(50, 4))
    C = rng.normal(size=(10, 4))  # k = 10 centres, d_i = 4
    D = clustering.sq_distances(X, C)  # what kmeans_cost sends
    A = -2.0 * (C[1:] - C[0])  # (D_c - D_0) = -2 (c - c_0)^T x + ||c||^2 - ||c_0||^2
    b = (D[:, 1:] - D[:, :1]) - ((C[1:] ** 2).sum(1) - (C[0] ** 2).sum())
    X_hat = np.linalg.lstsq(A, b.T, rcond=None)[0].T
    np.testing.assert_allclose(X_hat, X, atol=1e-8)


def test_a_k_beyond_the_owners_group_bound_is_one_line_from_the_server():
    """algorithm=kmeans with k > N / min_group_rows: the server says so once, with the largest k, before any
    node clusters (each node refused it: one line per table, each naming its table twice)."""
    cfg = make_cfg("algorithm=kmeans", "dataset=synthetic", "algorithm.k=5000")
    with pytest.raises(ValueError) as refused:
        run_in_process(cfg, None, log=quiet)
    line = str(refused.value)
    assert "\n" not in line, line
    assert re.match(r"algorithm\.k=5000: k-means over the join's \d+ rows has at most \d+ centres", line), line


def test_kmeans_has_no_constant_predictor_reference_nor_its_warning():
    """k-means ignores the label: its summary line names no constant predictor, results.json holds no
    reference, and its cost (in feature units) is never compared with the label's RMSE in a warning line (it
    said 'worse than predicting a constant (test rmse 3.6867 ...); a larger model.beta' on movielens)."""
    lines: list[str] = []
    cfg = make_cfg("algorithm=kmeans", "dataset=synthetic", "algorithm.k=4")
    strategy = run_in_process(cfg, None, log=lines.append).strategy
    assert strategy.results.reference == {}
    text = "\n".join(lines)
    assert "constant predictor" not in text and "warning" not in text, text
    assert strategy.results.history[-1].test_metric > 1.0  # above synthetic's constant RMSE: it was warned of


@pytest.mark.parametrize(("algorithm", "k"), [("kmeans", 30), ("coreset_kmeans", 500)])
def test_a_k_beyond_a_tables_group_bound_gives_that_table_fewer_centres(algorithm, k):
    """A k that a table's rows cannot carry at min_group_rows each (synthetic's d3: 354 rows in the join, 17
    centres) gives that table fewer local centres, named in one line, and the run keeps k final centres (was:
    refused in one line naming the table and the largest k, so that algorithm=kmeans at its defaults stopped on
    any dimension table of fewer than 200 rows in the join: 50 states, 123 rows of synthetic's d3 at fanout=1)."""
    lines: list[str] = []
    cfg = make_cfg(f"algorithm={algorithm}", "dataset=synthetic", f"algorithm.k={k}")
    strategy = run_in_process(cfg, None, log=lines.append).strategy
    (line,) = [line for line in lines if line.startswith("k-means: local centres")]
    assert re.search(r"'d3' (\d+) \((\d+) rows\)", line) and f"not algorithm.k={k}" in line, line
    counts = {t: len(C) for t, C in strategy.local_centres.items()}
    for table, centres, rows in re.findall(r"'(\w+)' (\d+) \(([\d,]+) rows\)", line):
        assert counts[table] <= int(centres) == int(rows.replace(",", "")) // 20
    assert len(strategy.centres) == k and np.isfinite(strategy.results.history[-1].test_metric)


def test_a_table_of_fewer_rows_than_min_group_rows_is_one_line_naming_it():
    """A table whose rows in the join are fewer than min_group_rows releases no centre: the server refuses in one
    line naming it and the bound that fits, before any node clusters (k is not at fault)."""
    cfg = make_cfg("algorithm=kmeans", "dataset=synthetic", "min_group_rows=380")
    with pytest.raises(ValueError) as refused:
        run_in_process(cfg, None, log=quiet)
    line = str(refused.value)
    assert "\n" not in line, line
    assert line == (
        "k-means: table 'd3' has 354 rows in the join and each of its k-means centres covers at least "
        "min_group_rows = 380 of them (the owners' bound), so it releases no centre; set min_group_rows=354 or "
        "less (a deployed owner: in its settings file)"
    )


def test_full_kmeans_line_names_no_coreset(kmeans_run):
    """DistDim on the full join has no coreset: its record said coreset_rows=N coreset_m=N construction_bytes=0;
    coreset_kmeans keeps them."""
    extra = kmeans_run.strategy.results.history[-1].extra
    assert set(extra) == {"grid_cells"}, extra


def test_results_name_the_kmeans_model_not_the_unused_linear_default(kmeans_run):
    """results.json's model (and simulations.reproduce's labels: 'kmeans, linear') named model=linear, the
    default k-means leaves unused; it is 'kmeans', as boosted trees' is 'gbdt'."""
    assert kmeans_run.strategy.results.model == "kmeans"


def test_a_coreset_is_not_offered_larger_for_a_table_of_too_few_rows_in_the_join():
    """coreset_kmeans over a table with fewer rows in the whole join than min_group_rows (synthetic's d3: 354):
    no coreset makes it release a centre, so the line offers min_group_rows only (it said 'or a larger
    algorithm.m' too, as for gapminder's 5 continents)."""
    cfg = make_cfg("algorithm=coreset_kmeans", "dataset=synthetic", "min_group_rows=380", "algorithm.m=30")
    with pytest.raises(ValueError) as refused:
        run_in_process(cfg, None, log=quiet)
    line = str(refused.value)
    assert line.startswith("k-means: table 'd3' has ") and "rows in the coreset" in line, line
    assert "algorithm.m" not in line and "set min_group_rows=" in line, line
