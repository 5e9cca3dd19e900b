"""Use a trained model: ``python -m simulations.predict RUN_DIR --rows FILE [--out predictions.csv]``.

Federated prediction in simulation (docs/prediction.md): the nodes of the training run in RUN_DIR come back
with their saved parts (RUN_DIR/node-state), the query table's owner (--table, default the label table's)
supplies the new rows FILE (CSV or Parquet, in the table's own format: its join keys and the columns its
features come from; other columns are ignored with one line), the other owners the tables they serve now; the
server (strategies/predict.py) joins the keys, sums the parts' outputs and writes one line per new row (the
mean over its joined rows), or with --per-joined-row one per joined row. New rows that join no partner are
counted and their row numbers written beside the predictions (``--out pred_new.csv``: pred_new.unjoined.csv). Bad input (a rows file without the key columns, a
missing key, wrong types; a missing part): one line on stderr, exit status 1, nothing written."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf, open_dict

from simulations.federated import in_process_contexts, run_flower_simulation, run_in_process
from strategies.model_record import read_model_record
from strategies.predict import (
    PREDICTIONS_FILE,
    FederatedPrediction,
    Predictions,
    unjoined_path,
    write_predictions,
)
from strategies.transport import RunError
from tpflower.app.client_app import make_client
from tpflower.checks import NA_ATTR
from tpflower.datasets import derive_rows, load_spec, load_table
from tpflower.datasets.files import is_parquet, read_rows_file
from tpflower.local_table import encode_labels
from tpflower.model_part import ModelPart
from tpflower.owner import simulation_secret
from tpflower.phases.predict import (
    median_filled_line,
    missing_category_line,
    read_rows,
    saved_part,
    unseen_category_line,
)
from tpflower.preprocess import missing_categories, unseen_categories
from tpflower.schema import RelationalSpec, SpecError
from tpflower.sql import row_mask


def predict_run(
    run_dir: str | Path,
    rows: str | Path,
    shard: int = 0,
    runtime: str = "inprocess",
    base_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    table: str | None = None,
    per_joined_row: bool = False,
    rows_name: str | None = None,
    python: bool = False,
) -> Predictions:
    """Score the new rows ``rows`` with the model of ``run_dir`` (its model.json and its nodes' parts); the
    shard ``shard`` of table ``table`` (default: the label table) holds them. ``runtime``: inprocess, or flower (the simulation engine).
    ``per_joined_row``: the predictions' frame has a line per joined row, not one per new row. ``rows_name``:
    what the lines and errors about the rows call them (default: "rows file ROWS"; the Python API's DataFrame,
    written to a temporary file: "the rows"). ``python``: a wrong ``table`` or ``runtime`` is named as the Python
    API's argument (``table='x'``), not as the command line's option (``--table 'x'``)."""
    if runtime not in ("inprocess", "flower"):  # before any work
        said = f"runtime={runtime!r}" if python else f"--runtime {runtime!r}"
        raise ValueError(f"{said}: no such runtime (inprocess or flower)")
    for name in ("flwr", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    run_dir = Path(run_dir).resolve()
    record = read_model_record(run_dir)
    rows_path = Path(rows).resolve()
    if not rows_path.is_file():
        raise ValueError(f"rows file {rows}: no such file")
    cfg = OmegaConf.create(record["config"])
    base = str(base_dir) if base_dir is not None else recorded_base_dir(record)
    spec = load_spec(cfg.dataset, base_dir=base)
    table = table or spec.label_table
    if table not in spec.table_names:
        said = f"table={table!r}" if python else f"--table {table!r}"
        raise ValueError(f"{said}: no such table (tables: {', '.join(spec.table_names)})")
    loader = None if spec.table(table).source else (cfg.dataset.get("loader") or {}).get("name")  # as the node
    ignored = unused_columns(rows_path, spec, table, loader)
    if ignored:
        log(
            f"{rows_name or f'rows file {rows}'}: column(s) {ignored} are no feature or key of table {table!r}: ignored"
        )
    frame = read_rows_once(rows_path, spec, table)
    notes = () if frame is None else na_text(rows_path, frame, spec, table).items()
    for c, (n, row, value) in notes:
        log(
            f"{rows_name or f'rows file {rows}'}: column {c!r} holds {n} value(s) like {value!r} (the first in row "
            f"{row}), read as missing: the median fills them (dataset.na_strings: error refuses them)"
        )
    unknown, missing, filled = (
        ({}, {}, {})
        if frame is None
        else unseen(frame, table, run_dir, record["run_id"], shard, simulation_secret(cfg))
    )
    for c, seen in unknown.items():
        log(unseen_category_line(rows_name or f"rows file {rows}", c, *seen))
    for c, (n, row) in missing.items():
        log(missing_category_line(rows_name or f"rows file {rows}", c, n, row))
    for c, (n, row, median) in filled.items():
        log(median_filled_line(rows_name or f"rows file {rows}", c, n, row, median))
    outside = 0 if frame is None else outside_where(frame, spec, table)
    del frame
    if outside:
        log(
            f"{rows_name or f'rows file {rows}'}: {outside} new row(s) fall outside table {table!r}'s where "
            f"({spec.table(table).where}), on which the model never trained: scored all the same"
        )
    with open_dict(cfg):
        cfg.predict = {"run_id": record["run_id"], "rows": str(rows_path), "table": table, "shard": shard}
        cfg.predict.per_joined_row = per_joined_row
        if rows_name is not None:  # the node's lines name the rows so, not the file
            cfg.predict.rows_name = rows_name
    strategy = FederatedPrediction(cfg, spec, record, (table, int(shard)), log)
    if runtime == "flower":  # the engine takes seconds to start: the query owner's check of its rows first
        check_rows_first(cfg, strategy, (table, int(shard)), run_dir, base, str(record["run_id"]))
    if runtime == "inprocess":
        run_in_process(cfg, run_dir, base, log, strategy=strategy)  # type: ignore[arg-type]
    else:
        run_flower_simulation(cfg, run_dir, base, log, strategy=strategy)  # type: ignore[arg-type]
    assert strategy.results is not None
    if spec.label.task != "regression":  # a simulation's user holds the label table: classes by name, as its owner
        _, labels = load_table(cfg.dataset, spec.label_table, base_dir=base)
        strategy.results.classes = encode_labels(spec, labels[spec.label.column])[1]
    return strategy.results


def recorded_base_dir(record: dict) -> str:
    """Where a prediction's relative table sources start when none is given: the folder the training run's
    started at (model.json's ``base_dir``, a simulation's), while it is a folder here; else the working
    directory."""
    recorded = record.get("base_dir")
    return str(recorded) if isinstance(recorded, str) and Path(recorded).is_dir() else os.getcwd()


def check_rows_first(
    cfg: DictConfig, strategy: FederatedPrediction, query: tuple[str, int], run_dir: Path, base: str, run_id: str
) -> None:
    """The query owner's node's own check of the new rows (tpflower.phases.predict.read_rows, on its saved model
    part), made before Flower's engine starts: in a simulation the user holds every table, so a bad rows file
    is its one line in seconds, not after the engine's start. Raises that line, naming the table and shard."""
    context = in_process_contexts(strategy, base)[query]
    try:
        client = make_client(cfg, context, base, state_dir=str(run_dir / "node-state"))
        read_rows(str(cfg.predict.rows), client, saved_part(client, run_id)[0])
    except (SpecError, ValueError) as exc:
        raise SpecError(f"table {query[0]!r} shard {query[1]}: {exc}") from None


def read_rows_once(path: Path, spec: RelationalSpec, table: str) -> pd.DataFrame | None:
    """The rows file as the query owner's node reads it (tpflower.datasets.files.read_rows_file), read once for
    all of the driver's notices; None when it does not read (the node says why, in its one line)."""
    try:
        return read_rows_file(path, spec.key_columns(table))
    except (OSError, ValueError, pa.ArrowException):
        return None


def unseen(
    frame: pd.DataFrame, table: str, run_dir: Path, run_id: str, shard: int, secret: bytes
) -> tuple[dict[str, tuple[int, int, str]], dict[str, tuple[int, int]], dict[str, tuple[int, int, float]]]:
    """The categorical columns of the rows ``frame`` holding categories no training row had (tpflower.preprocess.
    unseen_categories; over a union, no shard's: the part names the other shards' categories by the digests of
    the rows' values, ``secret``), those missing a value no training row missed (missing_categories), and
    boosted trees' numeric columns missing a value no training row missed, scored as their median
    (ModelPart.median_filled): a simulation's saved part, RUN_DIR/node-state (none: no part there)."""
    part = ModelPart.load(run_dir / "node-state", run_id, table, shard)
    if part is None:
        return {}, {}, {}
    categories = part.naming(frame, secret).preprocessing.get("categories") or {}
    return unseen_categories(categories, frame), missing_categories(categories, frame), part.median_filled(frame)


def outside_where(frame: pd.DataFrame, spec: RelationalSpec, table: str) -> int:
    """How many of the rows ``frame`` fail the query table's ``where`` (0: none, no where, or a predicate this
    cannot evaluate: the node says why, in its one line)."""
    where = spec.table(table).where
    if where is None:
        return 0
    try:
        return int((~row_mask(table, frame, where)).sum())
    except (ValueError, SpecError):
        return 0


def na_text(path: Path, frame: pd.DataFrame, spec: RelationalSpec, table: str) -> dict[str, tuple[int, int, str]]:
    """Under ``dataset.na_strings: missing``, the numeric columns of ``table`` where the CSV rows file (read into
    ``frame``) has text for a missing number ("n/a", "NULL", ...): (count, first row, the text). Under ``error``
    the node refuses them in its one line (tpflower.phases.predict.read_rows)."""
    if spec.na_strings != "missing":  # (a Parquet file notes none, but the one a DataFrame's rows are written to)
        return {}
    noted = frame.attrs.get(NA_ATTR) or {}
    return {c: v for c, v in noted.items() if c in spec.table(table).numeric}


def unused_columns(path: Path, spec: RelationalSpec, table: str, loader: str | None) -> list[str]:
    """The columns of the rows file that the model of ``table`` does not take (neither join key, feature nor the
    label); the query owner's node ignores them (tpflower.phases.predict.read_rows)."""
    try:
        if is_parquet(path):
            columns = pq.read_schema(path).names
        else:
            columns = list(pd.read_csv(path, nrows=0).columns)
    except (OSError, ValueError, pa.ArrowException):
        return []  # an unreadable file: the node says why, in its one line
    t = spec.table(table)
    label = [spec.label.column] if spec.label.table == table else []
    used = {*spec.key_columns(table), *t.features, *(c for c, _ in t.binned), *label}
    if loader is not None:  # a column the loader derives features from is used too
        header = pd.DataFrame(columns=columns)
        derived = set(derive_rows(loader, table, header).columns)
        used |= {
            c for c in columns if set(derive_rows(loader, table, header.drop(columns=[c])).columns) != derived - {c}
        }
    return [c for c in columns if c not in used]


def out_problem(out: Path, rows: Path) -> str | None:
    """Why the predictions cannot go to ``out`` (checked before any work), or None: a directory, or the rows
    file itself (it, or the file of unjoined rows beside it, would overwrite the new rows)."""
    if out.is_dir():
        return f"--out {out} is a directory: give the predictions file's name (e.g. {out / PREDICTIONS_FILE})"
    if rows.exists() and any(p.exists() and p.samefile(rows) for p in (out, unjoined_path(out))):
        return f"--out {out} would overwrite the rows file {rows}: give the predictions another file name"
    return None


def main(argv: Sequence[str] | None = None, prog: str = "python -m simulations.predict") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the training run's directory (model.json, node-state/)")
    parser.add_argument("--rows", required=True, help="the new rows (CSV or Parquet) of the query table")
    parser.add_argument("--table", help="the query table whose owner holds the new rows (default: the label table)")
    parser.add_argument("--out", help="the predictions CSV (default RUN_DIR/predictions.csv)")
    parser.add_argument("--shard", type=int, default=0, help="the query table's shard that holds the rows")
    parser.add_argument(
        "--per-joined-row",
        action="store_true",
        help="a line per joined row (with the partner tables' rows), not one per new row (the mean over its joined rows)",
    )
    parser.add_argument("--runtime", choices=("inprocess", "flower"), default="inprocess")
    parser.add_argument(
        "--base-dir",
        help="where relative dataset paths start (default: the training run's, in its model.json; else the current "
        "directory)",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out) if args.out else Path(args.run_dir) / PREDICTIONS_FILE
    problem = out_problem(out, Path(args.rows))
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 1
    try:
        pred = predict_run(
            args.run_dir,
            args.rows,
            args.shard,
            args.runtime,
            args.base_dir,
            table=args.table,
            per_joined_row=args.per_joined_row,
        )
    except (RunError, SpecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    write_predictions(pred, out)
    print(
        f"{pred.n_rows + len(pred.unjoined)} new rows: {pred.n_rows} scored over {len(pred.rows)} joined rows, "
        f"{len(pred.unjoined)} joined no partner; {time.perf_counter() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
