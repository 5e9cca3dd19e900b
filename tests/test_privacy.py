"""tpflower.privacy: label DP, DP-SGD steps against the non-private math, accounting, config validation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant

from simulations.federated import run_in_process
from tpflower import privacy as P
from tpflower.config import compose_config
from tpflower.models import local_model
from tpflower.phases.join_admm import admm_update_local_opt
from tpflower.phases.join_sgd import local_sgd_step
from tpflower.privacy.settings import cfg_number
from tpflower.privacy.trainer import DPLocalTrainer

F64 = torch.float64


# ---------------------------------------------------------------------------------------------- label DP


def label_lambda(epsilon: float) -> float:
    """The inverse of label_epsilon: the per-coordinate Laplace std giving ``epsilon``-label-DP."""
    return 2.0 * math.sqrt(2.0) / epsilon


def test_label_epsilon_matches_theorem_1():
    assert P.label_epsilon(0.5) == 2 * math.sqrt(2) / 0.5
    assert P.label_epsilon(0.5) == pytest.approx(5.657, abs=1e-3)
    assert label_lambda(P.label_epsilon(0.7)) == pytest.approx(0.7)
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="label_lambda"):
            P.label_epsilon(bad)


def test_binary_keep_probability_closed_form_and_empirical():
    lam, n = 0.5, 20_000
    b = lam / math.sqrt(2)
    closed = 1 - math.exp(-1 / b) * (2 + 1 / b) / 4
    assert P.label_keep_probability(lam, 2) == pytest.approx(closed, abs=1e-12)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, n).astype(np.float64)  # binary labels as float 0/1
    y_hat = P.randomize_class_labels(y, 2, lam, rng)
    assert y_hat.dtype == np.float64 and set(np.unique(y_hat)) <= {0.0, 1.0}
    assert np.mean(y_hat == y) == pytest.approx(closed, abs=0.01)  # std of the mean ~ 0.002


@pytest.mark.parametrize("lam, expected", [(1e-3, 1.0), (1e4, 0.2), (0.5, None), (2.0, None)])
def test_multiclass_keep_fraction(lam, expected):
    C, n = 5, 20_000
    rng = np.random.default_rng(1)
    y = rng.integers(0, C, n)
    y_hat = P.randomize_class_labels(y, C, lam, rng)
    assert y_hat.dtype == y.dtype and y_hat.min() >= 0 and y_hat.max() < C
    kept = np.mean(y_hat == y)
    analytic = P.label_keep_probability(lam, C)
    if expected is not None:  # limits: tiny noise keeps all, huge noise is uniform (1/C)
        assert analytic == pytest.approx(expected, abs=0.01)
    assert kept == pytest.approx(analytic, abs=0.015)
    # a changed label is uniform over the other C - 1 classes
    flipped = (y_hat - y)[y_hat != y] % C
    if len(flipped) > 2000:
        counts = np.bincount(flipped, minlength=C)[1:] / len(flipped)
        assert np.allclose(counts, 1 / (C - 1), atol=0.03)


def test_class_labels_reject_out_of_range():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="class ids"):
        P.randomize_class_labels(np.array([0, 3]), 3, 0.5, rng)
    with pytest.raises(ValueError, match="class ids"):
        P.randomize_class_labels(np.array([0.5]), 2, 0.5, rng)


def test_regression_label_dp_clips_and_has_laplace_scale():
    lo, hi, eps, n = 1.0, 5.0, 2.0, 20_000
    scale = (hi - lo) / eps
    rng = np.random.default_rng(2)
    y = rng.uniform(-2.0, 8.0, n)
    y_hat = P.randomize_regression_labels(y, lo, hi, eps, rng)
    assert y_hat.dtype == np.float64
    noise = y_hat - np.clip(y, lo, hi)
    assert np.std(noise) == pytest.approx(math.sqrt(2) * scale, rel=0.03)  # Laplace std = sqrt(2) b
    assert np.mean(np.abs(noise)) == pytest.approx(scale, rel=0.03)  # E|L| = b
    assert abs(np.mean(noise)) < 0.05
    # the config dispatcher gives the same draw
    cfg = {"name": "label", "label_range": [lo, hi], "label_epsilon": eps}
    a = P.randomize_labels(y, "regression", cfg, np.random.default_rng(3))
    b = P.randomize_regression_labels(y, lo, hi, eps, np.random.default_rng(3))
    assert np.array_equal(a, b)


def test_regression_label_dp_keeps_float32():
    y = np.linspace(0, 1, 10, dtype=np.float32)
    assert P.randomize_regression_labels(y, 0, 1, 1.0, np.random.default_rng(0)).dtype == np.float32


# -------------------------------------------------------------------------------------------- accounting


def test_epsilon_equals_independent_rdp_accountant():
    sigma, q, k, delta = 1.1, 0.02, 37, 1e-5
    trainer = DPLocalTrainer(
        local_model(3, 1, dtype=F64), noise_multiplier=sigma, max_grad_norm=1.0, sample_rate=q, seed=0
    )
    X, Y = torch.randn(8, 3, dtype=F64), torch.randn(8, 1, dtype=F64)
    for _ in range(k):
        trainer.sgd_step(X, Y, batch_size=10, lr=0.01, beta=0.1)
    ref = RDPAccountant()
    for _ in range(k):
        ref.step(noise_multiplier=sigma, sample_rate=q)
    assert trainer.steps == k
    assert trainer.epsilon(delta) == ref.get_epsilon(delta=delta)
    assert trainer.accountant_state() == [[sigma, q, float(k)]]
    assert P.rdp_epsilon(trainer.accountant_state(), delta) == ref.get_epsilon(delta=delta)


def test_the_epsilon_spent_is_never_negative_at_a_large_delta():
    """At delta 0.5 Opacus' conversion of a few noisy steps' RDP is below 0 (-0.49 was printed per epoch); an
    epsilon is at least 0."""
    history = [(1.2, 0.05, 20)]
    assert P.rdp_epsilon(history, 0.5) == 0.0
    assert P.rdp_epsilon(history, 1e-5) > 0


def test_noise_multiplier_for_meets_target():
    eps, delta, q, steps = 1.0, 1e-5, 0.01, 500
    sigma = P.noise_multiplier_for(eps, delta, q, steps)
    spent = P.rdp_epsilon([(sigma, q, steps)], delta)
    assert spent <= eps
    assert spent >= eps - 0.05  # the binary search stops within 0.01 of the target
    assert P.rdp_epsilon([(sigma * 0.9, q, steps)], delta) > eps  # not wastefully large


def test_the_accountants_smallest_epsilon_is_opacus_at_rdp_zero():
    """RDP_ORDERS are Opacus' default orders, and smallest_epsilon(delta) its conversion of RDP 0 (no steps'
    cost at all): no noise makes the accountant report less."""
    from opacus.accountants.analysis import rdp

    from tpflower.privacy.accounting import RDP_ORDERS, smallest_epsilon

    assert list(RDP_ORDERS) == [float(a) for a in RDPAccountant.DEFAULT_ALPHAS]
    for delta in (1e-5, 1e-3, 0.1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Optimal order is the largest alpha": the floor is at the largest
            eps, _ = rdp.get_privacy_spent(orders=list(RDP_ORDERS), rdp=[0.0] * len(RDP_ORDERS), delta=delta)
        assert smallest_epsilon(delta) == pytest.approx(eps, rel=1e-12)
    assert smallest_epsilon(1e-5) == pytest.approx(0.1029, abs=1e-4)


def test_a_dp_budget_no_noise_reaches_is_one_line_naming_the_setting_and_the_plan():
    """Opacus says only "The privacy budget is too low."; tpflower names privacy.epsilon, the plan's steps and
    sample rate, and what to change: below the accountant's floor at delta (any plan), or too small for the
    plan's steps (Opacus' search stops at sigma 1e6)."""
    with pytest.raises(ValueError) as low:
        P.noise_multiplier_for(0.1, 1e-5, 0.01, 500)
    line = str(low.value)
    assert line.startswith("privacy.epsilon=0.1 is below 0.103, the smallest epsilon the RDP accountant reaches")
    assert "privacy.delta=1e-05" in line and "set privacy.epsilon=0.11 or more" in line
    assert "500 DP steps at sample rate 0.01" in line and "\n" not in line
    assert P.noise_multiplier_for(0.11, 1e-5, 0.01, 500) > 0  # what the line says to set works
    epsilon, steps = 0.1029, 10**7  # above the floor, but 10 million full-batch steps need sigma > 1e6
    from opacus.accountants.utils import get_noise_multiplier

    with pytest.raises(ValueError, match="The privacy budget is too low"):  # Opacus' own word on the same plan
        get_noise_multiplier(target_epsilon=epsilon, target_delta=1e-5, sample_rate=1.0, steps=steps)
    with pytest.raises(ValueError) as many:
        P.noise_multiplier_for(epsilon, 1e-5, 1.0, steps)
    line = str(many.value)
    assert line.startswith("privacy.epsilon=0.1029 (privacy.delta=1e-05) is too small for the run's 10,000,000 DP")
    assert "sample rate 1" in line and "raise privacy.epsilon, train fewer epochs, use a larger batch" in line
    assert P.plan_problem(epsilon, 1e-5, 1.0, 10**5) is None  # fewer steps fit


def test_a_feature_dp_epsilon_below_the_accountants_floor_is_refused_before_any_table_is_read(tmp_path):
    """The setting is refused by the server while it checks the settings, once (not once per table at its
    first DP step), before the data check reads any table."""
    from simulations.federated import run_in_process
    from tests.conftest import make_cfg

    cfg = make_cfg("algorithm=admm", "dataset=synthetic", "epochs=1", "privacy=dpsgd", "privacy.epsilon=0.1")
    with pytest.raises(ValueError) as err:
        run_in_process(cfg, tmp_path, log=lambda _: None)
    assert str(err.value).startswith("privacy=dpsgd: privacy.epsilon=0.1 is below 0.103")
    assert not (tmp_path / "node-state").exists()  # no node was asked for anything


def test_the_server_refuses_a_dp_plan_no_noise_covers_once():
    from strategies.setup import check_dp_plan

    privacy = {"name": "dpsgd", "epsilon": 0.1029, "delta": 1e-5}
    check_dp_plan(privacy, {("a", 0): (100, 0.5), ("b", 0): (1000, 1.0)})
    with pytest.raises(ValueError, match=r"^privacy=dpsgd: privacy.epsilon=0.1029 .* 10,000,000 DP steps"):
        check_dp_plan(privacy, {("a", 0): (100, 0.5), ("b", 0): (10**7, 1.0)})


def test_table_row_sample_rate():
    N, B = 10_000, 100
    assert P.table_row_sample_rate(B, N, 1, "shuffle") == pytest.approx(B / N)
    assert P.table_row_sample_rate(B, N, 1, "poisson") == pytest.approx(B / N)
    q5 = P.table_row_sample_rate(B, N, 5, "shuffle")
    assert q5 == pytest.approx(1 - math.prod((N - B - k) / (N - k) for k in range(5)))
    assert q5 <= 5 * B / N and q5 > 4.8 * B / N
    assert P.table_row_sample_rate(B, N, 5, "poisson") == pytest.approx(1 - (1 - B / N) ** 5)
    assert P.table_row_sample_rate(N, N, 3) == 1.0
    assert P.table_row_sample_rate(B, N, N) == 1.0
    assert P.sgd_steps(10, 1000, 256) == 40 and P.admm_steps(10, 2, 1000, 256) == 80


# ------------------------------------------------------------------------------------------- DP-SGD step


def _batch(n_rows=9, d_in=4, d_out=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n_rows, d_in, generator=g, dtype=F64)
    Y = torch.randn(n_rows, d_out, generator=g, dtype=F64) * 3.0
    return X, Y


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_dp_step_without_noise_and_clipping_equals_sgd_step(kind):
    X, Y = _batch()
    ref = local_model(4, 2, kind=kind, hidden=(8,), dtype=F64, seed=3)
    dp_model = local_model(4, 2, kind=kind, hidden=(8,), dtype=F64, seed=3)
    trainer = DPLocalTrainer(dp_model, noise_multiplier=0.0, max_grad_norm=1e12, sample_rate=0.1, seed=0)
    for _ in range(3):
        local_sgd_step(ref, X, Y, batch_size=13, lr=0.3, beta=0.05)
        trainer.sgd_step(X, Y, batch_size=13, lr=0.3, beta=0.05)
    for (k, a), (k2, b) in zip(ref.state_dict().items(), trainer.state_dict().items()):
        assert k == k2
        assert torch.allclose(a, b, atol=1e-10, rtol=0), k


def _per_row_grads(model, X, Y):
    rows = []
    for u in range(len(X)):
        model.zero_grad()
        (Y[u : u + 1] * model(X[u : u + 1])).sum().backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_dp_step_clips_each_row_then_adds_unclipped_regulariser(kind):
    X, Y = _batch(seed=1)
    C, B, lr, beta = 0.5, 13, 0.2, 0.1
    ref = local_model(4, 2, kind=kind, hidden=(8,), dtype=F64, seed=5)
    dp_model = local_model(4, 2, kind=kind, hidden=(8,), dtype=F64, seed=5)
    # by hand: per-row gradients by autograd, clipped as Opacus does (factor min(1, C / (norm + 1e-6)))
    g = _per_row_grads(ref, X, Y)
    norms = g.norm(dim=1)
    assert (norms > C).all()  # the test clips every row
    clipped = g * (C / (norms + 1e-6)).clamp(max=1.0)[:, None]
    assert (clipped.norm(dim=1) <= C).all()
    theta = torch.cat([p.detach().flatten() for p in ref.parameters()])
    expected = theta - lr * (clipped.sum(0) / B + beta * theta)  # d/dtheta beta/2 ||theta||^2 = beta theta

    trainer = DPLocalTrainer(dp_model, noise_multiplier=0.0, max_grad_norm=C, sample_rate=0.1)
    trainer.sgd_step(X, Y, batch_size=B, lr=lr, beta=beta)
    got = torch.cat([p.detach().flatten() for p in dp_model.parameters()])
    assert torch.allclose(got, expected, atol=1e-10, rtol=0)


def test_dp_step_noise_has_std_sigma_c_over_batch():
    d_in, sigma, C, B, lr = 300, 2.0, 0.7, 50, 1.0
    model = local_model(d_in, 4, init="zeros", dtype=F64)
    trainer = DPLocalTrainer(model, noise_multiplier=sigma, max_grad_norm=C, sample_rate=0.1, seed=11)
    X, Y = torch.randn(5, d_in, dtype=F64), torch.zeros(5, 4, dtype=F64)  # no data gradient, beta = 0
    trainer.sgd_step(X, Y, batch_size=B, lr=lr, beta=0.0)
    delta = torch.cat([p.detach().flatten() for p in model.parameters()])  # = -lr * noise / B
    assert delta.numel() == 1204
    assert delta.std().item() == pytest.approx(lr * sigma * C / B, rel=0.08)
    assert abs(delta.mean().item()) < 4 * lr * sigma * C / B / math.sqrt(1204)


def test_seeded_noise_is_reproducible_and_not_replayed_after_restore():
    X, Y = _batch()
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1)

    def run(seed, steps):
        t = DPLocalTrainer(local_model(4, 2, dtype=F64, seed=1), seed=seed, **kw)
        for _ in range(steps):
            t.sgd_step(X, Y, batch_size=9, lr=0.1, beta=0.0)
        return t

    a, b = run(7, 2), run(7, 2)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    # a trainer rebuilt after 2 steps draws different noise than a fresh one (seeded by (seed, steps))
    fresh = DPLocalTrainer(local_model(4, 2, dtype=F64, seed=1), seed=7, **kw)
    rebuilt = DPLocalTrainer.from_state(
        local_model(4, 2, dtype=F64, seed=1), fresh.state_dict(), [[1.0, 0.1, 2]], seed=7, **kw
    )
    fresh.sgd_step(X, Y, batch_size=9, lr=0.1, beta=0.0)
    rebuilt.sgd_step(X, Y, batch_size=9, lr=0.1, beta=0.0)
    assert not torch.equal(fresh.state_dict()["weight"], rebuilt.state_dict()["weight"])


def test_state_round_trip():
    X, Y = _batch()
    model = local_model(4, 2, kind="mlp", hidden=(8,), dtype=F64, seed=2)
    t = DPLocalTrainer(model, noise_multiplier=1.3, max_grad_norm=1.0, sample_rate=0.05, seed=0)
    for _ in range(4):
        t.sgd_step(X, Y, batch_size=9, lr=0.1, beta=0.01)
    sd, acc = t.state_dict(), t.accountant_state()
    assert list(sd) == list(local_model(4, 2, kind="mlp", hidden=(8,)).state_dict())  # no "_module." prefix
    assert any(k.startswith("_module.") for k in t._gsm.state_dict())  # (the GradSampleModule itself is prefixed)
    acc = json.loads(json.dumps(acc))  # persistable as plain numbers
    fresh = local_model(4, 2, kind="mlp", hidden=(8,), dtype=F64, seed=99)
    t2 = DPLocalTrainer.from_state(fresh, sd, acc, noise_multiplier=1.3, max_grad_norm=1.0, sample_rate=0.05)
    assert t2.steps == 4 and t2.epsilon(1e-5) == t.epsilon(1e-5)
    assert all(torch.equal(fresh.state_dict()[k], sd[k]) for k in sd)
    t2.load_state_dict({"_module." + k: v for k, v in sd.items()})  # a GradSampleModule state_dict loads too
    assert torch.equal(t2.predict(X), t.predict(X))
    t2.sgd_step(X, Y, batch_size=9, lr=0.1, beta=0.01)
    assert t2.accountant_state() == [[1.3, 0.05, 5.0]]


def make_trainer(model, privacy_cfg, *, sample_rate, steps, seed=None, history=()):
    """A DPLocalTrainer calibrated so that ``steps`` steps at ``sample_rate`` spend ``privacy_cfg.epsilon`` at
    ``privacy_cfg.delta``, clipping at ``privacy_cfg.clip``."""
    sigma = P.noise_multiplier_for(
        cfg_number(privacy_cfg, "epsilon"), cfg_number(privacy_cfg, "delta"), sample_rate, steps
    )
    return DPLocalTrainer(
        model,
        noise_multiplier=sigma,
        max_grad_norm=cfg_number(privacy_cfg, "clip"),
        sample_rate=sample_rate,
        seed=seed,
        history=history,
    )


def test_feature_less_table_and_make_trainer():
    cfg = {"name": "dpsgd", "epsilon": 1.0, "delta": 1e-5, "clip": 1.0}
    t = make_trainer(local_model(0, 1, dtype=F64), cfg, sample_rate=0.01, steps=100, seed=0)
    assert t.noise_multiplier > 0 and t.max_grad_norm == 1.0
    for _ in range(100):
        t.sgd_step(torch.zeros(3, 0, dtype=F64), torch.ones(3, 1, dtype=F64), batch_size=10, lr=0.1, beta=0.0)
    assert 0.95 <= t.epsilon(1e-5) <= 1.0


# ----------------------------------------------------------------------------------------------- DP ADMM


def _admm_data(n=40, d_in=3, d_out=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g, dtype=F64)
    G = torch.randint(0, 4, (n,), generator=g).to(F64)
    Y = torch.randn(n, d_out, generator=g, dtype=F64) * G[:, None]  # Y_u = 0 where G_u = 0
    return X, G, Y


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_dp_admm_shuffle_without_noise_equals_non_private(kind):
    X, G, Y = _admm_data()
    kw = dict(N=70, rho=0.5, beta=0.01, epochs=3, lr=0.05, batch_size=8)
    ref = local_model(3, 2, kind=kind, hidden=(8,), dtype=F64, seed=4)
    admm_update_local_opt(ref, X, G, Y, generator=torch.Generator().manual_seed(0), **kw)
    dp_model = local_model(3, 2, kind=kind, hidden=(8,), dtype=F64, seed=4)
    t = DPLocalTrainer(dp_model, noise_multiplier=0.0, max_grad_norm=1e12)
    n_steps = t.admm_update(X, G, Y, generator=torch.Generator().manual_seed(0), sampling="shuffle", **kw)
    n_a = int((G > 0).sum())
    assert n_steps == 3 * math.ceil(n_a / 8) == t.steps
    assert t.accountant_state() == [[0.0, 8 / n_a, float(n_steps)]]
    for k, v in ref.state_dict().items():
        assert torch.allclose(v, t.state_dict()[k], atol=1e-10, rtol=0), k


def test_dp_admm_poisson_full_batch_equals_non_private_and_q_accounting():
    X, G, Y = _admm_data(seed=1)
    kw = dict(N=55, rho=1.0, beta=0.02, epochs=4, lr=0.05, batch_size=1000)  # batch >= n_a: q = 1
    ref = local_model(3, 2, kind="mlp", hidden=(8,), dtype=F64, seed=6)
    admm_update_local_opt(ref, X, G, Y, generator=torch.Generator().manual_seed(0), **kw)
    dp_model = local_model(3, 2, kind="mlp", hidden=(8,), dtype=F64, seed=6)
    t = DPLocalTrainer(dp_model, noise_multiplier=0.0, max_grad_norm=1e12)
    assert t.admm_update(X, G, Y, generator=torch.Generator().manual_seed(0), **kw) == 4
    assert t.accountant_state() == [[0.0, 1.0, 4.0]]
    for k, v in ref.state_dict().items():
        assert torch.allclose(v, t.state_dict()[k], atol=1e-10, rtol=0), k
    # Poisson with q < 1: ceil(n_a / b) steps per epoch, each recorded at q = b / n_a
    t2 = DPLocalTrainer(local_model(3, 2, dtype=F64), noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    n_a = int((G > 0).sum())
    gen = torch.Generator().manual_seed(1)
    steps = t2.admm_update(X, G, Y, N=55, rho=1.0, beta=0.0, epochs=2, lr=0.01, batch_size=5, generator=gen)
    assert steps == 2 * math.ceil(n_a / 5) == P.admm_steps(2, 1, n_a, 5)
    assert t2.accountant_state() == [[1.0, 5 / n_a, float(steps)]]


def test_dp_admm_clips_per_row_term():
    # one SGD step, full batch, no noise: per-row gradient of Y_u^T f_u + rho G_u/2 ||f_u||^2 clipped to C
    X, G, Y = _admm_data(n=12, seed=2)
    N, rho, beta, lr, C = 30, 0.7, 0.1, 0.3, 0.2
    ref = local_model(3, 2, kind="mlp", hidden=(5,), dtype=F64, seed=8)
    rows = []
    for u in torch.nonzero(G > 0).flatten():
        ref.zero_grad()
        f = ref(X[u : u + 1])
        ((Y[u] * f).sum() + 0.5 * rho * G[u] * (f * f).sum()).backward()
        rows.append(torch.cat([p.grad.flatten() for p in ref.parameters()]))
    g = torch.stack(rows)
    clipped = g * (C / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None]
    theta = torch.cat([p.detach().flatten() for p in ref.parameters()])
    expected = theta - lr * (clipped.sum(0) / N + beta * theta)
    dp_model = local_model(3, 2, kind="mlp", hidden=(5,), dtype=F64, seed=8)
    t = DPLocalTrainer(dp_model, noise_multiplier=0.0, max_grad_norm=C)
    kw = dict(N=N, rho=rho, beta=beta, epochs=1, lr=lr, batch_size=100, optimizer="sgd")
    t.admm_update(X, G, Y, generator=torch.Generator(), **kw)
    got = torch.cat([p.detach().flatten() for p in t.module.parameters()])
    assert torch.allclose(got, expected, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------------------------- config


BASE = {"epsilon": 1.0, "delta": 1e-5, "clip": 1.0, "label_lambda": 0.5, "label_range": [1, 5], "label_epsilon": 5.66}


@pytest.mark.parametrize("name", P.PRIVACY_NAMES)
@pytest.mark.parametrize("task", P.TASKS)
def test_validate_accepts_paper_settings(name, task):
    P.validate_privacy({**BASE, "name": name}, "tp_join_sgd", task, feature_dp=True)
    P.validate_privacy({**BASE, "name": name}, "tp_join_admm", task, feature_dp=True)


@pytest.mark.parametrize(
    "override, task, algorithm, match",
    [
        ({"name": "dp"}, "regression", "tp_join_sgd", "privacy.name"),
        ({"epsilon": 0}, "regression", "tp_join_sgd", "privacy.epsilon"),
        ({"epsilon": -1.0}, "binary", "tp_join_admm", "privacy.epsilon"),
        ({"epsilon": float("inf")}, "binary", "tp_join_admm", "privacy.epsilon"),
        ({"delta": 0}, "regression", "tp_join_sgd", "privacy.delta"),
        ({"delta": 1.0}, "regression", "tp_join_sgd", "privacy.delta"),
        ({"delta": None}, "regression", "tp_join_sgd", "privacy.delta"),
        ({"clip": 0.0}, "regression", "tp_join_sgd", "privacy.clip"),
        ({"clip": "big"}, "regression", "tp_join_sgd", "privacy.clip"),
        ({"sample_rate": "worst"}, "regression", "tp_join_sgd", "privacy.sample_rate"),  # was after the data
        ({"sample_rate": "batch", "epsilon": 0}, "regression", "tp_join_sgd", "privacy.epsilon"),
        ({"name": "label", "label_lambda": 0}, "binary", "tp_join_sgd", "privacy.label_lambda"),
        ({"name": "label_dpsgd", "label_lambda": -0.5}, "multiclass", "tp_join_sgd", "privacy.label_lambda"),
        ({"name": "label", "label_range": None}, "regression", "tp_join_sgd", "label_range"),
        ({"name": "label", "label_range": [5, 1]}, "regression", "tp_join_sgd", "label_range"),
        ({"name": "label", "label_range": [1, 1]}, "regression", "tp_join_sgd", "label_range"),
        ({"name": "label", "label_range": [0, float("inf")]}, "regression", "tp_join_sgd", "label_range"),
        ({"name": "label", "label_range": [1]}, "regression", "tp_join_sgd", "label_range"),
        ({"name": "label", "label_epsilon": 0}, "regression", "tp_join_sgd", "privacy.label_epsilon"),
        ({"name": "label", "label_epsilon": 0}, "binary", "tp_join_sgd", "privacy.label_epsilon"),
        ({"name": "label", "label_epsilon": 2}, "binary", "tp_join_sgd", "label_lambda=0.5 .*label_epsilon=2"),
        ({"name": "label", "label_lambda": 1}, "regression", "tp_join_sgd", "label_lambda=1 .*label_epsilon=5.66"),
        ({"name": "dpsgd"}, "regression", "centralized", "'centralized'"),
        ({"name": "label_dpsgd"}, "binary", "celu", "'celu'"),
        ({"name": "label"}, "ordinal", "tp_join_sgd", "task"),
    ],
)
def test_validate_refuses_impossible_settings(override, task, algorithm, match):
    cfg = {**BASE, "name": "label_dpsgd", **override}
    with pytest.raises(ValueError, match=match):
        P.validate_privacy(cfg, algorithm, task, feature_dp=algorithm.startswith("tp_join_"))


def test_a_missing_label_range_names_both_places_to_set_it():
    with pytest.raises(ValueError) as err:
        P.validate_privacy({**BASE, "name": "label", "label_range": None}, "tp_join_sgd", "regression", feature_dp=True)
    line = str(err.value)
    assert "label_range: [lo, hi] at the top level of the dataset config" in line  # docs/datasets.md
    assert "privacy.label_range=[lo,hi]" in line and "\n" not in line


def test_validate_refuses_label_dp_where_unsupported():
    with pytest.raises(ValueError, match="'my_new_algo'"):
        P.validate_privacy({**BASE, "name": "label"}, "my_new_algo", "binary", feature_dp=True, label_dp=False)


def test_validate_messages_name_algorithm_and_setting():
    with pytest.raises(ValueError) as err:
        P.validate_privacy(
            {**BASE, "name": "dpsgd"}, "centralized", "regression", feature_dp=False, why_not="one model"
        )
    assert "privacy=dpsgd" in str(err.value) and "centralized" in str(err.value) and "one model" in str(err.value)
    P.validate_privacy(
        {**BASE, "name": "label"}, "centralized", "regression", feature_dp=False
    )  # label DP is fine there
    P.validate_privacy(
        {"name": "none", "epsilon": -1}, "centralized", "regression", feature_dp=False
    )  # none ignores the rest


def test_label_levels_one_level_under_two_names():
    assert P.label_levels({}) == (0.5, 2 * math.sqrt(2) / 0.5)  # neither: TablePuppet's lambda 0.5
    assert P.label_levels({"label_epsilon": 2}) == pytest.approx((math.sqrt(2), 2.0), rel=1e-12)
    assert P.label_levels({"label_lambda": 1, "label_epsilon": None}) == pytest.approx((1.0, 2 * math.sqrt(2)))
    assert P.label_levels({"label_lambda": 0.5, "label_epsilon": 5.66}) == (0.5, 5.66)  # agree to 0.1%
    with pytest.raises(ValueError) as err:
        P.label_levels({"label_lambda": 0.5, "label_epsilon": 2}, "privacy=label")
    assert str(err.value) == (
        "privacy=label: privacy.label_lambda=0.5 (epsilon 2 sqrt(2) / lambda = 5.657) and privacy.label_epsilon=2 "
        "disagree; they name one label-DP level: set only one of them"
    )


@pytest.mark.parametrize("task", P.TASKS)
def test_label_epsilon_is_honoured_whatever_the_task(task):
    cfg = {"name": "label", "label_range": [1, 5], "label_epsilon": 2.0, "label_lambda": None}
    P.validate_privacy(cfg, "tp_join_sgd", task, feature_dp=True)
    assert P.privacy_summary(cfg, task)["label_epsilon"] == pytest.approx(2.0, rel=1e-12)
    sent = P.privacy_from_message(P.privacy_message(cfg))  # the client gets the level under both names
    assert (sent["label_lambda"], sent["label_epsilon"]) == pytest.approx((math.sqrt(2), 2.0), rel=1e-12)
    y = np.zeros(200_000, dtype=np.int64)
    noisy = P.randomize_labels(y, task, cfg, np.random.default_rng(0), n_classes=3)
    if task == "regression":  # Laplace((hi - lo) / epsilon) = Laplace(2): variance 8
        assert np.var(noisy) == pytest.approx(8.0, rel=0.03)
    else:
        kept = P.label_keep_probability(math.sqrt(2), 2 if task == "binary" else 3)
        assert np.mean(noisy == 0) == pytest.approx(kept, abs=0.005)


def test_privacy_summary():
    none = P.privacy_summary({"name": "none"}, "binary")
    assert none == {"label_epsilon": None, "feature_epsilon": None, "delta": None}
    s = P.privacy_summary({**BASE, "name": "label_dpsgd"}, "binary", feature_epsilon=0.93)
    assert s == {"label_epsilon": pytest.approx(5.657, abs=1e-3), "feature_epsilon": 0.93, "delta": 1e-5}
    assert P.privacy_summary({**BASE, "name": "label"}, "regression")["label_epsilon"] == 5.66


def test_one_trainer_per_model_and_close():
    model = local_model(3, 1, dtype=F64)
    t = DPLocalTrainer(model, noise_multiplier=0.0, max_grad_norm=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="already carries Opacus hooks"):
        DPLocalTrainer(model, noise_multiplier=0.0, max_grad_norm=1.0, sample_rate=0.1)
    assert t.close() is model
    DPLocalTrainer(model, noise_multiplier=0.0, max_grad_norm=1.0, sample_rate=0.1)  # fine after close()
    with pytest.raises(ValueError, match="sample_rate"):
        DPLocalTrainer(local_model(3, 1), noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        DPLocalTrainer(local_model(3, 1), noise_multiplier=1.0, max_grad_norm=0.0)


def test_admm_regularizer_override_is_added_unclipped():
    # Eq. 22 style prox term instead of beta R: with huge C and no noise the step is the plain gradient step
    X, G, Y = _admm_data(n=10, seed=3)
    v = [torch.randn_like(p) for p in local_model(3, 1, dtype=F64).parameters()]

    def prox(m):
        return 0.5 * 2.0 * sum(((p - vp) ** 2).sum() for p, vp in zip(m.parameters(), v))

    ref = local_model(3, 1, dtype=F64, seed=1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    act = G > 0
    loss = ((Y[act, :1] * ref(X[act])).sum() + 0.5 * 0.3 * (G[act, None] * ref(X[act]) ** 2).sum()) / 20 + prox(ref)
    loss.backward()
    opt.step()
    t = DPLocalTrainer(local_model(3, 1, dtype=F64, seed=1), noise_multiplier=0.0, max_grad_norm=1e12)
    kw = dict(N=20, rho=0.3, beta=1.0, epochs=1, lr=0.1, batch_size=100, optimizer="sgd", regularizer=prox)
    t.admm_update(X, G, Y[:, :1], generator=torch.Generator(), **kw)
    for k, val in ref.state_dict().items():
        assert torch.allclose(val, t.state_dict()[k], atol=1e-10, rtol=0), k


# ------------------------------------------------------------------------------------ the label's DP scale


def _scaled_label_dp_run(label_scale: float):
    """TP-Join-SGD under feature DP on the synthetic star with its label multiplied by ``label_scale`` (its
    std about 1.8 x label_scale)."""
    cfg = compose_config(
        "dataset=synthetic",
        "dataset.loader.schema=star",
        f"+dataset.loader.label_scale={label_scale}",
        "algorithm=sgd",
        "privacy=dpsgd",
        "epochs=10",
    )
    return run_in_process(cfg, None, log=lambda _: None).strategy.results


def test_feature_dp_on_a_tiny_unit_label_beats_the_constant_predictor(monkeypatch):
    """standardize_label=auto under feature DP multiplies a centred label of std far below the DP noise and the
    random initial model's predictions up to the target std (dp_label_divisor < 1): on a label of std ~0.02 the
    DP model beats the constant predictor. Left at its own std (the divisor at least 1), the noise a parameter
    accumulates is several times the label and the model ends far worse than the constant predictor
    (docs/algorithms.md, DP-SGD and accounting)."""
    auto = _scaled_label_dp_run(0.01)
    scale = auto.label_scale
    assert scale["label_std"] < 0.1 and scale["target_std"] >= 1.0 and scale["divisor"] < 0.1
    constant = auto.reference["constant_rmse"]
    assert auto.history[-1].test_metric < 0.7 * constant  # measured 0.56
    monkeypatch.setattr("strategies.setup.dp_label_divisor", lambda s, noise: 1.0)  # the label centred only
    centred = _scaled_label_dp_run(0.01)
    assert centred.history[-1].test_metric > 1.2 * constant  # measured 1.8


def test_feature_dp_on_a_large_unit_label_beats_the_constant_predictor(monkeypatch):
    """standardize_label=auto under feature DP divides the centred label by dp_label_divisor: on a label of
    std ~10^4 the DP model clearly beats the constant predictor. Centred only (the label's std alone as its
    scale, K = s), every row's gradient is clipped and the parameters cannot reach a model of that size: it
    stays near the constant predictor (docs/settings.md, standardize_label)."""
    auto = _scaled_label_dp_run(10000)
    scale = auto.label_scale
    assert scale["scaling"] == "dp" and scale["label_std"] > 1000
    assert 3.0 <= scale["target_std"] < 10 and scale["divisor"] == pytest.approx(
        scale["label_std"] / scale["target_std"]
    )
    constant = auto.reference["constant_rmse"]
    assert auto.history[-1].test_metric < 0.7 * constant  # measured 0.57 (about 10 s a run)
    monkeypatch.setattr("strategies.setup.dp_label_divisor", lambda s, noise: 1.0)  # the label centred only
    centred = _scaled_label_dp_run(10000)
    assert centred.label_scale["divisor"] == 1.0
    assert centred.history[-1].test_metric > 0.95 * constant  # measured 0.9998


def test_importing_opacus_leaves_a_process_without_log_handlers_without_them():
    """Opacus' import calls logging.basicConfig: in the deployed ServerApp (a root logger without handlers) it
    printed Flower's DEBUG lines ('ServerApp finished running.') into every feature-DP run's output."""
    code = (
        "import logging; from tpflower.privacy.accounting import opacus_api; opacus_api(); "
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
