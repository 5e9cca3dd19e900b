"""Histogram gradient boosting over the join, the table owner's side (docs/algorithms.md, Boosted trees over the
join; server: strategies/gbdt.py; shared math: tpflower/trees.py).

  gbdt_bins  {G}                                        -> {}: bins every feature column on weighted quantiles
                                                        (weights G_iu, at most algorithm.max_bins bins); the
                                                        edges stay on the node
  gbdt_split {nodes, parent, sizes, rows, G, H, C, won} -> {gain, bits}: for each node being expanded, the
                                                        per-table-row sums of g and h and the joined-row counts
                                                        of its rows (``sizes`` rows per node, concatenated);
                                                        the table's best split gain per node (-inf: none) and,
                                                        packed, one side bit per (node, row): its proposal's
                                                        "x_f <= threshold" (a missing x_f: the side the split
                                                        chose for them), or "its category is in the set"
                                                        (tpflower.categorical). ``won``: the nodes whose split the
                                                        server took from this table since the last message:
                                                        they join the table's model
  gbdt_route {rows, splits, won}                        -> {bits}: the side of each row ``rows`` at each of its
                                                        splits ``splits`` (packed, row-major): evaluation of
                                                        the test and validation rows

Histograms, bins, features, thresholds and category sets never leave the node (over a union, a shard's histograms
go to the server, which sums them: gbdt_hist, then gbdt_shard_split with the sums). Histogram subtraction: of two
siblings, the histogram of the one with fewer joined rows is built from its rows and the other's is the parent's
minus it; over a union at the summed level, on the server's plan (gbdt_hist's ``derive``, :func:`check_plan`).
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpflower import categorical
from tpflower.client import TableClient
from tpflower.fedprep import DEFAULT_SKETCH_SIZE, RankSketch
from tpflower.guard import Phase, Protocol, ProtocolRefusal, Stage, sharded, takes, unsharded
from tpflower.params import AlgorithmParams, nonnegative, nonnegative_int, one_of, param, positive, positive_int
from tpflower.phases import setup
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.trees import (
    MAX_BINS,
    BinLayout,
    Bundles,
    SplitRule,
    best_splits,
    bin_codes,
    binary_columns,
    column_edges,
    column_sums,
    dense_histograms,
    histograms,
    sparse_histograms,
    sparse_problem,
    subtraction_plan,
)

log = logging.getLogger(__name__)

#: Why gbdt refuses feature DP (shown in the error).
WHY_NO_FEATURE_DP = (
    "its replies (a best gain per node and one side bit per node and row) are exact functions of the table's "
    "features; gbdt has no DP version of them yet"
)
#: the model group's kinds the trees take: their own, or conf/config.yaml's default (linear), which they ignore
TREE_MODELS = ("gbdt", "linear")
WHY_TREE_MODELS = (
    "boosted trees have no other model; leave model at its default (linear, unused by trees) or set model=gbdt"
)


def max_bins(what: str, value: Any) -> int:
    n = positive_int(what, value)
    if not 2 <= n <= MAX_BINS:
        raise ValueError(f"{what} must be between 2 and {MAX_BINS}, got {value!r}")
    return n


@dataclass(frozen=True)
class GBDTParams(AlgorithmParams):
    """algorithm=gbdt (conf/algorithm/gbdt.yaml): second-order histogram boosting over the join."""

    trees: int = param(positive_int, 300)  # boosting rounds (d_c trees each)
    learning_rate: float = param(positive, 0.1)
    max_leaves: int = param(positive_int, 63)
    max_depth: int = param(nonnegative_int, 0)  # 0: no bound
    leaves_per_step: int = param(positive_int, 8)  # leaves of highest gain split per step (1: strictly best-first)
    max_bins: int = param(max_bins, 255)
    lambda_l2: float = param(nonnegative, 0.0)
    min_child_weight: float = param(nonnegative, 1e-3)
    min_child_rows: int = param(positive_int, 20)
    min_gain: float = param(nonnegative, 0.0)
    eval_every: int = param(positive_int, 10)  # trees between evaluations (one line, one routing round each)
    early_stopping: int = param(nonnegative_int, 3)  # evaluations without validation gain that stop (0: never)
    # categorical columns: each block one feature split by category sets (tpflower.categorical, with LightGBM's
    # defaults below), or each one-hot column a feature; native by measurement (docs/results.md)
    categorical: str = param(one_of(*categorical.MODES), "native")
    max_cat_to_onehot: int = param(positive_int, 4)
    cat_smooth: float = param(nonnegative, 10.0)
    cat_l2: float = param(nonnegative, 10.0)
    max_cat_threshold: int = param(positive_int, 32)
    min_data_per_group: int = param(positive_int, 100)

    @property
    def rule(self) -> SplitRule:
        return SplitRule(self.lambda_l2, self.min_child_weight, self.min_child_rows, self.min_gain)

    @property
    def categorical_rule(self) -> categorical.CategoricalRule | None:
        """The native split's rule (None: one-hot columns)."""
        if self.categorical != "native":
            return None
        return categorical.CategoricalRule(
            self.max_cat_to_onehot, self.cat_smooth, self.cat_l2, self.max_cat_threshold, self.min_data_per_group
        )


def _where(client: TableClient, phase: str) -> str:
    return f"table {client.settings.table!r} ({phase})"


def _refuse(client: TableClient, phase: str, problem: str, detail: str = "") -> ProtocolRefusal:
    """A refusal naming the table and the kind of problem, no number about the table (the node's log has the
    detail)."""
    if detail:
        log.warning("%s: %s (%s)", _where(client, phase), problem, detail)
    return ProtocolRefusal(f"{_where(client, phase)} refuses the message: {problem}")


# names, kinds and the dimension each input array must have, per phase
_INPUTS: dict[str, dict[str, str]] = {
    "gbdt_bins": {"G": "count"},
    "gbdt_split": {
        "nodes": "id",
        "parent": "id",
        "sizes": "count",
        "rows": "row",
        "G": "float",
        "H": "float",
        "C": "count",
        "won": "id",
    },
    "gbdt_route": {"rows": "row", "splits": "id", "won": "id"},
    "gbdt_hist": {},  # gbdt_split's and ``derive`` (below)
    "gbdt_edges": {"edges": "float", "sizes": "count"},
    "gbdt_shard_split": {"nodes": "id", "mask": "any", "hist": "any", "count": "any"},
}
_INPUTS["gbdt_hist"] = {**_INPUTS["gbdt_split"], "derive": "id"}


def check_inputs(client: TableClient, phase: str, arrays: Arrays, kept: Container[int] = ()) -> dict[str, np.ndarray]:
    """Every input of a gbdt phase, checked in one place before anything is computed: exactly the phase's
    names, vectors, integer or finite float dtypes, rows of this table, per-row arrays of one length, sizes that
    add up to the rows, one count per table row (gbdt_bins) and counts >= 1, hessian sums >= 0, and a shard's
    subtraction plan (gbdt_hist's ``derive``, :func:`check_plan`; ``kept``: the nodes whose summed histograms
    the shard keeps). Returns them with node ids, sizes and G_iu as int64, the rows and counts C in their
    integer dtype and the sums in float32 or float64 (no per-row copy)."""
    expected = dict(_INPUTS[phase])
    if phase in ("gbdt_split", "gbdt_hist") and client.settings.spec.label.task == "regression":
        del expected["H"]  # squared error: h = 1, the counts are the hessian sums
    if set(arrays) != set(expected):
        raise _refuse(client, phase, "its arrays are not the phase's inputs", f"got {sorted(arrays)}")
    n_rows = len(client.local.X)
    out: dict[str, np.ndarray] = {}
    for name, kind in expected.items():
        a = np.asarray(arrays[name])
        if kind == "any":  # checked by the phase (shape against its own state)
            continue
        if a.ndim != 1:
            raise _refuse(client, phase, f"{name} is not a vector", f"shape {a.shape}")
        if kind == "float":
            if a.size and a.dtype.kind != "f":
                raise _refuse(client, phase, f"{name} is not floating point", f"dtype {a.dtype}")
            if not a.size or a.dtype.itemsize < 4:  # float32 sums stay float32 (bincount adds in float64)
                a = a.astype(np.float64, copy=False)
            if not np.isfinite(a).all():
                raise _refuse(client, phase, f"{name} holds a value that is not finite")
        else:
            if a.size and a.dtype.kind not in "iu":
                raise _refuse(client, phase, f"{name} is not integer", f"dtype {a.dtype}")
            per_row = kind == "row" or name == "C"  # come in the narrowest dtype: kept, no per-row copy
            if not a.size or not per_row:
                a = a.astype(np.int64, copy=False)
            if a.size and a.dtype.kind == "i" and a.min() < (-1 if name == "parent" else 0):
                raise _refuse(client, phase, f"{name} holds a negative value")
            if kind == "row" and a.size and a.max() >= n_rows:
                raise _refuse(client, phase, f"{name} names rows this table does not have")
        out[name] = a
    if phase == "gbdt_bins" and len(out["G"]) != n_rows:
        raise _refuse(client, phase, "G does not hold one count per row of the table", f"{len(out['G'])} values")
    if phase in ("gbdt_split", "gbdt_hist"):
        n = len(out["nodes"])
        if len(out["parent"]) != n or len(out["sizes"]) != n:
            raise _refuse(client, phase, "nodes, parent and sizes differ in length")
        if (
            not len(out["rows"])
            == len(out["G"])
            == len(out.get("H", out["C"]))
            == len(out["C"])
            == int(out["sizes"].sum())
        ):
            raise _refuse(client, phase, "rows, G, H and C do not match the node sizes")
        if len(out["C"]) and out["C"].min() < 1:
            raise _refuse(client, phase, "a row of a node has no joined row")
        if "H" in out and len(out["H"]) and out["H"].min() < 0:
            raise _refuse(client, phase, "a hessian sum is negative")
        if len(set(out["nodes"].tolist())) != n:
            raise _refuse(client, phase, "a node appears twice")
    if phase == "gbdt_hist":
        problem = check_plan(out["nodes"], out["parent"], out["derive"], kept)
        if problem:
            raise _refuse(client, phase, problem)
    return out


def check_plan(nodes: np.ndarray, parent: np.ndarray, derive: np.ndarray, kept: Container[int]) -> str:
    """What is wrong with a step's subtraction plan over a union (empty: nothing): each node of ``derive`` (its
    summed histogram the parent's minus its sibling's, docs/algorithms.md, Union) must be a node of the step,
    named once, whose parent's summed histogram the shard keeps (``kept``) and whose one sibling in the step is
    built from rows."""
    ids = derive.tolist()
    if len(set(ids)) != len(ids):
        return "derive names a node twice"
    at = {n: i for i, n in enumerate(nodes.tolist())}
    if any(n not in at for n in ids):
        return "derive names a node that is not in the step"
    of = parent[[at[n] for n in ids]].tolist()
    if any(q not in kept for q in of):  # (a root's parent, -1, is never kept)
        return "derive names a node whose parent's summed histogram this shard does not keep"
    children = collections.Counter(parent.tolist())
    if len(set(of)) != len(of) or any(children[q] != 2 for q in of):
        return "derive names a node without one sibling built from its rows"
    return ""


# ------------------------------------------------------------------------------------------------ owner state


class OwnerTrees:
    """What the owner keeps of a run: its bin edges and codes, its proposals of the current boosting round
    (rows of node id, feature, bin, the gain's float64 bits, missing left), the splits the server took (its part of the
    model) and the histograms of the nodes still open (for subtraction). Edges, proposals and splits live in
    ``context.state``; codes and histograms are caches in the node's memory (rebuilt from the edges; a missing
    parent histogram is built from rows)."""

    def __init__(self, client: TableClient):
        self.client, self.state = client, client.state
        self.cache = client.data.models.setdefault(("gbdt", str(client.state.scalar("run_id", ""))), {})

    @property
    def edges(self) -> list[np.ndarray]:
        edges = self.state.get_list("gbdt.edges")
        if edges is None:
            raise _refuse(self.client, "gbdt", "no bins yet (gbdt_bins first)")
        return edges

    @property
    def layout(self) -> BinLayout:
        if "layout" not in self.cache:
            self.cache["layout"] = BinLayout.of(self.edges)
        return self.cache["layout"]

    def flat(self, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(feature, flat threshold code) of proposals or splits (rows of node, feature, bin, gain bits, missing left)."""
        f = splits[:, 1]
        return f, self.layout.offsets[f] + splits[:, 2]

    @property
    def codes(self) -> np.ndarray:
        if "codes" not in self.cache:  # a missing value of a column no training row missed: the median's bin
            empty = self.state.get("gbdt.empty_missing")
            self.cache["codes"] = bin_codes(tree_features(self.client), self.edges, self.client.local.X, empty)
        return self.cache["codes"]

    def learn_empty_missing(self, root: np.ndarray) -> None:
        """A shard of a union, from the first summed root histogram (``root``: (3, total), every training row of
        the union): the numeric columns whose missing bin holds no training row. Their missing values (of test
        and new rows: no training row has one) take the median's bin from now on, as over the join, where such
        a column has no missing bin (tpflower.trees.bin_codes); training rows' codes do not change."""
        if self.state.get("gbdt.empty_missing") is not None:
            return
        layout = self.layout
        empty = np.zeros(len(layout.offsets) - 1, dtype=bool)
        empty[layout.missing] = root[2, layout.offsets[layout.missing + 1] - 1] == 0
        self.state.put("gbdt.empty_missing", empty)
        for derived in ("codes", "bundles"):
            self.cache.pop(derived, None)

    @property
    def bundles(self) -> Bundles:
        """The features' exclusive bundles for histogram passes (tpflower.trees.Bundles: one-hot blocks)."""
        if "bundles" not in self.cache:
            self.cache["bundles"] = Bundles.of(self.codes, self.layout)
        return self.cache["bundles"]

    def table(self, name: str) -> np.ndarray:
        value = self.state.get(f"gbdt.{name}")
        return np.zeros((0, 5), dtype=np.int64) if value is None else value

    def accept(self, won: np.ndarray) -> None:
        """The proposals the server took become splits of the model (split id = node id)."""
        if not len(won):
            return
        props = self.table("proposals")
        at = {int(n): i for i, n in enumerate(props[:, 0])}
        if any(int(n) not in at for n in won):
            raise _refuse(self.client, "gbdt", "won names a node this table proposed no split for")
        self.state.put("gbdt.splits", np.concatenate([self.table("splits"), props[[at[int(n)] for n in won]]]))
        self.accept_categories(won)

    # native categorical splits (tpflower.categorical): a split (node, block's first column, -1) whose left
    # categories are the rows (node, column) of gbdt.category_proposals / gbdt.category_splits

    @property
    def blocks(self) -> list[np.ndarray]:
        """The one-hot blocks of the table's categorical columns (none unless algorithm.categorical=native)."""
        if self.client.settings.algorithm.categorical_rule is None:
            return []
        if "blocks" not in self.cache:
            assert self.client.local.preprocessor is not None
            self.cache["blocks"] = categorical.blocks_of(self.client.local.preprocessor)
        return self.cache["blocks"]

    def block(self, first: int) -> np.ndarray:
        """The block whose first column is ``first``."""
        return next(b for b in self.blocks if b[0] == first)

    def categories(self, first: int) -> np.ndarray:
        """Each row's category in the block whose first column is ``first`` (tpflower.categorical)."""
        key = ("categories", first)
        if key not in self.cache:
            self.cache[key] = categorical.category_codes(self.codes, self.layout, self.block(first))
        return self.cache[key]

    def category_sides(self, first: int, chosen: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The side of ``rows`` at a category split of the block starting at ``first``: in ``chosen``."""
        return categorical.in_set(self.categories(first)[rows], self.block(first), chosen)

    def propose_categories(self, nodes: np.ndarray, sets: list[np.ndarray | None]) -> None:
        """Keep the category sets of this step's proposals (the previous rounds' dropped)."""
        live = self.table("proposals")[:, 0]
        old = self.state.get("gbdt.category_proposals")
        old = np.zeros((0, 2), dtype=np.int64) if old is None else old[np.isin(old[:, 0], live)]
        new = [np.column_stack([np.full(len(c), n), c]) for n, c in zip(nodes, sets) if c is not None]
        self.state.put("gbdt.category_proposals", np.concatenate([old, *new]).astype(np.int64))

    def accept_categories(self, won: np.ndarray) -> None:
        props = self.state.get("gbdt.category_proposals")
        if props is None or not len(props):
            return
        taken = props[np.isin(props[:, 0], won)]
        if len(taken):
            old = self.state.get("gbdt.category_splits")
            self.state.put("gbdt.category_splits", taken if old is None else np.concatenate([old, taken]))

    def split_categories(self, split: int) -> np.ndarray:
        """The left columns of this table's category split ``split``."""
        rows = self.state.get("gbdt.category_splits")
        return np.zeros(0, dtype=np.int64) if rows is None else rows[rows[:, 0] == split, 1]


def tree_features(client: TableClient) -> np.ndarray:
    """The table's features as the trees bin them: the preprocessed features in float64 with the numeric
    columns' missing values kept missing (NaN: their own bin, tpflower.trees.column_edges) instead of the
    median that preprocessing fills in."""
    local = client.local
    assert local.preprocessor is not None
    return local.preprocessor.with_missing(local.X, client.data.rows)


def gbdt_bins(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Bin every feature column on quantiles weighted by G_iu (tpflower.trees.bin_edges); keep the edges. A shard
    of a sharded table keeps no edges of its own: it answers, per feature column, a rank sketch of its
    G-weighted values (block maxima with block weights, as federated preprocessing's; exact with at most
    DEFAULT_SKETCH_SIZE values), and the server's merged edges come back in ``gbdt_edges``."""
    G = check_inputs(client, "gbdt_bins", arrays)["G"]
    X = tree_features(client)
    client.output_width(config)
    if not client.settings.federated_prep:
        nb = int(client.settings.algorithm.max_bins)
        client.state.put_list("gbdt.edges", column_edges(X, G, nb))
        return {}, {}
    live = int((G > 0).sum())
    binary = binary_columns(X)  # 0/1 (one-hot) columns: sketched from their weighted counts of 1s, no values
    # order statistics of values need min_sketch_rows; a shard of only 0/1 columns sends counts: min_group_rows
    setting, sent = ("min_group_rows", "counts") if binary.all() else ("min_sketch_rows", "order statistics")
    bound = int(getattr(client.settings, setting))
    if 0 < live < bound:
        problem = (
            f"this shard holds fewer training rows than its owner's {setting}, so it sends no {sent} for the "
            "shared bins"
        )
        if client.settings.owner.deployed:  # the count stays in the owner's log
            raise _refuse(client, "gbdt_bins", f"{problem} (its owner may lower {setting})", f"{live} rows")
        raise ProtocolRefusal(  # a simulation: the user sets the run's bound (shards: one line, merged)
            f"{_where(client, 'gbdt_bins')} refuses the message: a union's shard holds fewer training rows than "
            f"{setting}={bound}, so it sends no {sent} for the shared bins; set {setting}=N, "
            f"N at most the smallest shard's training rows ({live} training rows)"
        )
    reps = G.astype(np.int64)
    ones, total = np.where(binary, column_sums(X, reps), 0).astype(np.int64), int(reps.sum())  # (NaN sums: unused)
    sketches = [RankSketch.empty()] * X.shape[1]
    for f in np.flatnonzero(binary):
        sketches[f] = RankSketch.two_values(total - int(ones[f]), int(ones[f]), DEFAULT_SKETCH_SIZE)
    for f in np.flatnonzero(~binary):  # missing values take no part in the edges (each numeric column's own bin)
        observed = ~np.isnan(X[:, f])
        sketches[f] = RankSketch.build(np.repeat(X[observed, f], reps[observed]), DEFAULT_SKETCH_SIZE)
    return {
        "values": np.concatenate([sk.values for sk in sketches]) if sketches else np.zeros(0),
        "weights": np.concatenate([sk.weights for sk in sketches]) if sketches else np.zeros(0, dtype=np.int64),
        "sizes": np.array([len(sk.values) for sk in sketches], dtype=np.int64),
    }, {}


def gbdt_edges(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """A shard of a sharded table: the table's bin edges, merged by the server from its shards' sketches."""
    a = check_inputs(client, "gbdt_edges", arrays)
    width = client.local.X.shape[1]
    if len(a["sizes"]) != width or int(a["sizes"].sum()) != len(a["edges"]) or (a["sizes"] >= MAX_BINS).any():
        raise _refuse(client, "gbdt_edges", "the edges do not fit the table's feature columns")
    parts = [a["edges"][s] for s in size_slices(a["sizes"])]  # (none: a table of no feature)
    if any((np.diff(e) <= 0).any() for e in parts):
        raise _refuse(client, "gbdt_edges", "the edges of a column are not increasing")
    # every shard gives each numeric column a bin of missing values, whether its own rows have any or not: the
    # shards' histograms add up bin by bin, and no shard tells whether it has missing values
    assert client.local.preprocessor is not None
    n_numeric = len(client.local.preprocessor.numeric)
    client.state.put_list("gbdt.edges", [np.append(e, np.nan) if f < n_numeric else e for f, e in enumerate(parts)])
    return {}, {}


def node_totals(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The sum of ``values`` over each node's slice (``sizes`` values per node, one after the other)."""
    if not len(values):
        return np.zeros(len(sizes), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.where(sizes > 0, np.add.reduceat(values, np.minimum(starts, len(values) - 1), dtype=np.int64), 0)


def new_round(client: TableClient, owner: OwnerTrees, a: Mapping[str, np.ndarray], kept: str) -> dict[int, Any]:
    """The histograms the owner keeps for subtraction (cache ``kept``: its own, or a shard's summed ones), emptied
    with the proposals when the step holds a root (a new boosting round: the last round's are done)."""
    hists: dict[int, Any] = owner.cache.setdefault(kept, {})
    if (a["parent"] < 0).any():
        client.state.put("gbdt.proposals", np.zeros((0, 5), dtype=np.int64))
        hists.clear()
    return hists


def built_histograms(owner: OwnerTrees, a: Mapping[str, np.ndarray], direct: list[int]) -> np.ndarray:
    """The histograms (len(direct), 3, total) of the message's nodes at positions ``direct`` (ascending), built
    together from their rows (tpflower.trees.histograms)."""
    layout = owner.layout
    if not direct:
        return np.zeros((0, 3, layout.total))
    slices = size_slices(a["sizes"])
    parts = [slices[i] for i in direct]

    def rows_of(x: np.ndarray | None) -> np.ndarray | None:  # the direct nodes' part of a per-row array
        if x is None or len(direct) == len(a["nodes"]):
            return x
        return np.concatenate([x[s] for s in parts])

    C = rows_of(a["C"])
    return histograms(
        owner.codes,
        rows_of(a["rows"]),
        rows_of(a["G"]),
        rows_of(a.get("H")),  # None: squared error, h = 1, so H is the count
        None if (C == 1).all() else C,  # None: one joined row each
        layout.total,
        np.repeat(np.arange(len(direct)), a["sizes"][direct]),
        len(direct),
        owner.bundles,
    )


def node_histograms(client: TableClient, owner: OwnerTrees, a: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
    """The histograms of the message's nodes (node id -> (3, total)); of two siblings the one with fewer joined
    rows is built from its rows, the other is the parent's minus it (parents' histograms kept between
    messages of a boosting round). The nodes built from rows are built together (tpflower.trees.histograms)."""
    hists = new_round(client, owner, a, "hists")
    nodes, parents = a["nodes"].tolist(), a["parent"].tolist()
    joined = node_totals(a["C"], a["sizes"])  # each node's joined rows
    direct, derived = subtraction_plan(parents, joined.tolist(), nodes, hists)  # built from rows; by subtraction
    built = built_histograms(owner, a, direct)
    new = {nodes[i]: built[j] for j, i in enumerate(direct)}
    for large, q, small in derived:
        new[nodes[large]] = hists[q] - new[nodes[small]]
    for q in set(parents):
        hists.pop(q, None)
    hists.update(new)
    return new


def size_slices(sizes: np.ndarray) -> list[slice]:
    """The slices of consecutive parts of ``sizes`` items each in their concatenation (no size: no part)."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).tolist()
    return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def node_parts(a: Mapping[str, np.ndarray]) -> dict[int, slice]:
    """Each node's slice of the concatenated per-row arrays (``sizes`` rows per node, in ``nodes`` order)."""
    return dict(zip(a["nodes"].tolist(), size_slices(a["sizes"])))


def answer(
    client: TableClient, owner: OwnerTrees, rows: np.ndarray, part: Mapping[int, slice], hists: Mapping[int, np.ndarray]
) -> tuple[Arrays, dict[str, Any]]:
    """The best split per node from its histogram (tpflower.trees.best_splits) and the side bit of each of the
    node's rows ``rows[part[n]]``; the proposals are kept for ``won``."""
    codes, layout, rule = owner.codes, owner.layout, client.settings.algorithm.rule
    nodes = list(part)
    if not nodes:
        return {"gain": np.zeros(0), "bits": np.packbits(np.zeros(0, dtype=bool))}, {}
    blocks, sets = owner.blocks, None
    if blocks:  # native categorical splits (tpflower.categorical)
        cat = client.settings.algorithm.categorical_rule
        gains, features, bins, missing_left, sets = categorical.best_native_splits(
            np.stack([hists[n] for n in nodes]), layout, blocks, rule, cat
        )
    else:
        gains, features, bins, missing_left = best_splits(np.stack([hists[n] for n in nodes]), layout, rule)
    bits = np.zeros(len(rows), dtype=bool)  # no split: every bit 0
    found = features >= 0
    for i in np.flatnonzero(found):
        at = part[nodes[i]]
        if sets is not None and sets[i] is not None:  # a category split: "the row's category is in the set"
            bits[at] = owner.category_sides(int(features[i]), sets[i], rows[at])
        else:
            f = features[i]
            code = codes[f].take(rows[at])
            bits[at] = code <= layout.offsets[f] + bins[i]
            if missing_left[i]:  # the feature's last bin: its missing values
                bits[at] |= code == layout.offsets[f + 1] - 1
    if found.any():  # the gain kept as its float64 bits in the int64 table (the owner's importance: model parts)
        gain_bits = gains[found].astype(np.float64).view(np.int64)
        proposals = np.stack(
            [np.array(nodes)[found], features[found], bins[found], gain_bits, missing_left[found]], axis=1
        )
        client.state.put("gbdt.proposals", np.concatenate([owner.table("proposals"), proposals]))
    if sets is not None:
        owner.propose_categories(np.array(nodes), sets)
    return {"gain": gains, "bits": np.packbits(bits)}, {}


def gbdt_split(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The table's best split per node and the side bit of each of the node's rows (module docstring)."""
    a = check_inputs(client, "gbdt_split", arrays)
    owner = OwnerTrees(client)
    owner.accept(a["won"])
    return answer(client, owner, a["rows"], node_parts(a), node_histograms(client, owner, a))


def gbdt_hist(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """A shard of a sharded table, first half of a step: its part of the histogram of each node but those of
    ``derive`` (the server's subtraction plan, checked by :func:`check_plan` against the nodes whose summed
    histograms the shard keeps), built from its rows; the server sums the shards' parts. A shard that lost a
    parent's summed histogram from its memory (a restarted node) builds every node's part, as the server then
    sends it every node's sum. The step's nodes and rows are kept for ``gbdt_shard_split``."""
    owner = OwnerTrees(client)
    a = check_inputs(client, "gbdt_hist", arrays, set(summed_ids(client).tolist()))
    owner.accept(a["won"])
    summed = new_round(client, owner, a, "summed")
    if (a["parent"] < 0).any():
        client.state.put("gbdt.summed_ids", np.zeros(0, dtype=np.int64))
    derive = np.isin(a["nodes"], a["derive"])
    if not all(q in summed for q in a["parent"][derive].tolist()):  # kept by the protocol, lost by this process
        derive[:] = False
    hist = built_histograms(owner, a, np.flatnonzero(~derive).tolist())
    client.state.put("gbdt.pending_rows", a["rows"])  # in the node's state: the next message may reach another
    pending = np.stack([a["nodes"], a["sizes"], a["parent"], derive.astype(np.int64)])  # worker (Flower's)
    client.state.put("gbdt.pending_nodes", pending)
    # its non-empty bins only (tpflower.trees.sparse_histograms) and the dense shape: (nodes answered, bins)
    return {**sparse_histograms(hist), "shape": np.array([len(hist), owner.layout.total], dtype=np.int64)}, {}


def summed_ids(client: TableClient) -> np.ndarray:
    """The nodes whose summed histograms a shard keeps, by the protocol (in the node's state; the histograms
    themselves are in its memory)."""
    ids = client.state.get("gbdt.summed_ids")
    return np.zeros(0, dtype=np.int64) if ids is None else ids


def summed_histograms(
    client: TableClient, owner: OwnerTrees, pending: np.ndarray, hist: np.ndarray
) -> dict[int, np.ndarray]:
    """Every node's summed histogram (node id -> (3, total)) from those the server sent (``hist``, the nodes
    built from rows, in step order): a derived node's is its kept summed parent's minus its sibling's, as the
    server's (docs/algorithms.md, Union). The step's summed histograms replace their parents' in the cache."""
    nodes, parents, derived = pending[0].tolist(), pending[2].tolist(), pending[3].astype(bool)
    summed: dict[int, np.ndarray] = owner.cache.setdefault("summed", {})
    out = dict(zip(pending[0][~derived].tolist(), hist))
    for i in np.flatnonzero(derived).tolist():
        q = parents[i]
        if q not in summed:  # there at gbdt_hist: this node's memory was lost in between
            raise _refuse(client, "gbdt_shard_split", "a derived node's parent's summed histogram is not kept")
        sibling = next(n for n, p in zip(nodes, parents) if p == q and n != nodes[i])
        out[nodes[i]] = summed[q] - out[sibling]
    for q in set(parents):
        summed.pop(q, None)
    summed.update(out)
    ids = np.union1d(np.setdiff1d(summed_ids(client), pending[2]), pending[0])
    client.state.put("gbdt.summed_ids", ids.astype(np.int64))
    return {n: out[n] for n in nodes}


def gbdt_shard_split(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """A shard of a sharded table, second half of a step: the summed histograms of the nodes built from rows
    (the server's sums of the shards' parts), the others derived (:func:`summed_histograms`); the table's best
    split per node (every shard finds the same) and the side bits of this shard's rows of the node."""
    a = check_inputs(client, "gbdt_shard_split", arrays)
    owner = OwnerTrees(client)
    rows, pending = client.state.get("gbdt.pending_rows"), client.state.get("gbdt.pending_nodes")
    if rows is None or pending is None or not len(pending):
        raise _refuse(client, "gbdt_shard_split", "no histogram step before it")
    client.state.put("gbdt.pending_nodes", np.zeros((0, 0), dtype=np.int64))  # answered once
    part = node_parts({"nodes": pending[0], "sizes": pending[1]})
    if list(part) != a["nodes"].tolist():
        raise _refuse(client, "gbdt_shard_split", "its nodes are not those of the histogram step")
    sparse = [np.asarray(arrays[name]) for name in ("mask", "hist", "count")]
    built, total = int(len(part) - pending[3].sum()), owner.layout.total
    problem = sparse_problem(*sparse, built, total)  # the non-empty bins of one histogram per node built
    if problem:
        raise _refuse(client, "gbdt_shard_split", f"not one finite histogram per node built from rows: {problem}")
    hists = summed_histograms(client, owner, pending, dense_histograms(*sparse, built, total))
    roots = np.flatnonzero(pending[2] < 0)
    if len(roots):
        owner.learn_empty_missing(hists[int(pending[0][roots[0]])])
    return answer(client, owner, rows, part, hists)


def gbdt_route(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The side of each row ``rows`` at each of this table's splits ``splits`` (packed, row-major)."""
    a = check_inputs(client, "gbdt_route", arrays)
    owner = OwnerTrees(client)
    owner.accept(a["won"])
    splits = owner.table("splits")
    at = {int(n): i for i, n in enumerate(splits[:, 0])}
    if any(int(s) not in at for s in a["splits"]):
        raise _refuse(client, "gbdt_route", "splits names a split this table does not hold")
    chosen = splits[np.array([at[int(s)] for s in a["splits"]], dtype=np.int64)]
    return {"bits": route_bits(owner, chosen, a["rows"])}, {}


def route_bits(owner: OwnerTrees, chosen: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The side of each of ``rows`` at each split ``chosen`` (rows of the splits table), packed row-major:
    (len(rows), ceil(len(chosen) / 8)) bytes, as np.packbits(sides, axis=1). A row's side at every split on
    one feature depends only on its bin (its category for a category split), so per feature the packed sides
    of each bin are computed once and each row takes its bin's bytes: one gather per feature, not one
    comparison per (row, split)."""
    layout, width = owner.layout, len(chosen)
    out = np.zeros((len(rows), (width + 7) // 8), dtype=np.uint8)
    category = chosen[:, 2] < 0  # a category split (tpflower.categorical): feature = its block's first column
    for feature, by_category in sorted(set(zip(chosen[:, 1].tolist(), category.tolist()))):
        on = np.flatnonzero((chosen[:, 1] == feature) & (category == by_category))
        if by_category:  # per category (the last: none, right at every split) its side at each split
            block = owner.block(int(feature))
            sides = np.zeros((len(block) + 1, width), dtype=bool)
            for j in on:
                sides[:, j] = categorical.set_sides(block, owner.split_categories(int(chosen[j, 0])))
            at = owner.categories(int(feature)).take(rows)
        else:  # per bin of the feature its side at each split
            lo, hi = layout.offsets[feature], layout.offsets[feature + 1]
            sides = np.zeros((hi - lo, width), dtype=bool)
            sides[:, on] = np.arange(hi - lo)[:, None] <= chosen[on, 2][None, :]
            sides[-1, on] |= chosen[on, 4] > 0  # missing left: the feature's last bin, its missing values
            at = owner.codes[feature].take(rows) - lo
        out |= np.packbits(sides, axis=1)[at]
    return out


# the arrays each phase takes (tpflower.guard) and which replies are exact releases (computed from the table's
# bins on the server's per-row sums: a shard's rank sketch, gains and side bits, a shard's histograms)
_NODE_SUMS = ("nodes", "parent", "sizes", "rows", "G", "H", "C", "won")
BINS = Stage("gbdt_bins", {"gbdt_bins": Phase(gbdt_bins, inputs=takes("G"), exact=True)})
EDGES = Stage("gbdt_edges", {"gbdt_edges": Phase(gbdt_edges, sharded, inputs=takes("edges", "sizes"))})
TRAIN = {
    "gbdt_split": Phase(gbdt_split, unsharded, inputs=takes(*_NODE_SUMS), exact=True),
    # the server's subtraction plan: the nodes whose summed histograms come from their parent's (docs/algorithms.md)
    "gbdt_hist": Phase(gbdt_hist, sharded, inputs=takes(*_NODE_SUMS, "derive"), exact=True),
    # the server's sum of the table's shards' histograms, only right after this shard's own part (gbdt_hist)
    "gbdt_shard_split": Phase(
        gbdt_shard_split,
        sharded,
        inputs=takes("nodes", union={"mask": "gbdt_hist", "hist": "gbdt_hist", "count": "gbdt_hist"}),
        exact=True,
    ),
    "gbdt_route": Phase(gbdt_route, inputs=takes("rows", "splits", "won"), exact=True),
}
PROTOCOL = Protocol(setup.SETUP + (BINS, EDGES, Stage("train", {**TRAIN, **setup.EVALUATE}, calls=None)))


register(
    AlgorithmEntry(
        "gbdt",
        "gbdt",
        "join",
        "gbdt",
        "JoinGBDT",
        PROTOCOL,
        GBDTParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="histogram gradient boosting over the join: one round trip per expansion step",
        models=TREE_MODELS,
        why_models=WHY_TREE_MODELS,
    )
)
register(
    AlgorithmEntry(
        "ucq_gbdt",
        "gbdt",
        "ucq",
        "gbdt",
        "UnionGBDT",
        PROTOCOL,
        GBDTParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="histogram gradient boosting over the union: two round trips per step (shards' histograms summed)",
        models=TREE_MODELS,
        why_models=WHY_TREE_MODELS,
    )
)
