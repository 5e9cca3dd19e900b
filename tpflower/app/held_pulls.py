"""A SuperLink whose message pulls wait for something to return (long polling), for up to :data:`HOLD_S`.

Flower's SuperLink (1.41, 1.42) answers a pull at once, empty or not, and a message is visible before its objects are
pushed: a SuperNode polls for its next message (an empty pull every few milliseconds during a run, each one a
TLS request the SuperLink authenticates) and then retries the object pulls that came too early; the ServerApp
polls for its replies likewise. Here a SuperNode's pull (Fleet API ``pull-messages``) is answered once a
message for that node is there with all its objects, and a ServerApp's (Runtime API ``pull-messages``) once
every reply it asks for is there with all its objects, or after :data:`HOLD_S` with what there is: the same
responses, Flower's handlers, the same authentication (the middleware runs before any handler); only later.
A push of a message or an object (either API) wakes the held pulls, which look again. At most
:data:`MAX_HELD` pulls are held at once (each holds one of the server's worker threads); any other is
answered at once, as Flower does. Clients need no change; tpflower's own (the SuperNode's pull loop in
tpflower.app.flower_patch, strategies.transport.GridTransport) see a held pull by its duration and pull again
at once instead of waiting (flower_patch.HELD_PULL_S). Installed by tpflower.app.superlink while Flower's handlers
are the code this was checked against (tpflower.app.flower_guard); else one notice line and Flower's own handlers.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable
from typing import Any

from tpflower.app.flower_guard import enabled

HOLD_S = 0.5  # longest a pull is held (well within a client's 30 s HTTP timeout)
MAX_HELD = 16  # pulls held at once; the server's thread pool has 40 workers


class Bell:
    """A counter of pushes and a condition to wait for the next one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.rung = 0

    def ring(self) -> None:
        with self._cond:
            self.rung += 1
            self._cond.notify_all()

    def wait(self, seen: int, deadline: float) -> bool:
        """Wait until a ring after ``seen`` (the counter read before the last look) or ``deadline``
        (time.monotonic()); True if one came."""
        with self._cond:
            while self.rung == seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


BELL = Bell()
_SLOTS = threading.BoundedSemaphore(MAX_HELD)


def ringing(handler: Any, bell: Bell = BELL) -> Any:
    """``handler`` (a push) followed by a ring of ``bell``, whatever it returns or raises."""

    @functools.wraps(handler)
    def push(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        finally:
            bell.ring()

    return push


def objects_missing(state: Any, run_id: int, trees: Iterable[Any]) -> bool:
    """Whether any object of the message trees ``trees`` is announced but not yet pushed (Flower's object
    store holds b"" for it)."""
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree  # noqa: PLC0415

    return any(state.get_object(run_id, node.object_id) == b"" for tree in trees for node in iterate_object_tree(tree))


def _wait_for_objects(state: Any, run_id: int, trees: list[Any], deadline: float, bell: Bell) -> None:
    while True:
        seen = bell.rung
        if not objects_missing(state, run_id, trees) or not bell.wait(seen, deadline):
            return


def held_fleet_pull(pull_messages: Any, hold_s: float = HOLD_S, bell: Bell = BELL) -> Any:
    """Flower's Fleet ``pull_messages(request, state, store)`` (one message for the SuperNode), answered once
    a message is there with all its objects, or after ``hold_s`` (see the module doc)."""

    @functools.wraps(pull_messages)
    def pull(request: Any, state: Any, store: Any) -> Any:
        if not _SLOTS.acquire(blocking=False):
            return pull_messages(request=request, state=state, store=store)
        try:
            deadline = time.monotonic() + hold_s
            while True:
                seen = bell.rung
                response = pull_messages(request=request, state=state, store=store)
                if response.messages_list:
                    run_id = response.messages_list[0].metadata.run_id
                    _wait_for_objects(state, run_id, list(response.message_object_trees), deadline, bell)
                    return response
                if not bell.wait(seen, deadline):
                    return response
        finally:
            _SLOTS.release()

    return pull


def held_runtime_pull(pull_messages: Any, hold_s: float = HOLD_S, bell: Bell = BELL) -> Any:
    """Flower's Runtime ``pull_messages(request, state, task)`` (the ServerApp's replies to the messages it
    names), answered once every reply is there with all its objects, or after ``hold_s`` with those there are:
    the replies of several looks, each look Flower's handler for the replies still missing."""

    @functools.wraps(pull_messages)
    def pull(request: Any, state: Any, task: Any) -> Any:
        wanted = set(request.message_ids)
        if not wanted or not _SLOTS.acquire(blocking=False):
            return pull_messages(request, state, task)
        try:
            deadline = time.monotonic() + hold_s
            response = None
            while True:
                seen = bell.rung
                looked = pull_messages(type(request)(message_ids=sorted(wanted)), state, task)
                if response is None:
                    response = looked
                else:
                    response.messages_list.extend(looked.messages_list)
                    response.message_object_trees.extend(looked.message_object_trees)
                wanted -= {m.metadata.reply_to_message_id for m in looked.messages_list}
                if not wanted or not bell.wait(seen, deadline):
                    break
            _wait_for_objects(state, task.run_id, list(response.message_object_trees), deadline, bell)
            return response
        finally:
            _SLOTS.release()

    return pull


def install_held_pulls(hold_s: float = HOLD_S) -> bool:
    """Hold the SuperLink's message pulls (module doc) if Flower's handlers are the ones this was checked
    against; else keep them and log one notice line. In the SuperLink's process only."""
    if not enabled("held-pulls"):
        return False
    from flwr.superlink.servicer.fleet import fleet_handlers  # noqa: PLC0415  only in the SuperLink's process
    from flwr.superlink.servicer.runtime import runtime_handlers  # noqa: PLC0415

    for module in (fleet_handlers, runtime_handlers):
        module.push_messages = ringing(module.push_messages)
        module.push_object = ringing(module.push_object)
    fleet_handlers.pull_messages = held_fleet_pull(fleet_handlers.pull_messages, hold_s)
    runtime_handlers.pull_messages = held_runtime_pull(runtime_handlers.pull_messages, hold_s)
    return True
