"""Preconditioned conjugate gradient over the join (tpflower/phases/pcg.py, strategies/pcg.py): it reaches the
exact ridge solution on the materialized join, keeps its vectors on the tables, and refuses what it cannot do."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.federated import run_in_process
from strategies.centralized import exact_ridge
from tests.conftest import make_cfg
from tests.test_privacy_e2e import Recorded
from tpflower.app.server_app import make_strategy
from tpflower.owner import simulation_secret
from tpflower.phases.pcg import PCGState
from tpflower.relation import has_bias, load_relation


def quiet(_: str) -> None:
    pass


@pytest.mark.parametrize("dataset", ["synthetic", "movielens"])
def test_pcg_reaches_the_exact_ridge_solution_over_the_join(dataset):
    cfg = make_cfg("algorithm=pcg", f"dataset={dataset}", "precision=float64", "algorithm.tol=1e-12", "epochs=60")
    run = run_in_process(cfg, None, log=quiet)
    s = run.strategy
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    label = rel.spec.label_table
    w, b = exact_ridge(rel, float(cfg.model.beta), True, s.label_scale)
    start = 0
    for t in rel.spec.table_names:
        width = rel.tables[t].width
        theta = run.theta((t, 0))
        np.testing.assert_allclose(theta["weight"].ravel(), w[start : start + width], rtol=1e-8, atol=1e-9)
        if has_bias(cfg.model, t, label):
            np.testing.assert_allclose(theta["bias"], [b], rtol=1e-8, atol=1e-9)
        start += width
    history = s.results.history
    assert s.results.stopped["reason"] == "tol" and len(history) < 60
    residuals = [h.extra["relative_residual"] for h in history]
    assert residuals[-1] <= 1e-12
    exact = run_in_process(make_cfg("algorithm=admm", f"dataset={dataset}", "precision=float64"), None, log=quiet)
    assert history[-1].test_metric <= exact.strategy.results.history[-1].test_metric * (1 + 1e-3)


def test_one_round_trip_per_iteration_and_no_vector_leaves_a_table():
    rec = Recorded("algorithm=pcg", "dataset=synthetic", "epochs=3", "algorithm.tol=0")
    train_rounds = [r for r in rec.strategy.results.history]
    assert len(train_rounds) == 3
    for key in rec.strategy.clients:  # 1 round trip per iteration, every table in it
        phases = [phase for k, phase, _, _ in rec.got if k == key]
        assert phases.count("pcg_step") == 3 and "pcg_partial" not in phases
    for key, phase, arrays, _ in rec.sent:
        if phase in ("pcg_setup", "pcg_step"):
            n = rec.strategy.client_rows[key]
            for name, a in arrays.items():  # per-row outputs of the table's own rows, or a few scalars
                assert (name in ("h", "h_eval") and len(a) == n) or (name == "dots" and a.size == 4), (phase, name)
    # the rounds between the first and the last training iteration: exactly one per iteration
    rounds = [h.rounds for h in rec.strategy.results.history]
    assert rounds[2] - rounds[1] == rounds[1] - rounds[0] == 1


def materialized_solution(rec: Recorded) -> tuple[dict, dict]:
    """The exact weighted ridge solution on the materialized problem, built from the clients' own preprocessed
    rows (shards put back together), and the federated theta of every table (its first shard's PCG state)."""
    s = rec.strategy
    blocks, thetas = [], {}
    for t, router in s.routers.items():
        X = router.gather_all({q: rec.client((t, q)).rows_X(None) for q in router.shards})
        st = PCGState.load(rec.client((t, router.shards[0])).state)
        thetas[t] = st.theta
        T = np.concatenate([X, np.ones((len(X), 1))], axis=1) if len(st.theta) > X.shape[1] else X
        p = s.S.p[t] if hasattr(s, "S") else s.train.p[t]
        blocks.append(T[p].astype(np.float64))
    A = np.concatenate(blocks, axis=1)
    w = np.ones(len(A)) if s.pcg_w is None else s.pcg_w
    lhs = (A.T * w) @ A / s.pcg_N + float(s.cfg.model.beta) * np.eye(A.shape[1])
    solution = np.linalg.solve(lhs, (A.T * w) @ s.pcg_y / s.pcg_N)
    out, start = {}, 0
    for t in s.routers:
        out[t] = solution[start : start + len(thetas[t])]
        start += len(thetas[t])
    return out, thetas


@pytest.mark.parametrize(
    "overrides",
    [("algorithm=pcg",), ("algorithm=pcg", "scenario=ucq"), ("algorithm=coreset", "algorithm.train=pcg")],
    ids=["join", "union", "coreset"],
)
def test_d_plus_one_iterations_reach_the_exact_ridge_solution(overrides):
    """PCG after d + 1 iterations (d = the number of parameters) equals the exact (weighted) ridge solution on
    the materialized join, union or coreset to 1e-8 in float64."""
    d = 4 * 4 + 1  # synthetic: fact, d1, d2, d3 with 4 features each, the label table's intercept
    rec = Recorded(*overrides, "dataset=synthetic", "precision=float64", "algorithm.tol=0", f"epochs={d + 1}")
    exact, theta = materialized_solution(rec)
    assert sum(len(v) for v in theta.values()) == d
    for t in exact:
        np.testing.assert_allclose(theta[t], exact[t], rtol=1e-8, atol=1e-10 * np.abs(exact[t]).max())
    if "scenario=ucq" in overrides:  # the shards of a sharded table hold the same block, their partial products
        for t, router in rec.strategy.routers.items():  # summed by the server once per iteration
            for q in router.shards:
                np.testing.assert_array_equal(PCGState.load(rec.client((t, q)).state).theta, theta[t])
            phases = [phase for k, phase, _, _ in rec.got if k == (t, router.shards[0])]
            assert phases.count("pcg_partial") == (d + 1 if len(router.shards) > 1 else 0)
            assert phases.count("pcg_gram") == (1 if len(router.shards) > 1 else 0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("dataset=nycflights13_delayed",), "needs a regression label"),
        (("model=mlp",), "model=linear"),
        (("privacy=dpsgd",), "cannot be honoured by algorithm 'tp_join_pcg'"),
        (("scenario=ucq", "model=mlp"), "model=linear"),
    ],
)
def test_pcg_refuses_what_it_cannot_solve(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(make_cfg("algorithm=pcg", *overrides), None, log=quiet)
