"""Block-Jacobi preconditioned conjugate gradient over the join, client side (docs/algorithms.md, section
"pcg"; Hestenes & Stiefel 1952, preconditioned as in Saad, Iterative Methods, Alg. 9.1).

Linear regression with ridge penalty over the join solves the normal equations
``(A^T A / N + beta I) theta = A^T y / N`` with ``A = [P_1 T_1 ... P_M T_M]`` (T_i = [X_i, 1] with a bias).
Each table keeps its own blocks of the CG vectors (theta_i, r_i, z_i, p_i) and its preconditioner block
``M_i = T_i^T diag(G_i) T_i / N + beta I`` (Cholesky-factored once), so no parameter vector, search direction
or feature moment leaves the node; the server sees what TP-Join-ADMM's server sees (per-row outputs of the
table's own rows) plus a few scalars:

  pcg_setup {G, s}   -> {h = T z, dots = [r.z, r.r]}        s = P_i^T y: r = T^T s / N, z = M^-1 r, p = z
  pcg_apply {s}, beta -> {dots = [p.Ap]}                     p = z + beta p; s = P_i^T (A p): Ap = T^T s / N + beta p
  pcg_step  alpha     -> {h = T z, h_eval = T theta, dots}   theta += alpha p, r -= alpha Ap, z = M^-1 r
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg
import torch

from tpflower.client import TableClient
from tpflower.guard import Phase, Stage
from tpflower.params import AlgorithmParams, nonnegative, param
from tpflower.phases import setup
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.state import StateRecord

WHY_NO_FEATURE_DP = (
    "PCG exchanges exact partial products of the features every iteration; there is no per-row gradient step "
    "to clip and noise. Run algorithm=admm with privacy=dpsgd"
)


@dataclass(frozen=True)
class PCGParams(AlgorithmParams):
    """algorithm.* of algorithm=pcg (conf/algorithm/pcg.yaml)."""

    tol: float = param(nonnegative, 1e-8)  # stop once ||r|| <= tol ||r_0|| (normal equations' residual); 0: never


@dataclass
class PCGState(StateRecord):
    """This table's blocks of the CG vectors and its preconditioner's Cholesky factor (all float64)."""

    L: np.ndarray | None = None  # lower Cholesky factor of M_i
    theta: np.ndarray | None = None
    r: np.ndarray | None = None
    z: np.ndarray | None = None
    p: np.ndarray | None = None
    Ap: np.ndarray | None = None
    w: np.ndarray | None = None  # M_i^-1 Ap
    N: int = 0

    @classmethod
    def of(cls, client: TableClient) -> PCGState:
        state = cls.load(client.state)
        if state is None:
            raise RuntimeError(f"table {client.settings.table!r}: a PCG step before pcg_setup")
        return state


def design(client: TableClient, model: torch.nn.Module) -> np.ndarray:
    """T_i: the table's feature rows with a column of ones when its linear model has a bias (float64)."""
    if not isinstance(model, torch.nn.Linear) or model.out_features != 1:
        raise ValueError(
            f"table {client.settings.table!r}: algorithm=pcg solves linear ridge regression (model=linear, one output)"
        )
    X = np.asarray(client.rows_X(None), dtype=np.float64)
    return np.concatenate([X, np.ones((len(X), 1))], axis=1) if model.bias is not None else X


def set_theta(model: torch.nn.Linear, theta: np.ndarray) -> None:
    """The model's weight and bias from theta in T_i's column order."""
    d = model.in_features
    with torch.no_grad():
        model.weight.copy_(torch.as_tensor(theta[:d].reshape(1, d)))
        if model.bias is not None:
            model.bias.copy_(torch.as_tensor(theta[d:]))


def wire(client: TableClient, values: np.ndarray) -> np.ndarray:
    """Per-row outputs as a column in the run's precision."""
    return np.asarray(values, dtype=str(client.dtype).removeprefix("torch.")).reshape(-1, 1)


def pcg_setup(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Factor M_i, start from theta = 0: r = T^T s / N (s = P_i^T y), z = M^-1 r, p = z."""
    model = client.model(config)
    T = design(client, model)
    G, s, N = np.asarray(arrays["G"], np.float64), np.asarray(arrays["s"], np.float64).ravel(), int(config["N"])
    beta = float(client.settings.model["beta"])
    L = np.linalg.cholesky((T.T * G) @ T / N + beta * np.eye(T.shape[1]))
    r = T.T @ s / N
    z = scipy.linalg.cho_solve((L, True), r)
    zero = np.zeros_like(r)
    PCGState(L, zero, r, z, z.copy(), zero, zero, N).save(client.state)
    set_theta(model, zero)
    client.state.save_model(model)
    return {"h": wire(client, T @ z), "dots": np.array([r @ z, r @ r])}, {}


def pcg_apply(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """p = z + beta p (beta of the previous iteration), then Ap = T^T s / N + beta_ridge p and w = M^-1 Ap."""
    st = PCGState.of(client)
    T = design(client, client.model(config))
    st.p = st.z + float(config["beta"]) * st.p
    st.Ap = T.T @ np.asarray(arrays["s"], np.float64).ravel() / st.N + float(client.settings.model["beta"]) * st.p
    st.w = scipy.linalg.cho_solve((st.L, True), st.Ap)
    st.save(client.state)
    return {"dots": np.array([st.p @ st.Ap])}, {}


def pcg_step(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """theta += alpha p, r -= alpha Ap, z -= alpha w (= M^-1 r); the new T z, T theta and r.z, r.r."""
    st = PCGState.of(client)
    model = client.model(config)
    T = design(client, model)
    alpha = float(config["alpha"])
    st.theta = st.theta + alpha * st.p
    st.r = st.r - alpha * st.Ap
    st.z = st.z - alpha * st.w
    st.save(client.state)
    set_theta(model, st.theta)
    client.state.save_model(model)
    out = {
        "h": wire(client, T @ st.z),
        "h_eval": wire(client, T @ st.theta),
        "dots": np.array([st.r @ st.z, st.r @ st.r]),
    }
    return out, client.reg_metrics(model)


START = Stage("start", {"pcg_setup": Phase(pcg_setup)})
TRAIN: dict[str, Phase] = {"pcg_apply": Phase(pcg_apply), "pcg_step": Phase(pcg_step)}

register(
    AlgorithmEntry(
        "tp_join_pcg",
        "pcg",
        "join",
        "pcg",
        "TPJoinPCG",
        setup.loj_protocol(START, TRAIN),
        PCGParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="block-Jacobi preconditioned CG on the ridge normal equations over the join",
    )
)
