"""Adding an algorithm takes its own files and no edit elsewhere (docs/adding-an-algorithm.md): a new family
written into fresh directories (its client module, its server module, its config file) is found by the
registry, gets its defaults from its parameter dataclass, and runs end to end through the unchanged ClientApp
and entry points."""

from __future__ import annotations

import shutil
import sys
import textwrap

import pytest

import strategies
import tpflower.config
from simulations.federated import run_in_process
from tpflower import phases, registry
from tpflower.config import CONF_DIR, compose_config

CLIENT = '''
"""A new family's client side: TP-Join-SGD's phases under a new name, with a parameter of its own."""

from dataclasses import dataclass

from tpflower.params import param, positive
from tpflower.phases import setup
from tpflower.phases.join_sgd import START, TRAIN, SGDParams
from tpflower.registry import AlgorithmEntry, register


@dataclass(frozen=True)
class ToyParams(SGDParams):
    lr: float = param(positive, 0.3)  # a default of its own, written only here


register(AlgorithmEntry("toy_sgd", "toy", "join", "toy", "ToySGD", setup.loj_protocol(START, TRAIN), ToyParams,
                        summary="a toy family for the house test"))
'''

SERVER = '''
"""A new family's server side."""

from strategies.join_sgd import TPJoinSGD
from tpflower.phases.toy import ToyParams


class ToySGD(TPJoinSGD):
    algorithm = "toy_sgd"
    params_type = ToyParams
'''

CONFIG = """
# A toy family: TP-Join-SGD under a new name.
defaults:
  - _toy
  - _self_

name: toy
"""


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The new family's four pieces in directories of their own, put on the packages' paths."""
    registry.load_all()  # the shipped families register in the real table first: the copy below is restored
    (tmp_path / "phases").mkdir()
    (tmp_path / "phases" / "toy.py").write_text(textwrap.dedent(CLIENT))
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "toy.py").write_text(textwrap.dedent(SERVER))
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "algorithm" / "toy.yaml").write_text(CONFIG)
    monkeypatch.setattr(phases, "__path__", [*phases.__path__, str(tmp_path / "phases")])
    monkeypatch.setattr(strategies, "__path__", [*strategies.__path__, str(tmp_path / "strategies")])
    monkeypatch.setattr(tpflower.config, "CONF_DIR", str(conf))
    monkeypatch.setattr(registry, "_LOADED", False)
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    yield
    for name in ("tpflower.phases.toy", "strategies.toy"):
        sys.modules.pop(name, None)


def test_a_new_family_runs_with_no_edit_elsewhere(toy_family):
    cfg = compose_config("algorithm=toy", "dataset=synthetic", "epochs=1", "precision=float64")
    assert cfg.algorithm.lr == 0.3 and cfg.algorithm.batch_size == 1024  # its own default and SGDParams'
    entry = registry.entry_of(cfg)
    assert (entry.name, entry.strategy.__name__) == ("toy_sgd", "ToySGD")
    toy = run_in_process(cfg, None, log=lambda _: None).strategy.results
    same = compose_config("algorithm=sgd", "algorithm.lr=0.3", "dataset=synthetic", "epochs=1", "precision=float64")
    sgd = run_in_process(same, None, log=lambda _: None).strategy.results
    assert toy.algorithm == "toy_sgd"
    assert [h.test_metric for h in toy.history] == [h.test_metric for h in sgd.history]
