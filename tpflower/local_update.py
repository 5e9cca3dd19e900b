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


def admm_objective(
    model: torch.nn.Module, X: torch.Tensor, G: torch.Tensor, Y: torch.Tensor, N: int, rho: float, beta: float
) -> torch.Tensor:
    """beta R_i(theta) + (1/N) sum_u [Y_iu^T f_i(T_iu) + rho G_iu / 2 ||f_i(T_iu)||^2] (Eq. 16)."""
    f = model(X)
    return beta * l2_penalty(model) + ((Y * f).sum() + 0.5 * rho * (G[:, None] * f * f).sum()) / N


def admm_update_linear(model: torch.nn.Linear, X: np.ndarray, G: np.ndarray, Y: np.ndarray, N: int, rho: float, beta: float) -> None:
    """Exact minimiser of Eq. 16 for f(x) = x W^T + b with R = 1/2 ||(W, b)||^2:

    (rho X1^T diag(G) X1 / N + beta I) Theta = -X1^T Y / N, with X1 = [X, 1] when the model has a bias.
    Solved in float64; the rows with G = 0 only enter through X1^T Y (where Y is 0 too).
    """
    X1 = np.concatenate([X, np.ones((len(X), 1))], axis=1) if model.bias is not None else X
    A = (rho / N) * (X1.T * G) @ X1 + beta * np.eye(X1.shape[1])
    Theta = np.linalg.solve(A, -(X1.T @ Y) / N)  # (d [+1]) x d_c
    with torch.no_grad():
        d = X.shape[1]
        model.weight.copy_(torch.as_tensor(Theta[:d].T))
        if model.bias is not None:
            model.bias.copy_(torch.as_tensor(Theta[d]))


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
) -> None:
    """Warm-started Adam on Eq. 16 (non-linear f_i), over mini-batches of the rows that occur in the join.

    A mini-batch b of the n_a active rows estimates the sum over rows without bias: (n_a / |b|) sum_{u in b}.
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
            loss = beta * l2_penalty(model) + data * (n_a / len(rows)) / N
            opt.zero_grad()
            loss.backward()
            opt.step()
