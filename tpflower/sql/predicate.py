"""A table owner's row filter: a SQL predicate over its own columns, evaluated vectorized on its frame.

The filter is the ``where`` of a table in the dataset spec (a training query's WHERE conjuncts on that table,
pushed to its owner). Comparisons, IN, BETWEEN, IS NULL, LIKE, AND / OR / NOT and arithmetic are supported,
in SQL's three-valued logic: a comparison with a missing value is unknown, and WHERE keeps the true rows only.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import pandas as pd
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from tpflower.checks import KEPT_ROWS_ATTR, WHERE_ROWS_ATTR, KeptRows
from tpflower.schema import SpecError

COMPARE: dict[type, Callable] = {
    exp.EQ: operator.eq,
    exp.NEQ: operator.ne,
    exp.LT: operator.lt,
    exp.LTE: operator.le,
    exp.GT: operator.gt,
    exp.GTE: operator.ge,
}
ARITH: dict[type, Callable] = {
    exp.Add: operator.add,
    exp.Sub: operator.sub,
    exp.Mul: operator.mul,
    exp.Div: operator.truediv,
    exp.Mod: np.fmod,  # SQL's %: the sign of the dividend (-3 % 2 = -1)
}


def parse_predicate(table: str, where: str) -> exp.Expression:
    """The parsed predicate; a SpecError naming the table when it is not one."""
    try:
        return sqlglot.parse_one(where)
    except ParseError as exc:
        raise SpecError(
            f"table {table!r}: where {where!r} is not a SQL predicate ({str(exc).splitlines()[0]})"
        ) from None


def _number(text: str) -> int | float:
    """A numeric literal: an integer where it reads as one, else a float (1.5, .5, 1e12)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _value(table: str, frame: pd.DataFrame, node: exp.Expression) -> pd.Series | object:
    """A column (Series) or a constant."""
    if isinstance(node, exp.Paren):
        return _value(table, frame, node.this)
    if isinstance(node, exp.Column):
        if node.name not in frame.columns:
            raise SpecError(f"table {table!r}: where names column {node.name!r}; its columns are {list(frame.columns)}")
        return frame[node.name]
    if isinstance(node, exp.Literal):
        return node.this if node.is_string else _number(node.this)
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Neg):
        return -_value(table, frame, node.this)  # type: ignore[operator]
    if type(node) in ARITH:
        return ARITH[type(node)](_value(table, frame, node.this), _value(table, frame, node.expression))
    raise SpecError(f"table {table!r}: where does not support {node.sql()!r}")


def _missing(n: int, *values: object) -> np.ndarray:
    """Rows where any of ``values`` (columns or constants) is missing."""
    out = np.zeros(n, dtype=bool)
    for v in values:
        out |= pd.isna(v).to_numpy() if isinstance(v, pd.Series) else np.full(n, v is None)
    return out


def _truth(table: str, frame: pd.DataFrame, node: exp.Expression) -> tuple[np.ndarray, np.ndarray]:
    """(true, unknown) per row: SQL's three-valued logic, a comparison with a missing value being unknown."""
    n = len(frame)
    if isinstance(node, exp.Paren):
        return _truth(table, frame, node.this)
    if isinstance(node, (exp.And, exp.Or)):
        (t1, u1), (t2, u2) = _truth(table, frame, node.this), _truth(table, frame, node.expression)
        if isinstance(node, exp.And):
            true = t1 & t2
            return true, (u1 | u2) & ~((~t1 & ~u1) | (~t2 & ~u2))
        true = t1 | t2
        return true, (u1 | u2) & ~true
    if isinstance(node, exp.Not):
        t, u = _truth(table, frame, node.this)
        return ~t & ~u, u
    if isinstance(node, exp.Boolean):
        return np.full(n, bool(node.this)), np.zeros(n, dtype=bool)
    if isinstance(node, exp.Is):
        if not isinstance(node.expression, exp.Null):
            raise SpecError(f"table {table!r}: where supports IS NULL only, got {node.sql()!r}")
        return _missing(n, _value(table, frame, node.this)), np.zeros(n, dtype=bool)
    if type(node) in COMPARE or isinstance(node, (exp.In, exp.Between, exp.Like)):
        value = _value(table, frame, node.this)
        if type(node) in COMPARE:
            other = _value(table, frame, node.expression)
            unknown = _missing(n, value, other)
            try:
                out = COMPARE[type(node)](value, other) if not unknown.all() else False
            except TypeError:
                raise SpecError(f"table {table!r}: where compares values of different types: {node.sql()}") from None
        elif isinstance(node, exp.In):
            unknown = _missing(n, value)
            out = pd.Series(value, index=frame.index).isin([_value(table, frame, v) for v in node.expressions])
        elif isinstance(node, exp.Between):
            low, high = _value(table, frame, node.args["low"]), _value(table, frame, node.args["high"])
            unknown = _missing(n, value, low, high)
            out = (value >= low) & (value <= high)  # type: ignore[operator]
        else:
            pattern = str(_value(table, frame, node.expression))
            regex = "^" + "".join(".*" if c == "%" else "." if c == "_" else _escape(c) for c in pattern) + "$"
            unknown = _missing(n, value)
            out = pd.Series(value, index=frame.index).astype("string").str.match(regex)
        true = np.broadcast_to(np.asarray(pd.Series(out).fillna(False), dtype=bool), (n,)) & ~unknown
        return true, unknown
    raise SpecError(f"table {table!r}: where does not support {node.sql()!r}")


def _escape(c: str) -> str:
    return "\\" + c if c in r".^$*+?{}[]\|()" else c


def row_mask(table: str, frame: pd.DataFrame, where: str) -> np.ndarray:
    """The rows of ``frame`` that the owner keeps under ``where`` (a boolean array of len(frame))."""
    return _truth(table, frame, parse_predicate(table, where))[0]


def filter_rows(table: str, frame: pd.DataFrame, where: str | None) -> pd.DataFrame:
    """``frame`` restricted to the rows ``where`` keeps, with a fresh RangeIndex (row id = position); its
    ``attrs[WHERE_ROWS_ATTR]`` is the count of rows before the filter, ``attrs[KEPT_ROWS_ATTR]`` the source row
    of each kept row (a data check names a row as its file has it)."""
    if where is None:
        return frame
    mask = np.asarray(row_mask(table, frame, where), dtype=bool)
    kept = frame.loc[mask].reset_index(drop=True)
    if len(kept) == 0:
        raise SpecError(f"table {table!r}: where {where!r} keeps no row")
    kept.attrs[WHERE_ROWS_ATTR] = len(frame)
    positions = np.flatnonzero(mask)
    kept.attrs[KEPT_ROWS_ATTR] = KeptRows(positions.astype(np.uint32) if len(frame) < 2**32 else positions)
    return kept
