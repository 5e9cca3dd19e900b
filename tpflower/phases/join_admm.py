"""TP-Join-ADMM and VFL-ADMM, client side (TablePuppet Eq. 14-16).

admm_setup   {G}  -> {}          store G_i (Eq. 15, constant), N and rho; build theta_i^0 (kept on the node)
admm_update  {Y}  -> {h}         theta_i = argmin Eq. 16 (closed form for linear models); predict every row;
                                 config ``rho``: the epoch's penalty (residual balancing changes it)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpflower.client import TableClient
from tpflower.design import Design, node_design
from tpflower.guard import Phase, Stage, takes
from tpflower.join_counts import check_join_counts, compact_counts
from tpflower.models import l2_penalty
from tpflower.params import (
    AlgorithmParams,
    above_one,
    boolean,
    nonnegative,
    nonnegative_int,
    one_of,
    or_word,
    param,
    positive,
    positive_int,
)
from tpflower.phases import setup
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.state import StateRecord
from tpflower.validation import PATIENCE


def admm_update_linear(
    model: torch.nn.Linear,
    T: Design,
    G: np.ndarray,
    Y: np.ndarray,
    N: int,
    rho: float,
    beta: float,
    prox: tuple[np.ndarray, float] | None = None,
) -> None:
    """Exact minimiser of Eq. 16 for f(x) = x W^T + b with R = 1/2 ||(W, b)||^2:

    (rho T^T diag(G) T / N + beta I) Theta = -T^T Y / N, with T = [X, 1] when the model has a bias.
    With ``prox = (v, rho')`` it solves one shard's consensus step instead (Eq. 22): the regulariser moves
    to the coordinator and rho'/2 ||Theta - v||^2 takes its place, v = w - u^q in flat parameter order.
    Solved in float64 (tpflower.design: T^T diag(G) T and T^T Y over blocks of rows, or on a sparse T); the
    rows with G = 0 only enter through T^T Y (where Y is 0 too).
    """
    bias, d, d_c = model.bias is not None, T.X.shape[1], Y.shape[1]
    rhs = -T.tdot(Y) / N
    if prox is None:
        A = (rho / N) * T.gram(G) + beta * np.eye(T.d)
    else:
        v, rho_c = prox
        A = (rho / N) * T.gram(G) + rho_c * np.eye(T.d)
        rhs = rhs + rho_c * flat_to_theta(v, d, d_c, bias)
    Theta = np.linalg.solve(A, rhs)  # (d [+1]) x d_c
    with torch.no_grad():
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
    opt = torch.optim.LBFGS(
        model.parameters(),
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-10,
        tolerance_change=1e-14,
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        f = model(Xa)
        loss = ((Ya * f).sum() + 0.5 * rho * (Ga * f * f).sum()) / N + theta_penalty(model, beta, prox)
        loss.backward()
        return loss

    opt.step(closure)


def relaxation(what: str, value) -> float:
    """An over-relaxation factor in (0, 2) (Boyd et al. 2011, Sec. 3.4.3)."""
    out = positive(what, value)
    if out >= 2:
        raise ValueError(f"{what} must be in (0, 2), got {value!r}")
    return out


@dataclass(frozen=True)
class ADMMParams(AlgorithmParams):
    """TP-Join-ADMM, TP-UCQ-ADMM, VFL-ADMM (conf/algorithm/admm.yaml)."""

    rho: float | str = param(or_word(positive, "auto"), "auto")
    # residual balancing (Boyd Sec. 3.4.1), also of rho_inner; auto: on unless Anderson acceleration is
    adapt_rho: bool | str = param(or_word(boolean, "auto"), "auto")
    rho_mu: float = param(above_one, 10.0)  # rebalance once one residual exceeds mu times the other
    rho_tau: float = param(above_one, 2.0)  # ... by this factor
    rho_warmup: int = param(nonnegative_int, 3)  # iterations before the first change (the start's transient)
    rho_mu_persistent: float = param(above_one, 2.0)  # ... or beyond this ratio for rho_patience iterations
    rho_patience: int = param(nonnegative_int, 3)  # 0: Boyd's rule alone (the paper's)
    relax: float = param(relaxation, 1.5)  # over-relaxation (Boyd Sec. 3.4.3): H^ = a H + (1 - a) z_prev; 1: off
    # Anderson acceleration of the server's iteration (strategies/anderson.py): memory m; 0: off (the paper's
    # iteration); auto: 10 over a join with the sharing variant, linear models and no feature DP, else 0
    anderson: int | str = param(or_word(nonnegative_int, "auto"), "auto")
    anderson_mb: float = param(positive, 1000.0)  # auto: the largest memory whose window fits in this
    # per-table subspace acceleration (strategies/subspace.py): the last m outputs of each table; 0: off;
    # auto: 10 for regression with linear models, the sharing variant and no feature DP (then anderson is off)
    subspace: int | str = param(or_word(nonnegative_int, "auto"), "auto")
    subspace_mb: float = param(positive, 2000.0)  # auto: at most the memory whose pairs fit in this
    tol: float = param(nonnegative, 1e-3)  # stop once both residuals are below Boyd's Eq. 3.12 (0: never)
    variant: str = param(one_of("sharing", "paper"), "sharing")
    local_solver: str = param(one_of("lbfgs", "adam"), "lbfgs")  # theta-update of non-linear models (no DP)
    local_steps: int = param(positive_int, 20)  # lbfgs: iterations per theta-update
    local_epochs: int = param(positive_int, 1)
    local_lr: float = param(positive, 0.01)
    local_batch_size: int = param(positive_int, 256)
    inner_rounds: int = param(positive_int, 10)
    inner_tol: float = param(nonnegative, 1e-6)
    rho_inner: float | str | None = param(or_word(positive, "auto", None), "auto")
    warm_dual: bool = param(boolean, True)  # keep the consensus duals u^q across epochs (false: reset, as Sec. 8)
    # evaluations without a lower validation loss that stop the run (0: never), with a validation part
    early_stopping: int = param(nonnegative_int, PATIENCE)


@dataclass
class ADMMState(StateRecord):
    """G_i over the client's rows (Eq. 15), the number of joined training rows N and the penalty rho."""

    G: np.ndarray | None = None
    N: int = 0
    rho: float = 0.0

    @classmethod
    def of(cls, client: TableClient) -> ADMMState:
        return cls.required(client.state, client.settings.table, "an ADMM update before admm_setup")


def epoch_rho(config: Mapping[str, Any], state: ADMMState) -> float:
    """The rho of this theta-update: the round's config (residual balancing, Boyd Sec. 3.4.1), else setup's."""
    rho = float(config.get("rho", state.rho))
    if not (np.isfinite(rho) and rho > 0):
        raise ValueError(f"admm: rho must be a positive number, got {rho!r}")
    return rho


def theta_update(
    client: TableClient,
    model: torch.nn.Module,
    rows: np.ndarray | None,
    G: np.ndarray,
    Y: np.ndarray,
    N: int,
    rho: float,
    beta: float,
    config: Mapping[str, Any],
    prox: tuple[np.ndarray, float] | None = None,
) -> None:
    """theta_i = argmin Eq. 16 without DP over the client's rows ``rows`` (all: None; TableClient.rows_X), in
    place: the closed form for a linear model, else the client's algorithm.local_solver (lbfgs: local_steps
    L-BFGS iterations; adam: local_epochs of Adam). ``prox`` = (v, rho'): the consensus step of a shard (Eq.
    22), rho'/2 ||theta - v||^2 added."""
    alg = client.settings.algorithm
    if isinstance(model, torch.nn.Linear):  # closed form, solved in float64 numpy
        T = node_design(client, model.bias is not None, rows)
        admm_update_linear(model, T, G, np.asarray(Y), N, rho, beta, prox=prox)
        return
    X = client.rows_X(rows)
    prox_t = None if prox is None else (client.tensor(prox[0]), prox[1])
    if alg.local_solver == "lbfgs":
        admm_update_lbfgs(
            model, client.tensor(X), client.tensor(G), client.tensor(Y), N, rho, beta, alg.local_steps, prox=prox_t
        )
    else:
        admm_update_local_opt(
            model,
            client.tensor(X),
            client.tensor(G),
            client.tensor(Y),
            N,
            rho,
            beta,
            alg.local_epochs,
            alg.local_lr,
            alg.local_batch_size,
            client.local_generator(config),
            prox=prox_t,
        )


def admm_setup(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Store G_i, N and rho (the server resolves algorithm.rho=auto) and build theta_i^0. Nothing of the model
    leaves: ADMM starts from x^0 = 0 (Boyd Sec. 3.1), so the server needs no prediction of theta_i^0, and
    theta_i^0 next to f_i(theta_i^0; X) would give X away (docs/threat-model.md, A deviating server)."""
    s = client.settings
    where = f"table {s.table!r} shard {s.shard} (algorithm {client.algorithm!r}), phase 'admm_setup'"
    # G_i as a join gives it (tpflower.join_counts); a shard of a union's table holds part of the N rows
    N = None if s.federated_prep else config["N"]
    held_out = float(config.get("validation_fraction", 0.0))  # the run's validation part (tpflower.validation)
    G = check_join_counts(client, arrays["G"], where, training_join=True, N=N, validation=held_out)
    ADMMState(compact_counts(G), int(config["N"]), float(config["rho"])).save(client.state)
    client.dp.init(config, lambda: client.dp.admm_rate(G))
    model = client.model(config)
    client.state.save_model(model)
    return {}, {"n_params": int(client.theta(model).size)}


def admm_update(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """theta_i = argmin Eq. 16 given Y_i, G_i; then predict every row with the new theta."""
    Y = arrays["Y"]
    model = client.model(config)
    s = ADMMState.of(client)
    rho = epoch_rho(config, s)
    alg, beta = client.settings.algorithm, float(client.settings.model["beta"])
    privacy: dict[str, Any] = {}
    if client.dp.on:  # Eq. 16 as DP-SGD over the table's rows (also for linear models)
        Xt, Gt, Yt = client.dp.admm_rows(s.G, Y)
        trainer = client.dp.trainer(model)
        trainer.admm_update(
            client.tensor(Xt),
            client.tensor(Gt),
            client.tensor(Yt),
            s.N,
            rho,
            beta,
            alg.local_epochs,
            alg.local_lr,
            alg.local_batch_size,
            client.dp.sample_generator(),
        )
        client.dp.done(trainer, privacy)
    else:
        theta_update(client, model, None, s.G, Y, s.N, rho, beta, config)
    client.state.save_model(model)
    return {"h": client.predict(model, None)}, {**client.reg_metrics(model), **privacy}


START = Stage("start", {"admm_setup": Phase(admm_setup, inputs=takes("G"))})
TRAIN: dict[str, Phase] = {"admm_update": Phase(admm_update, inputs=takes("Y"), exact=True, dp_noised=True)}


register(
    AlgorithmEntry(
        "tp_join_admm",
        "admm",
        "join",
        "join_admm",
        "TPJoinADMM",
        setup.loj_protocol(START, TRAIN),
        ADMMParams,
        summary="TP-Join-ADMM (Eq. 7, 8, 14-16): one round trip per epoch",
    )
)
register(
    AlgorithmEntry(
        "vfl_admm",
        "vfl_admm",
        "join",
        "join_admm",
        "VFLADMM",
        setup.loj_protocol(START, TRAIN, vfl=True),
        ADMMParams,
        summary="VFL-ADMM baseline on the expanded join",
    )
)
