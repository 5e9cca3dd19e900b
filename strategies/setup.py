"""The server side of the setup rounds (:class:`JoinSetup`) and the LoJ operator's row bookkeeping over the
shards of a table (:class:`ShardRouter`).

Setup (TablePuppet Sec. 3.1.1): every client sends row ids and keyed digests of its join keys, the label
owner also its labels and test-split flags (a table of more than mapping.keys_chunk_rows rows in chunks, one
round each: :meth:`JoinSetup.gather_chunks`); the server checks the key kinds agree, joins the digests into
p_i, and splits the joined rows into train and test by the label-table row (and, for an algorithm that selects
its model on validation, the training rows into fit and validation rows: tpflower.validation). Tables with several shards then
merge their shards' preprocessing summaries into one rule (Sec. 4.4). VFL baselines finally send each client
its p_i once ("expand") and continue on the identity mapping over the N joined rows.

The keys message carries the run's privacy settings (tpflower.privacy). Label DP: the label owner (every
shard of the label table) sends randomized TRAINING labels only, and the server keeps, per label shard, the
test rows it will ask the label owner to score (:attr:`JoinSetup.evaluation_split`).

Row ownership (Sec. 3.2): the router, built from the row ids every shard sent in the keys round, knows which
shard of a table holds which of its rows. The LoJ operator works on whole tables (rows U_i of table i); the
router splits such a request into one per shard (in the shard's own row positions) and puts the shards'
replies back together in the order of U_i.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from strategies.epoch_checkpoints import Saved
from strategies.key_chunks import Signed, gather_chunks, reblind_chunks
from strategies.transport import ClientKey, Reply
from tpflower import privacy as dp
from tpflower.blind import point_digests
from tpflower.fedprep import ShardSummary, merge_summaries, quantile_bin_edges, sketch_columns_needed
from tpflower.losses import LabelScale, dp_label_divisor, label_scaling, output_dim
from tpflower.mapping import KeyProjection, TableMapping, build_mapping, index_dtype
from tpflower.records import numbered, unnumbered
from tpflower.relation import shard_rows, summary_line
from tpflower.schema import RelationalSpec, SpecError, validate_key_kinds
from tpflower.signing import node_name
from tpflower.validation import validation_mask

Send = Callable[..., dict[ClientKey, Reply]]

KEYS_CHUNK_ROWS = 1 << 22
"""Rows per message of a keys reply (mapping.keys_chunk_rows): a larger table sends its keys in chunks."""


def keys_chunk_rows(cfg: Any) -> int:
    """The run's ``mapping.keys_chunk_rows`` (default :data:`KEYS_CHUNK_ROWS`), a positive integer."""
    value = int((cfg.get("mapping") or {}).get("keys_chunk_rows") or KEYS_CHUNK_ROWS)
    if value < 1:
        raise ValueError(f"mapping.keys_chunk_rows must be a positive number of rows, got {value}")
    return value


def key_mode(replies: Mapping[ClientKey, Reply]) -> str:
    """How the owners mapped their join keys (each node's own choice, reported in its keys reply): hmac or
    blind; owners that disagree stop the run here, naming the tables of each mode. The nodes that must hold
    one secret must do so too (:func:`check_secrets`)."""
    modes: dict[str, set[str]] = {}
    for (table, _), (_, metrics) in replies.items():
        modes.setdefault("blind" if metrics.get("blind_keys") else "hmac", set()).add(table)
    if len(modes) > 1:
        named = "; ".join(f"{', '.join(sorted(t))} by {m}" for m, t in sorted(modes.items()))
        raise ValueError(f"the table owners map their join keys differently ({named}): set one `keys` on every node")
    mode = next(iter(modes), "hmac")
    check_secrets(replies, mode)
    return mode


def check_secrets(replies: Mapping[ClientKey, Reply], mode: str) -> None:
    """Under keys=hmac every node holds the owners' join-key secret (a node with another one would join none of
    its rows); under keys=blind the shards of a table hold their owner's secret for its preprocessing (else
    each shard would code the same category, and draw the initial model, differently). Each keys reply
    carries its secret's keyed check value (tpflower.phases.setup.secret_check); nodes whose values differ stop
    the run here, named by the secret they share."""
    groups: dict[str, dict[str, list[str]]] = {}  # nodes that must agree -> check value -> nodes
    for (table, shard), (_, metrics) in sorted(replies.items()):
        group = groups.setdefault("" if mode == "hmac" else table, {})
        group.setdefault(str(metrics.get("secret_check", "")), []).append(f"{table!r} shard {shard}")
    for scope, values in sorted(groups.items()):
        if len(values) > 1:
            held = "; ".join(
                f"{', '.join(nodes)} {'no secret' if not value else f'secret {n + 1}'}"
                for n, (value, nodes) in enumerate(sorted(values.items(), key=lambda kv: kv[1]))
            )
            who = (
                "the nodes do not all hold the owners' join-key"
                if mode == "hmac"
                else f"table {scope!r}'s shards do not hold one"
            )
            raise ValueError(
                f"{who} secret (secret_file, else $TPFLOWER_KEY_SECRET): {held}; give them the same secret"
            )


class RecordOpener(Protocol):
    """What the keys round opens of the run record (strategies.evaluation.RunRecord)."""

    t0: float
    comm: Any

    def open(
        self,
        cfg: Any,
        algorithm: str,
        spec: RelationalSpec,
        mapping: TableMapping,
        regions: Mapping[ClientKey, str],
        y_train: np.ndarray,
        shard_rows: Mapping[str, list[int]] | None = None,
    ) -> None: ...

    def reference_text(self) -> str: ...


class JoinSetup(Saved):
    """What the setup rounds build: the mapping, its train/test partition, the shard routers, each client's
    row count, the labels the server holds, the label scale, the prediction width and the feature-DP plan.

    ``send``: the strategy's round; ``clients``: the run's client keys (table, shard)."""

    SAVED = (
        "mapping",
        "train",
        "valid",
        "evaluated",
        "test",
        "routers",
        "client_rows",
        "y_train",
        "y_test",
        "y_valid",
        "label_scale",
        "label_scaling",
        "evaluation_split",
        "d_out",
        "dp_plan",
    )  # what a checkpoint keeps (checkpoint-setup.pkl)

    def __init__(
        self,
        send: Send,
        spec: RelationalSpec,
        cfg: Any,
        clients: list[ClientKey],
        privacy: Mapping[str, Any],
        log: Callable[[str], None] = print,
        validation: float = 0.0,
    ):
        self.send, self.spec, self.cfg, self.clients, self.privacy, self.log = send, spec, cfg, clients, privacy, log
        self.validation = validation  # the share of the training join's labelled rows held out (tpflower.validation)
        self.task = spec.label.task
        self.label_dp = dp.uses_label_dp(privacy)
        self.mapping: TableMapping | None = None
        self.train: TableMapping | None = None
        self.test: TableMapping | None = None
        self.valid: TableMapping | None = None  # the validation rows (none without a validation part)
        self.evaluated: TableMapping | None = None  # the rows evaluated at every evaluation: validation, then test
        self.routers: dict[str, ShardRouter] = {}
        self.client_rows: dict[ClientKey, int] = {}  # each client's row count: replies are checked against it
        self.y_train: np.ndarray | None = None
        self.y_test: np.ndarray | None = None
        self.y_valid: np.ndarray | None = None  # the validation rows' labels as training sees them
        self.label_scale = LabelScale()  # fitted on the training labels the server holds
        self.label_scaling: dict[str, Any] = {}  # how: results.json's label_scale (divide_label)
        self.evaluation_split: dict[ClientKey, tuple[np.ndarray, np.ndarray]] = {}  # label DP (see evaluation)
        self.d_out: int | None = None  # the prediction width
        self.dp_plan: dict[ClientKey, tuple[int, float]] = {}  # feature DP: (local DP steps of the run, q)

    def run(
        self,
        run_id: str,
        record: RecordOpener,
        algorithm: str,
        plan_feature_dp: Callable[[], dict[ClientKey, tuple[int, float]]] | None = None,
        expand: bool = False,
        parameter_noise: Callable[[dict[ClientKey, tuple[int, float]]], float] | None = None,
    ) -> None:
        """Round 1 (keys) builds the mapping, the partition and the labels and opens ``record``; then the
        feature-DP plan (``plan_feature_dp``, on the table-row mapping) and the label's DP divisor from it
        (``parameter_noise``: the std the plan's DP noise adds to a parameter; :func:`dp_label_divisor`), the
        federated preprocessing rounds and, for a VFL baseline (``expand``), round ``expand``."""
        message = {"phase": "keys", "run_id": run_id, "chunk_rows": keys_chunk_rows(self.cfg)}
        replies = self.send({k: ({}, {**message, **dp.privacy_message(self.privacy)}) for k in self.clients})
        self.gather_chunks(replies)
        if key_mode(replies) == "blind":
            self.blind_rounds(replies)
        record.t0 = time.perf_counter()
        y_train = self.build(replies)
        regions = {k: str(r[1]["region"]) for k, r in replies.items()}
        assert self.mapping is not None
        shards = shard_rows(self.client_rows)  # (the server holds each shard's row ids: no new release)
        record.open(self.cfg, algorithm, self.spec, self.mapping, regions, y_train, shards)
        del y_train  # the raw training labels: only the reference needs them
        assert record.comm is not None
        summary = summary_line(self.spec, self.mapping, shards)
        self.log(" | ".join(p for p in (summary, record.reference_text(), record.comm.wan.note) if p))
        if plan_feature_dp is not None:  # on the table-row mapping, before a VFL expansion
            self.dp_plan = plan_feature_dp()
            check_dp_plan(self.privacy, self.dp_plan)  # once here, not once per node at its first DP step
            self.log(dp_plan_line(self.privacy, self.dp_plan))
        self.divide_label(parameter_noise)
        self.federated_preprocessing()
        if expand:
            self.expand()

    def divide_label(self, parameter_noise: Callable[[dict[ClientKey, tuple[int, float]]], float] | None) -> None:
        """standardize_label=auto under feature DP (label scaling ``dp``): the centred training and validation
        labels divided by :func:`dp_label_divisor` of the training labels' std and ``parameter_noise`` of the
        DP plan (noise 0 without one: the target std's floor); :attr:`label_scaling` records it for results.json."""
        scaling = label_scaling(self.cfg)
        if self.task != "regression":
            return
        self.label_scaling = {"scaling": scaling, "mean": self.label_scale.mean, "divisor": self.label_scale.std}
        if scaling != "dp":
            return
        assert self.y_train is not None and self.y_valid is not None
        s = float(np.std(np.asarray(self.y_train, dtype=np.float64))) if len(self.y_train) else 0.0
        noise = float(parameter_noise(self.dp_plan)) if parameter_noise is not None and self.dp_plan else 0.0
        c = dp_label_divisor(s, noise)
        self.label_scaling.update(label_std=s, parameter_noise=noise, target_std=s / c, divisor=c)
        if c == 1.0:
            return
        self.label_scale = self.label_scale.divided(c)
        self.y_train = self.state_labels(np.asarray(self.y_train, dtype=np.float64) / c)
        self.y_valid = self.state_labels(np.asarray(self.y_valid, dtype=np.float64) / c)

    def gather_chunks(self, replies: Mapping[ClientKey, Reply]) -> None:
        """Keys replies in chunks: the later chunks gathered and bounded (strategies.key_chunks)."""
        gather_chunks(self.send, replies, keys_chunk_rows(self.cfg))

    def blind_rounds(self, replies: Mapping[ClientKey, Reply]) -> None:
        """keys=blind (docs/algorithms.md, Blinded keys): route every client's blinded key values of a join to
        the other clients of that join's tables, one hop per round (lists in chunks of mapping.keys_chunk_rows
        values, one round each: strategies.key_chunks.reblind_chunks), until each list is blinded by all of them;
        then put the digests of the fully blinded values (``digest.<join>``, one per value, the rows' codes
        point into them) in place of the lists, as in keys=hmac."""
        current: dict[tuple[ClientKey, int], np.ndarray] = {}
        provenance: dict[tuple[ClientKey, int], Signed] = {}  # each list's origin, last signer, its signatures
        members: dict[int, list[ClientKey]] = {}
        for k, j in enumerate(self.spec.joins):
            members[k] = sorted(c for c in replies if c[0] in (j.left, j.right))
            for c in members[k]:
                current[(c, k)] = replies[c][0].pop(f"blind.{k}")
                sigs = str(replies[c][1].get(f"sig.{k}", ""))
                provenance[(c, k)] = Signed(node_name(*c), node_name(*c), sigs.split(",") if sigs else [])
        for hop in range(1, max(len(m) for m in members.values())):
            messages: dict[ClientKey, dict[str, np.ndarray]] = {}
            signed: dict[ClientKey, dict[str, Signed]] = {}
            for k, m in members.items():
                for i, origin in enumerate(m[:] if hop < len(m) else []):
                    to = m[(i + hop) % len(m)]
                    messages.setdefault(to, {})[f"pts.{k}.{i}"] = current[(origin, k)]
                    signed.setdefault(to, {})[f"pts.{k}.{i}"] = provenance[(origin, k)]
            back, sigs = reblind_chunks(self.send, messages, keys_chunk_rows(self.cfg), signed)
            for c, arrays in back.items():
                for name, points in arrays.items():
                    _, k, i = name.split(".")
                    origin = members[int(k)][int(i)]
                    current[(origin, int(k))] = points
                    provenance[(origin, int(k))] = Signed(node_name(*origin), node_name(*c), sigs[c][name])
        for (c, k), points in current.items():
            replies[c][0][f"digest.{k}"] = point_digests(points)

    def build(self, replies: Mapping[ClientKey, Reply]) -> np.ndarray:
        """The mapping, routers, partition and labels from the keys round's replies; returns the raw training
        labels (label units, for the reference)."""
        validate_key_kinds(self.spec, self._key_kinds(replies))
        projections: dict[str, list[KeyProjection]] = {t: [] for t in self.spec.table_names}
        for (table, _shard), (arrays, _) in replies.items():
            joins = [k for k, j in enumerate(self.spec.joins) if table in (j.left, j.right)]
            projections[table].append(
                KeyProjection(
                    table,
                    np.asarray(arrays["row_ids"]),
                    {k: arrays[f"code.{k}"] for k in joins},
                    {k: arrays[f"digest.{k}"] for k in joins},
                )
            )
        mapping = build_mapping(self.spec, projections)
        self.routers = {
            t: ShardRouter(
                {q: np.asarray(r[0]["row_ids"]) for (tt, q), r in replies.items() if tt == t},
                mapping.n_rows[t],
            )
            for t in self.spec.table_names
        }
        self.client_rows = {k: len(r[0]["row_ids"]) for k, r in replies.items()}
        for r in replies.values():  # codes and digests have served their purpose: free them before N-sized state
            for name in [n for n in r[0] if n.startswith(("digest.", "code."))]:
                del r[0][name]
        label = self.spec.label_table
        y_rows, is_test_rows, n_classes = self._labels(replies, mapping.n_rows[label])
        # train, validation and test are views of the mapping, reordered in place: the training rows the model
        # fits first, then the validation rows (whole labelled rows of the training split), then the test rows
        group = is_test_rows[mapping.p[label]].view(np.uint8)  # 1: test, then 2 (in place: N bytes in all)
        group *= 2
        if self.validation > 0:
            fit = group == 0
            group[fit] = validation_mask(mapping.p[label][fit], self.validation, int(self.cfg.seed))
        self.train, self.valid, self.test = mapping.groups(group, 3)
        del group
        for part, rows in (("test", self.test.N), ("training", self.train.N)):
            if not rows:  # a split of a few labelled rows: stop before any model is trained on it
                fraction = self.spec.split.test_fraction
                raise SpecError(
                    f"the {part} split holds no joined row (split.test_fraction={fraction:g} of "
                    f"{mapping.n_rows[label]:,} labelled rows); {'raise' if part == 'test' else 'lower'} it"
                )
        self.evaluated = mapping.rows(self.train.N, mapping.N)
        y_train = y_rows[self.train.p[label]]
        # regression: training sees the label standardized on the training rows (after label DP, which the
        # label owner applied to the raw label); predictions go back to the label's units before any metric
        self.label_scale = LabelScale.fit(self.task, y_train, label_scaling(self.cfg))
        self.y_train = self.state_labels(self.label_scale.scaled(y_train))
        # label DP: the server holds the randomized training labels only; the label owner evaluates the test rows
        self.y_test = None if self.label_dp else y_rows[self.test.p[label]]
        self.y_valid = self.state_labels(self.label_scale.scaled(y_rows[self.valid.p[label]]))
        self.evaluation_split = self._evaluation_split() if self.label_dp else {}
        self.d_out = output_dim(self.task, n_classes)
        self.mapping = mapping
        return y_train

    @property
    def state_dtype(self) -> np.dtype:
        """The dtype of the server's per-joined-row float state: float32 in a float32 run, else float64."""
        return np.dtype(np.float32 if str(self.cfg.get("precision", "float64")) == "float32" else np.float64)

    def state_labels(self, y: np.ndarray) -> np.ndarray:
        """The training labels as the server keeps them: regression/binary labels in :attr:`state_dtype`
        (float32 in a float32 run), class ids as int32."""
        if self.task == "multiclass":
            return np.asarray(y).astype(np.int32, copy=False)
        return np.asarray(y).astype(self.state_dtype, copy=False)

    def _labels(
        self, replies: Mapping[ClientKey, Reply], n_label_rows: int
    ) -> tuple[np.ndarray, np.ndarray, int | None]:
        """Labels and test flags over the label table's rows, from every shard of the label table."""
        y_rows: np.ndarray | None = None
        is_test = np.zeros(n_label_rows, dtype=bool)
        n_classes = 0
        digests = {str(m["classes_digest"]) for (t, _), (_, m) in replies.items() if "classes_digest" in m}
        if len(digests) > 1:  # keyed by the owners' secret: the server learns only that the lists differ
            raise RuntimeError(
                f"label table {self.spec.label_table!r}: its shards' files hold different classes of the label, so "
                "their class ids would disagree; list the classes in the dataset spec's label.classes"
            )
        for (t, q), (arrays, reply_metrics) in replies.items():
            if t != self.spec.label_table:
                continue
            ids, y, flags = np.asarray(arrays["row_ids"]), arrays["y"], arrays["is_test"].astype(bool)
            randomized = reply_metrics.get("labels") == "train_randomized"
            if randomized != self.label_dp:
                raise RuntimeError(
                    f"label table {t!r} shard {q}: privacy={self.privacy.get('name')} but the label owner sent "
                    f"{'randomized training labels' if randomized else 'its raw labels'}"
                )
            if not randomized and len(ids) == n_label_rows == len(y) and self.routers[t].whole:
                return y, flags, max(n_classes, int(reply_metrics.get("n_classes", 0))) or None  # rows in order
            if y_rows is None:
                y_rows = np.zeros(n_label_rows, dtype=y.dtype)
            if randomized:  # training rows only, in the order of the shard's rows; test labels stay with it
                y_rows[ids[~flags]] = y
                is_test[ids] = flags
            else:
                y_rows[ids], is_test[ids] = y, flags
            shard_classes = int(reply_metrics.get("n_classes", 0))
            if n_classes and shard_classes != n_classes:  # class ids of different class lists: they would disagree
                raise RuntimeError(
                    f"label table {t!r}: its shards know {n_classes} and {shard_classes} classes of a multiclass "
                    "label, so their class ids disagree; list the classes in the dataset spec's label.classes"
                )
            n_classes = max(n_classes, shard_classes)
        assert y_rows is not None
        return y_rows, is_test, n_classes or None

    def _key_kinds(self, replies: Mapping[ClientKey, Reply]) -> dict[str, dict[str, str]]:
        kinds: dict[str, dict[str, str]] = {}
        for (table, _), (_, m) in replies.items():
            pairs = [kv.split("=", 1) for kv in str(m.get("key_kinds", "")).split(",") if kv]
            kinds.setdefault(table, {}).update(dict(pairs))
        return kinds

    def _evaluation_split(self) -> dict[ClientKey, tuple[np.ndarray, np.ndarray]]:
        """Label DP: per label-table shard, (indices into the test joined rows, positions of their label rows
        in the shard), ordered by the shard's rows: what the label owner needs to score the test predictions."""
        assert self.test is not None
        label = self.spec.label_table
        rows = self.test.p[label]  # label-table row of every test joined row (before any VFL expansion)
        router = self.routers[label]
        split = {}
        for q in router.shards:
            idx = np.flatnonzero(router.shard_of[rows] == q)
            pos = router.position[rows[idx]]
            order = np.argsort(pos, kind="stable")
            split[(label, q)] = (idx[order], pos[order])
        return split

    def federated_preprocessing(self) -> None:
        """Sec. 4.4: tables with several shards merge their shards' summaries into one global rule.

        Round 1 asks for summaries without order statistics; round 2 (only when needed) asks for the sketches
        of the columns that need them (a missing fit value somewhere, or binned), so no other column's
        values (min/max and order statistics) leave the shards. Both rounds name the table's feature columns
        (``columns``, spec order): the clients refuse a request without that exact list.
        """
        sharded = [t for t in self.spec.table_names if len(self.routers[t].shards) > 1]
        if not sharded:
            return
        columns = {t: ",".join([*self.spec.table(t).numeric, *self.spec.table(t).categorical]) for t in sharded}
        replies = self.send(
            {
                k: ({}, {"phase": "stats", "columns": columns[k[0]], "sketch": ""})
                for k in self.clients
                if k[0] in sharded
            }
        )
        summaries = self._summaries(replies)
        wanted = {t: sketch_columns_needed(summaries[t], [c for c, _ in self.spec.table(t).binned]) for t in sharded}
        if any(wanted.values()):
            again = self.send(
                {
                    k: ({}, {"phase": "stats", "columns": columns[k[0]], "sketch": ",".join(wanted[k[0]])})
                    for k in self.clients
                    if wanted.get(k[0])
                }
            )
            summaries.update(self._summaries(again))
        messages = {}
        for t in sharded:
            spec_t = self.spec.table(t)
            merged = merge_summaries(summaries[t])
            # the binned columns' quantile edges come from the merged sketch, which stays on the server
            edges = [quantile_bin_edges(merged, col, bins) for col, bins in spec_t.binned]
            rule = merged.arrays(with_sketch=False) + edges
            rule_id = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in rule)).hexdigest()[:16]
            messages.update(
                {k: (numbered("rule", rule), {"phase": "rule", "rule_id": rule_id}) for k in self.clients if k[0] == t}
            )
        self.send(messages)

    def _summaries(self, replies: Mapping[ClientKey, Reply]) -> dict[str, list[ShardSummary]]:
        """The decoded preprocessing summaries of each table's shards, in shard order."""
        out: dict[str, list[ShardSummary]] = {}
        for (t, _), (arrays, _) in sorted(replies.items()):
            spec_t = self.spec.table(t)
            out.setdefault(t, []).append(
                ShardSummary.from_arrays(unnumbered(arrays, "summary"), spec_t.numeric, spec_t.categorical)
            )
        return out

    def expand(self) -> None:
        """VFL: send p_i over all joined rows (train, validation, then test); continue on the identity mapping."""
        assert self.mapping is not None and self.train is not None and self.test is not None
        assert self.valid is not None
        N_train, N_valid = self.train.N, self.valid.N
        order = self.mapping.p  # train rows, validation rows, then test rows (setup's partition)
        self.send({k: ({"p": order[k[0]]}, {"phase": "expand"}) for k in self.clients})
        n_all = self.mapping.N
        self.client_rows = {k: n_all for k in self.clients}
        ids = np.arange(n_all, dtype=index_dtype(n_all))
        identity = TableMapping({t: ids for t in order}, {t: n_all for t in order})
        self.train, self.valid = identity.rows(0, N_train), identity.rows(N_train, N_train + N_valid)
        self.test, self.evaluated = identity.rows(N_train + N_valid, n_all), identity.rows(N_train, n_all)


class ShardRouter:
    """Row ownership of one table: shard_of[u] and position[u] (row u's position within its shard).

    A table sent whole by one client, rows in order (the join scenario), needs neither: its router maps every
    row to itself, and builds shard_of and position only when asked for them."""

    def __init__(self, row_ids_by_shard: Mapping[int, np.ndarray], n_rows: int):
        self.shards = sorted(row_ids_by_shard)
        self.n_rows = int(n_rows)
        width = index_dtype(n_rows)  # int32 below 2^31 rows: 4 bytes per row, whatever the reply's integer type
        ids = {q: np.asarray(a).astype(width, copy=False) for q, a in row_ids_by_shard.items()}
        only = ids[self.shards[0]] if len(self.shards) == 1 else None
        self.whole = only is not None and len(only) == self.n_rows and _is_range(only)
        self._ids = None if self.whole else ids  # a whole table's are 0..n-1: made when asked for
        self._shard_of: np.ndarray | None = None
        self._position: np.ndarray | None = None
        if not self.whole:
            self._build()

    @property
    def ids(self) -> dict[int, np.ndarray]:
        """Each shard's global row ids, in shard order."""
        if self._ids is None:
            return {self.shards[0]: np.arange(self.n_rows, dtype=index_dtype(self.n_rows))}
        return self._ids

    def _build(self) -> None:
        self._shard_of = np.full(self.n_rows, -1, dtype=np.int32)
        self._position = np.full(self.n_rows, -1, dtype=index_dtype(self.n_rows))
        for q, ids in self.ids.items():
            self._shard_of[ids] = q
            self._position[ids] = np.arange(len(ids))

    @property
    def shard_of(self) -> np.ndarray:
        if self._shard_of is None:
            self._build()
        assert self._shard_of is not None
        return self._shard_of

    @property
    def position(self) -> np.ndarray:
        if self._position is None:
            self._build()
        assert self._position is not None
        return self._position

    def split(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Table rows -> {shard: positions of those rows within the shard}, in the order of ``rows``."""
        if self.whole:
            return {self.shards[0]: np.asarray(rows)}
        owner = self.shard_of[rows]
        return {q: self.position[rows[owner == q]] for q in self.shards}

    def masks(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        if self.whole:
            return {self.shards[0]: np.ones(len(rows), dtype=bool)}
        owner = self.shard_of[rows]
        return {q: owner == q for q in self.shards}

    def scatter_all(self, values: np.ndarray) -> dict[int, np.ndarray]:
        """A per-row array of the whole table, cut into each shard's rows (in shard order)."""
        if self.whole:
            return {self.shards[0]: values}
        return {q: values[ids] for q, ids in self.ids.items()}

    def gather_all(self, parts: Mapping[int, np.ndarray]) -> np.ndarray:
        """Each shard's per-row reply (in shard order) put back over the whole table."""
        if self.whole:
            return parts[self.shards[0]]
        first = next(iter(parts.values()))
        out = np.empty((self.n_rows,) + first.shape[1:], dtype=first.dtype)
        for q, ids in self.ids.items():
            out[ids] = parts[q]
        return out

    def gather(self, rows: np.ndarray, parts: Mapping[int, np.ndarray]) -> np.ndarray:
        """The shards' replies for ``split(rows)`` put back in the order of ``rows``."""
        if self.whole:
            return parts[self.shards[0]]
        first = next(iter(parts.values()))
        out = np.empty((len(rows),) + first.shape[1:], dtype=first.dtype)
        for q, mask in self.masks(rows).items():
            out[mask] = parts[q]
        return out


def _is_range(ids: np.ndarray) -> bool:
    """Whether ``ids`` is 0, 1, ..., len - 1 (checked in chunks: no N-sized temporary)."""
    step = 1 << 20
    for start in range(0, len(ids), step):
        part = ids[start : start + step]
        if not np.array_equal(part, np.arange(start, start + len(part), dtype=part.dtype)):
            return False
    return True


def dp_plan_line(privacy: Mapping[str, Any], plan: Mapping[ClientKey, tuple[int, float]]) -> str:
    """The feature-DP plan in one line: per (steps, sample rate), the tables (shards) that take it and the noise
    multiplier sigma each calibrates for it at the run's epsilon and delta (as the nodes do:
    tpflower.local_dp; a node observing a higher sample rate than the plan's calibrates more noise)."""
    epsilon, delta = float(privacy["epsilon"]), float(privacy["delta"])
    groups: dict[tuple[int, float], list[str]] = {}
    sharded = {t for t, shard in plan if shard > 0}
    for (table, shard), (steps, q) in sorted(plan.items()):
        groups.setdefault((int(steps), float(q)), []).append(f"{table}/{shard}" if table in sharded else table)
    parts = [
        f"{', '.join(names)}: {steps:,} DP steps at sample rate {q:.3g}, sigma "
        + (f"{dp.noise_multiplier_for(epsilon, delta, min(max(q, 1e-12), 1.0), steps):.3g}" if steps >= 1 else "-")
        for (steps, q), names in sorted(groups.items(), key=lambda g: g[1])
    ]
    return f"feature DP (epsilon {epsilon:g} per table at delta {delta:g}, clip {privacy.get('clip')}): " + " | ".join(
        parts
    )


def check_dp_plan(privacy: Mapping[str, Any], plan: Mapping[ClientKey, tuple[int, float]]) -> None:
    """Refuse, in one line before any DP step, a feature-DP plan whose (steps, sample rate) of some client no
    noise Opacus searches covers at the run's ``privacy.epsilon`` and ``delta`` (each node would refuse the
    same at its setup; tpflower.privacy.accounting.plan_problem), the highest sample rate first."""
    epsilon, delta = float(privacy["epsilon"]), float(privacy["delta"])
    for steps, q in sorted(set(plan.values()), key=lambda p: (-p[1], -p[0])):
        problem = dp.plan_problem(epsilon, delta, float(q), int(steps))
        if problem is not None:
            raise ValueError(f"privacy={privacy.get('name')}: {problem}")
