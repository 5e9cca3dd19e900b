"""The relational spec: tables, keys, label, joins, shards and the test split.

A spec is declared in Hydra YAML (conf/dataset/NAME.yaml) and parsed with :func:`parse_spec`.
Validation runs before any training and names the table and column at fault:

* :func:`validate_structure` needs only the spec (unknown tables, label, join graph).
* :func:`validate_tables` checks the spec against the loaded tables (columns, key dtypes, NaN keys).

The join graph must be a tree over the tables (TablePuppet Sec. 2: the query is a join tree, star, chain or
snowflake); each edge may equate several column pairs (a composite key).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

Task = Literal["regression", "binary", "multiclass"]
TASKS: tuple[str, ...] = ("regression", "binary", "multiclass")


class SpecError(ValueError):
    """A relational spec or a table that does not fit it. The message names the table and column."""


@dataclass(frozen=True)
class ShardSpec:
    """How a table is split by rows into shards (the union scenario).

    Either ``by`` (one shard per value of that column: the listed ``values`` in that order, else every
    distinct value in sorted order) or ``parts`` (that many random parts of near-equal size, drawn with
    ``seed``). A federated union run needs the count before any data is read: ``parts`` or ``values``.
    """

    by: str | None = None
    parts: int | None = None
    seed: int = 0
    values: tuple[str, ...] | None = None

    @property
    def count(self) -> int | None:
        """The number of shards, when the spec alone says it."""
        return int(self.parts) if self.parts is not None else (len(self.values) if self.values else None)


def parse_shards(shards: Mapping[str, Any] | None, where: str) -> ShardSpec | None:
    """A ``shards`` setting ({by, values} or {parts, seed}) as a ShardSpec; None when empty."""
    if not shards:
        return None
    values = shards.get("values")
    spec = ShardSpec(
        by=shards.get("by"),
        parts=shards.get("parts"),
        seed=int(shards.get("seed", 0)),
        values=tuple(str(v) for v in values) if values else None,
    )
    if (spec.by is None) == (spec.parts is None):
        raise SpecError(f"{where}: shards take exactly one of 'by' (a column) or 'parts' (a count)")
    if spec.parts is not None and int(spec.parts) < 1:
        raise SpecError(f"{where}: shards.parts must be >= 1, got {spec.parts}")
    return spec


@dataclass(frozen=True)
class TableSpec:
    """One vertical table: where it comes from and which columns are features."""

    name: str
    source: str | None = None  # a .csv/.parquet path; None: the dataset loader's table of this name
    numeric: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    shards: ShardSpec | None = None
    region: str | None = None  # None: the network config's default link (conf/network default_link)
    binned: tuple[tuple[str, int], ...] = ()  # numeric columns that also get one-hot quantile bins (column, bins)
    # its key (the columns its parent joins it on) names one row at most: true, a duplicate is an error; false,
    # several rows per key are meant (many-to-many); None (unset): a repeated key is a warning (tpflower.checks)
    unique: bool | None = None
    where: str | None = None  # a SQL predicate over its columns: the owner keeps only those rows (tpflower.sql)

    @property
    def features(self) -> tuple[str, ...]:
        return self.numeric + self.categorical


@dataclass(frozen=True)
class LabelSpec:
    column: str
    table: str | None
    task: Task
    # a class label's classes in the order of their ids (binary: [negative, positive]); None: from the column's
    # values (sorted). Declared, every shard's file codes the classes alike whichever of them its rows hold
    classes: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class JoinSpec:
    """An equi-join edge ``left.on[k][0] = right.on[k][1]`` for every k (composite keys have several)."""

    left: str
    right: str
    on: tuple[tuple[str, str], ...]

    def columns_of(self, table: str) -> tuple[str, ...]:
        """The key columns this edge reads from ``table`` (one of its two ends)."""
        if table == self.left:
            return tuple(left for left, _ in self.on)
        if table == self.right:
            return tuple(right for _, right in self.on)
        raise KeyError(f"join {self} does not involve table {table!r}")

    def other(self, table: str) -> str:
        return self.right if table == self.left else self.left

    def __str__(self) -> str:
        return " and ".join(f"{self.left}.{lc} = {self.right}.{rc}" for lc, rc in self.on)


@dataclass(frozen=True)
class SplitSpec:
    """The test split: a fraction of the label table's rows, drawn with ``seed``."""

    test_fraction: float = 0.15
    seed: int = 42


NA_STRING_POLICIES: tuple[str, ...] = ("missing", "error")


@dataclass(frozen=True)
class RelationalSpec:
    name: str
    tables: tuple[TableSpec, ...]
    label: LabelSpec
    joins: tuple[JoinSpec, ...]
    split: SplitSpec = SplitSpec()
    loader: Mapping[str, Any] = field(default_factory=dict)  # {"name": ..., **kwargs} of a bundled loader
    # "n/a"-style text (pandas' missing-value strings: NA, n/a, null ...) in a numeric column: "missing" (read as
    # missing values, one warning line per column) or "error" (refused)
    na_strings: str = "missing"

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    def clients(self, scenario: str) -> list[tuple[str, int]]:
        """(table, shard) of every client: one per table (join), or one per shard of each table (ucq)."""
        if scenario == "join":
            return [(t.name, 0) for t in self.tables]
        if scenario != "ucq":
            raise SpecError(f"scenario must be join or ucq, got {scenario!r}")
        keys = []
        for t in self.tables:
            count = 1 if t.shards is None else t.shards.count
            if count is None:
                raise SpecError(
                    f"table {t.name!r}: shards by {t.shards.by!r} need their values listed "  # type: ignore[union-attr]
                    "(shards: {by: COLUMN, values: [...]}) so every party knows the shard count"
                )
            keys += [(t.name, q) for q in range(count)]
        return keys

    @property
    def label_table(self) -> str:
        assert self.label.table is not None, "label table is resolved by validate_tables"
        return self.label.table

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise SpecError(f"unknown table {name!r}; the spec declares {list(self.table_names)}")

    def key_columns(self, table: str) -> tuple[str, ...]:
        """All columns of ``table`` that take part in some join."""
        cols: list[str] = []
        for j in self.joins:
            if table in (j.left, j.right):
                cols += [c for c in j.columns_of(table) if c not in cols]
        return tuple(cols)

    def unique_key(self, table: str) -> tuple[str, ...]:
        """The columns a parent joins ``table`` on (joins with ``table`` on the right side): its key."""
        cols: list[str] = []
        for j in self.joins:
            if j.right == table:
                cols += [c for c in j.columns_of(table) if c not in cols]
        return tuple(cols)

    def join_order(self) -> list[tuple[JoinSpec, str, str]]:
        """Edges of the join tree in breadth-first order from the label table: (edge, known, new)."""
        seen = {self.label_table}
        order: list[tuple[JoinSpec, str, str]] = []
        frontier = [self.label_table]
        while frontier:
            nxt: list[str] = []
            for t in frontier:
                for j in self.joins:
                    if t in (j.left, j.right) and j.other(t) not in seen:
                        seen.add(j.other(t))
                        order.append((j, t, j.other(t)))
                        nxt.append(j.other(t))
            frontier = nxt
        return order


# --------------------------------------------------------------------------------------------- parsing


def _on_pairs(on: Any, where: str) -> tuple[tuple[str, str], ...]:
    """``movieId`` | ``[origin, time_hour]`` | ``[[dest, faa], ...]`` -> ((left, right), ...)."""
    if isinstance(on, str):
        return ((on, on),)
    if isinstance(on, Sequence) and len(on) > 0:
        pairs = []
        for item in on:
            if isinstance(item, str):
                pairs.append((item, item))
            elif isinstance(item, Sequence) and len(item) == 2 and all(isinstance(c, str) for c in item):
                pairs.append((str(item[0]), str(item[1])))
            else:
                raise SpecError(f"{where}: 'on' entries are column names or [left, right] pairs, got {item!r}")
        return tuple(pairs)
    raise SpecError(f"{where}: 'on' must name at least one column, got {on!r}")


def with_on_key(join: Any) -> Any:
    """A join written with a bare ``on:``, which YAML 1.1 reads as the key True, with its key "on" (anything
    else as it is)."""
    if isinstance(join, Mapping) and True in join and "on" not in join:
        return {("on" if key is True else key): v for key, v in join.items()}
    return join


def canonical_joins(dataset: DictConfig) -> None:
    """The dataset config's joins with their key "on" (:func:`with_on_key`), in place: the run config then has
    string keys only, as its JSON forms (the clients' config key, results.json, model.json) need."""
    joins = dataset.get("joins")
    if not joins or not any(isinstance(j, Mapping) and True in j for j in joins):
        return
    with open_dict(dataset):
        dataset.joins = [OmegaConf.create(with_on_key(OmegaConf.to_container(j))) for j in joins]


def to_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A plain dict of the config (OmegaConf nodes resolved, interpolations such as ${oc.env:...} included)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def split_fraction(split: Mapping[str, Any], name: str) -> float:
    """``split.test_fraction`` (default 0.15), in (0, 1): every run reports its metrics on the test rows."""
    value = split.get("test_fraction", 0.15)
    try:
        out = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        out = math.nan
    if not 0.0 < out < 1.0:
        raise SpecError(
            f"dataset {name!r}: split.test_fraction must be in (0, 1) (the share of the label table's rows held "
            f"out for the test metrics), got {value!r}"
        )
    return out


def declared_classes(value: Any, task: str, name: str) -> tuple[Any, ...] | None:
    """``label.classes``: None, or a list of distinct classes (binary: two, [negative, positive]) for a class
    label; SpecError otherwise."""
    if value is None:
        return None
    if task == "regression":
        raise SpecError(f"dataset {name!r}: label.classes is for a class label (task binary or multiclass)")
    classes = tuple(value) if isinstance(value, (list, tuple)) else ()
    wanted = 2 if task == "binary" else None
    if len(classes) < 2 or len(set(map(str, classes))) < len(classes) or (wanted and len(classes) != wanted):
        what = "two distinct classes, [negative, positive]" if wanted else "two or more distinct classes"
        raise SpecError(f"dataset {name!r}: label.classes must list {what}, got {value!r}")
    return classes


def class_codes(values: pd.Series, classes: Sequence[Any]) -> np.ndarray:
    """Each label's position in the declared ``classes`` (-1: not among them), compared as text when the
    column's values and the declared ones differ in kind (a YAML ``1`` against a column's ``"1"``)."""
    codes = pd.Index(list(classes)).get_indexer(values)
    if (codes < 0).any():
        text = pd.Index([str(c) for c in classes]).get_indexer(values.astype(str))
        codes = np.where(codes < 0, text, codes)
    return codes.astype(np.int64)


#: what a table of the dataset spec may set (docs/datasets.md)
TABLE_SETTINGS = ("source", "numeric", "categorical", "shards", "region", "binned", "unique", "where")


def did_you_mean(name: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'Salary'?)`` for an unknown name: a known one that differs only in case (a column's name
    is matched as its file writes it), else the closest (difflib, ``cutoff``); or ''."""
    known = list(known)
    close = [k for k in known if k.lower() == name.lower()] or difflib.get_close_matches(name, known, 1, cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def setting_hint(unknown: Iterable[str], known: Sequence[str]) -> str:
    """:func:`did_you_mean` for the first unknown setting close to a known one, else ''."""
    return next((hint for name in sorted(map(str, unknown)) if (hint := did_you_mean(name.lower(), known))), "")


#: the dataset spec's top-level settings (docs/datasets.md)
DATASET_SETTINGS = (
    "name",
    "tables",
    "label",
    "joins",
    "split",
    "loader",
    "on_dropped_rows",
    "na_strings",
    "label_range",
    "sql",
)


def misspelt_settings(cfg: Mapping[str, Any], name: str) -> None:
    """A top-level key one letter or so off a dataset setting (``join``, ``lable``) is refused naming the
    setting (its section would be silently missing, and the error would be about that); other keys pass."""
    for key in sorted(map(str, set(cfg) - set(DATASET_SETTINGS))):
        if hint := did_you_mean(key.lower(), DATASET_SETTINGS, cutoff=0.8):
            raise SpecError(f"dataset {name!r}: unknown setting {key!r}{hint}")


def parse_spec(cfg: Mapping[str, Any]) -> RelationalSpec:
    """Build a :class:`RelationalSpec` from the dataset config (a dict or an OmegaConf node)."""
    cfg = to_dict(cfg)
    name = str(cfg.get("name", "dataset"))
    misspelt_settings(cfg, name)
    raw_tables = cfg.get("tables")
    if not isinstance(raw_tables, Mapping) or not raw_tables:
        raise SpecError(f"dataset {name!r}: 'tables' must map table names to their specs")
    tables = []
    for tname, t in raw_tables.items():
        t = dict(t or {})
        unknown = set(t) - set(TABLE_SETTINGS)
        if unknown:
            raise SpecError(
                f"table {tname!r}: unknown settings {sorted(unknown)}{setting_hint(unknown, TABLE_SETTINGS)}"
            )
        shard_spec = parse_shards(t.get("shards"), f"table {tname!r}")
        binned = tuple((str(c), int(b)) for c, b in (t.get("binned") or {}).items())
        for col, bins in binned:
            if col not in (t.get("numeric") or ()):
                raise SpecError(f"table {tname!r}: binned column {col!r} must be one of its numeric columns")
            if bins < 2:
                raise SpecError(f"table {tname!r}, binned column {col!r}: needs at least 2 bins, got {bins}")
        tables.append(
            TableSpec(
                name=str(tname),
                binned=binned,
                source=t.get("source"),
                numeric=tuple(t.get("numeric") or ()),
                categorical=tuple(t.get("categorical") or ()),
                shards=shard_spec,
                region=None if t.get("region") is None else str(t["region"]),
                unique=unique_setting(tname, t.get("unique")),
                where=None if t.get("where") is None else str(t["where"]),
            )
        )
    label = cfg.get("label") or {}
    if not label.get("column"):
        raise SpecError(f"dataset {name!r}: no label: set label.column (and label.table, label.task)")
    unknown = set(label) - {"table", "column", "task", "classes"}
    if unknown:
        top = (
            " (label_range goes at the top level of the dataset config, beside label)"
            if "label_range" in unknown
            else ""
        )
        raise SpecError(f"dataset {name!r}: label has unknown settings {sorted(unknown)}{top}")
    task = label.get("task", "regression")
    if task not in TASKS:
        raise SpecError(f"dataset {name!r}: label.task must be one of {TASKS}, got {task!r}")
    classes = declared_classes(label.get("classes"), task, name)
    joins = []
    for k, j in enumerate(cfg.get("joins") or []):
        where = f"dataset {name!r}, join #{k}"
        j = with_on_key(j)
        if not isinstance(j, Mapping) or "left" not in j or "right" not in j or "on" not in j:
            raise SpecError(f"{where}: a join is {{left: TABLE, right: TABLE, on: COLUMNS}}, got {j!r}")
        joins.append(JoinSpec(left=str(j["left"]), right=str(j["right"]), on=_on_pairs(j["on"], where)))
    split = cfg.get("split") or {}
    spec = RelationalSpec(
        name=name,
        tables=tuple(tables),
        label=LabelSpec(column=str(label["column"]), table=label.get("table"), task=task, classes=classes),
        joins=tuple(joins),
        split=SplitSpec(test_fraction=split_fraction(split, name), seed=int(split.get("seed", 42))),
        loader=dict(cfg.get("loader") or {}),
        na_strings=str(cfg.get("na_strings") or "missing"),
    )
    if spec.na_strings not in NA_STRING_POLICIES:
        raise SpecError(f"dataset.na_strings must be one of {list(NA_STRING_POLICIES)}, got {spec.na_strings!r}")
    validate_structure(spec)
    return spec


# ------------------------------------------------------------------------------------------ validation


def unique_setting(table: object, value: object) -> bool | None:
    """A table's ``unique``: true, false or unset (None)."""
    if value is None or isinstance(value, bool):
        return value
    raise SpecError(f"table {table!r}: unique must be true or false, got {value!r}")


def check_label_not_a_key(spec: RelationalSpec, table: str) -> None:
    """A label column of ``table`` that is also one of its join keys is refused: each joined row would hold the
    other table's row of its own label (the model reads the label off its features), and the server would see
    which rows share a label by their keys' digests (under label DP too)."""
    partners = [
        j.right if j.left == table else j.left
        for j in spec.joins
        if table in (j.left, j.right) and spec.label.column in j.columns_of(table)
    ]
    if partners:
        raise SpecError(
            f"table {table!r}: the label column {spec.label.column!r} is also its join key to table(s) "
            f"{partners}, so each joined row holds that table's row of its own label (the model reads the label "
            "off its features, and the server sees which rows share a label by their keys); predict a column "
            "that is not a join key"
        )


def validate_structure(spec: RelationalSpec) -> None:
    """Checks that need no data: table names, the label's table (its label no join key), and that the joins
    form a tree."""
    names = spec.table_names
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise SpecError(f"table names must be unique; repeated: {sorted(dup)}")
    if spec.label.table is not None and spec.label.table not in names:
        raise SpecError(f"label table {spec.label.table!r} is not a declared table; tables: {list(names)}")
    for j in spec.joins:
        for t in (j.left, j.right):
            if t not in names:
                raise SpecError(f"join {j}: unknown table {t!r}; tables: {list(names)}")
        if j.left == j.right:
            raise SpecError(f"join {j}: a table cannot join itself")
    if spec.label.table is not None and spec.label.column:
        check_label_not_a_key(spec, spec.label.table)
    for t in spec.tables:
        if t.unique and not spec.unique_key(t.name):
            raise SpecError(
                f"table {t.name!r}: unique: true needs a join with {t.name!r} on its right side "
                "(its key is the columns its parent joins it on)"
            )
    # A tree: connected with exactly len(tables) - 1 edges; find a cycle or a stray component by union-find.
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for j in spec.joins:
        a, b = root(j.left), root(j.right)
        if a == b:
            raise SpecError(
                f"join graph has a cycle: join {j} connects tables {j.left!r} and {j.right!r} that other joins "
                "already connect (put all columns of a composite key in one join)"
            )
        parent[a] = b
    components: dict[str, list[str]] = {}
    for n in names:
        components.setdefault(root(n), []).append(n)
    if len(components) > 1:
        groups = sorted(components.values(), key=len, reverse=True)
        raise SpecError(
            f"join graph is disconnected: tables {groups[1:]} are not joined to {groups[0]}; add a join for each"
        )


#: the key kind of a time-zone-aware datetime column: it never joins a column of naive datetimes (which zone
#: they are in is not known), and joins another zone's column instant for instant
DATETIME_TZ = "datetime with a time zone"


def key_kind(dtype: Any) -> str:
    """The kind a join key is compared as: 'integer', 'string', 'float', 'datetime', 'datetime with a time zone'
    (compared as instants: the same time in two zones joins) or 'bool'. A pandas ``category`` column (Parquet
    written by R or arrow) is the kind of its categories: its values join as plain values of that kind."""
    if isinstance(dtype, pd.CategoricalDtype):
        return key_kind(dtype.categories.dtype)
    if pd.api.types.is_bool_dtype(dtype):
        return "bool"
    if pd.api.types.is_integer_dtype(dtype):
        return "integer"
    if pd.api.types.is_float_dtype(dtype):
        return "float"
    if isinstance(dtype, pd.DatetimeTZDtype):
        return DATETIME_TZ
    if pd.api.types.is_datetime64_any_dtype(dtype):
        return "datetime"
    if pd.api.types.is_string_dtype(dtype) or pd.api.types.is_object_dtype(dtype):
        return "string"
    return str(dtype)


def resolve_label_table(spec: RelationalSpec, columns: Mapping[str, Sequence[str]]) -> RelationalSpec:
    """Fill in ``label.table`` from which tables hold the label column; error if none or several do."""
    holders = [t for t, cols in columns.items() if spec.label.column in cols]
    if spec.label.table is None:
        if not holders:
            raise SpecError(f"no label: no table has the label column {spec.label.column!r}")
        if len(holders) > 1:
            raise SpecError(
                f"label column {spec.label.column!r} is in tables {holders}; set label.table to the one that owns it"
            )
        table = holders[0]
    else:
        table = spec.label.table
        if spec.label.column not in columns[table]:
            raise SpecError(f"no label: table {table!r} has no column {spec.label.column!r}")
    for t in spec.tables:
        if t.name != table and spec.label.column in t.features:
            raise SpecError(
                f"label in two tables: {spec.label.column!r} is the label of table {table!r} "
                f"and a feature of table {t.name!r}"
            )
    if spec.label.column in spec.table(table).features:
        raise SpecError(f"table {table!r}: the label column {spec.label.column!r} is also declared as a feature")
    check_label_not_a_key(spec, table)
    return RelationalSpec(
        name=spec.name,
        tables=spec.tables,
        label=LabelSpec(column=spec.label.column, table=table, task=spec.label.task, classes=spec.label.classes),
        joins=spec.joins,
        split=spec.split,
        loader=spec.loader,
        na_strings=spec.na_strings,
    )


def binary_classes(y: pd.Series) -> list[Any] | None:
    """A binary label's classes in the order of their codes 0 and 1: None when its values are 0/1 (or booleans)
    already, else its two distinct values sorted (by their text when they do not compare), so every node that
    holds the column codes them alike. ValueError (its values, up to 5) for any other number of values."""
    values = pd.unique(y.dropna())
    if set(values) <= {0, 1}:
        return None
    if len(values) != 2:
        shown = ", ".join(map(repr, list(values[:5].tolist()))) + (
            ", ..." if len(values) > 5 else ""
        )  # 0.5, not np.float64(0.5)
        raise ValueError(f"a binary label holds two values, this one {len(values)}: {shown}")
    try:
        return sorted(values.tolist())
    except TypeError:
        return sorted(values.tolist(), key=str)


def validate_table(spec: RelationalSpec, name: str, frame: pd.DataFrame) -> None:
    """Checks one table against the spec (what one client can check locally, before sending anything)."""
    t = spec.table(name)
    needed = list(spec.key_columns(name)) + list(t.features)
    if spec.label.table == name:
        needed.append(spec.label.column)
    if t.shards is not None and t.shards.by is not None:
        needed.append(t.shards.by)
    for col in needed:
        if col not in frame.columns:
            raise SpecError(f"table {name!r} has no column {col!r}; its columns are {list(frame.columns)}")
    for col in t.numeric:
        if not (pd.api.types.is_numeric_dtype(frame[col]) or pd.api.types.is_bool_dtype(frame[col])):
            raise SpecError(f"table {name!r}, column {col!r}: numeric feature has dtype {frame[col].dtype}")
    for col in spec.key_columns(name):
        missing = int(frame[col].isna().sum())
        if missing:
            raise SpecError(
                f"table {name!r}, key column {col!r}: {missing} missing (NaN) key values; "
                "drop or fill those rows before training"
            )
    if spec.label.table == name:
        y = frame[spec.label.column]
        missing = int(y.isna().sum())
        if missing:
            raise SpecError(f"table {name!r}, label column {spec.label.column!r}: {missing} missing labels")
        if spec.label.classes is not None:
            outside = int((class_codes(y, spec.label.classes) < 0).sum())
            if outside:  # counted, never shown: a node's refusal travels to the server
                raise SpecError(
                    f"table {name!r}, label column {spec.label.column!r}: {outside} labels are not among "
                    f"label.classes {list(spec.label.classes)}"
                )
        elif spec.label.task == "binary":
            try:
                binary_classes(y)
            except ValueError as exc:
                raise SpecError(
                    f"table {name!r}, label column {spec.label.column!r}: {exc} (or set label.task: multiclass)"
                ) from None
        if spec.label.task == "regression" and not pd.api.types.is_numeric_dtype(y):
            raise SpecError(f"table {name!r}, label column {spec.label.column!r}: regression label has dtype {y.dtype}")
    if len(frame) == 0:
        raise SpecError(f"table {name!r} is empty")


def validate_key_kinds(spec: RelationalSpec, kinds: Mapping[str, Mapping[str, str]]) -> None:
    """Joined columns must compare as the same kind (``kinds[table][column]`` from :func:`key_kind`)."""
    for j in spec.joins:
        for lc, rc in j.on:
            lk, rk = kinds[j.left][lc], kinds[j.right][rc]
            if lk != rk:
                raise SpecError(
                    f"join {j}: key dtype mismatch: {j.left}.{lc} is {lk} but {j.right}.{rc} is {rk}; "
                    + key_kind_fix(lk, rk)
                )


def key_kind_fix(left: str, right: str) -> str:
    """How to make two key kinds (:func:`key_kind`) that do not compare agree, as one clause."""
    kinds = {left, right}
    if kinds == {"datetime", DATETIME_TZ}:
        return "give both columns a time zone (or neither) before joining them"
    if kinds in ({"datetime", "string"}, {DATETIME_TZ, "string"}):  # a CSV file holds dates as text
        return (
            "store the text column as dates too (a Parquet date or timestamp column), or the date column as "
            "ISO text (e.g. '2015-01-01') in both files"
        )
    return "store both key columns with the same type"


def validate_tables(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame]) -> RelationalSpec:
    """All checks against loaded tables; returns the spec with the label table resolved."""
    missing = [n for n in spec.table_names if n not in frames]
    if missing:
        raise SpecError(f"tables {missing} were declared but not loaded")
    spec = resolve_label_table(spec, {n: list(f.columns) for n, f in frames.items()})
    for name in spec.table_names:
        validate_table(spec, name, frames[name])
    validate_key_kinds(
        spec, {n: {c: key_kind(frames[n][c].dtype) for c in spec.key_columns(n)} for n in spec.table_names}
    )
    return spec
