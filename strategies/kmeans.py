"""Vertical k-means over joins (Huang et al., NeurIPS 2022, "Coresets for Vertical Federated Learning": Alg. 3
VKMC; DistDim of Ding et al. 2016), server side.

algorithm=kmeans: DistDim on the full join. Each table runs k-means on its own rows weighted by G_iu (= k-means
on its expanded slice of the join) and sends one centre label per ROW (n_i labels, not N) and its k centres;
the server gives every cell of the k^T product grid the number of joined rows whose labels (label_i[p_i(j)])
fall in it and runs weighted k-means on the non-empty cells (each cell's point: its tables' centres, side by
side). algorithm=coreset_kmeans: the same on a DIS coreset (local k-means++ sensitivities, alpha = 2; or
sampling=uniform), each table clustering the coreset's rows with their weights.

The metric, for every run: the cost per point on the FULL join of the clustering DistDim outputs, computed
from aggregates only (evaluation rounds, not training traffic). Every joined row j falls in the grid cell of
its tables' local labels and every cell is assigned to its nearest final centre, so j gets a final centre
c(j) (coreset_kmeans: each table first labels ALL its rows with their nearest local centre, ``kmeans_assign``).
The server sends each table i the sparse counts n_i x k, counts[u, c] = |{j : p_i(j) = u, c(j) = c}|, and its
block C_i of the final centres; the table checks that every row's counts add up to its G_iu and returns ONE
number, sum_u sum_c counts[u, c] ||x_iu - C_ic||^2, once per run. The sum over tables divided by N is
(1/N) sum_j ||x_j - C_c(j)||^2: the cost of the induced assignment, an upper bound on the nearest-centre cost
(1/N) sum_j min_c ||x_j - c||^2. Why not the nearest-centre cost: it needs every row's distances to the k
centres, and n_i x k squared distances to centres the server knows give away each row's features once
k - 1 >= d_i (differences of squared distances are linear in x). Labels are ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strategies.coreset import DISStrategy, row_ids
from tpflower.batches import BatchPlan
from tpflower.clustering import label_dtype, sq_distances, weighted_kmeans
from tpflower.join_counts import compact_counts
from tpflower.mapping import segment_sum
from tpflower.phases.kmeans import CoresetKMeansParams, KMeansParams
from tpflower.results import EpochRecord

METRIC = "kmeans_cost"


def grid_cells(labels: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct cells (rows of per-table labels) of the product grid that hold a point, and the cell of
    every point (np.unique over the encoded labels)."""
    L = np.stack([np.asarray(lab, dtype=np.int64) for lab in labels], axis=1)
    if k ** L.shape[1] < 2**62:
        code = L @ (k ** np.arange(L.shape[1] - 1, -1, -1, dtype=np.int64))
        _, first, inv = np.unique(code, return_index=True, return_inverse=True)
        return L[first], inv.reshape(-1)
    cells, inv = np.unique(L, axis=0, return_inverse=True)
    return cells, inv.reshape(-1)


def cell_points(cells: np.ndarray, local_C: list[np.ndarray]) -> np.ndarray:
    """Each grid cell's point: its tables' local centres side by side."""
    return np.hstack([C[cells[:, i]] for i, C in enumerate(local_C)])


def assignment_counts(
    p: np.ndarray, assign: np.ndarray, n_rows: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sparse counts[u, c] = |{j : p(j) = u, assign(j) = c}| as (rows, centres, counts), vectorized."""
    code = np.asarray(p, dtype=np.int64) * k + np.asarray(assign, dtype=np.int64)
    keys, counts = np.unique(code, return_counts=True)
    return keys // k, keys % k, counts


def check_k(k: int, joined: int, min_group_rows: int) -> None:
    """k centres over the join's rows: each covers at least ``min_group_rows`` of them (the owners' bound,
    tpflower.phases.kmeans), so k <= joined // min_group_rows; beyond it every node would refuse: one line here."""
    if k * min_group_rows > joined >= min_group_rows:
        raise ValueError(
            f"algorithm.k={k}: k-means over the join's {joined} rows has at most {joined // min_group_rows} "
            f"centres, each covering at least min_group_rows = {min_group_rows} joined rows (the owners' bound); "
            f"set algorithm.k={joined // min_group_rows} or less"
        )


def table_centres(
    k: int, rows: dict[str, int], min_group_rows: int, coreset: bool, join_rows: dict[str, int] | None = None
) -> dict[str, int]:
    """Each table's local centres: k, or ``rows // min_group_rows`` for a table of fewer rows in the join (or in
    the coreset: ``rows``, table -> rows of positive weight, what its node counts), so that each centre covers at
    least ``min_group_rows`` of them (the owners' bound; its node clusters into as many,
    tpflower.phases.kmeans.kmeans_local): a small dimension table (50 states, 7 precincts) gives the grid fewer
    cells, as its node's merging of small centres would. A table of fewer than ``min_group_rows`` rows releases
    no centre: refused in one line naming it, before any node clusters (a larger coreset offered only when the
    table has ``min_group_rows`` rows in the join, ``join_rows``)."""
    table = min(rows, key=rows.__getitem__)
    n, g = rows[table], min_group_rows
    if n < g:
        options = [f"min_group_rows={n} or less (a deployed owner: in its settings file)"] if n >= 1 else []
        if coreset and (join_rows is None or join_rows.get(table, g) >= g):
            options.append("a larger algorithm.m")
        raise ValueError(
            f"k-means: table '{table}' has {n} rows in the {'coreset' if coreset else 'join'} and each of its "
            f"k-means centres covers at least min_group_rows = {g} of them (the owners' bound), so it releases no "
            "centre" + ("; set " + ", or ".join(options) if options else "")
        )
    return {t: min(k, r // g) for t, r in rows.items()}


def fewer_centres_line(k: int, rows: dict[str, int], centres: dict[str, int], min_group_rows: int) -> str | None:
    """The run's line naming the tables that cluster into fewer than k local centres (:func:`table_centres`)."""
    few = [f"'{t}' {c} ({rows[t]:,} rows)" for t, c in centres.items() if c < k]
    if not few:
        return None
    return (
        f"k-means: local centres {', '.join(few)}, not algorithm.k={k}: each covers at least "
        f"min_group_rows = {min_group_rows} of its table's rows; the final centres are still k={k}"
    )


class DistDimKMeans(DISStrategy):
    """algorithm=kmeans: DistDim on the full join."""

    algorithm = "kmeans"
    params_type = KMeansParams
    kind = "kmeans"
    uses_coreset = False
    one_shot = True
    labelled = False  # its metric is the clustering cost: no constant predictor to compare it with

    def protocol(self) -> None:
        self.setup()
        self.require_join()
        assert self.results is not None and self.comm is not None
        self.results.metric = METRIC
        mapping, k, alg = self.mapping, self.params.k, self.params
        self.construction = {"rounds": 0.0, "bytes_up": 0.0, "bytes_down": 0.0, "distinct_rows": float(mapping.N)}
        if self.uses_coreset:
            core = self.sample_coreset(mapping, alg.m, alg.sampling)
            S = mapping.subset(core.rows)
            plan = BatchPlan.of(S, np.arange(S.N))
            w_U = {t: segment_sum(plan.inv[t], core.weights, len(U)) for t, U in plan.U.items()}
            joined = {t: int((mapping.G(t) > 0).sum()) for t in mapping.p}
            self.say_centres(k, {t: int((w > 0).sum()) for t, w in w_U.items()}, True, joined)
            replies = self.send(self.messages(lambda t: ({"rows": plan.U[t], "w": w_U[t]}, {"phase": "kmeans_local"})))
            point_labels = [np.asarray(replies[(t, 0)][0]["labels"], dtype=np.int64)[plan.inv[t]] for t in mapping.p]
            weights = core.weights
        else:  # each table: k-means weighted by G_iu, one label per row; the server reads them along p_i
            check_k(k, mapping.N, self.min_group_rows)
            self.say_centres(k, {t: int((mapping.G(t) > 0).sum()) for t in mapping.p}, False)
            replies = self.send(
                self.messages(lambda t: ({"G": compact_counts(mapping.G(t))}, {"phase": "kmeans_local"}))
            )
            point_labels = [np.asarray(replies[(t, 0)][0]["labels"], dtype=np.int64)[p] for t, p in mapping.p.items()]
            weights = np.ones(mapping.N)
        local_C = [np.asarray(replies[(t, 0)][0]["C"], dtype=np.float64) for t in mapping.p]
        self.local_centres = dict(zip(mapping.p, local_C))
        cells, inv = grid_cells(point_labels, k)
        cell_w = np.bincount(inv, weights=weights, minlength=len(cells))
        points = cell_points(cells, local_C)
        C, _ = weighted_kmeans(
            points,
            cell_w,
            k,
            np.random.default_rng([int(self.cfg.seed) & 0xFFFFFFFF, 0xD15D]),
            alg.iters,
            alg.tol,
            restarts=alg.restarts,
        )
        self.centres = C
        grid_cost = float((cell_w * sq_distances(points, C).min(1)).sum() / cell_w.sum())
        row_labels = None if self.uses_coreset else [np.asarray(replies[(t, 0)][0]["labels"]) for t in mapping.p]
        cost = self.full_join_cost(C, local_C, row_labels)
        rec = EpochRecord(
            epoch=1,
            test_metric=cost,
            train_loss=grid_cost,
            wall_time_s=self.record.elapsed(),
            extra={"grid_cells": float(len(cells)), **self.coreset_extra()},
            **self.comm.snapshot(),
        )  # type: ignore[arg-type]
        self.record.add(rec, METRIC)
        self.finish()

    def say_centres(self, k: int, rows: dict[str, int], coreset: bool, join_rows: dict[str, int] | None = None) -> None:
        """Refuse a table that releases no centre; name the tables of fewer than k local centres."""
        centres = table_centres(k, rows, self.min_group_rows, coreset, join_rows)
        line = fewer_centres_line(k, rows, centres, self.min_group_rows)
        if line is not None:
            self.log(line)

    def coreset_extra(self) -> dict[str, float]:
        """The coreset's numbers for the record (coreset_kmeans: its rows, draws and construction bytes); none
        on the full join, where they only repeated N and 0."""
        if not self.uses_coreset:
            return {}
        c = self.construction
        return {
            "coreset_rows": c["distinct_rows"],
            "coreset_m": c["m"],
            "construction_bytes": c["bytes_up"] + c["bytes_down"],
        }

    def model_extra(self) -> dict[str, Any]:
        """model.json of k-means: a prediction is a cluster id, from the final centres and each table's local
        centres (the grid the server clustered; both held by the server in the run; docs/prediction.md)."""
        return {
            "predicts": "cluster",
            "centres": self.centres.tolist(),
            "local_centres": {t: C.tolist() for t, C in self.local_centres.items()},
        }

    def full_join_assignment(
        self, C: np.ndarray, local_C: list[np.ndarray], row_labels: list[np.ndarray]
    ) -> np.ndarray:
        """c(j) for every joined row j of the full join: the final centre nearest to its grid cell's point."""
        mapping = self.mapping
        cells, inv = grid_cells(
            [np.asarray(lab, dtype=np.int64)[p] for lab, p in zip(row_labels, mapping.p.values())], C.shape[0]
        )
        return sq_distances(cell_points(cells, local_C), C).argmin(1)[inv]

    def full_join_cost(self, C: np.ndarray, local_C: list[np.ndarray], row_labels: list[np.ndarray] | None) -> float:
        """(1/N) sum_j ||x_j - C_c(j)||^2 over the full join from one number per table (module docstring).
        ``row_labels``: each table's local label of every row (None: asked for in a ``kmeans_assign`` round)."""
        mapping, k = self.mapping, C.shape[0]
        if row_labels is None:
            replies = self.send(
                self.messages(lambda t: ({"G": compact_counts(mapping.G(t))}, {"phase": "kmeans_assign"})), kind="eval"
            )
            row_labels = [np.asarray(replies[(t, 0)][0]["labels"]) for t in mapping.p]
        self.assignment = assign = self.full_join_assignment(C, local_C, row_labels)
        bounds = np.cumsum([0, *(c.shape[1] for c in local_C)])
        messages = {}
        for i, (t, p) in enumerate(mapping.p.items()):
            rows, centres, counts = assignment_counts(p, assign, mapping.n_rows[t], k)
            messages[(t, 0)] = (
                {
                    "rows": row_ids(rows, mapping.n_rows[t]),
                    "centres": centres.astype(label_dtype(k)),
                    "counts": compact_counts(counts),
                    "C": C[:, bounds[i] : bounds[i + 1]],
                },
                {"phase": "kmeans_cost"},
            )
        replies = self.send(messages, kind="eval")
        self.table_costs = {
            t: float(np.asarray(r[0]["cost"], dtype=np.float64).reshape(-1)[0]) for (t, _), r in replies.items()
        }
        return float(sum(self.table_costs.values()) / mapping.N)


class CoresetKMeans(DistDimKMeans):
    """algorithm=coreset_kmeans: DistDim on a DIS coreset (Alg. 3 sensitivities) or a uniform sample."""

    algorithm = "coreset_kmeans"
    params_type = CoresetKMeansParams
    uses_coreset = True
