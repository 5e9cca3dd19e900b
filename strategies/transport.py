"""The transports that carry one round of Flower messages: Flower's Grid (simulation engine or SuperLink),
or an in-process call of the same ClientApp. The payload codec is tpflower.records.

A round is ``send(messages, kind)`` (strategies.base): one message per client key (table, shard), each a
pair (named arrays, config scalars); the replies come back as (named arrays, metrics). Message types:
``train`` for training and union-inner rounds, ``evaluate`` for the label owner's evaluation, ``query`` for
the first step, which asks every node which table and shard it holds.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

from flwr.app import Context, Error, Message
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from tpflower.app.flower_patch import BELL_IDLE_S, HELD_PULL_S, stored_bell
from tpflower.errors import RunError  # (defined beside tpflower's other errors: the ServerApp tells it apart)
from tpflower.records import PAYLOAD, VALUE, Arrays

ClientKey = tuple[str, int]  # (table, shard)
Payload = tuple[Arrays, dict[str, Any]]  # (named arrays, config) of one message
Reply = tuple[Arrays, dict[str, Any]]  # (named arrays, metrics) of one reply
Kind = Literal["train", "inner", "eval"]
MESSAGE_TYPE: dict[str, str] = {"train": "train", "inner": "train", "eval": "evaluate"}


# ------------------------------------------------------------------------------------------------ transports


class Transport:
    """Carries one round of Flower messages to their nodes and returns every reply (error replies included);
    raises :class:`RunError` when replies are missing. ``name(node)`` says who a node is, for errors."""

    name: Callable[[int], str] = staticmethod(lambda node: f"node {node}")

    timeout_s: float = 600.0
    # every node of the run is there at once (the simulation engine registers its num-supernodes together): a
    # node missing once the node list has settled never comes
    nodes_fixed: bool = False

    def node_ids(self) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def exchange(self, messages: list[Message]) -> list[Message]:  # pragma: no cover - abstract
        raise NotImplementedError

    def failures(self) -> list[str]:
        """The tracebacks of the last round's failed handlers where this transport ran them (in-process), for
        the run's log file; empty where a node ran them (its own log has them)."""
        return []


def round_kind(messages: list[Message]) -> tuple[str, ...]:
    """What makes rounds alike in duration: their message type and phase (tpflower.records' ``v/phase``)."""
    kinds = set()
    for msg in messages:
        record = msg.content.config_records.get(PAYLOAD)
        kinds.add((msg.metadata.message_type, str(record.get(VALUE + "phase", "")) if record is not None else ""))
    return tuple(sorted(f"{t}/{p}" for t, p in kinds))


class GridTransport(Transport):
    """Flower's Grid (simulation engine or SuperLink): push the round's messages, pull the replies in our own
    loop (Grid.send_and_receive sleeps a fixed 0.1 s between pulls). The next pull comes after a tenth of the
    time this round has waited so far (0.5 ms at least, 0.5 s at most): sub-millisecond for the simulation
    engine's rounds, a few pulls per second for a deployment's seconds-long rounds, where every pull is a
    request to the SuperLink. Once :data:`LEARN_AFTER` rounds of a kind (:func:`round_kind`) have been
    timed, the first pull of the next comes after :data:`LEARNT_FRACTION` of the shortest of the last
    :data:`LEARN_MEMORY` (a run's rounds of one kind take about as long; the shortest bounds how late a
    quicker round's replies can be picked up). A SuperLink that holds pulls until the replies are there
    (tpflower.app.held_pulls) is seen by a pull taking :data:`HELD_PULL_S` or longer: then every pull comes at
    once, the link does the waiting. Under the simulation engine (an in-memory grid) with the stored-bells
    adapter, the loop instead waits for a reply to be stored (tpflower.app.flower_patch.stored_bell): no poll
    comes late."""

    MIN_WAIT_S, MAX_WAIT_S, WAIT_FRACTION = 0.0005, 0.5, 0.1
    LEARN_AFTER, LEARN_MEMORY, LEARNT_FRACTION = 2, 4, 0.8

    def __init__(self, grid: Grid, timeout_s: float = 600.0):
        self.grid = grid
        self.timeout_s = timeout_s
        self.bell = stored_bell(getattr(grid, "state", None), "store_message_res", notice=False)  # None: poll
        self._took: dict[tuple[str, ...], deque[float]] = {}
        self.link_holds = False  # the last telling pull was held (see the class doc)
        self.nodes_fixed = type(grid).__name__ == "InMemoryGrid"  # the simulation engine's (Flower 1.41, 1.42)

    def first_wait(self, kind: tuple[str, ...]) -> float:
        """How long to wait before the first reply pull of a round of ``kind`` (0 until learnt, with a link
        that holds pulls and with a bell)."""
        took = self._took.get(kind, ())
        learnt = len(took) >= self.LEARN_AFTER and not self.link_holds
        return self.LEARNT_FRACTION * min(took) if learnt else 0.0

    def node_ids(self) -> list[int]:
        return list(self.grid.get_node_ids())

    def exchange(self, messages: list[Message]) -> list[Message]:
        kind = round_kind(messages)
        start = time.monotonic()
        pending = {mid: msg.metadata.dst_node_id for mid, msg in zip(self.grid.push_messages(messages), messages)}
        replies: list[Message] = []
        deadline = start + self.timeout_s
        time.sleep(max(self.first_wait(kind) - (time.monotonic() - start), 0.0))
        while pending:
            seen = self.bell.rung if self.bell is not None else 0  # before pulling: a later reply rings anew
            asked = time.monotonic()
            got = list(self.grid.pull_messages(list(pending)))
            took = time.monotonic() - asked
            for reply in got:
                node = pending.pop(reply.metadata.reply_to_message_id, None)
                if node is not None and reply.has_error():
                    # an error the SuperLink wrote for a node (e.g. "Node Unavailable") comes from the SuperLink:
                    # it is about the node the message was for, so name that node
                    reply.metadata.__dict__["_src_node_id"] = node
            replies.extend(got)
            if took >= HELD_PULL_S:
                self.link_holds = True
            if not pending:
                break
            self.link_holds = took >= HELD_PULL_S  # came back short: held, or answered at once
            if time.monotonic() > deadline:
                late = ", ".join(self.name(node) for node in pending.values())
                raise RunError(f"no reply within {self.timeout_s:.0f} s from {late}")
            if self.bell is not None:
                self.bell.wait(seen, time.monotonic() + BELL_IDLE_S)
            elif not self.link_holds:
                waited = time.monotonic() - start
                time.sleep(min(max(self.WAIT_FRACTION * waited, self.MIN_WAIT_S), self.MAX_WAIT_S))
        if self.bell is None:  # with a bell no first wait is learnt (first_wait)
            self._took.setdefault(kind, deque(maxlen=self.LEARN_MEMORY)).append(time.monotonic() - start)
        return replies


class DirectTransport(Transport):
    """In-process: each message goes straight to ``app(message, context)`` (the same ClientApp and records as
    under Flower, no Grid, no Ray). ``contexts`` holds each node's Context (its state persists across rounds)."""

    def __init__(self, app: Callable[[Message, Context], Message], contexts: Mapping[int, Context]):
        if TaskIdentity._run_id is None:  # Message() reads the run id of the process (set by Flower's runtimes)
            TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 0, 1, SUPERLINK_NODE_ID
        self.app = app
        self.contexts = dict(contexts)
        self._next_id = 0
        self._failures: list[str] = []

    def node_ids(self) -> list[int]:
        return list(self.contexts)

    def exchange(self, messages: list[Message]) -> list[Message]:
        replies, self._failures = [], []
        for msg in messages:
            self._next_id += 1
            msg.metadata.__dict__["_message_id"] = f"direct-{self._next_id}"
            try:
                reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
            except Exception as exc:  # as the simulation engine does: an exception becomes an error reply
                reply = Message(Error(code=0, reason=f"{type(exc)}:<'{exc}'>"), reply_to=msg)
                where = self.name(msg.metadata.dst_node_id)
                self._failures.append(f"{where}:\n" + "".join(traceback.format_exception(exc)))
            replies.append(reply)
        return replies

    def failures(self) -> list[str]:
        return list(self._failures)
