"""ADMM that converges without tuning: residual balancing (Boyd et al. 2011, Sec. 3.4.1), the
stopping rule (Eq. 3.12), the label standardization, and MLPs that train with the shipped defaults."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies.centralized import train_centralized
from simulations.federated import run_in_process
from tests.conftest import make_cfg
from strategies.join_admm import ADMMServer, Balancing
from tpflower.mapping import TableMapping
from tpflower.owner import simulation_secret
from tpflower.relation import load_relation
from tpflower.results import new_run_results


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


def test_admm_server_residuals_and_rho_against_a_hand_computation():
    """Two tables, N = 3 joined rows (table b's row 0 used twice): the sharing problem's residuals (Boyd Sec. 3.3,
    7.3) computed by hand per table and joined row, and the rho change of Eq. 3.13 after the warm-up."""
    mapping = TableMapping({"a": np.array([0, 1, 2]), "b": np.array([0, 0, 1])}, {"a": 3, "b": 2})
    y = np.array([1.0, -2.0, 0.5])
    rho, M = 2.0, 2
    server = ADMMServer("regression", y, mapping, 1, rho, balancing=Balancing(10.0, 2.0, warmup=1), tol=0.1)
    h1 = {"a": np.array([[0.5], [0.1], [-0.3]]), "b": np.array([[0.2], [0.4]])}
    h2 = {"a": np.array([[0.9], [-1.0], [0.2]]), "b": np.array([[0.1], [0.3]])}
    # by hand, row by row
    z, lam, prev = np.zeros(3), np.zeros(3), None
    for k, h in enumerate((h1, h2), start=1):
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
    s = federated("algorithm=admm", *synthetic("chain", 1), "epochs=8", "algorithm.tol=0", "algorithm.rho=10",
                  "algorithm.adapt_rho=false")
    assert {h.extra["rho"] for h in s.results.history} == {10.0}
    adapted = federated("algorithm=admm", *synthetic("chain", 1), "epochs=8", "algorithm.tol=0", "algorithm.rho=10")
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
