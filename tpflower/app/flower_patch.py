"""Flower's hard-coded sleeps, shortened: the simulation engine's message fetch and a SuperNode's pull loop
(the node service's Runtime API client is tpflower.app.node_service).

Flower's simulation engine (flwr/server/superlink/fleet/vce/vce_api.py, ``add_messages_to_queue``) looks for
new messages for the virtual nodes every 0.1 s; a TablePuppet SGD epoch has one round per mini-batch, so that
sleep alone costs ~0.05 s per round. :func:`install_fast_fetch` replaces the loop with the same loop that
polls with a backoff from 0.5 ms (right after a message) to 2 ms (idle). Written against Flower 1.41
(``WRITTEN_FOR``); on any other version it leaves Flower's loop alone and logs one notice line.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from importlib.metadata import version
from queue import Queue
from typing import Any

WRITTEN_FOR: tuple[str, ...] = ("1.41.",)
MIN_WAIT_S, MAX_WAIT_S = 0.0005, 0.002
log = logging.getLogger("tpflower")


def supported(flwr_version: str | None = None, keeping: str | None = None) -> bool:
    """Whether the installed Flower (or ``flwr_version``) is one this module was written for; if not and
    ``keeping`` names what Flower keeps instead, log that in one notice line."""
    flwr_version = flwr_version or version("flwr")
    if flwr_version.startswith(WRITTEN_FOR):
        return True
    if keeping is not None:
        log.warning(
            "tpflower: Flower %s is not %s; keeping %s (slower rounds)",
            flwr_version,
            "/".join(v + "x" for v in WRITTEN_FOR),
            keeping,
        )
    return False


def fast_fetch_loop(state: Any, queue: Queue, nodes_mapping: dict, f_stop: threading.Event) -> None:
    """Flower 1.41's add_messages_to_queue (same calls, same order), with a millisecond backoff."""
    wait = MIN_WAIT_S
    while not f_stop.is_set():
        found = False
        for node_id in nodes_mapping:
            for msg in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
                found = True
        wait = MIN_WAIT_S if found else min(2 * wait, MAX_WAIT_S)
        f_stop.wait(wait)


def install_fast_fetch(flwr_version: str | None = None, only_if_loaded: bool = False) -> bool:
    """Patch the simulation engine's fetch loop if the installed Flower is one this was written for.

    ``only_if_loaded``: patch only if this process has already imported the engine (the simulation runtime
    does before it loads the ServerApp; a deployment's ServerApp process never does, and importing the
    engine there would add about 1 s to its start)."""
    if only_if_loaded and "flwr.server.superlink.fleet.vce.vce_api" not in sys.modules:
        return False
    if not supported(flwr_version, "Flower's own 0.1 s simulation fetch loop"):
        return False
    from flwr.server.superlink.fleet.vce import vce_api  # noqa: PLC0415  the engine: about 1 s (docstring above)

    vce_api.add_messages_to_queue = fast_fetch_loop
    return True


class _FastSleepTime:
    """Flower 1.41's SuperNode loop (supernode/start_client_internal.py) with its hard-coded sleeps shortened:
    the 3 s after a pull that found no message becomes a backoff from :data:`NODE_MIN_WAIT_S` doubling to
    :data:`NODE_MAX_WAIT_S`, and the 0.5 s waits for a reply and its content become :data:`NODE_MIN_WAIT_S`
    (they also reset the idle backoff: a message is being answered). Everything else is the time module."""

    def __init__(self) -> None:
        self._idle = NODE_MIN_WAIT_S

    def sleep(self, seconds: float) -> None:
        if seconds == 3:  # the empty pull
            time.sleep(self._idle)
            self._idle = min(2 * self._idle, NODE_MAX_WAIT_S)
        elif seconds == 0.5:  # waiting for the ClientApp's reply or its object content
            self._idle = NODE_MIN_WAIT_S
            time.sleep(NODE_MIN_WAIT_S)
        else:
            time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


NODE_MIN_WAIT_S, NODE_MAX_WAIT_S = 0.005, 0.1
OBJECT_PULL_BACKOFF_S, OBJECT_PULL_CAP_S = 0.005, 0.1  # Flower: from 1 s to 10 s (supercore/constant.py)


def fast_object_pulls(module: Any) -> None:
    """``module``'s ``pull_objects`` (Flower's object pull with retries) retried after milliseconds, not 1 s:
    a message is visible before its objects are pushed, so the first pull often misses by milliseconds."""
    from flwr.supercore.inflatable.inflatable_utils import pull_objects  # noqa: PLC0415

    module.pull_objects = functools.partial(
        pull_objects, initial_backoff=OBJECT_PULL_BACKOFF_S, backoff_cap=OBJECT_PULL_CAP_S
    )


def install_fast_grid_pulls(flwr_version: str | None = None) -> bool:
    """A deployed ServerApp's reply pulls (superlink/grid/http_grid.py) with millisecond object-pull retries,
    if that grid is loaded in this process and the installed Flower is one this was written for."""
    if "flwr.superlink.grid.http_grid" not in sys.modules:
        return False
    if not supported(flwr_version):
        return False
    fast_object_pulls(sys.modules["flwr.superlink.grid.http_grid"])
    return True


def install_fast_supernode(flwr_version: str | None = None) -> bool:
    """Shorten the SuperNode's sleeps (:class:`_FastSleepTime`) if the installed Flower is one this was
    written for; on any other version leave them and log one notice line."""
    if not supported(flwr_version, "the SuperNode's own 3 s idle pull"):
        return False
    from flwr.supernode import start_client_internal  # noqa: PLC0415  only in the SuperNode's process

    start_client_internal.time = _FastSleepTime()  # type: ignore[assignment]
    fast_object_pulls(start_client_internal)
    return True
