"""Devices: resources.num_gpus decides a client's device; DP noise is drawn on the parameters' device;
the centralized baseline's algorithm.optimizer is read."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, RecordDict

from simulations.run import run_job
from tests.conftest import make_cfg
from tpflower.app.client_app import make_client
from tpflower.client import choose_device
from tpflower.privacy.trainer import DPLocalTrainer


def test_num_gpus_decides_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device(0) == torch.device("cpu") and choose_device(1) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a visible GPU is not this client's
    assert choose_device(0) == torch.device("cpu") and choose_device(0.0) == torch.device("cpu")
    assert choose_device(0.5) == torch.device("cuda")


def test_a_client_without_a_gpu_share_computes_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = make_cfg("algorithm=admm", "dataset=synthetic", "resources.num_gpus=0")
    context = Context(run_id=0, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    client = make_client(cfg, context)
    assert client.settings.num_gpus == 0.0 and client.device == torch.device("cpu")


def test_dp_noise_generator_lives_on_the_parameters_device():
    model = torch.nn.Linear(3, 1)
    trainer = DPLocalTrainer(model, noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1, seed=0)
    assert trainer._noise_generator.device == next(model.parameters()).device == torch.device("cpu")
    trainer.close()


def test_centralized_optimizer_is_read_and_checked(tmp_path):
    sgd = run_job(make_cfg("algorithm=centralized", "dataset=synthetic", "epochs=1"), tmp_path / "sgd")
    adam = run_job(
        make_cfg(
            "algorithm=centralized", "dataset=synthetic", "epochs=1", "algorithm.optimizer=adam", "algorithm.lr=0.01"
        ),
        tmp_path / "adam",
    )
    assert sgd.history[-1].test_metric != adam.history[-1].test_metric
    with pytest.raises(ValueError, match=r"algorithm.optimizer must be one of \['sgd', 'adam'\], got 'bogus'"):
        run_job(make_cfg("algorithm=centralized", "dataset=synthetic", "algorithm.optimizer=bogus"), tmp_path / "x")
    assert not (tmp_path / "x" / "results.json").exists()
