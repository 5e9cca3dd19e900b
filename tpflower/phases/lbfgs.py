"""L-BFGS over the join, client side (docs/algorithms.md, section "L-BFGS"; Nocedal & Wright, Numerical
Optimization, Alg. 7.4 and 7.5; the two-loop recursion on inner products as in Chen et al. 2014, "Large-scale
L-BFGS using MapReduce").

The objective is TablePuppet Eq. 2 over the whole training join, F(theta) = (1/N) sum_j l(H_j; y_j) +
beta sum_i R_i(theta_i), for any loss and local model (linear or MLP). Its parameter vector is the
concatenation of the tables' theta_i: table i keeps its own block of theta, of the gradient g and of the
L-BFGS memory (the pairs s_k = theta_{k+1} - theta_k, y_k = g_{k+1} - g_k), and sends only per-row outputs
(as TP-Join-SGD with B = [N]) and the partial inner products of its blocks (the Gram matrix of
[s_0..s_{c-1}, y_0..y_{c-1}, g]); the server sums them and runs the two-loop recursion on scalars, returning
the direction as coefficients over that basis. No block of theta, g, s or y leaves the table.

  lbfgs_start {}                    -> {h}     h = f_i(theta_i; rows) for every row of the table, R_i
  lbfgs_grad  {Y}, t                -> {gram}  theta += t d (the accepted step; t = 0: none), the gradient
                                               g_i = J_i^T Y / N + beta theta_i (Y = S_i dl/dH), the new pair
                                               (s = t d, y = g - g_prev) as the memory's last candidate
  lbfgs_trial {delta, pairs}, t     -> {h}     d = [S, Y, g] delta, the memory keeps the pairs ``pairs``;
              (later trials: t only)           h = f_i(theta_i + t d; rows), R_i at that point
  lbfgs_take  t                     -> {}      the run's end: theta += t d (the last accepted step)

The union (TP-UCQ: a table split by rows over shards, every shard holding the same theta_i and the same
memory): a shard answers lbfgs_partial instead of lbfgs_grad, in the same round trip, with its partial data
gradient a_q = J_q^T Y_q / N over its rows (as TP-UCQ-SGD's Eq. 18) and the inner products the server needs
to assemble its table's Gram matrix without a second round: V^T a_q and V^T V for V = [S, Y, r, (s, u)], with
r = beta dR/dtheta_i at the new theta, s = t d the candidate step and u = r - g_prev. The server (the shards'
coordinator) sums a = sum_q a_q and sends it with the iteration's first lbfgs_trial, where every shard
completes g = a + r and the candidate pair's y = g - g_prev:

  lbfgs_partial {Y}, t              -> {g, cross, gram, layout}   a shard: theta += t d; a_q, V^T a_q, V^T V,
                                               [c, candidate]; once per iteration (a second before the
                                               iteration's first lbfgs_trial is refused)
  lbfgs_trial {delta, pairs, g}, t  -> {h}     a shard's first trial of an iteration also carries a; the
                                               shard sets g = a + r, y = g - g_prev, then as above
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpflower.client import TableClient
from tpflower.guard import Phase, ProtocolRefusal, Stage, refusal, sharded, takes, unsharded
from tpflower.models import l2_penalty
from tpflower.params import AlgorithmParams, nonnegative, nonnegative_int, param, positive_int, probability
from tpflower.phases import setup
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.state import StateRecord
from tpflower.validation import PATIENCE

WHY_NO_FEATURE_DP = (
    "L-BFGS takes exact full-batch gradient steps and exchanges exact inner products of the gradient blocks; "
    "there is no per-row step to clip and noise. Run algorithm=admm or sgd"
)


@dataclass(frozen=True)
class LBFGSParams(AlgorithmParams):
    """algorithm.* of algorithm=lbfgs (conf/algorithm/lbfgs.yaml)."""

    memory: int = param(positive_int, 10)  # m: the (s, y) pairs kept
    # stop once ||g|| <= tol ||g_0|| or (F_k - F_{k+1}) <= tol max(|F_k|, |F_{k+1}|, 1); 0: never
    tol: float = param(nonnegative, 1e-9)
    c1: float = param(probability, 1e-4)  # Armijo's sufficient decrease: F(theta + t d) <= F + c1 t g.d
    backtrack: float = param(probability, 0.5)  # t *= backtrack after a rejected trial
    max_trials: int = param(positive_int, 20)  # trial steps per iteration before the line search gives up
    # evaluations without a lower validation loss that stop the run (0: never), with a validation part
    early_stopping: int = param(nonnegative_int, PATIENCE)


@dataclass
class LBFGSState(StateRecord):
    """This table's blocks (float64): the memory S, Yk (d_i x c, oldest first; the last column may be the
    candidate pair not yet accepted by the server), the gradient g at theta and the direction d."""

    S: np.ndarray | None = None
    Yk: np.ndarray | None = None
    g: np.ndarray | None = None
    d: np.ndarray | None = None
    r: np.ndarray | None = None  # a shard after lbfgs_partial: beta dR/dtheta, until the summed a arrives

    @classmethod
    def of(cls, client: TableClient, phase: str) -> LBFGSState:
        return cls.required(client.state, client.settings.table, f"{phase} before lbfgs_start")


def flat(model: torch.nn.Module) -> np.ndarray:
    """theta_i as one float64 vector (the model's parameters in their order)."""
    params = list(model.parameters())
    if not params:
        return np.zeros(0)
    return torch.nn.utils.parameters_to_vector(params).detach().cpu().double().numpy()


def set_flat(model: torch.nn.Module, theta: np.ndarray) -> None:
    params = list(model.parameters())
    if params:
        with torch.no_grad():
            vec = torch.as_tensor(theta, dtype=params[0].dtype, device=params[0].device)
            torch.nn.utils.vector_to_parameters(vec, params)


def gradient(model: torch.nn.Module, X: torch.Tensor, Y: torch.Tensor, N: int, beta: float) -> np.ndarray:
    """g_i = (1/N) sum_u Y_iu^T dh_iu/dtheta_i + beta dR_i/dtheta_i (Eq. 12-13 with B = [N]), float64."""
    params = list(model.parameters())
    if not params:
        return np.zeros(0)
    model.zero_grad()
    ((Y * model(X)).sum() / N + beta * l2_penalty(model)).backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return torch.cat([g.reshape(-1) for g in grads]).detach().cpu().double().numpy()


def penalty_gradient(model: torch.nn.Module, beta: float) -> np.ndarray:
    """r = beta dR_i/dtheta_i at the model's theta, float64."""
    params = list(model.parameters())
    if not params:
        return np.zeros(0)
    model.zero_grad()
    (beta * l2_penalty(model)).backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return torch.cat([g.reshape(-1) for g in grads]).detach().cpu().double().numpy()


def rows_and_derivatives(client: TableClient, arrays: Arrays, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
    """X of every row of the client and Y, one row of derivatives per row (never broadcast over the rows)."""
    X, Y = client.rows_X(None), np.asarray(arrays["Y"])
    if Y.ndim != 2 or len(Y) != len(X):
        raise refusal(
            client,
            f"{phase}: Y must hold one row of derivatives per row",
            f"{phase} with Y of shape {Y.shape} for {len(X)} rows",
        )
    return client.tensor(X), client.tensor(Y)


def basis(state: LBFGSState) -> np.ndarray:
    """[s_0..s_{c-1}, y_0..y_{c-1}, g] as columns (d_i x (2c + 1))."""
    assert state.S is not None and state.Yk is not None and state.g is not None
    return np.column_stack([state.S, state.Yk, state.g])


def lbfgs_start(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """theta_0 (the seeded initialisation), an empty memory; the outputs of every row of the table."""
    model = client.model(config)
    client.state.save_model(model)
    d = len(flat(model))
    LBFGSState(np.zeros((d, 0)), np.zeros((d, 0)), None, None).save(client.state)
    return {"h": client.predict(model, None)}, client.reg_metrics(model)


def take_step(client: TableClient, model: torch.nn.Module, st: LBFGSState, t: float) -> None:
    """theta += t d: the step the server accepted (the trial point becomes the iterate)."""
    if st.d is None:
        raise RuntimeError(f"table {client.settings.table!r}: a step t={t} without a direction")
    set_flat(model, flat(model) + t * st.d)
    client.state.save_model(model)


def lbfgs_grad(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Take the accepted step t d, then g_i at the new theta; the partial Gram matrix of [S, Y, g]."""
    st = LBFGSState.of(client, "lbfgs_grad")
    model = client.model(config)
    X, Y = rows_and_derivatives(client, arrays, "lbfgs_grad")
    t = float(config["t"])
    if t:
        take_step(client, model, st, t)
    g = gradient(model, X, Y, int(config["N"]), float(client.settings.model["beta"]))
    if st.g is not None and t:  # the new pair, a candidate until the server keeps it (lbfgs_trial's pairs)
        st.S = np.column_stack([st.S, t * st.d])
        st.Yk = np.column_stack([st.Yk, g - st.g])
    st.g, st.d = g, None
    st.save(client.state)
    B = basis(st)
    return {"gram": B.T @ B}, {}


def lbfgs_partial(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """A shard of a sharded table: take the accepted step t d, then its partial data gradient
    a_q = J_q^T Y_q / N over its rows and the products V^T a_q, V^T V of V = [S, Y, r, (s, u)] (module
    docstring); the candidate step s joins S now, its y with the summed a (lbfgs_trial)."""
    st = LBFGSState.of(client, "lbfgs_partial")
    if st.r is not None:
        raise ProtocolRefusal(
            f"table {client.settings.table!r} shard {client.settings.shard}: one lbfgs_partial per iteration; "
            "a second before the iteration's lbfgs_trial is refused"
        )
    model = client.model(config)
    X, Y = rows_and_derivatives(client, arrays, "lbfgs_partial")
    t = float(config["t"])
    if t:
        take_step(client, model, st, t)
    a = gradient(model, X, Y, int(config["N"]), 0.0)
    r = penalty_gradient(model, float(client.settings.model["beta"]))
    assert st.S is not None and st.Yk is not None
    candidate = st.g is not None and bool(t)
    columns = [st.S, st.Yk, r[:, None]]
    if candidate:
        assert st.d is not None and st.g is not None
        columns += [t * st.d[:, None], (r - st.g)[:, None]]
    V = np.column_stack(columns)
    layout = np.array([st.S.shape[1], int(candidate)], dtype=np.int64)
    if candidate:
        st.S = np.column_stack([st.S, t * st.d])
    st.d, st.r = None, r
    st.save(client.state)
    return {"g": a, "cross": V.T @ a, "gram": V.T @ V, "layout": layout}, {}


def complete_gradient(client: TableClient, st: LBFGSState, arrays: Arrays) -> None:
    """A shard's first trial after lbfgs_partial: g = a + r with the server's sum a of the shards' partial
    gradients, and the candidate pair's y = g - g_prev."""
    where = f"table {client.settings.table!r} shard {client.settings.shard}"
    if st.r is None:
        if "g" in arrays:
            raise ProtocolRefusal(f"{where}: lbfgs_trial with a summed gradient but no lbfgs_partial before it")
        return
    if "g" not in arrays or "delta" not in arrays:
        raise ProtocolRefusal(f"{where}: the first lbfgs_trial after lbfgs_partial carries the summed gradient g")
    a = np.asarray(arrays["g"], dtype=np.float64).ravel()
    if a.shape != st.r.shape:
        raise refusal(client, "lbfgs_trial: the summed gradient is not this table's size", f"{a.size} vs {st.r.size}")
    assert st.S is not None and st.Yk is not None
    g = a + st.r
    if st.S.shape[1] > st.Yk.shape[1]:  # the candidate pair of lbfgs_partial's step
        assert st.g is not None
        st.Yk = np.column_stack([st.Yk, g - st.g])
    st.g, st.r = g, None


def lbfgs_trial(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The direction (first trial of an iteration: d = [S, Y, g] delta, then keep the memory's ``pairs``), and
    the outputs of every row at theta + t d, with R_i there. A shard completes its gradient first
    (:func:`complete_gradient`)."""
    st = LBFGSState.of(client, "lbfgs_trial")
    complete_gradient(client, st, arrays)
    model = client.model(config)
    if "delta" in arrays:
        B = basis(st)
        delta = np.asarray(arrays["delta"], dtype=np.float64).ravel()
        pairs = np.asarray(arrays["pairs"], dtype=np.int64).ravel()
        c = st.S.shape[1]
        if len(delta) != B.shape[1] or (pairs.size and (pairs.min() < 0 or pairs.max() >= c)):
            raise refusal(
                client,
                "lbfgs_trial: delta and pairs do not fit this table's memory",
                f"{len(delta)} coefficients, pairs {pairs.tolist()}, {c} pairs kept",
            )
        st.d = B @ delta
        st.S, st.Yk = st.S[:, pairs], st.Yk[:, pairs]
        st.save(client.state)
    if st.d is None:
        raise RuntimeError(f"table {client.settings.table!r}: lbfgs_trial without a direction")
    theta = flat(model)
    set_flat(model, theta + float(config["t"]) * st.d)
    out = {"h": client.predict(model, None)}
    metrics = client.reg_metrics(model)
    set_flat(model, theta)  # the trial point is not taken until the server accepts it (lbfgs_grad's t)
    return out, metrics


def lbfgs_take(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The run's last accepted step (the next gradient message would have taken it)."""
    st = LBFGSState.of(client, "lbfgs_take")
    model = client.model(config)
    take_step(client, model, st, float(config["t"]))
    st.d = None
    st.save(client.state)
    return {}, client.reg_metrics(model)


START = Stage("start", {"lbfgs_start": Phase(lbfgs_start)})
# a shard's first trial of an iteration carries the server's sum g of the shards' partial gradients: only on a
# shard of a sharded table, right after its own lbfgs_partial
TRIAL = Phase(lbfgs_trial, inputs=takes("delta", "pairs", union={"g": "lbfgs_partial"}), exact=True)
TRAIN: dict[str, Phase] = {
    "lbfgs_grad": Phase(lbfgs_grad, inputs=takes("Y"), exact=True),
    "lbfgs_trial": TRIAL,
    "lbfgs_take": Phase(lbfgs_take),
}

# the union: tables with one shard answer lbfgs_grad, the shards of a sharded table lbfgs_partial
UCQ_TRAIN: dict[str, Phase] = {
    "lbfgs_grad": Phase(lbfgs_grad, unsharded, inputs=takes("Y"), exact=True),
    "lbfgs_partial": Phase(lbfgs_partial, sharded, inputs=takes("Y"), exact=True),
    "lbfgs_trial": TRIAL,
    "lbfgs_take": Phase(lbfgs_take),
}

register(
    AlgorithmEntry(
        "tp_join_lbfgs",
        "lbfgs",
        "join",
        "lbfgs",
        "TPJoinLBFGS",
        setup.loj_protocol(START, TRAIN),
        LBFGSParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="full-batch L-BFGS over the join (two-loop recursion on the tables' partial inner products)",
    )
)
register(
    AlgorithmEntry(
        "tp_ucq_lbfgs",
        "lbfgs",
        "ucq",
        "lbfgs",
        "TPUCQLBFGS",
        setup.loj_protocol(START, UCQ_TRAIN),
        LBFGSParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="full-batch L-BFGS over the union: the shards' partial gradients summed, 2 round trips an iteration",
    )
)
