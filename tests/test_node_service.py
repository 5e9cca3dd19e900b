"""The owner's node service (tpflower.app.node_service, simulations.node): a run whose app is not the tpflower
the owner installed is refused, with one line naming the node and the app, before any handler runs; a
claimed task always gets a reply and a task output; the handler sees the owner's node config, never the
SuperNode's; the SuperNode adapter patches only the Flower version it was written for."""

from __future__ import annotations

import logging
import os
import pwd
import sys
import threading
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import SubStatus

from tpflower.app import flower_guard, flower_patch, node_service
from tpflower.app.node_service import OwnerNode, answer, installed_app, refusal

OWNER = OwnerNode("d1", 0, "/owner/d1-0.yaml")


def task_message(message_type: str = "query") -> tuple[Message, Context]:
    from flwr.supercore.task_identity import TaskIdentity  # the ServerApp side of the message, for the test

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    msg = Message(RecordDict({"config": ConfigRecord({"phase": "hello"})}), dst_node_id=7, message_type=message_type)
    context = Context(run_id=1, node_id=7, node_config={"table": "d1", "shard": 0}, state=RecordDict(), run_config={})
    return msg, context


def run_of(fab_id: str, fab_version: str) -> SimpleNamespace:
    return SimpleNamespace(fab_id=fab_id, fab_version=fab_version, fab_hash="0" * 64)


def never_called(*_args):
    raise AssertionError("a handler ran for a refused run")


def test_refusal_names_the_node_and_the_app():
    expected = installed_app()
    assert refusal(OWNER.name, *expected, expected) is None
    line = refusal(OWNER.name, "tpflower/tpflower", "0.0.9", expected)
    assert line is not None and "\n" not in line
    assert "table 'd1' shard 0" in line and "tpflower/tpflower 0.0.9" in line and expected[1] in line
    assert "attacker/foreign 1.0" in refusal(OWNER.name, "attacker/foreign", "1.0", expected)


@pytest.mark.parametrize("fab", [("tpflower/tpflower", "0.0.9"), ("attacker/foreign", installed_app()[1])])
def test_a_fab_of_another_version_or_app_is_refused_before_any_handler(fab):
    msg, context = task_message()
    reply, details = answer(msg, context, run_of(*fab), OWNER, never_called, installed_app())
    assert reply.has_error() and "refuses app" in reply.error.reason and "table 'd1' shard 0" in reply.error.reason
    assert details == reply.error.reason
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id


def test_the_handler_sees_the_owners_node_config_and_flowers_is_restored():
    msg, context = task_message()
    seen = {}

    def respond(message_type, content, ctx):
        seen.update(type=message_type, config=dict(ctx.node_config))
        return RecordDict({"info": ConfigRecord({"table": "d1"})})

    reply, details = answer(msg, context, run_of(*installed_app()), OWNER, respond, installed_app())
    assert details == "" and not reply.has_error()
    assert seen == {"type": "query", "config": {"table": "d1", "shard": 0, "client-config": "/owner/d1-0.yaml"}}
    assert dict(context.node_config) == {"table": "d1", "shard": 0}  # what goes back to the SuperNode


def test_a_handler_error_is_the_nodes_error_reply():
    msg, context = task_message("train")

    def respond(*_):
        raise ValueError("table 'd1': column 'x' is not exposed")

    reply, details = answer(msg, context, run_of(*installed_app()), OWNER, respond, installed_app())
    from tpflower.records import error_reason

    assert reply.has_error() and error_reason(reply) == "table 'd1': column 'x' is not exposed" and details


def test_a_refused_task_still_gets_its_reply_and_task_output(monkeypatch):
    msg, context = task_message()
    pushed = []
    monkeypatch.setattr(node_service, "pull_task", lambda client: (msg, context, run_of("attacker/x", "1")))
    monkeypatch.setattr(node_service, "push_message", lambda client, reply, ctx: pushed.append(("reply", reply)))
    monkeypatch.setattr(
        node_service, "push_task_output", lambda **kw: pushed.append(("output", kw["sub_status"], kw["details"]))
    )
    client = SimpleNamespace(SendTaskHeartbeat=lambda req: SimpleNamespace(success=True))
    details = node_service.serve_task(client, OWNER, never_called, installed_app())
    assert [p[0] for p in pushed] == ["reply", "output"]
    assert pushed[0][1].has_error() and pushed[1][1] == SubStatus.FAILED and "refuses app" in details


def test_the_supernode_runs_process_isolated_without_the_owners_paths():
    from simulations.node import supernode_command

    cmd = supernode_command("127.0.0.1:9092", 9094, 'table="d1" shard=0', "ca.crt", "d1.key")
    assert cmd[cmd.index("--isolation") + 1] == "process" and "--insecure" not in cmd
    assert "client-config" not in " ".join(cmd) and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_supernode_adapter_only_on_the_version_it_was_written_for(monkeypatch, caplog):
    from flwr.supernode import start_client_internal

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="tpflower"):
        m.setattr(flower_guard, "CHECKED", {})  # a Flower whose loop changed: Flower's sleeps stay
        assert flower_patch.install_fast_supernode() is False
    assert len(caplog.records) == 1 and "start_client_internal" in caplog.records[0].getMessage()
    monkeypatch.setattr(start_client_internal, "time", start_client_internal.time)  # restored after the test
    assert flower_patch.install_fast_supernode() is True
    fast = start_client_internal.time
    assert fast.monotonic() > 0  # the rest of the time module
    slept = []
    monkeypatch.setattr(flower_patch.time, "sleep", slept.append)
    fast.sleep(3)
    fast.sleep(3)
    fast.sleep(0.5)
    fast.sleep(3)
    assert slept == [
        flower_patch.NODE_MIN_WAIT_S,
        2 * flower_patch.NODE_MIN_WAIT_S,
        flower_patch.NODE_MIN_WAIT_S,
        flower_patch.NODE_MIN_WAIT_S,
    ]
    slept.clear()
    for _ in range(8):  # within a run (a message answered just now): the pull waits stay short
        fast.sleep(3)
    assert max(slept) == flower_patch.NODE_RUN_MAX_WAIT_S
    now = flower_patch.time.monotonic()
    monkeypatch.setattr(flower_patch.time, "monotonic", lambda: now + flower_patch.NODE_RUN_S + 1)
    slept.clear()
    for _ in range(8):  # idle: they grow to the longer cap
        fast.sleep(3)
    assert max(slept) == flower_patch.NODE_MAX_WAIT_S


def test_the_supernode_defers_task_creation_only_when_process_isolated():
    from tpflower.app.supernode import process_isolated

    assert process_isolated(["--insecure", "--isolation", "process", "--port", "1"])
    assert process_isolated(["--isolation=process"])
    assert not process_isolated(["--isolation", "subprocess"]) and not process_isolated(["--insecure"])


class RecordingState:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def create_task(self, **kwargs):
        self.calls.append("create_task")
        return 11

    def store_message(self, message) -> None:
        self.calls.append("store_message")

    def finish_task(self, task_id, sub_status, details) -> bool:
        self.calls.append(f"finish_task {task_id}")
        return True


def flowers_pull_and_store(objects_arrive: bool):
    """Flower 1.41's order in _pull_and_store_message: the task first, then the message and its objects."""

    def pull_and_store(*, state, receive):
        task_id = state.create_task(task_type="clientapp", run_id=5, fab_hash="h")
        state.store_message(receive())
        if not objects_arrive:
            state.finish_task(task_id, sub_status="failed", details="Pulling message objects failed")
            return None
        return 5

    return pull_and_store


def test_a_task_is_created_once_its_message_has_arrived_and_the_doorbell_rings():
    rings = []
    state = RecordingState()
    pull = flower_patch.tasks_when_ready(flowers_pull_and_store(True), lambda: rings.append(1))
    assert pull(state=state, receive=lambda: "message") == 5
    assert state.calls == ["store_message", "create_task"] and rings == [1]
    state = RecordingState()  # objects that never arrive: no task to claim, no ring, nothing to finish
    pull = flower_patch.tasks_when_ready(flowers_pull_and_store(False), lambda: rings.append(2))
    assert pull(state=state, receive=lambda: "message") is None
    assert state.calls == ["store_message"] and rings == [1]


def test_the_doorbell_wakes_the_service_and_only_makes_it_ask():
    bell = node_service.open_doorbell()
    try:
        assert node_service.wait_for_ring(bell, 0.01) is False
        ring = flower_patch.doorbell(bell.getsockname()[1])
        ring()
        ring()
        assert node_service.wait_for_ring(bell, 2.0) is True
        assert node_service.wait_for_ring(bell, 0.01) is False  # both rings taken at once
    finally:
        bell.close()


def test_the_service_asks_for_a_task_at_each_ring(monkeypatch):
    asked = []
    stop = threading.Event()

    class Client:
        def AcquireTask(self, request):  # Flower's method name
            asked.append(request)
            if len(asked) == 3:
                stop.set()
            return SimpleNamespace(HasField=lambda name: False, token="")

        def close(self) -> None:
            pass

    rung = []
    monkeypatch.setattr(node_service, "runtime_client", lambda address, token: Client())
    monkeypatch.setattr(node_service, "wait_for_ring", lambda bell, timeout: rung.append(timeout) or True)
    node_service.serve("127.0.0.1:1", OWNER, never_called, installed_app(), stop=stop, bell=object())
    assert len(asked) == 3 and rung == [node_service.DOORBELL_WAIT_S] * 3  # no polling between rings


def test_superlink_middleware_runs_only_for_the_requests_it_acts_on(monkeypatch, caplog):
    from flwr.superlink import main as superlink_main
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    flowers = superlink_main._get_middleware()
    gated = flower_patch.gated_middleware(flowers)
    assert [m.kwargs["layer"] for m in gated] == [m.cls for m in flowers]  # same layers, same order
    kept = [m.kwargs["layer"].__name__ for m in gated if m.cls is flower_patch.UnaryLayer]
    assert kept == ["BaseHTTPMiddleware", "ProtobufTranslationMiddleware"]  # error and protobuf translation
    gates = [m.kwargs["acts_on"] for m in gated if m.cls is flower_patch.PathGate]
    assert len(gates) == len(flowers) - 2 and flower_patch._fleet_path in gates  # every other layer is gated

    class Tag(BaseHTTPMiddleware):
        async def dispatch(self, request, call_next):
            response = await call_next(request)
            response.headers["x-tag"] = "1"
            return response

    app = Starlette(
        routes=[
            Route(p, lambda r: PlainTextResponse("ok"), methods=["POST"]) for p in ("/v1/fleet/x", "/v1/runtime/y")
        ],
        middleware=[
            Middleware(
                flower_patch.PathGate, middleware=flower_patch.UnaryLayer, acts_on=flower_patch._fleet_path, layer=Tag
            )
        ],
    )
    client = TestClient(app)
    assert client.post("/v1/fleet/x").headers.get("x-tag") == "1"
    assert "x-tag" not in client.post("/v1/runtime/y").headers and client.post("/v1/runtime/y").text == "ok"
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="tpflower"):
        m.setattr(flower_guard, "CHECKED", {})
        assert flower_patch.install_gated_superlink_middleware() is False
    assert len(caplog.records) == 1 and "_get_middleware" in caplog.records[0].getMessage()


def test_a_unary_layer_runs_its_dispatch_as_starlette_would():
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    class Layer(BaseHTTPMiddleware):  # reads the body, may answer by itself, changes the reply
        async def dispatch(self, request, call_next):
            body = await request.body()
            if body == b"refuse":
                return PlainTextResponse("refused", status_code=403)
            response = await call_next(request)
            response.headers["x-read"] = str(len(body))
            return response

    async def echo(request):
        if await request.body() == b"fail":
            raise ValueError("handler failed")
        return Response(b"got " + await request.body(), headers={"x-handler": "1"})

    def stream(_request):
        return StreamingResponse(iter([b"a", b"b"]))

    routes = [Route("/v1/fleet/echo", echo, methods=["POST"]), Route("/v1/control/stream", stream, methods=["POST"])]
    stacks = {
        kind: TestClient(Starlette(routes=routes, middleware=[m]), raise_server_exceptions=False)
        for kind, m in (("starlette", Middleware(Layer)), ("unary", Middleware(flower_patch.UnaryLayer, layer=Layer)))
    }
    for body in (b"x" * 70_000, b"refuse", b"fail"):
        starlette, unary = (stacks[k].post("/v1/fleet/echo", content=body) for k in ("starlette", "unary"))
        assert (unary.status_code, unary.content) == (starlette.status_code, starlette.content)
        assert unary.headers.get("x-read") == starlette.headers.get("x-read")
        assert unary.headers.get("x-handler") == starlette.headers.get("x-handler")
    assert stacks["unary"].post("/v1/fleet/echo", content=b"hi").headers["x-read"] == "2"
    assert stacks["unary"].post("/v1/control/stream").content == b"ab"  # not unary: the layer's own plumbing


AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="switching the SuperNode's OS user needs root")


def test_the_supernode_interpreter_is_checked_before_anything_starts():
    from simulations.node import supernode_command, supernode_start_problem

    assert supernode_start_problem(sys.executable, None, dict(os.environ)) is None
    problem = supernode_start_problem("/nonexistent/python3", None, dict(os.environ))
    assert problem is not None and "\n" not in problem and "/nonexistent/python3" in problem
    assert "--supernode-python" in problem and "--no-supernode" in problem
    cmd = supernode_command("127.0.0.1:9092", 9094, 'table="d1" shard=0', None, None, python="/opt/py/bin/python3")
    assert cmd[:3] == ["/opt/py/bin/python3", "-m", "tpflower.app.supernode"] and "--insecure" in cmd


@AS_ROOT
def test_a_supernode_user_runs_the_supernode_as_that_user():
    import subprocess

    from simulations.node import _as_user

    uid = subprocess.run(["id", "-u"], preexec_fn=_as_user("nobody"), capture_output=True, text=True, check=True)
    assert uid.stdout.strip() == str(pwd.getpwnam("nobody").pw_uid)


@AS_ROOT
def test_a_supernode_user_who_cannot_run_the_interpreter_stops_the_node_with_one_line(tmp_path, capsys):
    from simulations.node import main

    # this venv's interpreter sits under /root (0700 here): the user 'nobody' cannot run it
    (tmp_path / "d1.yaml").write_text("loader: movielens\nkeys: blind\n")  # settings the start check accepts
    args = ["--client-config", str(tmp_path / "d1.yaml"), "--table", "d1", "--superlink", "127.0.0.1:1", "--insecure"]
    assert main([*args, "--supernode-user", "nobody"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "user 'nobody'" in err and "--supernode-python" in err


def test_the_supernode_waits_most_of_a_steady_rounds_gap_in_one_sleep(monkeypatch):
    from flwr.supernode import start_client_internal

    monkeypatch.setattr(start_client_internal, "time", start_client_internal.time)  # restored after the test
    assert flower_patch.install_fast_supernode() is True
    fast, clock = start_client_internal.time, [100.0]
    monkeypatch.setattr(flower_patch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(flower_patch.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    def round_with_gap(gap: float) -> tuple[int, float]:
        """Answer a message, then pull until the next one, which comes ``gap`` s later: (empty pulls, delay)."""
        fast.sleep(0.5)
        arrives, pulls = clock[0] + gap, 0
        while clock[0] < arrives:  # Flower's loop: pull (nothing yet), sleep(3)
            fast.sleep(3)
            pulls += 1
        return pulls, clock[0] - arrives

    first, delay = round_with_gap(0.3)
    assert delay <= flower_patch.NODE_RUN_MAX_WAIT_S
    steady = [round_with_gap(0.3) for _ in range(3)]
    assert all(pulls <= first // 2 for pulls, _ in steady)  # the pace is learnt: half the requests or fewer
    assert all(d <= flower_patch.NODE_RUN_MAX_WAIT_S for _, d in steady)  # and no later pickup
    pulls, delay = round_with_gap(0.05)  # a quicker round after slow ones: picked up after the learnt wait
    assert delay <= flower_patch.NODE_GAP_FRACTION * 0.3 + flower_patch.NODE_RUN_MAX_WAIT_S


def test_the_warm_up_runs_beside_hello_queries_and_before_any_other_message():
    release, started, answered = threading.Event(), threading.Event(), []

    def warm_up() -> None:  # stands in for torch's imports: holds until released
        started.set()
        release.wait(5)

    respond = node_service.warmed(lambda kind, content, context: answered.append(kind) or content, warm_up)
    assert started.wait(5)
    respond("query", RecordDict(), None)  # answered while the warm-up runs
    assert answered == ["query"]
    train = threading.Thread(target=respond, args=("train", RecordDict(), None))
    train.start()
    train.join(0.2)
    assert train.is_alive() and answered == ["query"]  # a training message waits for the warm-up
    release.set()
    train.join(5)
    assert answered == ["query", "train"]


def test_the_warm_up_imports_the_training_code_and_torch_optim():
    import subprocess

    code = (
        "import sys; from tpflower.app.client_app import warm_up; assert 'tpflower.client' not in sys.modules; "
        "warm_up(); assert 'tpflower.client' in sys.modules and 'torch._dynamo' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


BILLING = "customer_id,monthly_charges,plan\nC1,19.5,basic\nC2,20.0,plus\n"
SETTINGS = (
    "table: billing\nsource: billing.csv\nkeys: blind\nprivacy: {name: none}\n"
    "columns: {keys: [customer_id], numeric: [monthly_charges], categorical: [plan]}\n"
)


@pytest.mark.parametrize(
    "settings, data, says",
    [
        (SETTINGS + "min_group_row: 50\n", BILLING, "unknown keys ['min_group_row']"),
        (SETTINGS.replace("billing.csv", "nonexistent.csv"), BILLING, "nonexistent.csv' does not exist"),
        (SETTINGS, BILLING.replace("customer_id", "cust_id"), "has no column(s) ['customer_id']"),
        (SETTINGS.replace("[plan]", "[plan, region]"), BILLING, "has no column(s) ['region']"),
        (SETTINGS.replace("blind", "hmac"), BILLING, "no join-key secret"),
        (SETTINGS + "min_sketch_rows: many\n", BILLING, "min_sketch_rows must be a whole number >= 1, got 'many'"),
        (SETTINGS.replace("{name: none}", "label"), BILLING, "privacy must be a mapping"),
        (  # was the run's first message: "[Errno 17] File exists: '<a path>'", the setting unnamed on both sides
            SETTINGS + "state_dir: billing.csv\n",
            BILLING,
            "billing.csv is not a folder it can write",
        ),
        (SETTINGS + "state_dir: billing.csv/state\n", BILLING, "billing.csv is not a folder it can write"),
        (  # a misspelt bound left the shipped default (5.66) as the floor, silently
            SETTINGS.replace("{name: none}", "{name: label, label_epsilion: 1}"),
            BILLING,
            "unknown keys ['label_epsilion'] under privacy (",
        ),
        (  # a floor no run can meet (or 'five': a ValueError at the run's first message)
            SETTINGS.replace("{name: none}", "{name: dpsgd, epsilon: -1}"),
            BILLING,
            "privacy.epsilon must be a positive number, got -1",
        ),
        (  # these three were found only by a run's first message, the node serving meanwhile
            SETTINGS,
            BILLING.replace("19.5", "n.a.!"),
            "billing.csv: 1 problem in the data: table 'billing', numeric feature 'monthly_charges': "
            "1 non-numeric value, first at row 0 (line 2 of ",
        ),
        (
            SETTINGS,
            BILLING.replace("19.5", "n.a.!"),
            "or declare it categorical in the columns: of its settings file OWNER",
        ),
        (SETTINGS, BILLING.splitlines()[0] + "\n", "table 'billing' has no rows; fill the table"),
        (
            SETTINGS.replace("[plan]", "[plan, monthly_charges]"),
            BILLING,
            "table 'billing', column 'monthly_charges': is declared both numeric and categorical; list it under one of "
            "the two in the columns: of its settings file OWNER",  # was: 'in the dataset config', which a node has not
        ),
        (SETTINGS + "algorithms: [pcg, admn]\n", BILLING, "algorithms names ['admn'], which no installed algorithm"),
        (  # the results.json name of an algorithm is not its family: the cap would bound nothing
            SETTINGS + "exact_releases: {tp_join_admm: 3}\n",
            BILLING,
            "exact_releases names ['tp_join_admm'], which no installed algorithm family is called; the families are",
        ),
    ],
    ids=[
        "typo-key",
        "no-data-file",
        "no-key-column",
        "no-exposed-column",
        "no-secret",
        "bad-value",
        "not-a-mapping",
        "state-dir-a-file",
        "state-dir-under-a-file",
        "privacy-typo-key",
        "privacy-bad-bound",
        "text-in-a-numeric-column",
        "text-in-a-numeric-column-hint",
        "no-rows",
        "numeric-and-categorical",
        "unknown-algorithm",
        "unknown-release-family",
    ],
)
def test_a_node_checks_its_settings_and_data_before_it_starts(tmp_path, monkeypatch, capsys, settings, data, says):
    import subprocess

    from simulations.node import main, settings_problem

    monkeypatch.delenv("TPFLOWER_KEY_SECRET", raising=False)
    (tmp_path / "billing.csv").write_text(data)
    (tmp_path / "owner.yaml").write_text(settings)
    monkeypatch.setattr(subprocess, "Popen", never_called)  # no SuperNode starts
    assert main(["--client-config", str(tmp_path / "owner.yaml"), "--superlink", "127.0.0.1:1", "--insecure"]) == 1
    out, err = capsys.readouterr()
    assert "serving" not in out and len(err.strip().splitlines()) == 1
    says = says.replace("OWNER", str(tmp_path / "owner.yaml"))
    assert err.startswith("error: node table 'billing' shard 0: ") and says in err, err
    (tmp_path / "billing.csv").write_text(BILLING)
    (tmp_path / "owner.yaml").write_text(SETTINGS)
    assert settings_problem(str(tmp_path / "owner.yaml"), "billing") is None


def test_a_supernode_refused_activation_is_told_apart_and_explained():
    import io
    import subprocess

    from simulations.node import forward_output, supernode_exit_line

    # Flower's own exit, as its SuperNode does when the SuperLink refuses to activate its key: the process exits
    # with status 1 (not 305), so only its lines tell this case apart
    flower = (
        "from flwr.supercore.exit import ExitCode, flwr_exit; flwr_exit(ExitCode.SUPERNODE_CONNECTION_ERROR, "
        "'Failed to initialize the connection to the SuperLink.\\n[code: 2004] Failed to activate SuperNode.')"
    )
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", flower], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    seen: set[str] = set()
    out = io.StringIO()
    forward_output(io.StringIO(done.stderr), out, seen)
    assert out.getvalue() == done.stderr  # the owner still sees Flower's lines
    line = supernode_exit_line("table 'd1' shard 0", done.returncode, seen)
    assert "another node with this key is connected" in line and "305" in line and "\n" not in line
    assert "flwr supernode register" in line  # Flower's error is the same for a key the SuperLink does not know
    # another connection error (no SuperLink there, a TLS problem) is not taken for it, nor any other exit
    other = supernode_exit_line("table 'd1' shard 0", 1, {"Exit Code: 305"})
    assert "could not connect" in other and "registered" in other
    assert supernode_exit_line("table 'd1' shard 0", 1, set()).endswith("the SuperNode exited with code 1")


FLOWER_REFUSES = (  # what Flower's SuperNode prints, and its exit status, when the SuperLink refuses its key
    "import sys; print('Exit Code: 305\\nFailed to initialize the connection to the SuperLink.\\n"
    "[code: 2004] Failed to activate SuperNode.', file=sys.stderr); sys.exit(1)"
)


def test_a_refused_supernode_is_started_again_then_the_node_says_why(monkeypatch, capsys):
    import simulations.node as node

    monkeypatch.setattr(node, "ACTIVATION_RETRY_S", 1.0)  # started again for 1 s, at once
    monkeypatch.setattr(node, "RETRY_WAIT_S", 0.0)
    monkeypatch.setattr(node.time, "sleep", lambda _s: None)
    exits: list[int] = []
    stop = threading.Event()
    child = node.SuperNodeChild(
        [sys.executable, "-c", FLOWER_REFUSES], dict(os.environ), None, "t 0", stop, exits.append
    )
    child.watch()
    out, err = capsys.readouterr()
    assert "[code: 2004]" in err  # Flower's lines reach the owner's log
    assert "does not activate this node's key yet" in out.splitlines()[0]  # started again
    last = out.splitlines()[-1]
    assert "another node with this key is connected" in last and "not registered" in last and child.reported.is_set()
    assert stop.is_set() and exits == [1]


FLOWER_RETRIES = (  # Flower's SuperNode when no SuperLink answers at --superlink: it retries without end
    "import sys\nfor s in (1.5, 3.2): print(f'WARNING :   Connection attempt failed, retrying in {s} seconds', "
    "file=sys.stderr)\nsys.exit(1)"
)


def test_a_supernode_without_a_superlink_names_the_address_once(capsys):
    """No SuperLink at --superlink: Flower's SuperNode only said 'Connection attempt failed, retrying' (forever);
    the node now says once which address it waits for."""
    import simulations.node as node

    stop = threading.Event()
    child = node.SuperNodeChild(
        [sys.executable, "-c", FLOWER_RETRIES, "--superlink", "link.example.org:9093"],
        dict(os.environ),
        None,
        "t 0",
        stop,
        lambda _code: None,
    )
    child.proc.wait()
    child.reader.join(timeout=10)
    err = capsys.readouterr().err
    assert err.count("Connection attempt failed") == 2  # Flower's lines reach the owner's log
    says = [line for line in err.splitlines() if line.startswith("node t 0:")]
    assert says == [
        "node t 0: no SuperLink answers at link.example.org:9093 (the SuperNode retries, above, until one does): "
        "check --superlink and that the SuperLink is running"
    ]


def test_a_settings_file_that_is_not_yaml_is_one_line(tmp_path, monkeypatch):
    """A typo in the file's syntax (a [ left open) was the YAML parser's 40-line traceback."""
    import subprocess

    from simulations.node import main, settings_problem

    monkeypatch.setattr(subprocess, "Popen", never_called)
    (tmp_path / "owner.yaml").write_text(SETTINGS.replace("[plan]", "[plan"))
    says = "not valid YAML: while parsing a flow sequence at line 5, column 73, expected ',' or ']', but got '}'"
    with pytest.raises(SystemExit) as stopped:  # the node's table read from the file
        main(["--client-config", str(tmp_path / "owner.yaml"), "--superlink", "127.0.0.1:1", "--insecure"])
    assert str(stopped.value).startswith(f"error: --client-config {tmp_path / 'owner.yaml'}: {says}")
    assert (
        settings_problem(str(tmp_path / "owner.yaml"), "billing")
        == f"{tmp_path / 'owner.yaml'}: {says} at line 5, column 78"
    )


@pytest.mark.parametrize("option", ["--root-certificates", "--auth-supernode-private-key"])
def test_a_node_refuses_a_missing_certificate_or_key_file_at_start(tmp_path, monkeypatch, capsys, option):
    """A missing node key was Flower's FileNotFoundError traceback from the started SuperNode."""
    import subprocess

    from simulations.node import main

    monkeypatch.delenv("TPFLOWER_KEY_SECRET", raising=False)
    monkeypatch.setattr(subprocess, "Popen", never_called)  # no SuperNode starts
    (tmp_path / "billing.csv").write_text(BILLING)
    (tmp_path / "owner.yaml").write_text(SETTINGS)
    (tmp_path / "ca.crt").write_text("")
    (tmp_path / "node.key").write_text("")
    files = {
        "--root-certificates": str(tmp_path / "ca.crt"),
        "--auth-supernode-private-key": str(tmp_path / "node.key"),
    }
    files[option] = str(tmp_path / "missing")
    argv = ["--client-config", str(tmp_path / "owner.yaml"), "--superlink", "127.0.0.1:1"]
    assert main(argv + [a for kv in files.items() for a in kv]) == 1
    err = capsys.readouterr().err
    assert err == f"error: node table 'billing' shard 0: {option} {tmp_path / 'missing'}: no such file\n"


def test_a_node_prints_flowers_log_lines_once(tmp_path, monkeypatch, capsys):
    """The node's log showed each of Flower's lines twice (Flower's handler and, propagated, the node's own),
    and Flower's DEBUG lines too ('Connection attempt failed with exception: ... Connection refused')."""
    import logging
    import subprocess

    from simulations.node import main

    monkeypatch.setattr(logging.getLogger("flwr"), "propagate", True)  # restored after the test
    monkeypatch.setattr(subprocess, "Popen", never_called)
    (tmp_path / "owner.yaml").write_text(SETTINGS)  # no billing.csv: the node stops at its check, after logging is set
    assert main(["--client-config", str(tmp_path / "owner.yaml"), "--superlink", "127.0.0.1:1", "--insecure"]) == 1
    assert not logging.getLogger("flwr").propagate


def test_a_supernode_whose_session_the_superlink_ended_is_reported(monkeypatch, capsys):
    """A SuperLink restarted (without --database) refuses the SuperNode's pull or heartbeat (401) and Flower's
    SuperNode ends 'gracefully', exit 0: the node ended (status 1) without a line saying why."""
    import simulations.node as node

    monkeypatch.setattr(node.time, "sleep", lambda _s: None)
    monkeypatch.setattr(node, "SESSION_WAIT_S", 0.1)
    exits: list[int] = []
    child = node.SuperNodeChild(
        [sys.executable, "-c", "pass"], dict(os.environ), None, "t 0", threading.Event(), exits.append
    )
    child.watch()
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("node t 0: the SuperNode ended (exit code 0): the SuperLink ended this node's session")
    assert "flwr supernode register" in last and child.reported.is_set() and exits == [1]
    # exit 0 on a SIGTERM to the node's process group, the service busy with a task (its handler runs later)
    monkeypatch.setattr(node, "SESSION_WAIT_S", 5.0)
    stop = threading.Event()
    child = node.SuperNodeChild([sys.executable, "-c", "pass"], dict(os.environ), None, "t 0", stop, exits.append)
    threading.Timer(0.3, stop.set).start()
    child.watch()
    assert "node t 0" not in capsys.readouterr().out and not child.reported.is_set() and exits == [1]


def test_a_stopped_node_stops_its_supernode_at_once_and_says_nothing(capsys):
    import time

    from simulations.node import SuperNodeChild

    ignores_sigterm = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    stop = threading.Event()
    exits: list[int] = []
    child = SuperNodeChild([sys.executable, "-c", ignores_sigterm], dict(os.environ), None, "t 0", stop, exits.append)
    watcher = threading.Thread(target=child.watch)
    watcher.start()
    time.sleep(0.5)
    stop.set()  # what SIGTERM does
    began = time.monotonic()
    assert child.terminate(grace=0.5) == -9  # SIGKILL once the grace is over
    watcher.join(timeout=5)
    assert time.monotonic() - began < 3 and not watcher.is_alive()
    assert exits == [] and not child.reported.is_set() and "node" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_node_exits_promptly_on_sigterm(tmp_path):
    import signal
    import subprocess
    import time

    (tmp_path / "owner.yaml").write_text("table: movies\nloader: movielens\nkeys: blind\n")
    cmd = [sys.executable, "-m", "simulations.node", "--client-config", str(tmp_path / "owner.yaml")]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.Popen(
        [*cmd, "--superlink", "127.0.0.1:1", "--insecure"], stdout=subprocess.PIPE, env=env, text=True, cwd=tmp_path
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # the SuperNode runs (retrying its SuperLink) and torch is imported
        if "torch and the training code imported" in line:
            break
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    # before: 2-5 s idle (the interpreter's teardown, a watcher's 5 s); the bound stretches with the machine's
    # load (a busy CI machine took 2.8 s to end the SuperNode child alone)
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert time.monotonic() - began < 2.5 * busy


def test_a_stopped_node_ends_even_if_its_loop_is_stuck():
    import subprocess
    import time

    from simulations.node import end_after

    exits: list[int] = []
    gone = SimpleNamespace(proc=subprocess.Popen([sys.executable, "-c", "pass"]))
    gone.proc.wait()
    began = time.monotonic()
    end_after(gone, 30.0, exits.append)  # its SuperNode ended: the loop is retrying a call to it
    assert exits == [0] and time.monotonic() - began < 3
    running = SimpleNamespace(proc=subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    end_after(running, 0.3, exits.append)  # a task in progress: ended once the time is up, its SuperNode killed
    assert exits == [0, 0] and running.proc.wait(timeout=5) == -9


@pytest.mark.parametrize("given", ["server.key", "node.key.pub", "ca.crt"])
def test_a_node_refuses_root_certificates_that_hold_no_certificate_at_start(tmp_path, monkeypatch, capsys, given):
    """A private key (or any file but a PEM certificate) as --root-certificates was Flower's ssl.SSLError traceback
    from the started SuperNode, whose Runtime API server then kept it, and the node, running: it hung."""
    import subprocess

    from simulations.node import main
    from simulations.pki import make_node_keys, make_server_tls

    monkeypatch.delenv("TPFLOWER_KEY_SECRET", raising=False)
    (tmp_path / "billing.csv").write_text(BILLING)
    (tmp_path / "owner.yaml").write_text(SETTINGS)
    tls = make_server_tls(tmp_path)
    key, _ = make_node_keys(tmp_path / "node.key")
    assert (tls.ca.name, tls.key.name) == ("ca.crt", "server.key")
    started: list[list[str]] = []

    class Started(Exception):
        pass

    def popen(cmd, *_args, **_kwargs):
        started.append(cmd)
        raise Started  # the checks passed: the SuperNode would start here

    monkeypatch.setattr(subprocess, "Popen", popen)
    argv = ["--client-config", str(tmp_path / "owner.yaml"), "--superlink", "127.0.0.1:1"]
    argv += ["--root-certificates", str(tmp_path / given), "--auth-supernode-private-key", str(key)]
    if given == "ca.crt":
        with pytest.raises(Started):
            main(argv)
        assert started
        return
    assert main(argv) == 1 and not started
    err = capsys.readouterr().err
    held = "a private key" if given == "server.key" else "no PEM certificate"
    assert err.startswith(f"error: node table 'billing' shard 0: --root-certificates {tmp_path / given} holds {held} (")
    assert err.endswith(
        "give the CA certificate the SuperLink's operator handed out (ca.crt, '-----BEGIN CERTIFICATE-----')\n"
    )
    assert len(err.splitlines()) == 1


def test_a_supernode_whose_main_raises_exits():
    """Flower's SuperNode raising in its main thread (here: root certificates that hold no certificate) left its
    process alive, held by its Runtime API server's thread; tpflower's SuperNode exits with status 1."""
    import subprocess
    import sys

    from simulations.deploy import free_port

    cmd = [sys.executable, "-m", "tpflower.app.supernode", "--isolation", "process", "--host", "127.0.0.1"]
    cmd += ["--port", str(free_port()), "--superlink", "127.0.0.1:1", "--root-certificates", __file__]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ssl.SSLError" in done.stderr


@pytest.mark.parametrize(
    "shards, shard, says",
    [
        ("", 3, "--shard 3 is no shard of this table (no shards: it serves its whole file as shard 0)"),
        ("shards: {parts: 2, seed: 0}\n", 2, "--shard 2 is no shard of this table (its shards are 0-1)"),
        (
            "shards: {by: plan, values: [basic, plus]}\n",
            -1,
            "--shard -1 is no shard of this table (its shards are 0-1)",
        ),
        ("shards: {parts: 2, seed: 0}\n", 1, None),
        ("shards: {by: plan}\n", 5, None),  # as many shards as the column has values: a run's to tell
    ],
)
def test_a_node_of_a_shard_its_settings_do_not_split_the_file_into_stops_at_start(tmp_path, shards, shard, says):
    """A node started with --shard 3 beside settings without shards served, and every run found a node of a shard
    it does not have."""
    from simulations.node import settings_problem

    (tmp_path / "billing.csv").write_text(BILLING)
    (tmp_path / "owner.yaml").write_text(SETTINGS + shards)
    problem = settings_problem(str(tmp_path / "owner.yaml"), "billing", shard)
    assert problem == (None if says is None else f"table 'billing': {tmp_path / 'owner.yaml'}: {says}")
