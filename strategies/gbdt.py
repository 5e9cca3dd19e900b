"""Histogram gradient boosting over the join, server side (docs/algorithms.md, Boosted trees over the join; client:
tpflower/phases/gbdt.py; shared math and tree growth: tpflower/trees.py).

The server holds the training labels (label-DP'd if so) and the current scores F of the joined training rows.
Per boosting round it computes g and h (tpflower.trees.gradients) and grows the round's d_c trees best-first
(tpflower.trees.grow_forest). Each expansion step is ONE round trip: every table receives, for each node being
expanded (all trees of the round together), the per-table-row sums of g and h and the joined-row counts of the
node's rows (segment sums over p_i: n_i numbers, not N); it answers its best gain per node and one side bit per
(node, row). The server keeps, per node, the table of the largest gain (ties: the smallest table name) and, when
it splits the node, routes the node's joined rows by that table's bits. Leaf values are the server's.

Evaluation every ``eval_every`` trees (one routing round, not training traffic): each table answers the side of
the test and validation rows at its splits of the new trees; the server walks the trees. Validation rows (the
top-level ``validation_fraction`` of the training join, tpflower.validation) take no part in training; with
``early_stopping`` > 0 the run stops after that many evaluations without a lower validation loss and keeps the
trees of the best one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from strategies.base import LoJStrategy
from strategies.replies import ReplyError, packed_bits
from tpflower.fedprep import RankSketch
from tpflower.join_counts import compact_counts
from tpflower.losses import loss_np
from tpflower.mapping import index_dtype
from tpflower.phases.gbdt import GBDTParams, size_slices
from tpflower.results import importance_line
from tpflower.trees import (
    Candidate,
    Growth,
    Node,
    Tree,
    add_leaves,
    bin_edges,
    dense_histograms,
    first_best_rows,
    gradients,
    grow_forest,
    init_scores,
    leaf_values,
    sparse_histograms,
    subtraction_plan,
    table_importance,
)
from tpflower.validation import validation_mask


@dataclass
class RowSums:
    """One node's per-table-row sums for one table: its distinct table rows (ascending), each one's sums of g
    and h over the node's joined rows (H None: not asked) and its count of them."""

    rows: np.ndarray
    G: np.ndarray
    H: np.ndarray | None
    C: np.ndarray

    def sibling(self, small: RowSums) -> RowSums:
        """The sums of the other child of this node, whose child ``small`` is: this node's minus small's, row by
        row (every row of small is this node's), the rows left without a joined row dropped; sums of h below 0
        by rounding are 0. The same rows and counts as summing the child's joined rows, the sums to rounding
        (the owner builds that child's histogram as its parent's minus its sibling's anyway)."""
        at = np.searchsorted(self.rows, small.rows)
        C = self.C.copy()
        C[at] -= small.C
        keep = np.flatnonzero(C)
        G = self.G.copy()
        G[at] -= small.G
        H = None
        if self.H is not None and small.H is not None:
            H = self.H.copy()
            H[at] -= small.H
            H = np.maximum(H[keep], 0.0)
        return RowSums(self.rows[keep], G[keep], H, C[keep])


def node_sums(p: np.ndarray, joined: np.ndarray, g: np.ndarray, h: np.ndarray | None, n_rows: int) -> list[RowSums]:
    """Segment sums over p for the k = len(joined) nodes at once: the joined rows of node n (``joined[n]`` of
    them, their table rows ``p``, in the node's row order, nodes one after the other) give the node's
    :class:`RowSums` (h None: no sums of h). Each sum adds its joined rows in their given order; dense
    (bincount over k * n_rows) when that is not much more than the joined rows, by sorting otherwise."""
    k, size = len(joined), len(joined) * n_rows
    key = np.repeat(np.arange(k, dtype=np.int64 if size >= 2**31 else np.int32) * n_rows, joined) + p
    if size <= 16 * len(key) + 2**16:  # a pass over k * n_rows counts costs less than sorting the keys
        C = np.bincount(key, minlength=size)
        nz = np.flatnonzero(C > 0)  # (on a bool array: several times faster than on the counts)
        C = C[nz]  # one array of k * n_rows alive at a time
        G = np.bincount(key, weights=g, minlength=size)[nz]
        H = None if h is None else np.bincount(key, weights=h, minlength=size)[nz]
    else:
        nz, inverse, C = np.unique(key, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        G = np.bincount(inverse, weights=g, minlength=len(nz))
        H = None if h is None else np.bincount(inverse, weights=h, minlength=len(nz))
    cut = np.searchsorted(nz, np.arange(k + 1) * n_rows)
    return [
        RowSums(nz[a:b] - n * n_rows, G[a:b], None if H is None else H[a:b], C[a:b])
        for n, (a, b) in enumerate(zip(cut[:-1].tolist(), cut[1:].tolist()))
    ]


def joined_sides(rows: np.ndarray, bits: np.ndarray, p: np.ndarray, n_rows: int, seg: np.ndarray) -> np.ndarray:
    """The side of each joined row ``seg`` of a node (its table row ``p[seg]``, of ``n_rows``) from the sides
    ``bits`` of the node's distinct table rows ``rows``."""
    at = np.empty(n_rows, dtype=index_dtype(len(rows)))
    at[rows] = np.arange(len(rows), dtype=at.dtype)
    return bits[at[p[seg]]]


def distinct_rows(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct table rows of ``p`` (ascending) and the position of each of p's rows among them, both in the
    narrowest index dtype (np.unique's inverse is int64: 8 bytes per evaluated row and table)."""
    rows, inv = np.unique(p, return_inverse=True)
    return rows.astype(p.dtype, copy=False), inv.reshape(-1).astype(index_dtype(len(rows)), copy=False)


def tree_record(tree: Tree) -> dict[str, Any]:
    """One tree as model.json holds it: its output, root and nodes [id, table, left, right, leaf value]."""
    return {
        "out": tree.out,
        "root": tree.root,
        "nodes": [[n.id, n.table, n.children[0], n.children[1], n.value] for n in tree.nodes.values()],
    }


def forest_scores(
    record: Mapping[str, Any], bits: Mapping[str, np.ndarray], inv: Mapping[str, np.ndarray]
) -> np.ndarray:
    """F of the joined rows of a prediction from model.json's trees: ``bits[t]`` the side of each of table t's
    distinct rows at each of its splits (columns in ``record["split_ids"][t]`` order), ``inv[t]`` the distinct
    row of every joined row."""
    n = len(next(iter(inv.values())))
    column = {t: {int(s): i for i, s in enumerate(ids)} for t, ids in record["split_ids"].items()}
    F = np.tile(np.asarray(record["F0"], dtype=np.float64), (n, 1))
    for trees in record["trees"]:
        for rec in trees:
            nodes = {
                int(i): Node(
                    int(i), int(rec["out"]), 0, 0, 0, 0.0, 0.0, table=str(t), children=(int(a), int(b)), value=float(v)
                )
                for i, t, a, b, v in rec["nodes"]
            }
            tree = Tree(int(rec["out"]), nodes, int(rec["root"]))
            F[:, tree.out] += leaf_values(
                tree, n, lambda node, idx: bits[node.table][inv[node.table][idx], column[node.table][node.id]]
            )
    return F


class JoinGBDT(LoJStrategy):
    """algorithm=gbdt over the join."""

    algorithm = "gbdt"
    params_type = GBDTParams

    resumable = True  # a checkpoint at every evaluation (the forest so far, the scores F), no extra round trip
    checkpointed = ("forest", "won", "split_ids", "F0")

    def protocol(self) -> None:
        done, loop = self.begin(self.start_gbdt)
        if done:  # resumed: what setup built is restored, the rows derived from it again (no round)
            self.fit_rows_and_counts()
        assert self.results is not None and self.comm is not None
        alg: GBDTParams = self.params
        task = self.task
        F, F_eval, best, bad = loop["F"], loop["F_eval"], loop["best"], loop["bad"]
        y = np.asarray(self.y_train)
        y_fit, y_val = y[self.fit_rows], y[self.val_rows]
        next_id, evaluated = loop["next_id"], len(self.forest)
        for r in range(done + 1, alg.trees + 1):
            g, h = gradients(task, F, y_fit)
            trees, perms, next_id = grow_forest(self.fit_rows, g, h, self.growth, self.evaluate, next_id)
            self.row_sums, self.summed = {}, {}  # the round's leaves' sums and summed histograms
            add_leaves(F, trees, perms)
            del g, h, perms
            for tree in trees:
                for node in tree.internal():
                    self.won[node.table].append(node.id)
                    self.split_ids[node.table].append(node.id)
            self.forest.append(trees)
            if r % alg.eval_every and r != alg.trees:
                continue
            # the routing round's last message carries the checkpoint mark: each node keeps its state after it
            F_eval += self.route(self.forest[evaluated:], self.checkpoint_config(r))
            evaluated = len(self.forest)
            extra: dict[str, float] = {"trees": float(r)}
            if len(self.val_rows):
                val_loss = float(loss_np(task, F_eval[self.test.N :], y_val).mean())
                extra["val_loss"] = self.label_scale.loss(val_loss) if task == "regression" else val_loss
                if val_loss < best[0]:
                    best, bad = (val_loss, r, F_eval[: self.test.N].copy(), float(loss_np(task, F, y_fit).mean())), 0
                else:
                    bad += 1
            train_loss = float(loss_np(task, F, y_fit).mean())
            self.record_epoch(r, F_eval[: self.test.N], train_loss, extra)
            if alg.early_stopping and bad >= alg.early_stopping:
                self.log(f"early stopping: no lower validation loss in {bad} evaluations; keeping {best[1]} trees")
                del self.forest[best[1] :]
                self.results.stopped = {
                    "epoch": r,
                    "reason": "validation",
                    "detail": f"no lower validation loss in {bad} evaluations",
                }
                self.record_epoch(best[1], best[2], best[3], {"trees": float(best[1]), "kept": 1.0})
                break
            self.end_epoch(r, {"F": F, "F_eval": F_eval, "best": best, "bad": bad, "next_id": next_id})
        if len(self.val_rows):  # results.json's selection, as the model-selecting algorithms' (strategies.selection)
            kept = len(self.forest)
            losses = {rec.epoch: rec.extra["val_loss"] for rec in self.results.history if "val_loss" in rec.extra}
            self.results.selection = {
                "validation_fraction": float(self.cfg.get("validation_fraction") or 0),
                "validation_rows": len(self.val_rows),
                "kept_epoch": kept,
                "val_loss": float(losses.get(kept, np.nan)),
                "early_stopping": alg.early_stopping,
            }
        self.results.importance = table_importance(self.forest)
        self.log(importance_line(self.results.importance, len(self.fit_rows), alg.min_child_rows))
        self.finish()

    def start_gbdt(self) -> dict[str, Any]:
        """Setup, the bins (one round; two over a union) and the training loop's first state: F = F_0 for the
        joined training rows and the evaluated rows (test, then validation)."""
        self.setup()
        counts = self.fit_rows_and_counts()
        self.won: dict[str, list[int]] = {t: [] for t in self.tables}  # taken splits the tables are not told yet
        self.split_ids: dict[str, list[int]] = {t: [] for t in self.tables}  # every split each table holds
        self.forest: list[list[Tree]] = []
        self.bins(counts, int(self.d_out))
        y = np.asarray(self.y_train)
        self.F0 = init_scores(self.task, y[self.fit_rows], int(self.d_out))
        return {
            "F": np.tile(self.F0, (len(self.fit_rows), 1)),
            "F_eval": np.tile(self.F0, (self.test.N + len(self.val_rows), 1)),
            "best": (np.inf, 0, None, 0.0),  # validation loss, trees, their test scores, train loss
            "bad": 0,
            "next_id": 0,
        }

    def fit_rows_and_counts(self) -> dict[str, np.ndarray]:
        """What the loop derives from setup's mapping, without a round: the joined training rows the trees are
        fit on (``fit_rows``: not the validation part, tpflower.validation) and their table rows ``p_fit``,
        the validation rows, the evaluated table rows (test, then validation) and the growth settings.
        Returns each table's count of fit rows per table row (G_iu, binning's weights)."""
        alg: GBDTParams = self.params
        train = self.train
        label = self.spec.label_table
        val = validation_mask(train.p[label], float(self.cfg.get("validation_fraction", 0) or 0), int(self.cfg.seed))
        self.fit_rows = fit = np.flatnonzero(~val).astype(index_dtype(train.N))
        self.val_rows = val_rows = np.flatnonzero(val)
        self.row_sums: dict[str, dict[int, RowSums]] = {}  # per table, node id -> its sums, until split
        self.summed: dict[str, dict[int, np.ndarray]] = {}  # per sharded table, node id -> summed histogram
        self.growth = Growth(alg.max_leaves, alg.max_depth, alg.leaves_per_step, alg.learning_rate, alg.rule)
        self.tables = sorted(train.p)
        self.p_fit = {t: train.p[t] if not val.any() else train.p[t][fit] for t in self.tables}  # no copy: all fit
        counts = {t: np.bincount(self.p_fit[t], minlength=train.n_rows[t]) for t in self.tables}
        self.injective = {t: bool(counts[t].max(initial=0) <= 1) for t in self.tables}
        self.eval_rows = {t: distinct_rows(np.concatenate([self.test.p[t], train.p[t][val_rows]])) for t in self.tables}
        return counts

    @property
    def eval_p(self) -> dict[str, np.ndarray]:
        """The table rows of the evaluated rows (test, then validation), per table."""
        return {t: rows[inv] for t, (rows, inv) in self.eval_rows.items()}

    # ------------------------------------------------------------------------------------------ one step

    def sharded(self, t: str) -> bool:
        return len(self.routers[t].shards) > 1

    def bins(self, counts: dict[str, np.ndarray], d_out: int) -> None:
        """Every client bins its columns (``gbdt_bins``, G_iu of its rows); a sharded table's shards answer rank
        sketches of their G-weighted columns instead, which the server merges into the table's edges
        (tpflower.trees.bin_edges on the merged sketch) and sends back (``gbdt_edges``)."""
        replies = self.send(
            {
                (t, q): (
                    {"G": compact_counts(self.routers[t].scatter_all(counts[t])[q])},
                    {"phase": "gbdt_bins", "d_out": d_out},
                )
                for t, q in self.clients
            }
        )
        self.shared_edges: dict[str, list[np.ndarray]] = {}
        for t in [t for t in self.tables if self.sharded(t)]:
            per_feature: list[list[RankSketch]] = []
            for q in self.routers[t].shards:
                a = replies[(t, q)][0]
                parts = size_slices(a["sizes"])  # (a table of no feature column: none)
                per_feature = per_feature or [[] for _ in parts]
                for f, s in enumerate(parts):
                    per_feature[f].append(
                        RankSketch(np.asarray(a["values"][s], np.float64), np.asarray(a["weights"][s], np.int64))
                    )
            merged = [RankSketch.merge(sk) for sk in per_feature]
            self.shared_edges[t] = [bin_edges(m.values, m.weights, self.params.max_bins) for m in merged]
        if self.shared_edges:
            self.send(
                {
                    (t, q): (
                        {
                            "edges": np.concatenate([np.zeros(0), *self.shared_edges[t]]),
                            "sizes": np.array([len(e) for e in self.shared_edges[t]], dtype=np.int64),
                        },
                        {"phase": "gbdt_edges"},
                    )
                    for t, q in self.clients
                    if t in self.shared_edges
                }
            )

    def evaluate(self, nodes: list[Node], perms: list[np.ndarray], g: np.ndarray, h: np.ndarray) -> list[Any]:
        """One expansion step: the nodes' per-table-row sums to every table, its best gain per node and side
        bits back; per node the best table's candidate (ties: the smallest table name). A table whose rows
        each occur at most once in the training join gets its joined rows as they are (rows p_i[S_n], sums g
        and h, counts 1) and answers its bits in that order; the squared error sends no H (h = 1: H = C).
        A sharded table's shards answer their parts of the histograms (``gbdt_hist``), and after the server
        summed them, the split and their rows' bits (``gbdt_shard_split``): a second round trip."""
        regression, k = self.task == "regression", len(nodes)
        segs = [perms[node.out][node.start : node.end] for node in nodes]
        joined = np.array([len(seg) for seg in segs], dtype=np.int64)
        seg_all = np.concatenate(segs)
        d_out = g.shape[1]  # g, h: C-ordered (N, d_out); each row's value at its node's output, one flat gather
        at = seg_all if d_out == 1 else seg_all * d_out + np.repeat([node.out for node in nodes], joined)
        g_all, h_all = g.ravel().take(at), None if regression else h.ravel().take(at)
        sums = self.table_sums(nodes, segs, seg_all, g_all, h_all)
        cat: dict[str, tuple[Any, ...]] = {}  # per table: rows, sizes, G, H, C (one node after the other)
        for t in self.tables:
            if self.injective[t]:
                p = self.p_fit[t][seg_all]
                cat[t] = (p, joined, g_all, h_all, np.ones(len(p), dtype=np.uint8))
            else:
                parts = sums[t]
                cat[t] = (
                    np.concatenate([s.rows for s in parts]),
                    np.array([len(s.rows) for s in parts], dtype=np.int64),
                    np.concatenate([s.G for s in parts]),
                    None if regression else np.concatenate([s.H for s in parts]),
                    np.concatenate([s.C for s in parts]),
                )
        ids = np.array([n.id for n in nodes], dtype=np.int64)
        parent = np.array([n.parent for n in nodes], dtype=np.int64)
        masks = {t: self.routers[t].masks(cat[t][0]) for t in self.tables}
        positions = {t: self.routers[t].split(cat[t][0]) for t in self.tables}
        won = {t: np.array(self.won[t], dtype=np.int64) for t in self.tables}
        self.won = {t: [] for t in self.tables}
        # a sharded table's node of each of its message rows (each shard's sizes count its part of them)
        node_of = {t: np.repeat(np.arange(k), cat[t][1]) for t in self.tables if not self.routers[t].whole}
        # over a union: the nodes whose summed histograms are their kept summed parent's minus their sibling's
        derived = self.summed_plan(nodes, joined)
        derive = np.array([nodes[large].id for large, _, _ in derived], dtype=np.int64)
        dtype, messages = self.state_dtype, {}
        for t, q in self.clients:
            rows, sizes, G, H, C = cat[t]
            whole = self.routers[t].whole
            mask = slice(None) if whole else masks[t][q]  # a whole table: no copies
            arrays = {
                "nodes": ids,
                "parent": parent,
                "sizes": sizes if whole else np.bincount(node_of[t][mask], minlength=k),
                "rows": positions[t][q].astype(index_dtype(self.train.n_rows[t]), copy=False),
                "G": G[mask].astype(dtype, copy=False),
                "C": compact_counts(C[mask]),
                "won": won[t],
            }
            if H is not None:
                arrays["H"] = H[mask].astype(dtype, copy=False)
            if self.sharded(t):
                arrays["derive"] = derive
            messages[(t, q)] = (arrays, {"phase": "gbdt_hist" if self.sharded(t) else "gbdt_split"})
        replies = self.send(messages)
        shard_tables = [t for t in self.tables if self.sharded(t)]
        if shard_tables:  # the shards' histograms summed, then each shard's split and bits
            large = {i for i, _, _ in derived}
            built = [i for i in range(k) if i not in large]
            summed = {t: self.summed_hist(t, replies, built) for t in shard_tables}
            every = self.keep_summed(nodes, summed, derived)
            down = {t: sparse_histograms(hist) for t, hist in summed.items()}  # their non-empty bins
            replies.update(
                self.send(
                    {  # a shard that answered every node's part (it lost its memory) gets every node's sum
                        (t, q): (
                            {
                                "nodes": ids,
                                **(
                                    sparse_histograms(every(t))
                                    if int(replies[(t, q)][0]["shape"][0]) > len(built)
                                    else down[t]
                                ),
                            },
                            {"phase": "gbdt_shard_split"},
                        )
                        for t, q in self.clients
                        if t in summed
                    }
                )
            )
        first = {t: self.routers[t].shards[0] for t in self.tables}
        gains = np.stack([np.asarray(replies[(t, first[t])][0]["gain"], dtype=np.float64) for t in self.tables])
        bits: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per table: its (node, row)s' sides, node offsets
        out: list[Any] = []
        best, found = first_best_rows(gains.T)  # tables in name order: a tie keeps the smallest table name
        for i in range(k):
            if not found[i]:
                out.append(None)
                continue
            best_gain, best_t = float(gains[best[i], i]), self.tables[best[i]]
            if best_t not in bits:  # the side of each of the table's (node, row)s, in the message's order
                full = np.zeros(len(cat[best_t][0]), dtype=bool)
                for q, mask in masks[best_t].items():
                    packed = np.asarray(replies[(best_t, q)][0]["bits"])
                    if self.sharded(best_t):  # a shard's rows are known here (gbdt_split's: checked at the door)
                        packed_bits((best_t, q), "gbdt_shard_split", packed, (int(mask.sum()),))
                    full[mask] = np.unpackbits(packed, count=int(mask.sum())).astype(bool)
                bits[best_t] = full, np.concatenate([[0], np.cumsum(cat[best_t][1])])
            full, offsets = bits[best_t]
            side = full[offsets[i] : offsets[i + 1]]  # the node's rows' sides (its joined rows' if injective)
            if self.injective[best_t]:
                out.append(Candidate(best_gain, best_t, lambda seg, s=side: s))
            else:  # per joined row from its table row's, asked when the node is split
                rows, n_rows = sums[best_t][i].rows, self.train.n_rows[best_t]
                left = partial(joined_sides, rows, side, self.p_fit[best_t], n_rows)
                out.append(Candidate(best_gain, best_t, left))
        return out

    def table_sums(
        self,
        nodes: list[Node],
        segs: list[np.ndarray],
        seg_all: np.ndarray,
        g_all: np.ndarray,
        h_all: np.ndarray | None,
    ) -> dict[str, list[RowSums]]:
        """Each table's per-table-row sums of each node (the tables whose rows occur at most once need none).
        Of two children of a parent whose sums are kept, the one with fewer joined rows is summed from its
        joined rows and the other is the parent's minus it (:meth:`RowSums.sibling`), as the owner builds
        their histograms; every other node is summed from its joined rows (``seg_all``: the nodes' joined
        rows one node after the other, g and h at them). A node's sums are kept until it is split
        (``row_sums``; dropped at the end of the boosting round)."""
        tables = [t for t in self.tables if not self.injective[t]]
        if not tables:
            return {}
        parents = self.row_sums.get(tables[0], {})  # every table keeps the same nodes' sums
        direct, derived = subtraction_plan(
            [n.parent for n in nodes], [len(seg) for seg in segs], [n.id for n in nodes], parents
        )
        if len(direct) < len(nodes):
            bounds = np.cumsum([0, *(len(s) for s in segs)])
            seg_all = np.concatenate([segs[i] for i in direct])
            g_all, h_all = (
                None if x is None else np.concatenate([x[bounds[i] : bounds[i + 1]] for i in direct])
                for x in (g_all, h_all)
            )
        joined = np.array([len(segs[i]) for i in direct], dtype=np.int64)
        out: dict[str, list[RowSums]] = {}
        for t in tables:
            parts: list[Any] = [None] * len(nodes)
            for i, s in zip(direct, node_sums(self.p_fit[t][seg_all], joined, g_all, h_all, self.train.n_rows[t])):
                parts[i] = s
            kept = self.row_sums.setdefault(t, {})
            for large, q, small in derived:
                parts[large] = kept.pop(q).sibling(parts[small])
            for i, node in enumerate(nodes):
                kept.pop(node.parent, None)
                kept[node.id] = parts[i]
            out[t] = parts
        return out

    def summed_plan(self, nodes: list[Node], joined: np.ndarray) -> list[tuple[int, int, int]]:
        """Histogram subtraction at the summed level over a union (docs/algorithms.md, Union): of two children of
        a node whose summed histograms are kept (``summed``, the same nodes for every sharded table), the one of
        fewer joined rows is built by the shards from their rows and summed here; the other, (its position, its
        parent's id, its sibling's position), is the summed parent's minus it, here and on every shard."""
        kept = next(iter(self.summed.values()), {})
        return subtraction_plan([n.parent for n in nodes], joined.tolist(), [n.id for n in nodes], kept)[1]

    def summed_hist(self, t: str, replies: Mapping[Any, Any], built: list[int]) -> np.ndarray:
        """The sum of a sharded table's shards' parts of the histograms of the nodes built from rows (positions
        ``built`` of the step; each part checked by check_gbdt: of those nodes, or of every node from a shard
        that lost its memory), each part's non-empty bins made dense again (tpflower.trees.dense_histograms: the
        same array bit for bit) and summed as dense parts; shards whose parts differ in shape stop the run
        naming the table."""
        parts = [
            dense_histograms(*(np.asarray(a[n]) for n in ("mask", "hist", "count")), *np.asarray(a["shape"]).tolist())
            for a in (replies[(t, q)][0] for q in self.routers[t].shards)
        ]
        parts = [p[built] if len(p) > len(built) else p for p in parts]
        if len({p.shape for p in parts}) > 1:
            shapes = ", ".join(f"shard {q}: {p.shape}" for q, p in zip(self.routers[t].shards, parts))
            raise ReplyError(f"table {t!r}, phase 'gbdt_hist': its shards' histograms differ in shape ({shapes})")
        return sum(parts[1:], parts[0])

    def keep_summed(
        self, nodes: list[Node], summed: Mapping[str, np.ndarray], derived: list[tuple[int, int, int]]
    ) -> Callable[[str], np.ndarray]:
        """Keep every node's summed histogram per sharded table (``summed``: those of the nodes built from rows,
        in step order; a derived node's: its parent's minus its sibling's), each in place of its parent's, as
        the shards do; dropped at the end of the boosting round. Returns a function giving a table's every
        node's, in step order (stacked only for a shard that lost its memory)."""
        large = {i for i, _, _ in derived}
        built = [i for i in range(len(nodes)) if i not in large]
        for t, hist in summed.items():
            kept = self.summed.setdefault(t, {})
            at = dict(zip(built, hist))
            for i, q, small in derived:
                at[i] = kept[q] - at[small]
            for q in {n.parent for n in nodes}:
                kept.pop(q, None)
            kept.update({nodes[i].id: h for i, h in at.items()})
        return lambda t: np.stack([self.summed[t][n.id] for n in nodes]) if nodes else summed[t]

    # ------------------------------------------------------------------------------------------ evaluation

    def route(self, rounds: list[list[Tree]], config: Mapping[str, Any] | None = None) -> np.ndarray:
        """The sum of the leaf values of the trees ``rounds`` for every evaluated row (test, then validation):
        one routing round (``kind=eval``), each table (each shard) the side of its evaluated rows at its
        splits. ``config``: more of the messages' config (the checkpoint mark)."""
        splits: dict[str, list[int]] = {t: [] for t in self.tables}
        for trees in rounds:
            for tree in trees:
                for node in tree.internal():
                    splits[node.table].append(node.id)
        won = {t: np.array(self.won[t], dtype=np.int64) for t in self.tables}
        self.won = {t: [] for t in self.tables}
        positions = {t: self.routers[t].split(self.eval_rows[t][0]) for t in self.tables}
        replies = self.send(
            {
                (t, q): (
                    {
                        "rows": positions[t][q].astype(index_dtype(self.train.n_rows[t]), copy=False),
                        "splits": np.array(splits[t], dtype=np.int64),
                        "won": won[t],
                    },
                    {"phase": "gbdt_route", **(config or {})},
                )
                for t, q in self.clients
            },
            kind="eval",
        )
        column = {t: {s: i for i, s in enumerate(splits[t])} for t in self.tables}
        packed: dict[str, np.ndarray] = {}  # per table its rows' sides, packed (np.packbits along the splits)
        for t in self.tables:
            rows = self.eval_rows[t][0]
            packed[t] = np.zeros((len(rows), (len(splits[t]) + 7) // 8), dtype=np.uint8)
            for q, mask in self.routers[t].masks(rows).items() if splits[t] else ():
                packed[t][mask] = np.asarray(replies[(t, q)][0]["bits"])
        inv = {t: self.eval_rows[t][1] for t in self.tables}
        n = len(inv[self.tables[0]])
        out = np.zeros((n, int(self.d_out)))

        def goes_left(node: Node, idx: np.ndarray) -> np.ndarray:  # read in place: only the rows at the node
            j = column[node.table][node.id]
            return (packed[node.table][inv[node.table][idx], j >> 3] >> (7 - (j & 7))) & 1 == 1

        for trees in rounds:
            for tree in trees:
                out[:, tree.out] += leaf_values(tree, n, goes_left)
        return out

    def model_extra(self) -> dict[str, Any]:
        """model.json of boosted trees: the tree structure (each node's id, its table, children and leaf
        value), F_0 and each table's split ids (its saved part holds their features and thresholds)."""
        return {
            "predicts": "trees",
            "F0": self.F0.tolist(),
            "split_ids": {t: sorted(ids) for t, ids in self.split_ids.items()},
            "trees": [[tree_record(tree) for tree in trees] for trees in self.forest],
        }


class UnionGBDT(JoinGBDT):
    """algorithm=gbdt scenario=ucq: over the union, a sharded table's shards bin on the edges the server merged
    from their sketches and answer their parts of the histograms, summed by the server (two round trips per
    step); of two siblings whose parent's summed histogram is kept, only the smaller's travels, both ways
    (:meth:`JoinGBDT.summed_plan`)."""

    algorithm = "ucq_gbdt"
