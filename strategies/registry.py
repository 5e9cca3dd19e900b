"""One registry of the federated algorithms (in the spirit of Opacus' register_accountant / create_accountant).

Each algorithm declares itself once, in its own strategies/ module, with :func:`register`: its name, which
`algorithm=` config and scenario select it, its server protocol (a strategy class), its client protocol (the
phases of its tpflower/ module in their order: all a client answers, tpflower.guard), its typed hyperparameters and the privacy
it supports. The entry points, the ClientApp, the privacy checks and the conformance tests look algorithms up
here; :func:`load_all` imports every module of this package, so a new module is found without editing a list.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

from tpflower.guard import Protocol
from tpflower.params import AlgorithmParams


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str  # as in results.json, e.g. "tp_ucq_admm"
    selector: str  # the conf value `algorithm.name` that selects it (conf/algorithm/*.yaml), e.g. "tp_join_admm"
    scenario: str  # "join" | "ucq"
    strategy: type  # the server protocol: a strategies.base.TablePuppetStrategy subclass
    protocol: Protocol  # the client side: its phases (handlers) in their order, checked by the client's guard
    params: type[AlgorithmParams]  # typed algorithm.* settings
    feature_dp: bool = True  # privacy=dpsgd supported
    why_no_feature_dp: str = ""  # shown when privacy=dpsgd is refused
    label_dp: bool = True  # privacy=label supported
    summary: str = ""


_ENTRIES: dict[tuple[str, str], AlgorithmEntry] = {}
_LOADED = False


def register(entry: AlgorithmEntry) -> AlgorithmEntry:
    key = (entry.selector, entry.scenario)
    if key in _ENTRIES and _ENTRIES[key].name != entry.name:
        raise ValueError(f"algorithm={entry.selector} scenario={entry.scenario} is registered twice "
                         f"({_ENTRIES[key].name} and {entry.name})")
    _ENTRIES[key] = entry
    return entry


def load_all() -> None:
    """Import every module of the strategies package (each registers its algorithms)."""
    global _LOADED
    if _LOADED:
        return
    import strategies

    for info in pkgutil.iter_modules(strategies.__path__):
        importlib.import_module(f"strategies.{info.name}")
    _LOADED = True


def entries() -> list[AlgorithmEntry]:
    load_all()
    return sorted(_ENTRIES.values(), key=lambda e: (e.scenario, e.name))


def lookup(algorithm: str, scenario: str) -> AlgorithmEntry:
    """The entry selected by `algorithm=` (its conf name) and `scenario=`; a clear error otherwise."""
    load_all()
    entry = _ENTRIES.get((algorithm, scenario))
    if entry is not None:
        return entry
    for_scenario = sorted(e.selector for e in _ENTRIES.values() if e.scenario == scenario)
    if any(e.selector == algorithm for e in _ENTRIES.values()):
        raise ValueError(f"algorithm {algorithm!r} has no {scenario} version; scenario={scenario} takes "
                         f"algorithm.name in {for_scenario}")
    raise ValueError(f"algorithm {algorithm!r} is not a federated algorithm; choose one of {for_scenario}")


def entry_of(cfg: Any) -> AlgorithmEntry:
    return lookup(str(cfg.algorithm.name), str(cfg.scenario.name))


def by_name(name: str) -> AlgorithmEntry:
    load_all()
    for entry in _ENTRIES.values():
        if entry.name == name:
            return entry
    raise ValueError(f"no registered algorithm is named {name!r}")
