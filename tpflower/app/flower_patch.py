"""Flower's hard-coded sleeps, shortened: the simulation engine's message fetch and a SuperNode's pull loop
(the node service's Runtime API client is tpflower.app.node_service), its tasks created once their message has
arrived, and the middleware of the SuperLink and the SuperNode run only where it acts.

Flower's simulation engine (flwr/server/superlink/fleet/vce/vce_api.py, ``add_messages_to_queue``) looks for
new messages for the virtual nodes every 0.1 s; a TablePuppet SGD epoch has one round per mini-batch, so that
sleep alone costs ~0.05 s per round. :func:`install_fast_fetch` replaces the loop with the same loop that
polls with a backoff from 0.5 ms (right after a message) to 2 ms (idle), or, with the stored-bells adapter
(:func:`stored_bell`), wakes as each message is stored. :func:`install_node_actors` keeps each virtual node on
one Ray actor. Each install_* function runs only
while the Flower code it relies on is the code it was checked against (tpflower.app.flower_guard); else it
leaves Flower's code alone and logs one notice line.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from queue import Queue
from typing import Any

from tpflower.app.flower_guard import enabled
from tpflower.app.held_pulls import Bell, ringing

MIN_WAIT_S, MAX_WAIT_S = 0.0005, 0.002
log = logging.getLogger("tpflower")


def _engine_loaded() -> bool:
    """Whether this process has imported Flower's simulation engine (the simulation runtime does before it loads
    the ServerApp; a deployed ServerApp's process never does)."""
    return "flwr.server.superlink.fleet.vce.vce_api" in sys.modules


#: how long a loop woken by a stored-message bell waits at most between looks (Flower's own fetch interval)
BELL_IDLE_S = 0.1
_BELL_LOCK = threading.Lock()


def stored_bell(state: Any, method: str, notice: bool = True) -> Bell | None:
    """A bell (tpflower.app.held_pulls.Bell) rung each time ``state.<method>`` (the simulation's in-memory
    LinkState: ``store_message_ins``, ``store_message_res``) has stored a message, so that a loop waiting for
    messages wakes at once instead of at its next poll; None if the stored-bells adapter is off or ``state`` is
    not Flower's in-memory LinkState. Installed once per state and method, as a wrapper on that instance
    (Flower's class is untouched). ``notice``: log the adapter's notice line if Flower's code changed (the fetch
    loop does; the ServerApp's transport, which asks in the same run, does not)."""
    linkstate = sys.modules.get("flwr.server.superlink.linkstate.in_memory_linkstate")  # (not loaded: not one)
    if linkstate is None or not isinstance(state, linkstate.InMemoryLinkState):
        return None
    if not enabled("stored-bells", notice=notice):
        return None
    with _BELL_LOCK:
        bells: dict[str, Bell] = state.__dict__.setdefault("_tpflower_bells", {})
        if method not in bells:
            bells[method] = Bell()
            setattr(state, method, ringing(getattr(state, method), bells[method]))
        return bells[method]


def fast_fetch_loop(state: Any, queue: Queue, nodes_mapping: dict, f_stop: threading.Event) -> None:
    """Flower's add_messages_to_queue (same calls, same order), woken as each message is stored
    (:func:`stored_bell`), else with a millisecond backoff."""
    bell = stored_bell(state, "store_message_ins")
    wait = MIN_WAIT_S
    while not f_stop.is_set():
        seen = bell.rung if bell is not None else 0  # read before looking: a message stored later rings anew
        found = False
        for node_id in nodes_mapping:
            for msg in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
                found = True
        if bell is not None:
            if not found:
                bell.wait(seen, time.monotonic() + BELL_IDLE_S)
            continue
        wait = MIN_WAIT_S if found else min(2 * wait, MAX_WAIT_S)
        f_stop.wait(wait)


def install_fast_fetch(only_if_loaded: bool = False) -> bool:
    """Patch the simulation engine's fetch loop if Flower's is the one this was checked against.

    ``only_if_loaded``: patch only if this process has already imported the engine (the simulation runtime
    does before it loads the ServerApp; a deployment's ServerApp process never does, and importing the
    engine there would add about 1 s to its start)."""
    if only_if_loaded and not _engine_loaded():
        return False
    if not enabled("fast-fetch"):
        return False
    from flwr.server.superlink.fleet.vce import vce_api  # noqa: PLC0415  the engine: about 1 s (docstring above)

    vce_api.add_messages_to_queue = fast_fetch_loop
    return True


#: the simulation engine's worker threads under node actors: each waits for one message's task, so every message of
#: a round is handed to its node's actor at once (an idle thread costs nothing)
NODE_ACTOR_WORKERS = 32
_PIN_LOCK = threading.Lock()


def pinned_submit(pool: Any, actor_fn: Any, job: tuple[Any, Any, str, Any]) -> Any:
    """Flower's ``BasicActorPool.submit`` (simulation/ray_transport/ray_actor.py) with every message of a virtual
    node on one actor: the k-th node seen runs on actor k mod the pool's actors, and its task queues at that actor
    (Ray runs an actor's tasks one at a time, in order) instead of waiting for whichever actor is idle. The actor
    never leaves the pool: :func:`release_future` only forgets the task."""
    app_fn, message, cid, context = job
    with _PIN_LOCK:
        pins: dict[str, Any] = pool.__dict__.setdefault("_tpflower_pins", {})
        if cid not in pins:
            pins[cid] = pool.pool[len(pins) % len(pool.pool)]
        actor = pins[cid]
    future = actor_fn(actor, app_fn, message, cid, context)
    pool._future_to_actor[future] = actor
    return future


def release_future(pool: Any, future: Any) -> None:
    """Flower's ``BasicActorPool.add_actor_back_to_pool`` under :func:`pinned_submit`: the task is done (or
    failed); its actor is in the pool already."""
    pool._future_to_actor.pop(future, None)


def _node_actor_workers(backend: Any) -> int:
    return max(backend.pool.num_actors, NODE_ACTOR_WORKERS) if backend.pool else 0


def install_node_actors(only_if_loaded: bool = False) -> bool:
    """Run each virtual node of Flower's simulation engine on one Ray actor (:func:`pinned_submit`) if the
    engine's code is the one this was checked against; else leave Flower's pool alone and log one notice line.
    ``only_if_loaded``: as :func:`install_fast_fetch`'s.

    Flower hands a node's message to whichever actor is idle, so a node's process-local caches (its table, the
    gbdt owner's parent histograms) are found on about half of its messages with two actors, every actor ends up
    loading every table, and an actor waits for the engine's thread to fetch its reply before it gets the next
    message. Pinned, a table is loaded by one actor, its caches always hit, and a round's messages queue at their
    actors at once. Nodes are spread over the actors by count, not by cost."""
    if only_if_loaded and not _engine_loaded():
        return False
    if not enabled("node-actors"):
        return False
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend  # noqa: PLC0415  Ray: engine only
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool  # noqa: PLC0415  (as above)

    BasicActorPool.submit = pinned_submit  # type: ignore[method-assign,assignment]
    BasicActorPool.add_actor_back_to_pool = release_future  # type: ignore[method-assign,assignment]
    RayBackend.num_workers = property(_node_actor_workers)  # type: ignore[method-assign,assignment]
    return True


class _FastSleepTime:
    """Flower's SuperNode loop (supernode/start_client_internal.py) with its hard-coded sleeps shortened:
    the 3 s after a pull that found no message becomes a backoff from :data:`NODE_MIN_WAIT_S` doubling to
    :data:`NODE_RUN_MAX_WAIT_S` within :data:`NODE_RUN_S` of the last message (a run's next round comes soon),
    to :data:`NODE_MAX_WAIT_S` after; the 0.5 s waits for a reply and its content become
    :data:`NODE_MIN_WAIT_S` (they also reset the idle backoff: a message is being answered). Within a run, the
    first wait after a reply is :data:`NODE_GAP_FRACTION` of the last wait for a message (at most
    :data:`NODE_GAP_MAX_S`): a run's rounds come at a steady pace, and every empty pull is a request to the
    SuperLink. A pull that took :data:`HELD_PULL_S` or longer to come back empty was held by the SuperLink
    (tpflower.app.held_pulls: it waited for a message itself): the next pull comes after :data:`NODE_HELD_WAIT_S`.
    Everything else is the time module."""

    def __init__(self) -> None:
        self._idle = NODE_MIN_WAIT_S
        self._answered = -float("inf")
        self._idle_since: float | None = None  # the first empty pull after the last message
        self._woke = 0.0  # the end of the last wait after an empty pull
        self._gap = 0.0  # the last wait for a message: first empty pull to the last one that found none
        self.pull_s = 0.0  # how long the last pull took (:func:`timed_pulls`)

    def sleep(self, seconds: float) -> None:
        if seconds == 3 and self.pull_s >= HELD_PULL_S:  # an empty pull the SuperLink held: pull again now
            self._idle_since = None
            time.sleep(NODE_HELD_WAIT_S)
        elif seconds == 3:  # the empty pull
            now = time.monotonic()
            in_run = now - self._answered < NODE_RUN_S
            wait = self._idle
            if self._idle_since is None:  # the first empty pull since a message
                self._idle_since = now
                wait = max(wait, min(NODE_GAP_FRACTION * self._gap, NODE_GAP_MAX_S)) if in_run else wait
            time.sleep(wait)
            self._woke = time.monotonic()
            self._idle = min(2 * self._idle, NODE_RUN_MAX_WAIT_S if in_run else NODE_MAX_WAIT_S)
        elif seconds == 0.5:  # waiting for the ClientApp's reply or its object content
            if self._idle_since is not None:  # a message came: how long this node waited for it
                self._gap = max(self._woke - self._idle_since, 0.0)
                self._idle_since = None
            self._idle = NODE_MIN_WAIT_S
            self._answered = time.monotonic()
            time.sleep(NODE_MIN_WAIT_S)
        else:
            time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


NODE_MIN_WAIT_S, NODE_MAX_WAIT_S = 0.005, 0.1
NODE_RUN_S, NODE_RUN_MAX_WAIT_S = 2.0, 0.02  # within a run: at most 20 ms from a message to its pull
NODE_GAP_FRACTION, NODE_GAP_MAX_S = 0.6, 0.25
HELD_PULL_S = 0.2  # an empty pull (or a ServerApp's short one) this long was held by the SuperLink
NODE_HELD_WAIT_S = 0.001
OBJECT_PULL_BACKOFF_S, OBJECT_PULL_CAP_S = 0.005, 0.1  # Flower: from 1 s to 10 s (supercore/constant.py)


def fast_object_pulls(module: Any) -> None:
    """``module``'s ``pull_objects`` (Flower's object pull with retries) retried after milliseconds, not 1 s:
    a message is visible before its objects are pushed, so the first pull often misses by milliseconds."""
    from flwr.supercore.inflatable.inflatable_utils import pull_objects  # noqa: PLC0415

    module.pull_objects = functools.partial(
        pull_objects, initial_backoff=OBJECT_PULL_BACKOFF_S, backoff_cap=OBJECT_PULL_CAP_S
    )


def install_fast_grid_pulls() -> bool:
    """A deployed ServerApp's reply pulls (superlink/grid/http_grid.py) with millisecond object-pull retries,
    if that grid is loaded in this process and its code is the one this was checked against."""
    if "flwr.superlink.grid.http_grid" not in sys.modules:
        return False
    if not enabled("fast-grid-pulls"):
        return False
    fast_object_pulls(sys.modules["flwr.superlink.grid.http_grid"])
    return True


def install_fast_supernode() -> bool:
    """Shorten the SuperNode's sleeps (:class:`_FastSleepTime`) if its loop is the one this was checked
    against; else leave them and log one notice line."""
    if not enabled("fast-supernode"):
        return False
    from flwr.supernode import start_client_internal  # noqa: PLC0415  only in the SuperNode's process

    sleeper = _FastSleepTime()
    start_client_internal.time = sleeper  # type: ignore[assignment]
    start_client_internal._pull_and_store_message = timed_pulls(  # type: ignore[attr-defined]
        start_client_internal._pull_and_store_message, sleeper
    )
    fast_object_pulls(start_client_internal)
    return True


def timed_pulls(pull_and_store: Any, sleeper: _FastSleepTime) -> Any:
    """Flower's ``_pull_and_store_message`` telling ``sleeper`` how long it took (``pull_s``)."""

    @functools.wraps(pull_and_store)
    def pull(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return pull_and_store(*args, **kwargs)
        finally:
            sleeper.pull_s = time.monotonic() - start

    return pull


DOORBELL_ENV = "TPFLOWER_TASK_DOORBELL"  # the node service's loopback UDP port, in its SuperNode's environment
DEFERRED_TASK_ID = -1  # what the deferred create_task hands Flower's code until the task exists


class _DeferredTaskState:
    """A SuperNode's NodeState for one ``_pull_and_store_message`` call, whose ``create_task`` is recorded
    (and done by :func:`tasks_when_ready` once the message's objects are stored); everything else is the state."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self.task: tuple[tuple, dict] | None = None

    def create_task(self, *args: Any, **kwargs: Any) -> int:
        self.task = (args, kwargs)
        return DEFERRED_TASK_ID

    def finish_task(self, task_id: int, *args: Any, **kwargs: Any) -> bool:
        if task_id == DEFERRED_TASK_ID:  # the message's objects failed to arrive: the task is never created
            self.task = None
            return True
        return bool(self._state.finish_task(task_id, *args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


def tasks_when_ready(pull_and_store: Any, ring: Any = None) -> Any:
    """Flower's ``_pull_and_store_message`` (supernode/start_client_internal.py: create the task, then
    pull the message's objects from the SuperLink) with the task created once every object is stored, then
    ``ring()`` (the node service's doorbell). Flower creates it first, so the node service claimed a task whose
    objects were still arriving and pulled them with retries (about twice the requests per message)."""

    @functools.wraps(pull_and_store)
    def pull(*args: Any, state: Any, **kwargs: Any) -> Any:
        deferred = _DeferredTaskState(state)
        run_id = pull_and_store(*args, state=deferred, **kwargs)
        if run_id is not None and deferred.task is not None:
            task_args, task_kwargs = deferred.task
            if state.create_task(*task_args, **task_kwargs) is None:
                log.error("tpflower: the SuperNode could not create the task of a message of run %s", run_id)
            elif ring is not None:
                ring()
        return run_id

    return pull


def doorbell(port: int) -> Any:
    """A function that tells the node service on 127.0.0.1:``port`` (UDP) that a task is waiting. The datagram
    carries nothing; any local process could send one, and all it does is make the service ask for a task."""
    import socket  # noqa: PLC0415

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def ring() -> None:
        try:
            sock.sendto(b"t", ("127.0.0.1", port))
        except OSError:  # the service polls anyway, only slower
            pass

    return ring


def install_tasks_when_ready(port: int | None = None) -> bool:
    """Create a SuperNode's tasks once their message is complete (:func:`tasks_when_ready`), ringing the node
    service's doorbell on ``port`` if given, if Flower's function is the one this was checked against; else
    keep Flower's order and log one notice line. Only for a SuperNode whose tasks the node service answers."""
    if not enabled("tasks-when-ready"):
        return False
    from flwr.supernode import start_client_internal  # noqa: PLC0415  only in the SuperNode's process

    ring = doorbell(port) if port else None
    start_client_internal._pull_and_store_message = tasks_when_ready(  # type: ignore[attr-defined]
        start_client_internal._pull_and_store_message, ring
    )
    return True


class PathGate:
    """A Starlette middleware run only for the requests it acts on (``acts_on(scope)``): any other HTTP request
    goes straight to the next layer (a pure ASGI hop instead of a BaseHTTPMiddleware pass-through, which costs
    an anyio task group and a streamed response per layer and request)."""

    def __init__(self, app: Any, middleware: type, acts_on: Any, **kwargs: Any) -> None:
        self.app = app
        self.middleware = middleware(app, **kwargs)
        self.acts_on = acts_on

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.acts_on(scope):
            await self.app(scope, receive, send)
        else:
            await self.middleware(scope, receive, send)


class UnaryLayer:
    """A BaseHTTPMiddleware ``layer`` run for a Fleet or Runtime API request (unary protobuf calls) without
    Starlette's per-request plumbing (middleware/base.py: an anyio task group, a memory stream and a streamed
    response per layer and request): the layer's own ``dispatch`` gets a ``call_next`` that runs the rest of
    the stack to its end and returns the response whole. Any other request (the Control API's log streams,
    the streamed ``/responses``) keeps the layer's own plumbing."""

    def __init__(self, app: Any, layer: type, **kwargs: Any) -> None:
        self.app = app
        self.layer = layer(app, **kwargs)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not str(scope["path"]).startswith(("/v1/fleet/", "/v1/runtime/")):
            await self.layer(scope, receive, send)
            return
        from starlette.middleware.base import _CachedRequest  # noqa: PLC0415
        from starlette.responses import Response  # noqa: PLC0415

        request = _CachedRequest(scope, receive)  # replays a body the layer read to the layers below

        async def call_next(_request: Any) -> Response:
            start: dict[str, Any] = {}
            body: list[bytes] = []

            async def keep(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    start.update(message)
                elif message["type"] == "http.response.body":
                    body.append(message.get("body", b""))

            await self.app(scope, request.wrapped_receive, keep)
            if not start:
                raise RuntimeError("No response returned.")
            response = Response(b"".join(body), status_code=start["status"])
            response.raw_headers = list(start["headers"])
            return response

        response = await self.layer.dispatch_func(request, call_next)
        await response(scope, request.wrapped_receive, send)


def unary(m: Any, acts_on: Any = None) -> Any:
    """Starlette ``Middleware`` entry ``m`` (a BaseHTTPMiddleware layer) as a :class:`UnaryLayer`, behind a
    :class:`PathGate` when ``acts_on`` says which requests it acts on; any other entry unchanged."""
    from starlette.middleware import Middleware  # noqa: PLC0415
    from starlette.middleware.base import BaseHTTPMiddleware  # noqa: PLC0415

    if m.args or not issubclass(m.cls, BaseHTTPMiddleware):
        return m
    if acts_on is None:
        return Middleware(UnaryLayer, layer=m.cls, **m.kwargs)
    return Middleware(PathGate, middleware=UnaryLayer, acts_on=acts_on, layer=m.cls, **m.kwargs)


def _control_path(scope: Any) -> bool:
    return str(scope["path"]).startswith("/v1/control/")


def _fleet_path(scope: Any) -> bool:
    return str(scope["path"]).startswith("/v1/fleet/")


def _fleet_event_log(scope: Any) -> bool:
    """A Fleet request on a SuperLink with an event log plugin (what FleetEventLogMiddleware checks first)."""
    app = scope.get("app")
    plugin = getattr(getattr(app, "state", None), "fleet_event_log_plugin", None)
    return _fleet_path(scope) and plugin is not None


def _tracing(_scope: Any) -> bool:
    import os  # noqa: PLC0415

    return os.getenv("FLWR_TRACING_ENABLED") == "1"  # what RuntimeTracingMiddleware checks per request


# what each gated layer acts on (its own dispatch returns ``call_next`` at once for any other request), by class
# name: Flower 1.42 dropped RuntimeTracingMiddleware (the guard's hashes pin each dispatch's code)
ACTS_ON = {
    "ControlSensitiveResponseMiddleware": _control_path,
    "ControlAuthenticationMiddleware": _control_path,
    "ControlLicenseMiddleware": _control_path,
    "ControlEventLogMiddleware": _control_path,
    "RuntimeTracingMiddleware": _tracing,
    "NodeAuthMiddleware": _fleet_path,
    "FleetEventLogMiddleware": _fleet_event_log,
}


def gated_middleware(middleware: list[Any]) -> list[Any]:
    """Flower's SuperLink middleware (superlink/main.py ``_get_middleware``: eight BaseHTTPMiddleware layers on
    every request, nine with 1.41's tracing layer), same order, with each layer that acts only on the Control
    API, only on the Fleet API or only when tracing is on behind a :class:`PathGate` saying so (its own code
    returns ``call_next`` at once for any other request: superlink/routers/control/middlewares.py,
    fleet/middlewares.py, fleet/node_auth.py, 1.41's supercore/routers/runtime/tracing.py; the fleet event log
    acts only with an event log plugin, which a SuperLink without one never has). A Fleet request then passes
    three layers (error translation, protobuf translation, node authentication), a ServerApp's Runtime
    request two."""
    return [unary(m, ACTS_ON.get(m.cls.__name__)) for m in middleware]


def install_gated_superlink_middleware() -> bool:
    """Gate the SuperLink's middleware by path (:func:`gated_middleware`) if Flower's stack is the one this was
    checked against; else keep Flower's stack and log one notice line. In the SuperLink's process only."""
    if not enabled("gated-superlink-middleware"):
        return False
    from flwr.superlink import main as superlink_main  # noqa: PLC0415

    flowers = superlink_main._get_middleware
    superlink_main._get_middleware = functools.wraps(flowers)(lambda: gated_middleware(flowers()))
    return True


def gated_supernode_app(create_app: Any) -> Any:
    """Flower's SuperNode Runtime API app (supernode/main.py ``create_app``: two BaseHTTPMiddleware layers on
    every request, three with 1.41's tracing layer) with each layer a :class:`UnaryLayer` and the tracing layer
    behind a :class:`PathGate` (it acts only when tracing is on): a node service's request then passes two
    layers (error and protobuf translation) without Starlette's per-layer plumbing."""

    @functools.wraps(create_app)
    def create(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)
        app.user_middleware = [unary(m, ACTS_ON.get(m.cls.__name__)) for m in app.user_middleware]
        return app

    return create


def install_gated_supernode_middleware() -> bool:
    """Gate the SuperNode Runtime API's tracing layer (:func:`gated_supernode_app`) if Flower's app is the one
    this was checked against; else keep Flower's stack and log one notice line. In the SuperNode's process."""
    if not enabled("gated-supernode-middleware"):
        return False
    from flwr.supernode import main as supernode_main  # noqa: PLC0415  only in the SuperNode's process

    supernode_main.create_app = gated_supernode_app(supernode_main.create_app)
    return True
