"""Dataset loading: a dataset config (conf/dataset/NAME.yaml) -> a validated spec and its tables.

``load_dataset(cfg)`` parses the relational spec, takes each table from its ``source`` file or else from the
bundled loader named in ``cfg.loader``, gives every frame a fresh RangeIndex (row id = position) and validates
the tables against the spec. ``shard_rows`` splits a table's row ids into its horizontal shards.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tpflower.checks import DROP_POLICIES, DataProblems, Problem, dataset_problems, errors, table_problems
from tpflower.datasets import movielens, movielens1m, nycflights13, synthetic
from tpflower.datasets.files import read_table, resolve_path, whole_as_integers
from tpflower.schema import RelationalSpec, SpecError, TableSpec, parse_spec, to_dict
from tpflower.sql import compile_query, filter_rows, query_tables

Loader = Callable[..., dict[str, pd.DataFrame]]
Describer = Callable[..., dict[str, Any]]
Deriver = Callable[[str, pd.DataFrame], pd.DataFrame]

#: name -> loader(**kwargs, tables=None) -> {table name: frame} (tables: only those; every bundled loader takes it)
LOADERS: dict[str, Loader] = {
    "movielens": movielens.load,
    "movielens1m": movielens1m.load,
    "nycflights13": nycflights13.load,
    "synthetic": synthetic.generate,
}
#: name -> derive(table, frame) -> frame: rows in the format of the loader's source (new rows to score, say)
#: with the columns the loader derives from them added (movielens: the rating's time features)
DERIVERS: dict[str, Deriver] = {"movielens": movielens.derive}
#: name -> derived_from(table) -> {derived column: the source column it comes from}
DERIVED_FROM: dict[str, Callable[[str], dict[str, str]]] = {"movielens": movielens.derived_from}
#: name -> describe(**kwargs) -> spec parts (tables/label/joins/split) used where the config has none
DESCRIBERS: dict[str, Describer] = {"synthetic": synthetic.describe}
SPEC_PARTS: tuple[str, ...] = ("tables", "label", "joins", "split")

__all__ = [
    "DESCRIBERS",
    "LOADERS",
    "check_dataset",
    "column_kind",
    "compile_sql",
    "derive_rows",
    "derived_from",
    "load_dataset",
    "load_spec",
    "load_table",
    "load_tables",
    "register_loader",
    "release_tables",
    "shard_rows",
    "to_dict",
]


def register_loader(name: str, load: Loader, describe: Describer | None = None, derive: Deriver | None = None) -> None:
    """Make ``load`` (and optionally ``describe``, ``derive``) available as ``loader: {name: NAME, ...}``. A
    ``load`` that takes ``tables`` (a tuple of names) makes only those: each client then loads its own table
    alone. ``derive(table, frame)``: the loader's derived columns of rows in its source's format."""
    LOADERS[name] = load
    if describe is not None:
        DESCRIBERS[name] = describe
    if derive is not None:
        DERIVERS[name] = derive


def derived_from(loader: str, table: str) -> dict[str, str]:
    """``{derived column: its source column}`` of the loader's ``table`` (empty for a loader without any)."""
    of = DERIVED_FROM.get(loader)
    return {} if of is None else of(table)


def derive_rows(loader: str, table: str, frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (rows of ``table`` in the format of the loader's source) with the columns the loader derives
    from them (its ``derive``); unchanged for a loader without one."""
    derive = DERIVERS.get(loader)
    return frame if derive is None else derive(table, frame)


def _loader_call(cfg: Mapping[str, Any], base_dir: str | Path | None) -> tuple[str | None, dict[str, Any]]:
    """(loader name, kwargs) of ``cfg.loader``; a relative ``path`` kwarg is resolved against ``base_dir``."""
    raw = dict(cfg.get("loader") or {})
    name = raw.pop("name", None)
    if name is None:
        if raw:
            raise SpecError(f"dataset {cfg.get('name', 'dataset')!r}: loader settings {sorted(raw)} but no loader.name")
        return None, {}
    if name not in LOADERS:
        raise SpecError(f"unknown dataset loader {name!r}; known loaders: {sorted(LOADERS)}")
    if isinstance(raw.get("path"), (str, Path)):
        raw["path"] = str(resolve_path(raw["path"], base_dir))
    return str(name), raw


def _spec_and_loader(
    cfg: Mapping[str, Any], base_dir: str | Path | None
) -> tuple[RelationalSpec, str | None, dict[str, Any]]:
    """The parsed spec (a loader's ``describe`` fills the parts the config leaves out) and the loader call."""
    cfg = to_dict(cfg)
    loader_name, kwargs = _loader_call(cfg, base_dir)
    if loader_name in DESCRIBERS:
        described = DESCRIBERS[loader_name](**kwargs)
        cfg = {**cfg, **{k: v for k, v in described.items() if k in SPEC_PARTS and cfg.get(k) is None}}
    return parse_spec(cfg), loader_name, kwargs


def _frame(
    table: TableSpec,
    loader_name: str | None,
    kwargs: dict[str, Any],
    base_dir: str | Path | None,
    loaded: dict[str, pd.DataFrame] | None,
    keys: Sequence[str] = (),
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame] | None]:
    """One table's frame (RangeIndex) from its source file or the loader; ``loaded`` None: the loader makes
    this table alone (a client's load), else ``loaded`` holds the loader's tables (all of them). ``keys``: its
    join key columns (a CSV's zero-padded codes kept as text: tpflower.datasets.files.key_columns)."""
    if table.source is not None:
        frame = read_table(table.name, table.source, base_dir, keys)
        if table.where is None:
            return frame, loaded
        # a key column of whole numbers and blanks is float in the file (1.0, 5.0, ''); once the owner's filter
        # drops the blank rows its keys are the integers they were (a missing key is refused, with its row)
        kept = filter_rows(table.name, frame, table.where)
        for k in keys:
            if k in kept.columns:
                kept[k] = whole_as_integers(kept[k])
        return kept, loaded
    if loader_name is None:
        raise SpecError(f"table {table.name!r} has no source file and the dataset has no loader; set its 'source'")
    frames = loaded if loaded is not None else load_tables(loader_name, kwargs, (table.name,))
    if table.name not in frames:
        raise SpecError(
            f"table {table.name!r} has no source file and loader {loader_name!r} gives no such table; "
            f"it gives {sorted(frames)}"
        )
    return filter_rows(table.name, frames[table.name].reset_index(drop=True), table.where), loaded


def load_tables(loader_name: str, kwargs: Mapping[str, Any], tables: tuple[str, ...]) -> dict[str, pd.DataFrame]:
    """The loader's tables ``tables`` only, made without the others when the loader takes ``tables`` (every
    bundled loader does); a loader that does not is run whole and cut. Not cached: the client caches its table."""
    load = LOADERS[loader_name]
    if "tables" in inspect.signature(load).parameters:
        try:
            return load(**kwargs, tables=tables)
        except SpecError:
            pass  # a table the loader does not give: reported by the caller, naming the loader's tables
    frames = load(**kwargs)
    return {t: frames[t] for t in tables if t in frames} or frames


@lru_cache(maxsize=2)
def _run_loader(name: str, kwargs_json: str) -> dict[str, pd.DataFrame]:
    """A bundled loader's tables (all of them), once per process: the whole-dataset paths (centralized
    baseline, checks) load every table."""
    return LOADERS[name](**json.loads(kwargs_json))


def release_tables() -> None:
    """Drop the whole-dataset tables this process keeps (the cache of :func:`check_dataset`'s loads)."""
    _run_loader.cache_clear()


def _frames(
    spec: RelationalSpec, loader_name: str | None, kwargs: dict[str, Any], base_dir: str | Path | None
) -> tuple[dict[str, pd.DataFrame], list[Problem]]:
    """Every table that loads, and one problem per table that does not (file missing, empty, unreadable)."""
    loaded: dict[str, pd.DataFrame] | None = None
    frames: dict[str, pd.DataFrame] = {}
    problems: list[Problem] = []
    for table in spec.tables:
        try:
            if table.source is None and loader_name is not None and loaded is None:
                loaded = _run_loader(loader_name, json.dumps(kwargs, sort_keys=True))  # every table, once
            keys = spec.key_columns(table.name)
            frames[table.name], loaded = _frame(table, loader_name, kwargs, base_dir, loaded, keys)
        except DataProblems as exc:
            problems += exc.problems
        except SpecError as exc:
            problems.append(
                Problem(None, str(exc), "fix the table's source or where in the dataset config (with sql: its WHERE)")
            )
    return frames, problems


def column_kind(dtype: Any) -> str:
    """A column's feature role by its dtype: numeric (numbers, booleans), categorical (strings), else the dtype."""
    if pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_numeric_dtype(dtype):
        return "numeric"
    if (
        isinstance(dtype, pd.CategoricalDtype)
        or pd.api.types.is_string_dtype(dtype)
        or pd.api.types.is_object_dtype(dtype)
    ):
        return "categorical"
    return str(dtype)


def compile_sql(cfg: Mapping[str, Any], base_dir: str | Path | None = None) -> dict[str, Any]:
    """The dataset config with its ``sql`` query compiled into tables, label and joins (tpflower.sql); a config
    without ``sql`` is returned as a plain dict. Reads the columns of the query's tables (each from its source
    file or the loader); a loader's ``describe`` supplies the table settings (regions, shards) and the label's
    task the config leaves out."""
    cfg = to_dict(cfg)
    if not cfg.get("sql"):
        return cfg
    loader_name, kwargs = _loader_call(cfg, base_dir)
    if loader_name in DESCRIBERS:
        described = DESCRIBERS[loader_name](**kwargs)
        if cfg.get("tables") is None:
            cfg["tables"] = {
                t: {k: v for k, v in (s or {}).items() if k not in ("numeric", "categorical")}
                for t, s in described.get("tables", {}).items()
            }
        if cfg.get("label") is None and described.get("label"):
            cfg["label"] = {"task": described["label"].get("task", "regression")}
        cfg = {**cfg, **{k: v for k, v in described.items() if k == "split" and cfg.get(k) is None}}
    settings = cfg.get("tables") or {}
    columns: dict[str, dict[str, str]] = {}
    if loader_name is not None:  # every table of the loader: an unknown table's refusal lists them all
        for name, frame in _run_loader(loader_name, json.dumps(kwargs, sort_keys=True)).items():
            columns[name] = {str(c): column_kind(frame[c].dtype) for c in frame.columns}
    for name in query_tables(str(cfg["sql"])):  # a table with a source file: its file's columns
        source = (settings.get(name) or {}).get("source")
        if source is not None:
            frame = read_table(name, source, base_dir)
            columns[name] = {str(c): column_kind(frame[c].dtype) for c in frame.columns}
    for name in settings:  # a declared table the query names not, left unread: an unknown table's refusal lists it
        columns.setdefault(str(name), {})
    return compile_query(str(cfg["sql"]), columns, cfg)


def check_dataset(
    cfg: Mapping[str, Any],
    base_dir: str | Path | None = None,
    on_dropped_rows: str | None = None,
    joins: bool = True,
) -> tuple[RelationalSpec, dict[str, pd.DataFrame], list[Problem]]:
    """Load every table and check them all (tpflower.checks): the label-resolved spec, the frames that loaded
    and every problem found (errors and warnings). ``on_dropped_rows`` (default: the config's
    ``on_dropped_rows``, else warn) decides how rows the joins drop are reported; ``joins=False`` skips the
    joins (an empty join is then the table mapping's error)."""
    policy = on_dropped_rows or str(to_dict(cfg).get("on_dropped_rows") or "warn")
    if policy not in DROP_POLICIES:
        raise SpecError(f"dataset.on_dropped_rows must be one of {list(DROP_POLICIES)}, got {policy!r}")
    spec, loader_name, kwargs = _spec_and_loader(cfg, base_dir)
    frames, read_errors = _frames(spec, loader_name, kwargs, base_dir)
    spec, problems = dataset_problems(spec, frames, read_errors, policy, joins)
    return spec, frames, problems


def load_dataset(
    cfg: Mapping[str, Any], base_dir: str | Path | None = None
) -> tuple[RelationalSpec, dict[str, pd.DataFrame]]:
    """Load and validate a dataset: returns the label-resolved spec and {table: frame with a RangeIndex}.

    A table with ``source`` is read from that .csv/.parquet file (relative to ``base_dir``, default the cwd);
    otherwise it is the loader's table of the same name. A loader with a ``describe`` supplies the spec parts
    (tables/label/joins/split) the config leaves out. Raises DataProblems (a SpecError) with every problem found,
    each naming the table and column at fault (rows the joins drop are check_dataset's).
    """
    spec, frames, problems = check_dataset(cfg, base_dir, joins=False)
    if errors(problems):
        raise DataProblems(errors(problems), spec.name)
    return spec, frames


def load_spec(cfg: Mapping[str, Any], base_dir: str | Path | None = None) -> RelationalSpec:
    """The server's view: the parsed spec only (it never loads a table). Federated runs need label.table."""
    if to_dict(cfg).get("sql"):
        raise SpecError(
            f"dataset {to_dict(cfg).get('name', 'dataset')!r} is a SQL query: compile it into a dataset spec first "
            "(python -m simulations.run does; for a deployment: python -m simulations.sql dataset=NAME > NAME.yaml)"
        )
    spec, _, _ = _spec_and_loader(cfg, base_dir)
    if spec.label.table is None:
        raise SpecError(f"dataset {spec.name!r}: federated runs need label.table (the table that owns the label)")
    return spec


def load_table(
    cfg: Mapping[str, Any], name: str, base_dir: str | Path | None = None, warn: Callable[[str], None] | None = None
) -> tuple[RelationalSpec, pd.DataFrame]:
    """What one client loads: the spec and its own table only, checked with the checks it can run alone
    (tpflower.checks.table_problems; DataProblems with all its errors; its warnings to ``warn``, one line each,
    None: unsaid, as a simulation's data check said them already).

    The label table must be named in the config (``label.table``): a client cannot see the other tables.
    """
    spec = load_spec(cfg, base_dir)
    _, loader_name, kwargs = _spec_and_loader(cfg, base_dir)
    frame, _ = _frame(spec.table(name), loader_name, kwargs, base_dir, None, spec.key_columns(name))
    problems = table_problems(spec, name, frame)
    if errors(problems):
        raise DataProblems(errors(problems), spec.name)
    for p in problems if warn is not None else ():
        warn(p.line())
    return spec, frame


def shard_rows(table: TableSpec, frame: pd.DataFrame) -> list[np.ndarray]:
    """Row ids (int64, ascending) of each shard of ``table``; together they cover every row exactly once.

    ``shards.by``: one shard per distinct value of that column, in sorted value order.
    ``shards.parts``: q random near-equal parts drawn with ``numpy.random.default_rng(shards.seed)``.
    No shards: a single shard with all rows.
    """
    n = len(frame)
    spec = table.shards
    if spec is None:
        return [np.arange(n, dtype=np.int64)]
    if spec.by is not None:
        if spec.by not in frame.columns:
            raise SpecError(
                f"table {table.name!r} has no shard column {spec.by!r}; its columns are {list(frame.columns)}"
            )
        if spec.values is not None:
            column = frame[spec.by].astype(str)
            listed = column.isin([str(v) for v in spec.values])  # (pandas 4 refuses values outside the categories)
            codes = pd.Categorical(column.where(listed), categories=list(spec.values)).codes
            if (codes < 0).any():  # counted, never shown: a refusal travels to the server, a value must not
                raise SpecError(
                    f"table {table.name!r}, shard column {spec.by!r}: {int((codes < 0).sum())} rows hold a value "
                    f"that is not among the declared shard values {list(spec.values)}"
                )
            n_shards = len(spec.values)
        else:
            codes, uniques = pd.factorize(frame[spec.by], sort=True)
            if (codes < 0).any():
                raise SpecError(
                    f"table {table.name!r}, shard column {spec.by!r}: {int((codes < 0).sum())} missing values"
                )
            n_shards = len(uniques)
        order = np.argsort(codes, kind="stable").astype(np.int64)
        bounds = np.cumsum(np.bincount(codes, minlength=n_shards))[:-1]
        return np.split(order, bounds)
    parts = int(spec.parts)  # type: ignore[arg-type]
    if parts > n:
        raise SpecError(f"table {table.name!r}: {parts} shards requested but the table has only {n} rows")
    perm = np.random.default_rng(spec.seed).permutation(n)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, parts)]
