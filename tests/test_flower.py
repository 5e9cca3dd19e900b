"""The algorithms under Flower's simulation engine (run_simulation, one virtual SuperNode per table)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from simulations.federated import run_flower_simulation, run_in_process
from tests.conftest import make_cfg


@pytest.mark.parametrize(
    "algorithm,scenario",
    [("admm", "join"), ("sgd", "join"), ("vfl_admm", "join"), ("vfl_sgd", "join"), ("admm", "ucq"), ("sgd", "ucq")],
)
def test_flower_simulation_smoke(algorithm, scenario, tmp_path):
    overrides = (f"algorithm={algorithm}", f"scenario={scenario}", "dataset=synthetic", "epochs=2")
    if algorithm.endswith("sgd"):
        overrides += ("algorithm.batch_size=4000",)  # a few rounds per epoch: Flower costs ~0.1 s per round
    cfg = make_cfg(*overrides)
    results = run_flower_simulation(cfg, tmp_path)
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["algorithm"] == results.algorithm and len(record["history"]) == 2
    assert all(np.isfinite(h["test_metric"]) for h in record["history"])
    assert record["history"][-1]["rounds"] > 0 and record["history"][-1]["bytes_up"] > 0
    # the same strategy and clients without Flower's transport: identical iterates and payloads
    direct = run_in_process(make_cfg(*overrides), None, log=lambda _: None).strategy.results
    np.testing.assert_allclose([h.test_metric for h in results.history], [h.test_metric for h in direct.history], rtol=1e-6)
    assert [h.bytes_up for h in results.history] == [h.bytes_up for h in direct.history]


def test_client_cache_survives_configs_deserialized_per_message():
    """Under Ray the ClientApp (and its config) is deserialized for every message: the per-process cache of
    tables must hit on equal content, not on object identity, or it grows with every message."""
    import pickle

    from flwr.common import Context, RecordDict

    from simulations import client_app

    cfg = make_cfg("algorithm=sgd", "dataset=synthetic")
    client_app._SETTINGS.clear()
    context = Context(run_id=0, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    first = client_app.make_client(pickle.loads(pickle.dumps(cfg)), context)
    for _ in range(20):
        again = client_app.make_client(pickle.loads(pickle.dumps(cfg)), context)
    assert len(client_app._SETTINGS) == 1 and again.data is first.data
