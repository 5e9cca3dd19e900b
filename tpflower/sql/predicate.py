"""A table owner's row filter: a SQL predicate over its own columns, evaluated vectorized on its frame.

The filter is the ``where`` of a table in the dataset spec (a training query's WHERE conjuncts on that table,
pushed to its owner). Comparisons, IN, BETWEEN, IS NULL, LIKE, AND / OR / NOT and arithmetic are supported;
a comparison with a missing value is false (the row is dropped, as SQL's WHERE drops an unknown).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import pandas as pd
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

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
}


def parse_predicate(table: str, where: str) -> exp.Expression:
    """The parsed predicate; a SpecError naming the table when it is not one."""
    try:
        return sqlglot.parse_one(where)
    except ParseError as exc:
        raise SpecError(
            f"table {table!r}: where {where!r} is not a SQL predicate ({str(exc).splitlines()[0]})"
        ) from None


def _value(table: str, frame: pd.DataFrame, node: exp.Expression) -> pd.Series | object:
    """A column (Series) or a constant."""
    if isinstance(node, exp.Paren):
        return _value(table, frame, node.this)
    if isinstance(node, exp.Column):
        if node.name not in frame.columns:
            raise SpecError(f"table {table!r}: where names column {node.name!r}; its columns are {list(frame.columns)}")
        return frame[node.name]
    if isinstance(node, exp.Literal):
        return node.this if node.is_string else float(node.this) if "." in node.this else int(node.this)
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Neg):
        return -_value(table, frame, node.this)  # type: ignore[operator]
    if type(node) in ARITH:
        return ARITH[type(node)](_value(table, frame, node.this), _value(table, frame, node.expression))
    raise SpecError(f"table {table!r}: where does not support {node.sql()!r}")


def _mask(table: str, frame: pd.DataFrame, node: exp.Expression) -> np.ndarray:
    """The rows where ``node`` is true (missing values compare false)."""
    n = len(frame)
    if isinstance(node, exp.Paren):
        return _mask(table, frame, node.this)
    if isinstance(node, exp.And):
        return _mask(table, frame, node.this) & _mask(table, frame, node.expression)
    if isinstance(node, exp.Or):
        return _mask(table, frame, node.this) | _mask(table, frame, node.expression)
    if isinstance(node, exp.Not):
        return ~_mask(table, frame, node.this)
    if isinstance(node, exp.Is):
        value = pd.Series(_value(table, frame, node.this), index=frame.index)
        if not isinstance(node.expression, exp.Null):
            raise SpecError(f"table {table!r}: where supports IS NULL only, got {node.sql()!r}")
        return value.isna().to_numpy()
    if type(node) in COMPARE:
        out = COMPARE[type(node)](_value(table, frame, node.this), _value(table, frame, node.expression))
        return np.broadcast_to(np.asarray(pd.Series(out).fillna(False), dtype=bool), (n,)).copy()
    if isinstance(node, exp.In):
        values = [_value(table, frame, v) for v in node.expressions]
        return pd.Series(_value(table, frame, node.this), index=frame.index).isin(values).to_numpy()
    if isinstance(node, exp.Between):
        value = _value(table, frame, node.this)
        low, high = _value(table, frame, node.args["low"]), _value(table, frame, node.args["high"])
        return np.asarray(((value >= low) & (value <= high)), dtype=bool)  # type: ignore[operator]
    if isinstance(node, exp.Like):
        pattern = str(_value(table, frame, node.expression))
        regex = "^" + "".join(".*" if c == "%" else "." if c == "_" else _escape(c) for c in pattern) + "$"
        value = pd.Series(_value(table, frame, node.this), index=frame.index).astype("string")
        return value.str.match(regex).fillna(False).to_numpy(dtype=bool)
    if isinstance(node, exp.Boolean):
        return np.full(n, bool(node.this))
    raise SpecError(f"table {table!r}: where does not support {node.sql()!r}")


def _escape(c: str) -> str:
    return "\\" + c if c in r".^$*+?{}[]\|()" else c


def row_mask(table: str, frame: pd.DataFrame, where: str) -> np.ndarray:
    """The rows of ``frame`` that the owner keeps under ``where`` (a boolean array of len(frame))."""
    return _mask(table, frame, parse_predicate(table, where))


def filter_rows(table: str, frame: pd.DataFrame, where: str | None) -> pd.DataFrame:
    """``frame`` restricted to the rows ``where`` keeps, with a fresh RangeIndex (row id = position)."""
    if where is None:
        return frame
    kept = frame.loc[row_mask(table, frame, where)].reset_index(drop=True)
    if len(kept) == 0:
        raise SpecError(f"table {table!r}: where {where!r} keeps no row")
    return kept
