"""One registry of the federated algorithms (in the spirit of Opacus' register_accountant / create_accountant).

An algorithm family is a pair of modules with the same name: ``tpflower/phases/NAME.py`` (the client side:
its phases, client math, state records and typed parameters) and ``strategies/NAME.py`` (the server protocol
and server math). The client module declares each algorithm of the family once with :func:`register`: its
name, which ``algorithm=`` config and scenario select it, its client protocol (the phases in their order: all
a client answers, tpflower.guard), its typed hyperparameters, the privacy it supports, and the name of its
server class in the same-named strategies module. :func:`load_all` imports every module of tpflower.phases,
so a new family is found without editing a list; the server class is imported by name only when a server
asks for it (:attr:`AlgorithmEntry.strategy`), so a table owner's node never imports server code.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

from tpflower.guard import Protocol
from tpflower.params import AlgorithmParams

#: the packages that hold the two halves of every family: tpflower/phases/NAME.py and strategies/NAME.py
PHASES_PACKAGE = "tpflower.phases"
STRATEGIES_PACKAGE = "strategies"


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str  # as in results.json, e.g. "tp_ucq_admm"
    selector: str  # `algorithm=SELECTOR`: conf/algorithm/SELECTOR.yaml (its `name:`), e.g. "admm"
    scenario: str  # "join" | "ucq"
    family: str  # the module name of both halves: tpflower/phases/FAMILY.py and strategies/FAMILY.py
    strategy_class: str  # the server protocol's class in strategies/FAMILY.py (a strategies.base subclass)
    protocol: Protocol  # the client side: its phases (handlers) in their order, checked by the client's guard
    params: type[AlgorithmParams]  # typed algorithm.* settings
    feature_dp: bool = True  # privacy=dpsgd supported
    why_no_feature_dp: str = ""  # shown when privacy=dpsgd is refused
    label_dp: bool = True  # privacy=label supported
    why_no_label_dp: str = ""  # shown when privacy=label is refused
    summary: str = ""
    federated: bool = True  # False: runs in one place without Flower (the centralized baseline)
    models: tuple[str, ...] = ("linear", "mlp")  # the model.kind it takes (conf/model); others refused
    why_models: str = "boosted trees are algorithm=gbdt (or model=gbdt with algorithm=auto)"  # with the refusal

    @property
    def strategy(self) -> type:
        """The server protocol class (imports strategies/FAMILY.py: server side only)."""
        module = importlib.import_module(f"{STRATEGIES_PACKAGE}.{self.family}")
        return getattr(module, self.strategy_class)


_ENTRIES: dict[tuple[str, str], AlgorithmEntry] = {}
_LOADED = False


def register(entry: AlgorithmEntry) -> AlgorithmEntry:
    key = (entry.selector, entry.scenario)
    if key in _ENTRIES and _ENTRIES[key].name != entry.name:
        raise ValueError(
            f"algorithm={entry.selector} scenario={entry.scenario} is registered twice "
            f"({_ENTRIES[key].name} and {entry.name})"
        )
    _ENTRIES[key] = entry
    return entry


def load_all() -> None:
    """Import every module of tpflower.phases (each family's client module registers its algorithms)."""
    global _LOADED
    if _LOADED:
        return
    phases = importlib.import_module(PHASES_PACKAGE)  # by name: the phases modules import this one
    for info in pkgutil.iter_modules(phases.__path__):
        importlib.import_module(f"{PHASES_PACKAGE}.{info.name}")
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
        raise ValueError(
            f"algorithm {algorithm!r} has no {scenario} version; scenario={scenario} takes algorithm=auto (the "
            f"fastest that fits the run) or one of {for_scenario}"
        )
    raise ValueError(f"algorithm {algorithm!r} is not a federated algorithm; choose one of {for_scenario}")


def prediction_strategy() -> type:
    """The server side of a prediction request (strategies/predict.py; imported by name: server side only)."""
    return importlib.import_module(f"{STRATEGIES_PACKAGE}.predict").FederatedPrediction


def entry_of(cfg: Any) -> AlgorithmEntry:
    return lookup(str(cfg.algorithm.name), str(cfg.scenario.name))


def check_model(entry: AlgorithmEntry, kind: str) -> None:
    """Refuse a model (``model=KIND``) the algorithm does not train, in one line, before any data is loaded."""
    if kind not in entry.models:
        raise ValueError(
            f"algorithm={entry.selector} does not take model={kind} (it takes "
            f"{' or '.join(f'model={m}' for m in entry.models)}): {entry.why_models}"
        )


def algorithm_names() -> dict[str, str]:
    """Every name an owner's ``algorithms`` may hold, to the ``algorithm=`` selector it stands for: each
    algorithm's results.json name (that algorithm alone) and each selector (itself: every scenario's)."""
    out = {e.name: e.selector for e in entries()}
    out.update({e.selector: e.selector for e in entries()})
    return out


def release_families() -> set[str]:
    """Every name an owner's ``exact_releases`` may hold: the families of the installed algorithms (each one's
    exact releases are counted under its family, tpflower.releases)."""
    return {e.family for e in entries()}


def by_name(name: str) -> AlgorithmEntry:
    load_all()
    for entry in _ENTRIES.values():
        if entry.name == name:
            return entry
    raise ValueError(f"no registered algorithm is named {name!r}")
