"""One line for a Hydra error composing the run config (Hydra prints several): the keys valid in place of an
unknown one, and for ``algorithm.KEY`` with ``algorithm=auto`` the settings of the algorithm auto picks."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from tpflower import registry
from tpflower.auto import choose
from tpflower.config import CONF_DIR, compose_config

#: Hydra's message for an override of a key the composed config lacks (a typo, or a setting of another choice)
NO_SUCH_KEY = re.compile(r"Could not override '([^']+)'")


def override_key(override: str) -> str:
    """The key of a ``KEY=VALUE`` override (without Hydra's ``+``, ``++`` and ``~`` prefixes)."""
    return override.split("=", 1)[0].lstrip("+~")


def override_error(
    exc: BaseException,
    overrides: Sequence[str],
    base_dir: str | Path | None = None,
    dataset: dict | None = None,
) -> str:
    """One line for a Hydra error composing ``overrides`` (and ``dataset``, as :func:`compose_config`; Hydra
    prints several lines): for a key the config lacks,
    the keys valid in its place and the closest one (difflib); ``algorithm.KEY`` with ``algorithm=auto``, the
    settings of the algorithm auto picks (docs/settings.md); any other error, Hydra's message on one line."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, OverrideParseException):
        return grammar_error(exc, overrides)
    match = NO_SUCH_KEY.match(str(exc))
    if match is None:
        return text
    key, failing = match.group(1), {match.group(1)}
    for _ in overrides:  # compose without the unknown keys, to list what is valid in their place
        try:
            cfg = compose_config(*(o for o in overrides if override_key(o) not in failing), dataset=dataset)
            break
        except HydraException as again:
            more = NO_SUCH_KEY.match(str(again))
            if more is None:
                return text
            failing.add(more.group(1))
    else:
        return text
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return text
    if parent == "algorithm" and str(cfg.algorithm.name) == "auto":
        value = next(o.split("=", 1)[1] for o in overrides if override_key(o) == key)
        return auto_setting_error(cfg, leaf, value, base_dir)
    valid = sorted(str(k) for k in node if k != "hydra" and not (parent == "algorithm" and k == "name"))
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    if not parent:
        groups = [k for k in valid if (Path(CONF_DIR) / str(k)).is_dir()]
        settings = [k for k in valid if k not in groups]
        if not close:  # a group's setting given without its group (trees=10 for algorithm.trees=10)
            owners = [f"{g}.{leaf}" for g in groups if isinstance(cfg.get(g), DictConfig) and leaf in cfg[g]]
            hint = f" (did you mean {' or '.join(owners)}?)" if owners else ""
            if not owners and str(cfg.algorithm.name) == "auto":  # auto has none: the algorithms that have it
                hint = algorithms_with(leaf, next(o.split("=", 1)[1] for o in overrides if override_key(o) == key))
        return f"{key} is not a setting of the config{hint}; its groups: {groups}; its settings: {settings}"
    what = f"algorithm {str(cfg.algorithm.name)!r}" if parent == "algorithm" else parent
    add = f"; +{key}=... adds it" if parent == "dataset" else ""
    return f"{key} is not a setting of {what}{hint}; its settings: {valid}{add}"


def algorithms_with(leaf: str, value: str) -> str:
    """The hint for ``LEAF=VALUE`` under ``algorithm=auto`` when LEAF is a setting of some algorithms (``trees=10``:
    gbdt's), which auto's choice may not be: choose one of them."""
    names = {e.selector for e in registry.entries() if leaf in {f.name for f in fields(e.params)}}
    selectors = sorted(names, key=lambda s: (s.startswith("centralized"), s))  # the federated ones first
    if not selectors:
        return ""
    return (
        f" (did you mean algorithm.{leaf}? a setting of algorithm={', '.join(selectors)}, not of algorithm=auto:"
        f" choose one, e.g. algorithm={selectors[0]} algorithm.{leaf}={value})"
    )


def grammar_error(exc: OverrideParseException, overrides: Sequence[str]) -> str:
    """The override Hydra's grammar refuses, named, with Hydra's reason (Hydra's own names no override)."""
    reason = str(exc).splitlines()[0].strip()
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as one:
            reason = str(one).splitlines()[0].strip()
            return f"{override}: not an override Hydra reads ({reason}); {GRAMMAR_DOCS}"
    return f"{reason}; {GRAMMAR_DOCS}"


#: Hydra's page on what an override may hold (lists [a,b], dicts {k:v}, quoting, sweeps)
GRAMMAR_DOCS = "the override grammar: https://hydra.cc/docs/advanced/override_grammar/basic/"


def auto_setting_error(cfg: DictConfig, leaf: str, value: str, base_dir: str | Path | None) -> str:
    """``algorithm.LEAF=VALUE`` with ``algorithm=auto`` (which has no settings of its own): the algorithm auto
    picks for this run and either the ``+`` form that passes the setting on to it or its settings."""
    from tpflower.datasets import load_spec  # noqa: PLC0415  pandas: only on this error's path

    try:
        task = load_spec(cfg.dataset, base_dir=base_dir).label.task
        picked, _ = choose(task, str(cfg.model.kind), cfg.get("privacy"), str(cfg.scenario.name))
        entry = registry.lookup(picked, str(cfg.scenario.name))
    except Exception:  # the dataset's own errors come after this one
        return (
            f"algorithm.{leaf}: algorithm=auto has no settings of its own; choose the algorithm "
            f"(algorithm=NAME algorithm.{leaf}={value}) or pass it on to auto's choice as +algorithm.{leaf}={value}"
        )
    settings = sorted(f.name for f in fields(entry.params))
    if leaf in settings:
        return (
            f"algorithm.{leaf}: algorithm=auto has no settings of its own; pass it on to {picked}, auto's choice "
            f"here, as +algorithm.{leaf}={value} (or choose it: algorithm={picked} algorithm.{leaf}={value})"
        )
    close = difflib.get_close_matches(leaf, settings, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"algorithm.{leaf} is not a setting of algorithm {picked!r} (auto's choice here){hint}; its settings: {settings}"
