"""End to end: mapping on the bundled datasets, the centralized baseline, user CSV files, results.json."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from simulations.run import run_job
from strategies.centralized import exact_ridge, predict
from tests.conftest import make_cfg as compose
from tests.mapping_reference import assert_mapping_equals_merge
from tpflower.datasets import load_dataset
from tpflower.relation import load_relation
from tpflower.schema import SpecError

SECRET = b"test-secret"


def central_cfg(*overrides: str, **kwargs):
    return compose("algorithm=centralized", *overrides, **kwargs)


@pytest.mark.parametrize("name", ["movielens", "nycflights13"])
def test_mapping_equals_pandas_merge_on_bundled_data(name):
    spec, frames = load_dataset(central_cfg(f"dataset={name}").dataset)
    m = assert_mapping_equals_merge(spec, frames)
    if name == "movielens":
        assert len(frames["ratings"]) < m.N  # many-to-many: one joined row per genre of the movie


def test_exact_ridge_equals_lstsq_on_materialized_join():
    rel = load_relation(central_cfg("dataset=synthetic").dataset, SECRET, verbose=False)
    beta = 1e-3
    w, b = exact_ridge(rel, beta)
    X = np.concatenate([rel.joined_features(rel.train), np.ones((rel.train.N, 1))], axis=1)
    y = rel.labels(rel.train)
    N, d = X.shape
    # ridge as an augmented least-squares problem: rows sqrt(N beta) I appended
    Xa = np.vstack([X, np.sqrt(N * beta) * np.eye(d)])
    ya = np.concatenate([y, np.zeros(d)])
    ref = np.linalg.lstsq(Xa, ya, rcond=None)[0]
    np.testing.assert_allclose(np.append(w, b), ref, rtol=1e-8, atol=1e-10)


def test_centralized_sgd_approaches_exact_solution(tmp_path):
    cfg = central_cfg("dataset=synthetic", "epochs=15", "precision=float64")
    sgd = run_job(cfg, tmp_path / "sgd")
    exact = run_job(central_cfg("dataset=synthetic", "algorithm.solver=exact"), tmp_path / "exact")
    assert sgd.history[-1].test_metric < 1.05 * exact.history[-1].test_metric
    assert sgd.history[-1].test_metric < 0.6 * sgd.reference["constant_rmse"]
    assert sgd.history[-1].train_loss < sgd.history[0].train_loss


def test_results_json_schema(tmp_path):
    run_job(central_cfg("dataset=synthetic", "epochs=2", "algorithm.min_steps=0"), tmp_path)
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["algorithm"] == "centralized" and r["scenario"] == "join" and r["metric"] == "rmse"
    assert r["n_joined"] > 0 and set(r["table_rows"]) == {"fact", "d1", "d2", "d3"}
    assert [h["epoch"] for h in r["history"]] == [1, 2]
    for key in ("test_metric", "train_loss", "rounds", "bytes_up", "bytes_down", "comm_time_s", "wall_time_s"):
        assert key in r["history"][0]
    assert r["privacy"] == {"label_epsilon": None, "feature_epsilon": None, "delta": None}
    assert r["config"]["dataset"]["name"] == "synthetic"


def write_user_tables(tmp_path) -> dict:
    """A small star schema as user CSV/Parquet files, and the dataset config that points at them."""
    rng = np.random.default_rng(0)
    n_cust, n_prod, n = 50, 30, 2000
    customers = pd.DataFrame(
        {
            "cust": [f"c{i}" for i in range(n_cust)],
            "age": rng.integers(18, 80, n_cust),
            "segment": rng.choice(["a", "b", "c"], n_cust),
        }
    )
    products = pd.DataFrame({"sku": np.arange(n_prod), "price": rng.gamma(2.0, 10.0, n_prod)})
    orders = pd.DataFrame(
        {"cust": rng.choice(customers["cust"], n), "sku": rng.integers(0, n_prod, n), "qty": rng.integers(1, 5, n)}
    )
    price = products.set_index("sku")["price"].reindex(orders["sku"]).to_numpy()
    orders["spend"] = orders["qty"] * price + rng.normal(0, 1, n)
    customers.to_csv(tmp_path / "customers.csv", index=False)
    products.to_parquet(tmp_path / "products.parquet")
    orders.to_csv(tmp_path / "orders.csv", index=False)
    return {
        "name": "shop",
        "tables": {
            "orders": {"source": str(tmp_path / "orders.csv"), "numeric": ["qty"]},
            "customers": {"source": "customers.csv", "numeric": ["age"], "categorical": ["segment"]},
            "products": {"source": str(tmp_path / "products.parquet"), "numeric": ["price"]},
        },
        "label": {"table": "orders", "column": "spend", "task": "regression"},
        "joins": [
            {"left": "orders", "right": "customers", "on": "cust"},
            {"left": "orders", "right": "products", "on": "sku"},
        ],
        "split": {"test_fraction": 0.2, "seed": 1},
    }


def test_user_csv_files_train_end_to_end(tmp_path, monkeypatch):
    dataset = write_user_tables(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative sources resolve against the working directory
    results = run_job(central_cfg("epochs=3", dataset=dataset), tmp_path / "run", base_dir=tmp_path)
    assert results.n_joined == 2000 and results.table_rows == {"orders": 2000, "customers": 50, "products": 30}
    assert results.history[-1].test_metric < 0.8 * results.reference["constant_rmse"]
    assert (tmp_path / "run" / "results.json").exists()


def test_a_small_join_trains_the_centralized_baseline_min_steps_as_sgd(tmp_path, monkeypatch):
    """A training join of 7 batches of 256: epochs=1 was 7 SGD steps, a baseline far below the federated SGD
    (which trains algorithm.min_steps=500 steps) on the same split; it trains ceil(500 / 7) epochs, in one
    line, as algorithm=sgd does; algorithm.min_steps=0 keeps exactly epochs."""
    dataset = write_user_tables(tmp_path)
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    short = run_job(
        central_cfg("epochs=1", "algorithm.min_steps=0", dataset=dataset), tmp_path / "a", base_dir=tmp_path
    )
    assert len(short.history) == 1
    long = run_job(central_cfg("epochs=1", dataset=dataset), tmp_path / "b", base_dir=tmp_path, log=lines.append)
    assert len(long.history) == 72  # 1,600 training rows: 7 steps per epoch
    assert any(line.startswith("epochs: 7 mini-batch step(s) per epoch (1,600 training rows") for line in lines)
    assert long.history[-1].test_metric < 0.7 * short.history[-1].test_metric


def test_bad_user_table_fails_before_training_and_keeps_old_results(tmp_path):
    dataset = write_user_tables(tmp_path)
    run_dir = tmp_path / "run"
    run_job(central_cfg("epochs=1", dataset=dataset), run_dir, base_dir=tmp_path)
    before = (run_dir / "results.json").read_text()
    pd.read_csv(tmp_path / "orders.csv").drop(columns=["qty"]).to_csv(tmp_path / "orders.csv", index=False)
    with pytest.raises(SpecError, match=r"table 'orders' has no column 'qty'"):
        run_job(central_cfg("epochs=1", dataset=dataset), run_dir, base_dir=tmp_path)
    assert (run_dir / "results.json").read_text() == before


def test_classification_metrics_reported(tmp_path):
    cfg = central_cfg("dataset=synthetic", "dataset.loader.task=binary", "epochs=2")
    r = run_job(cfg, tmp_path)
    assert r.metric == "accuracy" and "test_auc" in r.history[-1].extra
    assert r.history[-1].test_metric > r.reference["constant_accuracy"]


def test_predict_matches_sum_of_local_models():
    rel = load_relation(central_cfg("dataset=synthetic").dataset, SECRET, verbose=False)
    import torch

    from strategies.centralized import build_joined_model

    model = build_joined_model(rel, central_cfg().model, seed=0, dtype=torch.float64)
    H = predict(model, rel, rel.test, torch.float64)
    parts = [
        model.local[t](torch.as_tensor(rel.tables[t].X[rel.test.p[t]])).detach().numpy() for t in rel.spec.table_names
    ]
    np.testing.assert_allclose(H, sum(parts), rtol=1e-12)
