"""The base of every tpflower strategy: a Flower strategy (flwr.serverapp.strategy.Strategy) whose
:meth:`start` runs the algorithm's protocol, plain code over :meth:`send`.

A TablePuppet algorithm is a sequence of gather/scatter rounds whose number depends on the data (N / B
batches per epoch for SGD), with a different payload for every client; Flower's default start() loop (a fixed
number of configure_train / aggregate_train rounds with one global model) does not fit it. So start() runs
:meth:`protocol`, and every ``send(messages, kind)`` is one round of the Strategy API: configure_train (or
configure_evaluate) turns the round's payloads into Flower messages, the transport delivers them, and
aggregate_train (or aggregate_evaluate) turns the replies back into payloads, raising on an error reply.

Client keys are (table, shard). Before the protocol, :meth:`connect` asks every node which table and shard
it holds. The same object runs under Flower (:class:`~strategies.transport.GridTransport`) and in-process
(:class:`~strategies.transport.DirectTransport`), so the framework's overhead is measured on identical code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from strategies.replies import check_round
from strategies.transport import MESSAGE_TYPE, ClientKey, GridTransport, Kind, Payload, Reply, RunError, Transport
from tpflower.records import HELLO_PHASE, error_reason, pack_payload, record_bytes, unpack_reply


class TablePuppetStrategy(Strategy):
    """Flower plumbing around a protocol: node discovery, one round per :meth:`send`, byte accounting."""

    WAIT_LINE_S = 10.0  # while nodes are missing at the start, a line this often

    def __init__(self, clients: list[ClientKey], log: Callable[[str], None] = print):
        self.clients = clients
        self.log = log
        self.transport: Transport | None = None
        self.nodes: dict[ClientKey, int] = {}
        self.keys: dict[int, ClientKey] = {}
        self.server_round = 0
        self._outbox: Mapping[ClientKey, Payload] = {}
        self._kind: Kind = "train"
        self._inbox: dict[ClientKey, Reply] = {}
        self._down: dict[ClientKey, int] = {}
        self._up: dict[ClientKey, int] = {}
        self.client_rows: dict[ClientKey, int] = {}  # each client's row count, once known: replies are checked against it
        self.d_out: int | None = None  # the prediction width, once known

    # ------------------------------------------------------------------------------------ to implement

    def protocol(self) -> None:  # pragma: no cover - abstract
        """The algorithm: setup, training and evaluation rounds, each a call of :meth:`send`."""
        raise NotImplementedError

    def on_round(self, kind: Kind, down: Mapping[ClientKey, int], up: Mapping[ClientKey, int]) -> None:
        """Called after every round with the payload bytes sent to (down) and received from (up) each client."""

    # ------------------------------------------------------------------------------------ running

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 0,
              timeout: float = 600.0, node_wait_s: float = 120.0, **_: object) -> Result:
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
        while True:
            new = sorted(set(self.transport.node_ids()) - set(self.keys))
            if new:
                self._hello(new)
            missing = [k for k in self.clients if k not in self.nodes]
            waited = time.monotonic() - start
            if not missing:
                return
            names = ", ".join(f"table {t!r} shard {q}" for t, q in missing)
            if waited > wait_s:
                raise RunError(f"no node holds {names} ({len(self.nodes)} of {len(self.clients)} nodes connected "
                               f"within {wait_s:.0f} s; one SuperNode per table shard is needed)")
            if waited - said >= self.WAIT_LINE_S:
                said = waited
                self.log(f"waiting for nodes ({waited:.0f} of {wait_s:.0f} s): missing {names}")
            time.sleep(0.05)

    def _hello(self, ids: list[int]) -> None:
        """Ask nodes ``ids`` which table and shard they hold; a node refusing the run, a table claimed twice or
        one the run does not have stops the run."""
        assert self.transport is not None
        hello = [Message(pack_payload({}, {"phase": HELLO_PHASE}), node, "query") for node in ids]
        replies = self.transport.exchange(hello)
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

    def node_name(self, node: int) -> str:
        key = self.keys.get(node)
        return f"node {node}" if key is None else f"table {key[0]!r} shard {key[1]}"

    def send(self, messages: Mapping[ClientKey, Payload], kind: Kind = "train") -> dict[ClientKey, Reply]:
        """One round: a message per client key, every reply back (kind: train | inner | eval)."""
        assert self.transport is not None, "send() before run()"
        self.server_round += 1
        self._outbox, self._kind = messages, kind
        configure, aggregate = ((self.configure_evaluate, self.aggregate_evaluate) if kind == "eval"
                                else (self.configure_train, self.aggregate_train))
        messages = list(configure(self.server_round, ArrayRecord(), ConfigRecord(), None))  # type: ignore[arg-type]
        aggregate(self.server_round, self.transport.exchange(messages))
        self.on_round(kind, self._down, self._up)
        return self._inbox

    # ------------------------------------------------------------------------------------ Strategy API

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """The messages of the current round (a different payload per node; ``arrays``/``config`` unused)."""
        messages, self._down = [], {}
        for key, (payload, cfg) in self._outbox.items():
            content = pack_payload(payload, cfg)
            self._down[key] = record_bytes(content)
            messages.append(Message(content, self.nodes[key], MESSAGE_TYPE[self._kind]))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode the replies of the round; an error reply ends the run with one line naming its table."""
        self._inbox, self._up = {}, {}
        replies = list(replies)
        errors = [f"{self.node_name(r.metadata.src_node_id)}: {error_reason(r)}" for r in replies if r.has_error()]
        if errors:  # every node's own line (e.g. each table's data problems), not only the first one's
            raise RunError("\n".join(sorted(errors)))
        for reply in replies:
            node = reply.metadata.src_node_id
            key = self.keys[node]
            self._inbox[key] = unpack_reply(reply.content)
            self._up[key] = record_bytes(reply.content)
        missing = [k for k in self._outbox if k not in self._inbox]
        if missing:
            raise RunError("no reply from " + ", ".join(f"table {t!r} shard {q}" for t, q in missing))
        check_round(self._outbox, self._inbox, self.client_rows, self.d_out)
        return None, MetricRecord({"bytes_up": sum(self._up.values()), "bytes_down": sum(self._down.values())})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.configure_train(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.aggregate_train(server_round, replies)[1]

    def summary(self) -> None:
        self.log(f"{type(self).__name__}: {len(self.clients)} clients {self.clients}")
