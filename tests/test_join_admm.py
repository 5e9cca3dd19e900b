"""TP-Join-ADMM and VFL-ADMM: the same iterates, communication per epoch, and an ADMM that converges without
tuning: residual balancing (Boyd et al. 2011, Sec. 3.4.1), the stopping rule (Eq. 3.12), the label standardization, and MLPs that train with the shipped defaults."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simulations.federated import run_in_process
from strategies.anderson import Anderson
from strategies.centralized import exact_ridge, train_centralized
from strategies.join_admm import ADMMServer, Balancing, anderson_fit
from strategies.subspace import TableSubspace
from tests.conftest import make_cfg
from tests.test_join_sgd import run_federated
from tpflower.mapping import TableMapping
from tpflower.owner import simulation_secret
from tpflower.relation import load_relation
from tpflower.results import new_run_results

#: fixed-rho ADMM on the raw label: no residual balancing, no stopping rule (their own tests are above), the
#: paper's iteration (no Anderson acceleration: its own tests are below)
FIXED_RHO = ("algorithm.adapt_rho=false", "algorithm.tol=0", "standardize_label=false", "algorithm.anderson=0")


def admm_history(*overrides: str):
    return run_federated(
        "algorithm=admm", "dataset=synthetic", "precision=float64", *FIXED_RHO, *overrides
    ).strategy.results.history


def test_admm_sharing_decreases_objective_and_primal_residual():
    hist = admm_history("epochs=40", "model.bias=all", "algorithm.rho=1.0")
    obj = np.array([h.extra["objective"] for h in hist])
    res = np.array([h.extra["primal_residual"] for h in hist])
    # ADMM starts from x^0 = 0 (the first epoch's objective is already that of a fitted model)
    assert obj[-1] < obj[0] and res[-1] < 1e-2 * res[0]
    # ADMM is not monotone epoch by epoch; over windows of 10 epochs both fall
    assert np.all(np.diff(res[::10]) < 0) and res[-1] < res[-10]
    assert np.all(np.diff(obj[::10]) < 0) and obj[-1] <= obj[-10]


def test_admm_paper_variant_diverges_with_an_intercept_per_table():
    with pytest.raises(RuntimeError, match="diverged"):
        hist = admm_history("epochs=200", "model.bias=all", "algorithm.variant=paper", "algorithm.rho=1.0")
        assert hist[-1].extra["objective"] > 1e6  # not reached when the loss overflows first
        raise RuntimeError("diverged (objective exploded)")
    hist = admm_history("epochs=15", "model.bias=all", "algorithm.variant=paper", "algorithm.rho=1.0")
    objective = [h.extra["objective"] for h in hist]
    assert objective[-1] > 1e10 * objective[0]


def ridge_optimum_without_intercepts() -> float:
    """The ridge objective's minimum on the synthetic join (no intercepts, raw label), from the exact solution."""
    cfg = make_cfg("dataset=synthetic", "model.bias=none", "standardize_label=false")
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    beta = float(cfg.model.beta)
    w, _ = exact_ridge(rel, beta, intercept=False)
    resid = rel.joined_features(rel.train) @ w - rel.labels(rel.train)
    optimum = 0.5 * np.mean(resid**2) + beta * 0.5 * np.sum(w**2)
    return float(optimum)


def test_admm_variants_reach_the_ridge_optimum_without_intercepts():
    optimum = ridge_optimum_without_intercepts()
    for variant in ("sharing", "paper"):
        hist = admm_history("epochs=80", "model.bias=none", f"algorithm.variant={variant}", "algorithm.rho=1.0")
        assert hist[-1].extra["objective"] == pytest.approx(optimum, rel=1e-8), variant


def test_tp_join_admm_and_vfl_admm_produce_the_same_iterates():
    common = ("dataset=synthetic", "precision=float64", "epochs=5", "model.bias=all")
    tp = run_federated("algorithm=admm", *common)
    vfl = run_federated("algorithm=vfl_admm", *common)
    np.testing.assert_allclose(
        [h.test_metric for h in tp.strategy.results.history],
        [h.test_metric for h in vfl.strategy.results.history],
        rtol=1e-6,
    )
    for t in tp.strategy.spec.table_names:
        for name, value in tp.theta((t, 0)).items():
            np.testing.assert_allclose(value, vfl.theta((t, 0))[name], rtol=1e-6, atol=1e-9)


def per_epoch_up(results) -> float:
    h = results.history
    return (h[-1].bytes_up - h[-2].bytes_up) / 1.0


def test_admm_bytes_per_epoch_are_sum_n_i_vs_M_N():
    common = ("dataset=synthetic", "epochs=3")  # float32 payloads
    tp = run_federated("algorithm=admm", *common).strategy
    vfl = run_federated("algorithm=vfl_admm", *common).strategy
    sum_n = sum(tp.mapping.n_rows.values())
    M, N = len(tp.mapping.n_rows), tp.mapping.N
    for strategy, rows in ((tp, sum_n), (vfl, M * N)):
        expected = rows * strategy.d_out * 4
        up = per_epoch_up(strategy.results)
        down = strategy.results.history[-1].bytes_down - strategy.results.history[-2].bytes_down
        assert expected <= up < 1.05 * expected, (strategy.algorithm, up, expected)
        assert expected <= down < 1.05 * expected, (strategy.algorithm, down, expected)
    assert per_epoch_up(vfl.results) / per_epoch_up(tp.results) == pytest.approx(M * N / sum_n, rel=0.05)


def quiet(_line: str) -> None:
    pass


def federated(*overrides: str):
    return run_in_process(make_cfg(*overrides), None, log=quiet).strategy


def centralized(*overrides: str):
    cfg = make_cfg("algorithm=centralized", *overrides)
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    results = new_run_results(cfg, "centralized", rel.spec, rel.mapping)
    train_centralized(cfg, rel, results, log=quiet)
    return results


def synthetic(schema: str, scale: float) -> tuple[str, ...]:
    return ("dataset=synthetic", f"dataset.loader.schema={schema}", f"+dataset.loader.label_scale={scale}")


# ------------------------------------------------------------------------------------ residual balancing


def test_balancing_factor_is_boyd_eq_3_13():
    b = Balancing(mu=10.0, tau=2.0)
    assert b.factor(primal=11.0, dual=1.0) == 2.0  # primal > mu dual: rho up
    assert b.factor(primal=1.0, dual=11.0) == 0.5  # dual > mu primal: rho down
    assert b.factor(primal=10.0, dual=1.0) == 1.0 and b.factor(primal=1.0, dual=10.0) == 1.0


def test_a_persistent_imbalance_changes_rho_after_patience_iterations():
    """The stall: the residual ratio stays just under mu (10) for many iterations. With patience k, a ratio
    beyond mu_persistent in the same direction k times in a row changes rho; patience 0 is Boyd's rule alone."""
    b = Balancing(mu=10.0, tau=2.0, mu_persistent=2.0, patience=3)
    assert [b.factor(primal=9.0, dual=1.0) for _ in range(4)] == [1.0, 1.0, 2.0, 1.0]
    assert [b.factor(primal=1.0, dual=5.0) for _ in range(3)] == [1.0, 1.0, 0.5]
    # an interrupted run starts again: ratios flipping side never change rho
    assert {b.factor(primal=9.0 if k % 2 else 1.0, dual=1.0 if k % 2 else 9.0) for k in range(8)} == {1.0}
    old = Balancing(mu=10.0, tau=2.0)
    assert {old.factor(primal=9.0, dual=1.0) for _ in range(10)} == {1.0}


def test_over_relaxation_against_a_hand_computation():
    """Boyd Sec. 3.4.3: from the second update on, z and lambda see H^ = a H + (1 - a) z_prev."""
    mapping = TableMapping({"a": np.array([0, 1, 2]), "b": np.array([0, 0, 1])}, {"a": 3, "b": 2})
    y = np.array([1.0, -2.0, 0.5])
    rho, M, a = 2.0, 2, 1.6
    server = ADMMServer("regression", y, mapping, 1, rho, relax=a)
    z, lam, r = np.zeros(3), np.zeros(3), rho / M
    for k, h in enumerate(
        (
            {"a": np.array([[0.5], [0.1], [-0.3]]), "b": np.array([[0.2], [0.4]])},
            {"a": np.array([[0.9], [-1.0], [0.2]]), "b": np.array([[0.1], [0.3]])},
        )
    ):
        server.update(h)
        H = h["a"][mapping.p["a"], 0] + h["b"][mapping.p["b"], 0]
        H_hat = H if k == 0 else a * H + (1 - a) * z
        z = (y + lam + r * H_hat) / (1 + r)
        lam = lam + r * (H_hat - z)
        np.testing.assert_allclose(server.z[:, 0], z, rtol=1e-12)
        np.testing.assert_allclose(server.lam[:, 0], lam, rtol=1e-12)


def test_over_relaxed_admm_reaches_the_ridge_optimum():
    optimum = ridge_optimum_without_intercepts()
    hist = admm_history("epochs=80", "model.bias=none", "algorithm.relax=1.5", "algorithm.rho=1.0")
    assert hist[-1].extra["objective"] == pytest.approx(optimum, rel=1e-8)


def test_admm_server_residuals_and_rho_against_a_hand_computation():
    """Two tables, N = 3 joined rows (table b's row 0 used twice): the sharing problem's residuals (Boyd Sec. 3.3,
    7.3) computed by hand per table and joined row, and the rho change of Eq. 3.13 after the warm-up."""
    mapping = TableMapping({"a": np.array([0, 1, 2]), "b": np.array([0, 0, 1])}, {"a": 3, "b": 2})
    y = np.array([1.0, -2.0, 0.5])
    rho, M = 2.0, 2
    server = ADMMServer("regression", y, mapping, 1, rho, balancing=Balancing(10.0, 2.0, warmup=1), tol=0.1)
    # the paper's update (no over-relaxation) is what this hand computation follows
    h1 = {"a": np.array([[0.5], [0.1], [-0.3]]), "b": np.array([[0.2], [0.4]])}
    h2 = {"a": np.array([[0.9], [-1.0], [0.2]]), "b": np.array([[0.1], [0.3]])}
    # by hand, row by row
    z, lam, prev = np.zeros(3), np.zeros(3), None
    for _k, h in enumerate((h1, h2), start=1):
        res = server.update(h)
        x = {t: h[t][mapping.p[t], 0] for t in h}
        H = x["a"] + x["b"]
        r = rho / M
        z = (y + lam + r * H) / (1 + r)  # Eq. 7 (regression)
        lam = lam + r * (H - z)  # Eq. 8
        zi = {t: x[t] - H / M + z / M for t in x}  # the per-table copies of the sharing problem
        primal = math.sqrt(sum(np.sum((x[t] - zi[t]) ** 2) for t in x))
        assert res.primal == pytest.approx(primal, rel=1e-12)
        assert res.primal == pytest.approx(np.linalg.norm(H - z) / math.sqrt(M), rel=1e-12)
        if prev is None:
            assert res.dual is None and server.rho == rho  # no dual residual yet, rho unchanged
        else:
            dual = rho * math.sqrt(sum(np.sum((zi[t] - prev[t]) ** 2) for t in x))
            assert res.dual == pytest.approx(dual, rel=1e-12)
            eps_abs = math.sqrt(M * 3) * 0.1  # Eq. 3.12, eps_abs = eps_rel = tol, p = M N
            xs = math.sqrt(max(sum(np.sum(x[t] ** 2) for t in x), sum(np.sum(zi[t] ** 2) for t in x)))
            assert res.eps_primal == pytest.approx(eps_abs + 0.1 * xs, rel=1e-12)
            assert res.eps_dual == pytest.approx(eps_abs + 0.1 * math.sqrt(M) * np.linalg.norm(lam), rel=1e-12)
            expected = rho * (2.0 if primal > 10 * dual else 0.5 if dual > 10 * primal else 1.0)
            assert server.rho == pytest.approx(expected) and server.r == pytest.approx(expected / M)
            assert expected != rho  # the case exercises a change
        prev = zi
        np.testing.assert_allclose(server.z[:, 0], z, rtol=1e-12)
        np.testing.assert_allclose(server.lam[:, 0], lam, rtol=1e-12)  # unscaled duals: untouched by a new rho


# ------------------------------------------------------------------------------------ convergence goal


@pytest.mark.parametrize("schema", ["star", "chain", "snowflake"])
def test_shipped_defaults_reach_the_exact_ridge_within_one_percent_in_ten_epochs(schema):
    for scale in (1, 100, 10000):
        data = synthetic(schema, scale)
        exact = centralized(*data, "algorithm.solver=exact").history[-1].test_metric
        join = federated("algorithm=admm", *data, "epochs=10")
        assert join.results.history[-1].test_metric <= 1.01 * exact, (schema, scale)
        if scale == 10000:  # the union's inner consensus: within 1% of TP-Join-ADMM
            ucq = federated("algorithm=admm", "scenario=ucq", *data, "epochs=10")
            assert ucq.results.history[-1].test_metric <= 1.01 * join.results.history[-1].test_metric, schema


def test_metrics_are_in_the_labels_units():
    """Standardized training: the same run on the label in other units gives the metric in those units."""
    common = ("algorithm=admm", "precision=float64", "epochs=3", "algorithm.tol=0")
    one = federated(*common, *synthetic("star", 1)).results.history
    many = federated(*common, *synthetic("star", 10000)).results.history
    np.testing.assert_allclose([h.test_metric for h in many], [1e4 * h.test_metric for h in one], rtol=1e-6)
    np.testing.assert_allclose([h.train_loss for h in many], [1e8 * h.train_loss for h in one], rtol=1e-6)


def test_tol_stops_early_and_says_why():
    s = federated("algorithm=admm", *synthetic("star", 1), "epochs=60", "algorithm.tol=1e-3")
    assert s.results.stopped["reason"] == "tol" and s.results.stopped["epoch"] == len(s.results.history) < 60
    assert "primal residual" in s.results.stopped["detail"]
    last = s.results.history[-1].extra
    assert last["primal_residual"] > 0 and last["dual_residual"] > 0 and last["rho"] > 0
    never = federated("algorithm=admm", *synthetic("star", 1), "epochs=4", "algorithm.tol=0")
    assert never.results.stopped["reason"] == "epochs" and len(never.results.history) == 4


def test_adapt_rho_false_keeps_rho_fixed():
    s = federated(
        "algorithm=admm",
        *synthetic("chain", 1),
        "epochs=8",
        "algorithm.tol=0",
        "algorithm.rho=10",
        "algorithm.adapt_rho=false",
        "algorithm.anderson=0",
    )
    assert {h.extra["rho"] for h in s.results.history} == {10.0}
    adapted = federated(
        "algorithm=admm",
        *synthetic("chain", 1),
        "epochs=8",
        "algorithm.tol=0",
        "algorithm.rho=10",
        "algorithm.anderson=0",
    )
    assert adapted.results.history[-1].extra["rho"] < 10.0  # rho too large: balancing lowers it
    assert adapted.results.history[-1].test_metric < s.results.history[-1].test_metric


# ------------------------------------------------------------------------------------ MLPs with the defaults


@pytest.mark.parametrize("algorithm", ["centralized", "sgd", "admm"])
def test_mlp_does_not_diverge_on_a_label_in_grams(algorithm):
    data = synthetic("snowflake", 10000)
    if algorithm == "centralized":
        hist = centralized(*data, "model=mlp", "epochs=3").history
    else:
        hist = federated(f"algorithm={algorithm}", *data, "model=mlp", "epochs=3").results.history
    constant = 1e4 * 1.3  # well above the label's spread (std about 1.2e4): a diverged run is far beyond it
    assert all(np.isfinite(h.test_metric) and np.isfinite(h.train_loss) for h in hist)
    assert hist[-1].test_metric < constant and hist[-1].train_loss < hist[0].train_loss * 1.01


# ------------------------------------------------------------------------------------ Anderson acceleration


def test_anderson_solves_an_affine_fixed_point_in_n_plus_one_steps():
    """Full-memory type-II Anderson on G(w) = A w + b is GMRES on (I - A) w = b (Walker & Ni 2011): exact after
    about n + 1 evaluations in R^n (here n + 3: the Gram matrix's regularization), where the plain iteration is
    still far away."""
    rng = np.random.default_rng(0)
    n = 6
    Q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    A = Q @ np.diag(np.linspace(0.5, 0.95, n)) @ Q.T  # a contraction with slow modes
    b = rng.standard_normal(n)
    fixed = np.linalg.solve(np.eye(n) - A, b)
    aa = Anderson(n + 3)
    aa.restart([1.0])
    w = plain = np.zeros(n)
    for _ in range(n + 3):
        w = aa.step([w], [A @ w + b])[0]
        plain = A @ plain + b
    np.testing.assert_allclose(w, fixed, rtol=1e-8)
    assert np.linalg.norm(plain - fixed) > 0.1 * np.linalg.norm(fixed)
    assert aa.rejected == 0


def test_anderson_falls_back_to_the_plain_step_when_the_residual_grows():
    """The safeguard: an extrapolated iterate whose residual is not below the last accepted one is replaced by the
    plain step G(w) of the last accepted iterate w, and the window restarts."""
    aa = Anderson(3)
    aa.restart([1.0])
    g1 = [np.array([1.0, 0.0])]
    assert aa.step([np.zeros(2)], g1) is g1  # one pair: the plain step
    ext = aa.step(g1, [np.array([1.5, 0.5])])  # two pairs: an extrapolation
    assert aa.extrapolated
    fallback = aa.fallback
    out = aa.step(ext, [ext[0] + 100.0])  # its residual (100 sqrt 2) exceeds the accepted one's
    assert out is fallback and aa.rejected == 1 and not aa.extrapolated and aa.g == []


def anderson_admm(*overrides: str):
    return run_federated(
        "algorithm=admm",
        "dataset=synthetic",
        "precision=float64",
        "algorithm.adapt_rho=false",
        "algorithm.tol=0",
        "standardize_label=false",
        "model.bias=none",
        *overrides,
    ).strategy


def test_anderson_accelerated_admm_reaches_the_ridge_optimum():
    """The accelerated iteration has ADMM's fixed point: the exact ridge solution (float64) to 1e-9, from each
    variable the server holds; and it gets there in fewer epochs than the paper's iteration."""
    cfg = make_cfg("dataset=synthetic", "model.bias=none", "standardize_label=false")
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    w, _ = exact_ridge(rel, float(cfg.model.beta), intercept=False)
    H = rel.joined_features(rel.train) @ w
    optimum = ridge_optimum_without_intercepts()
    s = anderson_admm("epochs=60", "algorithm.anderson=10", "algorithm.rho=1.0")
    assert s.admm.anderson is not None and s.admm.anderson.accepted > 0
    assert s.results.history[-1].extra["objective"] == pytest.approx(optimum, rel=1e-9)
    np.testing.assert_allclose(s.admm.z[:, 0], H, rtol=0, atol=1e-9 * np.abs(H).max())
    np.testing.assert_allclose(s.admm.lam[:, 0], H - rel.labels(rel.train), rtol=0, atol=1e-9 * np.abs(H).max())
    gap = {}
    for m in (0, 10):
        hist = anderson_admm("epochs=15", f"algorithm.anderson={m}", "algorithm.rho=1.0").results.history
        gap[m] = hist[-1].extra["objective"] / optimum - 1
    assert gap[10] < 0.1 * gap[0], gap


def test_anderson_auto_applies_to_linear_models_over_a_join_without_feature_dp():
    s = federated("algorithm=admm", "dataset=synthetic", "epochs=2", "algorithm.subspace=0")
    assert s.admm.anderson is not None and s.admm.anderson.memory == 10
    assert s.admm.balancing is None and s.admm.rho == 1.0  # auto: fixed rho, AUTO_RHO_ANDERSON
    for overrides in (("model=mlp",), ("algorithm.variant=paper",), ("scenario=ucq",)):
        off = federated("algorithm=admm", "dataset=synthetic", "epochs=1", *overrides)
        assert off.admm.anderson is None, overrides
        assert off.admm.rho == 3.0 or "model=mlp" in overrides, overrides  # the paper's iteration's penalty
    assert federated("algorithm=admm", "dataset=synthetic", "epochs=1", "algorithm.anderson=0").admm.balancing


def test_anderson_memory_fits_its_budget():
    mapping = TableMapping({"a": np.arange(1000), "b": np.zeros(1000, dtype=np.int64)}, {"a": 1000, "b": 1})
    iterate = (1001 + 2 * 1000) * 8  # bytes of one iterate, d_c = 1, float64
    assert anderson_fit(mapping, 1, 8, 2 * 12 * iterate / 1e6) == 10  # 2 (m + 1) + 2 iterates
    assert anderson_fit(mapping, 1, 8, 2 * 3.5 * iterate / 1e6) == 1
    assert anderson_fit(mapping, 1, 8, 2 * 2.5 * iterate / 1e6) == 0


def test_anderson_over_a_union_is_refused_with_a_line():
    with pytest.raises(ValueError, match="algorithm.anderson=5 applies over a join"):
        federated("algorithm=admm", "dataset=synthetic", "scenario=ucq", "epochs=1", "algorithm.anderson=5")


def test_anderson_under_feature_dp_releases_nothing_new(monkeypatch):
    """Under feature DP (DP-SGD theta-updates) the acceleration is post-processing on the server of the outputs
    the nodes released: the nodes send the same messages (names, shapes, dtypes) and spend the same budget
    as without it, and the run still trains. Off by default there (auto), on when asked."""
    from tests.test_privacy_e2e import Recorded, same_entropy

    runs = {}
    for m in (0, 5):
        same_entropy(monkeypatch)
        runs[m] = Recorded("algorithm=admm", "privacy=dpsgd", "epochs=4", f"algorithm.anderson={m}")
    assert runs[5].strategy.admm.anderson is not None and runs[0].strategy.admm.anderson is None

    def shapes(rec):
        return [
            (k, phase, {n: (np.shape(v), np.asarray(v).dtype) for n, v in out.items()}) for k, phase, out, _ in rec.sent
        ]

    assert shapes(runs[5]) == shapes(runs[0])
    assert [set(m) for *_, m in runs[5].sent] == [set(m) for *_, m in runs[0].sent]
    assert runs[5].strategy.dp_plan == runs[0].strategy.dp_plan
    eps = {m: r.strategy.results.privacy["feature_epsilon"] for m, r in runs.items()}
    assert eps[5] == eps[0] and 0.98 <= eps[5] <= 1.0
    hist = runs[5].strategy.results.history
    assert hist[-1].train_loss < 0.85 * hist[0].train_loss
    auto = federated("algorithm=admm", "dataset=synthetic", "privacy=dpsgd", "epochs=1")
    assert auto.admm.anderson is None  # auto: off under feature DP (not measured there)


# ------------------------------------------------------------------------------------ subspace acceleration


def test_the_ritz_point_is_the_ridge_minimiser_over_each_tables_outputs():
    """TableSubspace recovers beta theta_k^T theta_j from (Y, h) pairs alone (the theta-update's normal
    equations) and returns the exact minimiser of the ridge objective over the span of each table's outputs."""
    rng = np.random.default_rng(3)
    n, d, N, beta = {"a": 40, "b": 7}, {"a": 3, "b": 2}, 120, 0.05
    p = {"a": rng.integers(0, 40, N), "b": rng.integers(0, 7, N)}
    mapping = TableMapping(p, n)
    X = {t: rng.normal(size=(n[t], d[t])) for t in n}
    y = rng.normal(size=N)
    sub = TableSubspace(3, mapping, y)
    thetas: dict[str, list[np.ndarray]] = {t: [] for t in n}
    for k in range(4):  # the first pair leaves the window of 3
        rho = [0.5, 1.0, 2.0, 4.0][k]
        Y, h = {}, {}
        for t in n:
            G = mapping.G(t).astype(float)
            Y[t] = rng.normal(size=(n[t], 1)) * (G > 0)[:, None]
            theta = -np.linalg.solve(rho * (X[t].T * G) @ X[t] / N + beta * np.eye(d[t]), X[t].T @ Y[t] / N)
            thetas[t].append(theta[:, 0])
            h[t] = X[t] @ theta
        sub.add(Y, h, rho)
    star = sub.point()
    # the same minimiser from the thetas themselves: min 1/(2N) ||sum_i T_i[p_i] Theta_i c_i - y||^2 + beta/2 ||.||^2
    A = np.concatenate([X[t][p[t]] @ np.stack(thetas[t][1:], axis=1) for t in n], axis=1)
    R = np.zeros((6, 6))
    for b, t in enumerate(n):
        Th = np.stack(thetas[t][1:], axis=1)
        R[3 * b : 3 * b + 3, 3 * b : 3 * b + 3] = beta * Th.T @ Th
    c = np.linalg.solve(A.T @ A / N + R, A.T @ y / N)
    for b, t in enumerate(n):
        expected = X[t] @ np.stack(thetas[t][1:], axis=1) @ c[3 * b : 3 * b + 3]
        np.testing.assert_allclose(star[t][:, 0], expected, rtol=1e-9, atol=1e-12)


def test_subspace_accelerated_admm_reaches_the_ridge_optimum():
    """Its fixed point is ADMM's: the exact ridge solution (float64) to 1e-9 from z and lambda; and within 1e-6 of
    the optimum's objective in 10 epochs, where the accelerations of the whole state are not."""
    cfg = make_cfg("dataset=synthetic", "model.bias=none", "standardize_label=false")
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    w, _ = exact_ridge(rel, float(cfg.model.beta), intercept=False)
    H = rel.joined_features(rel.train) @ w
    optimum = ridge_optimum_without_intercepts()
    s = anderson_admm("epochs=30", "algorithm.rho=1.0")
    assert s.admm.subspace is not None and s.admm.anderson is None and s.admm.subspace.memory == 10
    assert s.results.history[-1].extra["objective"] == pytest.approx(optimum, rel=1e-9)
    np.testing.assert_allclose(s.admm.z[:, 0], H, rtol=0, atol=1e-9 * np.abs(H).max())
    np.testing.assert_allclose(s.admm.lam[:, 0], H - rel.labels(rel.train), rtol=0, atol=1e-9 * np.abs(H).max())
    gap = {}
    for name, extra in (
        ("subspace", ()),
        ("anderson", ("algorithm.subspace=0",)),
        ("paper", ("algorithm.anderson=0",)),
    ):
        hist = anderson_admm("epochs=10", "algorithm.rho=1.0", *extra).results.history
        gap[name] = hist[-1].extra["objective"] / optimum - 1
    assert gap["subspace"] < 1e-6 and gap["subspace"] < 0.01 * min(gap["anderson"], gap["paper"]), gap


def test_subspace_auto_applies_to_linear_regression_over_a_join_without_feature_dp():
    s = federated("algorithm=admm", "dataset=synthetic", "epochs=2")
    assert s.admm.subspace is not None and s.admm.anderson is None and s.admm.balancing is None
    assert s.admm.rho == 1.0  # AUTO_RHO_ANDERSON: a fixed rho, as with Anderson acceleration
    for overrides in (
        ("model=mlp",),
        ("algorithm.variant=paper",),
        ("scenario=ucq",),
        ("algorithm.anderson=0",),  # the paper's iteration
        ("algorithm.anderson=5",),
        ("dataset=nycflights13_delayed",),  # binary: Anderson acceleration
    ):
        data = () if overrides[0].startswith("dataset=") else ("dataset=synthetic",)
        off = federated("algorithm=admm", *data, "epochs=1", *overrides)
        assert off.admm.subspace is None, overrides
    for overrides, match in (
        (("model=mlp",), "needs model=linear"),
        (("algorithm.variant=paper",), "needs algorithm.variant=sharing"),
        (("scenario=ucq",), "applies over a join"),
        (("algorithm.anderson=5",), "without anderson"),
    ):
        with pytest.raises(ValueError, match=match):
            federated("algorithm=admm", "dataset=synthetic", "epochs=1", "algorithm.subspace=5", *overrides)


def closed_form(X: np.ndarray, G: np.ndarray, Y: np.ndarray, N: int, rho: float, beta: float) -> np.ndarray:
    """Eq. 16's minimiser for a linear model with a bias, on the dense float64 [X, 1] (the reference)."""
    T = np.hstack([X.astype(np.float64), np.ones((len(X), 1))])
    return np.linalg.solve(rho / N * (T.T * G) @ T + beta * np.eye(T.shape[1]), -T.T @ Y / N)


@pytest.mark.parametrize("layout", ["one-hot", "dense"])
def test_the_closed_form_theta_update_holds_blocks_of_a_few_mb_of_a_wide_table(layout):
    """A table with a categorical column of many categories (nycflights13's flight number as one: 3,778 columns
    over 327,346 rows) made the theta-update a dense float64 Gram over chunks of 262,144 rows: 21 GB resident,
    166 s an epoch. Its T is now sparse (one-hot) or taken a few MB at a time (tpflower.design), and the update
    is the same minimiser to 1e-9."""
    import tracemalloc

    import torch

    from tpflower.design import Design
    from tpflower.phases.join_admm import admm_update_linear

    rng = np.random.default_rng(0)
    n, d = 30_000, 300
    if layout == "one-hot":
        X = np.zeros((n, d), dtype=np.float32)
        X[np.arange(n), rng.integers(0, d, n)] = 1.0
    else:
        X = rng.normal(size=(n, d)).astype(np.float32)
    G, Y = rng.integers(0, 3, n).astype(np.float64), rng.normal(size=(n, 2))
    model = torch.nn.Linear(d, 2, dtype=torch.float64)
    tracemalloc.start()
    T = Design(X, bias=True)
    admm_update_linear(model, T, G, Y, n, 1.0, 0.1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (T.sparse is not None) == (layout == "one-hot")
    assert peak < 100e6, peak  # was 2 x 72 MB: a float64 copy of every row of X and its G-weighted twin
    theta = np.vstack([model.weight.detach().numpy().T, model.bias.detach().numpy()])
    np.testing.assert_allclose(theta, closed_form(X, G, Y, n, 1.0, 0.1), rtol=1e-9, atol=1e-12)
