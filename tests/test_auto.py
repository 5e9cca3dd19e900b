"""algorithm=auto (tpflower/auto.py): the choice by model, label, privacy and scenario; the same choice on the
server and on every node (which resolves the run config itself); the choice printed first and recorded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tomllib

from simulations.federated import run_in_process
from tests.conftest import make_cfg
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, hello, node, refused
from tpflower.app.client_app import _compose
from tpflower.app.client_app import app as deployed_app
from tpflower.auto import choose, resolve
from tpflower.config import CONF_DIR, compose_config
from tpflower.datasets import load_spec
from tpflower.privacy import privacy_message


@pytest.mark.parametrize(
    ("task", "model", "privacy", "scenario", "selector"),
    [
        ("regression", "linear", "none", "join", "pcg"),
        ("regression", "linear", "label", "join", "pcg"),
        ("regression", "mlp", "none", "join", "admm"),
        ("binary", "linear", "label", "join", "admm"),
        ("multiclass", "mlp", "none", "join", "admm"),
        ("regression", "linear", "dpsgd", "join", "admm"),
        ("binary", "mlp", "label_dpsgd", "join", "admm"),
        ("regression", "linear", "none", "ucq", "pcg"),
        ("binary", "linear", "none", "ucq", "admm"),
        ("multiclass", "linear", "none", "join", "admm"),
        ("multiclass", "mlp", "label", "ucq", "admm"),
        ("binary", "mlp", "dpsgd", "ucq", "admm"),
        ("regression", "gbdt", "none", "join", "gbdt"),
        ("multiclass", "gbdt", "label", "ucq", "gbdt"),
    ],
)
def test_auto_chooses_by_model_label_privacy_and_scenario(task, model, privacy, scenario, selector):
    assert choose(task, model, {"name": privacy}, scenario)[0] == selector


def test_auto_is_resolved_printed_first_and_recorded(tmp_path):
    lines: list[str] = []
    cfg = make_cfg("algorithm=auto", "dataset=synthetic", "model=mlp", "epochs=2", "+algorithm.rho=2")
    run = run_in_process(cfg, tmp_path, log=lines.append)
    assert lines[0] == "algorithm=auto: admm (mlp model, regression label, without feature DP)"
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["algorithm"] == "tp_join_admm" == run.strategy.algorithm
    assert record["config"]["algorithm"]["name"] == "admm" and record["config"]["algorithm"]["rho"] == 2
    assert record["config"]["algorithm_auto"].startswith("admm:")
    # a run config (flwr run, a deployed node) resolves the same way on every side
    assert _compose("algorithm=auto dataset=synthetic model=mlp").algorithm.name == "admm"
    assert _compose("algorithm=auto dataset=synthetic model=mlp scenario=ucq").algorithm.name == "admm"
    assert _compose("algorithm=auto dataset=nycflights13_delayed").algorithm.name == "admm"
    assert _compose("algorithm=auto dataset=synthetic").algorithm.name == "pcg"
    assert _compose("algorithm=auto dataset=synthetic model=gbdt").algorithm.name == "gbdt"
    with pytest.raises(ValueError, match="algorithm.rho is not a setting of algorithm 'pcg'"):
        run_in_process(make_cfg("algorithm=auto", "dataset=synthetic", "+algorithm.rho=2"), None, log=lines.append)


def test_a_node_resolves_auto_itself_and_refuses_the_exact_phases_under_its_dp_floor(tmp_path):
    # the owner's floor is DP-SGD; the run asks for algorithm=auto with DP-SGD: the node resolves auto by its own
    # rules (admm: DP-SGD local steps) and refuses a curious server's exact PCG / L-BFGS phases
    attack = "algorithm=auto dataset=synthetic privacy=dpsgd"
    context = node(tmp_path, "d1", f"{SYNTHETIC} privacy=dpsgd", attack)
    assert hello(deployed_app, context)["table"] == "d1"
    msg = {"phase": "keys", **privacy_message(dict(compose_config(*attack.split()).privacy))}
    call(deployed_app, context, "train", {}, msg)
    for phase, arrays in (("pcg_setup", {"G": np.ones(400), "s": np.ones(400)}), ("lbfgs_start", {})):
        refused(deployed_app, context, f"refuses phase '{phase}'", "train", arrays, {"phase": phase, "N": 1})


BUNDLED = ("movielens", "movielens1m", "nycflights13", "nycflights13_delayed", "synthetic")


def test_auto_is_the_shipped_default_and_make_run_trains_pcg_on_movielens():
    cfg = compose_config()  # `make run`: no overrides
    assert (cfg.algorithm.name, cfg.dataset.name, cfg.model.kind) == ("auto", "movielens", "linear")
    assert resolve(cfg, log=None) == "pcg" and cfg.algorithm.name == "pcg"
    assert _compose("").algorithm.name == "pcg"  # a node (or the ServerApp) given no overrides
    project = tomllib.loads((Path(CONF_DIR).parent / "pyproject.toml").read_text())
    assert project["tool"]["flwr"]["app"]["config"]["overrides"] == "algorithm=auto"  # `flwr run .`'s default


@pytest.mark.parametrize("dataset", BUNDLED)
@pytest.mark.parametrize(("model", "privacy", "scenario"), [("linear", "none", "join"), ("mlp", "label", "ucq")])
def test_the_default_resolves_alike_on_the_server_and_on_every_node(dataset, model, privacy, scenario):
    # the server resolves the composed config with the dataset's parsed spec; a node (and a deployed ServerApp)
    # the run config's overrides string: the same choice, the one choose() makes for the dataset's label
    overrides = f"dataset={dataset} model={model} privacy={privacy} scenario={scenario}"
    cfg = compose_config(*overrides.split())
    spec = load_spec(cfg.dataset)
    assert resolve(cfg, log=None) == _compose(overrides).algorithm.name
    assert cfg.algorithm.name == choose(spec.label.task, model, {"name": privacy}, scenario)[0]
