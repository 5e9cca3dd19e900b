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


def test_two_round_trips_per_iteration_and_no_vector_leaves_a_table():
    rec = Recorded("algorithm=pcg", "dataset=synthetic", "epochs=3")
    for key in rec.strategy.clients:  # 2 round trips per iteration, every table in both
        phases = [phase for k, phase, _, _ in rec.got if k == key]
        assert phases.count("pcg_apply") == phases.count("pcg_step") == 3
    for key, phase, arrays, _ in rec.sent:
        if phase in ("pcg_setup", "pcg_apply", "pcg_step"):
            n = rec.strategy.client_rows[key]
            for name, a in arrays.items():  # per-row outputs of the table's own rows, or a few scalars
                assert (name in ("h", "h_eval") and len(a) == n) or (name == "dots" and a.size <= 2), (phase, name)
    assert len(rec.strategy.results.history) == 3


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("dataset=nycflights13_delayed",), "needs a regression label"),
        (("model=mlp",), "model=linear"),
        (("privacy=dpsgd",), "cannot be honoured by algorithm 'tp_join_pcg'"),
        (("scenario=ucq",), "has no ucq version"),
    ],
)
def test_pcg_refuses_what_it_cannot_solve(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(make_cfg("algorithm=pcg", *overrides), None, log=quiet)
