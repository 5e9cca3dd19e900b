"""Data problems: every check of a table (or a whole dataset) against its spec, collected, never the first only.

:func:`table_problems` is what one table's owner can check alone (a client in a deployment, before it sends
anything); :func:`dataset_problems` adds what needs every table (label resolution, key kinds, rows the joins
drop) for a simulation, where the user owns every table. Each :class:`Problem` is one line: table, column,
what is wrong, an example value and its row (where there is one), what to do. A deployed node sends
:meth:`Problem.line` with ``values=False`` (table, column, problem, count) and keeps the example values in
its own log. Every check is vectorized (pandas), never a loop over rows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import pandas as pd

from tpflower.schema import (
    RelationalSpec,
    SpecError,
    binary_classes,
    class_codes,
    key_kind,
    key_kind_fix,
    resolve_label_table,
)

Severity = Literal["error", "warning"]
WHERE_ROWS_ATTR = "rows_before_where"  # frame.attrs: a table's rows before its where (tpflower.sql.filter_rows)
KEPT_ROWS_ATTR = "rows_kept_by_where"  # frame.attrs: the source row of each row its where kept (KeptRows)
NA_ATTR = (
    "na_text"  # frame.attrs: {column: (count, first row, value)} of "n/a"-style text read as missing (datasets.files)
)
DROP_POLICIES: tuple[str, ...] = ("warn", "error", "ignore")
DROP_THRESHOLD = 0.01  # a join that drops more than this share of the label table's rows is reported
IDENTIFIER_SHARE, IDENTIFIER_MIN = 0.5, 100  # the label table's categorical columns of more categories: refused
FEATURE_MEMORY_SHARE = 0.5  # a table whose dense features would take more of the machine's memory is refused
# how to group a column's categories: in the table's file, as dataset.sql selects columns only (no CASE, no
# computed column: docs/datasets.md, the training set as SQL)
GROUP_FIX = "group its categories into a new column of fewer values in the table's file (a date's month, say)"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the data, as one line.

    ``role`` names the column's part ("column", "key column", "label column", "numeric feature");
    ``example`` what the owner's data shows, e.g. a value and its row (only with ``values=True``: a deployed
    node never sends it); ``count`` how many rows.
    """

    table: str | None
    what: str
    fix: str
    column: str | None = None
    role: str = "column"
    example: str | None = None
    count: int | None = None
    severity: Severity = "error"

    def line(self, values: bool = True) -> str:
        """``table 'T', ROLE 'C': WHAT, EXAMPLE; FIX`` (without the example when not ``values``)."""
        if self.table is None:
            subject = self.what
        elif self.column is None:
            subject = f"table {self.table!r} {self.what}"
        else:
            subject = f"table {self.table!r}, {self.role} {self.column!r}: {self.what}"
        example = f", {self.example}" if values and self.example else ""
        return f"{subject}{example}; {self.fix}"


class DataProblems(SpecError):
    """Raised with every problem found; ``str`` is one line per problem, with example values."""

    def __init__(self, problems: Sequence[Problem], dataset: str = "dataset"):
        self.problems = list(problems)
        self.dataset = dataset
        super().__init__("\n".join(p.line() for p in self.problems))

    def report(self, values: bool = True) -> str:
        """A header and one indented line per problem (the console report of a simulation)."""
        n = len(self.problems)
        head = f"dataset {self.dataset!r}: {n} problem{'s' if n != 1 else ''} in the data; fix {'them' if n != 1 else 'it'} and run again:"
        return "\n".join([head] + [f"  {p.line(values)}" for p in self.problems])

    def one_line(self, values: bool = False) -> str:
        """Every problem on one line (by default without row values: what a deployed node sends the server)."""
        n = len(self.problems)
        return f"{n} problem{'s' if n != 1 else ''} in the data: " + " | ".join(p.line(values) for p in self.problems)


def errors(problems: Sequence[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


# ------------------------------------------------------------------------------------------------ one table


def _at(row: int, source: str | None) -> str:
    """Where row ``row`` (0-based, header excluded) is: with its line number for a CSV file."""
    if source is not None and str(source).lower().endswith(".csv"):
        return f"row {row} (line {row + 2} of {source})"
    return f"row {row}"


class KeptRows:
    """The source row (0-based, header excluded) of each row of a table its ``where`` kept, by position
    (``frame.attrs[KEPT_ROWS_ATTR]``, set by tpflower.sql.filter_rows): how a data check names a filtered table's
    row as its file has it. Copied and compared by identity: pandas deep-copies and compares a frame's attrs
    with every operation, which must not copy the array."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __deepcopy__(self, memo: dict) -> KeptRows:
        return self

    def __getitem__(self, row: int) -> int:
        return int(self.rows[row])


@dataclass(frozen=True)
class SourceRows:
    """Where a table's rows are: its ``source`` file (a CSV file's rows get their line) and, for a table its
    where filtered, the source row of each row it kept (``kept``; None: the frame's rows are the file's)."""

    source: str | None
    kept: KeptRows | None = None

    @classmethod
    def of(cls, source: str | None, frame: pd.DataFrame) -> SourceRows:
        kept = frame.attrs.get(KEPT_ROWS_ATTR)
        # the frame as filter_rows left it (a frame filtered again since: its positions are no longer these)
        return cls(source, kept if isinstance(kept, KeptRows) and len(kept.rows) == len(frame) else None)

    def at(self, row: int) -> str:
        """Where the frame's row at position ``row`` is in the source (its file row and line)."""
        return _at(row if self.kept is None else self.kept[row], self.source)


def _counted(n: int, what: str) -> str:
    """``"2 missing labels"``, ``"1 missing label"``: ``what`` is a plural phrase whose first word ending in
    's' is its noun (singularized for a count of 1)."""
    words = what.split(" ")
    noun = next((i for i, w in enumerate(words) if w.endswith("s") and not w.endswith("ss")), None)
    if n == 1 and noun is not None:
        words[noun] = words[noun][:-1]
    return f"{n} {' '.join(words)}"


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _non_numeric(s: pd.Series) -> np.ndarray:
    """Rows holding a value that is not a number (missing values are fine)."""
    if pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s):
        return np.zeros(len(s), dtype=bool)
    return (pd.to_numeric(s, errors="coerce").isna() & s.notna()).to_numpy()


def _infinite(s: pd.Series) -> np.ndarray:
    """Rows holding an infinite number (+-inf), the column read as numbers (missing values are fine)."""
    if pd.api.types.is_bool_dtype(s):
        return np.zeros(len(s), dtype=bool)
    return np.isinf(pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan))


#: what to do with a column of dates or times declared numeric (a datetime column, or dates written as text)
DATE_FIX = (
    "store a number computed from them in a column of the table's file (the year, days since a start date) and "
    "declare that one, or declare the column categorical (one category per value)"
)


def _bad_values(
    table: str, column: str, role: str, mask: np.ndarray, s: pd.Series, source: SourceRows, what: str, fix: str
) -> Problem:
    row = _first(mask)
    n = int(mask.sum())
    value = s.iloc[row]
    return Problem(
        table,
        _counted(n, what),
        fix,
        column=column,
        role=role,
        count=n,
        example=f"first at {source.at(row)}: {value.item() if isinstance(value, np.generic) else value!r}",
    )


def _missing(
    table: str, column: str, role: str, s: pd.Series, source: SourceRows, what: str, fix: str
) -> Problem | None:
    mask = s.isna().to_numpy()
    if not mask.any():
        return None
    row, n = _first(mask), int(mask.sum())
    return Problem(
        table, _counted(n, what), fix, column=column, role=role, count=n, example=f"first at {source.at(row)}"
    )


def table_problems(spec: RelationalSpec, name: str, frame: pd.DataFrame, declared: str | None = None) -> list[Problem]:
    """Every problem of table ``name`` that its owner can see alone (its frame and the run's spec).
    ``declared``: where the hints send the user to declare a column (default the dataset config; a deployed
    node's start: ``columns:`` of its owner's settings file, what the owner edits)."""
    where = declared or "the dataset config"

    def declare(fix: str) -> str:
        return (
            fix
            if declared is None
            else fix.replace("declare the column categorical", f"declare it categorical in {where}")
        )

    t = spec.table(name)
    src = SourceRows.of(t.source, frame)  # a filtered table's rows named by their file rows too
    out: list[Problem] = []
    label, label_here = spec.label.column, spec.label.table == name
    if len(frame) == 0:
        out.append(Problem(name, "has no rows", "fill the table (its file has a header but no data rows)"))
    if spec.label.table is not None and not label_here and label in t.features:
        out.append(
            Problem(
                name,
                f"a feature bears the label's name {label!r} (the label is table {spec.label.table!r}'s)",
                "rename the column or drop it from this table's features",
                column=label,
                role="feature",
            )
        )
    if label_here and label in t.features:
        out.append(
            Problem(
                name,
                "the label is also declared as a feature",
                "remove it from numeric/categorical",
                column=label,
                role="label column",
            )
        )
    for col in sorted(set(t.numeric) & set(t.categorical)):
        out.append(
            Problem(
                name,
                "is declared both numeric and categorical",
                f"list it under one of the two in {where}",
                column=col,
            )
        )
    needed = list(
        dict.fromkeys(
            list(spec.key_columns(name))
            + list(t.features)
            + ([label] if label_here else [])
            + ([t.shards.by] if t.shards is not None and t.shards.by else [])
        )
    )
    absent = [c for c in needed if c not in frame.columns]
    for col in absent:
        out.append(
            Problem(
                name,
                f"has no column {col!r}",
                f"fix the column name in {where} or in the file's header",
                example=f"its columns are {list(frame.columns)}",
            )
        )
    present = set(frame.columns) - set(absent)
    for col in (c for c in t.numeric if c in present):
        s = frame[col]
        bad = _non_numeric(s)
        if bad.any():
            dates = bool(s[bad].astype(str).str.strip().str.fullmatch(DATE_TEXT).all())
            out.append(
                _bad_values(
                    name,
                    col,
                    "numeric feature",
                    bad,
                    s,
                    src,
                    "dates or times written as text, not numbers" if dates else "non-numeric values",
                    declare(
                        DATE_FIX
                        if dates
                        else "make every value a number (leave it empty if unknown: a missing value, which "
                        "boosted trees bin apart and the other models fill with the median), or declare the column "
                        "categorical"
                    ),
                )
            )
        elif pd.api.types.is_datetime64_any_dtype(s) or pd.api.types.is_timedelta64_dtype(s):
            out.append(
                Problem(
                    name,
                    f"dates or times, not numbers (dtype {s.dtype})",
                    declare(DATE_FIX),
                    column=col,
                    role="numeric feature",
                )
            )
        elif len(s) and not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)):
            # (a header-only file's columns read as text: 'has no rows' above says what is wrong)
            out.append(
                Problem(
                    name,
                    f"numbers stored as text (dtype {s.dtype})",
                    "store the column as numbers",
                    column=col,
                    role="numeric feature",
                )
            )
        else:
            inf = _infinite(s)
            if inf.any():
                out.append(
                    _bad_values(
                        name,
                        col,
                        "numeric feature",
                        inf,
                        s,
                        src,
                        "infinite values",
                        "replace them by finite numbers or leave them empty",
                    )
                )
    na_text = frame.attrs.get(NA_ATTR) or {}
    for col in (c for c in t.numeric if c in present and c in na_text):
        n, row, value = na_text[col]
        out.append(
            Problem(
                name,
                _counted(n, f"values like {value!r} read as missing")
                if spec.na_strings == "missing"
                else _counted(n, f"text values like {value!r} for a missing number"),
                "the median fills them (dataset.na_strings: error refuses them)"
                if spec.na_strings == "missing"
                else "leave the cells of unknown numbers empty (or set dataset.na_strings: missing)",
                column=col,
                role="numeric feature",
                count=n,
                example=f"first at {_at(row, t.source)}",
                severity="warning" if spec.na_strings == "missing" else "error",
            )
        )
    dup = _duplicate_keys(spec, name, frame, present, src)
    out += [dup] if dup is not None else []
    for col in (c for c in spec.key_columns(name) if c in present):
        p = _missing(
            name,
            col,
            "key column",
            frame[col],
            src,
            "missing (NaN) key values",
            "drop or fill those rows before training (a row without a key joins nothing)",
        )
        if p is not None:
            out.append(p)
    if label_here and label in present:
        out += _label_problems(spec, name, frame[label], src)
    out += _uninformative(name, frame, [c for c in t.features if c in present])
    levels = {c: int(frame[c].nunique(dropna=False)) for c in t.categorical if c in present}  # categories
    identifiers = _identifier_like(name, len(frame), levels) if label_here else []
    out += identifiers
    wide = _wide_features(spec, name, frame, present, levels)
    if wide is None or wide.column in {p.column for p in identifiers}:
        return out  # an identifier's line already says to drop it: one line per column at fault
    return out + [wide]


def _duplicate_keys(
    spec: RelationalSpec, name: str, frame: pd.DataFrame, present: set[str], source: SourceRows
) -> Problem | None:
    """A table declared ``unique: true`` whose key (the columns its parent joins it on) is on more than one row
    (rows of a missing key value aside: reported as missing); over a union, within a shard of ``shards.by``
    (random ``parts`` are checked by each shard's node). The same refusal as its node's
    (tpflower.phases.setup.check_unique_key), found with the table's other problems."""
    t = spec.table(name)
    cols = list(spec.unique_key(name))
    if not t.unique or not cols or any(c not in present for c in cols):
        return None
    if t.shards is not None and t.shards.by is None:
        return None
    subset = cols + ([t.shards.by] if t.shards is not None and t.shards.by in present else [])
    complete = frame[subset].notna().all(axis=1).to_numpy()
    dup = frame[subset].duplicated(keep=False).to_numpy() & complete
    if not dup.any():
        return None
    row, n = _first(dup), int(dup.sum())
    value = key_value_text(frame, cols, row)
    return Problem(
        name,
        f"declares its key {'+'.join(cols)} unique, but {n:,} rows share a value",
        "remove the duplicates, or drop unique: true if a training row per partner is meant",
        count=n,
        example=f"first at {source.at(row)}: {value}",
    )


def key_value_text(frame: pd.DataFrame, cols: Sequence[str], row: int) -> str:
    """``a=1, b='x'``: the key columns ``cols`` of ``frame`` at position ``row`` (a number or a string each), the
    example of a duplicate key."""
    values = [frame[c].iloc[row] for c in cols]
    return ", ".join(f"{c}={v.item() if isinstance(v, np.generic) else v!r}" for c, v in zip(cols, values))


def _uninformative(name: str, frame: pd.DataFrame, features: Sequence[str]) -> list[Problem]:
    """Warnings for the features that cannot inform the model: every value missing, or one value on every row
    (missing values aside)."""
    out = []
    for col in features:
        distinct = int(frame[col].nunique(dropna=True))
        if distinct > 1 or not len(frame):
            continue
        out.append(
            Problem(
                name,
                "every value is missing" if distinct == 0 else "one value on every row (missing values aside)",
                "it adds nothing to the model: drop it from the table's features",
                column=col,
                role="feature",
                severity="warning",
            )
        )
    return out


def _identifier_like(name: str, n_rows: int, levels: Mapping[str, int]) -> list[Problem]:
    """The label table's categorical columns with a category on most rows (more than IDENTIFIER_SHARE of the
    rows and more than IDENTIFIER_MIN categories: an identifier, a timestamp, free text): each one-hot column
    fits about one training row and tells nothing of a new row, at the cost of a block as wide as the table.
    (A dimension table's column of one category per row is a per-entity effect over the join: not refused.)"""
    out = []
    for col, n in levels.items():
        if n > max(IDENTIFIER_MIN, IDENTIFIER_SHARE * n_rows):
            out.append(
                Problem(
                    name,
                    "a different category on most rows of the label table (an identifier, a timestamp or free "
                    "text?): its one-hot columns each fit about one training row and tell nothing of a new one",
                    "drop the column from the table's features (or from the SELECT), declare it numeric if its "
                    f"values are numbers, or {GROUP_FIX}",
                    column=col,
                    role="categorical feature",
                    example=f"{n:,} categories over {n_rows:,} rows",
                )
            )
    return out


def shard_problems(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame]) -> list[Problem]:
    """Over a union (scenario ucq), each table split by a column's values: the column must be one of its keys or
    features (the server learns each row's shard, so its value: its owner exposes it), and every row must hold
    one of the listed values. Found up front, once per table (each shard's node refuses the same later)."""
    out: list[Problem] = []
    for t in (t for t in spec.tables if t.shards is not None and t.shards.by is not None and t.name in frames):
        by, frame = t.shards.by, frames[t.name]  # type: ignore[union-attr]
        exposed = {*spec.key_columns(t.name), *t.features, *(c for c, _ in t.binned)}
        if by not in exposed:
            out.append(
                Problem(
                    t.name,
                    "splits the table into shards but is none of its keys or features (the server learns each "
                    "row's shard, so the column's value: a shard column is one its owner exposes)",
                    "declare it numeric or categorical (with sql: select it in every branch of the UNION ALL)",
                    column=by,
                    role="shard column",
                )
            )
        values = t.shards.values  # type: ignore[union-attr]
        if values is not None and by in frame.columns:
            bad = ~frame[by].astype(str).isin([str(v) for v in values]).to_numpy()
            if bad.any():
                out.append(
                    _bad_values(
                        t.name,
                        by,
                        "shard column",
                        bad,
                        frame[by],
                        SourceRows.of(t.source, frame),
                        f"values not among the listed shard values {list(values)}",
                        "list every value under shards.values, or keep only those rows (where)"
                        + (f" ({hint})" if (hint := yaml_boolean_hint(values, frame[by][bad])) else ""),
                    )
                )
    return out


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _wide_features(
    spec: RelationalSpec, name: str, frame: pd.DataFrame, present: set[str], levels: Mapping[str, int]
) -> Problem | None:
    """A table whose features, held dense (a numeric column one column, a categorical column one 0/1 column per
    category), would take more than FEATURE_MEMORY_SHARE of this machine's memory at 4 bytes a value: refused
    before any training, naming its categorical column of most categories (counts in the example only)."""
    t = spec.table(name)
    if not levels:
        return None
    need = 4 * len(frame) * (sum(1 for c in t.numeric if c in present) + sum(levels.values()))
    memory = machine_memory()
    if need <= FEATURE_MEMORY_SHARE * memory:
        return None
    widest = max(levels, key=lambda c: (levels[c], c))
    return Problem(
        name,
        "its one-hot block makes the table's features, held dense, larger than half of this machine's memory",
        f"drop the column, declare it numeric if its values are numbers, or {GROUP_FIX}",
        column=widest,
        role="categorical feature",
        example=f"{levels[widest]:,} categories over {len(frame):,} rows: {need / 2**30:.1f} GB of features "
        f"against {memory / 2**30:.1f} GB",
    )


#: what YAML 1.1 (PyYAML, Hydra) reads as a boolean when unquoted, besides true and false
YAML_BOOLEAN_WORDS = frozenset({"y", "yes", "n", "no", "on", "off"})


def yaml_boolean_hint(listed: Sequence[Any], found: pd.Series) -> str:
    """A hint when a list in the user's YAML holds booleans and the data holds yes/no/on/off text: YAML 1.1 read
    the unquoted words as booleans (empty: none). It tells of the data: a label's goes in its problem's example,
    which a deployed node does not send."""
    if (
        any(str(v) in ("True", "False") for v in listed)
        and found.astype(str).str.lower().isin(YAML_BOOLEAN_WORDS).any()
    ):
        return "YAML reads an unquoted yes, no, on or off as true or false: quote them, e.g. ['no', 'yes']"
    return ""


def _label_problems(spec: RelationalSpec, name: str, y: pd.Series, src: SourceRows) -> list[Problem]:
    out: list[Problem] = []
    col, task = spec.label.column, spec.label.task
    p = _missing(name, col, "label column", y, src, "missing labels", "drop the rows without a label or fill them")
    if p is not None:
        out.append(p)
    bad, what, fix, detail = None, "", "", ""
    if task == "regression":
        bad, what, fix = _non_numeric(y), "non-numeric regression labels", "make every label a number"
        if not bad.any():  # numbers, or text that reads as numbers ("inf" among them)
            bad = _infinite(y)
            what, fix = "infinite regression labels", "replace them by finite numbers or drop those rows"
    elif spec.label.classes is not None:
        outside = (y.notna() & (class_codes(y, spec.label.classes) < 0)).to_numpy()
        if outside.any():
            # the classes are the run's word: a count of the labels outside them, for sets of the server's choosing,
            # would be the label's histogram, so the count goes in the example (the owner's console) alone
            row, n = _first(outside), int(outside.sum())
            value = y.iloc[row]
            shown = value.item() if isinstance(value, np.generic) else value
            hint = yaml_boolean_hint(spec.label.classes, y[outside])
            out.append(
                Problem(
                    name,
                    "labels outside label.classes",
                    f"list every class in label.classes {list(spec.label.classes)} or drop those rows",
                    column=col,
                    role="label column",
                    count=n,
                    example=f"{n} of them, first at {src.at(row)}: {shown!r}" + (f" ({hint})" if hint else ""),
                )
            )
    elif task == "binary":
        try:
            binary_classes(y)
        except ValueError as exc:
            kept = y.value_counts().index[:2]  # the two most frequent values: the rows of any other are shown
            bad = (y.notna() & ~y.isin(kept)).to_numpy()
            # the label's values go in the example (the owner's console), never in the line a deployed node sends
            what, fix, detail = (
                "binary labels beyond two values",
                "keep two classes (or set label.task: multiclass)",
                str(exc),
            )
    if bad is not None and bad.any():
        problem = _bad_values(name, col, "label column", bad, y, src, what, fix)
        out.append(replace(problem, example=f"{problem.example} ({detail})") if detail else problem)
    return out


# ------------------------------------------------------------------------------------------- whole dataset


def key_kind_problems(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame]) -> list[Problem]:
    """Joined columns that would not compare (integer vs string, ...): one problem per column pair. Joins
    whose two tables both loaded are checked (a table that did not load is reported as such, in the same pass)."""
    out = []
    for j in spec.joins:
        if j.left not in frames or j.right not in frames:
            continue
        for lc, rc in j.on:
            if lc not in frames[j.left].columns or rc not in frames[j.right].columns:
                continue
            if frames[j.left][lc].isna().any() or frames[j.right][rc].isna().any():
                continue  # reported as missing keys (a missing value makes an integer CSV column float)
            lk, rk = key_kind(frames[j.left][lc].dtype), key_kind(frames[j.right][rc].dtype)
            if lk != rk:
                out.append(
                    Problem(
                        None,
                        f"join {j}: key dtype mismatch: {j.left}.{lc} is {lk} but {j.right}.{rc} is {rk}",
                        key_kind_fix(lk, rk),
                    )
                )
    return out


def _key_codes(left: pd.DataFrame, right: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes of the key tuples of two tables (columns in pairs), equal codes for keys that an inner
    merge matches: each column pair factorized together, then the tuple of codes."""
    n = len(left)
    codes = np.zeros(n + len(right), dtype=np.int64)
    for lc, rc in zip(left.columns, right.columns):
        c, uniq = pd.factorize(pd.concat([left[lc], right[rc]], ignore_index=True))
        codes, _ = pd.factorize(codes * (len(uniq) + 1) + c)
    return codes[:n], codes[n:]


def edge_codes(spec: RelationalSpec, frames: Mapping[str, pd.DataFrame]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per join of ``spec.join_order()``: the key codes of the known and of the new table's rows (equal codes:
    equal keys)."""
    return [
        _key_codes(frames[known][list(edge.columns_of(known))], frames[new][list(edge.columns_of(new))])
        for edge, known, new in spec.join_order()
    ]


def join_drops(
    spec: RelationalSpec, frames: Mapping[str, pd.DataFrame], partner: list[tuple[np.ndarray, np.ndarray]]
) -> list[tuple[str, str, int]]:
    """Per join of the tree (breadth-first from the label table): (join, table joined, label-table rows that
    the inner join loses there). Raw key values (the simulation owns every table). On the table level: a row
    survives the joins so far when, for each of its joins among them, a surviving row of the child table
    shares its key (children first); the join itself is never materialized. ``partner``: :func:`edge_codes`."""
    root = spec.label_table
    order = list(spec.join_order())
    out = []
    before = len(frames[root])
    for k, (edge, _, new) in enumerate(order):
        alive = {t: np.ones(len(f), dtype=bool) for t, f in frames.items()}
        for (_, known_t, new_t), (code_known, code_new) in zip(order[k::-1], partner[k::-1]):  # children first
            has = np.zeros(int(max(code_known.max(initial=-1), code_new.max(initial=-1))) + 1, dtype=bool)
            has[code_new[alive[new_t]]] = True
            alive[known_t] &= has[code_known]
        after = int(alive[root].sum())
        out.append((str(edge), new, before - after))
        before = after
    return out


def fanout_problems(
    spec: RelationalSpec, frames: Mapping[str, pd.DataFrame], partner: list[tuple[np.ndarray, np.ndarray]]
) -> list[Problem]:
    """A join whose new table holds a key value on more than one row repeats every row of the known table that
    holds it, once per partner (many-to-many): a warning naming the join and the counts, unless the new
    table's spec says ``unique`` (true: its node refuses the duplicates; false: a row per partner is meant).
    ``partner``: :func:`edge_codes`."""
    out = []
    for (edge, known, new), (code_known, code_new) in zip(spec.join_order(), partner):
        if spec.table(new).unique is not None:
            continue
        size = int(max(code_known.max(initial=-1), code_new.max(initial=-1))) + 1
        repeated = np.bincount(code_new, minlength=size) > 1
        rows = int(repeated[code_known].sum())
        if rows:
            values = int((repeated & (np.bincount(code_known, minlength=size) > 0)).sum())
            what = (
                f"join {edge}: {values:,} key value{'s' if values > 1 else ''} of table {new!r} "
                f"{'are' if values > 1 else 'is'} on more than one of its rows, so the join repeats the {rows:,} rows "
                f"of table {known!r} that hold {'them' if values > 1 else 'it'}, once per partner row"
            )
            fix = (
                f"set unique: false on table {new!r} if a training row per partner is meant (many-to-many), "
                "unique: true to refuse the duplicates, or remove them"
            )
            out.append(Problem(None, what, fix, count=rows, severity="warning"))
    return out


#: text that reads as a date written with separators (2000-01-31, 01/31/2000, 31.01.2000), optionally a time
DATE_TEXT = r"^\d{1,4}[-/.]\d{1,2}[-/.]\d{1,4}([ T]\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?)?$"


def _loose_column(col: pd.Series) -> pd.Series:
    """A text key column stripped of surrounding spaces and case-folded, and, when every value reads as a date
    written with separators, as the instant it names (ISO text); another column as it is."""
    if not (pd.api.types.is_object_dtype(col) or pd.api.types.is_string_dtype(col)):
        return col
    text = col.astype("string").str.strip().str.casefold()
    values = text.dropna().unique()
    if len(values) and pd.Series(values).str.fullmatch(DATE_TEXT).all():
        parsed = pd.to_datetime(pd.Series(values), format="mixed", errors="coerce")
        if parsed.notna().all():
            return text.map(dict(zip(values, parsed.dt.strftime("%Y-%m-%dT%H:%M:%S.%f"))))
    return text


def near_key_example(frames: Mapping[str, pd.DataFrame], edge: Any, known: str, new: str) -> tuple[int, str] | None:
    """When a join's string keys match more rows once surrounding spaces, case and the way a date is written
    are ignored (``'Abilene'`` against ``'ABILENE '``, ``'2000-01-31'`` against ``'01/31/2000'``): how many rows of table ``known`` would then find a partner, and the first such key
    as each table writes it (values: a simulation's line only); else None."""
    a = frames[known][list(edge.columns_of(known))]
    b = frames[new][list(edge.columns_of(new))]
    if not any(pd.api.types.is_object_dtype(c) or pd.api.types.is_string_dtype(c) for _, c in a.items()):
        return None
    raw_a, raw_b = _key_codes(a, b)
    loose_a, loose_b = _key_codes(a.apply(_loose_column), b.apply(_loose_column))
    gained = np.isin(loose_a, loose_b) & ~np.isin(raw_a, raw_b)
    if not gained.any():
        return None
    i = int(np.flatnonzero(gained)[0])
    j = int(np.flatnonzero(loose_b == loose_a[i])[0])

    def shown(frame: pd.DataFrame, row: int) -> str:
        values = tuple(frame.iloc[row])
        return repr(values[0]) if len(values) == 1 else repr(values)

    return int(gained.sum()), f"{known} holds {shown(a, i)} where {new} holds {shown(b, j)}"


def dropped_row_problems(
    spec: RelationalSpec,
    frames: Mapping[str, pd.DataFrame],
    policy: str,
    partner: list[tuple[np.ndarray, np.ndarray]],
) -> list[Problem]:
    """A join that drops more than 1% of the label table's rows: a warning (``policy=warn``), an error
    (``error``) or nothing (``ignore``); the line names the join and the count. ``partner``: :func:`edge_codes`."""
    if policy not in DROP_POLICIES:
        raise SpecError(f"dataset.on_dropped_rows must be one of {list(DROP_POLICIES)}, got {policy!r}")
    n = len(frames[spec.label_table])
    out = []
    joins = {str(edge): (edge, known) for edge, known, _ in spec.join_order()}
    for edge, new, lost in join_drops(spec, frames, partner):
        noted = lost == n or (lost > DROP_THRESHOLD * n and policy != "ignore" and spec.table(new).where is None)
        near = near_key_example(frames, joins[edge][0], joins[edge][1], new) if noted else None
        loose = (
            ""
            if near is None
            else f"; {near[0]:,} rows of table {joins[edge][1]!r} hold a key that differs from one of table "
            f"{new!r} only in case, surrounding spaces or the way a date is written: write the keys alike in both files"
        )
        example = None if near is None else f"e.g. {near[1]}"
        if lost == n:
            return out + [
                Problem(
                    None,
                    f"join {edge} matched no rows: the join comes out empty",
                    f"check the key values of both tables (no row of table {new!r} has a partner){loose}",
                    example=example,
                )
            ]
        if lost > DROP_THRESHOLD * n and policy != "ignore":
            where = spec.table(new).where
            head = f"join {edge} drops {lost:,} of the {n:,} rows of label table {spec.label_table!r} ({lost / n:.1%})"
            if where is not None:  # the owner's filter (a WHERE of the query) removed their partners: intended
                before = frames[new].attrs.get(WHERE_ROWS_ATTR)
                keeps = "" if before is None else f", which keeps {len(frames[new]):,} of its {before:,} rows"
                what = f"{head}: their partner rows in table {new!r} are filtered out by its WHERE ({where}){keeps}"
                fix = (
                    "loosen the WHERE, or set dataset.on_dropped_rows=ignore to train on the rest"
                    if policy == "error"
                    else "the run trains on the rest (dataset.on_dropped_rows=ignore silences this line, =error refuses)"
                )
            else:
                what = f"{head}: they have no partner row in table {new!r}"
                fix = "add the missing rows to that table, or set dataset.on_dropped_rows=ignore to train on the rest"
                fix += ("" if policy == "error" else " (=error to refuse)") + loose
            severity: Severity = "error" if policy == "error" else "warning"
            out.append(Problem(None, what, fix, count=lost, severity=severity, example=example))
    return out


def dataset_problems(
    spec: RelationalSpec,
    frames: Mapping[str, pd.DataFrame],
    read_errors: Sequence[Problem] = (),
    on_dropped_rows: str = "warn",
    joins: bool = True,
) -> tuple[RelationalSpec, list[Problem]]:
    """Every problem of a dataset whose tables ``frames`` were loaded (``read_errors``: the tables that could
    not be); returns the spec with its label table resolved (when that worked) and the problems, errors and
    warnings. The joins are checked (``joins``) only when every table is sound."""
    problems = list(read_errors)
    if spec.label.table is None and len(frames) == len(spec.table_names):  # else table_problems says it
        try:
            spec = resolve_label_table(spec, {n: list(f.columns) for n, f in frames.items()})
        except SpecError as exc:
            problems.append(Problem(None, str(exc), "set label.table and label.column in the dataset config"))
    for name in spec.table_names:
        if name in frames:
            problems += table_problems(spec, name, frames[name])
    problems += key_kind_problems(spec, frames)
    if joins and not errors(problems) and spec.label.table is not None:
        partner = edge_codes(spec, frames)  # the key codes of every join, once for both checks
        problems += dropped_row_problems(spec, frames, on_dropped_rows, partner)
        if not errors(problems):
            problems += fanout_problems(spec, frames, partner)
    return spec, problems
