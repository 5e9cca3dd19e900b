"""Bad data, one clear report: every problem of every table, one line each, before Flower."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf, open_dict

from simulations.federated import run_in_process
from simulations.job import check_data
from tests.conftest import make_cfg
from tpflower.app.client_app import node_data_error
from tpflower.checks import DataProblems, errors
from tpflower.datasets import check_dataset, compile_sql, load_dataset, load_table
from tpflower.local_table import prepare_local_table
from tpflower.owner import Exposed, OwnerSettings
from tpflower.schema import SpecError

ROOT = Path(__file__).resolve().parents[1]


def shop(folder: Path, orders: pd.DataFrame | None = None, customers: pd.DataFrame | None = None, **extra) -> dict:
    """orders (label table: spend; key cust; numeric qty) joined many-to-one with customers (age)."""
    rng = np.random.default_rng(0)
    if orders is None:
        orders = pd.DataFrame(
            {
                "cust": rng.integers(0, 50, 400),
                "qty": rng.integers(1, 5, 400).astype(float),
                "spend": rng.normal(10, 2, 400),
            }
        )
    if customers is None:
        customers = pd.DataFrame({"cust": np.arange(50), "age": rng.integers(18, 80, 50).astype(float)})
    orders.to_csv(folder / "orders.csv", index=False)
    customers.to_csv(folder / "customers.csv", index=False)
    return {
        "name": "shop",
        "tables": {
            "orders": {"source": str(folder / "orders.csv"), "numeric": ["qty"]},
            "customers": {"source": str(folder / "customers.csv"), "numeric": ["age"]},
        },
        "label": {"table": "orders", "column": "spend", "task": "regression"},
        "joins": [{"left": "orders", "right": "customers", "on": "cust"}],
        **extra,
    }


def good(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    shop(folder)
    return pd.read_csv(folder / "orders.csv"), pd.read_csv(folder / "customers.csv")


def lines(dataset: dict) -> list[str]:
    with pytest.raises(DataProblems) as info:
        load_dataset(dataset)
    return [p.line() for p in info.value.problems]


def test_a_sound_dataset_has_no_problem(tmp_path):
    spec, frames, problems = check_dataset(shop(tmp_path))
    assert problems == [] and spec.label_table == "orders" and len(frames["orders"]) == 400


def test_nan_join_key(tmp_path):
    orders, customers = good(tmp_path)
    orders.loc[3, "cust"] = np.nan
    path = tmp_path / "orders.csv"
    assert lines(shop(tmp_path, orders, customers)) == [
        f"table 'orders', key column 'cust': 1 missing (NaN) key value, first at row 3 (line 5 of {path}); "
        "drop or fill those rows before training (a row without a key joins nothing)"
    ]


def test_missing_labels(tmp_path):
    orders, customers = good(tmp_path)
    orders.loc[[7, 9], "spend"] = np.nan
    (line,) = lines(shop(tmp_path, orders, customers))
    assert line.startswith("table 'orders', label column 'spend': 2 missing labels, first at row 7 (line 9 of ")
    assert line.endswith("; drop the rows without a label or fill them")


def test_an_infinite_regression_label_is_refused_naming_its_row(tmp_path, caplog):
    """+-inf labels (and "inf" text) are one data-check line naming the table, the column and the first row,
    before training; a deployed node sends the count, not the row or the value (its log keeps them)."""
    orders, customers = good(tmp_path)
    orders.loc[[5, 11], "spend"] = [np.inf, -np.inf]
    (line,) = lines(shop(tmp_path, orders, customers))
    assert line == (
        "table 'orders', label column 'spend': 2 infinite regression labels, first at row 5 "
        f"(line 7 of {tmp_path / 'orders.csv'}): inf; replace them by finite numbers or drop those rows"
    )
    with pytest.raises(DataProblems) as info:
        load_table(shop(tmp_path, orders, customers), "orders")
    owner = OwnerSettings(
        "orders", Exposed(("cust",), ("qty",), (), "spend"), {"name": "label"}, b"k", origin="/owner/o.yaml"
    )
    sent = str(node_data_error(info.value, owner))
    assert sent == (
        "1 problem in the data: table 'orders', label column 'spend': 2 infinite regression labels; "
        "replace them by finite numbers or drop those rows"
    )
    assert "row 5" in caplog.text  # the node's own log keeps where


def test_unknown_column(tmp_path):
    dataset = shop(tmp_path)
    dataset["tables"]["customers"]["numeric"] = ["agee"]
    assert lines(dataset) == [
        "table 'customers' has no column 'agee', its columns are ['cust', 'age']; "
        "fix the column name in the dataset config or in the file's header"
    ]


def test_non_numeric_value_shows_value_and_row(tmp_path):
    orders, customers = good(tmp_path)
    customers["age"] = customers["age"].astype(object)
    customers.loc[[12, 30], "age"] = ["unknown", "?"]
    (line,) = lines(shop(tmp_path, orders, customers))
    assert line.startswith(
        "table 'customers', numeric feature 'age': 2 non-numeric values, first at row 12 "
        f"(line 14 of {tmp_path / 'customers.csv'}): 'unknown'; make every value a number"
    )


def test_a_date_column_declared_numeric_is_called_dates_not_text(tmp_path):
    """A Parquet file's datetime column (an order's date) declared numeric: the line says what it holds and how to
    train on it, not "numbers stored as text"; declared categorical it loads."""
    orders, customers = good(tmp_path)
    customers["since"] = pd.Timestamp("2015-01-01") + pd.to_timedelta(customers["cust"], unit="D")
    customers.to_parquet(tmp_path / "customers.parquet")
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"].update(source=str(tmp_path / "customers.parquet"), numeric=["age", "since"])
    (line,) = lines(dataset)
    assert line.startswith("table 'customers', numeric feature 'since': dates or times, not numbers (dtype datetime64")
    assert "declare the column categorical" in line
    dataset["tables"]["customers"].update(numeric=["age"], categorical=["since"])
    assert check_dataset(dataset)[2] == []


def test_dates_written_as_text_in_a_numeric_column_are_called_dates(tmp_path):
    """A CSV column of dates (2017-01-01, 2017-01-01T06:00:42Z reads as text) declared numeric: the line says it
    holds dates and how to train on them, as for a Parquet datetime column (was: 'non-numeric values ... make
    every value a number'); a column of other text keeps the non-numeric line."""
    orders, customers = good(tmp_path)
    customers["since"] = (pd.Timestamp("2015-01-01") + pd.to_timedelta(customers["cust"], unit="D")).astype(str)
    customers.loc[3, "since"] = "2016-02-03 06:00:42"
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["numeric"] = ["age", "since"]
    (line,) = lines(dataset)
    assert line.startswith(
        f"table 'customers', numeric feature 'since': {len(customers)} dates or times written as text, not numbers, "
        f"first at row 0 (line 2 of {tmp_path / 'customers.csv'}): '2015-01-01'; store a number computed from them"
    )
    customers.loc[3, "since"] = "last spring"
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["numeric"] = ["age", "since"]
    (line,) = lines(dataset)
    assert f"{len(customers)} non-numeric values" in line and "make every value a number" in line


def test_empty_and_unreadable_files_name_table_and_file(tmp_path):
    dataset = shop(tmp_path)
    (tmp_path / "customers.csv").write_text("")
    (tmp_path / "orders.csv").write_bytes(b"cust,qty,spend\n1,2,\xff\xfe\n")
    found = lines(dataset)
    assert len(found) == 2
    assert found[0].startswith(f"table 'orders' cannot be read from '{tmp_path / 'orders.csv'}': not UTF-8 text")
    assert found[1] == (
        f"table 'customers' cannot be read from '{tmp_path / 'customers.csv'}': the file is empty "
        "(not even a header row); write the table into it: a header row with the column names, "
        "then one line per row"
    )
    assert "EmptyDataError" not in " ".join(found)


def test_a_feature_bearing_the_labels_name_in_another_table(tmp_path):
    orders, customers = good(tmp_path)
    customers["spend"] = 1.0
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["numeric"] = ["age", "spend"]
    assert lines(dataset) == [
        "table 'customers', feature 'spend': a feature bears the label's name 'spend' (the label is table "
        "'orders''s); rename the column or drop it from this table's features"
    ]
    # the check a client runs alone (federated runs, deployment) finds it too
    with pytest.raises(DataProblems, match="feature 'spend': a feature bears the label's name"):
        load_table(dataset, "customers")


def test_a_join_dropping_labelled_rows_warns_or_fails(tmp_path):
    orders, customers = good(tmp_path)
    customers = customers[customers["cust"] != 7]  # every order of customer 7 loses its partner
    lost = int((orders["cust"] == 7).sum())
    dataset = shop(tmp_path, orders, customers)
    _, _, problems = check_dataset(dataset)
    (warning,) = problems
    assert warning.severity == "warning" and not errors(problems)
    assert warning.line() == (
        f"join orders.cust = customers.cust drops {lost:,} of the 400 rows of label table 'orders' "
        f"({lost / 400:.1%}): they have no partner row in table 'customers'; add the missing rows to that table, "
        "or set dataset.on_dropped_rows=ignore to train on the rest (=error to refuse)"
    )
    (error,) = check_dataset({**dataset, "on_dropped_rows": "error"})[2]
    assert error.severity == "error" and error.line().endswith(  # refused: no word of training on the rest
        "; add the missing rows to that table, or set dataset.on_dropped_rows=ignore to train on the rest"
    )
    assert check_dataset({**dataset, "on_dropped_rows": "ignore"})[2] == []
    with pytest.raises(ValueError, match="on_dropped_rows must be one of"):
        check_dataset({**dataset, "on_dropped_rows": "sometimes"})


def test_string_keys_differing_in_case_or_spaces_are_named_in_the_join_line(tmp_path):
    """Keys written 'c7' in one file and ' C7' in the other do not join (as SQL's =); the line says that they
    differ only in case or surrounding spaces, with the first such pair, instead of leaving the user to look."""
    orders, customers = good(tmp_path)
    orders["cust"] = "c" + orders["cust"].astype(str)
    customers["cust"] = "c" + customers["cust"].astype(str)
    customers.loc[customers["cust"] == "c7", "cust"] = " C7"
    lost = int((orders["cust"] == "c7").sum())
    (warning,) = check_dataset(shop(tmp_path, orders, customers))[2]
    assert warning.line().endswith(
        f"add the missing rows to that table, or set dataset.on_dropped_rows=ignore to train on the rest (=error to "
        f"refuse); {lost} rows of table 'orders' hold a key that differs from one of table 'customers' only in case, "
        "surrounding spaces or the way a date is written: write the keys alike in both files"
    )
    assert ", e.g. orders holds 'c7' where customers holds ' C7';" in warning.line()
    assert "'c7'" not in warning.line(values=False)  # a deployed node's line: no value
    customers["cust"] = customers["cust"].str.upper()  # every key: the join is empty
    (error,) = check_dataset(shop(tmp_path, orders, customers))[2]
    assert error.severity == "error" and error.line().startswith(
        "join orders.cust = customers.cust matched no rows: the join comes out empty, e.g. orders holds 'c42' where "
        "customers holds 'C42'; check the key values"
    )


def test_date_keys_written_two_ways_are_named_in_the_join_line(tmp_path):
    """'2024-01-31' in one file and '01/31/2024' in the other name the same day but do not join (keys join as
    written): the empty join's line says so with the first such pair; codes of digits only (zip codes) are text."""
    orders, customers = good(tmp_path)
    days = pd.Timestamp("2024-01-01") + pd.to_timedelta(np.arange(50), unit="D")
    orders["cust"] = days[orders["cust"]].strftime("%Y-%m-%d")
    customers["cust"] = days[customers["cust"]].strftime("%m/%d/%Y")
    (error,) = check_dataset(shop(tmp_path, orders, customers))[2]
    first = orders["cust"][0]
    assert error.line().startswith(
        f"join orders.cust = customers.cust matched no rows: the join comes out empty, e.g. orders holds {first!r} "
        f"where customers holds {pd.Timestamp(first).strftime('%m/%d/%Y')!r}; check the key values"
    )
    assert error.line().endswith(
        "400 rows of table 'orders' hold a key that differs from one of table 'customers' "
        "only in case, surrounding spaces or the way a date is written: write the keys alike in both files"
    )
    orders["cust"] = "0" + orders["cust"].str.replace("-", "")  # '020240101' against '01/01/2024': not dates
    (error,) = check_dataset(shop(tmp_path, orders, customers))[2]
    assert error.line().endswith("(no row of table 'customers' has a partner)")


def test_a_repeated_key_in_a_joined_table_warns_unless_its_spec_says_unique(tmp_path):
    """A dimension table holding a key twice silently repeats the rows that join it (many-to-many): a warning
    naming the join, the counts and the fix; ``unique: false`` (meant) silences it, ``unique: true`` makes
    its node refuse the duplicates; any other value is refused."""
    orders, customers = good(tmp_path)
    customers = pd.concat([customers, customers[customers["cust"].isin([3, 7])]], ignore_index=True)
    held = int(orders["cust"].isin([3, 7]).sum())
    dataset = shop(tmp_path, orders, customers)
    _, _, problems = check_dataset(dataset)
    (warning,) = problems
    assert warning.severity == "warning" and warning.count == held
    assert warning.line() == (
        f"join orders.cust = customers.cust: 2 key values of table 'customers' are on more than one of its rows, "
        f"so the join repeats the {held:,} rows of table 'orders' that hold them, once per partner row; set unique: "
        "false on table 'customers' if a training row per partner is meant (many-to-many), unique: true to refuse "
        "the duplicates, or remove them"
    )
    meant = {**dataset, "tables": {**dataset["tables"], "customers": {**dataset["tables"]["customers"]}}}
    meant["tables"]["customers"]["unique"] = False
    assert check_dataset(meant)[2] == []
    meant["tables"]["customers"]["unique"] = True  # refused with the table's other problems (its node's refusal)
    assert [p.line() for p in check_dataset(meant)[2]] == [
        "table 'customers' declares its key cust unique, but 4 rows share a value, first at row 3 (line 5 of "
        f"{tmp_path / 'customers.csv'}): cust=3; remove the duplicates, or drop unique: true if a training row per "
        "partner is meant"
    ]
    meant["tables"]["customers"]["unique"] = "yes"
    with pytest.raises(SpecError, match="table 'customers': unique must be true or false, got 'yes'"):
        check_dataset(meant)
    assert check_dataset(shop(tmp_path))[2] == []  # one row per key: nothing to say


def test_all_problems_of_a_table_arrive_in_one_run(tmp_path):
    orders, customers = good(tmp_path)
    orders["qty"] = orders["qty"].astype(object)
    orders.loc[5, "qty"] = "two"
    orders.loc[6, "cust"] = np.nan
    orders.loc[8, "spend"] = np.nan
    customers["age"] = customers["age"].astype(object)
    customers.loc[1, "age"] = "old"
    found = lines(shop(tmp_path, orders, customers))
    assert [line.split(":")[0] for line in found] == [
        "table 'orders', numeric feature 'qty'",
        "table 'orders', key column 'cust'",
        "table 'orders', label column 'spend'",
        "table 'customers', numeric feature 'age'",
    ]


def test_a_missing_relative_source_says_where_relative_paths_start_and_how_to_move_them(tmp_path, monkeypatch):
    dataset = shop(tmp_path)
    dataset["tables"]["customers"]["source"] = "customers.csv"
    monkeypatch.chdir(tmp_path.parent)
    (line,) = lines(dataset)
    assert line.endswith(
        f"fix the table's source path (relative paths start at the working directory {str(tmp_path.parent)!r}; "
        "`tpflower predict --base-dir DIR`, or from Python base_dir= of tpflower.fit, tpflower.load or predict, says "
        "where they start)"
    )
    assert load_dataset(dataset, base_dir=tmp_path)[1]["customers"].shape == (50, 2)


def test_every_problem_of_the_dataset_arrives_in_one_pass(tmp_path):
    """A missing file, a misspelled column, a key stored as text against integers and a duplicate key of a
    ``unique`` table: one report, not one per attempt (the key kinds of the tables that loaded are compared
    even when another table did not load)."""
    orders, customers = good(tmp_path)
    customers["cust"] = "C" + customers["cust"].astype(str)
    customers = pd.concat([customers, customers.iloc[[2]]], ignore_index=True)
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["unique"] = True
    dataset["tables"]["orders"]["numeric"] = ["qtty"]
    (tmp_path / "items.csv").unlink(missing_ok=True)
    dataset["tables"]["items"] = {"source": str(tmp_path / "items.csv"), "numeric": ["price"]}
    dataset["joins"].append({"left": "orders", "right": "items", "on": "cust"})
    found = [line.split(";")[0] for line in lines(dataset)]
    assert found == [
        f"table 'items' source file '{tmp_path / 'items.csv'}' does not exist",
        "table 'orders' has no column 'qtty', its columns are ['cust', 'qty', 'spend']",
        "table 'customers' declares its key cust unique, but 2 rows share a value, first at row 2 (line 4 of "
        f"{tmp_path / 'customers.csv'}): cust='C2'",
        "join orders.cust = customers.cust: key dtype mismatch: orders.cust is integer but customers.cust is string",
    ]
    with pytest.raises(DataProblems) as info:
        load_table(dataset, "customers")
    owner = OwnerSettings("customers", Exposed(("cust",), ("age",)), {"name": "none"}, b"k", origin="/owner/c.yaml")
    sent = str(node_data_error(info.value, owner))  # a deployed node: the count, not the value
    assert "C2" not in sent and "share a value" in sent


def test_a_deployed_node_sends_counts_not_values(tmp_path, caplog):
    orders, customers = good(tmp_path)
    customers["age"] = customers["age"].astype(object)
    customers.loc[4, "age"] = "secret-value-42"
    dataset = shop(tmp_path, orders, customers)
    with pytest.raises(DataProblems) as info:
        load_table(dataset, "customers")
    owner = OwnerSettings("customers", Exposed(("cust",), ("age",)), {"name": "none"}, b"k", origin="/owner/c.yaml")
    sent = str(node_data_error(info.value, owner))
    assert "\n" not in sent and "secret-value-42" not in sent and "row 4" not in sent
    assert sent == (
        "1 problem in the data: table 'customers', numeric feature 'age': 1 non-numeric value; make "
        "every value a number (leave it empty if unknown: a missing value, which boosted trees bin apart and "
        "the other models fill with the median), or declare the column categorical"
    )
    assert "secret-value-42" in caplog.text  # the node's own log keeps the example
    simulated = str(node_data_error(info.value, OwnerSettings("customers", Exposed(), {}, b"k")))
    assert "'secret-value-42'" in simulated and "\n" not in simulated
    # nor the names of columns the node does not expose
    customers["ssn"] = "x"
    dataset = shop(tmp_path, orders, customers.assign(age=1.0))
    dataset["tables"]["customers"]["numeric"] = ["agee"]
    with pytest.raises(DataProblems) as info:
        load_table(dataset, "customers")
    sent = str(node_data_error(info.value, owner))
    assert "'agee'" in sent and "ssn" not in sent


def test_a_categorical_column_whose_one_hot_block_outgrows_the_machine_is_refused_naming_it(tmp_path, monkeypatch):
    """Dense features of rows x (numeric columns + categories) at 4 bytes a value over half the machine's memory:
    one line naming the table and its categorical column of most categories, before any training; the counts
    only in the example (a deployed node sends the line without it), never a category."""
    orders, customers = good(tmp_path)
    customers["email"] = [f"person{i}@example.org" for i in range(len(customers))]  # one category per row
    customers["segment"] = np.where(customers["age"] > 50, "senior", "junior")
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["categorical"] = ["segment", "email"]
    need = 4 * 50 * (1 + 2 + 50)  # 50 rows x (age, 2 segments, 50 emails)
    monkeypatch.setattr("tpflower.checks.machine_memory", lambda: 2 * need)
    assert check_dataset(dataset)[2] == []  # exactly half: still fits
    monkeypatch.setattr("tpflower.checks.machine_memory", lambda: 2 * need - 2)
    (line,) = lines(dataset)
    assert line == (
        "table 'customers', categorical feature 'email': its one-hot block makes the table's features, held "
        "dense, larger than half of this machine's memory, 50 categories over 50 rows: 0.0 GB of features "
        "against 0.0 GB; drop the column, declare it numeric if its values are numbers, or group its categories "
        "into a new column of fewer values in the table's file (a date's month, say)"
    )
    with pytest.raises(DataProblems) as info:
        load_table(dataset, "customers")
    exposed = Exposed(("cust",), ("age", "segment", "email"))
    owner = OwnerSettings("customers", exposed, {"name": "none"}, b"k", origin="/owner/c.yaml")
    sent = str(node_data_error(info.value, owner))
    assert "'email'" in sent and "person" not in sent and "50 categories" not in sent


def test_an_identifier_like_categorical_column_of_the_label_table_is_refused_naming_it(tmp_path):
    """A label-table column of a category on most rows (an id, a timestamp, free text) is refused in one line;
    a dimension's column of one category per row (a per-entity effect over the join) is not."""
    orders, customers = good(tmp_path)
    orders["note"] = [f"order {i}" for i in range(len(orders))]
    customers["email"] = [f"person{i}@example.org" for i in range(len(customers))]
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["categorical"] = ["email"]
    assert check_dataset(dataset)[2] == []
    dataset["tables"]["orders"]["categorical"] = ["note"]
    (line,) = lines(dataset)
    assert line.startswith("table 'orders', categorical feature 'note': a different category on most rows")
    assert "400 categories over 400 rows" in line and "drop the column" in line
    assert "CASE" not in line and "new column of fewer values in the table's file" in line  # SQL computes no column


def test_an_identifier_column_that_also_outgrows_the_machine_is_one_line(tmp_path, monkeypatch):
    """A label-table column of one category per row whose one-hot block is also over half the memory is told
    once, as an identifier (was: a second line for the same column, the memory one); another column too wide
    for the machine keeps its own line."""
    orders, customers = good(tmp_path)
    orders["note"] = [f"order {i}" for i in range(len(orders))]
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["orders"]["categorical"] = ["note"]
    monkeypatch.setattr("tpflower.checks.machine_memory", lambda: 1024)
    (line,) = lines(dataset)
    assert line.startswith("table 'orders', categorical feature 'note': a different category on most rows")
    customers["email"] = [f"person{i}@example.org" for i in range(len(customers))]
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["orders"]["categorical"] = ["note"]
    dataset["tables"]["customers"]["categorical"] = ["email"]
    assert [line.split(":")[0] for line in lines(dataset)] == [
        "table 'orders', categorical feature 'note'",
        "table 'customers', categorical feature 'email'",
    ]


def test_a_union_shard_column_not_exposed_or_holding_unlisted_values_is_refused_up_front_once(tmp_path):
    """scenario=ucq: a shard column that is none of the table's keys or features, and rows whose shard value is
    not listed, are refused in the simulation's data check, one line each naming the table and the column (the
    first unlisted value and its row as the example), before any node refuses the run once per shard."""
    orders, customers = good(tmp_path)
    orders["region"] = np.where(np.arange(len(orders)) % 3 == 0, "north", "south")
    orders.loc[7, "region"] = "west"
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["orders"]["shards"] = {"by": "region", "values": ["north", "south"]}
    cfg = make_cfg("scenario=ucq", "algorithm=admm")
    cfg.dataset = OmegaConf.create(dataset)
    with pytest.raises(DataProblems) as info:
        check_data(cfg)
    first, second = (p.line() for p in info.value.problems)
    assert first.startswith("table 'orders', shard column 'region': splits the table into shards but is none")
    assert "declare it numeric or categorical" in first
    assert second.startswith("table 'orders', shard column 'region': 1 value not among the listed shard values")
    assert "first at row 7 (line 9 of" in second and "'west'" in second
    dataset["tables"]["orders"]["categorical"] = ["region"]
    dataset["tables"]["orders"]["shards"]["values"] = ["north", "south", "west"]
    cfg.dataset = OmegaConf.create(dataset)
    assert check_data(cfg, log=lambda _: None) == {"orders": 400, "customers": 50}
    with open_dict(cfg):
        cfg.scenario.name = "join"  # the join reads no shard
    dataset["tables"]["orders"]["shards"]["values"] = ["north"]
    cfg.dataset = OmegaConf.create(dataset)
    assert check_data(cfg, log=lambda _: None) == {"orders": 400, "customers": 50}


def test_a_feature_all_missing_or_of_one_value_is_a_warning(tmp_path):
    orders, customers = good(tmp_path)
    orders["rate"], orders["gone"] = 1.5, np.nan
    orders.loc[3, "rate"] = np.nan  # a missing value beside the one value: still one value
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["orders"]["numeric"] = ["qty", "rate", "gone"]
    problems = check_dataset(dataset)[2]
    assert [(p.severity, p.line()) for p in problems] == [
        (
            "warning",
            "table 'orders', feature 'rate': one value on every row (missing values aside); it adds "
            "nothing to the model: drop it from the table's features",
        ),
        (
            "warning",
            "table 'orders', feature 'gone': every value is missing; it adds nothing to the model: drop it "
            "from the table's features",
        ),
    ]


def test_a_split_leaving_no_test_row_stops_before_training(tmp_path):
    dataset = shop(tmp_path, split={"test_fraction": 0.001})  # 400 labelled rows: none held out
    cfg = make_cfg("algorithm=admm", "epochs=1")
    cfg.dataset = OmegaConf.create(dataset)
    with pytest.raises(SpecError, match=r"the test split holds no joined row \(split.test_fraction=0.001 of 400"):
        run_in_process(cfg, None, log=lambda _: None)


def test_a_run_with_data_warnings_trains_the_nodes_load_their_tables_all_the_same(tmp_path):
    """Warnings (a feature of one value, "n/a" read as a missing number) are said by the data check; each node
    loads its table and trains (a node had refused on any problem, a warning too)."""
    orders, customers = good(tmp_path)
    orders["rate"] = 1.5
    orders["qty"] = orders["qty"].astype(object)
    orders.loc[5, "qty"] = "n/a"
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["orders"]["numeric"] = ["qty", "rate"]
    cfg = make_cfg("algorithm=admm", "epochs=1", "runtime=inprocess")
    cfg.dataset = OmegaConf.create(dataset)
    said: list[str] = []
    assert check_data(cfg, log=said.append) == {"orders": 400, "customers": 50}
    assert len(said) == 2 and all(line.startswith("warning: table 'orders'") for line in said)
    run = run_in_process(cfg, str(tmp_path / "run"), log=lambda _: None)
    assert run.strategy.results.history and (tmp_path / "run" / "model.json").exists()


def test_cli_reports_all_problems_without_traceback(tmp_path):
    orders, customers = good(tmp_path)
    orders.loc[2, "cust"] = np.nan
    customers["age"] = customers["age"].astype(object)
    customers.loc[3, "age"] = "unknown"
    dataset = shop(tmp_path, orders, customers)
    (tmp_path / "conf" / "dataset").mkdir(parents=True)
    (tmp_path / "conf" / "dataset" / "shop.yaml").write_text(yaml.safe_dump(dataset))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TPFLOWER_TRACEBACK"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulations.run",
            "--config-dir",
            str(tmp_path / "conf"),
            "dataset=shop",
            "algorithm=admm",
            "runtime=inprocess",
            "epochs=1",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    console = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in console
    assert out.stderr.splitlines()[0] == "error: dataset 'shop': 2 problems in the data; fix them and run again:"
    assert "key column 'cust': 1 missing (NaN) key value" in out.stderr
    assert "numeric feature 'age': 1 non-numeric value, first at row 3" in out.stderr and "'unknown'" in out.stderr
    assert "Traceback" in (run_dir / "run.log").read_text()  # the full trace went to the run's log file
    assert not (run_dir / "results.json").exists()


def test_a_column_name_twice_in_a_header_is_refused(tmp_path):
    dataset = shop(tmp_path)
    (tmp_path / "customers.csv").write_text("cust,age,age\n1,30,31\n")
    (line,) = lines(dataset)
    assert "table 'customers' cannot be read" in line and "column name(s) ['age'] appear more than once" in line


def test_a_column_declared_in_two_kinds_is_refused_before_start(tmp_path):
    dataset = shop(tmp_path)
    dataset["tables"]["orders"]["categorical"] = ["qty"]
    assert lines(dataset) == [
        "table 'orders', column 'qty': is declared both numeric and categorical; list it under one of the two in "
        "the dataset config"
    ]


def test_na_text_in_a_numeric_column_is_counted_missing_or_refused_as_the_spec_says(tmp_path):
    orders, customers = good(tmp_path)
    orders = orders.astype({"qty": object})
    orders.loc[[3, 8, 9], "qty"] = ["n/a", "NA", "n/a"]
    dataset = shop(tmp_path, orders, customers)
    spec, frames, problems = check_dataset(dataset)
    assert [p.line() for p in problems] == [
        "table 'orders', numeric feature 'qty': 3 values like 'n/a' read as missing, first at row 3 (line 5 of "
        f"{tmp_path / 'orders.csv'}); the median fills them (dataset.na_strings: error refuses them)"
    ]
    assert problems[0].severity == "warning" and frames["orders"]["qty"].isna().sum() == 3
    assert frames["orders"]["qty"].dtype == np.float64
    refused = lines({**dataset, "na_strings": "error"})
    assert refused == [
        "table 'orders', numeric feature 'qty': 3 text values like 'n/a' for a missing number, first at row 3 (line "
        f"5 of {tmp_path / 'orders.csv'}); leave the cells of unknown numbers empty (or set dataset.na_strings: missing)"
    ]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_boolean_column_with_blanks_is_a_numeric_feature_with_missing_values(tmp_path, suffix):
    """pandas reads True, (blank), False as object (a Parquet file may hold "true"/"false" text): read as a
    0/1 column with missing values, a numeric feature like a complete boolean one, its gaps imputed."""
    orders, customers = good(tmp_path)
    flags = pd.Series(np.arange(50) % 3 == 0, dtype=object).where(np.arange(50) % 7 > 0)
    customers["vip"] = flags if suffix == ".csv" else flags.map({True: "true", False: "false"})
    dataset = shop(tmp_path, orders, customers)
    if suffix == ".parquet":
        customers.to_parquet(tmp_path / "customers.parquet", index=False)
        dataset["tables"]["customers"]["source"] = str(tmp_path / "customers.parquet")
    dataset["tables"]["customers"]["numeric"].append("vip")
    spec, frames, problems = check_dataset(dataset)
    assert [p.line() for p in problems] == []
    vip = frames["customers"]["vip"]
    assert pd.api.types.is_bool_dtype(vip) and vip.isna().sum() == 8
    np.testing.assert_array_equal(vip.to_numpy(dtype=np.float64, na_value=np.nan), flags.astype(np.float64))
    local = prepare_local_table(spec, "customers", frames["customers"])
    assert np.isfinite(local.X).all() and local.feature_names == ["age", "vip"]


def test_rows_a_where_filter_removes_are_reported_as_filtered_not_missing(tmp_path):
    dataset = shop(tmp_path)
    dataset["tables"]["customers"]["where"] = "age >= 40"  # an intended filter: older customers only
    _, _, problems = check_dataset(dataset)
    (p,) = problems
    assert p.severity == "warning"
    kept = int((pd.read_csv(tmp_path / "customers.csv")["age"] >= 40).sum())
    assert (  # the user's own filter, and how much of the table it keeps
        f"their partner rows in table 'customers' are filtered out by its WHERE (age >= 40), which keeps {kept} of "
        "its 50 rows; the run trains on the rest" in p.line()
    )
    assert "add the missing rows" not in p.line() and "the run trains on the rest" in p.line()
    (refused,) = check_dataset({**dataset, "on_dropped_rows": "error"})[2]  # the run stops: it trains on nothing
    assert refused.severity == "error" and "the run trains on the rest" not in refused.line()
    assert refused.line().endswith("; loosen the WHERE, or set dataset.on_dropped_rows=ignore to train on the rest")
    del dataset["tables"]["customers"]["where"]
    customers = pd.read_csv(tmp_path / "customers.csv")
    customers[customers["age"] >= 40].to_csv(tmp_path / "customers.csv", index=False)  # the rows really absent
    (missing,) = check_dataset(dataset)[2]
    assert (
        "they have no partner row in table 'customers'" in missing.line() and "add the missing rows" in missing.line()
    )


def test_a_filtered_tables_problem_names_the_row_and_line_of_its_file(tmp_path):
    """A where (or a WHERE of the query) keeps some of a table's rows: a problem of a kept row is named by the
    row and line of the file, as without a filter (not its position among the kept rows)."""
    orders, customers = good(tmp_path)
    orders["qty"] = orders["qty"].astype(object)
    orders.loc[[3, 30], "cust"] = np.nan
    orders.loc[41, "qty"] = "lots"
    orders.loc[:29, "spend"] = 0.0  # the filter drops rows 0-29: row 3's missing key is not in the run
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["orders"]["where"] = "spend > 0"
    path = tmp_path / "orders.csv"
    found = lines(dataset)
    assert found[0].startswith(
        f"table 'orders', numeric feature 'qty': 1 non-numeric value, first at row 41 (line 43 of {path}): 'lots'"
    )
    assert found[1].startswith(
        f"table 'orders', key column 'cust': 1 missing (NaN) key value, first at row 30 (line 32 of {path});"
    )
    sql = {
        "name": "shop",
        "sql": "SELECT o.spend AS label, o.qty, c.age FROM orders o JOIN customers c USING (cust) WHERE o.spend > 0",
        "tables": {"orders": {"source": str(path)}, "customers": {"source": str(tmp_path / "customers.csv")}},
    }
    assert found[1] in lines(compile_sql(sql))  # (qty of text is a categorical column there)


def test_a_label_setting_other_than_table_column_task_is_refused_naming_where_it_goes(tmp_path):
    dataset = shop(tmp_path)
    dataset["label"]["label_range"] = [0, 20]
    with pytest.raises(SpecError, match=r"label has unknown settings \['label_range'\] \(label_range goes at the top"):
        check_dataset(dataset)


def test_a_misspelt_table_setting_is_refused_naming_the_close_one(tmp_path):
    dataset = shop(tmp_path)
    dataset["tables"]["orders"]["numerics"] = dataset["tables"]["orders"].pop("numeric")
    with pytest.raises(
        SpecError, match=r"^table 'orders': unknown settings \['numerics'\] \(did you mean 'numeric'\?\)$"
    ):
        check_dataset(dataset)
    dataset["tables"]["orders"]["colour"] = dataset["tables"]["orders"].pop("numerics")  # nothing close: no hint
    with pytest.raises(SpecError, match=r"^table 'orders': unknown settings \['colour'\]$"):
        check_dataset(dataset)


def test_a_misspelt_dataset_setting_is_refused_naming_the_close_one(tmp_path):
    """``join:`` for ``joins:`` left the spec without joins (the error was a disconnected join graph), ``lable:``
    without a label: the key is named with the setting it is close to; a key close to none passes."""
    for wrong, right in (("joins", "join"), ("label", "lable")):
        dataset = shop(tmp_path)
        dataset[right] = dataset.pop(wrong)
        with pytest.raises(
            SpecError, match=rf"^dataset 'shop': unknown setting '{right}' \(did you mean '{wrong}'\?\)$"
        ):
            check_dataset(dataset)
    assert check_dataset({**shop(tmp_path), "owner_notes": "x"})[2] == []


def test_a_binary_label_of_many_numbers_shows_them_as_written(tmp_path):
    """The example values of a binary label beyond two values read as the file's numbers (0.5), not numpy's
    reprs (np.float64(0.5))."""
    orders, customers = good(tmp_path)
    dataset = shop(tmp_path, orders.assign(spend=np.round(orders["spend"], 1)), customers)
    dataset["label"]["task"] = "binary"
    (line,) = lines(dataset)
    assert "np." not in line
    shown = ", ".join(repr(float(v)) for v in pd.unique(np.round(orders["spend"], 1))[:5])
    assert "(a binary label holds two values, this one " in line and f": {shown}, ...)" in line


def test_a_category_key_joins_a_string_key_as_strings(tmp_path):
    """A pandas ``category`` column of strings (Parquet written by R or arrow) joins a plain string key: it is
    compared by its categories' kind, and its values are mapped as the strings (the same model as with the
    column stored as text)."""
    rng = np.random.default_rng(0)
    codes = np.array([f"c{i}" for i in range(50)], dtype=object)
    orders = pd.DataFrame(
        {"cust": codes[rng.integers(0, 50, 400)], "qty": rng.integers(1, 5, 400), "spend": rng.normal(10, 2, 400)}
    )
    customers = pd.DataFrame({"cust": codes, "age": rng.integers(18, 80, 50).astype(float)})
    plain = shop(tmp_path, orders, customers)
    typed = shop(tmp_path, orders, customers)
    customers.astype({"cust": "category"}).to_parquet(tmp_path / "customers.parquet")
    typed["tables"]["customers"]["source"] = str(tmp_path / "customers.parquet")
    spec, frames, problems = check_dataset(typed)
    assert isinstance(frames["customers"]["cust"].dtype, pd.CategoricalDtype) and problems == []
    metrics = []
    for dataset in (plain, typed):
        cfg = make_cfg("algorithm=admm", "epochs=2", "runtime=inprocess")
        cfg.dataset = OmegaConf.create(dataset)
        run = run_in_process(cfg, None, log=lambda _: None)
        metrics.append(run.strategy.results.history[-1].test_metric)
    assert metrics[0] == metrics[1]


def test_a_date_key_against_iso_text_is_refused_saying_how_to_make_them_agree(tmp_path):
    orders, customers = good(tmp_path)
    orders["cust"] = pd.Timestamp("2015-01-01") + pd.to_timedelta(orders["cust"], unit="D")
    orders.to_parquet(tmp_path / "orders.parquet")
    customers["cust"] = (pd.Timestamp("2015-01-01") + pd.to_timedelta(customers["cust"], unit="D")).dt.strftime(
        "%Y-%m-%d"
    )
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["orders"]["source"] = str(tmp_path / "orders.parquet")
    assert lines(dataset) == [
        "join orders.cust = customers.cust: key dtype mismatch: orders.cust is datetime but customers.cust is "
        "string; store the text column as dates too (a Parquet date or timestamp column), or the date column as "
        "ISO text (e.g. '2015-01-01') in both files"
    ]


def test_unquoted_yes_no_of_a_yaml_list_get_a_hint_to_quote_them(tmp_path):
    """YAML 1.1 reads `classes: [no, yes]` and `values: [no, yes]` as booleans; the data holds the words: the
    problem line says to quote them (and quoted, the run's check passes)."""
    orders, customers = good(tmp_path)
    orders["late"] = np.where(orders["qty"] > 2, "yes", "no")
    orders["vip"] = np.where(orders["cust"] % 2 == 0, "yes", "no")
    text = "label: {table: orders, column: late, task: binary, classes: [no, yes]}"
    dataset = shop(tmp_path, orders, customers, label=yaml.safe_load(text)["label"])
    dataset["tables"]["orders"].update(categorical=["vip"], shards=yaml.safe_load("{by: vip, values: [no, yes]}"))
    cfg = make_cfg("scenario=ucq", "algorithm=admm")
    cfg.dataset = OmegaConf.create(dataset)
    with pytest.raises(DataProblems) as info:
        check_data(cfg)
    said = [p.line() for p in info.value.problems]
    assert len(said) == 2 and all("quote them, e.g. ['no', 'yes']" in line for line in said)
    assert "label.classes [False, True]" in said[0] and "shard values ['False', 'True']" in said[1]
    dataset["label"]["classes"] = ["no", "yes"]  # quoted
    dataset["tables"]["orders"]["shards"]["values"] = ["no", "yes"]
    cfg.dataset = OmegaConf.create(dataset)
    assert check_data(cfg, log=lambda _: None)["orders"] == 400
    orders["late"] = orders["late"].map({"no": "early", "yes": "late"})  # no word YAML reads as a boolean
    dataset = shop(tmp_path, orders, customers, label={**dataset["label"], "classes": [False, True]})
    assert "quote them" not in lines(dataset)[0]


def test_a_table_of_a_header_alone_is_one_problem_not_one_per_numeric_column(tmp_path):
    """A header-only file reads every column as text (dtype object): its one problem is that it has no rows,
    not also 'numbers stored as text' for each numeric feature."""
    dataset = shop(tmp_path)
    (tmp_path / "orders.csv").write_text("cust,qty,spend\n")
    found = [line for line in lines(dataset) if "'orders'" in line]
    assert found == ["table 'orders' has no rows; fill the table (its file has a header but no data rows)"]
