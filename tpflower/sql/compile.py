"""A training query -> the dataset config a YAML spec gives (tables, column roles, label, joins, shards).

``compile_query(sql, columns, cfg)`` parses the query (one SELECT, or a UNION ALL of them), resolves it against
the tables' columns and returns the dataset config with ``tables``, ``label`` and ``joins`` filled in; the
rest of ``cfg`` (loader, sources, regions, shards, split, ...) is kept. The mapping:

* FROM / JOIN ... ON a.x = b.y [AND ...] / USING (x): one join edge per pair of tables (a composite key when
  several equalities join them); the edges must form a tree.
* SELECT: ``t.c AS label`` is the label (or the config's ``label``); every other column is a feature of its
  table, numeric or categorical by its dtype, ``CAST(c AS CATEGORY)`` or ``tables.T.categorical`` making it
  categorical and a numeric CAST or ``tables.T.numeric`` numeric.
* WHERE / ON conjuncts over one table: that table's ``where``, applied by its owner to its own rows.
* UNION ALL of branches that differ only in ``t.c = value`` conjuncts: table t in shards by c, one per value
  (the union scenario: docs/algorithms.md, sections TP-UCQ-SGD and TP-UCQ-ADMM). The branches must cover
  every combination of the shard values of tables not joined on their shard column, so that the union of the
  joins is the join of the unions.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from tpflower.schema import SpecError
from tpflower.sql.predicate import row_mask
from tpflower.sql.query import Branch, Columns, QueryError, at, refuse, resolve_branch

ROLES = ("numeric", "categorical")


def parse_query(sql: str, columns: Columns) -> tuple[list[Branch], list[exp.Expression], str]:
    """The branches of the query, their SELECT nodes and the normalized query text."""
    try:
        statements = sqlglot.parse(sql)
    except ParseError as exc:
        raise QueryError(f"SQL does not parse: {str(exc).splitlines()[0]}") from None
    statements = [s for s in statements if s is not None]
    if len(statements) != 1:
        raise QueryError(f"SQL: one query expected, got {len(statements)} statements")
    root = statements[0]
    selects: list[exp.Expression] = []

    def flatten(node: exp.Expression) -> None:
        if isinstance(node, exp.Union):
            if node.args.get("distinct"):
                raise QueryError(f"SQL {_keyword(sql, node)}: UNION (distinct) is not supported; write UNION ALL")
            for key in ("order", "limit", "offset", "with_"):
                if node.args.get(key):
                    raise refuse(sql, node.args[key], f"{key.upper().rstrip('_')} on a UNION is not supported")
            flatten(node.this)
            flatten(node.expression)
        elif isinstance(node, exp.SetOperation):
            raise QueryError(
                f"SQL {_keyword(sql, node)}: {type(node).__name__.upper()} is not supported (UNION ALL only)"
            )
        else:
            selects.append(node)

    flatten(root)
    return [resolve_branch(sql, s, columns) for s in selects], selects, root.sql()


def _keyword(sql: str, node: exp.SetOperation) -> str:
    """The position of a set operation's keyword (UNION, INTERSECT, EXCEPT): the last one before its right side."""
    right = min((n.meta["start"] for n in node.expression.walk() if "start" in n.meta), default=len(sql))
    return at(sql, max(sql.upper().rfind(type(node).__name__.upper(), 0, right), 0))


def _shards(sql: str, branches: list[Branch], selects: list[exp.Expression]) -> tuple[dict, dict]:
    """(common filters per table, shards per table {by, values}) of a UNION ALL's branches."""
    first = branches[0]
    common = {t: [f for f in fs if all(f in b.filters.get(t, ()) for b in branches)] for t, fs in first.filters.items()}
    # per branch: table -> (column, value) of its one differing equality
    picks: list[dict[str, tuple[str, str]]] = []
    literal: dict[tuple[str, str], exp.Expression] = {}  # (column, value) -> the value's literal
    for k, (b, node) in enumerate(zip(branches, selects)):
        if (b.tables, b.edges, b.projected) != (first.tables, first.edges, first.projected):
            raise refuse(sql, node, f"UNION ALL branch {k + 1} selects or joins differently from branch 1")
        pick: dict[str, tuple[str, str]] = {}
        for t, fs in b.filters.items():
            for f in fs:
                if f in common.get(t, ()):
                    continue
                if not (
                    isinstance(f, exp.EQ) and isinstance(f.this, exp.Column) and isinstance(f.expression, exp.Literal)
                ):
                    raise refuse(
                        sql, node, f"UNION ALL branch {k + 1}: its filter {f.sql()} on {t!r} must be COLUMN = value"
                    )
                if t in pick:
                    raise refuse(sql, node, f"UNION ALL branch {k + 1}: two shard values for table {t!r}")
                pick[t] = (f.this.name, str(f.expression.this))
                literal[pick[t]] = f.expression
        picks.append(pick)
    sharded = list(dict.fromkeys(t for p in picks for t in p))
    for k, p in enumerate(picks):
        if set(p) != set(sharded):
            raise refuse(sql, selects[k], f"UNION ALL branch {k + 1} does not pick a shard of every table {sharded}")
        for t in sharded:
            if p[t][0] != picks[0][t][0]:
                raise refuse(sql, selects[k], f"UNION ALL branch {k + 1} shards {t!r} by another column")
    # tables joined on their shard columns form a group: one value per branch for the whole group
    parent = {t: t for t in sharded}

    def root(t: str) -> str:
        while parent[t] != t:
            t = parent[t]
        return t

    for e in first.edges:
        if e.left in parent and e.right in parent and (picks[0][e.left][0], picks[0][e.right][0]) in e.on:
            parent[root(e.right)] = root(e.left)
    group = {t: root(t) for t in sharded}
    groups = list(dict.fromkeys(group.values()))
    combos = []
    for k, p in enumerate(picks):
        for t in sharded:
            if p[t][1] != p[group[t]][1]:
                raise refuse(
                    sql,
                    selects[k],
                    f"UNION ALL branch {k + 1} is empty: {t!r} and {group[t]!r} are joined on "
                    "their shard columns but pick different values",
                )
        combos.append(tuple(p[g][1] for g in groups))
    if len(set(combos)) != len(combos):
        raise QueryError("SQL: two UNION ALL branches pick the same shards (their rows would count twice)")
    values = {g: list(dict.fromkeys(c[i] for c in combos)) for i, g in enumerate(groups)}
    missing = set(itertools.product(*values.values())) - set(combos)
    if missing:
        raise QueryError(
            f"SQL: the UNION ALL branches miss the shard combinations {sorted(missing)} of tables {groups}: "
            "only all combinations make the union of the joins the join of the unions"
        )
    shards = {t: {"by": picks[0][t][0], "values": values[group[t]]} for t in sharded}
    for t, s in shards.items():  # the union holds only the rows of its shards' values: the same rows either scenario
        into = exp.In(this=exp.column(s["by"]), expressions=[literal[(s["by"], v)].copy() for v in s["values"]])
        common.setdefault(t, []).append(into)
    return common, shards


def _roles(
    branch: Branch, columns: Columns, settings: Mapping[str, Any], label: tuple[str, str]
) -> dict[str, dict[str, list[str]]]:
    """numeric / categorical feature columns per table, in SELECT order."""
    roles: dict[str, dict[str, list[str]]] = {t: {"numeric": [], "categorical": []} for t in branch.tables}
    seen: set[tuple[str, str]] = set()
    keys = {(e.left, a) for e in branch.edges for a, _ in e.on} | {(e.right, b) for e in branch.edges for _, b in e.on}
    for p in branch.projected:
        where = (p.table, p.column)
        if p.label or where == label or (p.star and where in keys):
            continue
        if where in seen:
            if p.star:
                continue
            raise QueryError(f"SQL: column {p.table}.{p.column} is selected twice")
        seen.add(where)
        override = [r for r in ROLES if p.column in (settings.get(p.table, {}) or {}).get(r, ())]
        role = override[0] if override else p.hint or columns[p.table][p.column]
        if role not in ROLES:
            if p.star:
                continue
            raise QueryError(
                f"SQL: column {p.table}.{p.column} has dtype {role}: not a feature; CAST it to CATEGORY or a number"
            )
        roles[p.table][role].append(p.column)
    return roles


def _label(branch: Branch, columns: Columns, cfg: Mapping[str, Any]) -> tuple[str, str]:
    """(table, column) of the label: the SELECT's ``AS label`` or the config's ``label``."""
    chosen = [p for p in branch.projected if p.label]
    raw = dict(cfg.get("label") or {})
    if len(chosen) > 1:
        raise QueryError("SQL: more than one column is selected AS label")
    if chosen:
        if raw.get("column") and (raw["column"], raw.get("table", chosen[0].table)) != (
            chosen[0].column,
            chosen[0].table,
        ):
            raise QueryError(f"SQL: AS label selects {chosen[0].table}.{chosen[0].column} but dataset.label says {raw}")
        return chosen[0].table, chosen[0].column
    if not raw.get("column"):
        raise QueryError("SQL: no label: select one column AS label (or set dataset.label.column)")
    table = raw.get("table")
    holders = [t for t in branch.tables if raw["column"] in columns[t]]
    if table is None:
        if len(holders) != 1:
            where = f"is in tables {holders}; set dataset.label.table" if holders else "is in no table of the query"
            raise QueryError(f"SQL: label column {raw['column']!r} {where}")
        table = holders[0]
    if table not in holders:
        raise QueryError(f"SQL: dataset.label: table {table!r} of the query has no column {raw['column']!r}")
    return table, str(raw["column"])


def compile_query(sql: str, columns: Columns, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset config of the query ``sql`` (see the module docstring): ``cfg`` without ``sql``, with
    ``tables``, ``label``, ``joins`` from the query and ``query`` the normalized query text."""
    branches, selects, normalized = parse_query(sql, columns)
    branch = branches[0]
    if len(branches) > 1:
        common, shards = _shards(sql, branches, selects)
    else:
        common, shards = dict(branch.filters), {}
    settings = {str(t): dict(s or {}) for t, s in (cfg.get("tables") or {}).items()}
    notes = []  # what the dataset declares and the query leaves out (a dataset's tables as a catalogue)
    extra = [t for t in settings if t not in branch.tables]
    if extra:
        notes.append(f"SQL: dataset.tables declares {extra}, which the query does not use: left out of the run")
        settings = {t: v for t, v in settings.items() if t not in extra}
    label_table, label_column = _label(branch, columns, cfg)
    roles = _roles(branch, columns, settings, (label_table, label_column))
    order = list(settings) + [t for t in branch.tables if t not in settings]
    tables: dict[str, dict[str, Any]] = {}
    for t in order:
        entry = {k: v for k, v in settings.get(t, {}).items() if k not in ROLES}
        for role in ROLES:
            unknown = [
                c for c in settings.get(t, {}).get(role) or () if c not in roles[t]["numeric"] + roles[t]["categorical"]
            ]
            if unknown:
                notes.append(
                    f"SQL: dataset.tables.{t}.{role} names {unknown}, which the query does not select: no feature"
                )
        entry.update(roles[t])
        predicates = [f.sql() for f in common.get(t, ())] + ([entry["where"]] if entry.get("where") else [])
        if predicates:
            entry["where"] = " AND ".join(f"({p})" if len(predicates) > 1 else p for p in predicates)
            try:
                row_mask(t, pd.DataFrame(columns=list(columns[t])), entry["where"])
            except SpecError as exc:
                raise QueryError(f"SQL: the WHERE on {t!r}: {exc}") from None
        if t in shards:
            if entry.get("shards"):
                raise QueryError(f"SQL: table {t!r} is sharded by the UNION ALL and by dataset.tables.{t}.shards")
            entry["shards"] = shards[t]
        tables[t] = entry
    declared = dict(cfg.get("label") or {})
    task = declared.get("task", "regression")
    joins = [{"left": e.left, "right": e.right, "on": [list(pair) for pair in e.on]} for e in branch.edges]
    out = {k: v for k, v in cfg.items() if k != "sql"}
    out.update(
        tables=tables,
        label={
            "table": label_table,
            "column": label_column,
            "task": task,
            **({"classes": declared["classes"]} if declared.get("classes") is not None else {}),
        },
        joins=joins,
        query=normalized,
        **({"notes": notes} if notes else {}),
    )
    return out


def query_tables(sql: str) -> Sequence[str]:
    """The table names the query reads (to load their columns before :func:`compile_query`)."""
    try:
        return list(dict.fromkeys(t.name for t in sqlglot.parse_one(sql).find_all(exp.Table)))
    except ParseError as exc:
        raise QueryError(f"SQL does not parse: {str(exc).splitlines()[0]}") from None
