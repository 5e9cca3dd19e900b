"""Vertical k-means over joins (seed 004: Alg. 3 VKMC; DistDim of Ding et al. 2016), server side.

algorithm=kmeans: DistDim on the full join. Each table runs k-means on its own rows weighted by G_iu (= k-means
on its expanded slice of the join) and sends one centre label per ROW (n_i labels, not N) and its k centres;
the server gives every cell of the k^T product grid the number of joined rows whose labels (label_i[p_i(j)])
fall in it and runs weighted k-means on the non-empty cells (each cell's point: its tables' centres, side by
side). algorithm=coreset_kmeans: the same on a DIS coreset (local k-means++ sensitivities, alpha = 2; or
sampling=uniform), each table clustering the coreset's rows with their weights.

The metric, for every run: cost per point on the FULL join, (1/N) sum_j min_c ||x_j - c||^2, without
gathering features: each table sends the n_i x k squared distances of its rows to its block of the centres;
the server sums them along p_i (an evaluation round, not training traffic). Labels are ignored.
"""

from __future__ import annotations

import time

import numpy as np

from strategies.coreset import DISStrategy, compact_counts
from strategies.registry import AlgorithmEntry, register
from tpflower.coreset import CoresetKMeansParams, KMeansParams, sq_distances, weighted_kmeans
from tpflower.guard import Protocol
from tpflower.loj import BatchPlan, joined_predictions
from tpflower.mapping import segment_sum
from tpflower.phases import coreset as phases
from tpflower.phases import setup
from tpflower.results import EpochRecord, epoch_line

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


class DistDimKMeans(DISStrategy):
    """algorithm=kmeans: DistDim on the full join."""

    algorithm = "kmeans"
    params_type = KMeansParams
    kind = "kmeans"
    uses_coreset = False
    one_shot = True

    def protocol(self) -> None:
        self.setup()
        if self.scenario != "join" or any(len(r.shards) > 1 for r in self.routers.values()):
            raise ValueError(f"algorithm={self.algorithm} runs on the join scenario (one client per table)")
        assert self.results is not None and self.comm is not None
        self.results.metric = METRIC
        mapping, k, alg = self.mapping, self.params.k, self.params
        self.construction = {"rounds": 0.0, "bytes_up": 0.0, "bytes_down": 0.0, "distinct_rows": float(mapping.N)}
        if self.uses_coreset:
            core = self.sample_coreset(mapping, alg.m, alg.sampling)
            S = mapping.subset(core.rows)
            plan = BatchPlan.of(S, np.arange(S.N))
            w_U = {t: segment_sum(plan.inv[t], core.weights, len(U)) for t, U in plan.U.items()}
            replies = self.send(self.messages(lambda t: ({"rows": plan.U[t], "w": w_U[t]}, {"phase": "kmeans_local"})))
            point_labels = [np.asarray(replies[(t, 0)][0]["labels"], dtype=np.int64)[plan.inv[t]] for t in mapping.p]
            weights = core.weights
        else:  # each table: k-means weighted by G_iu, one label per row; the server reads them along p_i
            replies = self.send(self.messages(lambda t: ({"G": compact_counts(mapping.G(t))}, {"phase": "kmeans_local"})))
            point_labels = [np.asarray(replies[(t, 0)][0]["labels"], dtype=np.int64)[p] for t, p in mapping.p.items()]
            weights = np.ones(mapping.N)
        local_C = [np.asarray(replies[(t, 0)][0]["C"], dtype=np.float64) for t in mapping.p]
        cells, inv = grid_cells(point_labels, k)
        cell_w = np.bincount(inv, weights=weights, minlength=len(cells))
        points = np.hstack([C[cells[:, i]] for i, C in enumerate(local_C)])
        C, _ = weighted_kmeans(points, cell_w, k, np.random.default_rng([int(self.cfg.seed) & 0xFFFFFFFF, 0xD15D]),
                               alg.iters, alg.tol)
        self.centres = C
        grid_cost = float((cell_w * sq_distances(points, C).min(1)).sum() / cell_w.sum())
        cost = self.full_join_cost(C, [c.shape[1] for c in local_C])
        rec = EpochRecord(epoch=1, test_metric=cost, train_loss=grid_cost, wall_time_s=time.perf_counter() - self._t0,
                          extra={"grid_cells": float(len(cells)), "coreset_rows": self.construction["distinct_rows"],
                                 "construction_bytes": self.construction["bytes_up"] + self.construction["bytes_down"]},
                          **self.comm.snapshot())  # type: ignore[arg-type]
        self.results.history.append(rec)
        self.log(epoch_line(METRIC, rec))
        self.finish()

    def full_join_cost(self, C: np.ndarray, widths: list[int]) -> float:
        """(1/N) sum_j min_c ||x_j - c||^2 over the full join: D = sum_i D_i[p_i] (an evaluation round)."""
        bounds = np.cumsum([0, *widths])
        blocks = {t: C[:, bounds[i]:bounds[i + 1]] for i, t in enumerate(self.mapping.p)}
        replies = self.send(self.messages(lambda t: ({"C": blocks[t]}, {"phase": "kmeans_cost"})), kind="eval")
        D = joined_predictions(self.mapping.p, {t: np.asarray(r, dtype=np.float64) for t, r in self.outputs(replies, "D").items()})
        self.D_min = D.min(1)
        return float(self.D_min.mean())


class CoresetKMeans(DistDimKMeans):
    """algorithm=coreset_kmeans: DistDim on a DIS coreset (Alg. 3 sensitivities) or a uniform sample."""

    algorithm = "coreset_kmeans"
    params_type = CoresetKMeansParams
    uses_coreset = True


register(AlgorithmEntry("kmeans", "kmeans", "join", DistDimKMeans, Protocol(setup.SETUP + phases.KMEANS), KMeansParams,
                        feature_dp=False, label_dp=False, summary="DistDim k-means on the full join (VKMC baseline)"))
register(AlgorithmEntry("coreset_kmeans", "coreset_kmeans", "join", CoresetKMeans,
                        Protocol(setup.SETUP + phases.DIS + phases.KMEANS), CoresetKMeansParams,
                        feature_dp=False, label_dp=False,
                        summary="VFL coreset (DIS, Alg. 1 and 3) over the join, then DistDim k-means"))
