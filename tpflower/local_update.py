"""The client operator's math (torch): the SGD step of Eq. 12-13 and the ADMM theta-update of Eq. 16."""

from __future__ import annotations

import numpy as np
import torch

from tpflower.models import l2_penalty


def sgd_step(model: torch.nn.Module, X: torch.Tensor, Y: torch.Tensor, batch_size: int, lr: float, beta: float) -> None:
    """theta_i -= lr * [(1/|B|) sum_u Y_iu^T dh_iu/dtheta_i + beta dR_i/dtheta_i] (Eq. 12, 13).

    X: the rows U_i of the table (|U_i| x d_i); Y: the aggregated dl/dH of those rows (|U_i| x d_c).
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD keeps no state between steps
    opt.zero_grad()
    loss = (Y * model(X)).sum() / batch_size + beta * l2_penalty(model)
    loss.backward()
    opt.step()


def sgd_partial_gradient(model: torch.nn.Module, X: torch.Tensor, Y: torch.Tensor, count: float, beta: float) -> torch.Tensor:
    """One shard's unnormalised partial gradient (Eq. 18): sum_u Y_iu^T dh_iu/dtheta + beta G_sum dR/dtheta,
    with G_sum = sum over its rows u of G_iu (how many joined rows of the batch use them); flat vector."""
    model.zero_grad()
    loss = (Y * model(X)).sum() + beta * count * l2_penalty(model)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in model.parameters()])


def apply_step(model: torch.nn.Module, gradient: torch.Tensor, lr: float) -> None:
    """theta -= lr * gradient (Eq. 19), the gradient given as one flat vector."""
    with torch.no_grad():
        theta = torch.nn.utils.parameters_to_vector(model.parameters())
        torch.nn.utils.vector_to_parameters(theta - lr * gradient, model.parameters())


def admm_objective(
    model: torch.nn.Module, X: torch.Tensor, G: torch.Tensor, Y: torch.Tensor, N: int, rho: float, beta: float
) -> torch.Tensor:
    """beta R_i(theta) + (1/N) sum_u [Y_iu^T f_i(T_iu) + rho G_iu / 2 ||f_i(T_iu)||^2] (Eq. 16)."""
    f = model(X)
    return beta * l2_penalty(model) + ((Y * f).sum() + 0.5 * rho * (G[:, None] * f * f).sum()) / N


def admm_update_linear(
    model: torch.nn.Linear, X: np.ndarray, G: np.ndarray, Y: np.ndarray, N: int, rho: float, beta: float,
    prox: tuple[np.ndarray, float] | None = None,
) -> None:
    """Exact minimiser of Eq. 16 for f(x) = x W^T + b with R = 1/2 ||(W, b)||^2:

    (rho X1^T diag(G) X1 / N + beta I) Theta = -X1^T Y / N, with X1 = [X, 1] when the model has a bias.
    With ``prox = (v, rho')`` it solves one shard's consensus step instead (Eq. 22): the regulariser moves
    to the coordinator and rho'/2 ||Theta - v||^2 takes its place, v = w - u^q in flat parameter order.
    Solved in float64; the rows with G = 0 only enter through X1^T Y (where Y is 0 too).
    """
    X1 = np.concatenate([X, np.ones((len(X), 1))], axis=1) if model.bias is not None else X
    d1, d_c = X1.shape[1], Y.shape[1]
    rhs = -(X1.T @ Y) / N
    if prox is None:
        A = (rho / N) * (X1.T * G) @ X1 + beta * np.eye(d1)
    else:
        v, rho_c = prox
        A = (rho / N) * (X1.T * G) @ X1 + rho_c * np.eye(d1)
        rhs = rhs + rho_c * flat_to_theta(v, X.shape[1], d_c, model.bias is not None)
    Theta = np.linalg.solve(A, rhs)  # (d [+1]) x d_c
    with torch.no_grad():
        d = X.shape[1]
        model.weight.copy_(torch.as_tensor(Theta[:d].T))
        if model.bias is not None:
            model.bias.copy_(torch.as_tensor(Theta[d]))


def flat_to_theta(v: np.ndarray, d: int, d_c: int, bias: bool) -> np.ndarray:
    """A flat parameter vector of nn.Linear(d, d_c) (weight (d_c, d) row-major, then bias) as Theta (d1 x d_c)."""
    W = v[: d_c * d].reshape(d_c, d).T
    return np.vstack([W, v[d_c * d :].reshape(1, d_c)]) if bias else W


def theta_penalty(model: torch.nn.Module, beta: float, prox: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """The theta-update's penalty: beta R(theta) (Eq. 16), or rho'/2 ||theta - v||^2 for a shard's consensus
    step (Eq. 22) when ``prox = (v, rho')``."""
    if prox is None:
        return beta * l2_penalty(model)
    theta = torch.nn.utils.parameters_to_vector(model.parameters())
    return 0.5 * prox[1] * ((theta - prox[0]) ** 2).sum()


def admm_update_local_opt(
    model: torch.nn.Module,
    X: torch.Tensor,
    G: torch.Tensor,
    Y: torch.Tensor,
    N: int,
    rho: float,
    beta: float,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    prox: tuple[torch.Tensor, float] | None = None,
) -> None:
    """Warm-started Adam on Eq. 16 (non-linear f_i), over mini-batches of the rows that occur in the join.

    A mini-batch b of the n_a active rows estimates the sum over rows without bias: (n_a / |b|) sum_{u in b}.
    With ``prox = (v, rho')`` (a shard's consensus step, Eq. 22) rho'/2 ||theta - v||^2 replaces beta R.
    """
    active = torch.nonzero(G > 0).flatten()
    n_a = len(active)
    if n_a == 0:
        return
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        perm = active[torch.randperm(n_a, generator=generator)]
        for s in range(0, n_a, batch_size):
            rows = perm[s : s + batch_size]
            f = model(X[rows])
            data = (Y[rows] * f).sum() + 0.5 * rho * (G[rows, None] * f * f).sum()
            loss = theta_penalty(model, beta, prox) + data * (n_a / len(rows)) / N
            opt.zero_grad()
            loss.backward()
            opt.step()


def admm_update_lbfgs(
    model: torch.nn.Module,
    X: torch.Tensor,
    G: torch.Tensor,
    Y: torch.Tensor,
    N: int,
    rho: float,
    beta: float,
    max_iter: int,
    prox: tuple[torch.Tensor, float] | None = None,
) -> None:
    """Eq. 16 for a non-linear f_i by full-batch L-BFGS (strong Wolfe line search), warm-started from theta_i.

    Eq. 16 is a G-weighted least-squares fit of f_i to -Y_u / (rho G_u) plus beta R: smooth and, for the
    small local models here, well solved by a quasi-Newton method in ``max_iter`` iterations over the
    active rows (G > 0), deterministically. ``prox = (v, rho')``: one shard's consensus step (Eq. 22).
    """
    active = torch.nonzero(G > 0).flatten()
    if len(active) == 0:
        return
    Xa, Ga, Ya = X[active], G[active, None], Y[active]
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
                            line_search_fn="strong_wolfe", tolerance_grad=1e-10, tolerance_change=1e-14)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        f = model(Xa)
        loss = ((Ya * f).sum() + 0.5 * rho * (Ga * f * f).sum()) / N + theta_penalty(model, beta, prox)
        loss.backward()
        return loss

    opt.step(closure)
