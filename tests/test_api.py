"""The Python API (docs/python-api.md) and the ``tpflower`` command (simulations/cli.py): a fit is the command
line's run (results.json equal but for times and paths, metrics bit-identical), an API error is the command
line's message in one TpflowerError, the docs' example trains, predicts and reloads, importing tpflower loads
no server code, and each ``tpflower`` subcommand is its module's command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import tpflower
from simulations.api import override_value, overrides_of

ROOT = Path(__file__).resolve().parents[1]
TPFLOWER = Path(sys.executable).parent / "tpflower"  # the console script pip installed beside this python
RUN_SPECIFIC = ("wall_time_s", "comm_time_s")  # the only fields two identical runs may differ in


def comparable(run_dir: Path) -> dict:
    """results.json without wall and modelled communication times and without run-dir paths."""
    record = json.loads((run_dir / "results.json").read_text())
    for rec in record["history"]:
        for key in RUN_SPECIFIC:
            rec.pop(key, None)
    return json.loads(json.dumps(record).replace(str(run_dir), "RUN_DIR"))


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(TPFLOWER), *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env or os.environ.copy()
    )


@pytest.mark.parametrize(
    "runtime", ["inprocess", pytest.param("flower", marks=pytest.mark.slow)], ids=["inprocess", "flower"]
)
def test_fit_is_the_command_lines_run(runtime, tmp_path):
    overrides = ["dataset=synthetic", "algorithm=sgd", "epochs=2", "algorithm.batch_size=512", f"runtime={runtime}"]
    overrides.append("algorithm.min_steps=0")  # exactly the 2 epochs (24 steps each)
    done = cli("train", *overrides, f"hydra.run.dir={tmp_path / 'cli'}")
    assert done.returncode == 0, done.stderr
    model = tpflower.fit(
        dataset="synthetic",
        algorithm="sgd",
        epochs=2,
        algorithm__batch_size=512,
        algorithm__min_steps=0,
        runtime=runtime,
        run_dir=tmp_path / "api",
    )
    assert comparable(tmp_path / "api") == comparable(tmp_path / "cli")
    history = json.loads((tmp_path / "cli" / "results.json").read_text())["history"]
    assert model.history["test_metric"].tolist() == [h["test_metric"] for h in history]  # bit-identical
    assert model.metrics["rmse"] == history[-1]["test_metric"]
    # the epochs, then the kept model's record again (model selection: the best validation epoch)
    assert list(model.history["epoch"]) == [h["epoch"] for h in history]
    assert list(model.history["epoch"])[:2] == [1, 2] and len(history) in (2, 3)


def test_a_binary_models_metrics_hold_its_auc(tmp_path):
    """A binary label's metrics are accuracy and AUC, the numbers of the run's last evaluation (its history
    names the AUC test_auc)."""
    model = tpflower.fit(
        dataset="synthetic",
        algorithm="admm",
        epochs=1,
        dataset__loader__task="binary",
        runtime="inprocess",
        run_dir=tmp_path / "run",
        verbose=False,
    )
    last = model.results["history"][-1]
    assert model.metrics == {"accuracy": last["test_metric"], "auc": last["test_auc"]}


def test_predict_refuses_rows_that_are_no_frame_or_path_in_one_line(tmp_path):
    model = tpflower.Model.__new__(tpflower.Model)  # the check comes before the run dir is read
    with pytest.raises(tpflower.TpflowerError, match=r"as a pandas DataFrame or the path .*, got list"):
        model.predict([{"id": 1}])


def test_an_api_error_is_the_command_lines_message(tmp_path):
    (tmp_path / "dataset").mkdir()
    spec = tmp_path / "dataset" / "bad.yaml"
    spec.write_text(
        "name: bad\ntables:\n  t: {source: t.csv, numeric: [x]}\nlabel: {table: t, column: y, task: regression}\n"
    )
    (tmp_path / "t.csv").write_text("x,y\n1,2\nabc,3\n" + "".join(f"{i},{i}\n" for i in range(40)))
    done = cli("train", f"--config-dir={tmp_path}", "dataset=bad", "runtime=inprocess", cwd=tmp_path)
    assert done.returncode == 1
    for dataset in ("bad", spec):  # by name in config_dir, or the spec's file
        with pytest.raises(tpflower.TpflowerError) as info:
            tpflower.fit(
                dataset=dataset, config_dir=tmp_path, runtime="inprocess", run_dir=tmp_path / "api", base_dir=tmp_path
            )
        assert f"error: {info.value}" == done.stderr.strip()
        assert info.value.__cause__ is None and info.value.__suppress_context__  # no wrapper chained below it


def test_a_bad_setting_and_a_typo_raise_one_line(tmp_path):
    with pytest.raises(tpflower.TpflowerError, match=r"^[^\n]*epochs") as info:
        tpflower.fit(dataset="synthetic", runtime="inprocess", epochs=-1, run_dir=tmp_path, verbose=False)
    assert "\n" not in str(info.value)
    with pytest.raises(tpflower.TpflowerError) as typo:
        tpflower.fit(algorithm="nosuch", run_dir=tmp_path, verbose=False)
    assert str(typo.value).startswith("algorithm=nosuch: no such algorithm; choose one of admm, auto, celu,")
    assert " _admm" not in str(typo.value)


def test_a_seed_that_is_no_number_is_one_line_on_the_command_line_too(tmp_path):
    """The command line derives the simulation's key secret from the seed before the run: a seed that is no
    number is the setting's line there, as in tpflower.fit (not a traceback of int())."""
    done = cli("train", "dataset=synthetic", "runtime=inprocess", "seed=x", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1 and done.stderr.strip() == "error: seed must be a number, got 'x'", done.stderr
    with pytest.raises(tpflower.TpflowerError, match=r"^seed must be a number, got 'x'$"):
        tpflower.fit(dataset="synthetic", runtime="inprocess", seed="x", run_dir=tmp_path / "api", verbose=False)


def test_a_missing_or_unreadable_dataset_file_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "conf" / "dataset" / "nope.yml"
    with pytest.raises(tpflower.TpflowerError) as info:
        tpflower.fit(dataset=str(missing), runtime="inprocess", run_dir=tmp_path / "run", verbose=False)
    assert str(info.value) == (
        f"dataset={str(missing)!r}: no such file ({missing}); give the path of a dataset spec's YAML file "
        "(docs/datasets.md), or a dataset's name"
    )
    bad = tmp_path / "bad.yaml"
    for text, said in (("name: [unclosed\n", "cannot be read as YAML"), ("- a\n- b\n", "holds no mapping")):
        bad.write_text(text)
        with pytest.raises(tpflower.TpflowerError) as info:
            tpflower.fit(dataset=bad, runtime="inprocess", run_dir=tmp_path / "run", verbose=False)
        assert str(info.value).startswith(f"dataset file {bad}: {said}") and "\n" not in str(info.value)
    # a table's data file is no dataset (was: 'no such dataset; ... --config-dir DIR dataset=orders.csv for
    # DIR/dataset/orders.csv.yaml', the command line's advice)
    with pytest.raises(tpflower.TpflowerError) as info:
        tpflower.fit(dataset=Path("data/orders.csv"), runtime="inprocess", run_dir=tmp_path / "run", verbose=False)
    assert str(info.value) == (
        "dataset='data/orders.csv': a table's data file, not a dataset: give a dataset's name, the path of its "
        "spec's YAML file or the spec as a dict, whose tables name their files ({'tables': {'NAME': {'source': "
        "'data/orders.csv'}}, ...}: docs/datasets.md)"
    )


@pytest.mark.parametrize("value, on", [("", False), ("0", False), ("false", False), ("No", False), ("1", True)])
def test_tpflower_traceback_is_on_for_1_and_off_for_0_false_no_or_empty(value, on, tmp_path, monkeypatch):
    from tpflower.errors import traceback_wanted

    monkeypatch.setenv("TPFLOWER_TRACEBACK", value)
    assert traceback_wanted() is on
    raised = pytest.raises(ValueError) if on else pytest.raises(tpflower.TpflowerError)
    with raised as info:
        tpflower.fit(dataset="synthetic", runtime="inprocess", epochs=0, run_dir=tmp_path, verbose=False)
    assert on or "\n" not in str(info.value)
    if value == "0":  # the command line alike: one line, no traceback
        env = {**os.environ, "TPFLOWER_TRACEBACK": "0"}
        done = cli("train", "dataset=synthetic", "runtime=inprocess", "epochs=0", f"hydra.run.dir={tmp_path}", env=env)
        assert done.returncode == 1 and "Traceback" not in done.stderr and done.stderr.startswith("error: ")


def test_an_unknown_key_is_one_line_naming_what_is_valid(tmp_path):
    done = cli("train", "algoritm=gbdt", "dataset=synthetic", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()  # not Hydra's "Could not override ... HYDRA_FULL_ERROR" lines
    assert line.startswith("error: algoritm is not a setting of the config (did you mean algorithm?); its groups: [")
    assert "'epochs'" in line
    with pytest.raises(tpflower.TpflowerError) as auto:  # auto -> pcg (linear regression), which has no trees
        tpflower.fit(dataset="movielens", runtime="inprocess", algorithm__trees=50, run_dir=tmp_path, verbose=False)
    assert str(auto.value) == (
        "algorithm.trees is not a setting of algorithm 'pcg' (auto's choice here); its settings: "
        "['tol', 'window', 'window_mb']"
    )
    with pytest.raises(tpflower.TpflowerError) as typo:
        tpflower.fit(algorithm="gbdt", overrides=["algorithm.tres=3"], run_dir=tmp_path, verbose=False)
    assert str(typo.value).startswith("algorithm.tres is not a setting of algorithm 'gbdt' (did you mean trees?)")
    # a group's setting without its group (were: no hint, the top level's settings only)
    with pytest.raises(tpflower.TpflowerError) as bare:
        tpflower.fit(algorithm="gbdt", trees=10, run_dir=tmp_path, verbose=False)
    assert str(bare.value).startswith(
        "trees is not a setting of the config (did you mean algorithm.trees?); its groups"
    )
    with pytest.raises(tpflower.TpflowerError) as bare:
        tpflower.fit(model="mlp", hidden=[8], run_dir=tmp_path, verbose=False)
    assert str(bare.value).startswith("hidden is not a setting of the config (did you mean model.hidden?)")
    # under the default algorithm=auto, which has no settings: the algorithms that have it (were: no hint)
    with pytest.raises(tpflower.TpflowerError) as bare:
        tpflower.fit(trees=10, run_dir=tmp_path, verbose=False)
    assert str(bare.value).startswith(
        "trees is not a setting of the config (did you mean algorithm.trees? a setting of algorithm=gbdt,"
        " centralized_gbdt, not of algorithm=auto: choose one, e.g. algorithm=gbdt algorithm.trees=10); its groups"
    )


def test_an_override_hydra_cannot_read_is_named(tmp_path):
    """Hydra's grammar error names no override: the line names the one it cannot read (CLI and API)."""
    done = cli("train", "epochs=2", "model.hidden=[3,", "dataset=synthetic", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: model.hidden=[3,: not an override Hydra reads (no viable alternative at input")
    with pytest.raises(tpflower.TpflowerError, match=r"^algorithm\.lr=\{1: not an override Hydra reads"):
        tpflower.fit(dataset="synthetic", overrides=["epochs=1", "algorithm.lr={1"], run_dir=tmp_path, verbose=False)


def test_a_typo_in_a_choice_lists_the_public_choices_only(tmp_path):
    done = cli("train", "algorithm=admn", "dataset=synthetic", cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: algorithm=admn: no such algorithm; choose one of admm, auto, celu, centralized,")
    choices = [c.strip() for c in line.split("choose one of")[1].split(",")]
    assert choices and not any(c.startswith("_") for c in choices)  # Hydra's private nodes (_admm ...) left out


def test_the_docs_example_trains_predicts_and_reloads(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "python_api_example.py"), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "reloaded: same predictions" in done.stdout
    assert "epoch   1 | test rmse=" in done.stdout  # the progress lines, as on the command line


def test_predict_takes_a_frame_and_save_load_keep_the_model(tmp_path, capsys):
    model = tpflower.fit(
        dataset="synthetic", algorithm="admm", epochs=1, runtime="inprocess", run_dir=tmp_path / "run", verbose=False
    )
    from tpflower.datasets import load_table

    _, fact = load_table(model.get_params()["dataset"], "fact")
    rows = fact.head(50)
    capsys.readouterr()
    first = model.predict(rows)  # quiet, as the fit
    assert capsys.readouterr().out == ""
    copy = model.save(tmp_path / "copy")
    again = tpflower.load(copy.run_dir).predict(rows, verbose=False)
    pd.testing.assert_frame_equal(first, again)
    capsys.readouterr()
    tpflower.load(copy.run_dir, verbose=False).predict(rows.assign(note="x"))  # a column it ignores: no line
    assert capsys.readouterr() == ("", "")
    tpflower.load(copy.run_dir).predict(rows.assign(note="x"))  # a loaded model: verbose by default
    assert "column(s) ['note'] are no feature or key of table 'fact': ignored" in capsys.readouterr().out
    assert len(first) > 0 and set(first["row"]) <= set(range(50))
    with pytest.raises(tpflower.TpflowerError, match="exists already"):
        model.save(tmp_path / "copy")


def test_a_join_written_with_a_bare_on_key_trains_and_predicts(tmp_path):
    """YAML 1.1 reads a bare ``on:`` as the key True (docs/datasets.md: accepted): the run config holds "on",
    so its JSON forms (the clients' config key, model.json) hold string keys and the model predicts."""
    import yaml

    from tests.test_checks import shop

    spec = tmp_path / "shop.yaml"
    spec.write_text(yaml.safe_dump(shop(tmp_path)).replace("'on': cust", "on: cust"))
    assert "\n  on: cust" in spec.read_text()  # (PyYAML quotes the key it would read back as True)
    model = tpflower.fit(dataset=spec, algorithm="pcg", runtime="inprocess", run_dir=tmp_path / "run", verbose=False)
    joins = json.loads((tmp_path / "run" / "model.json").read_text())["config"]["dataset"]["joins"]
    assert joins == [{"left": "orders", "right": "customers", "on": "cust"}]
    rows = pd.read_csv(tmp_path / "orders.csv").head(5).drop(columns=["spend"])
    assert model.predict(rows, verbose=False)["prediction"].notna().all()


def test_a_spec_dict_of_paths_numpy_values_and_an_index_trains_as_its_plain_values(tmp_path):
    """What a notebook builds a spec from: a Path source, numpy numbers, a pandas Index of columns (were: a
    TypeError from the run's JSON after the run dir was made, or OmegaConf's "Value 'int64' is not a supported
    primitive type"); both runs write the same results."""
    from tests.test_checks import shop

    plain = shop(tmp_path, label_range=[0.0, 20.0], split={"test_fraction": 0.2, "seed": 1})
    orders = pd.read_csv(tmp_path / "orders.csv")
    rich = shop(
        tmp_path, label_range=np.array([0.0, 20.0]), split={"test_fraction": np.float64(0.2), "seed": np.int64(1)}
    )
    rich["tables"]["orders"]["source"] = tmp_path / "orders.csv"
    rich["tables"]["orders"]["numeric"] = orders.columns[1:2]  # Index(['qty'])
    for name, spec in (("plain", plain), ("rich", rich)):
        tpflower.fit(
            dataset=spec, algorithm="pcg", epochs=1, runtime="inprocess", run_dir=tmp_path / name, verbose=False
        )
    assert comparable(tmp_path / "rich") == json.loads(
        json.dumps(comparable(tmp_path / "plain")).replace("/plain", "/rich")
    )


def test_a_model_whose_run_dir_a_later_fit_replaced_refuses_to_predict_or_save(tmp_path):
    """Two fits into one run_dir (a notebook cell run again with another algorithm): the first Model's predict
    used the second run's parts under the first run's metrics, silently; now one line says so."""
    from tests.test_checks import shop

    spec = shop(tmp_path)
    first = tpflower.fit(dataset=spec, algorithm="pcg", runtime="inprocess", run_dir=tmp_path / "run", verbose=False)
    rows = pd.read_csv(tmp_path / "orders.csv").head(3)
    before = first.predict(rows, verbose=False)
    second = tpflower.fit(
        dataset=spec, algorithm="admm", epochs=1, runtime="inprocess", run_dir=tmp_path / "run", verbose=False
    )
    assert not second.predict(rows, verbose=False)["prediction"].equals(before["prediction"])
    for use in (lambda: first.predict(rows, verbose=False), lambda: first.save(tmp_path / "copy")):
        with pytest.raises(tpflower.TpflowerError) as info:
            use()
        assert str(info.value).startswith(
            f"{tmp_path / 'run'} now holds another run (tp_join_admm), not this model's (tp_join_pcg): a later fit"
        ), info.value
    assert not (tmp_path / "copy").exists()


def test_dataframes_as_table_sources_train_as_their_files_and_a_saved_copy_holds_them(tmp_path):
    """A DataFrame as a table's source (were: OmegaConf's "Value 'DataFrame' is not a supported primitive
    type"): written to RUN_DIR/tables/NAME.parquet, the file its owner's node reads; the same results as the
    CSV files (a named index is columns); the saved copy reads its own tables, the fit's run dir deleted."""
    import shutil

    from tests.test_checks import shop

    files = shop(tmp_path)
    orders, customers = pd.read_csv(tmp_path / "orders.csv"), pd.read_csv(tmp_path / "customers.csv")
    frames = json.loads(json.dumps(files))
    frames["tables"]["orders"]["source"] = orders
    frames["tables"]["customers"]["source"] = customers.set_index("cust")
    for name, spec in (("files", files), ("frames", frames)):
        tpflower.fit(dataset=spec, algorithm="pcg", runtime="inprocess", run_dir=tmp_path / name, verbose=False)
    assert (tmp_path / "frames" / "tables" / "customers.parquet").is_file()
    record = comparable(tmp_path / "frames")
    for t in ("orders", "customers"):
        record["config"]["dataset"]["tables"][t]["source"] = files["tables"][t]["source"]
    assert record == comparable(tmp_path / "files")
    model = tpflower.load(tmp_path / "frames", verbose=False)
    before = model.predict(orders.head(5), verbose=False)
    copy = model.save(tmp_path / "copy")
    shutil.rmtree(tmp_path / "frames")
    pd.testing.assert_frame_equal(tpflower.load(copy.run_dir).predict(orders.head(5), verbose=False), before)
    assert copy.results["config"]["dataset"]["tables"]["orders"]["source"] == str(
        copy.run_dir / "tables/orders.parquet"
    )


def test_a_dataframe_sources_bad_values_are_the_data_checks_lines_as_a_csv_files(tmp_path):
    """A column of numbers and text (Parquet holds no such column) is written as text, so the data checks name
    the table, column and value as for a CSV file; a column given twice is one line naming the source."""
    from tests.test_checks import shop

    spec = shop(tmp_path)
    mixed = pd.read_csv(tmp_path / "orders.csv").astype({"qty": object})
    mixed.loc[2, "qty"] = "two"
    spec["tables"]["orders"]["source"] = mixed
    with pytest.raises(tpflower.TpflowerError) as err:
        tpflower.fit(dataset=spec, runtime="inprocess", run_dir=tmp_path / "run", verbose=False)
    assert "table 'orders', numeric feature 'qty': 1 non-numeric value, first at row 2" in str(err.value), err.value
    assert "'two'" in str(err.value)
    spec["tables"]["orders"]["source"] = pd.concat([mixed[["qty"]], mixed], axis=1)
    with pytest.raises(tpflower.TpflowerError) as err:
        tpflower.fit(dataset=spec, runtime="inprocess", run_dir=tmp_path / "run2", verbose=False)
    assert str(err.value) == (
        "dataset tables.orders.source: the DataFrame names column(s) ['qty'] twice; give each column once"
    )


@pytest.fixture(scope="module")
def binary_shop(tmp_path_factory) -> tuple[tpflower.Model, pd.DataFrame]:
    """A binary classifier of tests.test_checks' shop (orders join customers on cust) and 6 new orders, of
    which rows 1 and 4 join no customer."""
    from tests.test_checks import shop

    tmp = tmp_path_factory.mktemp("shop")
    rng = np.random.default_rng(0)
    orders = pd.DataFrame({"cust": rng.integers(0, 50, 300), "qty": rng.integers(1, 5, 300)})
    orders["big"] = (orders["qty"] > 2).astype(int)
    dataset = shop(tmp, orders, label={"table": "orders", "column": "big", "task": "binary"})
    model = tpflower.fit(
        dataset=dataset, algorithm="admm", epochs=1, runtime="inprocess", run_dir=tmp / "run", verbose=False
    )
    rows = orders.drop(columns=["big"]).head(6).copy()
    rows.loc[[1, 4], "cust"] = 999
    return model, rows


def test_predict_gives_every_row_of_a_frame_in_order(binary_shop):
    """One line per row of the DataFrame, in its order: a row that joins nothing is there, its prediction
    missing (README: one prediction each)."""
    model, rows = binary_shop
    pred = model.predict(rows, verbose=False)
    assert pred["row"].tolist() == list(range(6)) and pred["joined_rows"].tolist() == [1, 0, 1, 1, 0, 1]
    assert pred["prediction"].isna().tolist() == [False, True, False, False, True, False]
    assert pred["p_1"].isna().tolist() == pred["prediction"].isna().tolist()
    assert pred["prediction"].dtype == "Int64"


def test_an_error_about_a_frames_rows_names_the_rows_not_a_temporary_file(binary_shop):
    model, rows = binary_shop
    with pytest.raises(tpflower.TpflowerError) as info:
        model.predict(rows.assign(cust=rows["cust"] + 0.5), verbose=False)  # (whole floats: integers, they join)
    assert str(info.value) == (
        "table 'orders' shard 0: the rows: key column 'cust' holds float values; table 'orders' joins it as integer"
    )
    with pytest.raises(tpflower.TpflowerError) as info:
        model.predict(rows.drop(columns=["qty"]), verbose=False)
    assert str(info.value).startswith(
        "table 'orders' shard 0: the rows lack feature column(s) ['qty'] of table 'orders': the model takes them"
    )


def test_dates_in_a_numeric_column_are_one_line_not_nanoseconds_scored(binary_shop, tmp_path):
    """A date column where a number belongs (training refuses one): were its nanoseconds, scored as numbers
    ~1e18 and refused after the nodes' work as a diverged model ('the model diverged (lower the learning
    rate or raise rho)'); a Parquet rows file likewise."""
    model, rows = binary_shop
    dated = rows.assign(qty=pd.Timestamp("2020-01-01"))
    with pytest.raises(tpflower.TpflowerError) as info:
        model.predict(dated, verbose=False)
    assert re.fullmatch(
        r"table 'orders' shard 0: the rows: column 'qty' of table 'orders' is numeric, but holds dates or times "
        r"\(dtype datetime64\[\w+\]\), not numbers",
        str(info.value),
    ), info.value
    dated.to_parquet(tmp_path / "dated.parquet")
    with pytest.raises(tpflower.TpflowerError, match=r"dated\.parquet: column 'qty' .* holds dates or times"):
        model.predict(tmp_path / "dated.parquet", verbose=False)


def test_a_wrong_table_or_runtime_of_predict_is_named_as_its_argument(binary_shop):
    """Were the command line's options: "--table 'nope': no such table", "--runtime must be ..." (the runtime
    checked after the rows were read)."""
    model, rows = binary_shop
    with pytest.raises(tpflower.TpflowerError) as info:
        model.predict(rows, table="nope", verbose=False)
    assert str(info.value) == "table='nope': no such table (tables: orders, customers)"
    with pytest.raises(tpflower.TpflowerError) as info:
        model.predict(rows, runtime="ray", verbose=False)
    assert str(info.value) == "runtime='ray': no such runtime (inprocess or flower)"


def test_an_empty_frame_is_one_line_saying_so_before_any_node_is_asked(binary_shop, monkeypatch):
    """Was the node's line for a rows file, "the rows: holds no row (a header only)", after the nodes started."""
    model, rows = binary_shop
    monkeypatch.setattr("simulations.api.predict_run", lambda *a, **k: pytest.fail("the nodes were asked"))
    for empty in (rows.iloc[:0], pd.DataFrame()):
        with pytest.raises(tpflower.TpflowerError) as info:
            model.predict(empty, verbose=False)
        assert str(info.value) == f"the rows: a DataFrame of no row ({len(empty.columns)} columns): nothing to score"


def test_a_frames_named_index_is_its_columns(binary_shop):
    """rows.set_index("cust") keeps the key in the index, which pandas' to_parquet writes as a column: were
    'the rows lack key column(s) ['cust']'; now the same predictions as the plain frame."""
    model, rows = binary_shop
    plain = model.predict(rows, verbose=False)
    pd.testing.assert_frame_equal(model.predict(rows.set_index("cust"), verbose=False), plain)
    pd.testing.assert_frame_equal(model.predict(rows.set_index(["cust", "qty"]), verbose=False), plain)


def test_a_frames_column_of_numbers_and_text_is_read_as_a_csv_files_would_be(binary_shop, tmp_path):
    """An int column holding one text value (``df.loc[i, 'qty'] = '99plus'``) cannot be written to Parquet as
    it is: it reaches the node as text, as a CSV file holds it, and is refused in the CSV file's one line."""
    model, rows = binary_shop
    mixed = rows.copy()
    mixed["qty"] = mixed["qty"].astype(object)
    mixed.loc[2, "qty"] = "99plus"
    mixed.loc[1, "qty"] = np.nan  # missing stays missing beside the numbers and the text (not 'nan')
    with pytest.raises(tpflower.TpflowerError) as frame:
        model.predict(mixed, verbose=False)
    assert str(frame.value) == (
        "table 'orders' shard 0: the rows: column 'qty' of table 'orders' is numeric, but row 2 holds '99plus', "
        "not a number"
    )
    mixed.to_csv(tmp_path / "rows.csv", index=False)
    with pytest.raises(tpflower.TpflowerError) as csv:
        model.predict(tmp_path / "rows.csv", verbose=False)
    assert str(csv.value) == str(frame.value).replace("the rows", f"rows file {tmp_path / 'rows.csv'}")
    with pytest.raises(tpflower.TpflowerError, match=r"^the rows name column\(s\) \['qty'\] twice"):
        model.predict(pd.concat([rows, rows[["qty"]]], axis=1), verbose=False)


def test_a_frames_na_text_beside_numbers_is_a_missing_number_as_in_a_csv_file(binary_shop, tmp_path, capsys):
    """``df.loc[i, 'qty'] = 'n/a'`` on an int column: read as missing with the CSV file's line, the same
    predictions as the CSV file of the same rows (it was refused: 'row 2 holds 'n/a', not a number')."""
    model, rows = binary_shop
    mixed = rows.copy()
    mixed["qty"] = mixed["qty"].astype(object)
    mixed.loc[2, "qty"] = "n/a"
    mixed.to_csv(tmp_path / "rows.csv", index=False)
    from_csv = model.predict(tmp_path / "rows.csv", verbose=True)
    capsys.readouterr()
    pd.testing.assert_frame_equal(model.predict(mixed, verbose=True), from_csv)
    assert "the rows: column 'qty' holds 1 value(s) like 'n/a' (the first in row 2), read as missing" in (
        capsys.readouterr().out
    )


def test_a_frames_text_columns_reach_the_node_without_a_pandas_warning(tmp_path):
    """A DataFrame of pandas 3's text columns (dtype str, as read_csv gives) is written as it is, with no
    deprecation warning of pandas' in the user's output (select_dtypes(include="object") warned of them)."""
    from simulations.api import write_rows

    rows = pd.DataFrame({"cust": ["a", "b", None], "qty": [1, 2, 3], "mixed": pd.Series([1, "x", None], dtype=object)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_rows(rows.astype({"cust": "str"}), tmp_path / "rows.parquet")
    back = pd.read_parquet(tmp_path / "rows.parquet")
    assert back["cust"].tolist()[:2] == ["a", "b"] and back["mixed"].tolist()[:2] == ["1", "x"]


def test_a_fit_models_predict_reads_relative_paths_from_the_fits_base_dir_and_pq_rows(tmp_path, monkeypatch):
    """fit(base_dir=...) with relative sources: its Model, the same run loaded, and the command line predict from
    any working directory (the fit's base_dir kept, and recorded in model.json), and a .pq rows file is read as
    Parquet (as a table's source may be)."""
    from tests.test_checks import shop

    data = tmp_path / "data"
    data.mkdir()
    dataset = shop(data)
    for t in dataset["tables"].values():
        t["source"] = str(Path(t["source"]).relative_to(tmp_path))
    model = tpflower.fit(
        dataset=dataset, algorithm="admm", epochs=1, runtime="inprocess", base_dir=tmp_path, verbose=False
    )
    rows = pd.read_csv(data / "orders.csv").head(5)
    rows.to_parquet(tmp_path / "rows.pq", index=False)
    monkeypatch.chdir(data)  # neither the fit's base dir nor the rows' folder
    pred = model.predict(tmp_path / "rows.pq", verbose=False)
    assert pred["joined_rows"].tolist() == [1] * 5 and pred["prediction"].notna().all()
    assert tpflower.load(model.run_dir, base_dir=tmp_path).predict(rows, verbose=False).equals(pred)
    # loaded elsewhere without base_dir, or the command line without --base-dir: the fit's, in its model.json
    # (were "... no such file" unless --base-dir was given again)
    assert json.loads((model.run_dir / "model.json").read_text())["base_dir"] == str(tmp_path)
    assert tpflower.load(model.run_dir).predict(rows, verbose=False).equals(pred)
    from simulations.predict import main as predict_main

    assert (
        predict_main([str(model.run_dir), "--rows", str(tmp_path / "rows.pq"), "--out", str(tmp_path / "p.csv")]) == 0
    )
    assert pd.read_csv(tmp_path / "p.csv")["prediction"].tolist() == pytest.approx(pred["prediction"].tolist())
    with pytest.raises(tpflower.TpflowerError) as info:  # an explicit base_dir wins: the error names it
        tpflower.load(model.run_dir, base_dir=data).predict(rows, verbose=False)
    said = str(info.value)
    assert (
        f"(relative paths start at base_dir {str(data)!r}; `tpflower predict --base-dir DIR`, or from Python " in said
    )


def test_a_privacy_dict_trains_at_its_settings(tmp_path):
    privacy = {"name": "label", "label_epsilon": 2}
    model = tpflower.fit(
        dataset="synthetic", algorithm="sgd", epochs=1, runtime="inprocess", run_dir=tmp_path, verbose=False,
        dataset__loader__task="binary", privacy=privacy,
    )  # fmt: skip
    assert model.results["privacy"] == {"label_epsilon": 2.0, "feature_epsilon": None, "delta": None}


def test_overrides_are_the_command_lines_spelling():
    assert overrides_of({"epochs": 3, "model__hidden": [32, 16], "algorithm__tol": None, "x": True}) == [
        "epochs=3",
        "model.hidden=[32,16]",
        "algorithm.tol=null",
        "x=true",
    ]
    # a config group as a dict: its choice and its settings (was one override Hydra read as a choice named
    # "{name:label", refused as no such privacy)
    assert overrides_of({"privacy": {"name": "label", "label_epsilon": 2}, "model": {"hidden": [8]}}) == [
        "privacy=label",
        "privacy.label_epsilon=2",
        "model.hidden=[8]",
    ]
    assert override_value("SELECT a FROM t WHERE b = 'x'") == "\"SELECT a FROM t WHERE b = 'x'\""
    assert override_value("movielens") == "movielens"
    assert override_value("null") == "'null'"


def test_importing_tpflower_loads_no_server_code():
    code = "import sys, tpflower; print(sorted({m.split('.')[0] for m in sys.modules} & {'strategies', 'simulations', 'torch', 'flwr'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_the_tpflower_command_dispatches_to_the_modules():
    args = ["dataset=nycflights13_sql"]
    module = subprocess.run(
        [sys.executable, "-m", "simulations.sql", *args], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert cli("sql", *args).stdout == module.stdout
    helped = cli("--help")
    assert helped.returncode == 0 and all(c in helped.stdout for c in ("train", "predict", "sql", "node", "deploy"))
    assert "usage: tpflower predict" in cli("predict", "--help").stdout
    # the run's help: the options as a user selects them (no `_admm` defaults), each algorithm said in a line
    train = cli("train", "--help")
    groups = next(line for line in train.stdout.splitlines() if line.startswith("  algorithm: "))
    options = sorted(p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml"))
    assert train.returncode == 0 and groups == f"  algorithm: {', '.join(options)}"
    assert re.search(r"^  gbdt +histogram gradient boosting over the join", train.stdout, re.M)
    wrong = cli("trian")
    assert wrong.returncode == 2 and "no command 'trian'" in wrong.stderr


def test_tpflower_version_names_tpflower_and_the_flower_it_runs_on(capsys):
    """As `flwr --version` (was: "error: no command '--version'", status 2)."""
    from importlib.metadata import version

    from simulations.cli import main as cli_main

    for flag in ("--version", "-V"):
        assert cli_main([flag]) == 0
        assert capsys.readouterr().out == f"tpflower {version('tpflower')} (Flower {version('flwr')})\n"


def test_loading_a_folder_that_is_no_run_is_one_line_saying_which(tmp_path):
    """Was "PATH/results.json: cannot read ([Errno 2] No such file or directory: ...)" for both."""
    with pytest.raises(tpflower.TpflowerError) as missing:
        tpflower.load(tmp_path / "nope")
    assert str(missing.value) == f"{tmp_path / 'nope'}: no such folder (a run's folder holds its results.json)"
    (tmp_path / "empty").mkdir()
    with pytest.raises(tpflower.TpflowerError) as empty:
        tpflower.load(tmp_path / "empty")
    assert "no results.json in it: not a finished run's folder" in str(empty.value) and "Errno" not in str(empty.value)


def test_loading_a_sweeps_folder_names_its_jobs(tmp_path):
    """Was "SWEEP/results.json: cannot read ([Errno 2] No such file or directory ...)"."""
    from tests.test_checks import shop

    spec = shop(tmp_path)
    for job in ("algorithm=pcg", "algorithm=admm"):
        tpflower.fit(
            dataset=spec,
            algorithm=job.split("=")[1],
            epochs=1,
            runtime="inprocess",
            run_dir=tmp_path / "sweep" / job,
            verbose=False,
        )
    (tmp_path / "sweep" / "multirun.yaml").write_text("{}\n")
    with pytest.raises(tpflower.TpflowerError) as info:
        tpflower.load(tmp_path / "sweep")
    assert str(info.value) == (
        f"{tmp_path / 'sweep'} is a sweep's folder, not a run's: load one of its 2 jobs' folders, 'algorithm=admm', "
        f"'algorithm=pcg' (python -m simulations.reproduce {tmp_path / 'sweep'} --out PREFIX compares them)"
    )
    assert tpflower.load(tmp_path / "sweep" / "algorithm=pcg").results["algorithm"] == "tp_join_pcg"


def test_a_hydra_run_dir_override_is_the_fits_run_dir(tmp_path):
    """The command line's hydra.run.dir=DIR given to fit (overrides= or hydra__run__dir=) was dropped by Hydra's
    compose: the run went to outputs/DATE/TIME-... instead; run_dir= and another hydra.run.dir are one line."""
    from tests.test_checks import shop

    spec = shop(tmp_path)
    as_override = tpflower.fit(
        dataset=spec, algorithm="pcg", runtime="inprocess", overrides=[f"hydra.run.dir={tmp_path / 'a'}"], verbose=False
    )
    as_keyword = tpflower.fit(
        dataset=spec, algorithm="pcg", runtime="inprocess", hydra__run__dir=str(tmp_path / "b"), verbose=False
    )
    assert (as_override.run_dir, as_keyword.run_dir) == (tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "results.json").is_file() and (tmp_path / "b" / "results.json").is_file()
    with pytest.raises(tpflower.TpflowerError) as info:
        tpflower.fit(dataset=spec, run_dir=tmp_path / "c", hydra__run__dir=str(tmp_path / "d"), verbose=False)
    assert (
        str(info.value)
        == f"run_dir={str(tmp_path / 'c')!r} and hydra.run.dir={tmp_path / 'd'} name two folders; give one"
    )


def test_a_hydra_setting_fit_does_not_honour_is_refused_in_one_line(tmp_path):
    """hydra.job.name=x (or any hydra.* but the run dir) was dropped by Hydra's compose without a word; now one
    line naming what fit takes, before any run dir is made; config_dir= (fit's own hydra.searchpath) still works."""
    for kw in (
        {"hydra__job__name": "mine"},
        {"overrides": ["hydra.job.name=mine"]},
        {"overrides": ["hydra.verbose=true"]},
        {"config_dir": tmp_path, "overrides": ["hydra.verbose=true"]},
    ):
        with pytest.raises(tpflower.TpflowerError) as info:
            tpflower.fit(dataset="synthetic", runtime="inprocess", run_dir=tmp_path / "r", verbose=False, **kw)
        given = kw["overrides"][0] if "overrides" in kw else "hydra.job.name=mine"
        assert str(info.value) == (
            f"{given}: fit runs no Hydra job, so of Hydra's settings it takes only hydra.run.dir (or run_dir=); a "
            "folder of dataset/NAME.yaml files is config_dir=; the command line (tpflower train) takes the others"
        )
    assert not (tmp_path / "r").exists()
    from simulations.api import compose

    assert compose("synthetic", None, None, "inprocess", [], {}, tmp_path).dataset.name == "synthetic"


def test_a_sweep_given_to_fit_is_one_line_with_the_two_ways_to_run_it(tmp_path):
    """Were Hydra's "Ambiguous value for argument 'algorithm=admm,pcg' ... add --multirun to your command
    line" (there is no command line), and for a list "algorithm=['admm': no such algorithm"."""
    said = []
    for kw in (
        {"algorithm": "admm,pcg"},
        {"algorithm": ["admm", "pcg"]},
        {"overrides": ["algorithm=choice(admm,pcg)"]},
    ):
        with pytest.raises(tpflower.TpflowerError) as info:
            tpflower.fit(dataset="synthetic", runtime="inprocess", run_dir=tmp_path / "run", verbose=False, **kw)
        said.append(str(info.value))
    assert set(said) == {
        "algorithm=admm,pcg is a sweep (one run per value), and fit trains one model: call fit once per value (for v "
        "in ['admm', 'pcg']: tpflower.fit(..., algorithm=v)), or run the sweep: tpflower train -m algorithm=admm,pcg ..."
    }
    with pytest.raises(tpflower.TpflowerError, match=r"^algorithm\.rho=1,2 is a sweep .*algorithm__rho=v"):
        tpflower.fit(dataset="synthetic", algorithm="admm", overrides=["algorithm.rho=1,2"], verbose=False)
    assert not (tmp_path / "run").exists()
