"""Saved model parts and federated prediction, client side (docs/prediction.md; server: strategies/predict.py).

At the end of a training run (a stage after training, every predictor's protocol):

  save_part     {}            -> {} {part}: this node stores its part (tpflower.model_part) under its owner's
                                 state_dir, named by the run; ``part`` its id ("" without a state_dir or theta)

A prediction request is a protocol of its own (:data:`PREDICT`), never mixed with training:

  predict_keys  {} {run_id, query, chunk_rows} -> {row_ids, code.<join>, digest.<join>...} (keys=blind:
                                 code/blind, then reblind): the query owner (``query``: 1) reads the new
                                 rows of its settings' ``prediction_rows`` file, every other node takes the
                                 rows it serves now; codes and keyed digests of their join keys, as in
                                 training's keys phase (more rows than chunk_rows: chunk 0)
  keys_chunk    as in setup: the later chunks, in order, each once, none beyond the rows
  reblind       as in setup (keys=blind; lists in chunks)
  predict_rows  {rows}        -> {h}: f_i(theta_i; x_u) of its rows ``rows`` with the saved theta_i and the
                                 saved preprocessing; k-means: {labels}, each row's nearest local centre
  deliver       {col.<name>..., unjoined} -> {} {written}: the query owner only; it writes the predictions
                                 (one column per array, ``row`` its new row's number) to
                                 STATE_DIR/predictions/<run>.csv and the new rows that joined nothing to
                                 <run>.unjoined.csv (0600)

The owner decides (tpflower.owner): a node answers only for a run whose part it still holds, only when its
settings say ``serve_predictions: true``, with the saved output width within its ``max_outputs``, and scores at
most ``max_prediction_rows`` rows per request. New rows are checked before anything leaves the node: key
columns present and of the kind training joined them as, numbers where training had numbers (columns the
model did not train on are ignored); one line naming the file, the table and the column.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tpflower.checks import NA_ATTR
from tpflower.client import TableClient
from tpflower.clustering import label_dtype
from tpflower.datasets import derive_rows, derived_from
from tpflower.datasets.files import is_parquet, read_rows_file
from tpflower.files import atomic_write
from tpflower.guard import Phase, Protocol, ProtocolRefusal, Stage, chunked_keys, takes
from tpflower.keys_payload import KeysPayload
from tpflower.local_table import with_class_names
from tpflower.model_part import ModelPart, part_id, part_path
from tpflower.phases.setup import REBLIND, REBUILD, chunked_reply, key_payload, keys_chunk, secret_check
from tpflower.preprocess import missing_categories, unseen_categories
from tpflower.records import Arrays
from tpflower.schema import DATETIME_TZ, SpecError, key_kind
from tpflower.selection import kept_theta


def _where(client: TableClient) -> str:
    return f"table {client.settings.table!r} shard {client.settings.shard}"


# ------------------------------------------------------------------------------------------------ saving


def save_part(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Store this node's part of the run's model under its owner's state_dir (the kept model when the message
    says ``keep``: tpflower.selection); reply its part id."""
    s = client.settings
    run_id = client.state.scalar("run_id")
    theta, centres = kept_theta(client, config), client.state.get("kmeans.C")
    trees = client.state.get("gbdt.splits")
    if trees is None and client.state.get_list("gbdt.edges") is not None:  # boosted trees: no split of it won
        trees = np.zeros((0, 5), dtype=np.int64)
    if s.owner.state_dir is None or (theta is None and centres is None and trees is None) or run_id is None:
        return {}, {"part": ""}
    if str(config.get("run_id", run_id)) != str(run_id):
        raise ProtocolRefusal(f"{_where(client)}: save_part names run {config.get('run_id')!r}, not its run")
    local = client.local
    assert local.preprocessor is not None
    t = s.spec.table(s.table)
    part = ModelPart(
        run_id=str(run_id),
        algorithm=client.algorithm,
        table=s.table,
        shard=s.shard,
        model=dict(s.model),
        width=local.width,
        d_out=int(client.state.scalar("d_out", 0)),  # k-means: 0 (it predicts a cluster)
        precision=s.precision,
        seed=s.seed,
        preprocessing=local.preprocessor.stats(),
        numeric=tuple(t.numeric),
        categorical=tuple(t.categorical),
        bin_edges={k: np.asarray(v, dtype=np.float64) for k, v in (local.bin_edges or {}).items()},
        theta={} if theta is None else {k: v.cpu().numpy() for k, v in theta.to_torch_state_dict().items()},
        centres=None if theta is not None or centres is None else np.asarray(centres, dtype=np.float64),
        **({} if trees is None else saved_splits(client, trees)),
    )
    return {}, {"part": part.save(s.owner.state_dir)}


def saved_splits(client: TableClient, splits: np.ndarray) -> dict[str, np.ndarray]:
    """Boosted trees: the table's splits (rows of split id, feature, bin, the gain's float64 bits, missing left)
    in id order, (split id, feature) with the threshold (the edge of the split's bin; every value left of a
    split that sends only the missing ones right: inf) in preprocessed and in raw units (numeric columns: x std
    + mean; a one-hot column keeps 0.5), the split's gain and the side of a missing value."""
    splits = np.asarray(splits, dtype=np.int64)[np.argsort(np.asarray(splits)[:, 0], kind="stable")]
    edges = client.state.get_list("gbdt.edges") or []
    thr = np.array([edges[f][b] if b >= 0 else np.nan for _, f, b, *_ in splits], dtype=np.float64)
    thr[(splits[:, 2] >= 0) & np.isnan(thr)] = np.inf  # the missing values' edge (tpflower.trees.column_edges)
    local = client.local
    assert local.preprocessor is not None
    stats = local.preprocessor.stats()
    raw = thr.copy()
    for i, f in enumerate(splits[:, 1]):
        name = local.feature_names[f]
        if name in (stats.get("means") or {}):
            raw[i] = thr[i] * float(stats["stds"][name]) + float(stats["means"][name])
    return {
        "splits": splits[:, :2].copy(),
        "thresholds": thr,
        "raw_thresholds": raw,
        "split_gains": splits[:, 3].view(np.float64).copy(),
        "missing_left": splits[:, 4] > 0,
        # per feature, whether it has a missing bin with training rows (else its missing values take the median's
        # side; a union's shards give every numeric column one, empty where no training row missed the column)
        "missing_bins": np.array([len(e) > 0 and bool(np.isnan(e[-1])) for e in edges], dtype=bool)
        & ~_empty_missing(client, len(edges)),
        **saved_categories(client),
    }


def _empty_missing(client: TableClient, n_features: int) -> np.ndarray:
    """The features whose missing bin holds no training row (tpflower.phases.gbdt.OwnerTrees.learn_empty_missing;
    none learnt: none)."""
    empty = client.state.get("gbdt.empty_missing")
    return np.zeros(n_features, dtype=bool) if empty is None else np.asarray(empty, dtype=bool)


def saved_categories(client: TableClient) -> dict[str, np.ndarray]:
    """Native categorical splits (tpflower.categorical; threshold NaN in ``saved_splits``): per category going
    left, (split id, its one-hot column) and its raw value (the column's category as preprocessing read it)."""
    rows = client.state.get("gbdt.category_splits")
    if rows is None or not len(rows):
        return {}
    rows = np.asarray(rows, dtype=np.int64)[np.argsort(np.asarray(rows)[:, 0], kind="stable")]
    pre = client.local.preprocessor
    assert pre is not None and pre.categories is not None
    values = [v for c in pre.categorical for v in pre.categories[c]]  # the one-hot columns' categories, in order
    return {"category_splits": rows, "category_values": np.array([values[f - len(pre.numeric)] for f in rows[:, 1]])}


#: the last stage of every predictor's training protocol
SAVE = Stage("save", {"save_part": Phase(save_part)})


def with_save(protocol: Protocol) -> Protocol:
    """A training protocol followed by the save stage."""
    return Protocol(protocol.stages + (SAVE,))


# ------------------------------------------------------------------------------------------------ predicting


def saved_part(client: TableClient, run_id: str) -> tuple[ModelPart, str]:
    """This node's part of run ``run_id`` and its id, if its owner serves predictions and still holds it."""
    s, where = client.settings, _where(client)
    if not s.owner.serve_predictions:
        raise ProtocolRefusal(f"{where}: its owner does not serve predictions (serve_predictions: false)")
    part = None if s.owner.state_dir is None else ModelPart.load(s.owner.state_dir, run_id, s.table, s.shard)
    if part is None:
        raise SpecError(
            f"{where}: no saved model part of run {run_id} on this node (its owner deleted it, or the node did "
            "not train that run)"
        )
    bound = s.owner.max_outputs
    if bound is not None and part.d_out > bound:
        raise ProtocolRefusal(
            f"{where}: the model has {part.d_out} outputs per row; this node's owner allows at most {bound} "
            "(max_outputs in its settings)"
        )
    assert s.owner.state_dir is not None
    return part, part_id(part_path(s.owner.state_dir, run_id, s.table, s.shard))


def read_rows(path: str, client: TableClient, part: ModelPart) -> pd.DataFrame:
    """The query owner's new rows, checked against what the model was trained on (module docstring). Every
    refusal goes through :func:`rows_refusal`: a deployed node tells the server the kind of problem only (its
    line names no path, value or row), its own log the line with the file's path."""
    s = client.settings
    spec, table, where = s.spec, s.table, s.owner.prediction_rows_name or f"rows file {path}"
    suffix = "parquet" if is_parquet(Path(path)) else "csv"  # what read_rows_file reads it as (any other: CSV)
    try:
        frame = read_rows_file(Path(path), spec.key_columns(table))
    except (OSError, ValueError) as exc:  # pandas' parser error ends in a newline: its words on the line, joined
        detail = f"{where}: cannot read it as {suffix} ({' '.join(str(exc).split())})"
        raise rows_refusal(client, detail, f"cannot be read as {suffix}", says="why") from None
    if not len(frame):
        detail = f"{where}: holds no row (a header only): nothing to score"
        raise rows_refusal(client, detail, "holds no row (a header only): nothing to score", says=None)
    na_text = {c: v for c, v in (frame.attrs.get(NA_ATTR) or {}).items() if c in part.numeric}
    if s.owner.loader is not None:  # rows in the format of the loader's source: its derived columns computed
        try:
            frame = derive_rows(s.owner.loader, table, frame)
        except SpecError as exc:
            detail = f"{where}: {exc}"
            raise rows_refusal(client, detail, "has a value its derived features cannot come from") from None
    keys = list(spec.key_columns(table))
    missing = [c for c in keys if c not in frame.columns]
    if missing:
        detail = f"{_lacks(where)} key column(s) {missing} of table {table!r} (the rows join by {keys})"
        only = [str(c) for c in frame.columns]
        if len(only) == 1 and any(sep in only[0] for sep in ";\t|"):  # another separator than CSV's comma
            detail += f"; its header reads as the one column {only[0]!r}: separate the columns with commas"
        raise rows_refusal(client, detail, f"lacks key column(s) {missing} (the rows join by {keys})", says=None)
    incomplete = frame[keys].isna().any(axis=1).to_numpy()
    if incomplete.any():
        detail = (
            f"{where}: {int(incomplete.sum())} row(s) with a missing key in {keys} of table {table!r}, the first "
            f"row {int(np.flatnonzero(incomplete)[0])} (0-based, header excluded); give every row its keys"
        )
        raise rows_refusal(client, detail, "has rows with a missing key")
    for c, (n, row, value) in na_text.items():  # text for a missing number: as training reads it (na_strings)
        detail = (
            f"{where}: column {c!r} of table {table!r} holds {n} text value(s) like {value!r} for a missing "
            f"number, the first in row {row} (0-based, header excluded)"
        )
        if spec.na_strings == "error":
            fix = "leave them empty (or set dataset.na_strings: missing)"
            raise rows_refusal(client, f"{detail}; {fix}", f"has text for a missing number; {fix}")
        if s.owner.origin != "simulation":  # a simulation's driver says it in one line (simulations.predict)
            logging.getLogger("tpflower").warning("%s: read as missing (dataset.na_strings: missing)", detail)
    frame = frame[[c for c in frame.columns if c in set(keys) | set(part.columns)]]  # other columns: ignored
    absent = [c for c in part.columns if c not in frame.columns]
    sources = derived_from(s.owner.loader, table) if s.owner.loader is not None else {}
    if any(c in sources for c in absent):  # rows in the source's format: name the column they come from
        named = sorted({sources.get(c, c) for c in absent})
        detail = (
            f"{_lacks(where)} column(s) {named} of table {table!r}: the model's features {absent} come from them; "
            "add them to the rows"
        )
        raise rows_refusal(client, detail, f"lacks column(s) {named} the model's features come from", says=None)
    if absent:
        detail = (
            f"{_lacks(where)} feature column(s) {absent} of table {table!r}: the model takes them from each new "
            "row; add them to the rows"
        )
        raise rows_refusal(client, detail, f"lacks feature column(s) {absent} the model takes", says=None)
    if s.owner.origin != "simulation":  # the owner's log (a simulation's driver says it in one line)
        named = part.naming(frame, s.secret).preprocessing.get("categories") or {}
        for c, seen in unseen_categories(named, frame).items():
            logging.getLogger("tpflower").warning("%s", unseen_category_line(where, c, *seen))
        for c, (n, row) in missing_categories(named, frame).items():
            logging.getLogger("tpflower").warning("%s", missing_category_line(where, c, n, row))
        for c, (n, row, median) in part.median_filled(frame).items():
            logging.getLogger("tpflower").warning("%s", median_filled_line(where, c, n, row, median))
    for c in keys:
        trained = s.key_kinds.get(c)
        as_text = key_kind(frame[c].dtype) == "string"  # a CSV file holds dates as text
        if trained in ("datetime", DATETIME_TZ) and as_text:
            frame[c] = datetime_key(client, frame[c], f"{where}: key column {c!r} of table {table!r}")
        kind = key_kind(frame[c].dtype)
        if trained is not None and kind != trained:
            detail = f"{where}: key column {c!r} holds {kind} values; table {table!r} joins it as {trained}"
            raise rows_refusal(
                client, detail, f"holds {kind} values in key column {c!r}, joined as {trained}", says=None
            )
    for c in (*part.numeric, *part.bin_edges):
        col = frame[c]
        if pd.api.types.is_datetime64_any_dtype(col) or pd.api.types.is_timedelta64_dtype(col):
            # pd.to_numeric would make them nanoseconds, scored as numbers ~1e18 (training refuses such a column)
            detail = (
                f"{where}: column {c!r} of table {table!r} is numeric, but holds dates or times (dtype {col.dtype})"
            )
            raise rows_refusal(client, f"{detail}, not numbers", "has dates or times in a numeric column")
        if not (pd.api.types.is_numeric_dtype(col) or pd.api.types.is_bool_dtype(col)):
            numbers = pd.to_numeric(col, errors="coerce")
            bad = numbers.isna() & col.notna()
            if not bad.any():  # numbers held as text (a Parquet or DataFrame string column): as a CSV file reads them
                frame[c] = numbers
                continue
            first = int(np.flatnonzero(bad.to_numpy())[0])
            detail = f"{where}: column {c!r} of table {table!r} is numeric, but row {first} holds {col.iloc[first]!r}"
            raise rows_refusal(client, f"{detail}, not a number", "has a non-numeric value in a numeric column")
    if len(frame) == 0:
        raise rows_refusal(client, f"{where}: no rows", "holds no row", says=None)
    return frame.reset_index(drop=True)


def _lacks(where: str) -> str:
    """``rows file X lacks`` / ``the rows lack``: the subject of a missing column, the rows being scored."""
    return f"{where} lack" if where == "the rows" else f"{where} lacks"


def unseen_category_line(where: str, column: str, n: int, row: int, value: str) -> str:
    """The notice of ``n`` rows whose category in ``column`` no training row had (tpflower.preprocess.
    unseen_categories: the first in ``row``, ``value``)."""
    return (
        f"{where}: {n} row(s) hold a category of column {column!r} no training row had, like {value!r} (the "
        f"first in row {row}): scored as a category the model never saw"
    )


def missing_category_line(where: str, column: str, n: int, row: int) -> str:
    """The notice of ``n`` rows missing a value of categorical ``column`` whose training rows all had one
    (tpflower.preprocess.missing_categories: the first in ``row``)."""
    return (
        f"{where}: {n} row(s) miss a value of column {column!r}, which no training row missed (the first in row "
        f"{row}): scored as a category the model never saw"
    )


def median_filled_line(where: str, column: str, n: int, row: int, median: float) -> str:
    """The notice of ``n`` rows missing a value of numeric ``column`` that no training row of boosted trees
    missed (ModelPart.median_filled: the first in ``row``): no split learnt where such a value goes, so it is
    scored as the column's training ``median`` (docs/algorithms.md, Missing values)."""
    return (
        f"{where}: {n} row(s) miss a value of column {column!r}, which no training row missed (the first in row "
        f"{row}): scored as its training median, {median:.6g}"
    )


def datetime_key(client: TableClient, column: pd.Series, where: str) -> pd.Series:
    """A text key column the table joins as datetime, parsed as ISO 8601 dates / times (pandas' to_datetime,
    format="ISO8601"); a value that does not parse: one line naming ``where`` (the column) and its first row."""
    parsed = pd.to_datetime(column, format="ISO8601", errors="coerce")
    bad = (parsed.isna() & column.notna()).to_numpy()
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        detail = (
            f"{where} joins as datetime, but row {first} (0-based, header excluded) holds {column.iloc[first]!r}, "
            "not an ISO 8601 date or time (2020-01-31, 2020-01-31 08:00:00)"
        )
        raise rows_refusal(client, detail, "has a key that is not a date or time")
    return parsed


def rows_refusal(client: TableClient, detail: str, problem: str, says: str | None = "which") -> SpecError:
    """A rows file refused: ``detail`` (the file's path, counts and row numbers) in the line of a simulation,
    where the user plays every owner; a deployed node logs it and tells the server only the table and
    ``problem`` (the refusal rule of tpflower.guard; docs/deployment.md: no owner's path reaches the server),
    with a pointer to its log when ``says`` (which / why) the log says more."""
    s = client.settings
    if s.owner.origin == "simulation":
        return SpecError(detail)
    logging.getLogger("tpflower").error("%s", detail)  # the owner's log: its path, rows and counts stay on the node
    more = f" (the node's log says {says})" if says else ""
    return SpecError(f"table {s.table!r} shard {s.shard}: the rows file {problem}{more}")


def request_rows(client: TableClient, part: ModelPart, query: bool) -> tuple[pd.DataFrame, np.ndarray]:
    """The rows of this request and their row ids: the query owner's new rows (ids 0..n-1), or the rows this
    node serves now (its table, or its shard with the table's row ids)."""
    s = client.settings
    if not query:
        return client.data.rows, np.asarray(client.data.row_ids, dtype=np.int64)
    if s.owner.prediction_rows is None:
        raise SpecError(f"{_where(client)}: no new rows to predict (prediction_rows in its owner's settings)")
    frame = read_rows(s.owner.prediction_rows, client, part)
    return frame, np.arange(len(frame), dtype=np.int64)


def check_count(client: TableClient, n: int) -> None:
    bound = client.settings.owner.max_prediction_rows
    if bound is not None and n > bound:
        raise ProtocolRefusal(
            f"{_where(client)}: a prediction request of {n} rows; this node's owner scores at most {bound} per "
            "request (max_prediction_rows in its settings)"
        )


def predict_keys(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Row ids and keyed digests (or blinded values) of the join keys of the request's rows (module
    docstring); more rows than the message's ``chunk_rows``: chunk 0, the rest by ``keys_chunk`` (as training's
    keys reply, tpflower.phases.setup.chunked_reply)."""
    s = client.settings
    run_id, query = str(config.get("run_id", "")), bool(config.get("query", 0))
    part, pid = saved_part(client, run_id)
    frame, row_ids = request_rows(client, part, query)
    if query:
        check_count(client, len(frame))
    client.state.set_scalar("predict.run_id", run_id)
    client.state.set_scalar("predict.query", int(query))
    client.state.set_scalar("predict.n_rows", len(frame))
    mode = s.owner.keys
    out, metrics = chunked_reply(client, config, lambda seed: key_payload(client, frame, row_ids, seed), "predict")
    checked = secret_check(client.settings.secret)
    return out, {
        **metrics,
        "part": pid,
        "d_out": part.d_out,
        "blind_keys": int(mode == "blind"),
        "secret_check": checked,
    }


def predict_payload(client: TableClient, seed: bytes, rebuilt: bool) -> KeysPayload:
    """The keys payload of a prediction request again (for a later chunk): the request's rows read anew."""
    part, _ = saved_part(client, str(client.state.scalar("predict.run_id")))
    frame, row_ids = request_rows(client, part, bool(client.state.scalar("predict.query")))
    return key_payload(client, frame, row_ids, seed)


REBUILD["predict"] = predict_payload


def predict_rows(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """h = f_i(theta_i; x_u) of the request's rows ``rows`` (positions among this node's request rows)."""
    run_id, query = str(client.state.scalar("predict.run_id")), bool(client.state.scalar("predict.query"))
    part, _ = saved_part(client, run_id)
    frame, _ = request_rows(client, part, query)
    rows = np.asarray(arrays["rows"], dtype=np.int64)
    check_count(client, len(rows))
    if len(rows) and (rows.min() < 0 or rows.max() >= len(frame)):
        raise ProtocolRefusal(f"{_where(client)}: predict_rows asks for rows outside its {len(frame)} rows")
    X = part.naming(frame, client.settings.secret).features(frame.iloc[rows])
    if part.centres is not None:  # k-means: the nearest local centre of each row (DistDim: one label per row)
        return {"labels": part.cluster_labels(X).astype(label_dtype(len(part.centres)))}, {}
    if part.splits is not None:  # boosted trees: one side bit per (row, split), packed
        return {"bits": np.packbits(part.split_sides(X), axis=1)}, {}
    return {"h": part.predict(client.settings.spec, X)}, {}


def predictions_path(state_dir: str | Path, run_id: str) -> Path:
    """Where the query owner's node keeps the latest predictions of run ``run_id``."""
    return Path(state_dir) / "predictions" / f"{run_id}.csv"


def deliver(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The query owner receives the predictions of its new rows (module docstring) and keeps them, 0600."""
    s = client.settings
    if not client.state.scalar("predict.query"):
        raise ProtocolRefusal(f"{_where(client)}: deliver goes to the query owner only")
    n_rows = int(client.state.scalar("predict.n_rows", 0))
    unjoined = np.asarray(arrays.get("unjoined", np.zeros(0, np.int64)), dtype=np.int64)
    frame = pd.DataFrame({name.removeprefix("col."): a for name, a in arrays.items() if name.startswith("col.")})
    if "row" not in frame:
        raise ProtocolRefusal(f"{_where(client)}: deliver without the rows' numbers (col.row)")
    rows = np.concatenate([frame["row"].to_numpy(dtype=np.int64), unjoined])
    if len(rows) and (rows.min() < 0 or rows.max() >= n_rows):
        raise ProtocolRefusal(f"{_where(client)}: deliver names rows outside its {n_rows} new rows")
    if client.data.classes is not None and "prediction" in frame:  # the label owner's own classes, by name
        frame = with_class_names(frame, client.data.classes)
    if s.owner.state_dir is None:
        return {}, {"written": 0}
    out = predictions_path(s.owner.state_dir, str(client.state.scalar("predict.run_id")))
    atomic_write(out, frame.to_csv(index=False).encode(), dir_mode=0o700)
    atomic_write(out.with_suffix(".unjoined.csv"), pd.DataFrame({"row": unjoined}).to_csv(index=False).encode())
    return {}, {"written": len(frame)}


#: a prediction request: the keys of the rows, (keys=blind) the re-blinding hops, one scoring round, the
#: predictions to the query owner
PREDICT = Protocol(
    (
        Stage("predict_keys", {"predict_keys": Phase(predict_keys)}),
        Stage("keys_chunk", {"keys_chunk": Phase(keys_chunk, chunked_keys)}, calls=None),
        Stage("reblind", {"reblind": REBLIND}, calls=None),
        # not an exact release (tpflower.releases): the saved model is the owner's, the rows its own new ones
        Stage("predict_rows", {"predict_rows": Phase(predict_rows, inputs=takes("rows"))}),
        Stage("deliver", {"deliver": Phase(deliver, inputs=takes("unjoined", prefixes=["col."]))}),
    )
)
