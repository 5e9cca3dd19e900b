"""L-BFGS over the join and the union (tpflower/phases/lbfgs.py, strategies/lbfgs.py): the same iterates as a
centralized L-BFGS with the same line search on the materialized join, its blocks kept on the tables (the
union: the shards' partial gradients to the coordinator, once per iteration), its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from simulations.federated import run_in_process
from strategies.centralized import build_joined_model, label_scale_of
from strategies.lbfgs import shard_gram, two_loop
from tests.conftest import make_cfg
from tests.test_conformance import call
from tests.test_curious_server import hello, node, refused
from tests.test_privacy_e2e import Recorded
from tpflower.app.client_app import app as deployed_app
from tpflower.app.client_app import client_app_for
from tpflower.app.server_app import make_strategy
from tpflower.config import compose_config
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
    "task,model,scenario",
    [
        ("regression", "linear", "join"),
        ("regression", "mlp", "join"),
        ("binary", "linear", "join"),
        ("multiclass", "mlp", "join"),
        ("regression", "linear", "ucq"),
        ("regression", "mlp", "ucq"),
        ("binary", "linear", "ucq"),
        ("multiclass", "mlp", "ucq"),
    ],
)
def test_lbfgs_equals_centralized_lbfgs_on_the_materialized_join(task, model, scenario):
    """Over the union (fact and d1 in 2 shards each) every shard holds the centralized iterate."""
    iterations = 6
    cfg = make_cfg(
        "algorithm=lbfgs", "dataset=synthetic", f"dataset.loader.task={task}", f"model={model}",
        "precision=float64", "algorithm.tol=0", f"epochs={iterations}", "algorithm.memory=3", f"scenario={scenario}",
        "validation_fraction=0",  # the whole training split, as the centralized reference
    )  # fmt: skip
    run = run_in_process(cfg, None, log=quiet)
    local, losses = centralized_lbfgs(cfg, iterations)
    for t, module in local.items():
        for key in [k for k in run.strategy.clients if k[0] == t]:
            theta = run.theta(key)
            for name, value in module.state_dict().items():
                np.testing.assert_allclose(theta[name], value.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"{key}.{name}")
    objective = [h.extra["objective"] for h in run.strategy.results.history]
    scale = run.strategy.label_scale
    np.testing.assert_allclose(objective, [scale.loss(F) for F in losses[1:]], rtol=1e-9)
    assert losses[-1] < losses[0] and run.strategy.results.stopped["reason"] == "epochs"


def test_lbfgs_stops_on_tol_at_the_ridge_solution():
    whole = "validation_fraction=0"  # the whole training split, as PCG's ridge solution
    results = run_in_process(make_cfg("algorithm=lbfgs", "dataset=synthetic", "epochs=30", whole), None, log=quiet)
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
    rec = Recorded("algorithm=lbfgs", "dataset=synthetic", "epochs=3", "algorithm.memory=2", "validation_fraction=0")
    for key, phase, arrays, _ in rec.sent:
        if phase.startswith("lbfgs_"):
            n = rec.strategy.client_rows[key]
            for name, a in arrays.items():  # per-row outputs of the table's own rows, or its partial Gram matrix
                assert (name == "h" and len(a) == n) or (name == "gram" and a.shape[0] == a.shape[1] <= 7), name
    for key in rec.strategy.clients:
        phases = [phase for k, phase, _, _ in rec.got if k == key]
        assert phases.count("lbfgs_grad") == 3 and phases.count("lbfgs_trial") >= 3
    assert len(rec.strategy.results.history) == 3


def test_shard_gram_equals_the_gram_matrix_of_the_completed_basis():
    rng = np.random.default_rng(1)
    d, c = 6, 2
    S, Yk, r, s, g_prev = rng.normal(size=(d, c)), rng.normal(size=(d, c)), *rng.normal(size=(3, d))
    parts = rng.normal(size=(3, d))  # three shards' partial gradients
    a = parts.sum(axis=0)
    for candidate in (False, True):
        V = np.column_stack([S, Yk, r] + ([s, r - g_prev] if candidate else []))
        Va = sum(V.T @ p for p in parts)
        g = a + r
        B = np.column_stack([S, s, Yk, g - g_prev, g] if candidate else [S, Yk, g])
        np.testing.assert_allclose(shard_gram(V.T @ V, Va, a @ a, c, candidate), B.T @ B, rtol=1e-12, atol=1e-12)


def test_the_union_takes_the_joins_round_trips_and_its_shards_send_one_partial_gradient_each():
    common = ("algorithm=lbfgs", "dataset=synthetic", "epochs=3", "algorithm.memory=2", "algorithm.tol=0")
    join, rec = Recorded(*common), Recorded(*common, "scenario=ucq")
    training = [
        [h.rounds - r.history[0].rounds for h in r.history] for r in (join.strategy.results, rec.strategy.results)
    ]
    assert training[0] == training[1]  # the same round trips per iteration (setup rounds aside)
    assert rec.strategy.results.history[-1].rounds_inner == 0
    for key, phase, arrays, _ in [m for m in rec.sent if m[1].startswith("lbfgs_")]:
        n = rec.strategy.client_rows[key]
        for name, a in arrays.items():  # outputs of its own rows, inner products, a shard's partial gradient
            assert (
                (name == "h" and len(a) == n)
                or (name == "gram" and a.shape[0] == a.shape[1] <= 7)
                or (name == "g" and a.shape == (5 if key[0] == "fact" else 4,))  # theta_i: 4 features (+ intercept)
                or (name == "cross" and a.ndim == 1 and a.size <= 7)
                or (name == "layout" and a.shape == (2,))
            ), (key, phase, name)
    for key in rec.strategy.clients:
        phases = [phase for k, phase, _, _ in rec.got if k == key]
        sharded = len(rec.strategy.routers[key[0]].shards) > 1
        assert phases.count("lbfgs_partial") == (3 if sharded else 0)
        assert phases.count("lbfgs_grad") == (0 if sharded else 3)


def test_a_curious_server_gets_one_partial_gradient_per_iteration():
    cfg = compose_config("algorithm=lbfgs", "dataset=synthetic", "scenario=ucq", "epochs=1")
    run = run_in_process(cfg, None, log=quiet)
    key = next(k for k in run.contexts if k[0] == "fact")
    app, context = client_app_for(cfg), run.contexts[key]
    n = run.strategy.client_rows[key]
    probe = np.zeros((n, 1))
    probe[0] = 1.0  # Y = e_u would give the server row u's features in the partial gradient
    config = {"phase": "lbfgs_partial", "t": 0.0, "N": 1}
    # one Y broadcast over every row would sum the rows' features: refused before anything is computed
    refused(app, context, r"lbfgs_partial with Y of shape \(1, 1\) for \d+ rows", "train", {"Y": probe[:1]}, config)
    call(app, context, "train", {"Y": probe}, config)  # the one of the coming iteration
    refused(app, context, "one lbfgs_partial per iteration", "train", {"Y": probe}, config)
    refused(app, context, "refuses phase 'lbfgs_grad': it is answered by tables with one shard only", "train",
            {"Y": probe}, {"phase": "lbfgs_grad", "t": 0.0, "N": 1})  # fmt: skip
    refused(app, context, "carries the summed gradient", "train", {}, {"phase": "lbfgs_trial", "t": 1.0})
    single = next(k for k in run.contexts if k[0] == "d2")
    refused(app, run.contexts[single], "refuses phase 'lbfgs_partial': it is answered by the shards", "train",
            {"Y": np.zeros((run.strategy.client_rows[single], 1))}, config)  # fmt: skip
    refused(app, run.contexts[single], "array 'g' is a sum over the shards of a sharded table; this table has one shard", "train",
            {"delta": np.zeros(1), "pairs": np.zeros(0), "g": np.zeros(4)}, {"phase": "lbfgs_trial", "t": 1.0})  # fmt: skip
    join = compose_config("algorithm=lbfgs", "dataset=synthetic", "epochs=1")
    run = run_in_process(join, None, log=quiet)
    refused(client_app_for(join), run.contexts[next(iter(run.contexts))], "refuses phase 'lbfgs_partial': not a phase",
            "train", {"Y": probe}, config)  # fmt: skip


def test_a_deployed_shard_computes_no_partial_gradient_before_the_runs_start(tmp_path):
    owner = "algorithm=lbfgs dataset=synthetic scenario=ucq"
    context = node(tmp_path, "fact", owner, owner)  # a shard of fact, deployed with its owner's settings
    assert hello(deployed_app, context)["table"] == "fact"
    call(deployed_app, context, "train", {}, {"phase": "keys"})
    refused(deployed_app, context, "refuses phase 'lbfgs_partial': stage 'stats' .* comes first", "train",
            {"Y": np.ones((5, 1))}, {"phase": "lbfgs_partial", "t": 0.0, "N": 1})  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("privacy=dpsgd",), "cannot be honoured by algorithm 'lbfgs'"),
        (("privacy=dpsgd", "scenario=ucq"), "cannot be honoured by algorithm 'lbfgs'"),
        (("algorithm.backtrack=1",), "algorithm.backtrack must be in \\(0, 1\\)"),
    ],
)
def test_lbfgs_refuses_what_it_cannot_do(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(make_cfg("algorithm=lbfgs", *overrides), None, log=quiet)
