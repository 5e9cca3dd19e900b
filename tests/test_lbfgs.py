"""L-BFGS over the join (tpflower/phases/lbfgs.py, strategies/lbfgs.py): the same iterates as a centralized
L-BFGS with the same line search on the materialized join, its blocks kept on the tables, its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from simulations.federated import run_in_process
from strategies.centralized import build_joined_model, label_scale_of
from strategies.lbfgs import two_loop
from tests.conftest import make_cfg
from tests.test_privacy_e2e import Recorded
from tpflower.app.server_app import make_strategy
from tpflower.losses import loss_torch
from tpflower.models import l2_penalty
from tpflower.owner import simulation_secret
from tpflower.relation import load_relation


def quiet(_: str) -> None:
    pass


def centralized_lbfgs(cfg, iterations: int) -> tuple[dict[str, torch.nn.Module], list[float]]:
    """Textbook L-BFGS (Nocedal & Wright Alg. 7.4 on vectors) with the strategy's line search and memory rules,
    on the materialized training join in float64: the reference the federated run must equal."""
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    task, beta, p = rel.spec.label.task, float(cfg.model.beta), cfg.algorithm
    model = build_joined_model(rel, cfg.model, int(cfg.seed), torch.float64)
    X = torch.as_tensor(rel.joined_features(rel.train), dtype=torch.float64)
    y = label_scale_of(cfg, rel).scaled(rel.labels(rel.train))
    y = torch.as_tensor(y, dtype=torch.long if task == "multiclass" else torch.float64)
    params = list(model.parameters())

    def objective(theta: torch.Tensor, grad: bool = False):
        torch.nn.utils.vector_to_parameters(theta, params)
        model.zero_grad()
        F = loss_torch(task, model(X), y) + beta * l2_penalty(model)
        if not grad:
            return float(F.detach())
        F.backward()
        return float(F.detach()), torch.cat([q.grad.reshape(-1) for q in params]).clone()

    theta = torch.nn.utils.parameters_to_vector(params).detach().clone()
    F, g = objective(theta, True)
    S, Yk, losses = [], [], [F]
    for _ in range(iterations):
        q, alphas = g.clone(), []
        for s, yk in reversed(list(zip(S, Yk))):
            a = float(s @ q) / float(s @ yk)
            q -= a * yk
            alphas.append(a)
        r = q * (float(S[-1] @ Yk[-1]) / float(Yk[-1] @ Yk[-1]) if S else 1.0)
        for (s, yk), a in zip(zip(S, Yk), reversed(alphas)):
            r += (a - float(yk @ r) / float(s @ yk)) * s
        d, t = -r, 1.0 if S else min(1.0, 1.0 / float(g.norm()))
        for _ in range(int(p.max_trials)):
            F_t = objective(theta + t * d)
            if F_t <= F + float(p.c1) * t * float(g @ d):
                break
            t *= float(p.backtrack)
        theta_new = theta + t * d
        F, g_new = objective(theta_new, True)
        s, yk = theta_new - theta, g_new - g
        if float(s @ yk) > np.finfo(float).eps * float(yk @ yk):
            S, Yk = (S + [s])[-int(p.memory) :], (Yk + [yk])[-int(p.memory) :]
        theta, g = theta_new, g_new
        losses.append(F)
    torch.nn.utils.vector_to_parameters(theta, params)
    return dict(model.local), losses


@pytest.mark.parametrize(
    "task,model",
    [("regression", "linear"), ("regression", "mlp"), ("binary", "linear"), ("multiclass", "mlp")],
)
def test_lbfgs_equals_centralized_lbfgs_on_the_materialized_join(task, model):
    iterations = 6
    cfg = make_cfg(
        "algorithm=lbfgs", "dataset=synthetic", f"dataset.loader.task={task}", f"model={model}",
        "precision=float64", "algorithm.tol=0", f"epochs={iterations}", "algorithm.memory=3",
    )  # fmt: skip
    run = run_in_process(cfg, None, log=quiet)
    local, losses = centralized_lbfgs(cfg, iterations)
    for t, module in local.items():
        theta = run.theta((t, 0))
        for name, value in module.state_dict().items():
            np.testing.assert_allclose(theta[name], value.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"{t}.{name}")
    objective = [h.extra["objective"] for h in run.strategy.results.history]
    scale = run.strategy.label_scale
    np.testing.assert_allclose(objective, [scale.loss(F) for F in losses[1:]], rtol=1e-9)
    assert losses[-1] < losses[0] and run.strategy.results.stopped["reason"] == "epochs"


def test_lbfgs_stops_on_tol_at_the_ridge_solution():
    results = run_in_process(make_cfg("algorithm=lbfgs", "dataset=synthetic", "epochs=30"), None, log=quiet)
    history = results.strategy.results
    assert history.stopped["reason"] == "tol" and len(history.history) < 30
    pcg = run_in_process(make_cfg("algorithm=pcg", "dataset=synthetic", "epochs=30"), None, log=quiet)
    assert history.history[-1].test_metric == pytest.approx(pcg.strategy.results.history[-1].test_metric, rel=1e-4)


def test_two_loop_on_the_gram_matrix_equals_the_vector_recursion():
    rng = np.random.default_rng(0)
    d, c = 7, 3
    S, Yk, g = rng.normal(size=(d, c)), rng.normal(size=(d, c)), rng.normal(size=d)
    Yk += 3 * S  # positive curvature
    B = np.column_stack([S, Yk, g])
    direction = B @ two_loop(B.T @ B, c, [0, 2])
    q, alphas = g.copy(), {}
    for j in (2, 0):
        alphas[j] = S[:, j] @ q / (S[:, j] @ Yk[:, j])
        q -= alphas[j] * Yk[:, j]
    r = q * (S[:, 2] @ Yk[:, 2]) / (Yk[:, 2] @ Yk[:, 2])
    for j in (0, 2):
        r += (alphas[j] - Yk[:, j] @ r / (S[:, j] @ Yk[:, j])) * S[:, j]
    np.testing.assert_allclose(direction, -r, rtol=1e-12)


def test_no_block_leaves_a_table_only_outputs_and_inner_products():
    rec = Recorded("algorithm=lbfgs", "dataset=synthetic", "epochs=3", "algorithm.memory=2")
    for key, phase, arrays, _ in rec.sent:
        if phase.startswith("lbfgs_"):
            n = rec.strategy.client_rows[key]
            for name, a in arrays.items():  # per-row outputs of the table's own rows, or its partial Gram matrix
                assert (name == "h" and len(a) == n) or (name == "gram" and a.shape[0] == a.shape[1] <= 7), name
    for key in rec.strategy.clients:
        phases = [phase for k, phase, _, _ in rec.got if k == key]
        assert phases.count("lbfgs_grad") == 3 and phases.count("lbfgs_trial") >= 3
    assert len(rec.strategy.results.history) == 3


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("privacy=dpsgd",), "cannot be honoured by algorithm 'tp_join_lbfgs'"),
        (("scenario=ucq",), "has no ucq version"),
        (("algorithm.backtrack=1",), "algorithm.backtrack must be in \\(0, 1\\)"),
    ],
)
def test_lbfgs_refuses_what_it_cannot_do(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(make_cfg("algorithm=lbfgs", *overrides), None, log=quiet)
