"""Losses, dl/dH against autograd, metrics against hand counts, and the ADMM z-update (Eq. 7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import softmax

from strategies.join_admm import _multiclass_newton_direction, z_update
from tpflower.losses import (
    LabelScale,
    adam_parameter_noise,
    binary_auc,
    dp_label_divisor,
    label_scaling,
    loss_grad_np,
    loss_np,
    loss_torch,
    metrics,
    output_dim,
    primary_metric,
    sgd_parameter_noise,
)

CASES = [("regression", 1), ("binary", 1), ("multiclass", 4)]


def _data(task: str, width: int, n: int, seed: int, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    H = rng.normal(size=(n, width)) * scale
    if task == "regression":
        y = rng.normal(size=n) * scale
    elif task == "binary":
        y = rng.integers(0, 2, size=n).astype(np.float64)
    else:
        y = rng.integers(0, width, size=n)
    return H, y


@pytest.mark.parametrize(("task", "width"), CASES)
def test_loss_and_gradient_match_torch_autograd(task: str, width: int) -> None:
    H, y = _data(task, width, n=40, seed=1)
    H[0] = 700.0  # extreme logits: the stable formulas stay finite
    H[1] = -700.0
    Ht = torch.tensor(H, dtype=torch.float64, requires_grad=True)
    mean_loss = loss_torch(task, Ht, torch.tensor(y))
    (mean_loss * H.shape[0]).backward()  # sum of the per-row losses: its gradient is dl/dH row by row
    per_row = loss_np(task, H, y)
    assert per_row.shape == (40,) and np.all(np.isfinite(per_row))
    assert per_row.mean() == pytest.approx(float(mean_loss.detach()), rel=1e-13)
    np.testing.assert_allclose(loss_grad_np(task, H, y), Ht.grad.numpy(), rtol=0, atol=1e-12)


def test_loss_values_by_hand() -> None:
    np.testing.assert_allclose(loss_np("regression", np.array([[3.0]]), np.array([1.0])), [2.0])
    binary = loss_np("binary", np.array([[0.0], [2.0]]), np.array([1, 0]))
    np.testing.assert_allclose(binary, [np.log(2), np.log1p(np.e**2)])
    H = np.array([[1.0, 2.0, 3.0]])
    np.testing.assert_allclose(loss_np("multiclass", H, np.array([0])), [np.log(np.exp(H).sum()) - 1.0])
    # labels as (n, 1) are accepted
    np.testing.assert_allclose(loss_grad_np("regression", np.array([[3.0]]), np.array([[1.0]])), [[2.0]])


def test_metrics_by_hand() -> None:
    H = np.array([[1.0], [2.0], [4.0]])
    y = np.array([1.0, 2.0, 2.0])
    m = metrics("regression", H, y)
    assert m["rmse"] == pytest.approx(np.sqrt((0 + 0 + 4) / 3))
    assert m["loss"] == pytest.approx((0 + 0 + 2) / 3)

    m = metrics("binary", np.array([[2.0], [-1.0], [0.0], [0.5]]), np.array([1, 0, 1, 0]))
    assert m["accuracy"] == 0.5  # H = 0 predicts class 0
    assert set(m) == {"loss", "accuracy", "auc"}

    m = metrics("multiclass", np.array([[0.0, 1.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0]]), np.array([1, 1, 2]))
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert set(m) == {"loss", "accuracy"}
    assert primary_metric("regression") == "rmse" and primary_metric("multiclass") == "accuracy"


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_pairwise_count_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 5, size=37).astype(np.float64)  # many ties
    y = rng.integers(0, 2, size=37)
    pos, neg = scores[y == 1], scores[y == 0]
    diff = pos[:, None] - neg[None, :]
    brute = ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / (pos.size * neg.size)
    assert binary_auc(scores, y) == pytest.approx(brute, rel=1e-14)
    assert metrics("binary", scores[:, None], y)["auc"] == pytest.approx(brute, rel=1e-14)


def test_auc_undefined_with_one_class() -> None:
    assert np.isnan(binary_auc(np.array([0.1, 0.2]), np.array([1, 1])))


def _z_gradient(task: str, z: np.ndarray, H: np.ndarray, y: np.ndarray, lam: np.ndarray, r: float) -> np.ndarray:
    """Eq. 7 optimality: dl/dz - lam + r (z - H)."""
    return loss_grad_np(task, z, y) - lam + r * (z - H)


@pytest.mark.parametrize(("task", "width"), CASES)
@pytest.mark.parametrize("r", [0.01, 0.5, 2.0, 50.0])
def test_z_update_is_optimal(task: str, width: int, r: float) -> None:
    H, y = _data(task, width, n=500, seed=2)
    rng = np.random.default_rng(3)
    lam = rng.normal(size=H.shape)
    z = z_update(task, H, y, lam, r)
    assert z.shape == H.shape
    assert np.abs(_z_gradient(task, z, H, y, lam, r)).max() < 1e-8


@pytest.mark.parametrize(("task", "width"), [("binary", 1), ("multiclass", 6)])
def test_z_update_with_admm_duals(task: str, width: int) -> None:
    """After Eq. 8, lam = dl/dz(z_prev) (a probability minus the one-hot label): the z-update's usual input."""
    H, y = _data(task, width, n=2000, seed=4, scale=10.0)
    rng = np.random.default_rng(5)
    logits = rng.normal(size=H.shape) * 10.0
    lam = loss_grad_np(task, logits, y)
    for r in (1e-3, 0.1, 1.0):
        z = z_update(task, H, y, lam, r)
        assert np.abs(_z_gradient(task, z, H, y, lam, r)).max() < 1e-8
    # lam = 0 and z = H optimal for the loss alone is not the fixed point: z moves towards the label
    z = z_update(task, H, y, np.zeros_like(H), 1.0)
    assert np.all(loss_np(task, z, y) <= loss_np(task, H, y) + 1e-12)


def test_z_update_regression_closed_form() -> None:
    H, y = _data("regression", 1, n=50, seed=6)
    lam = np.random.default_rng(7).normal(size=H.shape)
    z = z_update("regression", H, y, lam, 0.3)
    np.testing.assert_allclose(z, (y[:, None] + lam + 0.3 * H) / 1.3, rtol=0, atol=1e-14)
    assert np.abs(_z_gradient("regression", z, H, y, lam, 0.3)).max() < 1e-12


def test_multiclass_newton_direction_equals_dense_solve() -> None:
    rng = np.random.default_rng(8)
    p = softmax(rng.normal(size=(30, 5)) * 4, axis=1)
    g = rng.normal(size=(30, 5))
    for r in (1e-3, 1.0):
        hess = np.einsum("nc,cd->ncd", p, np.eye(5)) - p[:, :, None] * p[:, None, :] + r * np.eye(5)
        dense = -np.linalg.solve(hess, g[:, :, None])[:, :, 0]
        np.testing.assert_allclose(_multiclass_newton_direction(p, g, r), dense, rtol=1e-9, atol=1e-12)


def test_z_update_errors() -> None:
    H, y = _data("binary", 1, n=20, seed=9)
    lam = np.ones_like(H) * 3.0
    with pytest.raises(RuntimeError, match="did not reach the gradient tolerance after 1 Newton steps"):
        z_update("binary", H, y, lam, 0.01, max_iter=1)
    with pytest.raises(ValueError, match="r > 0"):
        z_update("binary", H, y, lam, 0.0)
    with pytest.raises(ValueError, match="shape of H"):
        z_update("binary", H, y, lam[:5], 1.0)
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        z_update("binary", H, y + 2, lam, 1.0)
    with pytest.raises(ValueError, match="not finite at row 3"):
        z_update("binary", np.where(np.arange(20)[:, None] == 3, np.nan, H), y, lam, 1.0)
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\)"):
        loss_np("multiclass", np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="'ordinal'"):
        loss_np("ordinal", H, y)


def test_output_dim() -> None:
    assert output_dim("regression") == 1 and output_dim("binary") == 1 and output_dim("binary", 2) == 1
    assert output_dim("multiclass", 7) == 7
    with pytest.raises(ValueError, match="n_classes"):
        output_dim("multiclass")
    with pytest.raises(ValueError, match="n_classes=3"):
        output_dim("binary", 3)


@pytest.mark.parametrize(
    "privacy, value, expected",
    [
        ("none", "auto", "standardize"),
        ("label", "auto", "standardize"),
        ("dpsgd", "auto", "dp"),
        ("label_dpsgd", "auto", "dp"),
        ("dpsgd", True, "standardize"),
        ("none", False, "raw"),
    ],
)
def test_standardize_label_auto_divides_by_the_dp_divisor_under_feature_dp(privacy, value, expected):
    """standardize_label=auto: the label is standardized unless feature DP is on, where it is centred and
    divided by the DP divisor of the run's plan (``dp``); an explicit true / false is obeyed."""
    assert label_scaling({"standardize_label": value, "privacy": {"name": privacy}}) == expected


def test_standardize_label_refuses_other_values():
    with pytest.raises(ValueError, match="standardize_label must be true, false or auto"):
        label_scaling({"standardize_label": "yes", "privacy": {"name": "none"}})


def test_shipped_config_standardizes_except_under_feature_dp():
    from tpflower.config import compose_config

    assert label_scaling(compose_config("dataset=nycflights13")) == "standardize"
    assert label_scaling(compose_config("dataset=nycflights13", "privacy=dpsgd")) == "dp"


@pytest.mark.parametrize(
    "s, noise, target",
    [
        (3988.0, 0.302, 3.0),  # diamonds' price, TP-Join-SGD: 6 nu = 1.8, K = 3
        (45.1, 1.61, 6 * 1.61),  # nycflights13's arrival delay, TP-Join-SGD: K = 9.7
        (45.1, 0.0, 3.0),  # no noise: K = 3
        (1.05, 1.58, 6 * 1.58),  # a label of std below 6 nu: multiplied up to it (movielens' rating, TP-Join-SGD)
        (1.05, 0.1, 1.05),  # between 1 and 3, above 6 nu: its own std (movielens, TP-Join-SGD as the paper accounts)
        (0.166, 0.142, 1.0),  # below 1 and 6 nu: multiplied up to 1 (a food budget share)
        (0.166, 0.283, 6 * 0.283),  # below 6 nu: multiplied up to it
        (0.0, 1.0, 0.0),  # a constant label: centred
    ],
)
def test_dp_label_divisor_targets_a_multiple_of_the_parameter_noise(s, noise, target):
    """Feature DP: the centred label is divided by c = s / K, K = max(6 x the DP noise one parameter accumulates
    over the run, min(s, 3), 1), so it trains at std K (a constant label: c = 1)."""
    c = dp_label_divisor(s, noise)
    assert c > 0
    assert s / c == pytest.approx(target)


def test_parameter_noise_of_the_dp_plans():
    """TP-Join-SGD: lr sigma C sqrt(T) / B, the noisiest client's; Adam (TP-Join-ADMM's theta-update): lr sqrt(T)
    of the client with the most steps; no step: 0."""
    plan = {("a", 0): (400, 0.01), ("b", 0): (400, 1.0)}
    sigmas = {0.01: 2.0, 1.0: 80.0}
    noise = sgd_parameter_noise(0.2, 1.0, 1024, plan, lambda steps, q: sigmas[q])
    assert noise == pytest.approx(0.2 * 80.0 * 20.0 / 1024)
    assert sgd_parameter_noise(0.2, 1.0, 1024, {("a", 0): (0, 1.0)}, lambda steps, q: 1.0) == 0.0
    assert adam_parameter_noise(0.01, {("a", 0): (1600, 0.01), ("b", 0): (10, 1.0)}) == pytest.approx(0.4)
    assert adam_parameter_noise(0.01, {}) == 0.0


def test_dp_label_scale_is_centred_then_divided():
    y = np.array([1000.0, 3000.0, 5000.0, 7000.0])
    scale = LabelScale.fit("regression", y, "dp")
    assert (scale.mean, scale.std) == (4000.0, 1.0)
    divided = scale.divided(100.0)
    np.testing.assert_allclose(divided.scaled(y), (y - 4000.0) / 100.0)
    np.testing.assert_allclose(divided.to_label(divided.scaled(y)), y)
