"""Typed, validated hyperparameters of the federated algorithms (the `algorithm.*` keys of conf/algorithm).

Each algorithm declares a dataclass (fields with a checker each); :meth:`AlgorithmParams.from_cfg` builds it
from the config and refuses a bad value before any client is contacted, in the form
"algorithm.rho must be > 0, got -1". Unknown keys are refused too (a typo would otherwise be ignored).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

P = TypeVar("P", bound="AlgorithmParams")
Check = Callable[[str, Any], Any]


# Every checker takes ``(what, value)``: ``what`` names the setting in the error, the value comes back
# converted. The algorithms' settings (below) and the privacy settings (tpflower.privacy) share them.


def number(what: str, value: Any) -> float:
    """Any float (inf and nan included); refuses None, booleans and what ``float`` cannot read."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None


def _number(what: str, value: Any) -> float:
    out = number(what, value)
    if not math.isfinite(out):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return out


def positive_finite(what: str, value: Any) -> float:
    x = number(what, value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return x


def nonnegative_finite(what: str, value: Any) -> float:
    x = number(what, value)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return x


def probability(what: str, value: Any) -> float:
    """A probability strictly between 0 and 1 (e.g. delta)."""
    x = number(what, value)
    if not (0.0 < x < 1.0):
        raise ValueError(f"{what} must be in (0, 1), got {value!r}")
    return x


def rate(what: str, value: Any) -> float:
    """A sampling rate in (0, 1]."""
    x = number(what, value)
    if not (0.0 < x <= 1.0):
        raise ValueError(f"{what} must be in (0, 1], got {value!r}")
    return x


def positive(what: str, value: Any) -> float:
    out = _number(what, value)
    if out <= 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")
    return out


def nonnegative(what: str, value: Any) -> float:
    out = _number(what, value)
    if out < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return out


def positive_int(what: str, value: Any) -> int:
    out = _number(what, value)
    if out != int(out) or out < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return int(out)


def nonnegative_int(what: str, value: Any) -> int:
    out = _number(what, value)
    if out != int(out) or out < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return int(out)


def boolean(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, got {value!r}")
    return value


def above_one(what: str, value: Any) -> float:
    out = _number(what, value)
    if out <= 1:
        raise ValueError(f"{what} must be > 1, got {value!r}")
    return out


def degrees(what: str, value: Any) -> float:
    out = _number(what, value)
    if not 0 < out <= 180:
        raise ValueError(f"{what} must be an angle in degrees in (0, 180], got {value!r}")
    return out


def one_of(*choices: str) -> Check:
    def check(what: str, value: Any) -> str:
        if str(value) not in choices:
            raise ValueError(f"{what} must be one of {list(choices)}, got {value!r}")
        return str(value)

    return check


def or_word(check: Check, *words: Any) -> Check:
    """``check``, or one of the literal ``words`` (e.g. "auto", "full", None) kept as is."""

    def either(what: str, value: Any) -> Any:
        if value in words:
            return value
        try:
            return check(what, value)
        except ValueError as exc:
            raise ValueError(f"{exc} (or one of {list(words)})") from None

    return either


def param(check: Check, default: Any = MISSING) -> Any:
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True)
class AlgorithmParams:
    """Base: subclasses declare their fields with :func:`param`."""

    @classmethod
    def from_cfg(cls: type[P], alg: Mapping[str, Any]) -> P:
        known = {f.name for f in fields(cls)} | {"name"}
        unknown = sorted(set(alg) - known)
        if unknown:
            raise ValueError(
                f"algorithm.{unknown[0]} is not a setting of algorithm {alg.get('name')!r}; "
                f"its settings: {sorted(known - {'name'})}"
            )
        values = {}
        for f in fields(cls):
            if f.name in alg:
                values[f.name] = f.metadata["check"](f"algorithm.{f.name}", alg[f.name])
            elif f.default is MISSING:
                raise ValueError(f"algorithm.{f.name} is missing (algorithm {alg.get('name')!r})")
        return cls(**values)


def run_settings(cfg: Mapping[str, Any]) -> None:
    """The run-level keys every federated algorithm reads: epochs, seed, precision, runtime, resume."""
    positive_int("epochs", cfg.get("epochs"))
    nonnegative_int("seed", cfg.get("seed"))  # numpy's generators take no negative seed, and 1.5 is no seed
    one_of("float32", "float64")("precision", cfg.get("precision"))
    one_of("flower", "inprocess")("runtime", cfg.get("runtime", "flower"))
    boolean("resume", cfg.get("resume", False))  # resume=flase would otherwise be a true string: resumed
    # the run's own (a simulated node's) bounds and key mapping: one line here, not one per node at its hello
    for key in ("min_group_rows", "min_sketch_rows"):
        if cfg.get(key) is not None:
            positive_int(key, cfg.get(key))
    mapping, nodes = cfg.get("mapping") or {}, cfg.get("nodes") or {}
    one_of("hmac", "blind")("mapping.keys", mapping.get("keys") or "hmac")
    if mapping.get("keys_chunk_rows") is not None:
        positive_int("mapping.keys_chunk_rows", mapping.get("keys_chunk_rows"))
    for key in ("wait_s", "reply_timeout_s"):
        if nodes.get(key) is not None:
            positive_finite(f"nodes.{key}", nodes.get(key))
