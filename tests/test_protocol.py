"""The message layer with canned replies (no Flower runtime): node discovery, error replies, missing replies,
the Grid pull loop, typed settings refused before any client is contacted, the simulation-engine adapter."""

from __future__ import annotations

import logging
import threading
import time
from queue import Queue

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.supercore.task_identity import TaskIdentity

from strategies.base import TablePuppetStrategy
from strategies.transport import DirectTransport, RunError
from tests.conftest import make_cfg
from tpflower.app import flower_guard
from tpflower.app import flower_patch as flower_adapter
from tpflower.app.server_app import make_strategy
from tpflower.records import pack_reply, unpack_payload

KEYS = [("fact", 0), ("dim", 0)]


def answering(tables: dict[int, tuple[str, int]], fail: dict[str, str] | None = None):
    """A ClientApp stand-in: node n holds tables[n]; it echoes ``x`` + 1, or raises fail[phase]."""

    def app(msg: Message, context) -> Message:
        arrays, config = unpack_payload(msg.content)
        table, shard = tables[msg.metadata.dst_node_id]
        if config["phase"] == "hello":
            return Message(pack_reply({}, {"table": table, "shard": shard}), reply_to=msg)
        if fail and config["phase"] in fail:
            raise ValueError(fail[config["phase"]])
        return Message(pack_reply({"x": arrays["x"] + 1}, {"n": len(arrays["x"])}), reply_to=msg)

    return app


class Echo(TablePuppetStrategy):
    """A two-round protocol: send x, get x + 1 back; the rounds' byte counts are recorded."""

    def __init__(self, clients, kinds=("train", "inner")):
        super().__init__(clients, log=lambda _: None)
        self.kinds, self.rounds, self.got = kinds, [], []

    def protocol(self) -> None:
        for kind in self.kinds:
            replies = self.send({k: ({"x": np.arange(3.0)}, {"phase": "echo"}) for k in self.clients}, kind)
            self.got.append(replies)

    def on_round(self, kind, down, up) -> None:
        self.rounds.append((kind, dict(down), dict(up)))


def direct(tables, fail=None) -> DirectTransport:
    return DirectTransport(answering(tables, fail), {n: None for n in tables})


def test_connect_maps_nodes_to_tables_and_rounds_carry_named_arrays():
    strategy = Echo(KEYS)
    strategy.run(direct({7: ("dim", 0), 9: ("fact", 0)}))
    assert strategy.nodes == {("dim", 0): 7, ("fact", 0): 9}
    for replies in strategy.got:
        assert set(replies) == set(KEYS)
        np.testing.assert_array_equal(replies[("fact", 0)][0]["x"], [1.0, 2.0, 3.0])
        assert replies[("dim", 0)][1] == {"n": 3}
    # bytes: the serialized arrays of each message and reply, the same both ways here (same shape and dtype)
    assert [r[0] for r in strategy.rounds] == ["train", "inner"]
    kind, down, up = strategy.rounds[0]
    assert down == up and set(down) == set(KEYS) and all(b > 3 * 8 for b in down.values())


@pytest.mark.parametrize(
    "tables, match",
    [
        ({1: ("fact", 0), 2: ("fact", 0)}, "both hold table 'fact' shard 0"),
        ({1: ("fact", 0), 2: ("other", 0)}, "holds table 'other' shard 0, which this run does not have"),
        ({1: ("fact", 0), 2: ("fact", 1)}, "holds table 'fact' shard 1"),
    ],
)
def test_connect_refuses_duplicate_or_unknown_tables(tables, match):
    with pytest.raises(RunError, match=match):
        Echo(KEYS).run(direct(tables))


def test_too_few_nodes_is_one_error_naming_the_missing_table():
    lines: list[str] = []
    strategy = Echo(KEYS)
    strategy.log, strategy.WAIT_LINE_S = lines.append, 0.1
    with pytest.raises(RunError, match=r"no node holds table 'dim' shard 0 \(1 of 2 nodes connected within 0 s"):
        strategy.run(direct({1: ("fact", 0)}), node_wait_s=0.35)
    # while waiting, a line every WAIT_LINE_S names the missing tables
    assert 2 <= len(lines) <= 4 and all("missing table 'dim' shard 0" in line for line in lines), lines
    # a deployment's nodes come as their owners start them (was: "`flwr run`'s simulation needs num-supernodes=2",
    # which only Flower's simulation engine has)
    assert all(line.endswith("its owner starts it with `tpflower node --client-config OWNER.yaml`)") for line in lines)


def test_too_few_nodes_of_a_simulation_stop_the_run_once_its_node_list_settles():
    """The simulation engine registers all its nodes at once: a missing table stops the run as soon as the node
    list has not changed for SETTLE_S, not after the wait for nodes (120 s by default)."""
    transport = direct({1: ("fact", 0)})
    transport.nodes_fixed = True
    strategy = Echo(KEYS)
    strategy.SETTLE_S = 0.2
    start = time.monotonic()
    with pytest.raises(RunError) as err:
        strategy.run(transport, node_wait_s=60)
    assert time.monotonic() - start < 5
    assert str(err.value) == (
        "no node holds table 'dim' shard 0: the simulation has 1 nodes; one SuperNode per table shard: "
        "`flwr run`'s simulation needs num-supernodes=2"
    )


def test_a_late_node_is_greeted_when_it_connects():
    transport = direct({1: ("fact", 0), 2: ("dim", 0)})
    everyone = transport.contexts
    calls = []

    def node_ids():  # the dim node connects on the third look
        calls.append(1)
        return [1] if len(calls) < 3 else list(everyone)

    transport.node_ids = node_ids
    strategy = Echo(KEYS)
    strategy.run(transport, node_wait_s=5)
    assert strategy.nodes == {("fact", 0): 1, ("dim", 0): 2} and len(calls) == 4  # (once more after each hello)


def test_nodes_that_register_while_the_first_hello_waits_are_greeted_not_counted_missing():
    """The simulation engine starts the ServerApp before it registers its nodes and answers the first hello
    only once its actors are up (seconds): the node list read before that hello is not the settled one."""
    transport = direct({1: ("fact", 0), 2: ("dim", 0)})
    transport.nodes_fixed = True
    registered = [1]
    exchange = transport.exchange

    def slow_first_exchange(messages):
        if len(registered) == 1:  # the engine starts (longer than SETTLE_S) while the dim node registers
            time.sleep(0.3)
            registered.append(2)
        return exchange(messages)

    transport.exchange, transport.node_ids = slow_first_exchange, lambda: list(registered)
    strategy = Echo(KEYS)
    strategy.SETTLE_S = 0.2
    strategy.run(transport, node_wait_s=5)
    assert strategy.nodes == {("fact", 0): 1, ("dim", 0): 2}


def test_a_client_exception_ends_the_run_with_one_line_naming_its_table():
    with pytest.raises(RunError) as err:
        Echo(KEYS).run(direct({1: ("fact", 0), 2: ("dim", 0)}, fail={"echo": "dim.csv row 3: 'abc' is not a number"}))
    assert str(err.value).splitlines() == [
        f"table '{t}' shard 0: dim.csv row 3: 'abc' is not a number" for t in ("dim", "fact")
    ]


class FakeGrid:
    """A Grid whose replies arrive after ``delay_pulls`` pulls; after the hello, ``lost`` nodes reply with
    NODE_UNAVAILABLE (what the SuperLink does for a node that stopped sending heartbeats) and ``silent`` nodes
    never reply."""

    def __init__(self, tables, delay_pulls=3, lost=(), silent=()):
        self.tables, self.delay, self.lost, self.silent = tables, delay_pulls, set(lost), set(silent)
        self.pulls, self.pending, self.app = 0, {}, answering(tables)

    def get_node_ids(self):
        return list(self.tables)

    def push_messages(self, messages):
        ids = []
        for k, msg in enumerate(messages):
            mid = f"m{self.pulls}-{k}-{msg.metadata.dst_node_id}"
            msg.metadata.__dict__["_message_id"] = mid
            self.pending[mid] = msg
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        if self.pulls % self.delay:
            return []
        out = []
        for mid in list(message_ids):
            msg = self.pending.get(mid)
            node, hello = msg.metadata.dst_node_id, unpack_payload(msg.content)[1]["phase"] == "hello"
            if node in self.silent and not hello:
                continue
            if node in self.lost and not hello:
                error = Message(Error(code=3, reason="Node Unavailable"), reply_to=msg)
                error.metadata.__dict__["_src_node_id"] = 1  # written by the SuperLink (SUPERLINK_NODE_ID), as in 1.41
                out.append(error)
            else:
                out.append(self.app(msg, None))
            del self.pending[mid]
        return out


@pytest.fixture
def serverapp_identity(monkeypatch):
    """The identity Flower's ServerApp runtime sets before the app's main runs (a reply Message reads its run id);
    without it these tests passed only after another test had run Flower in the same process."""
    for name in ("_task_id", "_run_id", "_node_id"):
        if getattr(TaskIdentity, name, None) is None:
            monkeypatch.setattr(TaskIdentity, name, 1)


@pytest.mark.usefixtures("serverapp_identity")
def test_grid_transport_pulls_until_every_reply_is_in():
    grid = FakeGrid({1: ("fact", 0), 2: ("dim", 0)})
    strategy = Echo(KEYS)
    strategy.start(grid, timeout=5)
    assert len(strategy.got) == 2 and grid.pulls >= 9


@pytest.mark.usefixtures("serverapp_identity")
def test_a_lost_node_is_one_error_naming_its_table():
    with pytest.raises(RunError, match="table 'dim' shard 0: Node Unavailable"):
        Echo(KEYS).start(FakeGrid({1: ("fact", 0), 2: ("dim", 0)}, lost={2}), timeout=5)


@pytest.mark.usefixtures("serverapp_identity")
def test_a_silent_node_times_out_naming_its_table():
    with pytest.raises(RunError, match="no reply within 0 s from table 'fact' shard 0"):
        Echo(KEYS).start(FakeGrid({1: ("fact", 0), 2: ("dim", 0)}, delay_pulls=1, silent={1}), timeout=0.05)


class Clock:
    """A fake monotonic clock whose sleep advances it (strategies.transport's time, in these tests)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class TimedGrid:
    """A Grid whose replies are ready ``took[phase]`` seconds (of ``clock``) after their round was pushed;
    counts its reply pulls."""

    def __init__(self, clock: Clock, took: dict[str, float]) -> None:
        self.clock, self.took, self.app = clock, took, answering({1: ("fact", 0), 2: ("dim", 0)})
        self.pulls, self.ready, self.pending = 0, 0.0, {}

    def push_messages(self, messages):
        phase = unpack_payload(messages[0].content)[1]["phase"]
        self.ready = self.clock.now + self.took[phase]
        for k, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{self.pulls}-{k}"
            self.pending[f"m{self.pulls}-{k}"] = msg
        return list(self.pending)

    def pull_messages(self, message_ids):
        self.pulls += 1
        if self.clock.now < self.ready:
            return []
        out = [self.app(self.pending.pop(mid), None) for mid in list(message_ids)]
        return out


@pytest.mark.usefixtures("serverapp_identity")
def test_grid_transport_learns_a_rounds_pace_and_pulls_less(monkeypatch):
    from strategies import transport as transport_module
    from strategies.transport import GridTransport
    from tpflower.records import pack_payload

    clock = Clock()
    monkeypatch.setattr(transport_module, "time", clock)
    grid = TimedGrid(clock, {"echo": 0.3, "quick": 0.05})
    transport = GridTransport(grid, timeout_s=5)

    def round_of(phase: str) -> tuple[int, float]:
        """One round: (reply pulls, how long after the replies were ready they were picked up)."""
        pulls = grid.pulls
        messages = [Message(pack_payload({"x": np.zeros(2)}, {"phase": phase}), n, "train") for n in (1, 2)]
        assert len(transport.exchange(messages)) == 2
        return grid.pulls - pulls, clock.now - grid.ready

    unlearnt = [round_of("echo") for _ in range(GridTransport.LEARN_AFTER)]
    learnt = [round_of("echo") for _ in range(3)]
    assert all(pulls <= unlearnt[0][0] // 3 for pulls, _ in learnt)  # a third of the requests or fewer
    step = GridTransport.WAIT_FRACTION * (0.3 + max(d for _, d in unlearnt))  # the unlearnt pull's pace at 0.3 s
    assert all(d <= step + 1e-9 for _, d in unlearnt + learnt)  # and no later pickup than that pace gives
    pulls, delay = round_of("quick")  # another kind of round is not held back by the echo rounds' pace
    assert delay <= 0.1 * 0.05 + 1e-9
    round_of("quick")
    grid.took["echo"] = 0.1  # a quicker echo round: picked up after the learnt wait at the latest
    pulls, delay = round_of("echo")
    assert delay <= GridTransport.LEARNT_FRACTION * (0.3 + step) - 0.1 + 1e-9


# ------------------------------------------------------------------------------------------ typed settings


@pytest.mark.parametrize(
    "algorithm, override, message",
    [
        ("admm", "algorithm.rho=-1", "algorithm.rho must be > 0, got -1"),
        ("admm", "algorithm.variant=fancy", "algorithm.variant must be one of ['sharing', 'paper'], got 'fancy'"),
        ("admm", "algorithm.local_epochs=1.5", "algorithm.local_epochs must be an integer >= 1, got 1.5"),
        ("admm", "+algorithm.rhoo=1", "algorithm.rhoo is not a setting of algorithm 'admm'"),
        ("admm", "epochs=0", "epochs must be an integer >= 1, got 0"),
        ("sgd", "seed=-1", "seed must be an integer >= 0, got -1"),  # was numpy's "expected non-negative integer"
        ("admm", "seed=1.5", "seed must be an integer >= 0, got 1.5"),  # was run, and recorded as seed 1.5
        ("admm", "runtime=flwr", "runtime must be one of ['flower', 'inprocess'], got 'flwr'"),  # was run on Flower
        ("admm", "resume=flase", "resume must be true or false, got 'flase'"),  # was a true string: resumed
        # each was one line per node at its hello, after the data loaded (or its default, silently, for a 0)
        ("admm", "min_group_rows=-1", "min_group_rows must be an integer >= 1, got -1"),
        ("admm", "min_sketch_rows=abc", "min_sketch_rows must be a number, got 'abc'"),
        ("admm", "mapping.keys=foo", "mapping.keys must be one of ['hmac', 'blind'], got 'foo'"),
        ("admm", "mapping.keys_chunk_rows=0", "mapping.keys_chunk_rows must be an integer >= 1, got 0"),
        ("admm", "nodes.reply_timeout_s=abc", "nodes.reply_timeout_s must be a number, got 'abc'"),
        ("admm", "nodes.wait_s=-1", "nodes.wait_s must be a finite number > 0, got -1"),
        ("sgd", "algorithm.lr=abc", "algorithm.lr must be a number, got 'abc'"),
        ("sgd", "algorithm.lr=0", "algorithm.lr must be > 0, got 0"),
        ("sgd", "algorithm.batch_size=-5", "algorithm.batch_size must be an integer >= 1, got -5"),
    ],
)
def test_settings_are_refused_before_any_client_is_contacted(algorithm, override, message):
    with pytest.raises(ValueError) as err:
        make_strategy(make_cfg(f"algorithm={algorithm}", "dataset=synthetic", override), None, log=lambda _: None)
    assert message in str(err.value)


def test_unknown_algorithm_and_missing_union_version():
    with pytest.raises(ValueError, match="'vfl_sgd' has no ucq version") as missing:
        make_strategy(make_cfg("algorithm=vfl_sgd", "scenario=ucq", "dataset=synthetic"), None)
    # the choices a user can type: auto (which runs over a union too) and the union's algorithms
    assert "takes algorithm=auto (the fastest that fits the run) or one of ['admm'," in str(missing.value)
    with pytest.raises(ValueError, match="'centralized' is not a federated algorithm"):
        make_strategy(make_cfg("algorithm=centralized", "dataset=synthetic"), None)


# ------------------------------------------------------------------------------------------ adapter


def test_adapter_leaves_flower_alone_on_another_version(monkeypatch, caplog):
    from flwr.server.superlink.fleet.vce import vce_api

    sentinel = object()
    monkeypatch.setattr(vce_api, "add_messages_to_queue", sentinel)
    monkeypatch.setattr(flower_guard, "CHECKED", {})  # a Flower whose fetch loop changed
    with caplog.at_level(logging.WARNING, logger="tpflower"):
        assert flower_adapter.install_fast_fetch() is False
    assert vce_api.add_messages_to_queue is sentinel
    line = caplog.records[0].getMessage()
    assert len(caplog.records) == 1 and "vce_api:add_messages_to_queue" in line and "0.1 s simulation fetch" in line


def test_adapter_replaces_the_fetch_loop_on_the_version_it_was_written_for(monkeypatch):
    from flwr.server.superlink.fleet.vce import vce_api

    monkeypatch.setattr(vce_api, "add_messages_to_queue", None)
    assert flower_adapter.install_fast_fetch() is True
    assert vce_api.add_messages_to_queue is flower_adapter.fast_fetch_loop


def test_adapter_leaves_a_process_without_the_engine_alone(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "flwr.server.superlink.fleet.vce.vce_api", raising=False)
    assert flower_adapter.install_fast_fetch(only_if_loaded=True) is False
    assert flower_adapter.install_node_actors(only_if_loaded=True) is False
    assert "flwr.server.superlink.fleet.vce.vce_api" not in sys.modules


def test_pinned_submit_keeps_each_node_on_one_actor_and_spreads_nodes_by_count():
    class Pool:
        def __init__(self):
            self.pool, self._future_to_actor = ["A", "B"], {}

    pool, ran = Pool(), []

    def actor_fn(actor, app_fn, message, cid, context):
        ran.append((cid, actor))
        return (cid, len(ran))  # the task's future

    futures = [flower_adapter.pinned_submit(pool, actor_fn, (None, None, cid, None)) for cid in "3140" * 3]
    assert {cid: {a for c, a in ran if c == cid} for cid in "3140"} == {"3": {"A"}, "1": {"B"}, "4": {"A"}, "0": {"B"}}
    assert pool.pool == ["A", "B"] and len(pool._future_to_actor) == 12  # the actors never leave the pool
    for future in futures:
        flower_adapter.release_future(pool, future)
    assert pool._future_to_actor == {} and pool.pool == ["A", "B"]


def test_node_actors_run_every_message_of_a_node_on_one_actor(monkeypatch, tmp_path):
    """On Flower's simulation engine (2 actors, 5 nodes, 8 rounds): each node's replies come from one process, and
    both actors serve nodes. Without the adapter a node lands on whichever actor is idle."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    from simulations.federated import flower_logs_to

    for name in ("submit", "add_actor_back_to_pool"):  # put Flower's own back after the test
        monkeypatch.setattr(BasicActorPool, name, BasicActorPool.__dict__[name])
    monkeypatch.setattr(RayBackend, "num_workers", RayBackend.__dict__["num_workers"])
    assert flower_adapter.install_fast_fetch() and flower_adapter.install_node_actors()
    assert BasicActorPool.submit is flower_adapter.pinned_submit

    client, server, seen = ClientApp(), ServerApp(), {}

    @client.query()
    def pid(msg: Message, context) -> Message:
        import os

        return Message(RecordDict({"r": ConfigRecord({"pid": os.getpid()})}), reply_to=msg)

    @server.main()
    def main(grid: Grid, context) -> None:
        import time

        deadline = time.monotonic() + 120
        while len(nodes := list(grid.get_node_ids())) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine registers its nodes after the ServerApp starts
        for _ in range(8):
            for reply in grid.send_and_receive([Message(RecordDict(), node, "query") for node in nodes]):
                seen.setdefault(reply.metadata.src_node_id, set()).add(reply.content["r"]["pid"])

    with flower_logs_to(tmp_path / "flower.log"):
        run_simulation(
            server_app=server,
            client_app=client,
            num_supernodes=5,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": 2, "logging_level": logging.ERROR, "log_to_driver": False},
            },
        )
    assert len(seen) == 5 and all(len(pids) == 1 for pids in seen.values()), seen
    assert len(set().union(*seen.values())) == 2


def test_fast_fetch_loop_moves_every_message_and_stops():
    class State:
        def __init__(self):
            self.inbox = {1: ["a", "b"], 2: ["c"]}

        def get_message_ins(self, node_id, limit):
            box = self.inbox[node_id]
            return [box.pop(0)] if box else []

    queue, stop, state = Queue(), threading.Event(), State()
    worker = threading.Thread(target=flower_adapter.fast_fetch_loop, args=(state, queue, {1: 0, 2: 1}, stop))
    worker.start()
    got = sorted(queue.get(timeout=2) for _ in range(3))
    stop.set()
    worker.join(timeout=2)
    assert got == ["a", "b", "c"] and not worker.is_alive()


def in_memory_state(monkeypatch, inbox: dict[int, list] | None = None):
    """Flower's in-memory LinkState whose store/get of messages are a plain inbox (any object is a message)."""
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager

    inbox = {} if inbox is None else inbox
    looks = []

    def store(self, message):
        inbox.setdefault(message[0], []).append(message)
        return "id"

    def get(self, node_id, limit):
        looks.append(node_id)
        box = inbox.get(node_id, [])
        return [box.pop(0)] if box else []

    monkeypatch.setattr(InMemoryLinkState, "store_message_ins", store)
    monkeypatch.setattr(InMemoryLinkState, "store_message_res", store)
    monkeypatch.setattr(InMemoryLinkState, "get_message_ins", get)
    state = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()).state()
    return state, inbox, looks


def test_a_stored_bell_rings_after_each_store_of_the_in_memory_link_state_only(monkeypatch):
    state, inbox, _ = in_memory_state(monkeypatch)
    bell = flower_adapter.stored_bell(state, "store_message_res")
    assert bell is not None and flower_adapter.stored_bell(state, "store_message_res") is bell  # installed once
    assert bell.rung == 0
    assert state.store_message_res((7, "reply")) == "id" and bell.rung == 1 and inbox[7] == [(7, "reply")]
    assert flower_adapter.stored_bell(object(), "store_message_res") is None  # a deployment's grid: it polls
    monkeypatch.setenv(flower_guard.OFF_ENV, "stored-bells")
    assert flower_adapter.stored_bell(in_memory_state(monkeypatch)[0], "store_message_res") is None


def test_a_changed_flower_keeps_polling_with_one_notice_line_per_run(monkeypatch, caplog):
    state, _, _ = in_memory_state(monkeypatch)
    monkeypatch.setattr(flower_guard, "CHECKED", {})  # a Flower whose LinkState changed
    with caplog.at_level(logging.WARNING, logger="tpflower"):
        assert flower_adapter.stored_bell(state, "store_message_ins") is None  # the fetch loop's
        assert flower_adapter.stored_bell(state, "store_message_res", notice=False) is None  # the transport's
    lines = [r.getMessage() for r in caplog.records if r.name == "tpflower"]
    assert len(lines) == 1 and "polling for the simulation's stored messages" in lines[0]


def test_the_fetch_loop_waits_for_a_stored_message_instead_of_polling(monkeypatch):
    state, _, looks = in_memory_state(monkeypatch)
    queue, stop = Queue(), threading.Event()
    loop = threading.Thread(target=flower_adapter.fast_fetch_loop, args=(state, queue, {1: 0, 2: 1}, stop))
    loop.start()
    try:
        threading.Event().wait(0.3)
        idle_looks = len(looks)  # a look per node at start and every BELL_IDLE_S (a 2 ms poll: ~150 per node)
        state.store_message_ins((2, "message"))
        got = queue.get(timeout=flower_adapter.BELL_IDLE_S / 2)  # woken by the store, not by its next look
    finally:
        stop.set()
        loop.join(timeout=2)
    assert got == (2, "message") and not loop.is_alive()
    assert idle_looks <= 2 * (0.3 / flower_adapter.BELL_IDLE_S + 2)


@pytest.mark.usefixtures("serverapp_identity")
def test_grid_transport_under_the_simulation_engine_pulls_when_a_reply_is_stored(monkeypatch):
    from strategies.transport import GridTransport
    from tpflower.records import pack_payload

    state, inbox, _ = in_memory_state(monkeypatch)
    app = answering({1: ("fact", 0)})

    class Grid:  # the simulation's in-memory grid: replies reach the state from the engine's thread
        def __init__(self):
            self.state, self.pulls = state, 0

        def push_messages(self, messages):
            messages[0].metadata.__dict__["_message_id"] = "m0"

            def answer():
                threading.Event().wait(0.05)
                state.store_message_res((0, app(messages[0], None)))

            threading.Thread(target=answer).start()
            return ["m0"]

        def pull_messages(self, message_ids):
            self.pulls += 1
            return [reply for _, reply in inbox.pop(0, [])]

    grid = Grid()
    transport = GridTransport(grid, timeout_s=5)
    for _ in range(GridTransport.LEARN_AFTER + 1):
        pulls = grid.pulls
        replies = transport.exchange([Message(pack_payload({"x": np.zeros(2)}, {"phase": "echo"}), 1, "train")])
        assert len(replies) == 1 and grid.pulls - pulls == 2  # one at once, one when the reply was stored


def test_every_failing_client_of_a_round_has_its_own_line():
    fail = {"echo": "its own problem"}
    with pytest.raises(RunError) as err:
        Echo(KEYS).run(direct({1: ("fact", 0), 2: ("dim", 0)}, fail=fail))
    assert str(err.value).splitlines() == [
        "table 'dim' shard 0: its own problem",
        "table 'fact' shard 0: its own problem",
    ]


class GoneAtHello(FakeGrid):
    """The SuperLink still lists a node whose SuperNode died (its session not yet expired): the hello to it
    comes back NODE_UNAVAILABLE ``gone`` times; then its owner's restarted node (same key, same id) answers."""

    def __init__(self, tables, gone):
        super().__init__(tables, delay_pulls=1)
        self.gone = dict(gone)

    def pull_messages(self, message_ids):
        out = []
        for mid in list(message_ids):
            msg = self.pending[mid]
            node, phase = msg.metadata.dst_node_id, unpack_payload(msg.content)[1]["phase"]
            if phase == "hello" and self.gone.get(node, 0) > 0:
                self.gone[node] -= 1
                error = Message(Error(code=5, reason="Node Unavailable"), reply_to=msg)  # ErrorCode.NODE_UNAVAILABLE
                error.metadata.__dict__["_src_node_id"] = 1
                out.append(error)
            else:
                out.append(self.app(msg, None))
            del self.pending[mid]
        return out


@pytest.mark.usefixtures("serverapp_identity")
def test_a_node_gone_before_its_hello_is_waited_for_not_a_refusal():
    """A run submitted right after a node crashed: the hello to its dead session comes back 'Node Unavailable'
    (was: the run stopped, naming only a node id); the run waits for its table and greets the node its owner
    started again."""
    lines: list[str] = []
    strategy = Echo(KEYS)
    strategy.log = lines.append
    strategy.GONE_RETRY_S = 0.05
    strategy.start(GoneAtHello({1: ("fact", 0), 2: ("dim", 0)}, gone={2: 1}), timeout=5)
    assert strategy.nodes == {("fact", 0): 1, ("dim", 0): 2} and len(strategy.got) == 2
    assert lines[0] == (
        "node 2 did not answer the hello (Node Unavailable): its SuperNode stopped; waiting for the tables no node "
        "holds (a node started again joins the run)"
    )


@pytest.mark.usefixtures("serverapp_identity")
def test_a_node_gone_for_good_stops_the_run_naming_its_table_after_the_wait():
    strategy = Echo(KEYS)
    strategy.GONE_RETRY_S = 0.05
    with pytest.raises(RunError, match=r"^no node holds table 'dim' shard 0 \(1 of 2 nodes connected within 0 s"):
        strategy.start(GoneAtHello({1: ("fact", 0), 2: ("dim", 0)}, gone={2: 10**6}), timeout=5, node_wait_s=0.3)
