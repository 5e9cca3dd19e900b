"""TP-UCQ-ADMM (TablePuppet Eq. 20-24) against TP-Join-ADMM, the union's federated preprocessing and shard
edge cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from simulations.federated import run_in_process
from strategies.ucq_admm import consensus_step
from tests.conftest import make_cfg
from tpflower.phases import ucq_admm as union
from tpflower.relation import shard_text


def run(*overrides: str, dataset: dict | None = None, base_dir=None):
    return run_in_process(make_cfg(*overrides, dataset=dataset), None, base_dir=base_dir, log=lambda _: None)


def history(r, key: str = "test_metric") -> list[float]:
    return [getattr(h, key) for h in r.strategy.results.history]


def test_tp_ucq_admm_converges_to_tp_join_admm():
    # the union's iteration is the join's without Anderson acceleration (which the union does not run)
    common = ("algorithm=admm", "dataset=synthetic", "precision=float64", "epochs=4", "algorithm.anderson=0")
    join = run(*common)
    ucq = run(*common, "scenario=ucq", "algorithm.inner_rounds=400", "algorithm.inner_tol=1e-11")
    # stated tolerance: with the inner loop run to max_q ||theta^q - w|| < 1e-11, the iterates agree to 1e-7
    np.testing.assert_allclose(history(ucq), history(join), rtol=1e-7)
    for t in ("fact", "d1", "d2"):
        for name, value in join.theta((t, 0)).items():
            np.testing.assert_allclose(ucq.theta((t, 0))[name], value, rtol=1e-7, atol=1e-8)


def test_tp_ucq_admm_inner_loop_accounting_and_early_stop():
    r = run(
        "algorithm=admm",
        "dataset=synthetic",
        "scenario=ucq",
        "epochs=3",
        "algorithm.inner_rounds=10",
        "algorithm.inner_tol=1e-3",
    )
    used = r.strategy.inner_rounds_used
    assert all(1 <= u <= 10 for u in used) and min(used) < 10  # stops early once the shards agree
    h = r.strategy.results.history
    # per epoch: the Y scatter with the first inner step, (used - 1) coordinator rounds, the consensus round
    assert h[-1].rounds_inner - h[-2].rounds_inner == used[-1] - 1
    assert h[-1].rounds - h[-2].rounds == used[-1] + 1
    assert 0 < h[-1].bytes_inner < h[-1].bytes_up + h[-1].bytes_down
    assert h[-1].train_loss < h[0].train_loss


#: The shop's customers shards hold 10-25 rows, far below the default min_sketch_rows (2048) and, region c, the
#: default min_group_rows (20): the binned age column's sketch and that shard's summary would be refused; its
#: owners lower the thresholds (their settings; here the run config's).
SMALL_SHARDS = ("min_sketch_rows=1", "min_group_rows=5")


def shop_with_shards(tmp_path) -> dict:
    """orders x customers x products; customers in 3 shards by region, where region "c" holds customers that
    never ordered (a shard with no row in the join) and segment "vip" exists in region "a" only; customers'
    age is also binned into 4 quantile bins."""
    rng = np.random.default_rng(0)
    n_cust, n_prod, n = 60, 25, 1500
    region = np.array(["a"] * 25 + ["b"] * 25 + ["c"] * 10)
    segment = rng.choice(["x", "y"], n_cust).astype(object)
    segment[:5] = "vip"
    customers = pd.DataFrame(
        {"cust": np.arange(n_cust), "region": region, "age": rng.integers(18, 80, n_cust), "segment": segment}
    )
    products = pd.DataFrame({"sku": np.arange(n_prod), "price": rng.gamma(2.0, 10.0, n_prod)})
    orders = pd.DataFrame(
        {"cust": rng.integers(0, 50, n), "sku": rng.integers(0, n_prod, n), "qty": rng.integers(1, 5, n)}
    )
    vip = np.isin(orders["cust"], np.arange(5))
    orders["spend"] = orders["qty"] * products["price"].to_numpy()[orders["sku"]] + 20 * vip + rng.normal(0, 1, n)
    for name, frame in (("customers", customers), ("products", products), ("orders", orders)):
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
    return {
        "name": "shop",
        "tables": {
            "orders": {"source": "orders.csv", "numeric": ["qty"], "shards": {"parts": 2, "seed": 1}},
            "customers": {
                "source": "customers.csv",
                "numeric": ["age"],
                "categorical": ["segment", "region"],  # a shard column is an exposed one
                "binned": {"age": 4},
                "shards": {"by": "region", "values": ["a", "b", "c"]},
            },
            "products": {"source": "products.csv", "numeric": ["price"]},
        },
        "label": {"table": "orders", "column": "spend", "task": "regression"},
        "joins": [
            {"left": "orders", "right": "customers", "on": "cust"},
            {"left": "orders", "right": "products", "on": "sku"},
        ],
        "split": {"test_fraction": 0.2, "seed": 1},
    }


@pytest.mark.parametrize("algorithm", ["sgd", "admm"])
def test_shard_without_join_rows_and_category_of_one_shard(tmp_path, algorithm):
    dataset = shop_with_shards(tmp_path)
    common = (*SMALL_SHARDS, f"algorithm={algorithm}", "precision=float64", "epochs=3", "model.init=zeros")
    # three shards, one of them outside the join, agree more slowly: run the consensus loop to 1e-11
    extra = (
        ("algorithm.batch_size=256",)
        if algorithm == "sgd"
        else ("algorithm.inner_rounds=3000", "algorithm.inner_tol=1e-11", "algorithm.anderson=0")
    )
    # ADMM: the union's iteration is the join's without Anderson acceleration (which the union does not run)
    join = run(*common, *extra[:1] if algorithm == "sgd" else extra[2:], dataset=dataset, base_dir=tmp_path)
    ucq = run(*common, *extra, "scenario=ucq", dataset=dataset, base_dir=tmp_path)
    assert ("customers", 2) in ucq.strategy.clients
    assert ucq.strategy.mapping.G("customers")[ucq.strategy.routers["customers"].ids[2]].sum() == 0
    # the vip column exists on every customers shard (zeros where unseen) and the result equals the join run
    np.testing.assert_allclose(history(ucq), history(join), rtol=1e-9)
    assert history(ucq)[-1] < 0.85 * history(ucq)[0]


def test_binning_by_federated_rule_equals_binning_of_the_union(tmp_path):
    """Quantile bins of a sharded table's column: edges from the merged sketch (exact here: every shard holds
    fewer than 512 values; min_sketch_rows lowered) give the same one-hot bin features as binning the unioned
    table."""
    from tpflower.app.client_app import make_client
    from tpflower.relation import load_relation

    dataset = shop_with_shards(tmp_path)
    cfg = make_cfg(*SMALL_SHARDS, "algorithm=admm", "scenario=ucq", "epochs=1", dataset=dataset)
    ucq = run_in_process(cfg, None, base_dir=tmp_path, log=lambda _: None)
    union = load_relation(cfg.dataset, b"x", base_dir=tmp_path, verbose=False).tables["customers"]
    bins = [k for k, name in enumerate(union.feature_names) if name.startswith("age#bin")]
    assert len(bins) == 4
    for shard in range(3):
        local = make_client(cfg, ucq.contexts[("customers", shard)], tmp_path).local
        own = [k for k, name in enumerate(local.feature_names) if name.startswith("age#bin")]
        np.testing.assert_array_equal(local.X[:, own], union.X[local.row_ids][:, bins])


def test_binning_of_small_shards_is_refused_by_default(tmp_path):
    """Without lowering min_sketch_rows the customers shards (10-25 rows) refuse to send age's sketch."""
    from strategies.transport import RunError

    with pytest.raises(
        RunError,
        # the three shards refuse alike: one line, each shard's count in its parentheses
        match=r"(?m)^table 'customers' shards 0, 1, 2: column 'age' has fewer observed fit values than "
        r"min_sketch_rows=2048.*table owner can lower min_sketch_rows.* \(shard 0: \d+ observed fit values; "
        r"shard 1: \d+ observed fit values; shard 2: \d+ observed fit values\)$",
    ):
        run(
            "algorithm=sgd",
            "scenario=ucq",
            "epochs=1",
            "min_group_rows=5",
            dataset=shop_with_shards(tmp_path),
            base_dir=tmp_path,
        )


def test_consensus_step_is_eq20_when_every_shard_uses_every_weight_and_general_form_otherwise():
    rng = np.random.default_rng(0)
    Q, rho, beta = 3, 0.7, 0.2
    theta = {q: rng.normal(size=5) for q in range(Q)}
    u = {q: rng.normal(size=5) for q in range(Q)}
    w_prev = rng.normal(size=5)
    ones = {q: np.ones(5, dtype=bool) for q in range(Q)}
    w, primal, dual = consensus_step(theta, u, ones, w_prev, rho, beta)
    mean = sum(theta.values()) / Q + sum(u.values()) / Q
    np.testing.assert_allclose(w, Q * rho * mean / (beta + Q * rho), rtol=1e-14)  # Eq. 20
    np.testing.assert_allclose(dual, rho * np.sqrt(Q) * np.linalg.norm(w - w_prev), rtol=1e-14)
    for q in range(Q):
        np.testing.assert_allclose(primal[q], theta[q] - w, rtol=1e-14)
    # weight 0 used by shard 1 only, weight 1 by no shard: averaged over its users only / the ridge minimiser 0
    used = {q: np.ones(5, dtype=bool) for q in range(Q)}
    for q in range(Q):
        used[q][1] = False
        if q != 1:
            used[q][0] = False
    w, primal, dual = consensus_step(theta, u, used, w_prev, rho, beta)
    assert w[0] == pytest.approx(rho * (theta[1][0] + u[1][0]) / (beta + rho), rel=1e-14)
    assert w[1] == 0.0
    np.testing.assert_allclose(w[2:], (Q * rho * mean / (beta + Q * rho))[2:], rtol=1e-14)
    assert all(primal[q][1] == 0 for q in range(Q)) and primal[0][0] == 0 and primal[1][0] != 0
    count = np.array([1, 0, Q, Q, Q])
    assert dual == pytest.approx(rho * np.sqrt(np.sum(count * (w - w_prev) ** 2)), rel=1e-14)


def test_general_form_consensus_reaches_the_join_where_categories_live_in_one_shard(tmp_path, monkeypatch):
    """The customers' segment 'vip' and every customer's own rows live in one shard of three: averaging each
    weight over the shards that use it (the default) matches TP-Join-ADMM within the default 10 inner rounds;
    the plain average of Eq. 20 over all shards (what feature-DP shards get) lags."""
    dataset = shop_with_shards(tmp_path)
    # the paper's update (no over-relaxation): the comparison is of the consensus forms alone; with relax=1.5
    # the general form is 1.2e-3 from the join after 4 epochs (plain: 3.9e-3)
    common = (
        *SMALL_SHARDS,
        "algorithm=admm",
        "algorithm.relax=1",
        "algorithm.anderson=0",  # the union's iteration: the join's without Anderson acceleration
        "precision=float64",
        "epochs=4",
        "model.init=zeros",
    )
    join = history(run(*common, dataset=dataset, base_dir=tmp_path))[-1]
    general = history(run(*common, "scenario=ucq", dataset=dataset, base_dir=tmp_path))[-1]
    monkeypatch.setattr(
        union,
        "used_parameters",
        lambda model, cols: torch.ones(sum(p.numel() for p in model.parameters()), dtype=torch.bool),
    )
    plain = history(run(*common, "scenario=ucq", dataset=dataset, base_dir=tmp_path))[-1]
    gap, gap_plain = abs(general / join - 1), abs(plain / join - 1)
    print(f"join {join:.6f} general {general:.6f} ({gap:.2e}) plain {plain:.6f} ({gap_plain:.2e})")
    assert gap < 1e-3 and gap_plain > 3 * gap


def test_union_run_says_each_shards_rows_in_its_summary_line_and_results(tmp_path):
    """Shards of very different sizes: the dataset line and results.json's shard_rows give each shard's rows (a
    join run, whose shards are ignored, has neither)."""
    dataset = shop_with_shards(tmp_path)
    lines: list[str] = []
    cfg = make_cfg(*SMALL_SHARDS, "scenario=ucq", "algorithm=pcg", "epochs=1", dataset=dataset)
    ucq = run_in_process(cfg, None, base_dir=tmp_path, log=lines.append)
    customers = [25, 25, 10]
    assert ucq.strategy.results.to_json()["shard_rows"] == {"orders": [750, 750], "customers": customers}
    summary = next(line for line in lines if line.startswith("[shop] tables:"))
    assert "orders=1,500 (shards 750 + 750), customers=60 (shards 25 + 25 + 10), products=25 |" in summary
    join = run("algorithm=pcg", "epochs=1", dataset=dataset, base_dir=tmp_path)
    assert "shard_rows" not in join.strategy.results.to_json()
    assert shard_text([250] * 11 + [3]) == " (12 shards of 3 to 250 rows)"  # many shards: their count and range
    assert shard_text([250] * 12) == " (12 shards of 250 rows)"


def test_a_checkpointed_record_without_a_later_field_unpickles_with_its_default():
    """A run checkpointed before RunResults gained shard_rows resumes: the unpickled record takes the field's
    default (its to_json raised AttributeError)."""
    import pickle

    from tpflower.results import RunResults

    record = RunResults("tp_ucq_admm", "ucq", "shop", "linear", "regression", "rmse", 10, {"orders": 10})
    del record.__dict__["shard_rows"]  # as a record pickled by the earlier tpflower holds it
    again = pickle.loads(pickle.dumps(record))
    assert again.shard_rows == {} and again.to_json()["table_rows"] == {"orders": 10}
