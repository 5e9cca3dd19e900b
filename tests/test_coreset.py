"""Coresets for VFL over joins (Huang et al., "Coresets for Vertical Federated Learning", NeurIPS 2022,
Alg. 1-3; docs/algorithms.md).

DIS over the join against DIS on the materialized join (float64, the synthetic many-to-many snowflake), the
unbiasedness of the weighted coreset loss, the construction's message count, the weighted ADMM against row
repetition, the payload audit and the settings checks."""

from __future__ import annotations

import re

import numpy as np
import pytest

from simulations.federated import run_in_process
from strategies.coreset import WeightedADMMServer, joined_sampling_probabilities, uniform_joined_rows
from strategies.join_admm import ADMMServer
from tests.conftest import make_cfg
from tests.test_privacy_e2e import Recorded, assert_absent, raw_columns
from tpflower.app.server_app import make_strategy
from tpflower.mapping import TableMapping
from tpflower.phases import coreset as cs
from tpflower.phases.coreset import DISState
from tpflower.relation import has_bias

F64 = "precision=float64"


def quiet(_: str) -> None:
    pass


def ridge_leverage_rows(A: np.ndarray, lam: float) -> np.ndarray:
    """Row i of A: a_i^T (A^T A + lam I)^+ a_i from a thin SVD of the (materialized) matrix A itself."""
    U, sv, _ = np.linalg.svd(A, full_matrices=False)
    r = int(np.sum(sv > sv[0] * max(A.shape) * np.finfo(float).eps))
    return (U[:, :r] ** 2) @ (sv[:r] ** 2 / (sv[:r] ** 2 + lam))


def materialized_sensitivities(rec: Recorded) -> np.ndarray:
    """Alg. 2 on the MATERIALIZED training join: per table the (ridge) leverage scores of A_i = T_i[p_i] (the
    label owner's [X, 1, y], its extra columns divided by their root mean square over the joined rows), from a
    thin SVD of the N x d_i matrix, summed over tables, + 1/N; lam = leverage_ridge N / m."""
    s, train = rec.strategy, rec.strategy.train
    N = train.N
    lam = cs.ridge_lambda(s.params.leverage_ridge, N, s.params.m)
    total = np.full(N, 1.0 / N)
    for t, p in train.p.items():
        client = rec.client((t, 0))
        A = np.asarray(client.local.X, dtype=np.float64)[p]
        if t == s.spec.label_table:
            extra = ([np.ones(N)] if has_bias(rec.cfg.model, t, t) else []) + [client.data.y[p].reshape(-1)]
            A = np.column_stack([A] + [e / np.sqrt(np.mean(e * e)) for e in extra])
        total += ridge_leverage_rows(A, lam)
    return total


@pytest.fixture(scope="module")
def dis_run() -> Recorded:
    return Recorded("algorithm=coreset", F64, "epochs=2", "algorithm.m=500")


@pytest.mark.parametrize("lam", [0.0, 30.0])
def test_leverage_over_the_join_equals_the_materialized_join(dis_run, lam):
    """Plain (lam = 0, Alg. 2) and ridge leverage scores from the n_i table rows and G_i equal the scores of
    the materialized join's block T_i[p_i]; per table they sum to its rank / its statistical dimension."""
    rec = dis_run
    train = rec.strategy.train
    for t, p in train.p.items():
        client = rec.client((t, 0))
        X, G = np.asarray(client.local.X, dtype=np.float64), train.G(t)
        g = cs.leverage_sensitivities(X, G, lam=lam)
        np.testing.assert_allclose(g[p], ridge_leverage_rows(X[p], lam), rtol=1e-9, atol=1e-12)
        sv = np.linalg.svd(X[p], compute_uv=False)
        sv = sv[sv > sv[0] * max(X[p].shape) * np.finfo(float).eps]
        assert abs(np.dot(G, g) - np.sum(sv**2 / (sv**2 + lam))) < 1e-9
        assert (np.dot(G, g) < len(sv)) if lam else (abs(np.dot(G, g) - len(sv)) < 1e-9)
        assert (g[G == 0] == 0).all()


def test_ridge_leverage_ignores_the_label_units():
    """The label owner's y column is scaled to unit root mean square first: y x 10,000 gives the same scores
    (plain leverage scores never depended on it)."""
    rng = np.random.default_rng(0)
    X, G, y = rng.normal(size=(50, 3)), rng.integers(0, 4, 50).astype(float), rng.normal(size=50) + 3
    for lam in (0.0, 20.0):
        a = cs.leverage_sensitivities(X, G, np.column_stack([np.ones(50), y]), lam)
        b = cs.leverage_sensitivities(X, G, np.column_stack([np.ones(50), 1e4 * y]), lam)
        np.testing.assert_allclose(a, b, rtol=1e-9)


def test_dis_over_the_join_gives_the_materialized_probabilities_and_weights(dis_run):
    rec, s = dis_run, dis_run.strategy
    g_mat = materialized_sensitivities(rec)
    G_mat, m = g_mat.sum(), 500
    # the clients' sensitivities, per table row, and the protocol's distribution of one draw over joined rows
    g_tab = {t: DISState.load(rec.client((t, 0)).state).g for t in s.train.p}
    np.testing.assert_allclose(joined_sampling_probabilities(s.train, g_tab), g_mat / G_mat, rtol=1e-9)
    # what the protocol did: two-stage draw (multinomial over tables, then G_iu g_u / G^(i), then uniform in
    # G_i(u)); its one-draw marginal, from the clients' own sampling distributions, is g_j / G
    P = np.zeros(s.train.N)
    totals = {t: cs.local_total(s.train.G(t), g_tab[t]) for t in g_tab}
    for t, p in s.train.p.items():
        G_t = s.train.G(t)
        P += totals[t] / sum(totals.values()) * cs.sampling_probabilities(G_t, g_tab[t])[p] / G_t[p]
    np.testing.assert_allclose(P, g_mat / G_mat, rtol=1e-9)
    # round 3: the sensitivities and weights of the drawn joined rows
    j = s.dis_joined
    assert len(j) == m
    np.testing.assert_allclose(s.dis_g, g_mat[j], rtol=1e-9)
    w = np.bincount(np.unique(j, return_inverse=True)[1].reshape(-1), weights=G_mat / (m * g_mat[j]))
    np.testing.assert_allclose(s.coreset.weights, w, rtol=1e-9)
    np.testing.assert_array_equal(s.coreset.rows, np.unique(j))
    assert abs(s.coreset.total - G_mat) < 1e-9 * G_mat


def test_mixing_in_uniform_sampling_gives_the_mixture_over_the_join():
    """algorithm.mix: each table shifts its own sensitivities by mix G^(i) / N, so one draw picks joined row j
    with (1 - mix) g_j / G + mix / N (float64, against the materialized join's leverage scores)."""
    rec = Recorded("algorithm=coreset", F64, "epochs=1", "algorithm.m=200", "algorithm.mix=0.3")
    s = rec.strategy
    g_mat = materialized_sensitivities(rec)
    g_tab = {t: DISState.load(rec.client((t, 0)).state).g for t in s.train.p}
    want = 0.7 * g_mat / g_mat.sum() + 0.3 / s.train.N
    np.testing.assert_allclose(joined_sampling_probabilities(s.train, g_tab), want, rtol=1e-9)
    assert (
        s.coreset.weights.max()
        <= s.train.N
        / (0.3 * 200)
        * (1 + 1e-9)
        * np.bincount(np.unique(s.dis_joined, return_inverse=True)[1].reshape(-1)).max()
    )  # a draw's weight <= N / (mix m)


def test_the_two_stage_sampler_draws_the_joined_distribution():
    """Empirically, on a small many-to-many join: multinomial over tables, G_iu g_u / G^(i) per table, then a
    uniform joined row of G_i(u), gives P(j) = sum_i g^(i)_{p_i(j)} / G (chi-square over the joined rows)."""
    rng = np.random.default_rng(0)
    p = {"a": np.array([0, 0, 1, 1, 2, 2, 2, 3]), "b": np.array([0, 1, 0, 1, 0, 1, 2, 2])}
    n_rows = {"a": 4, "b": 3}
    mapping = TableMapping(p, n_rows)
    g = {"a": np.array([0.5, 1.0, 0.2, 2.0]), "b": np.array([0.1, 0.7, 1.5])}
    expected = joined_sampling_probabilities(mapping, g)
    totals = np.array([cs.local_total(mapping.G(t), g[t]) for t in p])
    draws = 200_000
    counts = np.zeros(mapping.N)
    a = rng.multinomial(draws, totals / totals.sum())
    for (t, p_t), a_t in zip(p.items(), a):
        base = cs.draw_base_rows(mapping.G(t), g[t], a_t, rng)
        counts += np.bincount(uniform_joined_rows(p_t, n_rows[t], base, rng), minlength=mapping.N)
    chi2 = float((((counts - draws * expected) ** 2) / (draws * expected)).sum())
    assert chi2 < 24.3  # 7 degrees of freedom: p = 0.001


@pytest.mark.parametrize("sampling", ["sensitivity", "uniform"])
def test_the_weighted_coreset_loss_is_unbiased(dis_run, sampling):
    """For a fixed model, sum_{draws} w_j l_j estimates sum_j l_j without bias: the mean of 400 independent
    coresets (m = 200) is within 4 standard errors of the full join's loss."""
    rec, s = dis_run, dis_run.strategy
    N, m, reps = s.train.N, 200, 400
    rng = np.random.default_rng(1)
    H = rng.normal(size=N) * 0.5  # any fixed predictions
    loss = 0.5 * (H - s.y_train) ** 2
    if sampling == "sensitivity":
        P = materialized_sensitivities(rec)
        P = P / P.sum()
    else:
        P = np.full(N, 1.0 / N)
    est = np.empty(reps)
    for r in range(reps):
        j = rng.choice(N, size=m, p=P)
        est[r] = np.sum(loss[j] / (m * P[j]))  # w_j = G / (m g_j) = 1 / (m P(j))
    se = est.std(ddof=1) / np.sqrt(reps)
    assert abs(est.mean() - loss.sum()) < 4 * se


def test_construction_sends_at_most_2T_plus_m_plus_2mT_numbers_at_most_T_plus_3mT(dis_run):
    """Round 3 asks each table about the DISTINCT rows p_i(j), j in S (n_i^S <= m): 2T + m + 2 sum_i n_i^S
    numbers, at most 2T + m + 2mT (every drawn joined row distinct in every table), at most the paper's T + 3mT."""
    rec, s = dis_run, dis_run.strategy
    T, m = len(s.clients), 500
    dis = {"sensitivity", "sample", "weigh"}
    down = sum(a.size for _, ph, arrays, _ in rec.got if ph in dis for n, a in arrays.items() if n != "G")
    up = sum(a.size for _, ph, arrays, _ in rec.sent if ph in dis for a in arrays.values())
    distinct = sum(len(np.unique(p[s.dis_joined])) for p in s.train.p.values())
    assert down + up == 2 * T + m + 2 * distinct <= 2 * T + m + 2 * m * T <= T + 3 * m * T
    assert distinct < m * T  # the fact table's rows repeat across draws here: the dedup saves traffic
    G_sent = sum(arrays["G"].size for _, ph, arrays, _ in rec.got if ph == "sensitivity")
    assert G_sent == sum(s.mapping.n_rows.values())  # the join's extra: G_i, once, in the narrowest uint
    assert s.construction["rounds"] == 3


@pytest.mark.parametrize(
    "overrides",
    [("algorithm.train=admm",), ("algorithm.train=sgd", "epochs=2"), ("algorithm.sampling=uniform",)],
    ids=["admm", "sgd", "uniform"],
)
def test_no_feature_or_key_column_leaves_a_client(overrides):
    rec = Recorded("algorithm=coreset", "algorithm.m=300", *overrides)
    keys, features, _ = raw_columns(rec)
    assert_absent(rec, keys)
    assert_absent(rec, features)
    phases = {p for _, p, _, _ in rec.sent}
    assert ("sensitivity" in phases) == ("algorithm.sampling=uniform" not in overrides)
    assert np.isfinite(rec.strategy.results.history[-1].test_metric)


def test_weighted_admm_equals_tp_join_admm_on_repeated_rows():
    """Integer weights w_j: the weighted ADMM's Y_i and G_i equal TP-Join-ADMM's on the rows repeated w_j
    times, epoch after epoch (float64)."""
    rng = np.random.default_rng(3)
    n = {"a": 5, "b": 4}
    p = {"a": rng.integers(0, 5, 30), "b": rng.integers(0, 4, 30)}
    w = rng.integers(1, 4, 30)
    y = rng.normal(size=30)
    weighted = WeightedADMMServer("regression", y, TableMapping(p, n), 1, 2.0, "sharing", w.astype(float))
    rep = np.repeat(np.arange(30), w)
    plain = ADMMServer("regression", y[rep], TableMapping({t: v[rep] for t, v in p.items()}, n), 1, 2.0, "sharing")
    for t in n:
        np.testing.assert_allclose(weighted.G()[t], plain.G()[t])
    h = {t: rng.normal(size=(n[t], 1)) for t in n}
    for _ in range(5):
        Yw, Yp = weighted.step(h), plain.step(h)
        for t in n:
            np.testing.assert_allclose(Yw[t], Yp[t], rtol=1e-12, atol=1e-12)
        h = {t: h[t] - 0.1 * Yw[t] for t in n}  # any next predictions, the same for both


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.m=0", "algorithm.m must be an integer >= 1"),
        ("algorithm.train=lbfgs", "algorithm.train must be one of"),
        ("algorithm.sampling=leverage", "algorithm.sampling must be one of"),
        ("algorithm.mix=1.5", "algorithm.mix must be in \\[0, 1\\]"),
        ("algorithm.leverage_ridge=-1", "algorithm.leverage_ridge must be >= 0"),
    ],
)
def test_bad_settings_are_refused_before_any_node(override, message):
    with pytest.raises(ValueError, match=message):
        make_strategy(make_cfg("algorithm=coreset", "dataset=synthetic", override), None, log=quiet)


@pytest.mark.parametrize("algorithm", ["coreset", "coreset_kmeans"])
def test_an_explicit_m_beyond_the_owners_group_bound_is_one_line_from_the_server(algorithm):
    """algorithm.m larger than N / min_group_rows: the server says so once, with the largest m it may ask for,
    before any node is asked for sensitivities (each node refused it: one line per table, each naming its
    table twice)."""
    cfg = make_cfg(f"algorithm={algorithm}", "dataset=synthetic", "epochs=1", "algorithm.m=100000")
    with pytest.raises(ValueError) as refused:
        run_in_process(cfg, None, log=quiet)
    line = str(refused.value)
    assert "\n" not in line, line
    assert re.match(r"algorithm\.m=100000: a coreset of the join's \d+ rows has at most \d+ rows", line), line
    assert "set algorithm.m=" in line


def test_train_pcg_with_an_mlp_is_one_line_before_any_node():
    """algorithm.train=pcg solves the linear normal equations: with model=mlp every node refused it in a line of
    its own (four on synthetic); the server now says it once, naming the trainers that take an MLP."""
    cfg = make_cfg("algorithm=coreset", "dataset=synthetic", "algorithm.train=pcg", "model=mlp")
    with pytest.raises(ValueError, match=r"^algorithm.train=pcg solves linear ridge regression .*train=admm"):
        make_strategy(cfg, None, log=quiet)


def test_the_coreset_is_said_once_and_its_numbers_stay_out_of_the_epoch_lines():
    """Its size and construction traffic are the same every epoch: one line once it is built (each epoch line
    repeated coreset_rows=665 coreset_m=680 construction_rounds=3 construction_bytes=2.086e+04); results.json
    keeps them in every history entry."""
    lines: list[str] = []
    run = run_in_process(make_cfg("algorithm=coreset", "dataset=synthetic", "epochs=2"), None, log=lines.append)
    said = [line for line in lines if line.startswith("coreset: ")]
    assert len(said) == 1 and re.match(
        r"coreset: m=680 draws \(DIS\) over 13,600 joined rows, [\d,]+ distinct", said[0]
    )
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 2 and not any("coreset_" in line or "construction_" in line for line in epochs), epochs
    assert run.strategy.results.history[-1].extra["coreset_m"] == 680


def test_coreset_ridge_refuses_a_classification_label():
    with pytest.raises(ValueError, match="trains ridge regression"):
        make_strategy(make_cfg("algorithm=coreset", "dataset=nycflights13_delayed"), None, log=quiet)


# ------------------------------------------------------------------------------------------------ k-means


def test_a_coreset_trains_under_label_dp_on_the_released_labels_only():
    """privacy=label: the coreset is built and trained on the randomized training labels the label owner
    released; its evaluation is the label owner's DP release; no label vector is in any payload."""
    rec = Recorded("algorithm=coreset", "epochs=2", "privacy=label", "privacy.label_range=[-20,20]")
    results = rec.strategy.results
    assert len(results.history) == 2 and np.isfinite(results.history[-1].test_metric)
    assert results.privacy["label_epsilon"] == pytest.approx(5.66, abs=0.01)
    assert "evaluate" in {phase for _, phase, _, _ in rec.sent}
    assert_absent(rec, raw_columns(rec)[2])
