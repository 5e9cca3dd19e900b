"""The protocol guard: a client answers only the phases of the algorithm it was set up for, in their order.

Each algorithm family declares its client protocol beside its phase handlers (tpflower/phases/): a sequence
of :class:`Stage` s, each a set of :class:`Phase` s with the clients that answer them (``who``) and how many
messages the stage takes. The client keeps its position in ``context.state`` and refuses, naming the phase,
anything else: a phase of another algorithm or scenario, a setup phase once training started, a phase meant
for other clients (e.g. ``admm_shard`` on a table with one shard), a stage skipped, a phase marked
``spaced`` twice in a row (``evaluate``: at most once per evaluation point; ``admm_consensus``: once per
consensus). Nothing of a refused message is computed, so nothing leaves the client.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tpflower.owner import uses_label_dp
from tpflower.records import Arrays


class GuardState(typing.Protocol):
    """The client state the guard keeps its position in (tpflower.state.ClientState)."""

    def scalar(self, name: str, default: Any = None) -> Any: ...

    def set_scalar(self, name: str, value: Any) -> None: ...


class GuardSettings(typing.Protocol):
    """The client settings the guard and the roles read (the client operator's ClientSettings)."""

    @property
    def table(self) -> str: ...

    @property
    def shard(self) -> int: ...

    @property
    def federated_prep(self) -> bool: ...


class GuardData(typing.Protocol):
    """The client data the roles read (tpflower.local_table.ShardData): the labels, None off the label owner."""

    @property
    def y(self) -> Any: ...


class GuardedClient(typing.Protocol):
    """What the guard and the role predicates need of a client (the client operator, TableClient, provides it)."""

    @property
    def state(self) -> GuardState: ...

    @property
    def settings(self) -> GuardSettings: ...

    @property
    def data(self) -> GuardData: ...

    @property
    def algorithm(self) -> str: ...

    def privacy(self) -> Mapping[str, Any]: ...


#: Which clients answer a phase: a predicate on the client (its settings, data and stored privacy).
Role = Callable[[Any], bool]
#: A phase of an algorithm, client side: (client, named arrays, config) -> (named arrays, metrics). The
#: client is the client operator, TableClient (the phases sit above it).
PhaseHandler = Callable[[Any, Arrays, Mapping[str, Any]], tuple[Arrays, dict[str, Any]]]


class ProtocolRefusal(ValueError):
    """A message outside the protocol the client signed up for."""


def every(client: GuardedClient) -> bool:
    return True


def sharded(client: GuardedClient) -> bool:
    """A shard of a table split over several clients (union scenario)."""
    return bool(client.settings.federated_prep)


def unsharded(client: GuardedClient) -> bool:
    return not sharded(client)


def label_dp_owner(client: GuardedClient) -> bool:
    """The label owner under label DP (it alone scores the test predictions; the server has no test labels)."""
    return client.data.y is not None and uses_label_dp(client.privacy())


def chunked_keys(client: GuardedClient) -> bool:
    """Clients whose keys reply came in more than one chunk (tpflower.phases.setup.keys_chunk)."""
    return int(client.state.scalar("keys.chunks", 1)) > 1


_ROLE_NAMES = {
    every: "every client",
    sharded: "the shards of a sharded table",
    unsharded: "tables with one shard",
    label_dp_owner: "the label owner under label DP",
    chunked_keys: "a table whose keys reply is chunked",
}


@dataclass(frozen=True)
class Phase:
    handler: PhaseHandler
    who: Role = every
    spaced: bool = False  # never twice in a row, never first in its stage


@dataclass(frozen=True)
class Stage:
    name: str
    phases: Mapping[str, Phase]
    calls: int | None = 1  # messages this stage takes (None: any number)


@dataclass(frozen=True)
class Protocol:
    """An algorithm's client protocol: its stages, in order."""

    stages: tuple[Stage, ...]

    @property
    def handlers(self) -> dict[str, PhaseHandler]:
        return {name: p.handler for s in self.stages for name, p in s.phases.items()}

    def admit(self, client: GuardedClient, phase: str) -> PhaseHandler:
        """The handler of ``phase`` if the protocol allows it now (the position moves on); else refuse."""
        state = client.state
        cur, calls = int(state.scalar("guard.stage", -1)), int(state.scalar("guard.calls", 0))
        last = state.scalar("guard.last", "")
        where = f"table {client.settings.table!r} shard {client.settings.shard} (algorithm {client.algorithm!r})"

        def refuse(why: str) -> ProtocolRefusal:
            return ProtocolRefusal(f"{where} refuses phase {phase!r}: {why}")

        def admitted(index: int, n: int, p: Phase) -> PhaseHandler:
            if not p.who(client):
                raise refuse(f"it is answered by {_ROLE_NAMES.get(p.who, p.who.__name__)} only")
            if p.spaced and (n == 1 or last == phase):
                raise refuse("at most once per step of its stage (never twice in a row, never first)")
            state.set_scalar("guard.stage", index)
            state.set_scalar("guard.calls", n)
            state.set_scalar("guard.last", phase)
            return p.handler

        if phase not in self.handlers:
            raise refuse(f"not a phase of this algorithm (it answers {sorted(self.handlers)})")
        if cur >= 0:
            stage = self.stages[cur]
            if phase in stage.phases and (stage.calls is None or calls < stage.calls):
                return admitted(cur, calls + 1, stage.phases[phase])
            if any(phase in s.phases for s in self.stages[: cur + 1]):
                raise refuse(f"out of order (this client is past it, at stage {stage.name!r})")
        for index in range(cur + 1, len(self.stages)):
            stage = self.stages[index]
            if phase in stage.phases:
                return admitted(index, 1, stage.phases[phase])
            if any(p.who(client) for p in stage.phases.values()):
                raise refuse(f"stage {stage.name!r} ({', '.join(stage.phases)}) comes first")
        raise AssertionError("unreachable: every phase of the protocol is in some stage")
