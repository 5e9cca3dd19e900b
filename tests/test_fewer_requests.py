"""Fewer and cheaper requests per deployed round: the SuperLink's held message pulls (tpflower.app.held_pulls)
and the clients that see them (the SuperNode's pull loop in tpflower.app.flower_patch, the ServerApp's
GridTransport in strategies.transport); middleware layers skipped where they do nothing (flower_patch)."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

import numpy as np
import pytest
from flwr.app import Message
from flwr.proto.fleet_pb2 import PullMessagesRequest, PullMessagesResponse  # pylint: disable=E0611
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611
from flwr.proto.message_pb2 import Metadata, ObjectTree  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullAppMessagesResponse  # pylint: disable=E0611

from tests.test_protocol import Clock, TimedGrid, serverapp_identity  # noqa: F401  (a fixture)
from tpflower.app import flower_guard, flower_patch, held_pulls
from tpflower.app.held_pulls import Bell, held_fleet_pull, held_runtime_pull, ringing


class Link:
    """A SuperLink's state for the held pulls: messages waiting per node, replies per message they answer,
    and object contents (b"": announced, not pushed yet), changed through ``ringing`` pushes."""

    def __init__(self, bell: Bell) -> None:
        self.bell = bell
        self.waiting: list[ProtoMessage] = []
        self.replies: dict[str, ProtoMessage] = {}
        self.objects: dict[str, bytes] = {}
        self.looks = 0
        self.push = ringing(self._push, bell)

    def _push(self, kind: str, msg_id: str, data: tuple[str, ...] | bytes = ()) -> None:
        """A message and the objects it announces (kind "ins" or "res", ``data`` their ids), or an object's
        content (kind "obj", ``data`` the bytes)."""
        if isinstance(data, bytes):
            self.objects[msg_id] = data
            return
        self.objects.update((obj, b"") for obj in data)
        meta = Metadata(run_id=7, message_id=msg_id, reply_to_message_id=msg_id[:-4] if kind == "res" else "")
        msg = ProtoMessage(metadata=meta)
        if kind == "ins":
            self.waiting.append(msg)
        else:
            self.replies[meta.reply_to_message_id] = msg

    def tree(self, msg: ProtoMessage) -> ObjectTree:
        mid = msg.metadata.message_id
        return ObjectTree(object_id=mid, children=[ObjectTree(object_id=o) for o in self.objects if o.startswith(mid)])

    def get_object(self, run_id: int, object_id: str) -> bytes | None:
        assert run_id == 7
        return self.objects.get(object_id)

    def fleet_pull(self, request, state, store):  # Flower's handler: at once, one message or none
        self.looks += 1
        got = self.waiting[:1]
        del self.waiting[:1]
        return PullMessagesResponse(messages_list=got, message_object_trees=[self.tree(m) for m in got])

    def runtime_pull(self, request, state, task):  # Flower's handler: at once, the replies there are
        self.looks += 1
        got = [self.replies.pop(mid) for mid in request.message_ids if mid in self.replies]
        return PullAppMessagesResponse(messages_list=got, message_object_trees=[self.tree(m) for m in got])


def later(seconds: float, *pushes: tuple) -> threading.Thread:
    """Pushes to the link after ``seconds`` (each ``(link.push, args...)``), from another thread."""

    def run() -> None:
        time.sleep(seconds)
        for push, *args in pushes:
            push(*args)

    thread = threading.Thread(target=run)
    thread.started_at = time.monotonic()  # type: ignore[attr-defined]  # the pushes' times count from here
    thread.start()
    return thread


def timed(call):
    start = time.monotonic()
    out = call()
    return out, time.monotonic() - start


def test_a_held_fleet_pull_returns_its_message_once_every_object_is_there():
    link = Link(Bell())
    pull = held_fleet_pull(link.fleet_pull, hold_s=5.0, bell=link.bell)
    pushing = later(
        0.1,
        (link.push, "ins", "m1", ("m1-a", "m1-b")),
        (link.push, "obj", "m1-a", b"a"),
        (time.sleep, 0.1),
        (link.push, "obj", "m1-b", b"b"),
    )
    response, took = timed(lambda: pull(request=PullMessagesRequest(), state=link, store=None))
    returned = time.monotonic() - pushing.started_at  # the pushes sleep 0.2 s from here, not from the pull's start
    pushing.join()
    assert [m.metadata.message_id for m in response.messages_list] == ["m1"]
    assert returned >= 0.2 and took < 2.0  # after its last object, not at once and not at the end of the hold
    assert link.objects == {"m1-a": b"a", "m1-b": b"b"}
    assert link.looks <= 2  # a look at the start and at the message's push: none while waiting for objects


def test_a_held_fleet_pull_without_a_message_returns_empty_after_the_hold():
    link = Link(Bell())
    pull = held_fleet_pull(link.fleet_pull, hold_s=0.2, bell=link.bell)
    pushing = later(0.05, (link.push, "obj", "unrelated", b"x"))  # a push wakes it; it looks, finds none
    response, took = timed(lambda: pull(request=PullMessagesRequest(), state=link, store=None))
    pushing.join()
    assert not response.messages_list and 0.2 <= took < 1.0 and link.looks <= 2


def test_a_held_runtime_pull_gathers_every_reply_it_asks_for():
    link = Link(Bell())
    pull = held_runtime_pull(link.runtime_pull, hold_s=5.0, bell=link.bell)
    pushing = later(
        0.05,
        (link.push, "res", "i1-res", ("i1-res-x",)),
        (link.push, "obj", "i1-res-x", b"1"),
        (time.sleep, 0.1),
        (link.push, "res", "i2-res", ("i2-res-x",)),
        (time.sleep, 0.1),
        (link.push, "obj", "i2-res-x", b"2"),
    )
    response, took = timed(lambda: pull(PullAppMessagesRequest(message_ids=["i1", "i2"]), link, Task()))
    returned = time.monotonic() - pushing.started_at
    pushing.join()
    assert sorted(m.metadata.reply_to_message_id for m in response.messages_list) == ["i1", "i2"]
    # after the last reply's object, pushed 0.25 s after the pushing thread started (a little before the pull)
    assert len(response.message_object_trees) == 2 and returned >= 0.25 and took < 2.0
    # a reply that does not come: the others after the hold
    pull = held_runtime_pull(link.runtime_pull, hold_s=0.2, bell=link.bell)
    link.push("res", "i3-res")
    response, took = timed(lambda: pull(PullAppMessagesRequest(message_ids=["i3", "i4"]), link, Task()))
    assert [m.metadata.reply_to_message_id for m in response.messages_list] == ["i3"] and 0.2 <= took < 1.0


class Task:
    run_id = 7


def test_beyond_the_held_pulls_allowed_a_pull_is_answered_at_once(monkeypatch):
    monkeypatch.setattr(held_pulls, "_SLOTS", threading.BoundedSemaphore(1))
    held_pulls._SLOTS.acquire()  # every slot taken
    link = Link(Bell())
    _, took = timed(lambda: held_fleet_pull(link.fleet_pull, 5.0, link.bell)(PullMessagesRequest(), link, None))
    assert took < 0.5 and link.looks == 1


def test_held_pulls_only_on_the_version_they_were_written_for(monkeypatch, caplog):
    from flwr.superlink.servicer.fleet import fleet_handlers
    from flwr.superlink.servicer.runtime import runtime_handlers

    for module in (fleet_handlers, runtime_handlers):
        for name in ("pull_messages", "push_messages", "push_object"):
            monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    flowers = fleet_handlers.pull_messages
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="tpflower"):
        m.setattr(flower_guard, "CHECKED", {})  # a Flower whose handlers changed
        assert held_pulls.install_held_pulls() is False
    assert len(caplog.records) == 1 and "fleet_handlers:pull_messages" in caplog.records[0].getMessage()
    assert fleet_handlers.pull_messages is flowers
    assert held_pulls.install_held_pulls() is True
    assert fleet_handlers.pull_messages.__wrapped__ is flowers
    assert runtime_handlers.push_object.__wrapped__ is not None


def test_the_supernode_pulls_again_at_once_after_a_held_empty_pull(monkeypatch):
    from flwr.supernode import start_client_internal

    monkeypatch.setattr(start_client_internal, "time", start_client_internal.time)  # restored after the test
    monkeypatch.setattr(start_client_internal, "_pull_and_store_message", start_client_internal._pull_and_store_message)
    assert flower_patch.install_fast_supernode() is True
    fast, slept = start_client_internal.time, []
    clock = [100.0]
    monkeypatch.setattr(flower_patch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(flower_patch.time, "sleep", slept.append)

    def pull_taking(seconds: float):
        def pull(**_: object) -> None:
            clock[0] += seconds

        return flower_patch.timed_pulls(pull, fast)

    pull_taking(flower_patch.HELD_PULL_S)()  # held by the SuperLink: no wait before the next pull
    fast.sleep(3)
    pull_taking(0.001)()  # answered at once: Flower's link, the backoff as before
    fast.sleep(3)
    assert slept == [flower_patch.NODE_HELD_WAIT_S, flower_patch.NODE_MIN_WAIT_S]


class HoldingGrid(TimedGrid):
    """A Grid on a SuperLink that holds pulls: a pull comes back when every reply is ready or after ``hold``
    seconds (of ``clock``); replies are ready ``took`` s after their round was pushed."""

    def __init__(self, clock: Clock, took: float, hold: float = 0.5) -> None:
        super().__init__(clock, defaultdict(lambda: took))
        self.hold = hold

    def pull_messages(self, message_ids):
        self.clock.now = min(max(self.ready, self.clock.now), self.clock.now + self.hold)
        return super().pull_messages(message_ids)


@pytest.mark.usefixtures("serverapp_identity")
def test_grid_transport_pulls_at_once_from_a_link_that_holds_pulls(monkeypatch):
    from strategies import transport as transport_module
    from strategies.transport import GridTransport
    from tpflower.records import pack_payload

    clock = Clock()
    monkeypatch.setattr(transport_module, "time", clock)
    grid = HoldingGrid(clock, took=1.2)
    transport = GridTransport(grid, timeout_s=5)
    for _ in range(GridTransport.LEARN_AFTER + 2):
        pulls, pushed = grid.pulls, clock.now
        messages = [Message(pack_payload({"x": np.zeros(2)}, {"phase": "p"}), n, "train") for n in (1, 2)]
        assert len(transport.exchange(messages)) == 2
        assert transport.link_holds
        assert clock.now == pytest.approx(pushed + 1.2)  # picked up the moment they are ready: no waits
        assert grid.pulls - pulls == 3  # held 0.5 s, 0.5 s, then the replies


def test_the_fleet_event_log_layer_runs_only_with_an_event_log_plugin():
    from types import SimpleNamespace

    def scope(path: str, plugin: object) -> dict:
        return {
            "type": "http",
            "path": path,
            "app": SimpleNamespace(state=SimpleNamespace(fleet_event_log_plugin=plugin)),
        }

    assert flower_patch._fleet_event_log(scope("/v1/fleet/pull-messages", object()))
    assert not flower_patch._fleet_event_log(scope("/v1/fleet/pull-messages", None))
    assert not flower_patch._fleet_event_log(scope("/v1/runtime/pull-messages", object()))
    assert not flower_patch._fleet_event_log({"type": "http", "path": "/v1/fleet/x"})  # no app: nothing to log to


def test_the_supernodes_layers_run_unary_and_tracing_only_while_on(monkeypatch, caplog):
    from flwr.supernode import main as supernode_main
    from starlette.testclient import TestClient

    monkeypatch.setattr(supernode_main, "create_app", supernode_main.create_app)  # restored after the test
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="tpflower"):
        m.setattr(flower_guard, "CHECKED", {})
        assert flower_patch.install_gated_supernode_middleware() is False
    assert len(caplog.records) == 1 and "create_app" in caplog.records[0].getMessage()
    flowers = [m.cls for m in supernode_main.create_app().user_middleware]
    assert flower_patch.install_gated_supernode_middleware() is True
    app = supernode_main.create_app()
    gated = [m.kwargs["layer"] for m in app.user_middleware]
    assert gated == flowers  # same layers, same order, none with Starlette's per-request plumbing
    tracing = [c for c in flowers if c.__name__ == "RuntimeTracingMiddleware"]  # Flower 1.41 only
    assert [m.cls for m in app.user_middleware].count(flower_patch.PathGate) == len(tracing)
    assert TestClient(app).get("/health").status_code < 500  # the app still answers


def test_node_services_sharing_a_machine_split_its_cores():
    from simulations import deploy, node

    assert [deploy.node_threads(n, cpus=2) for n in (1, 2, 3, 5)] == [2, 1, 1, 1]
    assert deploy.node_threads(3, cpus=8) == 2
    cmd = deploy.node_command(9092, 9094, "ratings", 0, "c.yaml", "ca.crt", "n.key", torch_threads=1)
    assert cmd[cmd.index("--torch-threads") + 1] == "1"
    assert "--torch-threads" not in deploy.node_command(9092, 9094, "ratings", 0, "c.yaml", "ca.crt", "n.key")
    with pytest.raises(SystemExit):
        node.main(["--client-config", "c.yaml", "--torch-threads", "0"])


def test_after_a_task_the_service_asks_again_only_at_a_ring(monkeypatch):
    from types import SimpleNamespace

    from tpflower.app import node_service

    events, stop = [], threading.Event()

    class Client:
        def AcquireTask(self, request):  # Flower's method name
            events.append("ask")
            if events.count("ask") == 3:
                stop.set()
            first = events.count("ask") == 1
            return SimpleNamespace(HasField=lambda name: first, token="t" if first else "", task=SimpleNamespace())

        def close(self) -> None:
            pass

    monkeypatch.setattr(node_service, "runtime_client", lambda address, token: Client())
    monkeypatch.setattr(node_service, "serve_task", lambda *args: events.append("task") or "")
    monkeypatch.setattr(node_service, "wait_for_ring", lambda bell, timeout: events.append("ring") or True)
    node_service.serve("127.0.0.1:1", None, None, ("a", "1"), stop=stop, bell=object())
    assert events == ["ask", "task", "ring", "ask", "ring", "ask", "ring"]  # no ask without a ring in between
