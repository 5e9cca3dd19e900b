"""The protocol guard: a client answers only the phases of the algorithm it was set up for, in their order.

Each algorithm family declares its client protocol beside its phase handlers (tpflower/phases/): a sequence
of :class:`Stage` s, each a set of :class:`Phase` s with the clients that answer them (``who``) and how many
messages the stage takes. The client keeps its position in ``context.state`` and refuses, naming the phase,
anything else: a phase of another algorithm or scenario, a setup phase once training started, a phase meant
for other clients (e.g. ``admm_shard`` on a table with one shard), a stage skipped, a phase marked
``spaced`` twice in a row (``evaluate``: at most once per evaluation point; ``admm_consensus``: once per
consensus). Nothing of a refused message is computed, so nothing leaves the client.

Each phase also declares its inputs (:class:`Inputs`): the arrays it accepts at its position. A union-only
array (a sum the server, the shards' coordinator, forms over a sharded table's shards: PCG's ``gram`` and
``g``, L-BFGS's and TP-UCQ-SGD's summed gradient ``g``, TP-UCQ-ADMM's consensus ``v`` and ``w``) is accepted
only on a shard of a sharded table, after this shard answered its own partial products (the phases the
declaration names), once per such answer; any other array is refused, before the phase's position is even
looked at and before the handler runs. Each phase declares too whether its reply is an exact release (``exact``: computed
from the owner's features on arrays the server supplied, without DP noise; ``dp_noised``: not when the run
uses feature DP), which the client charges to its owner's ledger of exact releases (tpflower.releases).

One refusal rule (:func:`refusal`): the line the server receives names the table and the kind of problem,
never the table's contents (no widths, counts, row numbers or values); the owner's node log keeps the detail;
a simulation, where the user plays every owner, shows it in the line.
"""

from __future__ import annotations

import functools
import logging
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tpflower.owner import uses_label_dp
from tpflower.records import Arrays


class GuardState(typing.Protocol):
    """The client state the guard keeps its position in (tpflower.state.ClientState)."""

    def scalar(self, name: str, default: Any = None) -> Any: ...

    def set_scalar(self, name: str, value: Any) -> None: ...

    def set_scalars(self, values: Mapping[str, Any]) -> None: ...


class GuardSettings(typing.Protocol):
    """The client settings the guard and the roles read (the client operator's ClientSettings)."""

    @property
    def table(self) -> str: ...

    @property
    def shard(self) -> int: ...

    @property
    def federated_prep(self) -> bool: ...

    @property
    def owner(self) -> Any: ...  # the owner's settings (tpflower.owner.OwnerSettings): ``deployed``


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


_LOG = logging.getLogger("tpflower")


def refusal(client: GuardedClient, kind: str, detail: str = "") -> ProtocolRefusal:
    """The one refusal rule of a node: the line the server receives names the table (and shard) and ``kind``,
    the kind of problem, which must state nothing of the table's contents (no widths, counts, row numbers or
    values); ``detail`` (what was wrong, with the numbers) goes to the owner's node log on a deployed node and
    into the line in a simulation, where the user plays every owner."""
    s = client.settings
    line = f"table {s.table!r} shard {s.shard}: {kind}"
    if not detail:
        return ProtocolRefusal(line)
    if s.owner.deployed:
        _LOG.error("%s (%s)", line, detail)
        return ProtocolRefusal(f"{line} (the detail is in this node's log)")
    return ProtocolRefusal(f"{line} ({detail})")


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
class Inputs:
    """The arrays a phase accepts at its position in the protocol (the guard refuses any other before the
    handler runs). ``names``: from every client that answers the phase; ``prefixes``: numbered or named
    families of arrays (``rule.<i>``, ``pts.<join>.<j>``); ``union``: union-only arrays, each with a phase
    it follows on the same shard (its own partial products, which the server sums over the table's shards),
    accepted only on a shard of a sharded table, once per answer of that phase."""

    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    union: tuple[tuple[str, str], ...] = ()

    def union_after(self, name: str) -> tuple[str, ...]:
        """The phases after which the union-only array ``name`` may come (none: it is not one)."""
        return tuple(after for n, after in self.union if n == name)

    def accepts(self, name: str) -> bool:
        return name in self.names or any(name.startswith(p) for p in self.prefixes)

    @property
    def all_names(self) -> frozenset[str]:
        return self.names | {n for n, _ in self.union}


def takes(
    *names: str, prefixes: Iterable[str] = (), union: Mapping[str, str | tuple[str, ...]] | None = None
) -> Inputs:
    """The inputs of a phase: ``takes("G", "s", union={"gram": "pcg_gram"})`` (a union-only array may name
    several phases it can follow)."""
    pairs = [(n, a) for n, after in (union or {}).items() for a in ((after,) if isinstance(after, str) else after)]
    return Inputs(frozenset(names), tuple(prefixes), tuple(sorted(pairs)))


#: a phase that takes no array (its settings travel in the config)
NOTHING = Inputs()


@dataclass(frozen=True)
class Phase:
    handler: PhaseHandler
    who: Role = every
    spaced: bool = False  # never twice in a row, never first in its stage
    inputs: Inputs = NOTHING  # the arrays it accepts at its position
    # its reply is an exact release: computed from the owner's features on server-supplied arrays (charged to the
    # owner's ledger of exact releases, tpflower.releases); ``dp_noised``: not when the run uses feature DP (the
    # reply then comes from a model the DP noise hides from the server)
    exact: bool = False
    dp_noised: bool = False


@dataclass(frozen=True)
class Stage:
    name: str
    phases: Mapping[str, Phase]
    calls: int | None = 1  # messages this stage takes (None: any number)


@dataclass(frozen=True)
class Protocol:
    """An algorithm's client protocol: its stages, in order."""

    stages: tuple[Stage, ...]

    # built once per protocol (every message asks): the phases by name, their handlers, and the phases a
    # union-only input follows
    @functools.cached_property
    def handlers(self) -> dict[str, PhaseHandler]:
        return {name: p.handler for name, p in self.phases().items()}

    @functools.cached_property
    def _phases(self) -> dict[str, Phase]:
        return {name: p for s in self.stages for name, p in s.phases.items()}

    def phases(self) -> dict[str, Phase]:
        return self._phases

    @functools.cached_property
    def _partials(self) -> frozenset[str]:
        return frozenset(after for p in self.phases().values() for _, after in p.inputs.union)

    def replied(self, client: GuardedClient, phase: str) -> None:
        """``phase`` was answered (its handler returned): when it is a shard's own partial products (a phase a
        union-only input follows), the server's sum over the shards may come with the next such message."""
        if phase in self._partials:
            client.state.set_scalar("guard.partial", phase)

    def admit(self, client: GuardedClient, phase: str, arrays: Iterable[str] = ()) -> Phase:
        """The :class:`Phase` of ``phase`` if the protocol allows it now with the arrays named ``arrays`` (the
        position moves on); else refuse, naming the phase (and the array)."""
        state = client.state
        cur, calls = int(state.scalar("guard.stage", -1)), int(state.scalar("guard.calls", 0))
        last = state.scalar("guard.last", "")
        where = f"table {client.settings.table!r} shard {client.settings.shard} (algorithm {client.algorithm!r})"

        def refuse(why: str) -> ProtocolRefusal:
            return ProtocolRefusal(f"{where} refuses phase {phase!r}: {why}")

        def admitted(index: int, n: int, p: Phase) -> Phase:
            if not p.who(client):
                raise refuse(f"it is answered by {_ROLE_NAMES.get(p.who, p.who.__name__)} only")
            if p.spaced and (n == 1 or last == phase):
                raise refuse("at most once per step of its stage (never twice in a row, never first)")
            state.set_scalars({"guard.stage": index, "guard.calls": n, "guard.last": phase})
            if any(p.inputs.union_after(name) for name in names):
                state.set_scalar("guard.partial", "")  # the sum is taken once per partial product
            return p

        names = sorted(str(n) for n in arrays)

        def check_input(p: Phase, name: str) -> None:
            if p.inputs.accepts(name):
                return
            after = p.inputs.union_after(name)
            if not after:
                raise refuse(f"array {name!r} is not an input of this phase")
            if not sharded(client):
                raise refuse(f"array {name!r} is a sum over the shards of a sharded table; this table has one shard")
            if state.scalar("guard.partial", "") not in after:
                raise refuse(f"array {name!r} comes only right after this shard's own {' or '.join(after)}")

        if phase not in self.handlers:
            raise refuse(f"not a phase of this algorithm (it answers {sorted(self.handlers)})")
        for name in names:  # first: an array the phase never takes at this position is refused wherever it comes
            check_input(self.phases()[phase], name)
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
