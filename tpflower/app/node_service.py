"""The owner's node service: one long-lived process that answers every message of every run on a SuperNode,
with the owner's installed tpflower client, and never runs code from the submitter's app bundle (FAB).

Flower's extension point for separately managed ClientApps: ``flower-supernode --isolation process``
starts no app process of its own; it serves a Runtime API on loopback and one outside process claims each
task (one task per message). This module is that process. Per task (docs/threat-model.md "The node
service"): ``AcquireTask`` -> ``PullTaskInput`` (context, run, FAB bytes, ignored) -> the message ->
the FAB's identity (publisher/name, version) checked against the installed tpflower -> the handler (the
owner's ClientApp, tpflower.app.client_app) or a refusal -> the reply pushed -> ``PushTaskOutput``. A
claimed task always gets a reply (an error reply when refused or when the handler raises): a task left
without one would block the SuperNode for every later run.

The node config the handler sees is the owner's (table, shard, client-config given to this process), not
the SuperNode's: the settings file, its secret and the data are read only here. Imports, the composed config
and the prepared table stay in this process across messages and runs (tpflower.app.client_app's caches).
The service learns of a task from its doorbell, a loopback UDP socket that the owner's fast SuperNode
(tpflower.app.supernode) rings once a message has fully arrived (:data:`DOORBELL_WAIT_S` between asks
otherwise); without one it polls with a short backoff (:data:`MIN_POLL_S` right after a task, doubling to
:data:`MAX_POLL_S` when idle). It pulls message objects with a millisecond backoff (Flower's default starts at
1 s). Uses Flower's Runtime API client and flwr-clientapp's helpers (supernode/runtime/run_clientapp.py), as
any outside ClientApp process does; tested on the Flower releases pyproject's pin allows (.ci/run tries each).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskRequest,
    PullAppMessagesRequest,
    PullTaskInputRequest,
)
from flwr.supercore.heartbeat import make_task_heartbeat_fn_http
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

APP_ID = "tpflower/tpflower"  # the FAB id of tpflower's app: [tool.flwr.app] publisher / [project] name
TASK_TYPE = "flwr-clientapp"
MIN_POLL_S, MAX_POLL_S = 0.002, 0.05
DOORBELL_WAIT_S = 0.5  # with a doorbell: ask for a task at least this often (a lost ring costs this much)
OBJECT_PULL_BACKOFF_S = 0.005
HEARTBEAT_S = 20.0  # Flower's clientapp: about every 30 s; a task token lapses after about 60 s without one
log = logging.getLogger("tpflower")

Respond = Callable[[str, RecordDict, Context], RecordDict]


def installed_app() -> tuple[str, str]:
    """(FAB id, version) of the tpflower the owner installed: the only app this node answers."""
    return APP_ID, version("tpflower")


def refusal(node: str, fab_id: str, fab_version: str, expected: tuple[str, str]) -> str | None:
    """The one-line refusal of a run whose app is not ``expected`` (id, version), else None.

    The identity is the submitter's claim (a locally submitted FAB carries no signature): it only decides
    whether to refuse; whatever it says, the node runs its own installed code, never the FAB's."""
    if (fab_id, fab_version) == expected:
        return None
    return (
        f"node {node} refuses app {fab_id or '?'} {fab_version or '?'}: it runs only {expected[0]} "
        f"{expected[1]} (the tpflower its owner installed)"
    )


@dataclass(frozen=True)
class OwnerNode:
    """What the owner gives the service: the node's name in error lines and its node config."""

    table: str
    shard: int
    client_config: str

    @property
    def name(self) -> str:
        return f"table {self.table!r} shard {self.shard}"

    def node_config(self) -> dict[str, Any]:
        return {"table": self.table, "shard": self.shard, "client-config": self.client_config}


class TaskToken:
    """The current task's token on every Runtime API call (none between tasks): one client, one connection,
    for every task of the service."""

    def __init__(self) -> None:
        self.token: str | None = None

    def intercept(self, context: Any, call_next: Any) -> Any:
        if self.token:
            return RuntimeTokenHttpInterceptor(self.token).intercept(context, call_next)
        return call_next(context)


def runtime_client(address: str, token: TaskToken | None = None) -> RuntimeHttpClient:
    """A Runtime API client for the SuperNode's loopback ``address`` (plain HTTP), with the task's token."""
    interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")]
    if token is not None:
        interceptors.append(token)
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=True,
        root_certificates=None,
        interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


def pull_task(client: Any) -> tuple[Message, Context, Any]:
    """The task's message, context and run (FAB bytes received and dropped, never written or loaded)."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id  # as Flower's flwr-clientapp does
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode's task has no message")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message,
        initial_backoff=OBJECT_PULL_BACKOFF_S,
        backoff_cap=0.1,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower's flwr-clientapp does
    return message, context, run


def answer(
    message: Message, context: Context, run: Any, owner: OwnerNode, respond: Respond, expected: tuple[str, str]
) -> tuple[Message, str]:
    """The reply to one task's message and the task's sub-status: a refusal before any handler runs when
    the run's app is not ``expected``; the handler's exception as Flower's error reply."""
    refused = refusal(owner.name, str(run.fab_id), str(run.fab_version), expected)
    if refused is not None:
        log.warning("%s", refused)
        return Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=refused), reply_to=message), refused
    flower_config = context.node_config
    context.node_config = owner.node_config()  # the owner's, whatever the SuperNode was started with
    try:
        content = respond(message.metadata.message_type, message.content, context)
        return Message(content, reply_to=message), ""
    except Exception as exc:  # the client's error line goes back to the server (tpflower.records.error_reason)
        log.error("%s: %s: %s", owner.name, type(exc).__name__, exc)
        reason = f"{type(exc)}:<'{exc}'>"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message), reason
    finally:
        context.node_config = flower_config


class KeepAlive:
    """Task heartbeats every :data:`HEARTBEAT_S` while a task is answered (none for a task answered sooner,
    which is nearly every one: the token lapses after about a minute without one)."""

    def __init__(self, client: Any) -> None:
        self._beat = make_task_heartbeat_fn_http(client)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def serve_task(client: Any, owner: OwnerNode, respond: Respond, expected: tuple[str, str]) -> str:
    """Claimed task -> reply pushed -> task output pushed (always, also on failure); returns its details."""
    context = None
    details = "the node service could not read the task"
    status = SubStatus.FAILED
    beat = KeepAlive(client)  # a long handler keeps the task's token alive
    try:
        t0 = time.perf_counter()
        message, context, run = pull_task(client)
        t1 = time.perf_counter()
        reply, details = answer(message, context, run, owner, respond, expected)
        t2 = time.perf_counter()
        push_message(client, reply, context)
        log.debug("task: pulled %.3f s, answered %.3f s, pushed %.3f s", t1 - t0, t2 - t1, time.perf_counter() - t2)
        status = SubStatus.COMPLETED if not details else SubStatus.FAILED
    finally:
        beat.stop()
        push_task_output(client=client, context=context, sub_status=status, details=details)
    return details


def warmed(respond: Respond, warm_up: Callable[[], None]) -> Respond:
    """``respond`` with ``warm_up`` (torch's imports) run at once in a thread: the hello queries are answered
    meanwhile, any other message after it (never two imports of one module at once)."""
    done = threading.Event()

    def run() -> None:
        try:
            warm_up()
        finally:
            done.set()

    threading.Thread(target=run, name="warm-up", daemon=True).start()

    def answer(message_type: str, content: RecordDict, context: Context) -> RecordDict:
        if message_type != "query":
            done.wait()
        return respond(message_type, content, context)

    return answer


def open_doorbell(port: int = 0) -> socket.socket:
    """The service's doorbell: a UDP socket on 127.0.0.1:``port`` (a free one for 0; its port goes to the
    SuperNode, in tpflower.app.flower_patch.DOORBELL_ENV). A ring only makes the service ask for a task."""
    bell = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bell.bind(("127.0.0.1", port))
    bell.setblocking(False)
    return bell


def wait_for_ring(bell: socket.socket, timeout: float) -> bool:
    """Wait up to ``timeout`` for a ring; True if one came (every ring waiting is taken)."""
    ready, _, _ = select.select([bell], [], [], timeout)
    if not ready:
        return False
    try:
        while bell.recv(64):
            pass
    except BlockingIOError:
        pass
    return True


def serve(
    address: str,
    owner: OwnerNode,
    respond: Respond,
    expected: tuple[str, str] | None = None,
    stop: threading.Event | None = None,
    bell: socket.socket | None = None,
) -> None:
    """Claim and answer the SuperNode's tasks until ``stop`` is set (one at a time): asked for when ``bell``
    rings (every :data:`DOORBELL_WAIT_S` at least; after a task too, whose SuperNode creates the next one
    only after the reply, and rings), else polled with a short backoff."""
    expected = expected or installed_app()
    stop = stop or threading.Event()
    token = TaskToken()
    client = runtime_client(address, token)
    wait = MIN_POLL_S
    try:
        while not stop.is_set():
            res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TASK_TYPE]))
            if res.HasField("task") and res.token:
                token.token = res.token
                try:
                    serve_task(client, owner, respond, expected)
                except Exception:  # one task's transport failure must not end the service
                    log.exception("%s: task %s failed", owner.name, res.task.task_id)
                finally:
                    token.token = None
                wait = MIN_POLL_S
                if bell is None:
                    continue
            if bell is not None:  # also right after a task: the SuperNode's next one comes with a ring
                wait_for_ring(bell, DOORBELL_WAIT_S)
                continue
            stop.wait(wait)
            wait = min(2 * wait, MAX_POLL_S)
    finally:
        client.close()


def wait_for_runtime(address: str, timeout: float, alive: Callable[[], bool]) -> None:
    """Wait until the SuperNode's Runtime API port (HOST:PORT) accepts connections; raises if the SuperNode
    exits first or ``timeout`` passes."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the SuperNode exited before its Runtime API on {address} answered")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"the SuperNode's Runtime API on {address} did not answer within {timeout:.0f} s")
