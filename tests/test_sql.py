"""The training set as SQL (tpflower.sql): every bundled dataset's query gives the spec and the table mapping
of its YAML; a UNION ALL gives the union scenario's shards; WHERE runs at the owner; every refused construct
is refused with one line naming it and its position."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from simulations.run import compile_query as compile_run_query
from simulations.run import run_job
from simulations.sql import compiled_yaml
from tpflower.config import compose_config
from tpflower.datasets import compile_sql, load_dataset, load_spec, load_table, shard_rows
from tpflower.owner import Refusal, load_owner_settings, simulation_owner
from tpflower.relation import load_relation
from tpflower.schema import SpecError, parse_spec
from tpflower.sql import QueryError, compile_query, row_mask

CONF = Path(__file__).parents[1] / "conf" / "dataset"
SECRET = b"test-secret"


def yaml(name: str) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"), resolve=True)  # type: ignore[return-value]


def sql_form(cfg: dict[str, Any], sql: str) -> dict[str, Any]:
    """The YAML config with its features, label column and joins replaced by the query ``sql``."""
    out = {k: v for k, v in cfg.items() if k != "joins"}
    if "tables" in out:
        out["tables"] = {
            t: {k: v for k, v in s.items() if k not in ("numeric", "categorical")} for t, s in cfg["tables"].items()
        }
    if "label" in out:
        out["label"] = {"task": cfg["label"]["task"]}
    return {**out, "sql": sql}


def assert_same_mapping(a: dict[str, Any], b: dict[str, Any], base_dir: Path | None = None) -> None:
    ra = load_relation(a, SECRET, base_dir=base_dir, verbose=False)
    rb = load_relation(b, SECRET, base_dir=base_dir, verbose=False)
    assert ra.mapping.n_rows == rb.mapping.n_rows
    assert set(ra.mapping.p) == set(rb.mapping.p)
    for t in ra.mapping.p:
        np.testing.assert_array_equal(ra.mapping.p[t], rb.mapping.p[t], err_msg=t)
    for t in ra.train.p:
        np.testing.assert_array_equal(ra.train.p[t], rb.train.p[t], err_msg=t)


# ------------------------------------------------------------------------------- the bundled datasets

FLIGHTS = (
    "SELECT f.{label} AS label, f.month, f.day, f.hour, f.sched_dep_time, f.dep_delay, f.distance, "
    "w.temp, w.dewp, w.humid, w.wind_dir, w.wind_speed, w.wind_gust, w.precip, w.pressure, w.visib, "
    "p.year, p.engines, p.seats, p.type, p.manufacturer, p.engine, a.lat, a.lon, a.alt, a.tz, l.name "
    "FROM flights f JOIN planes p USING (tailnum) JOIN airports a ON f.dest = a.faa "
    "JOIN weather w ON f.origin = w.origin AND f.time_hour = w.time_hour JOIN airlines l USING (carrier)"
)
SYNTHETIC = "SELECT fact.y AS label, fact.*, d1.*, d2.*, d3.* FROM fact JOIN d1 USING (k1) JOIN d2 USING (k2) JOIN d3 USING (k3)"


def test_movielens_sql_conf_gives_the_movielens_spec_and_mapping():
    sql, ref = yaml("sql"), yaml("movielens")
    compiled = compile_sql(sql)
    assert parse_spec(compiled).tables == parse_spec(ref).tables
    assert parse_spec(compiled).joins == parse_spec(ref).joins
    assert parse_spec(compiled).label == parse_spec(ref).label
    assert parse_spec({**compiled, "name": "movielens"}) == parse_spec(ref)
    assert_same_mapping(compiled, ref)


@pytest.mark.parametrize("name,label", [("nycflights13", "arr_delay"), ("nycflights13_delayed", "delayed")])
def test_nycflights13_sql_gives_its_spec_and_mapping(name, label):
    ref = yaml(name)
    compiled = compile_sql(sql_form(ref, FLIGHTS.format(label=label)))
    assert parse_spec(compiled) == parse_spec(ref)
    assert_same_mapping(compiled, ref)


def test_synthetic_sql_with_stars_gives_its_spec_and_mapping():
    ref = yaml("synthetic")
    compiled = compile_sql({**ref, "sql": SYNTHETIC})
    spec, (ref_spec, _) = parse_spec(compiled), load_dataset(ref)
    assert spec == ref_spec  # keys and the label are not features of fact.*, d1.*, ...
    assert_same_mapping(compiled, ref)


def write_ml1m(folder: Path) -> None:
    folder.mkdir()
    (folder / "ratings.dat").write_text(
        "1::10::4::978300760\n1::20::3::978302109\n2::10::5::978301968\n3::30::2::978824291\n"
    )
    (folder / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072\n3::M::25::15::55117\n")
    (folder / "movies.dat").write_text(
        "10::Toy Story (1995)::Animation|Comedy\n20::Heat (1995)::Action\n30::Casino (1995)::Drama\n"
    )


def test_movielens1m_sql_with_category_casts_gives_its_spec_and_mapping(tmp_path):
    write_ml1m(tmp_path / "ml-1m")
    ref = OmegaConf.to_container(OmegaConf.load(CONF / "movielens1m.yaml"))
    ref["loader"]["path"] = str(tmp_path / "ml-1m")
    ref["on_dropped_rows"] = "ignore"
    sql = (
        "SELECT r.rating AS label, r.rating_year, r.rating_month, r.rating_hour, r.rating_weekday, m.year, m.genre, "
        "u.gender, CAST(u.age AS CATEGORY), CAST(u.occupation AS CATEGORY) "
        "FROM ratings r JOIN movies m USING (movieId) JOIN users u USING (userId)"
    )
    compiled = compile_sql(sql_form(ref, sql))
    assert parse_spec(compiled) == parse_spec(ref)
    assert compiled["tables"]["users"]["categorical"] == ["gender", "age", "occupation"]
    assert_same_mapping(compiled, ref)


def test_union_all_over_origins_gives_the_union_scenario_spec():
    compiled = compile_sql(yaml("nycflights13_sql"))
    # the union holds the rows of its shards' values only: flights and weather keep those (here: every row)
    for table in ("flights", "weather"):
        assert compiled["tables"][table].pop("where") == "origin IN ('EWR', 'JFK', 'LGA')"
    spec, ref = parse_spec(compiled), parse_spec(yaml("nycflights13"))
    assert spec == ref
    assert spec.table("flights").shards.values == ("EWR", "JFK", "LGA")
    assert spec.clients("ucq") == ref.clients("ucq")


# ------------------------------------------------------------------------------------- the shop tables

SHOP_YAML = {
    "name": "shop",
    "tables": {
        "orders": {"source": "orders.csv", "numeric": ["qty"]},
        "customers": {"source": "customers.csv", "numeric": ["age"], "categorical": ["segment"]},
        "products": {"source": "products.csv", "numeric": ["price"]},
    },
    "label": {"table": "orders", "column": "spend", "task": "regression"},
    "joins": [
        {"left": "orders", "right": "customers", "on": "cust"},
        {"left": "orders", "right": "products", "on": "sku"},
    ],
    "split": {"test_fraction": 0.2, "seed": 1},
}
SHOP_SQL = (
    "SELECT o.spend AS label, o.qty, c.age, c.segment, p.price "
    "FROM orders o JOIN customers c USING (cust) JOIN products p USING (sku)"
)


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    n = 200
    pd.DataFrame(
        {
            "oid": np.arange(n),
            "cust": rng.integers(0, 20, n),
            "sku": rng.integers(0, 10, n),
            "qty": rng.integers(1, 5, n),
            "spend": rng.normal(size=n),
            "region": np.where(np.arange(n) % 2 == 0, "eu", "us"),
        }
    ).to_csv(tmp_path / "orders.csv", index=False)
    pd.DataFrame(
        {
            "cust": np.arange(20),
            "age": rng.integers(18, 80, 20),
            "segment": np.array(["a", "b", "c", "d"])[np.arange(20) % 4],
            "region": np.where(np.arange(20) < 10, "eu", "us"),
        }
    ).to_csv(tmp_path / "customers.csv", index=False)
    pd.DataFrame({"sku": np.arange(10), "price": rng.uniform(1, 9, 10)}).to_csv(tmp_path / "products.csv", index=False)
    return tmp_path


def shop_sql(sql: str) -> dict[str, Any]:
    return sql_form(SHOP_YAML, sql)


@pytest.mark.parametrize("literal", ["1e0", "1.5", ".5", "15e-1", "1"])
def test_numeric_literals_in_a_where_read_as_numbers(shop, literal):
    compiled = compile_sql(shop_sql(SHOP_SQL + f" WHERE o.qty > {literal}"), base_dir=shop)
    _, own = load_table(compiled, "orders", base_dir=shop)
    orders = pd.read_csv(shop / "orders.csv")
    pd.testing.assert_frame_equal(own, orders[orders.qty > float(literal)].reset_index(drop=True))


def test_the_docs_shop_example_as_sql_gives_its_spec_and_mapping(shop):
    compiled = compile_sql(shop_sql(SHOP_SQL), base_dir=shop)
    assert parse_spec(compiled) == parse_spec(SHOP_YAML)
    assert_same_mapping(compiled, SHOP_YAML, base_dir=shop)


def test_where_on_one_table_is_applied_by_its_owner(shop):
    sql = SHOP_SQL + " WHERE o.qty > 1 AND c.segment IN ('a', 'b') AND o.region = 'eu'"
    compiled = compile_sql(shop_sql(sql), base_dir=shop)
    assert compiled["tables"]["orders"]["where"] == "(qty > 1) AND (region = 'eu')"
    assert compiled["tables"]["customers"]["where"] == "segment IN ('a', 'b')"
    assert "where" not in compiled["tables"]["products"]
    # the server's view holds the predicate, never a row; the owner's node keeps only its matching rows
    assert load_spec(compiled, base_dir=shop).table("orders").where == compiled["tables"]["orders"]["where"]
    orders = pd.read_csv(shop / "orders.csv")
    _, own = load_table(compiled, "orders", base_dir=shop)
    kept = orders[(orders.qty > 1) & (orders.region == "eu")].reset_index(drop=True)
    pd.testing.assert_frame_equal(own, kept)
    relation = load_relation(compiled, SECRET, base_dir=shop, verbose=False)
    assert relation.mapping.n_rows["orders"] == len(kept)
    assert relation.mapping.n_rows["customers"] == 10
    # the same as the owners filtering their files first
    kept.to_csv(shop / "orders_kept.csv", index=False)
    customers = pd.read_csv(shop / "customers.csv")
    customers[customers.segment.isin(["a", "b"])].to_csv(shop / "customers_kept.csv", index=False)
    prefiltered = {
        **SHOP_YAML,
        "tables": {
            **SHOP_YAML["tables"],
            "orders": {"source": "orders_kept.csv", "numeric": ["qty"]},
            "customers": {"source": "customers_kept.csv", "numeric": ["age"], "categorical": ["segment"]},
        },
    }
    assert_same_mapping(compiled, prefiltered, base_dir=shop)


def test_row_mask_predicates():
    frame = pd.DataFrame({"x": [1.0, 2.0, np.nan, 4.0], "s": ["ab", "b", "ac", None]})
    assert row_mask("t", frame, "x BETWEEN 2 AND 4").tolist() == [False, True, False, True]
    assert row_mask("t", frame, "s LIKE 'a%'").tolist() == [True, False, True, False]
    # SQL's three-valued logic: NOT of an unknown is unknown, and an unknown row is not kept
    assert row_mask("t", frame, "x IS NULL OR NOT s = 'b'").tolist() == [True, False, True, False]
    assert row_mask("t", frame, "NOT x > 1").tolist() == [True, False, False, False]
    assert row_mask("t", frame, "s IS NOT NULL AND x <> 2 OR x = NULL").tolist() == [True, False, False, False]
    with pytest.raises(SpecError, match="where compares values of different types"):
        row_mask("t", frame, "s > 3")
    assert row_mask("t", frame, "x * 2 >= 4 AND x <> 4").tolist() == [False, True, False, False]
    assert row_mask("t", pd.DataFrame({"x": [-3, -2, 3, 4]}), "x % 2 = -1 OR x % 2 = 1").tolist() == [
        True,
        False,
        True,
        False,
    ]


def test_union_all_of_every_shard_combination_shards_both_tables(shop):
    branch = SHOP_SQL + " WHERE o.region = '{}' AND c.region = '{}'"
    sql = " UNION ALL ".join(branch.format(a, b) for a in ("eu", "us") for b in ("eu", "us"))
    compiled = compile_sql(shop_sql(sql), base_dir=shop)
    assert compiled["tables"]["orders"]["shards"] == {"by": "region", "values": ["eu", "us"]}
    assert compiled["tables"]["customers"]["shards"] == {"by": "region", "values": ["eu", "us"]}
    spec = parse_spec(compiled)
    assert spec.clients("ucq") == [("orders", 0), ("orders", 1), ("customers", 0), ("customers", 1), ("products", 0)]
    orders = pd.read_csv(shop / "orders.csv")
    eu, us = shard_rows(spec.table("orders"), orders)
    assert (orders.region[eu] == "eu").all() and len(eu) + len(us) == len(orders)


def test_union_all_of_some_shard_values_holds_their_rows_only_in_either_scenario(shop):
    """A UNION ALL picking some values of a column (here one of the two products' halves) is the union of those
    rows: the owner keeps them (a where), over the join as over the union; no other row trains."""
    branch = SHOP_SQL + " WHERE p.sku = {}"
    compiled = compile_sql(shop_sql(" UNION ALL ".join(branch.format(v) for v in (1, 3))), base_dir=shop)
    assert compiled["tables"]["products"]["where"] == "sku IN (1, 3)"
    assert compiled["tables"]["products"]["shards"] == {"by": "sku", "values": ["1", "3"]}
    relation = load_relation(compiled, SECRET, base_dir=shop, verbose=False)
    orders = pd.read_csv(shop / "orders.csv")
    assert int(orders.sku.isin([1, 3]).sum()) == relation.mapping.N
    spec = parse_spec(compiled)
    _, own = load_table(compiled, "products", base_dir=shop)
    assert [len(r) for r in shard_rows(spec.table("products"), own)] == [1, 1]


def test_a_union_all_run_without_scenario_ucq_says_it_trains_the_join(shop):
    """The union's shards apply under scenario=ucq: a run in the join scenario says in one line that it trains
    over the join of the union's rows (the same model), instead of dropping the shards silently."""
    branch = SHOP_SQL + " WHERE o.region = '{}'"
    sql = " UNION ALL ".join(branch.format(r) for r in ("eu", "us"))
    for scenario, said in (("join", 1), ("ucq", 0)):
        cfg = OmegaConf.create({"dataset": shop_sql(sql), "scenario": {"name": scenario}})
        lines: list[str] = []
        compile_run_query(cfg, base_dir=shop, log=lines.append)
        notes = [line for line in lines if line.startswith("note:")]
        assert len(notes) == said
    assert notes == [] and lines[0].startswith("query: ")
    cfg = OmegaConf.create({"dataset": shop_sql(sql), "scenario": {"name": "join"}})
    lines = []
    compile_run_query(cfg, base_dir=shop, log=lines.append)
    assert lines[-1] == (
        "note: the query's UNION ALL splits table 'orders' by region into shards, which apply under scenario=ucq; "
        "this run (scenario=join) trains over the join of the union's rows, whole (the same model)"
    )


def test_run_prints_the_normalized_query_first_and_trains_on_its_spec():
    cfg = OmegaConf.create({"dataset": yaml("sql")})
    lines: list[str] = []
    compile_run_query(cfg, log=lines.append)
    assert lines == [
        "query: SELECT r.rating AS label, r.rating_year, r.rating_month, r.rating_hour, r.rating_weekday, m.year, "
        "m.genre, u.user FROM ratings AS r JOIN movies AS m USING (movieId) JOIN users AS u USING (userId)"
    ]
    assert "sql" not in cfg.dataset and parse_spec(cfg.dataset).joins == parse_spec(yaml("movielens")).joins


# ---------------------------------------------------------------------------------------------- refusals

COLUMNS = {
    "orders": {"oid": "numeric", "cust": "categorical", "sku": "categorical", "qty": "numeric", "spend": "numeric"}
    | {"region": "categorical", "day": "datetime64[ns]"},
    "customers": {"cust": "categorical", "age": "numeric", "segment": "categorical", "region": "categorical"},
    "products": {"sku": "categorical", "price": "numeric"},
}
BASE = "SELECT o.spend AS label, o.qty, c.age FROM orders o JOIN customers c ON o.cust = c.cust"
POSITION = r"SQL line \d+, column \d+: "


def refused(sql: str) -> str:
    with pytest.raises(QueryError) as info:
        compile_query(sql, COLUMNS, {"name": "shop"})
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "sql,expected",
    [
        (BASE + " WHERE o.qty < c.age", POSITION + "a predicate across tables must be an equality of two columns"),
        (
            BASE.replace("o.cust = c.cust", "o.qty + c.age = 3"),
            POSITION + "a predicate across tables must be an equality",
        ),
        (BASE + " WHERE o.qty > 1 OR c.age > 30", POSITION + "OR across tables is not supported"),
        ("SELECT SUM(o.spend) AS label FROM orders o", POSITION + r"aggregates are not supported .*: SUM\(o.spend\)"),
        (BASE + " GROUP BY o.qty", POSITION + "GROUP BY is not supported"),
        ("SELECT s.spend AS label FROM (SELECT * FROM orders) s", POSITION + "subqueries are not supported"),
        (BASE + " WHERE o.cust IN (SELECT cust FROM customers)", POSITION + "subqueries are not supported"),
        ("WITH s AS (SELECT * FROM orders) SELECT s.spend AS label FROM s", POSITION + "a WITH clause"),
        (BASE.replace(" JOIN ", " LEFT JOIN "), POSITION + "LEFT OUTER JOIN is not supported"),
        (BASE.replace(" JOIN ", " FULL OUTER JOIN "), POSITION + "FULL OUTER JOIN is not supported"),
        (
            BASE + " JOIN products p ON o.sku = p.sku AND p.sku = c.segment",
            POSITION + "the join graph has a cycle: tables 'customers' and 'products'",
        ),
        (BASE + " UNION " + BASE, POSITION + r"UNION \(distinct\) is not supported; write UNION ALL"),
        (BASE + " INTERSECT " + BASE, POSITION + "INTERSECT is not supported"),
        (BASE + " JOIN stores s ON o.oid = s.oid", POSITION + "unknown table 'stores'"),
        ("SELECT o.nope AS label FROM orders o", POSITION + "unknown column 'nope' of table 'orders': o.nope"),
        # a column's name is matched as its file writes it: one that differs only in case is named
        (
            "SELECT o.Spend AS label FROM orders o",
            POSITION + r"unknown column 'Spend' of table 'orders' \(did you mean 'spend'\?\)",
        ),
        (
            BASE.replace("o.qty", "QTY"),
            POSITION + r"unknown column 'QTY': no table of the query has it \(did you mean 'qty'\?\)",
        ),
        (
            BASE.replace("ON o.cust = c.cust", "USING (Cust)"),
            POSITION + r"USING column 'Cust' is not a column of table 'customers' \(did you mean 'cust'\?\)",
        ),
        (
            BASE.replace("o.qty,", "qty, region,"),
            POSITION + r"ambiguous column 'region': tables \['orders', 'customers'\]",
        ),
        (
            "SELECT o.spend AS label, c.age FROM orders o, customers c",
            POSITION + r"table\(s\) \['customers'\] are not joined",
        ),
        (BASE.replace("o.qty", "o.qty * 2"), POSITION + "computed columns are not supported"),
        (BASE.replace("o.qty", "o.qty AS amount"), POSITION + "an alias other than AS label"),
        (BASE + " JOIN orders o2 ON o.oid = o2.oid", POSITION + "table 'orders' appears twice"),
        (BASE.replace(" JOIN ", " NATURAL JOIN ").split(" ON ")[0], POSITION + "NATURAL JOIN is not supported"),
        (BASE.replace("o.qty", "o.day"), "column orders.day has dtype datetime64"),
        ("SELECT o.qty FROM orders o", "no label"),
        ("SELECT o.spend AS label FROM orders o; SELECT 1", "one query expected"),
        ("SELECT FROM WHERE", "SQL does not parse"),
    ],
)
def test_refusals_name_the_construct_and_its_position(sql, expected):
    assert re.search(expected, refused(sql)), refused(sql)


REGIONS = COLUMNS | {"regions": {"region": "categorical", "tax": "numeric"}}


def test_using_a_key_earlier_using_made_one_column_joins_the_first_table():
    """SQL's ``a JOIN b USING (k) JOIN c USING (k)``: k is one column of a and b's join, so c joins a (the
    first holder), as a snowflake's shared key is written; the edges form a tree."""
    sql = (
        "SELECT o.spend AS label, o.qty, r.tax FROM orders o JOIN customers c USING (cust, region) "
        "JOIN regions r USING (region)"
    )
    spec = compile_query(sql, REGIONS, {"name": "shop"})
    assert spec["joins"] == [
        {"left": "orders", "right": "customers", "on": [["cust", "cust"], ["region", "region"]]},
        {"left": "orders", "right": "regions", "on": [["region", "region"]]},
    ]


def test_using_a_key_two_earlier_tables_hold_apart_is_refused_at_the_using_column():
    sql = "SELECT o.spend AS label, r.tax FROM orders o JOIN customers c USING (cust)\nJOIN regions r USING (region)"
    with pytest.raises(QueryError) as info:
        compile_query(sql, REGIONS, {"name": "shop"})
    assert str(info.value).startswith(
        "SQL line 2, column 23: USING column 'region' is ambiguous: tables ['orders', 'customers'] joined before "
        "it have it and no earlier USING (region) makes it one column; join with ON and qualified columns"
    )


def test_refusal_position_is_the_constructs_own():
    message = refused(BASE + "\nWHERE o.qty > 1 OR c.age > 30")
    assert message.startswith("SQL line 2, column 7: OR across tables")


@pytest.mark.parametrize(
    "branches,expected",
    [
        ([("eu", "eu"), ("us", "us")], r"miss the shard combinations \[\('eu', 'us'\), \('us', 'eu'\)\]"),
        ([("eu", "eu"), ("eu", "eu")], "pick the same shards"),
    ],
)
def test_union_all_refusals(branches, expected):
    branch = BASE + " WHERE o.region = '{}' AND c.region = '{}'"
    assert re.search(expected, refused(" UNION ALL ".join(branch.format(a, b) for a, b in branches)))


def test_union_all_branches_must_select_alike():
    sql = BASE + " WHERE o.region = 'eu' UNION ALL " + BASE.replace("c.age", "c.segment") + " WHERE o.region = 'us'"
    assert re.search(POSITION + "UNION ALL branch 2 selects or joins differently", refused(sql))


def test_union_keyword_position():
    assert refused(BASE + " UNION " + BASE).startswith(f"SQL line 1, column {len(BASE) + 2}: UNION (distinct)")


def test_compiled_yaml_is_the_spec_a_deployment_takes(tmp_path):
    text = compiled_yaml(["dataset=sql"])
    assert text.startswith("# query: SELECT r.rating AS label")
    assert parse_spec(OmegaConf.create(text)) == parse_spec({**yaml("movielens"), "name": "sql"})
    with pytest.raises(SpecError, match="is a SQL query: compile it into a dataset spec first"):
        load_spec(yaml("sql"))


def test_the_owner_decides_its_rows_a_run_cannot_filter_them_otherwise(shop):
    """The curious server submits a run whose query picks a few rows of an owner's table: the node refuses."""
    cfg = {"dataset": compile_sql(shop_sql(SHOP_SQL), base_dir=shop), "privacy": {"name": "none"}, "seed": 0}
    owner = simulation_owner(cfg, parse_spec(cfg["dataset"]), "customers", shop)
    assert owner.where is None
    narrowed = compile_sql(shop_sql(SHOP_SQL + " WHERE c.cust = 7"), base_dir=shop)
    with pytest.raises(
        Refusal, match=r"table 'customers' refuses the run: the run filters its rows with where 'cust = 7'"
    ):
        owner.check_spec(parse_spec(narrowed), narrowed, shop)
    settings = shop / "customers.yaml"
    settings.write_text(
        f"source: {shop / 'customers.csv'}\nwhere: \"segment IN ('a', 'b')\"\n"
        "columns: {keys: [cust], numeric: [age], categorical: [segment]}\n"
        f"secret_file: {shop / 'key'}\n"
    )
    (shop / "key").write_text("k" * 64)
    node = load_owner_settings(settings, "customers")
    own = compile_sql(shop_sql(SHOP_SQL + " WHERE c.segment IN ('a', 'b')"), base_dir=shop)
    node.check_spec(parse_spec(own), own, shop)  # the owner's own filter: accepted
    with pytest.raises(Refusal, match="this node serves the rows where"):
        node.check_spec(parse_spec(cfg["dataset"]), cfg["dataset"], shop)


def test_implicit_join_in_where_is_the_same_join():
    implicit = "SELECT o.spend AS label, o.qty, c.age FROM orders o, customers c WHERE c.cust = o.cust AND o.qty > 1"
    explicit = BASE + " WHERE o.qty > 1"
    assert (
        compile_query(implicit, COLUMNS, {"name": "shop"})["joins"]
        == compile_query(explicit, COLUMNS, {"name": "shop"})["joins"]
        == [{"left": "orders", "right": "customers", "on": [["cust", "cust"]]}]
    )


def test_a_datasets_tables_are_a_catalogue_the_query_picks_from():
    """A dataset spec's tables and features, queried by SQL (tpflower.fit(dataset=..., sql=...)): the tables the
    query does not use are left out and the declared features it does not select are no features, each said in a
    warning note; a declared role of a selected column still holds."""
    tables = {
        "orders": {"source": "o.csv", "numeric": ["qty", "oid"], "categorical": ["region"]},
        "customers": {"source": "c.csv", "categorical": ["age"]},
        "products": {"source": "p.csv", "numeric": ["price"]},
    }
    compiled = compile_query(BASE, COLUMNS, {"name": "shop", "tables": tables})
    assert list(compiled["tables"]) == ["orders", "customers"]
    assert compiled["tables"]["orders"]["numeric"] == ["qty"] and compiled["tables"]["customers"]["categorical"] == [
        "age"
    ]
    assert compiled["notes"] == [
        "SQL: dataset.tables declares ['products'], which the query does not use: left out of the run",
        "SQL: dataset.tables.orders.numeric names ['oid'], which the query does not select: no feature",
        "SQL: dataset.tables.orders.categorical names ['region'], which the query does not select: no feature",
    ]
    assert "notes" not in compile_query(BASE, COLUMNS, {"name": "shop"})


def test_label_from_the_config_is_not_a_feature():
    cfg = {"name": "shop", "label": {"column": "spend", "task": "regression"}}
    compiled = compile_query("SELECT o.spend, o.qty, c.age " + BASE.split(" c.age ")[1], COLUMNS, cfg)
    assert compiled["label"] == {"table": "orders", "column": "spend", "task": "regression"}
    assert compiled["tables"]["orders"]["numeric"] == ["qty"]
    with pytest.raises(QueryError, match="label column 'region' is in tables"):
        compile_query(BASE.replace("o.spend AS label", "o.spend"), COLUMNS, {"label": {"column": "region"}})
    declared = {"label": {"task": "multiclass", "classes": ["eu", "us"]}}  # the label's classes pass through
    compiled = compile_query(BASE.replace("o.spend AS label", "o.region AS label"), COLUMNS, declared)
    assert compiled["label"] == {"table": "orders", "column": "region", "task": "multiclass", "classes": ["eu", "us"]}


def test_union_all_of_tables_joined_on_their_shard_column_takes_one_value_per_branch():
    base = BASE.replace("o.cust = c.cust", "o.cust = c.cust AND o.region = c.region")
    branch = base + " WHERE o.region = '{}' AND c.region = '{}'"
    compiled = compile_query(" UNION ALL ".join(branch.format(v, v) for v in ("us", "eu")), COLUMNS, {"name": "s"})
    assert compiled["tables"]["customers"]["shards"] == {"by": "region", "values": ["us", "eu"]}
    mixed = " UNION ALL ".join(branch.format(a, b) for a, b in (("eu", "eu"), ("us", "us"), ("eu", "us")))
    assert re.search(POSITION + "UNION ALL branch 3 is empty: 'customers' and 'orders' are joined", refused(mixed))


def test_unknown_table_lists_the_loaders_tables_and_quoted_columns_stay_quoted():
    with pytest.raises(QueryError, match=r"unknown table 'stores'; the tables are \['movies', 'ratings', 'users'\]"):
        compile_sql({**yaml("sql"), "sql": "SELECT s.x AS label FROM stores s"})
    columns = {"t": {"my col": "numeric", "y": "numeric"}}
    compiled = compile_query('SELECT t.y AS label FROM t WHERE t."my col" > 1', columns, {})
    assert compiled["tables"]["t"]["where"] == '"my col" > 1'
    assert row_mask("t", pd.DataFrame({"my col": [0, 2]}), compiled["tables"]["t"]["where"]).tolist() == [False, True]
    assert re.search(POSITION + "unknown table or alias 'x'", refused("SELECT o.spend AS label, x.* FROM orders o"))


@pytest.mark.slow
def test_a_run_on_the_query_trains_as_the_run_on_its_yaml(tmp_path, capsys):
    results = {}
    for name in ("sql", "movielens"):
        cfg = compose_config(f"dataset={name}", "epochs=1", "runtime=inprocess", "algorithm=sgd")
        results[name] = run_job(cfg, tmp_path / name)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("query: SELECT r.rating AS label")
    assert results["sql"].history[-1].test_metric == results["movielens"].history[-1].test_metric


def test_roles_by_dtype_with_casts_and_table_overrides():
    sql = "SELECT o.spend AS label, o.qty, CAST(o.oid AS CATEGORY), CAST(o.region AS DOUBLE), c.age, c.segment " + (
        "FROM orders o JOIN customers c USING (cust)"
    )
    cfg = {"tables": {"orders": {"region": "us-east"}, "customers": {"categorical": ["age"]}}}
    tables = compile_query(sql, COLUMNS, cfg)["tables"]
    assert tables["orders"] == {"region": "us-east", "numeric": ["qty", "region"], "categorical": ["oid"]}
    assert tables["customers"] == {"numeric": [], "categorical": ["age", "segment"]}
    unselected = compile_query(sql, COLUMNS, {"tables": {"customers": {"numeric": ["region"]}}})
    assert unselected["notes"] == [
        "SQL: dataset.tables.customers.numeric names ['region'], which the query does not select: no feature"
    ]
    with pytest.raises(QueryError, match="a CAST must be to CATEGORY"):
        compile_query(sql.replace("AS DOUBLE", "AS DATE"), COLUMNS, {})


def test_a_boolean_column_with_blanks_is_numeric_as_a_complete_one(shop):
    """pandas reads True, (blank), False as object, a complete True/False column as bool: the query takes both
    as numeric columns (tpflower.datasets.files.booleans_as_flags), never the first as text."""
    customers = pd.read_csv(shop / "customers.csv")
    vip = np.arange(20) % 3 == 0
    customers.assign(vip=vip, churned=pd.Series(vip, dtype=object).where(np.arange(20) % 5 > 0)).to_csv(
        shop / "customers.csv", index=False
    )
    sql = SHOP_SQL.replace("c.segment", "c.vip, c.churned")
    assert compile_sql(shop_sql(sql), base_dir=shop)["tables"]["customers"]["numeric"] == ["age", "vip", "churned"]


def test_the_sql_command_says_an_unknown_dataset_or_key_in_one_line(capsys):
    from simulations.sql import main

    assert main(["dataset=nosuch"]) == 1
    assert capsys.readouterr().err.startswith("error: dataset=nosuch: no such dataset; choose one of movielens")
    assert main(["dataset=movielens", 'dataset.sql="SELECT 1"']) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: dataset.sql is not a setting of dataset") and "+dataset.sql=... adds it" in err
    assert len(err.strip().splitlines()) == 1


def test_the_sql_commands_help_is_its_whole_first_paragraph_and_a_spec_without_a_query_says_how_to_give_one(capsys):
    """`tpflower sql --help` showed the docstring's first line alone ('... for review by the table owners and for
    a'); `tpflower sql` on a dataset without a query (the default, movielens) named no way to give one."""
    from simulations.sql import main as sql_main

    with pytest.raises(SystemExit):
        sql_main(["--help"], prog="tpflower sql")
    helped = " ".join(capsys.readouterr().out.split())
    assert "for review by the table owners and for a deployment, whose nodes take a plain dataset spec." in helped
    assert sql_main([]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: dataset 'movielens' has no sql: it is a dataset spec already; give a dataset that holds a query "
        '(dataset=sql, dataset=nycflights13_sql), or the query: +dataset.sql="SELECT ..."'
    )


def test_an_unknown_table_of_a_catalogue_lists_its_declared_tables_and_the_closest(shop):
    """A catalogue's tables the query names not are left unread: the refusal listed the query's own tables
    alone ("unknown table 'customer'; the tables are ['orders']"); now every declared one, and the closest."""
    query = "SELECT o.spend AS label, o.qty, c.age FROM orders o JOIN customer c USING (cust)"
    with pytest.raises(QueryError) as err:
        compile_sql({**SHOP_YAML, "sql": query}, base_dir=shop)
    assert (
        "unknown table 'customer' (did you mean 'customers'?); the tables are ['customers', 'orders', 'products']"
        in str(err.value)
    ), err.value
