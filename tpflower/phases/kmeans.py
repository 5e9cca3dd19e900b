"""DistDim k-means over the join and its coreset version, client side (VFL coresets, Alg. 3; docs/algorithms.md).

  kmeans_local  {G} or {rows, w} -> {labels, C}  local k-means weighted by G_iu (or w on the coreset's rows):
                                                 the table's k centres and each row's centre
  kmeans_assign {G}              -> {labels}     coreset_kmeans, evaluation: every row's nearest local centre
  kmeans_cost   {rows, centres, counts, C} -> {cost}  evaluation: ONE number, sum_u sum_c counts[u, c]
                                                 ||x_u - C_c||^2, answered once per run

The coreset version runs the DIS phases of tpflower/phases/coreset.py first and clusters the coreset's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.optimize

from tpflower.client import TableClient
from tpflower.clustering import label_dtype, merge_small_clusters, sq_distances, weighted_kmeans
from tpflower.guard import Phase, Protocol, Stage, refusal, takes
from tpflower.params import AlgorithmParams, nonnegative, one_of, or_word, param, positive_int
from tpflower.phases import coreset, setup
from tpflower.phases.coreset import (
    CoresetRefusal,
    _keep_G,
    _m,
    _rows,
    _where,
    admit_training_rows,
    client_rng,
    fraction,
)
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register


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

    m: int | str = param(or_word(positive_int, "auto"), "auto")  # auto: coreset.coreset_size
    sampling: str = param(one_of("sensitivity", "uniform"), "sensitivity")
    mix: float = param(fraction, 0.0)  # share of uniform sampling in DIS: P = (1 - mix) g_j / G + mix / N


def kmeans_local(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """DistDim, the party's step: weighted local k-means, one centre label per row sent, its k centres (kept
    for kmeans_assign).

    {G}: all its rows weighted by G_iu (the full join); {rows, w}: the coreset's rows with their weights."""
    s = client.settings
    X = np.asarray(client.local.X, dtype=np.float64)
    # every centre is the weighted mean of at least min_group_rows of its rows (the owner's setting): at most
    # n_active // min_group_rows centres, and a centre of fewer rows is merged into its neighbours (k shrinks)
    if "rows" in arrays:
        rows = _rows(client, arrays, "kmeans_local")
        w = np.asarray(arrays["w"], dtype=np.float64)
        if w.shape != rows.shape or (w < 0).any():
            raise ValueError(f"{_where(client, 'kmeans_local')}: w must hold one weight >= 0 per row")
        admit_training_rows(client, rows, "kmeans_local")
        X = X[rows]
    else:
        if _m(client):
            raise CoresetRefusal(f"{_where(client, 'kmeans_local')}: coreset k-means clusters the coreset's rows only")
        w = _keep_G(client, arrays, "kmeans_local")
    k, g = int(s.algorithm.k), int(s.min_group_rows)
    n_active = int((w > 0).sum())
    if n_active < g:
        raise CoresetRefusal(
            f"{_where(client, 'kmeans_local')}: k = {k} centres over {n_active} weighted rows; each centre "
            f"covers at least min_group_rows = {g} of them (its owner's setting), so it releases no centre (its "
            "owner may lower min_group_rows)"
        )
    k = min(k, n_active // g)  # few rows in the join: fewer centres (strategies/kmeans.py, table_centres)
    C, labels = weighted_kmeans(
        X,
        w,
        k,
        client_rng(s.seed, s.table, 3),
        int(s.algorithm.iters),
        float(s.algorithm.tol),
        restarts=int(s.algorithm.restarts),
    )
    C, labels = merge_small_clusters(X, w, C, labels, g)  # an empty centre keeps its seeding, a row: merged too
    client.state.put("kmeans.C", C)
    return {"labels": labels.astype(label_dtype(len(C))), "C": C}, {}


def kmeans_assign(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """coreset_kmeans, evaluation: every row's nearest local centre (what DistDim on the full join sends), for
    the server to place every joined row in its grid cell."""
    C = client.state.get("kmeans.C")
    if C is None:
        raise RuntimeError(f"{_where(client, 'kmeans_assign')}: before kmeans_local")
    if "G" in arrays:  # uniform sampling: the first G_i of the run (after DIS: must be the same)
        _keep_G(client, arrays, "kmeans_assign")
    labels = sq_distances(np.asarray(client.local.X, dtype=np.float64), C).argmin(1)
    return {"labels": labels.astype(label_dtype(len(C)))}, {}


def kmeans_cost(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The factorized cost of the final clustering (strategies/kmeans.py): ONE number,
    sum_u sum_c counts[u, c] ||x_u - C_c||^2, for the sparse counts (rows, centres, counts) of the joined rows
    of each row u assigned to each final centre c. Refused unless every row's counts add up to its G_iu (the
    G_i this client received earlier: each row enters with all its joined rows) and the first time in the run."""
    where = _where(client, "kmeans_cost")
    if client.state.scalar("kmeans.cost_answered", 0):
        raise CoresetRefusal(
            f"{where}: the cost is answered once per run (two answers for different counts "
            "would reveal a row's distances)"
        )
    G = client.state.get("coreset.G")
    if G is None:
        raise CoresetRefusal(f"{where}: this client never received G_i, so it cannot check the counts")
    X = np.asarray(client.local.X, dtype=np.float64)
    C = np.asarray(arrays["C"], dtype=np.float64)
    k = int(client.settings.algorithm.k)
    if C.ndim != 2 or C.shape[1] != X.shape[1] or not 1 <= C.shape[0] <= k or not np.isfinite(C).all():
        raise refusal(client, "kmeans_cost: C must be at most k finite centres of this table's width", f"{C.shape}")
    rows, centres, counts = (np.asarray(arrays[n]) for n in ("rows", "centres", "counts"))
    if not (rows.ndim == centres.ndim == counts.ndim == 1 and len(rows) == len(centres) == len(counts)):
        raise ValueError(f"{where}: rows, centres and counts must be vectors of one length")
    if any(a.size and a.dtype.kind not in "iu" for a in (rows, centres, counts)):
        raise ValueError(f"{where}: rows, centres and counts must be integers")
    rows, centres, counts = rows.astype(np.int64), centres.astype(np.int64), counts.astype(np.int64)
    if len(rows) and (
        rows.min() < 0 or rows.max() >= len(X) or centres.min() < 0 or centres.max() >= len(C) or counts.min() <= 0
    ):
        raise ValueError(f"{where}: counts must name rows of the table, centres of C and be >= 1")
    if len(np.unique(rows * len(C) + centres)) != len(rows):
        raise CoresetRefusal(f"{where}: a (row, centre) pair appears twice in the counts")
    if 0 < int((G > 0).sum()) < client.settings.min_group_rows:
        raise CoresetRefusal(
            f"{where}: the cost would cover {int((G > 0).sum())} rows; this node's owner releases aggregates of at "
            f"least min_group_rows = {client.settings.min_group_rows} rows"
        )
    per_row = np.bincount(rows, weights=counts, minlength=len(X))
    bad = per_row != G
    if bad.any():
        u = int(np.flatnonzero(bad)[0])
        raise CoresetRefusal(
            f"{where}: the counts of {int(bad.sum())} row(s) do not add up to the row's G_iu "
            f"(row {u}: {per_row[u]:g} vs G = {G[u]:g}); every row enters with all its joined rows"
        )
    if not built_from(C, client.state.get("kmeans.C")):
        raise refusal(
            client, "kmeans_cost: C must be built from this table's own released local centres (their weighted means)"
        )
    client.state.set_scalar("kmeans.cost_answered", 1)
    diff = X[rows] - C[centres]
    d2 = np.einsum("ij,ij->i", diff, diff)  # no BLAS: the same rounding with any thread count
    return {"cost": np.array([float((counts * d2).sum())])}, {}


#: how far (relative to the local centres' scale) a final centre may lie from their convex hull: rounding only
HULL_TOLERANCE = 1e-9


def built_from(C: np.ndarray, local: np.ndarray | None) -> bool:
    """Every row of C is a weighted mean (a convex combination) of the local centres ``local`` this table
    released in kmeans_local, as DistDim's final centres are (their block of this table: the mean of the local
    centres of its grid cells): a server cannot ask for the cost against centres of its choosing."""
    if local is None or not len(local):
        return False
    local = np.asarray(local, dtype=np.float64)
    scale = 1.0 + float(np.abs(local).max(initial=0.0))  # (a table of no feature column: 1)
    weight = 1e3 * scale  # the row of ones (sum of the weights = 1), weighted to hold nearly exactly
    A = np.vstack([local.T, np.full((1, len(local)), weight)])
    for c in C:
        w, residual = scipy.optimize.nnls(A, np.concatenate([c, [weight]]))
        if residual > HULL_TOLERANCE * scale * np.sqrt(len(c) + 1):
            return False
    return True


KMEANS_LOCAL = Stage("kmeans_local", {"kmeans_local": Phase(kmeans_local, inputs=takes("G", "rows", "w"), exact=True)})


KMEANS_COST = Stage(
    "kmeans_cost",
    {"kmeans_cost": Phase(kmeans_cost, inputs=takes("rows", "centres", "counts", "C"), exact=True)},
    calls=None,
)


KMEANS: tuple[Stage, ...] = (KMEANS_LOCAL, KMEANS_COST)


CORESET_KMEANS: tuple[Stage, ...] = (
    KMEANS_LOCAL,
    Stage("kmeans_assign", {"kmeans_assign": Phase(kmeans_assign, inputs=takes("G"), exact=True)}),
    KMEANS_COST,
)


#: k-means clusters the joined rows: the model group is unused, so only its default (conf/config.yaml) is taken
KMEANS_MODELS = ("linear",)
WHY_NO_FEATURE_DP = (
    "each table sends its k local centres and one centre label per row, exact functions of its features "
    "(DistDim, Alg. 3); there is no per-row gradient step to clip and noise. Run it with privacy=none"
)
WHY_NO_LABEL_DP = "k-means reads no label, so there is none to protect; run it with privacy=none"
WHY_KMEANS_MODELS = "k-means trains no model of the model group; leave model at its default (linear, unused by k-means)"
register(
    AlgorithmEntry(
        "kmeans",
        "kmeans",
        "join",
        "kmeans",
        "DistDimKMeans",
        Protocol(setup.SETUP + KMEANS),
        KMeansParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        label_dp=False,
        why_no_label_dp=WHY_NO_LABEL_DP,
        summary="DistDim k-means on the full join (VKMC baseline)",
        models=KMEANS_MODELS,
        why_models=WHY_KMEANS_MODELS,
    )
)
register(
    AlgorithmEntry(
        "coreset_kmeans",
        "coreset_kmeans",
        "join",
        "kmeans",
        "CoresetKMeans",
        Protocol(setup.SETUP + coreset.DIS + CORESET_KMEANS),
        CoresetKMeansParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        label_dp=False,
        why_no_label_dp=WHY_NO_LABEL_DP,
        summary="VFL coreset (DIS, Alg. 1 and 3) over the join, then DistDim k-means",
        models=KMEANS_MODELS,
        why_models=WHY_KMEANS_MODELS,
    )
)
