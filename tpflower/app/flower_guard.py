"""Which of tpflower's Flower adapters (tpflower.app.flower_patch, tpflower.app.held_pulls) run with the
installed Flower: each is on only while the Flower code it relies on is the code it was checked against.

Every adapter names the Flower functions it replaces, wraps or whose hard-coded sleeps it shortens
(:data:`ADAPTERS`); :data:`CHECKED` holds a hash of each one's code on the Flower releases it was read and tested
on (the syntax tree of its definition, read from the installed module's file: comments, formatting and moved
lines do not count, any change of code does). A Flower release whose functions hash the same gets the adapter
whatever its version number; a changed function turns that adapter off with one notice line, and Flower's own
code runs (the same results, slower rounds). ``TPFLOWER_FLOWER_ADAPTERS_OFF`` (comma-separated names, or
``all``) turns adapters off by hand: what the adapters bench uses to measure what each one buys.
``python -m simulations.node --check`` prints every adapter's state.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version

OFF_ENV = "TPFLOWER_FLOWER_ADAPTERS_OFF"
ABSENT = "absent"  # a target's "hash" when its module or function is not there
log = logging.getLogger("tpflower")


@dataclass(frozen=True)
class Adapter:
    """One adapter: the Flower functions (``module:qualname``) whose code it relies on, and what Flower keeps
    when it is off (the notice line's words)."""

    name: str
    targets: tuple[str, ...]
    keeping: str


_SUPERNODE = "flwr.supernode.start_client_internal"
_PULL_OBJECTS = "flwr.supercore.inflatable.inflatable_utils:pull_objects"
_TRACING = "flwr.supercore.routers.runtime.tracing:RuntimeTracingMiddleware.dispatch"  # gone in 1.42
_GATED_LAYERS = (  # the layers gated_middleware skips for requests their own dispatch returns at once
    *(
        f"flwr.superlink.routers.control.middlewares:Control{n}Middleware.dispatch"
        for n in ("SensitiveResponse", "Authentication", "License", "EventLog")
    ),
    "flwr.superlink.routers.fleet.node_auth:NodeAuthMiddleware.dispatch",
    "flwr.superlink.routers.fleet.middlewares:FleetEventLogMiddleware.dispatch",
    _TRACING,
)
ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        Adapter(
            "fast-fetch",
            ("flwr.server.superlink.fleet.vce.vce_api:add_messages_to_queue",),
            "Flower's own 0.1 s simulation fetch loop",
        ),
        Adapter(
            "stored-bells",
            (
                "flwr.server.superlink.linkstate.in_memory_linkstate:InMemoryLinkState.store_message_ins",
                "flwr.server.superlink.linkstate.in_memory_linkstate:InMemoryLinkState.store_message_res",
                "flwr.superlink.grid.inmemory_grid:InMemoryGrid.__init__",
            ),
            "polling for the simulation's stored messages and replies",
        ),
        Adapter(
            "node-actors",
            (
                *(
                    f"flwr.simulation.ray_transport.ray_actor:BasicActorPool.{f}"
                    for f in (
                        "submit",
                        "add_actor_back_to_pool",
                        "fetch_result_and_return_actor_to_pool",
                        "terminate_all_actors",
                    )
                ),
                "flwr.server.superlink.fleet.vce.backend.raybackend:RayBackend.num_workers",
                "flwr.server.superlink.fleet.vce.backend.raybackend:RayBackend.process_message",
                "flwr.server.superlink.fleet.vce.vce_api:worker",
                "flwr.server.superlink.fleet.vce.vce_api:run_api",
            ),
            "a node's messages on whichever simulation actor is idle",
        ),
        Adapter(
            "fast-supernode",
            (
                f"{_SUPERNODE}:start_client_internal",
                f"{_SUPERNODE}:_push_messages",
                f"{_SUPERNODE}:_pull_and_store_message",
                _PULL_OBJECTS,
            ),
            "the SuperNode's own 3 s idle pull",
        ),
        Adapter(
            "tasks-when-ready",
            (f"{_SUPERNODE}:_pull_and_store_message",),
            "tasks created before their message's objects arrive",
        ),
        Adapter(
            "fast-grid-pulls",
            ("flwr.superlink.grid.http_grid:HttpGrid.pull_messages", _PULL_OBJECTS),
            "Flower's 1 s first retry of a reply's object pull",
        ),
        Adapter(
            "gated-superlink-middleware",
            ("flwr.superlink.main:_get_middleware", *_GATED_LAYERS),
            "every SuperLink middleware layer on every request",
        ),
        Adapter(
            "gated-supernode-middleware",
            ("flwr.supernode.main:create_app", _TRACING),
            "every SuperNode middleware layer on every request",
        ),
        Adapter(
            "held-pulls",
            tuple(
                f"flwr.superlink.servicer.{api}.{api}_handlers:{f}"
                for api in ("fleet", "runtime")
                for f in ("pull_messages", "push_messages", "push_object")
            ),
            "pulls answered at once (clients poll)",
        ),
    )
}

# sha256 (first 16 hex digits) of each target's syntax tree -> the Flower releases it was checked on (a function
# that differs between releases has one entry per code); a new release: read the diff of the functions whose
# hash it changes, test, add its hashes here (python -m simulations.node --check prints them)
CHECKED: dict[str, dict[str, str]] = {
    "flwr.server.superlink.fleet.vce.vce_api:add_messages_to_queue": {"7c9e5c602a30dbbf": "1.41.0, 1.42.0"},
    "flwr.server.superlink.linkstate.in_memory_linkstate:InMemoryLinkState.store_message_ins": {
        "579e6aebd634c76e": "1.41.0, 1.42.0"
    },
    "flwr.server.superlink.linkstate.in_memory_linkstate:InMemoryLinkState.store_message_res": {
        "a679ed161312aed6": "1.41.0, 1.42.0"
    },
    "flwr.superlink.grid.inmemory_grid:InMemoryGrid.__init__": {"abdc21cc24f13001": "1.41.0, 1.42.0"},
    "flwr.simulation.ray_transport.ray_actor:BasicActorPool.submit": {"14dc2c8fe987648d": "1.41.0, 1.42.0"},
    "flwr.simulation.ray_transport.ray_actor:BasicActorPool.add_actor_back_to_pool": {
        "cdda0799f2bb3dc8": "1.41.0, 1.42.0"
    },
    "flwr.simulation.ray_transport.ray_actor:BasicActorPool.fetch_result_and_return_actor_to_pool": {
        "d88d868f87dbf0ff": "1.41.0, 1.42.0"
    },
    "flwr.simulation.ray_transport.ray_actor:BasicActorPool.terminate_all_actors": {
        "fbc2bc66e5aef1a5": "1.41.0, 1.42.0"
    },
    "flwr.server.superlink.fleet.vce.backend.raybackend:RayBackend.num_workers": {"b09e113ec1d0361e": "1.41.0, 1.42.0"},
    "flwr.server.superlink.fleet.vce.backend.raybackend:RayBackend.process_message": {
        "99d849c4d851662f": "1.41.0, 1.42.0"
    },
    "flwr.server.superlink.fleet.vce.vce_api:worker": {"dab26a82cdf57a8e": "1.41.0, 1.42.0"},
    "flwr.server.superlink.fleet.vce.vce_api:run_api": {"dbae7ca8bbd07378": "1.41.0, 1.42.0"},
    "flwr.supernode.start_client_internal:start_client_internal": {"45eebb903a0a9783": "1.41.0, 1.42.0"},
    "flwr.supernode.start_client_internal:_push_messages": {"eee901d21df66482": "1.41.0, 1.42.0"},
    "flwr.supernode.start_client_internal:_pull_and_store_message": {"ef0d3cf6b6541720": "1.41.0, 1.42.0"},
    "flwr.supercore.inflatable.inflatable_utils:pull_objects": {"edd40d769c5b62af": "1.41.0, 1.42.0"},
    "flwr.superlink.grid.http_grid:HttpGrid.pull_messages": {"c5907b4b852a2411": "1.41.0, 1.42.0"},
    "flwr.superlink.main:_get_middleware": {"d2aaf3c04aff5f04": "1.41.0", "8d0651aff33b8dab": "1.42.0"},
    "flwr.superlink.routers.control.middlewares:ControlSensitiveResponseMiddleware.dispatch": {
        "4a1c6b969de761ff": "1.41.0, 1.42.0"
    },
    "flwr.superlink.routers.control.middlewares:ControlAuthenticationMiddleware.dispatch": {
        "0a3734a3a22f8f2e": "1.41.0, 1.42.0"
    },
    "flwr.superlink.routers.control.middlewares:ControlLicenseMiddleware.dispatch": {
        "176fcc3809664444": "1.41.0, 1.42.0"
    },
    "flwr.superlink.routers.control.middlewares:ControlEventLogMiddleware.dispatch": {
        "b25742fe4c156ddb": "1.41.0, 1.42.0"
    },
    "flwr.superlink.routers.fleet.node_auth:NodeAuthMiddleware.dispatch": {"d80cc591bc8b5665": "1.41.0, 1.42.0"},
    "flwr.superlink.routers.fleet.middlewares:FleetEventLogMiddleware.dispatch": {"bf80cdb65141a520": "1.41.0, 1.42.0"},
    "flwr.supercore.routers.runtime.tracing:RuntimeTracingMiddleware.dispatch": {
        "3e2ab09aa28c58a5": "1.41.0",
        "absent": "1.42.0",
    },
    "flwr.supernode.main:create_app": {"0e75048370a1e636": "1.41.0", "4b6e3dbff368b4d2": "1.42.0"},
    "flwr.superlink.servicer.fleet.fleet_handlers:pull_messages": {"fe54964be8ead73b": "1.41.0, 1.42.0"},
    "flwr.superlink.servicer.fleet.fleet_handlers:push_messages": {"c09089b4314a8a0a": "1.41.0, 1.42.0"},
    "flwr.superlink.servicer.fleet.fleet_handlers:push_object": {"e388766c3c3b2428": "1.41.0, 1.42.0"},
    "flwr.superlink.servicer.runtime.runtime_handlers:pull_messages": {"1bc4cd41d0e76746": "1.41.0, 1.42.0"},
    "flwr.superlink.servicer.runtime.runtime_handlers:push_messages": {"b2d6c8d5ed884acb": "1.41.0, 1.42.0"},
    "flwr.superlink.servicer.runtime.runtime_handlers:push_object": {"2c88a2273e4566d6": "1.41.0, 1.42.0"},
}


def _module_file(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


@cache
def _parsed(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


@cache
def code_hash(target: str) -> str:
    """The hash of Flower's function ``module:qualname`` as the installed module's file defines it (its syntax
    tree, without positions), or :data:`ABSENT` if the module or the function is gone."""
    module, qualname = target.split(":")
    path = _module_file(module)
    if path is None:
        return ABSENT
    body = _parsed(path).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if node is None:
            return ABSENT
        body = node.body  # type: ignore[attr-defined]
    return hashlib.sha256(ast.dump(node).encode()).hexdigest()[:16]


def changed(name: str) -> list[str]:
    """The targets of adapter ``name`` whose installed code is not one of the code versions it was checked
    against (empty: the adapter may run)."""
    return [t for t in ADAPTERS[name].targets if code_hash(t) not in CHECKED.get(t, {})]


def turned_off(name: str) -> bool:
    """Whether ``TPFLOWER_FLOWER_ADAPTERS_OFF`` turns adapter ``name`` off."""
    off = {s.strip() for s in os.environ.get(OFF_ENV, "").split(",")}
    return name in off or "all" in off


def state(name: str) -> tuple[bool, str]:
    """(on, why) of adapter ``name`` with the installed Flower."""
    if turned_off(name):
        return False, f"off by {OFF_ENV}"
    moved = changed(name)
    if moved:
        return False, "changed in this Flower: " + ", ".join(moved)
    return True, "Flower's code is the code it was checked against"


def enabled(name: str, notice: bool = True) -> bool:
    """Whether adapter ``name`` may run; if its Flower code changed, log one notice line (when ``notice``)
    naming the function and what Flower keeps instead."""
    on, why = state(name)
    if not on and notice and not turned_off(name):
        log.warning(
            "tpflower: Flower %s %s; keeping %s (same results, slower rounds)",
            version("flwr"),
            why,
            ADAPTERS[name].keeping,
        )
    return on


def report() -> list[str]:
    """Every adapter's state with the installed Flower, and each Flower function it relies on with its hash and
    the releases that code was checked on (``python -m simulations.node --check``)."""
    lines = [f"Flower {version('flwr')}; tpflower's adapters (on: Flower's code is the code each was checked against)"]
    for name, adapter in ADAPTERS.items():
        on, why = state(name)
        lines.append(f"{name:28} {'on ' if on else 'off'}  {'' if on else why}".rstrip())
        for target in adapter.targets:
            checked = CHECKED.get(target, {}).get(code_hash(target))
            seen = f"checked on {checked}" if checked else "new code: read its diff"
            lines.append(f"    {target} {code_hash(target)} ({seen})")
    return lines
