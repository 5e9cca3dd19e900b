"""Model selection on the validation part of the training join (docs/algorithms.md, Model selection): the kept
model is the best validation evaluation's (its test metric is the one recorded there and the saved parts predict
its test predictions to 1e-9), early stopping stops, validation rows never come from the test split, the solvers
keep their results, and a node keeps only a model it copied."""

from __future__ import annotations

import re

import numpy as np
import pytest

from simulations.federated import run_in_process
from simulations.job import run_job
from simulations.predict import predict_run
from tests.conftest import make_cfg
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, node
from tests.test_predict import assert_same_as_the_run, held_out_rows
from tpflower.app.client_app import app as deployed_app
from tpflower.app.server_app import make_strategy
from tpflower.validation import validation_mask

QUIET = {"log": lambda _: None}
#: a small synthetic join in float64 whose MLP overfits its few training rows: its validation loss turns up
OVERFIT = (
    "dataset=synthetic",
    "dataset.loader.n_fact=300",
    "dataset.loader.dim_rows=30",
    "precision=float64",
    "model=mlp",
    "model.hidden=[64]",
    "model.beta=0",
    "validation_fraction=0.3",
)
#: the iterative trainers, each with settings that overfit OVERFIT within its epochs
FAMILIES = {
    "sgd": ("algorithm=sgd", "algorithm.lr=0.1", "algorithm.batch_size=32", "epochs=15"),
    "celu": ("algorithm=celu", "algorithm.lr=0.1", "algorithm.batch_size=32", "epochs=15"),
    "ucq_sgd": ("algorithm=sgd", "scenario=ucq", "algorithm.lr=0.1", "algorithm.batch_size=32", "epochs=15"),
    "lbfgs": ("algorithm=lbfgs", "epochs=40"),
    "admm": ("algorithm=admm", "epochs=12"),
}


def train(tmp_path, *overrides: str):
    return run_in_process(make_cfg(*overrides), tmp_path / "run", **QUIET).strategy


def evaluations(strategy) -> list:
    """The history's evaluations (without the kept model's record appended at the end)."""
    return [h for h in strategy.results.history if "kept" not in h.extra]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_kept_model_is_the_best_validation_epochs_and_the_saved_parts_predict_it(family, tmp_path):
    s = train(tmp_path, *OVERFIT, *FAMILIES[family], "algorithm.early_stopping=0")
    evals = evaluations(s)
    losses = [h.extra["val_loss"] for h in evals]
    best = evals[int(np.argmin(losses))]
    last = s.results.history[-1]
    assert s.results.selection["kept_epoch"] == best.epoch == last.epoch
    assert last.test_metric == best.test_metric and s.results.selection["val_loss"] == min(losses)
    assert ("kept" in last.extra) == (best is not evals[-1])
    if family == "sgd":
        assert best is not evals[-1], losses  # the case the kept copy exists for: a later epoch was worse
    assert len(evals) == len(s.results.history) - ("kept" in last.extra)
    shards = [None] if s.scenario == "join" else s.routers[s.spec.label_table].shards
    preds = []
    for q in shards:
        rows, ids = held_out_rows(s, tmp_path, q)
        preds.append((predict_run(tmp_path / "run", rows, shard=q or 0, **QUIET), ids))
    assert_same_as_the_run(s, preds)  # the saved parts are the kept model's (its test predictions, 1e-9)


def test_early_stopping_stops_after_its_patience(tmp_path):
    lines: list[str] = []
    cfg = make_cfg(*OVERFIT, *FAMILIES["sgd"], "algorithm.early_stopping=2", "epochs=40")
    s = run_in_process(cfg, tmp_path / "run", log=lines.append).strategy
    evals = evaluations(s)
    losses = [h.extra["val_loss"] for h in evals]
    k = int(np.argmin(losses))
    assert len(evals) < 40 and len(evals) == k + 1 + 2  # two evaluations without a lower loss, then the stop
    assert s.results.stopped["reason"] == "validation"
    assert any(line.startswith("early stopping: no lower validation loss in 2 evaluations") for line in lines)
    assert s.results.history[-1].test_metric == evals[k].test_metric


def test_validation_rows_come_from_the_training_split_only(tmp_path):
    base = ("algorithm=sgd", "dataset=synthetic", "epochs=1", "algorithm.batch_size=256")
    whole = train(tmp_path / "a", *base, "validation_fraction=0")
    held = train(tmp_path / "b", *base, "validation_fraction=0.25")
    label = whole.spec.label_table
    assert whole.valid.N == 0 and whole.selection.on is False and "selection" not in whole.results.to_json()
    np.testing.assert_array_equal(np.sort(held.test.p[label]), np.sort(whole.test.p[label]))  # the same test rows
    train_rows = whole.train.p[label]
    expected = np.sort(train_rows[validation_mask(train_rows, 0.25, 0)])  # gbdt's definition of the same rows
    np.testing.assert_array_equal(np.sort(held.valid.p[label]), expected)
    assert not set(held.valid.p[label]) & set(held.train.p[label])  # a labelled row is on one side only
    assert held.train.N + held.valid.N == whole.train.N and held.results.n_joined == whole.results.n_joined
    assert held.results.selection["validation_rows"] == held.valid.N > 0


def test_the_default_share_is_the_algorithms(tmp_path):
    """null: 0.1 for SGD and for ADMM with an MLP; 0 for PCG and linear ADMM, whose runs keep their results."""
    base = ("dataset=synthetic", "epochs=2")
    assert train(tmp_path / "sgd", *base, "algorithm=sgd").validation_fraction == 0.1
    assert train(tmp_path / "mlp", *base, "algorithm=admm", "model=mlp").validation_fraction == 0.1
    for algorithm in ("pcg", "admm"):
        s = train(tmp_path / algorithm, *base, f"algorithm={algorithm}")
        assert s.validation_fraction == 0.0 and s.valid.N == 0 and not s.results.selection


@pytest.mark.parametrize("algorithm", ["pcg", "coreset", "centralized"])
def test_a_solver_refuses_a_validation_part_in_one_line(tmp_path, algorithm):
    cfg = make_cfg("dataset=synthetic", f"algorithm={algorithm}", "validation_fraction=0.2", "runtime=inprocess")
    with pytest.raises(ValueError, match="validation_fraction=0.2: .* set validation_fraction=0") as err:
        run_job(cfg, tmp_path / "run", log=lambda _: None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("algorithm", ["sgd", "gbdt"])
def test_a_bad_share_is_refused_before_any_client_is_contacted(algorithm):
    cfg = make_cfg(f"algorithm={algorithm}", "dataset=synthetic", "validation_fraction=1.5")
    with pytest.raises(ValueError, match=r"validation_fraction must be a number in \[0, 1\) or null .*got 1.5"):
        make_strategy(cfg, None, **QUIET)


def test_a_node_keeps_only_a_model_it_copied(tmp_path):
    """A deployed node refuses ``keep`` of an evaluation it holds no copy of, in one line without a digit."""
    context = node(tmp_path, "d1", SYNTHETIC, SYNTHETIC)
    with pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "train", {}, {"phase": "keys", "keep": 3})
    line = str(refusal.value)
    assert "keep names a model this node did not copy" in line and "\n" not in line
    assert not re.search(r"\d", line.split(":", 1)[1]), line
