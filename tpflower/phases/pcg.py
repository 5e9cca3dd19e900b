"""Block-Jacobi preconditioned conjugate gradient over the join, the union and a weighted coreset, client side
(docs/algorithms.md, section "pcg"; Hestenes & Stiefel 1952, preconditioned as in Saad, Iterative Methods,
Alg. 9.1).

Linear regression with ridge penalty solves the normal equations ``(A^T W A / N + beta I) theta = A^T W y / N``
with ``A = [P_1 T_1 ... P_M T_M]`` (T_i = [X_i, 1] with a bias; W the joined rows' weights: 1, or a coreset's
w_j). Each table keeps its own blocks of the CG vectors (theta_i, r_i, z_i, p_i) and its preconditioner block
``M_i = T_i^T diag(G_i) T_i / N + beta I`` (G_i the summed weights of its rows; Cholesky-factored once). One
round trip per iteration: the server never needs p_{k+1} itself, only its per-row outputs
T_i p_{k+1,i} = T_i z_{k+1,i} + beta_k T_i p_{k,i}, and p.Ap from ||A p||_W^2 and the partial norms of p:

  pcg_setup {G, s | gram, g}       -> {h = T z, dots}   r = T^T s / N (s = P_i^T W y), z = M^-1 r, p = 0
  pcg_step  {s | g}, alpha, beta   -> {h = T z, dots}   (the server follows T theta += alpha T p itself)
        p = z + beta p;  Ap = T^T s / N + beta_ridge p  (s = P_i^T W A p);  theta += alpha p;  r -= alpha Ap;
        z = M^-1 r;  dots = [r.z, z.z, z.p, r.r]  (partial inner products over this table's block)

The union (a table split over shards): each shard sends its partial products T_q^T diag(G_q) T_q and
T_q^T s_q (``pcg_gram`` once, ``pcg_partial`` per iteration); the server, the shards' coordinator as in
TP-UCQ-SGD/ADMM, sums them and sends the sums (``gram``, ``g``) with the next message; every shard then holds
the same block vectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg
import scipy.sparse
import torch

from tpflower.client import TableClient
from tpflower.design import Design, node_design
from tpflower.guard import Phase, Protocol, ProtocolRefusal, Stage, refusal, sharded, takes
from tpflower.params import AlgorithmParams, nonnegative, nonnegative_int, param, positive
from tpflower.phases import setup
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.state import StateRecord

WHY_NO_FEATURE_DP = (
    "PCG exchanges exact partial products of the features every iteration; there is no per-row gradient step "
    "to clip and noise. Run algorithm=admm"
)


PARTIAL = "pcg.partial"  # 1 between a shard's pcg_partial and its pcg_step


@dataclass(frozen=True)
class PCGParams(AlgorithmParams):
    """algorithm.* of algorithm=pcg (conf/algorithm/pcg.yaml)."""

    tol: float = param(nonnegative, 1e-8)  # stop once ||r|| <= tol ||r_0|| (normal equations' residual); 0: never
    # one search direction per table (multipreconditioned CG, Bridson & Greif 2006), A-orthogonalized against the
    # last ``window`` iterations' directions; 0: one direction, the classic block-Jacobi PCG recurrence
    window: int = param(nonnegative_int, 4)
    # the server's window state (T_i P_j: tables x table rows values per direction block) at most this; a window
    # that does not fit is shortened (0: the classic recurrence), with a line saying so
    window_mb: float = param(positive, 1000.0)


@dataclass
class PCGState(StateRecord):
    """This table's blocks of the CG vectors and its preconditioner's Cholesky factor (all float64); ``rows``:
    the table rows the problem covers (a coreset's), None for all."""

    L: np.ndarray | None = None  # lower Cholesky factor of M_i
    theta: np.ndarray | None = None
    r: np.ndarray | None = None
    z: np.ndarray | None = None
    p: np.ndarray | None = None
    N: int = 0
    rows: np.ndarray | None = None
    # multipreconditioned CG (window > 0): the table's blocks of the last ``window`` direction blocks P_j (k x d x c)
    # and its column among the c = M directions
    P: np.ndarray | None = None
    window: int = 0
    col: int = 0
    cols: int = 0

    @classmethod
    def of(cls, client: TableClient) -> PCGState:
        return cls.required(client.state, client.settings.table, "a PCG step before pcg_setup")


def design(client: TableClient, model: torch.nn.Module, rows: np.ndarray | None = None) -> Design:
    """T_i of the table's rows ``rows`` (default all) for its linear model (module doc; tpflower.design)."""
    if not isinstance(model, torch.nn.Linear) or model.out_features != 1:
        raise ValueError(
            f"table {client.settings.table!r}: algorithm=pcg solves linear ridge regression (model=linear, one output)"
        )
    return node_design(client, model.bias is not None, rows)


def set_theta(model: torch.nn.Linear, theta: np.ndarray) -> None:
    """The model's weight and bias from theta in T_i's column order."""
    d = model.in_features
    with torch.no_grad():
        model.weight.copy_(torch.as_tensor(theta[:d].reshape(1, d)))
        if model.bias is not None:
            model.bias.copy_(torch.as_tensor(theta[d:]))


def wire(client: TableClient, T: Design, z: np.ndarray) -> np.ndarray:
    """The per-row outputs T z as a column in the run's precision."""
    return T.apply(z, str(client.dtype).removeprefix("torch."))


def _vector(arrays: Arrays, name: str) -> np.ndarray:
    return np.asarray(arrays[name], np.float64).ravel()


def _per_row(client: TableClient, arrays: Arrays, name: str, n: int) -> np.ndarray:
    """Array ``name`` as sent (any precision), checked to hold one value per row of the ``n``."""
    v = np.asarray(arrays[name]).reshape(-1)
    if v.shape != (n,):
        raise refusal(client, f"pcg: {name} must hold one value per row", f"{v.size} for {n} rows")
    return v


def _counts(client: TableClient, arrays: Arrays, n: int) -> np.ndarray:
    """G as sent (narrow counts or float weights), checked: one finite value >= 0 per row."""
    G = np.asarray(arrays["G"]).reshape(-1)
    if G.shape != (n,) or not np.all(np.isfinite(G)) or (G < 0).any():
        raise refusal(client, "pcg: G must hold one finite count >= 0 per row", f"{G.shape} for {n} rows")
    return G


def pcg_gram(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """A shard's partial products for its table's preconditioner and r_0: T_q^T diag(G_q) T_q and T_q^T s_q."""
    T = design(client, client.model(config))
    G = _counts(client, arrays, len(T))
    return {"gram": T.gram(G), "g": T.tdot(_per_row(client, arrays, "s", len(T)))}, {}


def pcg_partial(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """A shard's partial product T_q^T s_q of the table's block of A^T W A p (s_q = P_q^T W A p): at most one
    per step (a second one before the step is refused)."""
    st = PCGState.of(client)
    if client.state.scalar(PARTIAL, 0):
        raise ProtocolRefusal(f"table {client.settings.table!r}: one pcg_partial per pcg_step; a second is refused")
    client.state.set_scalar(PARTIAL, 1)
    T = design(client, client.model(config), st.rows)
    return {"g": T.tdot(_per_row(client, arrays, "s", len(T)))}, {}


def _dots(st: PCGState, p_prev: np.ndarray) -> np.ndarray:
    return np.array([st.r @ st.z, st.z @ st.z, st.z @ p_prev, st.r @ st.r])


def _multi_dots(st: PCGState) -> np.ndarray:
    """Multipreconditioned CG's partial inner products over this table's block: [r.z, z.z, r.r], then per window
    direction block P_j (oldest first) P_j^T z and P_j^T r (c values each)."""
    head = [st.r @ st.z, st.z @ st.z, st.r @ st.r]
    assert st.P is not None
    tail = [np.concatenate([Pj.T @ st.z, Pj.T @ st.r]) for Pj in st.P]
    return np.concatenate([head, *tail])


def _multi_step(client: TableClient, st: PCGState, arrays: Arrays, g: np.ndarray) -> None:
    """P_k = Z - sum_j P_j C_j (Z: z in this table's column, C_j the server's A-orthogonalization coefficients);
    theta += P_k alpha; r -= A P_k alpha (g = T^T P^T W A P_k alpha); the window keeps the last ``window`` P's."""
    assert st.P is not None and st.z is not None and st.r is not None and st.theta is not None
    k, c = len(st.P), st.cols
    coef = _vector(arrays, "coef")
    if coef.shape != (c + k * c * c,) or not np.all(np.isfinite(coef)):
        # k (the window) and c (the tables) are the run's, not the table's: the line may state them
        raise refusal(
            client, f"coef must hold alpha and {k} {c}x{c} blocks C_j ({c + k * c * c} finite values), got {coef.size}"
        )
    alpha, C = coef[:c], coef[c:].reshape(k, c, c)
    P = np.zeros((len(st.z), c))
    P[:, st.col] = st.z
    P -= np.einsum("kdc,kce->de", st.P, C)
    step = P @ alpha
    st.theta = st.theta + step
    st.r = st.r - (g / st.N + float(client.settings.model["beta"]) * step)
    st.P = np.concatenate([st.P, P[None]])[-st.window :]


def pcg_setup(
    client: TableClient, arrays: Arrays, config: Mapping[str, Any], rows: np.ndarray | None = None
) -> tuple[Arrays, dict[str, Any]]:
    """Factor M_i, start from theta = 0: r = T^T s / N (s = P_i^T W y), z = M^-1 r, p = 0. A shard of a
    sharded table gets the sums over its table's shards (``gram``, ``g``) instead of (G, s)."""
    model = client.model(config)
    T = design(client, model, rows)
    N, beta, d = int(config["N"]), float(client.settings.model["beta"]), T.d
    if "gram" in arrays:
        gram, g = np.asarray(arrays["gram"], np.float64), _vector(arrays, "g")
        if gram.shape != (d, d) or g.shape != (d,) or not (np.isfinite(gram).all() and np.isfinite(g).all()):
            raise refusal(
                client,
                "pcg_setup: gram and g are not this table's size or not finite",
                f"d = {d}: {gram.shape}, {g.shape}",
            )
    else:
        G = _counts(client, arrays, len(T))
        gram, g = T.gram(G), T.tdot(_per_row(client, arrays, "s", len(T)))
    L = np.linalg.cholesky((gram + gram.T) / (2 * N) + beta * np.eye(d))
    r = g / N
    z = scipy.linalg.cho_solve((L, True), r)
    zero = np.zeros_like(r)
    window, col, cols = (int(config.get(k, 0)) for k in ("window", "col", "cols"))
    if window and not 0 <= col < cols:
        raise ValueError(f"table {client.settings.table!r}: direction column {col} is not one of {cols}")
    st = PCGState(L, zero, r, z, zero, N, rows, np.zeros((0, d, cols)), window, col, cols)
    st.save(client.state)
    set_theta(model, zero)
    client.state.save_model(model)
    return {"h": wire(client, T, z), "dots": _multi_dots(st) if window else _dots(st, zero)}, {}


def pcg_step(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """p = z + beta p; Ap = T^T s / N + beta_ridge p (or g / N + beta_ridge p with the shards' sum g);
    theta += alpha p, r -= alpha Ap, z = M^-1 r; the new T z and the partial dots."""
    st = PCGState.of(client)
    client.state.set_scalar(PARTIAL, 0)
    model = client.model(config)
    T = design(client, model, st.rows)
    g = _vector(arrays, "g") if "g" in arrays else T.tdot(_per_row(client, arrays, "s", len(T)))
    if g.shape != st.r.shape or not np.isfinite(g).all():
        raise refusal(client, "pcg_step: g is not this table's size or not finite", f"{len(st.r)} vs {g.shape}")
    if st.window:
        _multi_step(client, st, arrays, g)
    else:
        alpha, beta = float(config["alpha"]), float(config["beta"])
        st.p = st.z + beta * st.p
        Ap = g / st.N + float(client.settings.model["beta"]) * st.p
        st.theta = st.theta + alpha * st.p
        st.r = st.r - alpha * Ap
    st.z = scipy.linalg.cho_solve((st.L, True), st.r)
    st.save(client.state)
    set_theta(model, st.theta)
    client.state.save_model(model)
    dots = _multi_dots(st) if st.window else _dots(st, st.p)
    return {"h": wire(client, T, st.z), "dots": dots}, client.reg_metrics(model)


# the server's sums over a sharded table's shards (gram, g) only on such a shard, right after its own partial
# products (pcg_gram, pcg_partial); a table with one shard computes them itself from (G, s)
START = Stage(
    "start",
    {"pcg_setup": Phase(pcg_setup, inputs=takes("G", "s", union={"gram": "pcg_gram", "g": "pcg_gram"}), exact=True)},
)
STEP = Phase(pcg_step, inputs=takes("s", "coef", union={"g": "pcg_partial"}), exact=True)
TRAIN: dict[str, Phase] = {"pcg_step": STEP}
GRAM = Stage("gram", {"pcg_gram": Phase(pcg_gram, sharded, inputs=takes("G", "s"), exact=True)})
# the union: a shard's partial product, at most once per step (pcg_partial refuses a second)
UCQ_TRAIN: dict[str, Phase] = {**TRAIN, "pcg_partial": Phase(pcg_partial, sharded, inputs=takes("s"), exact=True)}


def ucq_protocol() -> Protocol:
    """The union's client protocol: setup, the shards' Gram blocks (once), pcg_setup, then the steps."""
    stages = list(setup.loj_protocol(START, UCQ_TRAIN).stages)
    stages.insert(stages.index(START), GRAM)
    return Protocol(tuple(stages))


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
        summary="block-Jacobi preconditioned CG on the ridge normal equations over the join, one round trip each",
    )
)
register(
    AlgorithmEntry(
        "tp_ucq_pcg",
        "pcg",
        "ucq",
        "pcg",
        "TPUCQPCG",
        ucq_protocol(),
        PCGParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="block-Jacobi preconditioned CG over the union: the shards' partial products summed",
    )
)
