"""Coresets for VFL over joins, the client's math (ALGORITHMS.md "Coresets for VFL"; seed 004, Alg. 1-3).

A client holds table i and G_iu (how often its row u occurs in the training join, sent by the server). The
sampling unit is the JOINED row j; its local sensitivity factors through u = p_i(j), so everything here is
per table row and per joined row of that table row (never over the N joined rows):

- ridge (VRLR, Alg. 2): leverage of joined row j = ||Q_B[u]||^2 / G_iu with Q_B an orthonormal basis of
  diag(sqrt(G_i)) T_i (the label owner appends its intercept column and y); exact over joins since
  A_i = P_i T_i has A_i^T A_i = T_i^T diag(G_i) T_i.
- k-means (VKMC, Alg. 3): local k-means++ weighted by G_iu; with alpha = 2,
  g = alpha d^2(x, C) / cost + 2 alpha cost(P_c) / (|P_c| cost) + 4 / |P_c|, costs and |P_c| counted with G.
- DIS (Alg. 1), the client's part: the local total sum_u G_iu g_u, a_i base rows drawn with replacement with
  probability G_iu g_u / G^(i), and g at the rows the server names.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from tpflower.params import AlgorithmParams, nonnegative, one_of, or_word, param, positive, positive_int

ALPHA = 2.0  # VKMC sensitivity constant (ALGORITHMS.md, Alg. 3 with alpha = 2)


# ------------------------------------------------------------------------------------------------ settings


def fraction(what: str, value) -> float:
    out = nonnegative(what, value)
    if out > 1:
        raise ValueError(f"{what} must be in [0, 1], got {value!r}")
    return out


@dataclass(frozen=True)
class CoresetParams(AlgorithmParams):
    """algorithm=coreset (conf/algorithm/coreset.yaml): ridge on a DIS coreset of the training join."""

    m: int = param(positive_int, 2000)  # coreset size (draws, with replacement)
    sampling: str = param(one_of("sensitivity", "uniform"), "sensitivity")
    mix: float = param(fraction, 0.0)  # share of uniform sampling in DIS: P = (1 - mix) g_j / G + mix / N
    leverage_ridge: float = param(nonnegative, 64.0)  # ridge leverage scores, lam = leverage_ridge N / m; 0: Alg. 2
    train: str = param(one_of("admm", "sgd"), "admm")
    rho: float | str = param(or_word(positive, "auto"), "auto")  # train=admm
    variant: str = param(one_of("sharing", "paper"), "sharing")
    local_solver: str = param(one_of("lbfgs", "adam"), "lbfgs")  # MLP theta-update (train=admm), as TP-Join-ADMM
    local_steps: int = param(positive_int, 20)
    local_epochs: int = param(positive_int, 1)
    local_lr: float = param(positive, 0.01)
    local_batch_size: int = param(positive_int, 256)
    lr: float = param(positive, 0.05)  # train=sgd
    batch_size: int | str = param(or_word(positive_int, "full"), 256)


@dataclass(frozen=True)
class KMeansParams(AlgorithmParams):
    """algorithm=kmeans (conf/algorithm/kmeans.yaml): DistDim on the full join."""

    k: int = param(positive_int, 10)
    iters: int = param(positive_int, 100)  # Lloyd iterations (local and on the server's grid)
    restarts: int = param(positive_int, 10)  # k-means++ seedings, the lowest cost kept (local and on the grid)
    tol: float = param(nonnegative, 1e-6)  # relative cost decrease that stops Lloyd


@dataclass(frozen=True)
class CoresetKMeansParams(KMeansParams):
    """algorithm=coreset_kmeans (conf/algorithm/coreset_kmeans.yaml): DistDim on a DIS coreset."""

    m: int = param(positive_int, 2000)
    sampling: str = param(one_of("sensitivity", "uniform"), "sensitivity")
    mix: float = param(fraction, 0.0)  # share of uniform sampling in DIS: P = (1 - mix) g_j / G + mix / N


# ------------------------------------------------------------------------------------------------ ridge


def leverage_sensitivities(X: np.ndarray, G: np.ndarray, extra: np.ndarray | None = None,
                           lam: float = 0.0) -> np.ndarray:
    """Per table row u: the (ridge) leverage of ONE joined row of u, 0 where G_u = 0.

    A = diag(sqrt(G)) [X | extra], thin SVD A = U S V^T. lam = 0: ||U[u]||^2 / G_u (Alg. 2; summed over the
    joined rows, sum_u G_u g_u, it is rank(A)). lam > 0: the ridge leverage score
    a_u^T (A^T A + lam I)^{-1} a_u / G_u = sum_k U_uk^2 s_k^2 / (s_k^2 + lam) / G_u (Alaoui & Mahoney 2015),
    whose sum is the statistical dimension sum_k s_k^2 / (s_k^2 + lam) < rank(A): a direction carried by r
    joined rows contributes about r / (r + lam). ``extra`` columns (the label owner's intercept and y) are
    divided by their root mean square over the joined rows first, so the label's units do not matter (no
    effect when lam = 0)."""
    A = np.asarray(X, dtype=np.float64)
    G = np.asarray(G, dtype=np.float64)
    if extra is not None:
        E = np.asarray(extra, dtype=np.float64).reshape(len(A), -1)
        rms = np.sqrt((G[:, None] * E * E).sum(0) / max(G.sum(), 1e-300))
        A = np.column_stack([A, E / np.where(rms > 0, rms, 1.0)])
    g = np.zeros(len(A))
    active = np.flatnonzero(G > 0)
    if len(active) == 0 or A.shape[1] == 0:
        return g
    B = A[active] * np.sqrt(G[active])[:, None]
    U, s, _ = np.linalg.svd(B, full_matrices=False)
    if s.size == 0 or s[0] == 0:
        return g
    rank = int(np.sum(s > s[0] * max(B.shape) * np.finfo(np.float64).eps))
    shrink = s[:rank] ** 2 / (s[:rank] ** 2 + lam)  # 1 for plain leverage (lam = 0)
    g[active] = (U[:, :rank] ** 2 @ shrink) / G[active]
    return g


def ridge_lambda(leverage_ridge: float, N: int, m: int) -> float:
    """lam of the ridge leverage scores, in joined rows: leverage_ridge * N / m. A direction that m uniform
    draws would see fewer than about ``leverage_ridge`` times is damped instead of sampled at full weight."""
    return float(leverage_ridge) * float(N) / float(m)


# ------------------------------------------------------------------------------------------------ k-means


def kmeans_pp_init(X: np.ndarray, w: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding weighted by w (rows with w = 0 are never chosen); k distinct centres at most n_active."""
    active = np.flatnonzero(w > 0)
    k = min(k, len(active))
    centres = np.empty((k, X.shape[1]))
    first = rng.choice(active, p=w[active] / w[active].sum())
    centres[0] = X[first]
    d2 = ((X - centres[0]) ** 2).sum(1)
    for c in range(1, k):
        p = w * d2
        total = p.sum()
        idx = rng.choice(len(X), p=p / total) if total > 0 else rng.choice(active)
        centres[c] = X[idx]
        d2 = np.minimum(d2, ((X - centres[c]) ** 2).sum(1))
    return centres


def label_dtype(k: int) -> np.dtype:
    """Centre labels 0..k-1 as sent: one byte up to 255 centres, else two."""
    return np.dtype(np.uint16 if k > 255 else np.uint8)


def sq_distances(X: np.ndarray, C: np.ndarray) -> np.ndarray:
    """||x_u - c||^2 for every row and centre (n x k), clipped at 0."""
    d = np.einsum("ij,ij->i", X, X)[:, None] - 2.0 * np.einsum("ij,kj->ik", X, C) + (C * C).sum(1)[None, :]
    return np.maximum(d, 0.0)


def weighted_kmeans(X: np.ndarray, w: np.ndarray, k: int, rng: np.random.Generator, iters: int = 100,
                    tol: float = 1e-6, init: np.ndarray | None = None, restarts: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means on rows X with weights w: (centres k x d, label per row). Starts from ``init``, or from
    ``restarts`` k-means++ seedings drawn from ``rng`` one after the other, keeping the lowest weighted cost.

    Equals k-means on the rows repeated w_u times (integer w). An emptied cluster keeps its centre."""
    X = np.asarray(X, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    x2 = np.einsum("ij,ij->i", X, X)
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for _ in range(1 if init is not None else max(int(restarts), 1)):
        C = kmeans_pp_init(X, w, k, rng) if init is None else np.array(init, dtype=np.float64)
        C, labels, cost = _lloyd(X, x2, w, C, iters, tol)
        if best is None or cost < best[0]:
            best = (cost, C, labels)
    return best[1], best[2]


def _lloyd(X: np.ndarray, x2: np.ndarray, w: np.ndarray, C: np.ndarray, iters: int,
           tol: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Lloyd iterations from centres C until the relative cost decrease is <= tol: (C, labels, weighted cost)."""
    rows = np.arange(len(X))

    def assign(C: np.ndarray) -> tuple[np.ndarray, float]:
        part = (C * C).sum(1)[None, :] - 2.0 * np.einsum("ij,kj->ik", X, C)  # ||x - c||^2 - ||x||^2: the same argmin
        labels = part.argmin(1)
        return labels, float((w * np.maximum(x2 + part[rows, labels], 0.0)).sum())  # no BLAS: thread-independent

    prev = np.inf
    for _ in range(iters):
        labels, cost = assign(C)
        member = sparse.csr_matrix((w, (labels, rows)), shape=(len(C), len(X)))  # weighted one-hot, k x n
        mass = np.asarray(member.sum(1)).reshape(-1)
        sums = member @ X
        nonempty = mass > 0
        C[nonempty] = sums[nonempty] / mass[nonempty, None]
        if prev - cost <= tol * max(cost, 1e-300):
            break
        prev = cost
    labels, cost = assign(C)
    return C, labels, cost


def kmeans_sensitivities(X: np.ndarray, G: np.ndarray, k: int, rng: np.random.Generator, iters: int = 100,
                         alpha: float = ALPHA) -> np.ndarray:
    """VKMC local sensitivities (Alg. 3) of one joined row of each table row: local k-means++ / Lloyd weighted
    by G (= on the table's expanded slice of the join), then :func:`cluster_sensitivities`."""
    C, _ = weighted_kmeans(X, np.asarray(G, dtype=np.float64), k, rng, iters)
    return cluster_sensitivities(X, G, C, alpha)


def cluster_sensitivities(X: np.ndarray, G: np.ndarray, C: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """g_u = alpha d^2(x_u, C) / cost + 2 alpha cost(P_c) / (|P_c| cost) + 4 / |P_c| (Alg. 3), c = the cluster
    of u, cost = sum_u G_u d^2(x_u, C), cost(P_c) and |P_c| summed with G; 0 where G_u = 0. With G = 1 on the
    materialized join's rows it is the paper's formula; with G_iu it gives the same value per joined row."""
    X, G = np.asarray(X, dtype=np.float64), np.asarray(G, dtype=np.float64)
    D = sq_distances(X, C)
    labels = D.argmin(1)
    d2 = D[np.arange(len(X)), labels]
    size = np.bincount(labels, weights=G, minlength=len(C))
    group_cost = np.bincount(labels, weights=G * d2, minlength=len(C))
    cost = float(group_cost.sum())
    g = np.zeros(len(X))
    act = G > 0
    sz = size[labels[act]]
    if cost > 0:
        g[act] = alpha * d2[act] / cost + 2 * alpha * group_cost[labels[act]] / (sz * cost) + 4.0 / sz
    else:  # every point on its centre: only the cluster-size term
        g[act] = 4.0 / sz
    return g


# ------------------------------------------------------------------------------------------------ DIS


def mix_uniform(G: np.ndarray, g: np.ndarray, N: int, mix: float) -> np.ndarray:
    """g' = (1 - mix) g + mix G^(i) / N on the rows in the join (G^(i) = sum_u G_iu g_u, unchanged by this).

    Summed over the tables, g'_j = (1 - mix) g_j + mix G / N, so one DIS draw picks joined row j with
    P'(j) = (1 - mix) g_j / G + mix / N: a mixture of the sensitivity sampling and uniform sampling, computed
    by each table alone (it knows its own total and N). The weights G / (m g'_j) are then at most N / (mix m),
    and a sensitivity plus anything stays an upper bound (the coreset guarantee holds with G unchanged)."""
    if mix <= 0:
        return g
    total = local_total(G, g)
    out = np.zeros_like(g)
    act = np.asarray(G) > 0
    out[act] = (1.0 - mix) * g[act] + mix * total / float(N)
    return out


def local_total(G: np.ndarray, g: np.ndarray) -> float:
    """G^(i) = sum over the joined rows of the local sensitivity = sum_u G_iu g_u (Alg. 1, round 1)."""
    return float((np.asarray(G, dtype=np.float64) * g).sum())  # not np.dot: BLAS threads change its rounding


def sampling_probabilities(G: np.ndarray, g: np.ndarray) -> np.ndarray:
    """P(u) = G_iu g_u / G^(i): the client's draw over its base rows (Alg. 1, round 2)."""
    p = np.asarray(G, dtype=np.float64) * g
    return p / p.sum()


def draw_base_rows(G: np.ndarray, g: np.ndarray, a: int, rng: np.random.Generator) -> np.ndarray:
    """a base rows i.i.d. with replacement, P(u) = G_iu g_u / G^(i) (Alg. 1, round 2)."""
    if a <= 0:
        return np.zeros(0, dtype=np.int64)
    p = sampling_probabilities(G, g)
    return rng.choice(len(p), size=int(a), replace=True, p=p).astype(np.int64)


def client_rng(seed: int, table: str, stream: int) -> np.random.Generator:
    """The client's sampling generator: the run seed, the table's name and a stream number."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(table.encode()), int(stream)])
