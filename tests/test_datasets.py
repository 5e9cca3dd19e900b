"""Dataset loaders, dataset YAMLs, load_dataset and shard_rows (tpflower.datasets)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from tpflower.datasets import LOADERS, load_dataset, movielens, movielens1m, nycflights13, shard_rows, synthetic
from tpflower.datasets.files import read_rows_file
from tpflower.schema import ShardSpec, SpecError, TableSpec

CONF = Path(__file__).parents[1] / "conf" / "dataset"


def conf(name: str):
    return OmegaConf.load(CONF / f"{name}.yaml")


def assert_range_index(frames: dict[str, pd.DataFrame]) -> None:
    for name, frame in frames.items():
        assert isinstance(frame.index, pd.RangeIndex) and frame.index.start == 0, name
        assert frame.index.stop == len(frame), name


def materialize(spec, frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The join with every table's columns prefixed by its name (for checks on small data only)."""
    out = frames[spec.label_table].add_prefix(f"{spec.label_table}.")
    for join, known, new in spec.join_order():
        on = [(c, d) if known == join.left else (d, c) for c, d in join.on]
        out = out.merge(
            frames[new].add_prefix(f"{new}."),
            left_on=[f"{known}.{k}" for k, _ in on],
            right_on=[f"{new}.{n}" for _, n in on],
        )
    return out


# ------------------------------------------------------------------------------------------- movielens


@pytest.fixture(scope="module")
def movielens_data():
    return load_dataset(conf("movielens"))


def test_movielens_tables(movielens_data):
    spec, frames = movielens_data
    assert set(frames) == {"ratings", "movies", "users"}
    ratings, movies, users = frames["ratings"], frames["movies"], frames["users"]
    assert len(ratings) == 100_004
    assert {"userId", "movieId", "rating", "rating_year", "rating_month", "rating_hour", "rating_weekday"} <= set(
        ratings.columns
    )
    assert ratings["rating_month"].between(1, 12).all() and ratings["rating_weekday"].between(0, 6).all()
    assert list(movies.columns) == ["movieId", "genre", "year"]
    assert len(movies) > movies["movieId"].nunique() == ratings["movieId"].nunique()
    assert not movies.duplicated(["movieId", "genre"]).any()
    assert users["userId"].is_unique and len(users) == ratings["userId"].nunique()
    assert (users["user"] == users["userId"].astype(str)).all()
    assert_range_index(frames)
    assert spec.label.table == "ratings" and spec.label.task == "regression"
    assert {t.name: t.region for t in spec.tables} == {"ratings": "us-east", "movies": "us-west", "users": "eu"}
    # many-to-many: a rating joins once per genre of its movie
    per_movie = movies.groupby("movieId").size()
    assert int(per_movie.reindex(ratings["movieId"]).sum()) > len(ratings)


def test_movielens_split_and_shards(movielens_data):
    spec, frames = movielens_data
    assert (spec.split.test_fraction, spec.split.seed) == (0.15, 42)
    for name in ("ratings", "users"):
        table = spec.table(name)
        assert table.shards == ShardSpec(parts=2, seed=0)
        parts = shard_rows(table, frames[name])
        assert len(parts) == 2 and abs(len(parts[0]) - len(parts[1])) <= 1
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(frames[name])))


# ---------------------------------------------------------------------------------------- nycflights13


@pytest.fixture(scope="module")
def flights_frames():
    return nycflights13.load()


def test_nycflights13_loader(flights_frames):
    frames = flights_frames
    assert set(frames) == {"flights", "planes", "airports", "weather", "airlines"}
    flights = frames["flights"]
    assert flights["arr_delay"].notna().all() and flights["tailnum"].notna().all()
    assert len(flights) == 327_346
    assert flights["delayed"].dtype == np.int64
    assert np.array_equal(flights["delayed"].to_numpy(), (flights["arr_delay"] > 15).to_numpy().astype(int))
    assert all("rownames" not in f.columns for f in frames.values())
    assert frames["planes"]["tailnum"].is_unique and frames["airports"]["faa"].is_unique
    assert frames["airlines"]["carrier"].is_unique
    assert_range_index(frames)


@pytest.mark.parametrize(
    "name, label, task", [("nycflights13", "arr_delay", "regression"), ("nycflights13_delayed", "delayed", "binary")]
)
def test_nycflights13_yaml(monkeypatch, flights_frames, name, label, task):
    monkeypatch.setitem(LOADERS, "nycflights13", lambda: flights_frames)  # load the CSVs once per module
    spec, frames = load_dataset(conf(name))
    assert (spec.label.table, spec.label.column, spec.label.task) == ("flights", label, task)
    leaks = {"arr_delay", "arr_time", "air_time", "delayed"}
    assert not leaks & set(spec.table("flights").features)
    assert set(spec.table("flights").numeric) >= {"dep_delay", "sched_dep_time", "distance", "month", "day", "hour"}
    weather = [j for j in spec.joins if "weather" in (j.left, j.right)][0]
    assert weather.on == (("origin", "origin"), ("time_hour", "time_hour"))
    airports = [j for j in spec.joins if "airports" in (j.left, j.right)][0]
    assert airports.on == (("dest", "faa"),)
    if task == "binary":
        assert set(np.unique(frames["flights"]["delayed"])) == {0, 1}
    for table in ("flights", "weather"):
        parts = shard_rows(spec.table(table), frames[table])
        assert len(parts) == 3  # EWR, JFK, LGA in sorted order
        assert (frames[table]["origin"].to_numpy()[parts[0]] == "EWR").all()
        assert sum(map(len, parts)) == len(frames[table])


# ------------------------------------------------------------------------------------------- synthetic


def test_synthetic_yaml_is_a_many_to_many_snowflake():
    spec, frames = load_dataset(conf("synthetic"))
    assert spec.table_names == ("fact", "d1", "d2", "d3")
    assert {(j.left, j.right) for j in spec.joins} == {("fact", "d1"), ("fact", "d2"), ("d1", "d3")}
    assert len(frames["fact"]) == 2000 and len(frames["d1"]) == 2 * 200
    assert frames["d1"].groupby("k1").size().eq(2).all()
    assert len(materialize(spec, frames)) == 2000 * 2 * 2 * 2
    assert_range_index(frames)


@pytest.mark.parametrize(
    "schema, joins",
    [
        ("star", {("fact", "d1"), ("fact", "d2"), ("fact", "d3")}),
        ("chain", {("fact", "d1"), ("d1", "d2"), ("d2", "d3")}),
        ("snowflake", {("fact", "d1"), ("fact", "d2"), ("d1", "d3")}),
    ],
)
def test_synthetic_schemas_plant_a_linear_label(schema, joins):
    kw = dict(schema=schema, n_fact=500, dim_rows=[20, 30, 40], widths=[2, 3, 4, 5], noise=0.0, seed=3)
    cfg = {"name": "s", "loader": {"name": "synthetic", **kw}}
    spec, frames = load_dataset(cfg)
    assert {(j.left, j.right) for j in spec.joins} == joins
    assert [len(frames[t]) for t in spec.table_names] == [500, 20, 30, 40]
    assert [len(spec.table(t).numeric) for t in spec.table_names] == [2, 3, 4, 5]
    # keys in the narrowest signed integer dtype (int8 for up to 128 values), features float32
    assert all(frames[t][c].dtype == np.int8 for t in spec.table_names for c in spec.key_columns(t))
    assert all(frames[t][c].dtype == np.float32 for t in spec.table_names for c in spec.table(t).numeric)
    joined = materialize(spec, frames)
    assert len(joined) == 500  # fanout 1: every fact row joins exactly one row per dimension
    x = joined[[f"{t}.{c}" for t in spec.table_names for c in spec.table(t).numeric]].to_numpy()
    y = joined["fact.y"].to_numpy()
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert np.allclose(x @ coef, y, atol=1e-9)  # y is a sum of per-table linear models of the joined row


def test_synthetic_composite_and_many_to_many():
    kw = dict(schema="star", n_fact=300, dim_rows=50, n_dims=2, widths=1, fanout=3, composite=True)
    spec, frames = load_dataset({"name": "s", "loader": {"name": "synthetic", **kw}})
    assert all(len(j.on) == 2 for j in spec.joins)
    assert {"k1_a", "k1_b", "k2_a", "k2_b"} <= set(frames["fact"].columns)
    assert len(frames["d1"]) == 150 and frames["d1"].groupby(["k1_a", "k1_b"]).size().eq(3).all()
    assert len(materialize(spec, frames)) == 300 * 3 * 3


def test_synthetic_tasks_and_determinism():
    binary = synthetic.generate(n_fact=2000, task="binary", seed=1)["fact"]["y"]
    assert set(np.unique(binary)) == {0, 1} and 0.2 < binary.mean() < 0.8
    multi = synthetic.generate(n_fact=2000, task="multiclass", n_classes=4, label="nonlinear")["fact"]["y"]
    assert set(np.unique(multi)) == {0, 1, 2, 3}
    a, b = synthetic.generate(seed=5), synthetic.generate(seed=5)
    assert all(a[t].equals(b[t]) for t in a)
    assert not a["fact"].equals(synthetic.generate(seed=6)["fact"])
    # dimensions do not depend on the fact size
    assert a["d2"].equals(synthetic.generate(seed=5, n_fact=77)["d2"])
    with pytest.raises(SpecError, match="schema"):
        synthetic.generate(schema="galaxy")


def _teacher_on_join(spec, frames, seed: int, d_c: int) -> np.ndarray:
    """The interaction teacher computed directly on the materialized join (float64): per joined row, each table's
    tanh(x A_t) B_t times the switches 2 * 1[x > 0] on the path from the fact table to it, summed over the
    tables, then averaged over each fact row's joined rows."""
    names = spec.table_names
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(len(names) + 2)[-2])
    fact = frames["fact"].assign(rid=np.arange(len(frames["fact"])))
    joined = materialize(spec, {**frames, "fact": fact})
    parent = {j.right: j.left for j in spec.joins}
    total = np.zeros((len(joined), d_c))
    for t in names:
        cols = [f"{t}.{c}" for c in spec.table(t).numeric]
        if not cols:
            continue
        a = rng.standard_normal((len(cols), synthetic.HIDDEN)) * (2.0 / np.sqrt(len(cols)))
        b = rng.standard_normal((synthetic.HIDDEN, d_c)) / np.sqrt(synthetic.HIDDEN)
        score = np.tanh(joined[cols].to_numpy(np.float64) @ a) @ b
        child = t
        while child in parent:  # the switches on the path: the j-th child of p is switched by p's x_{j mod width}
            p = parent[child]
            kids = sorted((j.right for j in spec.joins if j.left == p), key=names.index)
            p_cols = spec.table(p).numeric
            if p_cols:
                x = joined[f"{p}.{p_cols[kids.index(child) % len(p_cols)]}"].to_numpy(np.float64)
                score = score * np.where(x > 0, 2.0, 0.0)[:, None]
            child = p
        total += score
    return pd.DataFrame(total).groupby(joined["fact.rid"].to_numpy()).mean().sort_index().to_numpy()


def test_synthetic_interaction_label_equals_the_teacher_on_the_join():
    """label=interaction on a many-to-many snowflake (switches on two levels, a parent without columns): the
    generator's key-mean push-up equals the teacher computed on the materialized join, in float64."""
    kw = dict(schema="snowflake", n_fact=300, dim_rows=[7, 5, 6, 4], n_dims=4, widths=[2, 1, 0, 2, 3], fanout=2)
    cfg = {"name": "s", "loader": {"name": "synthetic", **kw, "label": "interaction", "noise": 0.0, "seed": 4}}
    spec, frames = load_dataset(cfg)
    assert {(j.left, j.right) for j in spec.joins} == {("fact", "d1"), ("fact", "d2"), ("d1", "d3"), ("d2", "d4")}
    direct = _teacher_on_join(spec, frames, seed=4, d_c=1)[:, 0]
    np.testing.assert_allclose(frames["fact"]["y"].to_numpy(), direct, rtol=0, atol=1e-9)
    assert np.std(direct) > 0.5
    # the switches matter: the nonlinear label (same tables, same teacher weights) differs
    nonlinear = synthetic.generate(**kw, label="nonlinear", noise=0.0, seed=4)["fact"]["y"].to_numpy()
    assert np.abs(nonlinear - direct).max() > 0.5
    multi = synthetic.generate(**kw, label="interaction", noise=0.0, seed=4, task="multiclass", n_classes=3)
    d_c3 = _teacher_on_join(spec, frames, seed=4, d_c=3)
    assert np.array_equal(multi["fact"]["y"].to_numpy(), d_c3.argmax(1))
    assert all(multi[t].equals(frames[t]) for t in ("d1", "d2", "d3", "d4"))


def test_synthetic_interaction_label_is_deterministic_per_seed():
    kw = dict(schema="star", n_fact=2000, dim_rows=30, label="interaction", noise=0.5)
    a, b = synthetic.generate(**kw, seed=7), synthetic.generate(**kw, seed=7)
    assert all(a[t].equals(b[t]) for t in a)
    c = synthetic.generate(**kw, seed=8)["fact"]["y"]
    assert not np.allclose(a["fact"]["y"], c)
    binary = synthetic.generate(**kw, seed=7, task="binary")["fact"]["y"]
    assert set(np.unique(binary)) == {0, 1} and 0.2 < binary.mean() < 0.8
    with pytest.raises(SpecError, match="label must be one of"):
        synthetic.generate(label="interactions")


def test_synthetic_large_is_fast():
    start = time.perf_counter()
    frames = synthetic.generate(schema="star", n_fact=2_000_000, dim_rows=1000, n_dims=3, widths=2)
    assert len(frames["fact"]) == 2_000_000
    assert time.perf_counter() - start < 10.0  # 10M rows take a few seconds


# ---------------------------------------------------------------------------- load_dataset and shards


def write_user_tables(folder: Path) -> None:
    pd.DataFrame(
        {"id": [1, 2, 3, 4], "shop": ["a", "b", "a", "c"], "x": [0.5, 1.5, 2.0, 3.0], "target": [1.0, 2.0, 3.0, 4.0]}
    ).to_csv(folder / "orders.csv", index=False)
    (folder / "data").mkdir()
    pd.DataFrame({"shop": ["a", "b", "c"], "size": [10, 20, 30], "kind": ["x", "y", "x"]}).to_parquet(
        folder / "data" / "shops.parquet"
    )


def test_yaml_with_user_files(tmp_path):
    write_user_tables(tmp_path)
    (tmp_path / "mine.yaml").write_text(
        "name: mine\n"
        "tables:\n"
        "  orders: {source: orders.csv, numeric: [x], shards: {by: shop}}\n"
        "  shops: {source: data/shops.parquet, numeric: [size], categorical: [kind], region: eu}\n"
        "label: {column: target, task: regression}\n"
        "joins:\n"
        "  - {left: orders, right: shops, on: shop}\n"  # unquoted `on` (YAML reads it as True) is accepted
    )
    spec, frames = load_dataset(OmegaConf.load(tmp_path / "mine.yaml"), base_dir=tmp_path)
    assert spec.label.table == "orders" and spec.joins[0].on == (("shop", "shop"),)
    assert len(frames["orders"]) == 4 and len(frames["shops"]) == 3
    assert_range_index(frames)
    parts = shard_rows(spec.table("orders"), frames["orders"])
    assert [p.tolist() for p in parts] == [[0, 2], [1], [3]]


def test_zero_padded_csv_keys_are_text_and_join_as_written(tmp_path):
    """A CSV join key column holding a zero-padded code ("00501") is read as text, its zeros kept, in each file
    alone: two files of the same codes join (one with a letter code too); a column of plain numbers stays
    integer, whole numbers written as decimals too; "501" and "00501" are different keys (the data check says
    the kinds differ)."""
    (tmp_path / "sales.csv").write_text("zip,price\n00501,1.0\n00501,2.0\n0001A,3.0\n02134,4.0\n")
    (tmp_path / "areas.csv").write_text("zip,pop\n00501,10\n02134,20\n0001A,30\n")
    (tmp_path / "plain.csv").write_text("zip,pop\n501,10\n2134,20\n")
    cfg = {
        "name": "zips",
        "tables": {"sales": {"source": "sales.csv"}, "areas": {"source": "areas.csv", "numeric": ["pop"]}},
        "label": {"table": "sales", "column": "price"},
        "joins": [{"left": "sales", "right": "areas", "on": "zip"}],
    }
    spec, frames = load_dataset(cfg, base_dir=tmp_path)
    assert frames["areas"]["zip"].tolist() == ["00501", "02134", "0001A"] and frames["areas"]["pop"].dtype == np.int64
    assert frames["sales"]["zip"].tolist() == ["00501", "00501", "0001A", "02134"]
    (tmp_path / "decimals.csv").write_text("zip,pop\n501.0,10\n2134.0,20\n")  # a once-NaN column written back
    assert read_rows_file(tmp_path / "decimals.csv", ["zip"])["zip"].tolist() == [501, 2134]
    assert read_rows_file(tmp_path / "decimals.csv", ["zip"])["zip"].dtype == np.int64
    rows = read_rows_file(tmp_path / "sales.csv", ["zip"])  # a rows file to score: its keys read alike
    assert rows["zip"].tolist() == frames["sales"]["zip"].tolist()
    cfg["tables"]["areas"]["source"] = "plain.csv"
    with pytest.raises(SpecError, match="key dtype mismatch: sales.zip is string but areas.zip is integer"):
        load_dataset(cfg, base_dir=tmp_path)


def test_parquet_whole_float_keys_join_integer_keys(tmp_path):
    """A Parquet key column of whole numbers stored as floats (an integer column that once held a missing value)
    joins a CSV file's integer keys, as a CSV file's "1412.0" does; a Parquet key with a fraction stays float."""
    pd.DataFrame({"shop": [1.0, 2.0, 2.0, 3.0], "y": [1.0, 2.0, 3.0, 4.0]}).to_parquet(tmp_path / "orders.parquet")
    (tmp_path / "shops.csv").write_text("shop,size\n1,10\n2,20\n3,30\n")
    cfg = {
        "name": "pq",
        "tables": {"orders": {"source": "orders.parquet"}, "shops": {"source": "shops.csv", "numeric": ["size"]}},
        "label": {"table": "orders", "column": "y"},
        "joins": [{"left": "orders", "right": "shops", "on": "shop"}],
    }
    spec, frames = load_dataset(cfg, base_dir=tmp_path)
    assert frames["orders"]["shop"].dtype == np.int64 and frames["orders"]["shop"].tolist() == [1, 2, 2, 3]
    assert read_rows_file(tmp_path / "orders.parquet", ["shop"])["shop"].dtype == np.int64  # rows to score alike
    pd.DataFrame({"shop": [1.5, 2.0], "y": [1.0, 2.0]}).to_parquet(tmp_path / "orders.parquet")
    with pytest.raises(SpecError, match="key dtype mismatch: orders.shop is float but shops.shop is integer"):
        load_dataset(cfg, base_dir=tmp_path)


def test_blank_keys_a_where_drops_join_as_integers(tmp_path):
    """A CSV key column of whole numbers and blanks reads as float (1.0, ''); a `where` that drops the blank rows
    leaves the integers it held, which join an integer key column (was: refused as float against integer)."""
    (tmp_path / "stops.csv").write_text("precinct,race\n1,a\n,b\n2,a\n2,\n")
    (tmp_path / "precincts.csv").write_text("precinct,officers\n1,10\n2,20\n3,30\n")
    cfg = {
        "name": "blank_keys",
        "tables": {
            "stops": {"source": "stops.csv", "where": "precinct IS NOT NULL AND race IS NOT NULL"},
            "precincts": {"source": "precincts.csv", "numeric": ["officers"]},
        },
        "label": {"table": "stops", "column": "race", "task": "binary"},
        "joins": [{"left": "stops", "right": "precincts", "on": "precinct"}],
    }
    spec, frames = load_dataset(cfg, base_dir=tmp_path)
    assert frames["stops"]["precinct"].dtype == np.int64 and frames["stops"]["precinct"].tolist() == [1, 2]
    del cfg["tables"]["stops"]["where"]  # blank keys kept: refused as missing keys, naming the first one's line
    with pytest.raises(SpecError, match=r"key column .precinct.: 1 missing .* \(line 3 of stops.csv\)"):
        load_dataset(cfg, base_dir=tmp_path)


def test_source_overrides_loader_table(tmp_path):
    frames = synthetic.generate(n_fact=100, dim_rows=10, n_dims=1, widths=1)
    frames["d1"].iloc[::-1].set_index(pd.Index(range(100, 110))).to_csv(tmp_path / "d1.csv")
    cfg = {"name": "s", "loader": {"name": "synthetic", "n_fact": 100, "dim_rows": 10, "n_dims": 1, "widths": 1}}
    cfg["tables"] = {"fact": {"numeric": ["x0"]}, "d1": {"source": str(tmp_path / "d1.csv"), "numeric": ["x0"]}}
    spec, loaded = load_dataset(cfg)
    assert loaded["d1"]["k1"].tolist() == frames["d1"]["k1"].tolist()[::-1]
    assert "Unnamed: 0" in loaded["d1"].columns  # a source file's columns are kept as they are
    assert_range_index(loaded)


def test_missing_table_sources_name_the_table(tmp_path):
    write_user_tables(tmp_path)
    cfg = {
        "name": "mine",
        "tables": {"orders": {"source": "orders.csv", "numeric": ["x"]}, "shops": {"numeric": ["size"]}},
        "label": {"column": "target"},
        "joins": [{"left": "orders", "right": "shops", "on": "shop"}],
    }
    with pytest.raises(SpecError, match="'shops'"):
        load_dataset(cfg, base_dir=tmp_path)
    with pytest.raises(SpecError, match="'shops'.*movielens"):
        load_dataset({**cfg, "loader": {"name": "movielens"}}, base_dir=tmp_path)
    cfg["tables"]["shops"]["source"] = "nowhere.csv"
    with pytest.raises(SpecError, match="'shops'.*does not exist"):
        load_dataset(cfg, base_dir=tmp_path)
    with pytest.raises(SpecError, match="unknown dataset loader"):
        load_dataset({**cfg, "loader": {"name": "nope"}}, base_dir=tmp_path)


def test_validation_runs(tmp_path):
    write_user_tables(tmp_path)
    cfg = {
        "name": "mine",
        "tables": {
            "orders": {"source": "orders.csv", "numeric": ["x", "missing_col"]},
            "shops": {"source": "data/shops.parquet"},
        },
        "label": {"column": "target"},
        "joins": [{"left": "orders", "right": "shops", "on": "shop"}],
    }
    with pytest.raises(SpecError, match="'orders'.*'missing_col'"):
        load_dataset(cfg, base_dir=tmp_path)


def test_shard_rows_partitions():
    frame = pd.DataFrame({"c": ["b", "a", "c", "a", "b", "b", "c"]})
    by = shard_rows(TableSpec("t", shards=ShardSpec(by="c")), frame)
    assert [p.tolist() for p in by] == [[1, 3], [0, 4, 5], [2, 6]]
    parts = shard_rows(TableSpec("t", shards=ShardSpec(parts=3, seed=7)), pd.DataFrame({"c": range(100)}))
    assert sorted(map(len, parts)) == [33, 33, 34]
    assert all(np.all(np.diff(p) > 0) for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(100))
    again = shard_rows(TableSpec("t", shards=ShardSpec(parts=3, seed=7)), pd.DataFrame({"c": range(100)}))
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))
    assert [p.tolist() for p in shard_rows(TableSpec("t"), frame)] == [list(range(7))]
    with pytest.raises(SpecError, match="'t'.*'c'.*missing"):
        shard_rows(TableSpec("t", shards=ShardSpec(by="c")), pd.DataFrame({"c": ["a", None]}))
    with pytest.raises(SpecError, match="'t'"):
        shard_rows(TableSpec("t", shards=ShardSpec(parts=8)), frame)
    # a refusal travels to the server: it counts the rows outside the declared values, never shows one
    with pytest.raises(SpecError, match="'c': 5 rows hold a value that is not among") as refusal:
        shard_rows(TableSpec("t", shards=ShardSpec(by="c", values=("a",))), frame)
    assert "'b'" not in str(refusal.value)


# ----------------------------------------------------------------------------------------- movielens1m


def write_ml1m(folder: Path) -> None:
    (folder / "ratings.dat").write_text(
        "1::10::5::978300760\n1::20::3::978302109\n2::10::4::978301968\n3::30::1::978824291\n"
    )
    (folder / "movies.dat").write_bytes(
        "10::Toy Story (1995)::Animation|Children's|Comedy\n"
        "20::Star Wars: Episode IV - A New Hope (1977)::Action|Sci-Fi\n"
        "30::Amélie (2001)::Comedy\n".encode("latin-1")
    )
    (folder / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072\n3::M::25::15::55117-1234\n")


def test_movielens1m_from_files(tmp_path, monkeypatch):
    write_ml1m(tmp_path)
    frames = movielens1m.load(tmp_path)
    assert len(frames["ratings"]) == 4 and frames["ratings"]["rating"].tolist() == [5.0, 3.0, 4.0, 1.0]
    movies = frames["movies"]
    assert len(movies) == 6 and movies["genre"].tolist()[:3] == ["Animation", "Children's", "Comedy"]
    assert movies.loc[movies["movieId"] == 20, "title"].iloc[0] == "Star Wars: Episode IV - A New Hope (1977)"
    assert movies.loc[movies["movieId"] == 30, "title"].iloc[0] == "Amélie (2001)"
    assert movies.drop_duplicates("movieId")["year"].tolist() == [1995.0, 1977.0, 2001.0]
    users = frames["users"]
    assert users["age"].tolist() == [1, 56, 25] and users["zip"].tolist()[2] == "55117-1234"
    assert frames["ratings"]["userId"].dtype == users["userId"].dtype == np.int64

    monkeypatch.setenv("TPFLOWER_ML1M", str(tmp_path))
    spec, loaded = load_dataset(conf("movielens1m"))
    assert set(spec.table("users").categorical) == {"gender", "age", "occupation"}
    assert len(materialize(spec, loaded)) == 3 + 2 + 3 + 1
    with pytest.raises(SpecError, match="ratings.dat"):
        movielens1m.load(tmp_path / "absent")


def test_movielens_helpers():
    feats = movielens.timestamp_features(pd.Series([0, 86400 * 3 + 3600 * 5]))
    assert feats.iloc[1].tolist() == [1970, 1, 5, 6]  # 1970-01-04 05:00 UTC, a Sunday
    split = movielens.split_genres(pd.DataFrame({"movieId": [1, 2], "genres": ["A|B", None]}))
    assert split["genre"].tolist() == ["A", "B", "(no genres listed)"]


def test_registry():
    assert {"movielens", "movielens1m", "nycflights13", "synthetic"} <= set(LOADERS)
    assert all(callable(f) for f in LOADERS.values())


def test_synthetic_correlation_and_imbalance_knobs():
    """correlation c: a parent's feature k is c z + sqrt(1 - c^2) x with z its child's key-mean feature k, so
    the fact table's features correlate with the dimension rows they join (and 0 leaves the tables as before);
    imbalance: multiclass labels skew towards the first classes."""
    syn = synthetic
    plain = syn.generate("star", n_fact=4000, dim_rows=20, n_dims=1, fanout=1)
    zero = syn.generate("star", n_fact=4000, dim_rows=20, n_dims=1, fanout=1, correlation=0.0)
    pd.testing.assert_frame_equal(plain["fact"], zero["fact"])
    t = syn.generate("star", n_fact=4000, dim_rows=20, n_dims=1, fanout=1, correlation=0.9)
    dim = t["d1"].set_index("k1").loc[t["fact"]["k1"]]
    r = np.corrcoef(t["fact"]["x0"], dim["x0"].to_numpy())[0, 1]
    assert 0.85 < r < 0.95, r
    pd.testing.assert_frame_equal(
        t["d1"], syn.generate("star", 4000, 20, 1, fanout=1, correlation=0.9, tables=["d1"])["d1"]
    )
    y = syn.generate("star", 3000, 20, 1, task="multiclass", n_classes=5, imbalance=1.0)["fact"]["y"]
    counts = np.bincount(y, minlength=5)
    assert counts[0] > 2 * counts[4], counts


def test_a_shard_missing_a_class_codes_the_others_as_the_whole_table_does():
    """Multiclass labels are class ids in the sorted order of the whole table's classes: a shard whose rows lack
    the first class (here 'a') gives 'b' and 'c' the ids the other shard and the join give them."""
    from tpflower.local_table import ShardData, prepare_local_table
    from tpflower.schema import parse_spec

    spec = parse_spec(
        {
            "name": "s",
            "tables": {"t": {"numeric": ["x"], "shards": {"parts": 2}}, "d": {"numeric": ["z"]}},
            "label": {"table": "t", "column": "y", "task": "multiclass"},
            "joins": [{"left": "t", "right": "d", "on": "k"}],
        }
    )
    frame = pd.DataFrame({"k": [0, 1, 0, 1, 0], "x": np.arange(5.0), "y": ["b", "a", "c", "a", "b"]})
    whole = ShardData(spec, "t", frame)
    assert whole.y.tolist() == [1, 0, 2, 0, 1] and whole.n_classes == 3
    shard = ShardData(spec, "t", frame, np.array([0, 2, 4]))  # no 'a'
    assert shard.y.tolist() == [1, 2, 1] and shard.n_classes == 3
    local = prepare_local_table(spec, "t", frame, np.array([0, 2, 4]))
    assert local.y.tolist() == [1, 2, 1] and local.n_classes == 3


def test_shards_that_know_different_numbers_of_classes_are_refused(monkeypatch):
    """Shards whose own files hold different class lists would code classes differently: the server refuses the
    run in one line naming the label table (here one shard is made to count one class more)."""
    import tpflower.local_table as lt
    from simulations.federated import run_in_process
    from tpflower.config import compose_config

    encode, seen = lt.encode_labels, []

    def uneven(spec, values, rows=None):
        y, classes = encode(spec, values, rows)
        seen.append(rows is not None)
        return y, (classes + ["unseen"] if rows is not None and sum(seen) == 2 else classes)

    monkeypatch.setattr(lt, "encode_labels", uneven)
    cfg = compose_config("algorithm=admm", "dataset=synthetic", "dataset.loader.task=multiclass", "scenario=ucq")
    with pytest.raises(RuntimeError, match=r"label table 'fact': its shards' files hold different classes of the"):
        run_in_process(cfg, None, log=lambda _: None)  # (their keyed class lists differ: seen before the counts)
