"""One SELECT of a training query, parsed with sqlglot and resolved against the tables' columns.

A branch is a select-project-join query: ``SELECT cols FROM t1 [JOIN t2 ON equalities | USING (cols)] ...
[WHERE conjuncts]``. Equalities between two tables' columns are the join edges (the join tree of TablePuppet
Sec. 2; docs/algorithms.md, section Table mapping); a conjunct over one table's columns is that table's row
filter, pushed to its owner. Everything else is refused with a :class:`QueryError` naming the construct and its line and column.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlglot import exp

from tpflower.schema import SpecError, did_you_mean

#: column -> "numeric" | "categorical" | a dtype name (not usable as a feature), per table
Columns = Mapping[str, Mapping[str, str]]

CATEGORY_TYPES = ("CATEGORY", "CATEGORICAL")
NUMERIC_TYPES = {
    exp.DataType.Type.DOUBLE,
    exp.DataType.Type.FLOAT,
    exp.DataType.Type.DECIMAL,
    exp.DataType.Type.INT,
    exp.DataType.Type.BIGINT,
    exp.DataType.Type.SMALLINT,
    exp.DataType.Type.TINYINT,
}
REFUSED_CLAUSES = {
    "with_": "a WITH clause (a subquery)",
    "group": "GROUP BY",
    "having": "HAVING",
    "order": "ORDER BY",
    "limit": "LIMIT",
    "offset": "OFFSET",
    "distinct": "SELECT DISTINCT",
    "qualify": "QUALIFY",
    "windows": "WINDOW",
    "laterals": "LATERAL",
}


class QueryError(SpecError):
    """A training query tpflower cannot run; the message names the construct and its position."""


def position(sql: str, node: exp.Expression) -> str:
    """``line L, column C`` of the first token of ``node`` in ``sql`` (1-based)."""
    starts = [n.meta["start"] for n in node.walk() if "start" in n.meta]
    if not starts:
        return "position unknown"
    return at(sql, min(starts))


def at(sql: str, offset: int) -> str:
    """``line L, column C`` of character ``offset`` of ``sql`` (1-based)."""
    return f"line {sql.count(chr(10), 0, offset) + 1}, column {offset - (sql.rfind(chr(10), 0, offset) + 1) + 1}"


def refuse(sql: str, node: exp.Expression, what: str) -> QueryError:
    """``SQL line L, column C: WHAT: <the construct>``."""
    text = node.sql()
    text = text if len(text) <= 80 else text[:77] + "..."
    return QueryError(f"SQL {position(sql, node)}: {what}: {text}")


@dataclass(frozen=True)
class Projected:
    """One SELECT item: a table's column, the role hint of a CAST, and whether it is the label (AS label)."""

    table: str
    column: str
    hint: str | None = None  # "numeric" | "categorical" (a CAST) | None (from the dtype)
    label: bool = False
    star: bool = False  # from ``*`` / ``t.*``: a key, the label or a non-feature dtype is skipped, not refused


@dataclass(frozen=True)
class Edge:
    """The equalities ``left.l = right.r`` between two tables (one join edge; several pairs: a composite key)."""

    left: str
    right: str
    on: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Branch:
    """A resolved select-project-join: tables in FROM order, join edges, per-table filter conjuncts, SELECT."""

    tables: tuple[str, ...]
    edges: tuple[Edge, ...]
    filters: Mapping[str, tuple[exp.Expression, ...]]  # table -> its conjuncts, columns unqualified
    projected: tuple[Projected, ...]


def conjuncts(node: exp.Expression) -> list[exp.Expression]:
    """The AND-ed parts of a predicate (parentheses dropped)."""
    node = node.unnest() if isinstance(node, exp.Paren) else node
    if isinstance(node, exp.And):
        return conjuncts(node.this) + conjuncts(node.expression)
    return [node]


class _Scope:
    """The tables of one branch by alias, and column resolution against their columns."""

    def __init__(self, sql: str, columns: Columns) -> None:
        self.sql, self.columns = sql, columns
        self.alias: dict[str, str] = {}
        self.order: list[str] = []

    def add(self, node: exp.Expression) -> str:
        if isinstance(node, exp.Subquery) or node.find(exp.Select):
            raise refuse(self.sql, node, "subqueries are not supported (name an owner's table)")
        if not isinstance(node, exp.Table):
            raise refuse(self.sql, node, "only tables can be joined")
        name = node.name
        if name not in self.columns:
            hint = did_you_mean(name, self.columns)
            raise refuse(self.sql, node, f"unknown table {name!r}{hint}; the tables are {sorted(self.columns)}")
        if name in self.order:
            raise refuse(self.sql, node, f"table {name!r} appears twice (a self-join is not supported)")
        alias = node.alias_or_name
        if alias in self.alias:
            raise refuse(self.sql, node, f"alias {alias!r} is used twice")
        self.alias[alias] = name
        self.order.append(name)
        return name

    def resolve(self, col: exp.Column, within: list[str] | None = None) -> tuple[str, str]:
        """(table, column) of a column reference; unknown or ambiguous names are refused."""
        name = col.name
        if col.table:
            if col.table not in self.alias:
                raise refuse(self.sql, col, f"unknown table or alias {col.table!r}")
            table = self.alias[col.table]
            if name not in self.columns[table]:
                hint = did_you_mean(name, self.columns[table])
                raise refuse(self.sql, col, f"unknown column {name!r} of table {table!r}{hint}")
            return table, name
        holders = [t for t in (within or self.order) if name in self.columns[t]]
        if not holders:
            hint = did_you_mean(name, [c for t in (within or self.order) for c in self.columns[t]])
            raise refuse(self.sql, col, f"unknown column {name!r}: no table of the query has it{hint}")
        if len(holders) > 1:
            raise refuse(self.sql, col, f"ambiguous column {name!r}: tables {holders} have it; qualify it")
        return holders[0], name


def _check_clauses(sql: str, select: exp.Select) -> None:
    for key, what in REFUSED_CLAUSES.items():
        if select.args.get(key):
            raise refuse(sql, select.args[key], f"{what} is not supported")
    for node in select.walk():
        if isinstance(node, exp.AggFunc):
            raise refuse(sql, node, "aggregates are not supported (tpflower trains on rows)")
        if isinstance(node, exp.Window):
            raise refuse(sql, node, "window functions are not supported")
        if node is not select and isinstance(node, (exp.Select, exp.Subquery)):
            raise refuse(sql, node, "subqueries are not supported")


def _projected(sql: str, scope: _Scope, item: exp.Expression) -> list[Projected]:
    """The SELECT item as projected columns (``t.*`` / ``*``: every column of those tables, roles by dtype)."""
    label = False
    if isinstance(item, exp.Alias):
        label = item.alias.lower() == "label"
        inner = item.this
        if not label and not (isinstance(inner, exp.Column) and inner.name == item.alias):
            raise refuse(sql, item, "an alias other than AS label is not supported (features keep their names)")
        item = inner
    hint = None
    if isinstance(item, exp.Cast):
        to = item.to
        if to.this == exp.DataType.Type.USERDEFINED and str(to.args.get("kind", "")).upper() in CATEGORY_TYPES:
            hint = "categorical"
        elif to.this in NUMERIC_TYPES:
            hint = "numeric"
        else:
            raise refuse(sql, item, "a CAST must be to CATEGORY (categorical) or a numeric type")
        item = item.this
    if isinstance(item, exp.Star) or (isinstance(item, exp.Column) and isinstance(item.this, exp.Star)):
        if label or hint:
            raise refuse(sql, item, "* cannot be the label or cast")
        qualifier = item.table if isinstance(item, exp.Column) else ""
        if qualifier and qualifier not in scope.alias:
            raise refuse(sql, item, f"unknown table or alias {qualifier!r}")
        tables = [scope.alias[qualifier]] if qualifier else scope.order
        return [Projected(t, c, star=True) for t in tables for c in scope.columns[t]]
    if not isinstance(item, exp.Column):
        raise refuse(sql, item, "computed columns are not supported (select an owner's column)")
    table, column = scope.resolve(item)
    return [Projected(table, column, hint, label)]


def _unqualified(node: exp.Expression) -> exp.Expression:
    """The predicate with its column references stripped of their table (it runs at the owner)."""
    return node.copy().transform(
        lambda n: exp.column(n.name, quoted=n.this.args.get("quoted")) if isinstance(n, exp.Column) else n
    )


def resolve_branch(sql: str, select: exp.Expression, columns: Columns) -> Branch:
    """Resolve one SELECT of the query (see the module docstring for what is accepted)."""
    if not isinstance(select, exp.Select):
        raise refuse(sql, select, "only SELECT ... FROM ... JOIN ... queries are supported")
    _check_clauses(sql, select)
    scope = _Scope(sql, columns)
    source = select.args.get("from_")
    if source is None:
        raise refuse(sql, select, "a query needs FROM a table")
    scope.add(source.this)
    pairs: dict[tuple[str, str], list[tuple[str, str]]] = {}
    where: dict[tuple[str, str], exp.Expression] = {}  # the first equality of each edge (for its position)
    filters: dict[str, list[exp.Expression]] = {}
    merged: dict[str, list[str]] = {}  # a USING column's name -> the tables joined on it, one column of the join

    def classify(pred: exp.Expression) -> None:
        """A conjunct: a filter of one table, or an equality joining two."""
        refs = {scope.resolve(c) for c in pred.find_all(exp.Column)}
        tables = sorted({t for t, _ in refs}, key=scope.order.index)
        if not tables:
            raise refuse(sql, pred, "a predicate without a column is not supported")
        if len(tables) == 1:
            filters.setdefault(tables[0], []).append(_unqualified(pred))
            return
        if isinstance(pred, exp.Or):
            raise refuse(sql, pred, "OR across tables is not supported (each table filters its own rows)")
        if not (
            isinstance(pred, exp.EQ) and isinstance(pred.this, exp.Column) and isinstance(pred.expression, exp.Column)
        ):
            raise refuse(sql, pred, "a predicate across tables must be an equality of two columns (an equi-join)")
        a, b = scope.resolve(pred.this), scope.resolve(pred.expression)
        (lt, lc), (rt, rc) = (a, b) if scope.order.index(a[0]) < scope.order.index(b[0]) else (b, a)
        pairs.setdefault((lt, rt), []).append((lc, rc))
        where.setdefault((lt, rt), pred)

    for join in select.args.get("joins") or []:
        if join.side:
            raise refuse(sql, join, f"{join.side} OUTER JOIN is not supported (inner joins only)")
        if join.method:
            raise refuse(sql, join, f"{join.method} JOIN is not supported; name the columns with USING (...)")
        if join.kind and join.kind.upper() not in ("INNER", "CROSS"):
            raise refuse(sql, join, f"{join.kind} JOIN is not supported (inner joins only)")
        previous = list(scope.order)
        new = scope.add(join.this)
        for ident in join.args.get("using") or []:
            name = ident.name
            if name not in columns[new]:
                hint = did_you_mean(name, columns[new])
                raise refuse(sql, ident, f"USING column {name!r} is not a column of table {new!r}{hint}")
            old = _using_partner(sql, ident, previous, columns, merged.get(name, []))
            merged[name] = (merged.get(name) or [old]) + [new]
            pairs.setdefault((old, new), []).append((name, name))
            where.setdefault((old, new), ident)
        for pred in conjuncts(join.args["on"]) if join.args.get("on") else []:
            classify(pred)
    for pred in conjuncts(select.args["where"].this) if select.args.get("where") else []:
        classify(pred)
    edges = [Edge(left, right, tuple(on)) for (left, right), on in pairs.items()]
    _check_tree(sql, select, scope.order, edges, [where[(e.left, e.right)] for e in edges])
    projected: list[Projected] = []
    for item in select.expressions:
        projected += _projected(sql, scope, item)
    return Branch(
        tables=tuple(scope.order),
        edges=tuple(edges),
        filters={t: tuple(f) for t, f in filters.items()},
        projected=tuple(projected),
    )


def _using_partner(sql: str, ident: exp.Expression, previous: list[str], columns: Columns, merged: list[str]) -> str:
    """The table that ``JOIN t USING (c)`` joins t to: the one table before it holding c, or, as SQL's USING
    makes the tables an earlier ``USING (c)`` joined one column c, the first of them (their c is equal on every
    joined row; ``a JOIN b USING (k) JOIN c USING (k)``, a snowflake's shared key). Tables holding c apart
    (not joined by USING on it) are ambiguous, refused at the USING column."""
    holders = [t for t in previous if ident.name in columns[t]]
    if not holders:
        hint = did_you_mean(ident.name, [c for t in previous for c in columns[t]])
        raise refuse(sql, ident, f"USING column {ident.name!r}: no table joined before it has it{hint}")
    if len(holders) > 1 and not set(holders) <= set(merged):
        raise refuse(
            sql,
            ident,
            f"USING column {ident.name!r} is ambiguous: tables {holders} joined before it have it and no earlier "
            f"USING ({ident.name}) makes it one column; join with ON and qualified columns",
        )
    return holders[0]


def _check_tree(
    sql: str, select: exp.Select, tables: list[str], edges: list[Edge], nodes: list[exp.Expression]
) -> None:
    """The join graph is a tree: no cycle (two routes between two tables), no table left unjoined."""
    root = {t: t for t in tables}

    def find(t: str) -> str:
        while root[t] != t:
            t = root[t]
        return t

    for e, node in zip(edges, nodes):
        if find(e.left) == find(e.right):
            raise refuse(
                sql,
                node,
                f"the join graph has a cycle: tables {e.left!r} and {e.right!r} are already joined through "
                "other tables (the joins must form a tree)",
            )
        root[find(e.left)] = find(e.right)
    stray = [t for t in tables if find(t) != find(tables[0])]
    if stray:
        raise refuse(
            sql,
            select.args["from_"],
            f"table(s) {stray} are not joined to {tables[0]!r} by any equality (a cross join is not supported)",
        )
