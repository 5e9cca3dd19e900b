"""The base of every tpflower strategy: a Flower strategy (flwr.serverapp.strategy.Strategy) whose
:meth:`start` runs the algorithm's protocol, plain code over :meth:`send`.

A TablePuppet algorithm is a sequence of gather/scatter rounds whose number depends on the data (N / B
batches per epoch for SGD), with a different payload for every client; Flower's default start() loop (a fixed
number of configure_train / aggregate_train rounds with one global model) does not fit it. So start() runs
:meth:`protocol`, and every ``send(messages, kind)`` is one round: its per-client payloads become Flower
messages (:meth:`round_messages`), the transport delivers them, and the replies become payloads again
(:meth:`read_replies`), raising on an error reply. (Why the Strategy API's configure_* methods are not the
way in: see the note above them.)

The relational strategies share :class:`LoJStrategy`: a protocol runner over the transport that USES a
:class:`~strategies.setup.JoinSetup` (the setup rounds and what they build), a
:class:`~strategies.evaluation.RunRecord` (test evaluation, results, meters), a
:class:`~strategies.selection.ModelSelection` (the validation part and the kept model) and, when it
checkpoints its epochs, a :class:`~strategies.epoch_checkpoints.EpochCheckpoints`.

Client keys are (table, shard). Before the protocol, :meth:`connect` asks every node which table and shard
it holds. The same object runs under Flower (:class:`~strategies.transport.GridTransport`) and in-process
(:class:`~strategies.transport.DirectTransport`), so the framework's overhead is measured on identical code.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from strategies.epoch_checkpoints import NO_CHECKPOINTS, EpochCheckpoints, NoCheckpoints
from strategies.evaluation import RunRecord
from strategies.model_record import model_record, write_model_record
from strategies.replies import DIVERGED, check_round
from strategies.selection import ModelSelection
from strategies.setup import JoinSetup
from strategies.transport import MESSAGE_TYPE, ClientKey, GridTransport, Kind, Payload, Reply, RunError, Transport
from tpflower import privacy as dp
from tpflower.checkpoint import CHECKPOINT
from tpflower.losses import LabelScale, primary_metric
from tpflower.params import AlgorithmParams, run_settings
from tpflower.phases.join_sgd import SGDParams
from tpflower.records import HELLO_PHASE, error_reason, pack_payload, record_bytes, unpack_reply
from tpflower.reference import below_constant, loss_grew, loss_rose
from tpflower.registry import by_name, entries
from tpflower.schema import RelationalSpec
from tpflower.validation import SELECTION_FRACTION, validation_fraction_of


def _predicate(name: str, reason: str, table: str | None = None) -> str:
    """What a node's error ``reason`` says of its subject, with its separator (``": no rows"``,
    ``" (gbdt_bins) refuses ..."``): the reason less a leading node name, or less the node's table's name
    (``table 'f' (gbdt_bins) refuses ...`` from the node ``table 'f' shard 0``), so that a line naming the node
    before it names it once."""
    for subject in (name, f"table {table!r}" if table is not None else None):
        if subject is not None and reason.startswith(subject) and reason[len(subject) : len(subject) + 1] in (":", " "):
            return reason[len(subject) :]
    return f": {reason}"


def node_line(name: str, reason: str, table: str | None = None) -> str:
    """A node's error as one line starting with the node's name, which names it once (a reason may start with
    the node's name or its table's: :func:`_predicate`)."""
    return name + _predicate(name, reason, table)


def merged_lines(failed: Iterable[tuple[str, ClientKey | None, str]]) -> list[str]:
    """The error lines of a round, (node name, client key, reason) each: the shards of one table that refuse
    alike (the same reason but for a final ``(detail)``, the shard's own numbers) make one line naming the
    shards, each shard's detail in its parentheses, so a union's refusal is said once, not once per shard."""
    groups: dict[tuple[str, str], list[tuple[int, str, str]]] = {}
    lines = []
    for name, key, reason in failed:
        if key is None:
            lines.append(node_line(name, reason))
            continue
        said = _predicate(name, reason, key[0])
        match = re.fullmatch(r"(.*) \(([^()]*)\)", said)
        base, detail = (match.group(1), match.group(2)) if match else (said, "")
        groups.setdefault((key[0], base), []).append((key[1], detail, name + said))
    for (table, base), shards in groups.items():
        shards.sort()
        if len(shards) == 1:  # the node's own line
            lines.append(shards[0][2])
            continue
        alike = {d for _, d, _ in shards}
        details = alike.pop() if len(alike) == 1 else "; ".join(f"shard {q}: {d}" for q, d, _ in shards if d)
        names = ", ".join(str(q) for q, _, _ in shards)
        lines.append(f"table {table!r} shards {names}{base}" + (f" ({details})" if details else ""))
    return sorted(lines)


class TablePuppetStrategy(Strategy):
    """Flower plumbing around a protocol: node discovery, one round per :meth:`send`, byte accounting."""

    WAIT_LINE_S = 10.0  # while nodes are missing at the start, a line this often
    SETTLE_S = 2.0  # a transport whose nodes come at once (the simulation engine's): its node list is final after
    # a node the SuperLink answered 'Node Unavailable' for at the hello (its SuperNode died, its session not yet
    # expired): greeted again after this long, should it (or its owner's restarted node, same key) be listed
    GONE_RETRY_S = 5.0
    client_rows: Mapping[ClientKey, int] = {}  # each client's row count, once known: replies are checked against it
    d_out: int | None = None  # the prediction width, once known
    # under Flower's simulation engine: when the engine was asked to start (the start-up stages get a line each)
    engine_t0: float | None = None

    HEARTBEAT_S = 30.0  # a round trip this long after the last line prints one: a long epoch is not silent

    def __init__(self, clients: list[ClientKey], log: Callable[[str], None] = print):
        self.clients = clients
        self.print_line = log
        self.last_line = time.monotonic()
        self.transport: Transport | None = None
        self.nodes: dict[ClientKey, int] = {}
        self.keys: dict[int, ClientKey] = {}
        self._gone: dict[int, float] = {}  # node -> when its hello came back 'Node Unavailable'
        self.server_round = 0

    # ------------------------------------------------------------------------------------ to implement

    def protocol(self) -> None:  # pragma: no cover - abstract
        """The algorithm: setup, training and evaluation rounds, each a call of :meth:`send`."""
        raise NotImplementedError

    def on_round(self, kind: Kind, down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> None:
        """Called after every round with the payload bytes sent to (down) and received from (up) each client."""

    # ------------------------------------------------------------------------------------ running

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 0,
        timeout: float = 600.0,
        node_wait_s: float = 120.0,
        **_: object,
    ) -> Result:
        """Run the protocol over Flower's Grid (the ServerApp's main). Rounds are the protocol's, not num_rounds;
        ``timeout``: the longest wait for a round's replies; ``node_wait_s``: for the nodes to connect."""
        self.run(GridTransport(grid, timeout), node_wait_s)
        return Result()

    def run(self, transport: Transport, node_wait_s: float = 120.0) -> None:
        self.transport = transport
        transport.name = self.node_name
        self.connect(node_wait_s)
        self.protocol()

    def connect(self, wait_s: float = 120.0) -> None:
        """The explicit first step: ask every node that connects which table and shard it holds, until there
        is one node per client key; a line every 10 s names the tables still missing; after ``wait_s`` the
        run stops with one line naming them."""
        assert self.transport is not None
        start, said = time.monotonic(), 0.0
        seen, settled_at = set[int](), start  # the node list, since when it has not changed
        if self.engine_t0 is not None:
            self.log(
                f"engine: ServerApp up in {time.perf_counter() - self.engine_t0:.1f} s; waiting for "
                f"{len(self.clients)} nodes (Ray's actors import torch and tpflower)"
            )
        while True:
            ids = set(self.transport.node_ids())
            if ids != seen:
                seen, settled_at = ids, time.monotonic()
            now = time.monotonic()
            new = sorted(n for n in ids - set(self.keys) if now - self._gone.get(n, -1e9) >= self.GONE_RETRY_S)
            if new:  # its replies may wait for the engine to start (seconds), while more nodes register
                self._hello(new)
                continue  # so the node list is read again before it is judged settled
            missing = [k for k in self.clients if k not in self.nodes]
            waited = time.monotonic() - start
            if not missing:
                if self.engine_t0 is not None or waited >= 1.0:
                    self.log(f"nodes: {len(self.nodes)} of {len(self.clients)} connected in {waited:.1f} s")
                return
            names = ", ".join(f"table {t!r} shard {q}" for t, q in missing)
            if self.transport.nodes_fixed:  # Flower's simulation engine: its nodes are all it will have
                need = (
                    f"one SuperNode per table shard: `flwr run`'s simulation needs num-supernodes={len(self.clients)}"
                )
            else:  # a deployment: each owner starts its node, which may come later
                need = "one node per table shard: its owner starts it with `tpflower node --client-config OWNER.yaml`"
            if seen and self.transport.nodes_fixed and time.monotonic() - settled_at >= self.SETTLE_S:
                raise RunError(f"no node holds {names}: the simulation has {len(seen)} nodes; {need}")
            if waited > wait_s:
                raise RunError(
                    f"no node holds {names} ({len(self.nodes)} of {len(self.clients)} nodes connected "
                    f"within {wait_s:.0f} s; {need})"
                )
            if waited - said >= self.WAIT_LINE_S:
                said = waited
                self.log(f"waiting for nodes ({waited:.0f} of {wait_s:.0f} s): missing {names} ({need})")
            time.sleep(0.05)

    def _hello(self, ids: list[int]) -> None:
        """Ask nodes ``ids`` which table and shard they hold; a node refusing the run, a table claimed twice or
        one the run does not have stops the run."""
        assert self.transport is not None
        hello = [Message(pack_payload({}, {"phase": HELLO_PHASE}), node, "query") for node in ids]
        replies = self.transport.exchange(hello)
        gone = [r for r in replies if r.has_error() and r.error.code == ErrorCode.NODE_UNAVAILABLE]
        for reply in gone:  # a dead SuperNode the SuperLink still listed: not a refusal; its table is waited for
            node = reply.metadata.src_node_id
            if node not in self._gone:
                self.log(
                    f"node {node} did not answer the hello ({error_reason(reply)}): its SuperNode stopped; "
                    "waiting for the tables no node holds (a node started again joins the run)"
                )
            self._gone[node] = time.monotonic()
        replies = [r for r in replies if not any(r is g for g in gone)]
        errors = [f"node {r.metadata.src_node_id}: {error_reason(r)}" for r in replies if r.has_error()]
        if errors:  # every refusing node's line
            raise RunError("\n".join(sorted(errors)))
        for reply in replies:
            node = reply.metadata.src_node_id
            _, info = unpack_reply(reply.content)
            key = (str(info["table"]), int(info["shard"]))
            if key in self.nodes:
                raise RunError(f"two nodes ({self.nodes[key]} and {node}) both hold table {key[0]!r} shard {key[1]}")
            if key not in self.clients:
                raise RunError(f"node {node} holds table {key[0]!r} shard {key[1]}, which this run does not have")
            self.nodes[key], self.keys[node] = node, key

    def log(self, line: str) -> None:
        """Print one line of the run's output (and note when: :meth:`heartbeat`)."""
        self.last_line = time.monotonic()
        self.print_line(line)

    def heartbeat(self) -> str:
        """The line a long stretch of round trips without one prints (every HEARTBEAT_S)."""
        return f"still running: round trip {self.server_round:,}"

    @cached_property
    def diverged_hint(self) -> str:
        """The setting a reply of non-finite model outputs names (the generic hint; a training run may name its
        own). Read once per run: every round's check takes it."""
        return DIVERGED

    def node_name(self, node: int) -> str:
        key = self.keys.get(node)
        return f"node {node}" if key is None else f"table {key[0]!r} shard {key[1]}"

    def send(self, messages: Mapping[ClientKey, Payload], kind: Kind = "train") -> dict[ClientKey, Reply]:
        """One round: a message per client key, every reply back (kind: train | inner | eval)."""
        assert self.transport is not None, "send() before run()"
        self.server_round += 1
        out, down = self.round_messages(messages, kind)
        try:
            replies, up = self.read_replies(self.transport.exchange(out))
        except RunError as exc:  # the handlers' own tracebacks, where this process ran them: in the run's log file
            for failure in self.transport.failures():
                exc.add_note(failure)
            raise
        missing = [k for k in messages if k not in replies]
        if missing:
            raise RunError("no reply from " + ", ".join(f"table {t!r} shard {q}" for t, q in missing))
        check_round(messages, replies, self.client_rows, self.d_out, self.diverged_hint)
        self.on_round(kind, down, up)
        if time.monotonic() - self.last_line >= self.HEARTBEAT_S:
            self.log(self.heartbeat())
        return replies

    def round_messages(
        self, messages: Mapping[ClientKey, Payload], kind: Kind
    ) -> tuple[list[Message], dict[ClientKey, int]]:
        """The Flower messages of a round (a different payload per node) and each one's payload bytes."""
        out, down = [], {}
        for key, (payload, cfg) in messages.items():
            content = pack_payload(payload, cfg)
            down[key] = record_bytes(content)
            out.append(Message(content, self.nodes[key], MESSAGE_TYPE[kind]))
        return out, down

    def read_replies(self, replies: Iterable[Message]) -> tuple[dict[ClientKey, Reply], dict[ClientKey, int]]:
        """The decoded replies of a round by client key, and each one's payload bytes; an error reply ends the
        run with one line naming its table."""
        replies = list(replies)
        failed = [
            (self.node_name(r.metadata.src_node_id), self.keys.get(r.metadata.src_node_id), error_reason(r))
            for r in replies
            if r.has_error()
        ]
        if failed:  # every node's own line (e.g. each table's data problems), not only the first one's
            raise RunError("\n".join(merged_lines(failed)))
        inbox, up = {}, {}
        for reply in replies:
            key = self.keys[reply.metadata.src_node_id]
            inbox[key] = unpack_reply(reply.content)
            up[key] = record_bytes(reply.content)
        return inbox, up

    # ------------------------------------------------------------------------------------ Strategy API
    # Flower's configure_train / configure_evaluate build a round's messages from ONE global model (``arrays``)
    # and ONE config for every sampled node, and its start() loop runs a fixed number of such rounds. A
    # TablePuppet round sends each client its own payload (its rows of Y_i, its batch rows), so it cannot be
    # expressed through those two arguments: :meth:`send` builds each round's messages from its own arguments
    # (:meth:`round_messages`) and start() runs the protocol instead of Flower's loop. The abstract methods are
    # implemented as what they can honestly be: configure_* refuse (nothing calls them), aggregate_* decode a
    # round's replies and report its bytes.

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        raise NotImplementedError(
            "a TablePuppet round's messages are per client: built by send(), not from one (arrays, config)"
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode a round's replies (an error reply ends the run): no global model, the round's reply bytes."""
        _, up = self.read_replies(replies)
        return None, MetricRecord({"bytes_up": sum(up.values())})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.configure_train(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.aggregate_train(server_round, replies)[1]

    def summary(self) -> None:
        self.log(f"{type(self).__name__}: {len(self.clients)} clients {self.clients}")


class LoJStrategy(TablePuppetStrategy):
    """The relational strategies' runner (TP-Join/UCQ-SGD/ADMM, the VFL baselines, CELU, the coreset family,
    k-means): :meth:`protocol` over the transport, with the setup rounds in :attr:`join`, the run record in
    :attr:`record` and the epoch checkpoints in :attr:`checkpoints`.

    ``params``: the algorithm's typed settings, validated (with the run settings and the privacy settings)
    in the constructor, before any client is contacted."""

    algorithm = "loj"
    params_type: type[AlgorithmParams] = AlgorithmParams
    expand = False  # VFL baselines: setup sends each client its p_i (no duplicate reduction)
    resumable = False  # the protocol checkpoints every epoch: the strategy gets an EpochCheckpoints
    one_shot = False  # True: the run records one result whatever `epochs` says (k-means: DistDim has no epochs)
    checkpointed: tuple[str, ...] = ("selection",)  # the strategy's own attributes an epoch's checkpoint keeps
    predictor = True  # the nodes save their parts of the trained f_i at the end (model.json; simulations.predict)
    # a simulation's folder its relative table sources start at, recorded in model.json (``base_dir``: a later
    # prediction from another working directory starts there; docs/prediction.md); a deployment's: none
    source_dir: Path | None = None
    labelled = True  # False: the algorithm ignores the label (k-means): no constant-predictor reference or warning
    # the top-level validation_fraction: "select" (setup holds out the validation part of the training join and
    # the run keeps the model of its best evaluation: strategies.selection), "own" (the strategy reads it
    # itself: boosted trees) or "none" (a solver that keeps no validation part: above 0 is refused)
    validation = "own"

    def __init__(
        self,
        cfg: Any,
        spec: RelationalSpec,
        run_dir: str | Path | None,
        log: Callable[[str], None] = print,
        feature_dp: bool = True,
        label_dp: bool = True,
        why_no_feature_dp: str = "",
        why_no_label_dp: str = "",
    ):
        self.cfg = cfg
        self.spec = spec
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.scenario = str(cfg.scenario.name)
        super().__init__(spec.clients(self.scenario), log)
        run_settings(cfg)
        self.params = self.params_type.from_cfg(cfg.algorithm)
        self.task = spec.label.task
        self.metric = primary_metric(self.task)
        self.privacy = cfg.get("privacy") or {"name": "none"}
        # impossible privacy settings fail here, before any client is asked for anything (also under flwr run)
        dp.validate_privacy(
            self.privacy,
            self.public_name,
            self.task,
            feature_dp=feature_dp,
            label_dp=label_dp,
            why_not=why_no_feature_dp,
            why_no_label=why_no_label_dp,
        )
        self.label_dp = dp.uses_label_dp(self.privacy)
        self.feature_dp = dp.uses_feature_dp(self.privacy)
        self.finished = False
        self.run_id = secrets.token_hex(16)  # names this run's checkpoints on the nodes (kept when resumed)
        self.validation_fraction = self.validation_share()
        self.join = JoinSetup(self.send, spec, cfg, self.clients, self.privacy, self.log, self.validation_fraction)
        self.selection = ModelSelection(self.task, LabelScale(), None, 0)  # set up with the validation rows
        self.record = RunRecord(self.send, self.join, self.task, self.privacy, self.log, labelled=self.labelled)
        self.checkpoints = self._checkpoints(bool(cfg.get("resume", False)))

    def validation_share(self) -> float:
        """The share of the training join's labelled rows setup holds out for model selection (``validation``)."""
        value = self.cfg.get("validation_fraction")
        if self.validation == "select":
            return validation_fraction_of(value, self.default_validation())
        fraction = validation_fraction_of(value, 0.0)  # checked for every algorithm, before a client is contacted
        if self.validation == "none" and fraction > 0:
            raise ValueError(
                f"validation_fraction={value}: algorithm={self.public_name} solves its problem to the end and selects no "
                "model on a validation part; set validation_fraction=0 (or null)"
            )
        return 0.0

    @property
    def public_name(self) -> str:
        """The algorithm as the user selects it (``algorithm=NAME``, its registry selector): what messages say
        (``self.algorithm`` is the internal name, e.g. tp_join_pcg for algorithm=pcg)."""
        try:
            return by_name(self.algorithm).selector
        except ValueError:
            return self.algorithm

    def default_validation(self) -> float:
        """``validation_fraction`` when the config leaves it at null (docs/settings.md)."""
        return SELECTION_FRACTION

    def _checkpoints(self, resume: bool) -> NoCheckpoints:
        """An EpochCheckpoints for a resumable algorithm with a run dir, else NO_CHECKPOINTS; ``resume=true``
        is refused here for an algorithm that has nothing to resume from."""
        if resume and self.one_shot:
            raise ValueError(
                f"resume=true: algorithm={self.public_name} runs in one shot (no epochs, no checkpoint to resume "
                "from); run it again"
            )
        if resume and not self.resumable:
            resumable = sorted({e.selector for e in entries() if e.strategy.resumable})
            raise ValueError(
                f"resume=true: algorithm={self.public_name} does not checkpoint its epochs yet "
                f"(algorithms that do: {', '.join(resumable)})"
            )
        if resume and self.run_dir is None:
            raise ValueError(f"resume=true but there is no checkpoint {CHECKPOINT} in the run dir None")
        if self.resumable and self.run_dir is not None:
            return EpochCheckpoints(self.run_dir, self.cfg, resume)
        return NO_CHECKPOINTS

    # ------------------------------------------------------------------------------------------ what setup built
    # read by the families' protocols (and tests) on the strategy; held by the JoinSetup

    mapping = property(lambda self: self.join.mapping)
    train = property(lambda self: self.join.train)
    test = property(lambda self: self.join.test)
    valid = property(lambda self: self.join.valid)
    evaluated = property(lambda self: self.join.evaluated)  # the validation rows, then the test rows
    routers = property(lambda self: self.join.routers)
    y_train = property(lambda self: self.join.y_train)
    y_test = property(lambda self: self.join.y_test)
    label_scale = property(lambda self: self.join.label_scale)
    d_out = property(lambda self: self.join.d_out)  # type: ignore[assignment]
    dp_plan = property(lambda self: self.join.dp_plan)
    state_dtype = property(lambda self: self.join.state_dtype)

    @property  # type: ignore[override]
    def client_rows(self) -> dict[ClientKey, int]:
        return self.join.client_rows

    @client_rows.setter
    def client_rows(self, rows: dict[ClientKey, int]) -> None:  # the coreset trains on its own rows
        self.join.client_rows = rows

    # ------------------------------------------------------------------------------------------ the run record

    results = property(lambda self: self.record.results)
    comm = property(lambda self: self.record.comm)
    eps_spent = property(lambda self: self.record.eps_spent)

    def heartbeat(self) -> str:
        """A long stretch of training round trips without a line: where the run is (the epoch in progress, its
        round trips and bytes so far, the time since the last line)."""
        if self.results is None or self.comm is None:  # setup's rounds
            return super().heartbeat()
        done = self.results.history[-1].epoch if self.results.history else 0
        trees = hasattr(self.params, "trees")  # boosted trees: their count so far, as their lines say
        where = f"trees {done:g} done" if trees else f"epoch {int(done) + 1} in progress"
        m = self.comm.snapshot()
        return (
            f"{where}: {int(m['rounds']):,} round trips so far (MB up/down={m['bytes_up'] / 1e6:.2f}/"
            f"{m['bytes_down'] / 1e6:.2f}); {time.monotonic() - self.last_line:.0f} s since the last line"
        )

    def setup(self) -> None:
        """The setup rounds (JoinSetup.run): keys, then federated preprocessing, and expand for VFL."""
        if self.engine_t0 is not None:
            keys = (self.cfg.get("mapping") or {}).get("keys", "hmac")
            self.log(
                f"keys: {len(self.clients)} nodes send their join keys (mapping.keys={keys}); the table mapping follows"
            )
        self.join.run(
            self.run_id,
            self.record,
            self.algorithm,
            self.plan_feature_dp if self.feature_dp else None,
            self.expand,
            self.dp_parameter_noise,
        )
        if self.join.label_scaling:
            self.results.label_scale = dict(self.join.label_scaling)
        patience = int(getattr(self.params, "early_stopping", 0))
        self.selection = ModelSelection(self.task, self.label_scale, self.join.y_valid, patience)
        if self.selection.on:
            stopping = f"early stopping after {patience} without a lower one" if patience else "no early stopping"
            self.log(
                f"validation: {self.selection.n_valid:,} joined rows of the training join "
                f"(validation_fraction={self.validation_fraction:g}); the model of the evaluation with the lowest "
                f"validation loss is kept, {stopping}"
            )

    def send(self, messages: Mapping[ClientKey, Payload], kind: Kind = "train") -> dict[ClientKey, Reply]:
        replies = super().send(messages, kind)
        self.record.note_epsilon(replies)
        return replies

    def on_round(self, kind: Kind, down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> None:
        self.record.count(kind, down, up)

    def record_epoch(
        self, epoch: int | float, H_test: np.ndarray, train_loss: float, extra: dict[str, float] | None = None
    ) -> None:
        """Evaluate the test predictions, append the epoch to the record and print its line (RunRecord)."""
        self.record.record_epoch(self.algorithm, epoch, H_test, train_loss, extra)

    def record_evaluation(
        self, epoch: int | float, H_eval: np.ndarray, train_loss: float, extra: dict[str, float] | None = None
    ) -> bool:
        """:meth:`record_epoch` for the predictions ``H_eval`` of the :attr:`evaluated` rows (the validation rows,
        then the test rows): with a validation part, its loss (``val_loss``) goes into the record and the model
        selection (strategies.selection). True when the run stops early here (its line says so)."""
        sel = self.selection
        n = sel.n_valid
        val: dict[str, float] = {"val_loss": sel.validation_loss(H_eval[:n])} if sel.on else {}
        self.record_epoch(epoch, H_eval[n:], train_loss, {**(extra or {}), **val})
        if not sel.on:
            return False
        assert self.results is not None
        sel.observe(self.results.history[-1], self.record.test_predictions, val["val_loss"])
        if sel.stopped:
            self.log(sel.stop_line())
            self.results.stopped = {
                "epoch": epoch,
                "reason": "validation",
                "detail": f"no lower validation loss in {sel.bad} evaluations",
            }
        return sel.stopped

    def keep_best(self) -> None:
        """At the end of a run with a validation part: the kept model's record is the last history entry
        (appended again, with the run's traffic and time, when a later evaluation was not the best) and its
        test predictions the run's; results.selection says which it is."""
        sel = self.selection
        if not sel.on or sel.best_record is None:
            return
        assert self.results is not None and self.comm is not None
        best = sel.best_record
        if sel.best != sel.evaluations:
            now = {"wall_time_s": self.record.elapsed(), **self.comm.snapshot()}
            self.log(f"kept: the model of epoch {best.epoch} (the lowest validation loss, {sel.best_loss:.4g})")
            self.record.add(replace(best, **now, extra={**best.extra, "kept": 1.0}), self.metric)  # type: ignore[arg-type]
            self.record.test_predictions = sel.best_predictions
        self.results.selection = sel.summary(self.validation_fraction)

    def finish(self) -> None:
        """Once the protocol has run to its end: the kept model chosen (:meth:`keep_best`), every node saves its
        part of the model and model.json is written (a predictor with a run dir; docs/prediction.md), then
        results.json (atomically)."""
        self.keep_best()
        if self.predictor and self.run_dir is not None:
            self.save_model()
        self.finished = True
        self.warn_loss_rose()
        self.warn_below_constant()
        self.record.write(self.run_dir)

    def warn_below_constant(self) -> None:
        """One warning line when the final model scores worse on the test rows than the constant predictor (its
        features taught it nothing that holds on new rows), with the setting most likely to help."""
        assert self.results is not None
        if not self.results.history:
            return
        last = self.results.history[-1]
        test = {self.metric: last.test_metric, **{k[5:]: v for k, v in last.extra.items() if k.startswith("test_")}}
        worse = below_constant(self.task, test, self.results.reference)
        grew = self.trees_diverged()
        if not worse:
            return
        if grew:  # said in its own line (trees_diverged)
            hint = f"the training loss diverged (above): {self.trees_divergence_fix}"
        elif self.feature_dp:
            hint = "the DP noise outweighs what it learnt: more epochs, or a larger epsilon"
        elif self.label_dp:  # the labels it trained on are randomized; a larger model.beta cannot undo that
            eps = self.results.privacy.get("label_epsilon")
            level = f"privacy.label_epsilon={eps:.4g}" if eps is not None else "label DP"
            tighter = ", or a tighter label range (its noise grows with it)" if self.task == "regression" else ""
            hint = (
                f"the label DP noise ({level}) outweighs what the labels teach: a larger privacy.label_epsilon{tighter}"
            )
        elif self.boosted_trees and self.results.selection.get("early_stopping") == 0:  # validating, never stopping
            hint = "the trees overfit: fewer trees, or algorithm.early_stopping=3 to stop early"
        elif self.boosted_trees and self.results.selection:  # it kept the trees of its best validation evaluation
            hint = (
                "the trees overfit though early stopping kept the best validation evaluation's: a smaller "
                "algorithm.eval_every (e.g. 1) lets it keep fewer trees"
            )
        elif self.boosted_trees:
            hint = "the trees overfit: fewer trees, or validation_fraction=0.1 to stop early"
        elif self.validation == "select" and not self.results.selection:
            hint = "it overfits: a larger model.beta (e.g. 0.1), or validation_fraction=0.1 to keep its best epoch"
        else:  # a solver: the regularization decides its solution
            hint = "it overfits: a larger model.beta (e.g. 0.1)"
        self.log(f"warning: the model ends worse than predicting a constant ({worse}); {hint}")

    def warn_loss_rose(self) -> str:
        """Mini-batch SGD (sgd, vfl_sgd, celu, vfl_celu, TP-UCQ-SGD) whose training loss rose by a quarter over a
        lower earlier epoch (tpflower.reference.loss_rose): one warning line naming algorithm.lr and a quarter of
        it, and its text; '' otherwise, and under feature DP, whose noise and plan are tied to lr."""
        assert self.results is not None
        lr = self.sgd_lr
        if self.feature_dp or lr is None:
            return ""
        history = [rec for rec in self.results.history if not rec.extra.get("kept")]
        rose = loss_rose([(rec.epoch, rec.train_loss) for rec in history])
        if rose:
            kept = (self.results.selection or {}).get("kept_epoch")
            keeps = f"; the run keeps epoch {kept}'s model" if kept is not None else ""
            self.log(
                f"warning: the {rose}: steps of algorithm.lr={lr:g} overshoot on these tables{keeps}; a smaller "
                f"step trains them stably (algorithm.lr={lr / 4:g}, docs/algorithms.md#step-size)"
            )
        return rose

    @cached_property
    def diverged_hint(self) -> str:
        """The setting a reply of non-finite model outputs names: an SGD trainer's ``algorithm.lr`` with a quarter of
        it (its steps left SGD's stable range, docs/algorithms.md#step-size); the generic hint otherwise."""
        lr = self.sgd_lr
        if lr is None:
            return DIVERGED
        return (
            f"steps of algorithm.lr={lr:g} overshoot on these tables: a quarter of it or less, algorithm.lr={lr / 4:g}"
        )

    @property
    def sgd_lr(self) -> float | None:
        """The step size ``algorithm.lr`` of a run taking mini-batch SGD steps (its settings SGDParams': sgd,
        vfl_sgd, celu, vfl_celu, TP-UCQ-SGD); None for every other algorithm."""
        return float(self.params.lr) if isinstance(self.params, SGDParams) else None

    @property
    def boosted_trees(self) -> bool:
        """Whether the run's algorithm is of the boosted-trees family (over the join or the union)."""
        try:
            return by_name(self.algorithm).family == "gbdt"
        except ValueError:  # an unregistered strategy (the base class's own name)
            return False

    def trees_diverged(self) -> str:
        """Boosted trees whose training loss ends above its first evaluation's (tpflower.reference.loss_grew):
        one warning line with the setting that bounds their leaves, and its text; '' otherwise (and for the
        other algorithms, whose losses are not Newton steps of one model)."""
        assert self.results is not None
        if not self.boosted_trees:
            return ""
        grew = loss_grew([(rec.epoch, rec.train_loss) for rec in self.results.history])
        if grew:
            lr = float(getattr(self.params, "learning_rate", 0.0))
            cause = (
                f"algorithm.learning_rate={lr:g} scales every leaf's Newton step past the loss's minimum"
                if lr > 1
                else "a leaf of almost no hessian, as a class of few rows gets at lambda_l2 0, takes a value far from 0"
            )
            self.log(
                f"warning: the {grew}: the trees' leaf values diverge, not overfit ({cause}); {self.trees_divergence_fix}"
            )
        return grew

    @property
    def trees_divergence_fix(self) -> str:
        """The setting that stops boosted trees' leaf values diverging: a learning_rate above 1 overshoots every
        leaf's Newton step -learning_rate G / (H + lambda) (squared error: each tree multiplies the residuals by
        1 - learning_rate, so from 2 on they grow whatever lambda_l2 is; synthetic at 5 reached a test RMSE of
        1.4e12, 1.3e12 at lambda_l2 1, 8.6e10 at 100); else lambda_l2 bounds a leaf of little hessian
        (|w| <= learning_rate |G| / lambda_l2), named larger than the run's."""
        lr = float(getattr(self.params, "learning_rate", 0.0))
        if lr > 1:
            return "algorithm.learning_rate=0.1 (the default), at most 1"
        l2 = float(getattr(self.params, "lambda_l2", 0.0))
        if l2 < 1:
            return "algorithm.lambda_l2=1 bounds them"
        return f"algorithm.lambda_l2={10 * l2:g} bounds them more tightly"

    def model_extra(self) -> dict[str, Any]:
        """What model.json holds beyond the common record (k-means: its centres)."""
        return {}

    def save_model(self) -> None:
        """The save round (``save_part``, not training traffic) and the server's model record, model.json."""
        assert self.run_dir is not None
        config = {"phase": "save_part", "run_id": self.run_id, **self.selection.save_config()}
        replies = self.send({k: ({}, config) for k in self.clients}, "eval")
        parts = {k: str(m.get("part", "")) for k, (_, m) in replies.items()}
        if not all(parts.values()):
            return  # nodes without a state_dir keep no part: there is no model to record
        record = model_record(self.cfg, self.run_id, self.algorithm, self.task, self.d_out, self.label_scale, parts)
        record.update(self.model_extra())
        if self.source_dir is not None:
            record["base_dir"] = str(self.source_dir)
        self.log(f"model: {write_model_record(record, self.run_dir)}")

    # ------------------------------------------------------------------------------------------ checkpoints

    def begin(self, start: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """The epochs done and the training loop's state (EpochCheckpoints.begin)."""
        return self.checkpoints.begin(self, start)

    def checkpoint_config(self, epoch: int) -> dict[str, Any]:
        """Config of an epoch's last training message: each client checkpoints its state after answering it."""
        return self.checkpoints.config(epoch, self.run_id)

    def end_epoch(self, epoch: int, loop: dict[str, Any]) -> None:
        self.checkpoints.end_epoch(self, epoch, loop)

    # ------------------------------------------------------------------------------------------ privacy

    def plan_feature_dp(self) -> dict[ClientKey, tuple[int, float]]:
        """Feature DP: per client, (local DP steps over the whole run, per-step sample rate of a table row).

        Called in setup on the training mapping of TABLE rows. The client calibrates sigma to these once."""
        raise ValueError(f"privacy={self.privacy.get('name')}: algorithm={self.public_name} has no feature-DP plan")

    def dp_parameter_noise(self, plan: dict[ClientKey, tuple[int, float]]) -> float:
        """Feature DP: the std the DP noise of ``plan`` adds to one parameter over the run, which sets the
        label's scale (tpflower.losses.dp_label_divisor); 0 (the target std's floor, 3) unless the algorithm
        knows it."""
        return 0.0

    def client_G(self, key: ClientKey) -> np.ndarray:
        """G_iu over the training join of the rows of client ``key`` (its shard of table i), in shard order."""
        t, q = key
        return self.train.G(t)[self.routers[t].ids[q]]

    def dp_config(self, key: ClientKey) -> dict[str, Any]:
        """The DP plan of client ``key`` for the config of its first training message ({} without feature DP)."""
        if not self.feature_dp:
            return {}
        steps, q = self.dp_plan[key]
        return {"dp_steps": int(steps), "dp_q": float(q)}

    # ------------------------------------------------------------------------------------------ messages

    def messages(self, build: Callable[[str], Payload]) -> dict[ClientKey, Payload]:
        """One message per client, built from its table name (join scenario: one client per table)."""
        return {k: build(k[0]) for k in self.clients}

    @staticmethod
    def outputs(replies: Mapping[ClientKey, Reply], name: str = "h") -> dict[str, np.ndarray]:
        """Reply array ``name`` of every client, keyed by table (join scenario)."""
        return {k[0]: r[0][name] for k, r in replies.items()}

    def shard_messages(self, build: Callable[[ClientKey], Payload]) -> dict[ClientKey, Payload]:
        """One message per shard client (union scenario)."""
        return {k: build(k) for k in self.clients}

    def gather_rows(
        self, replies: Mapping[ClientKey, Reply], rows: Mapping[str, np.ndarray], name: str = "h"
    ) -> dict[str, np.ndarray]:
        """Per table, the shards' reply array ``name`` for the table rows ``rows[t]``, in that order."""
        return {
            t: self.routers[t].gather(rows[t], {q: r[0][name] for (tt, q), r in replies.items() if tt == t})
            for t in self.spec.table_names
        }
