"""Every registered algorithm under Flower's simulation engine (run_simulation, one virtual SuperNode per
table shard): the same results and payloads as in-process; a failing client, and the console a user sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from simulations.federated import RAY_INLINE_BYTES, RAY_INLINE_ENV, run_flower_simulation, run_in_process
from strategies.transport import RunError
from tests.conftest import make_cfg
from tests.test_conformance import overrides_of
from tpflower import registry

ENTRIES = [e for e in registry.entries() if e.federated]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_flower_simulation_equals_in_process(entry, tmp_path):
    overrides = [*overrides_of(entry), "epochs=2"]  # SGD: a few rounds per epoch (batch 4000)
    results = run_flower_simulation(make_cfg(*overrides), tmp_path, log=lambda _: None)
    record = json.loads((tmp_path / "results.json").read_text())
    # one record for a one-shot algorithm (k-means: DistDim has no epochs), else one per epoch
    assert record["algorithm"] == entry.name and len(record["history"]) == (1 if entry.strategy.one_shot else 2)
    assert all(np.isfinite(h["test_metric"]) for h in record["history"])
    assert record["history"][-1]["rounds"] > 0 and record["history"][-1]["bytes_up"] > 0
    # the same strategy and ClientApp without Flower's transport: identical iterates and payloads
    direct = run_in_process(make_cfg(*overrides), None, log=lambda _: None).strategy.results
    np.testing.assert_allclose(
        [h.test_metric for h in results.history], [h.test_metric for h in direct.history], rtol=1e-6
    )
    assert [h.bytes_up for h in results.history] == [h.bytes_up for h in direct.history]
    assert [h.bytes_down for h in results.history] == [h.bytes_down for h in direct.history]
    assert (tmp_path / "flower.log").stat().st_size > 0  # Flower's own lines went to the run's log file
    assert os.environ[RAY_INLINE_ENV] == str(RAY_INLINE_BYTES)  # set before Ray started


def bad_shop(folder: Path) -> dict:
    """A two-table dataset whose customers.csv has a non-numeric value in its numeric column ``age``; also
    written as conf/dataset/bad_shop.yaml under ``folder`` (for ``--config-dir``)."""
    rng = np.random.default_rng(0)
    customers = pd.DataFrame({"cust": np.arange(20), "age": rng.integers(18, 80, 20).astype(object)})
    customers.loc[3, "age"] = "unknown"
    orders = pd.DataFrame({"cust": rng.integers(0, 20, 200), "qty": rng.integers(1, 5, 200)})
    orders["spend"] = 3.0 * orders["qty"] + rng.normal(0, 1, 200)
    customers.to_csv(folder / "customers.csv", index=False)
    orders.to_csv(folder / "orders.csv", index=False)
    dataset = {
        "name": "bad_shop",
        "tables": {
            "orders": {"source": str(folder / "orders.csv"), "numeric": ["qty"]},
            "customers": {"source": str(folder / "customers.csv"), "numeric": ["age"]},
        },
        "label": {"table": "orders", "column": "spend", "task": "regression"},
        "joins": [{"left": "orders", "right": "customers", "on": "cust"}],
    }
    (folder / "conf" / "dataset").mkdir(parents=True, exist_ok=True)
    (folder / "conf" / "dataset" / "bad_shop.yaml").write_text(yaml.safe_dump(dataset))
    return dataset


@pytest.mark.slow
def test_a_failing_client_ends_the_flower_run_with_one_error_naming_its_table(tmp_path):
    cfg = make_cfg("algorithm=admm", "epochs=1", dataset=bad_shop(tmp_path))
    with pytest.raises(RunError, match=r"^table 'customers' shard 0: .*age"):
        run_flower_simulation(cfg, tmp_path / "run", log=lambda _: None)
    assert not (tmp_path / "run" / "results.json").exists()


def run_cli(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "simulations.run", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_the_console_shows_epochs_results_and_errors_only(tmp_path):
    run_dir = tmp_path / "ok"
    secret = "flower-run-secret-" + os.urandom(6).hex()
    ok = run_cli(
        "algorithm=admm",
        "dataset=synthetic",
        "epochs=2",
        f"hydra.run.dir={run_dir}",
        f"mapping.secret={secret}",
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"flower.log", "results.json", "config.yaml"} <= {p.name for p in written}
    assert not [p for p in written if secret in p.read_text(errors="replace")]  # nor in Flower's log
    lines = ok.stdout.splitlines()
    assert lines[0] == (  # what runs and where its results go, before torch and Flower load
        "tpflower train: algorithm=admm dataset=synthetic (2 more settings) on Flower's simulation engine; "
        f"results: {run_dir}/results.json"
    )
    stages = ["data: 4 tables loaded and checked in", "engine: starting", "engine: ServerApp up", "nodes: 4 of 4"]
    assert [line[: len(s)] for line, s in zip(lines[1:5], stages)] == stages  # a line per start-up stage
    assert lines[5].startswith("keys: 4 nodes send their join keys") and lines[6].startswith("[synthetic] tables:")
    assert lines[-1] == f"results: {run_dir / 'results.json'}"
    assert lines[-2] == f"model: {run_dir / 'model.json'}"  # the model record (docs/prediction.md)
    assert all(line.startswith("epoch ") for line in lines[7:-2]) and len(lines) == 11
    assert ok.stderr == ""
    bad_shop(tmp_path)
    bad = run_cli(
        "--config-dir",
        str(tmp_path / "conf"),
        "algorithm=admm",
        "dataset=bad_shop",
        "epochs=1",
        f"hydra.run.dir={tmp_path / 'bad'}",
        cwd=tmp_path,
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stdout.splitlines() == [  # the first line only: nothing started
        f"tpflower train: algorithm=admm dataset=bad_shop (1 more setting) on Flower's simulation engine; "
        f"results: {tmp_path / 'bad'}/results.json"
    ]
    # every table is checked before Flower starts: one report, one line per problem (tests/test_checks.py)
    assert bad.stderr.splitlines() == [
        "error: dataset 'bad_shop': 1 problem in the data; fix it and run again:",
        f"  table 'customers', numeric feature 'age': 1 non-numeric value, first at row 3 (line 5 of "
        f"{tmp_path / 'customers.csv'}): 'unknown'; make every value a number (leave it empty if unknown: a "
        "missing value, which boosted trees bin apart and the other models fill with the median), or declare the "
        "column categorical",
    ]
    refused = run_cli("algorithm=admm", "dataset=synthetic", "algorithm.rho=-1", cwd=tmp_path)
    assert refused.returncode == 1 and refused.stderr.startswith("error: algorithm.rho must be > 0, got -1")


def test_client_cache_survives_configs_deserialized_per_message():
    """Under Ray the ClientApp (and its config) is deserialized for every message: the per-process cache of
    tables must hit on equal content, not on object identity, or it grows with every message."""
    import pickle

    from flwr.common import Context, RecordDict

    from tpflower.app import client_app

    cfg = make_cfg("algorithm=sgd", "dataset=synthetic")
    client_app._SETTINGS.clear()
    context = Context(run_id=0, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    first = client_app.make_client(pickle.loads(pickle.dumps(cfg)), context)
    for _ in range(20):
        again = client_app.make_client(pickle.loads(pickle.dumps(cfg)), context)
    assert len(client_app._SETTINGS) == 1 and again.data is first.data
