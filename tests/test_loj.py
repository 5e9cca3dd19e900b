"""Learning over join: exactness against the centralized math, ADMM convergence, communication volumes.

These run the real strategy and client code in-process (strategies.transport.DirectTransport: the same records as
under Flower, without Ray); tests/test_flower.py runs the same code under Flower's simulation engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from strategies.centralized import exact_ridge, train_centralized
from simulations.federated import run_in_process
from tests.conftest import make_cfg
from tpflower.batches import BatchPlan, epoch_batches
from tpflower.owner import simulation_secret
from tpflower.relation import load_relation
from tpflower.results import new_run_results



def quiet(_line: str) -> None:
    pass


def run_federated(*overrides: str):
    return run_in_process(make_cfg(*overrides), None, log=quiet)


def run_centralized(*overrides: str):
    cfg = make_cfg("algorithm=centralized", *overrides)
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    results = new_run_results(cfg, "centralized", rel.spec, rel.mapping)
    model = train_centralized(cfg, rel, results, log=quiet)
    return rel, model, results


EXACT = ("model.init=zeros", "precision=float64", "epochs=3")


@pytest.mark.parametrize(
    "algorithm,dataset,batch",
    [
        ("sgd", "synthetic", "full"),
        ("vfl_sgd", "synthetic", "full"),
        ("sgd", "synthetic", "500"),  # mini-batches: the same shuffles, so the same trajectory
        ("sgd", "movielens", "full"),
        ("vfl_sgd", "movielens", "full"),
    ],
)
def test_tp_join_sgd_equals_centralized_gradient_descent(algorithm, dataset, batch):
    common = (*EXACT, f"dataset={dataset}", f"algorithm.batch_size={batch}", "algorithm.lr=0.2")
    fed = run_federated(f"algorithm={algorithm}", *common)
    rel, model, cen = run_centralized(*common)
    for t in rel.spec.table_names:
        theta = fed.theta((t, 0))
        np.testing.assert_allclose(theta["weight"], model.local[t].weight.detach().numpy(), rtol=1e-9, atol=1e-12)
        if "bias" in theta:
            np.testing.assert_allclose(theta["bias"], model.local[t].bias.detach().numpy(), rtol=1e-9, atol=1e-12)
    fed_hist, cen_hist = fed.strategy.results.history, cen.history
    np.testing.assert_allclose([h.test_metric for h in fed_hist], [h.test_metric for h in cen_hist], rtol=1e-9)
    np.testing.assert_allclose([h.train_loss for h in fed_hist], [h.train_loss for h in cen_hist], rtol=1e-9)
    assert abs(fed_hist[-1].train_loss - fed_hist[0].train_loss) > 1e-6  # it did move


#: fixed-rho ADMM on the raw label: no residual balancing, no stopping rule (their own tests: test_admm_convergence)
FIXED_RHO = ("algorithm.adapt_rho=false", "algorithm.tol=0", "standardize_label=false")


def admm_history(*overrides: str):
    return run_federated("algorithm=admm", "dataset=synthetic", "precision=float64", *FIXED_RHO,
                         *overrides).strategy.results.history


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


def test_admm_variants_reach_the_ridge_optimum_without_intercepts():
    cfg = make_cfg("dataset=synthetic", "model.bias=none", "standardize_label=false")
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    beta = float(cfg.model.beta)
    w, _ = exact_ridge(rel, beta, intercept=False)
    resid = rel.joined_features(rel.train) @ w - rel.labels(rel.train)
    optimum = 0.5 * np.mean(resid**2) + beta * 0.5 * np.sum(w**2)
    for variant in ("sharing", "paper"):
        hist = admm_history("epochs=80", "model.bias=none", f"algorithm.variant={variant}", "algorithm.rho=1.0")
        assert hist[-1].extra["objective"] == pytest.approx(optimum, rel=1e-8), variant


def test_tp_join_admm_and_vfl_admm_produce_the_same_iterates():
    common = ("dataset=synthetic", "precision=float64", "epochs=5", "model.bias=all")
    tp = run_federated("algorithm=admm", *common)
    vfl = run_federated("algorithm=vfl_admm", *common)
    np.testing.assert_allclose(
        [h.test_metric for h in tp.strategy.results.history], [h.test_metric for h in vfl.strategy.results.history], rtol=1e-6
    )
    for t in tp.strategy.spec.table_names:
        for name, value in tp.theta((t, 0)).items():
            np.testing.assert_allclose(value, vfl.theta((t, 0))[name], rtol=1e-6, atol=1e-9)


def test_mlp_admm_and_sgd_learn():
    for alg in ("admm", "sgd"):
        hist = run_federated(f"algorithm={alg}", "dataset=synthetic", "model=mlp", "epochs=4").strategy.results.history
        assert hist[-1].train_loss < hist[0].train_loss, alg


# ------------------------------------------------------------------------------------------ communication


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


NPY_HEADER = 128  # bytes np.save puts before each array's data


def expected_sgd_rows(strategy, seed: int, batch: int) -> int:
    """Rows predicted over one epoch: sum over batches of sum_i |U_i(B)|, plus the test rows, plus no more."""
    batches = epoch_batches(strategy.train.N, batch, np.random.default_rng(seed))
    rows = sum(len(u) for b in batches for u in BatchPlan.of(strategy.train, b).U.values())
    return rows + sum(len(u) for u in BatchPlan.of(strategy.test, np.arange(strategy.test.N)).U.values())


def test_sgd_bytes_per_batch_are_sum_U_i_vs_M_B():
    common = ("dataset=synthetic", "epochs=1", "algorithm.batch_size=2000", "seed=3")
    tp = run_federated("algorithm=sgd", *common).strategy
    vfl = run_federated("algorithm=vfl_sgd", *common).strategy
    M = len(tp.spec.table_names)
    tp_rows, vfl_rows = expected_sgd_rows(tp, 3, 2000), M * (vfl.train.N + vfl.test.N)  # VFL: duplicates included
    payload = {}
    for strategy, rows in ((tp, tp_rows), (vfl, vfl_rows)):
        expected = rows * strategy.d_out * 4
        rounds = strategy.results.history[-1].rounds
        up = strategy.results.history[-1].bytes_up
        # one array per client per round, plus the test predictions: np.save adds 128 bytes per array
        framing = NPY_HEADER * M * (rounds + 1)
        assert expected <= up <= expected + framing, (strategy.algorithm, up, expected)
        payload[strategy.algorithm] = up - framing
    assert payload["vfl_sgd"] / payload["tp_join_sgd"] == pytest.approx(vfl_rows / tp_rows, rel=0.01)
