"""Weighted k-means (k-means++ seeding, Lloyd iterations) on one table's rows: the clustering that DistDim
k-means (strategies/kmeans.py) and the coreset's k-means sensitivities (tpflower/phases/coreset.py) share.
Plain numpy; weights are G_iu (how often a row occurs in the join) or coreset weights.
"""

from __future__ import annotations

import numpy as np
from scipy import sparse


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


def weighted_kmeans(
    X: np.ndarray,
    w: np.ndarray,
    k: int,
    rng: np.random.Generator,
    iters: int = 100,
    tol: float = 1e-6,
    init: np.ndarray | None = None,
    restarts: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
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


def _lloyd(
    X: np.ndarray, x2: np.ndarray, w: np.ndarray, C: np.ndarray, iters: int, tol: float
) -> tuple[np.ndarray, np.ndarray, float]:
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


def merge_small_clusters(
    X: np.ndarray, w: np.ndarray, C: np.ndarray, labels: np.ndarray, min_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """Centres that each cover at least ``min_rows`` rows of positive weight (the owner's min_group_rows): while
    some centre covers fewer, the smallest is dropped, every row goes to its nearest remaining centre and the
    centres become the weighted means of their rows (one Lloyd update). A clustering without a small centre comes
    back unchanged; k shrinks by one per dropped centre (at most k - 1 rounds, over centres, not rows)."""
    active = w > 0
    if min_rows <= 1:  # every non-empty centre covers a row; an empty one keeps its seeding (no bound asked)
        return C, labels
    if int(active.sum()) < min_rows:
        raise ValueError(f"{int(active.sum())} weighted rows cannot fill one centre of {min_rows} rows")
    C, labels = np.array(C, dtype=np.float64), np.asarray(labels)
    while True:
        sizes = np.bincount(labels[active], minlength=len(C))
        if sizes.min() >= min_rows:
            return C, labels
        keep = np.arange(len(C)) != int(sizes.argmin())
        labels = sq_distances(X, C[keep]).argmin(1)
        member = sparse.csr_matrix((w, (labels, np.arange(len(X)))), shape=(int(keep.sum()), len(X)))
        mass = np.asarray(member.sum(1)).reshape(-1)
        sums = np.asarray(member @ X)
        C = np.where(mass[:, None] > 0, sums / np.maximum(mass, 1e-300)[:, None], C[keep])
