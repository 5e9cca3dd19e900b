"""Every registered algorithm (tpflower.registry), the same checks: it runs and its metrics are finite, no
raw key or feature leaves a client, its privacy declarations are enforced, its client answers only its own
phases. Flower-vs-in-process equality per algorithm is in tests/test_flower.py (slow)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from flwr.app import Context, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from strategies.transport import DirectTransport
from tests.conftest import make_cfg
from tests.test_privacy_e2e import Recorded, assert_absent, raw_columns
from tpflower import registry
from tpflower.app.client_app import client_app_for
from tpflower.app.server_app import make_strategy
from tpflower.config import CONF_DIR
from tpflower.records import PAYLOAD, pack_payload, unpack_reply

ENTRIES = [e for e in registry.entries() if e.federated]


def overrides_of(entry: registry.AlgorithmEntry) -> list[str]:
    """Hydra overrides selecting ``entry`` on the synthetic schema, small enough for a unit test."""
    conf = [
        p.stem
        for p in sorted(Path(CONF_DIR, "algorithm").glob("*.yaml"))
        if yaml.safe_load(p.read_text()).get("name") == entry.selector
    ]
    assert len(conf) == 1, f"no conf/algorithm YAML selects {entry.selector!r}"
    fields = set(entry.params.__dataclass_fields__)
    extra = ["algorithm.batch_size=4000"] if "batch_size" in fields else []
    if "min_steps" in fields:  # SGD: exactly the epochs asked for (4 batches of 4000 each)
        extra.append("algorithm.min_steps=0")
    if "trees" in fields:  # boosted trees: two trees, one evaluation each (as two epochs); the union's shards
        # sketch every column for the shared bins: the synthetic shards hold fewer rows than the default floor
        extra += ["algorithm.trees=2", "algorithm.eval_every=1", "min_sketch_rows=64"]
    return [f"algorithm={conf[0]}", f"scenario={entry.scenario}", "dataset=synthetic", "epochs=1", *extra]


def test_registry_covers_the_shipped_algorithms():
    names = {e.name for e in ENTRIES}
    assert {"tp_join_sgd", "tp_join_admm", "vfl_sgd", "vfl_admm", "tp_ucq_sgd", "tp_ucq_admm"} <= names
    for e in ENTRIES:
        assert e.strategy.algorithm == e.name and e.protocol.handlers and "keys" in e.protocol.handlers and e.summary


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_runs_with_finite_metrics_and_sends_no_raw_key_or_feature(entry):
    rec = Recorded(*overrides_of(entry))
    results = rec.strategy.results
    assert results.algorithm == entry.name and rec.strategy.finished
    assert all(math.isfinite(h.test_metric) and math.isfinite(h.train_loss) for h in results.history)
    assert results.history[-1].rounds > 0 and results.history[-1].bytes_up > 0
    # every phase a client was asked for is one its algorithm declares
    assert {phase for _, phase, _, _ in rec.got} <= set(entry.protocol.handlers) | {"hello", "save_part"}
    keys, features, _ = raw_columns(rec)
    assert_absent(rec, keys)
    assert_absent(rec, features)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_privacy_declarations_are_enforced_before_any_client(entry):
    cfg = make_cfg(*overrides_of(entry), "privacy=dpsgd")
    if entry.feature_dp:
        assert make_strategy(cfg, None, log=lambda _: None).feature_dp
    else:
        assert entry.why_no_feature_dp  # the line says why and what to run (was "it is not known to support ...")
        with pytest.raises(
            ValueError,
            match=f"cannot be honoured by algorithm '{entry.selector}': {re.escape(entry.why_no_feature_dp)}",
        ):
            make_strategy(cfg, None, log=lambda _: None)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.label_dp], ids=lambda e: e.name)
def test_a_label_dp_refusal_says_why_and_what_to_run(entry):
    """privacy=label with an algorithm without label DP (k-means, which reads no label) says why and what to run
    (it said only 'label DP is not supported for algorithm 'kmeans'')."""
    assert entry.why_no_label_dp and "privacy=none" in entry.why_no_label_dp
    cfg = make_cfg(*overrides_of(entry), "privacy=label")
    with pytest.raises(ValueError, match=f"not supported for algorithm '{entry.selector}': .*reads no label"):
        make_strategy(cfg, None, log=lambda _: None)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.feature_dp], ids=lambda e: e.name)
def test_a_refusal_under_label_dpsgd_does_not_tell_to_drop_label_dp(entry):
    """privacy=label_dpsgd with an algorithm without feature DP: the line names the run's privacy and the
    algorithm to run, never privacy=dpsgd, which would drop the label DP the user asked for."""
    cfg = make_cfg(*overrides_of(entry), "privacy=label_dpsgd", "privacy.label_range=[-20,20]")
    with pytest.raises(ValueError, match="^privacy=label_dpsgd: ") as refused:
        make_strategy(cfg, None, log=lambda _: None)
    assert "privacy=dpsgd" not in str(refused.value), refused.value


def test_an_algorithm_without_feature_dp_is_refused(monkeypatch):
    entry = registry.lookup("sgd", "join")
    monkeypatch.setitem(
        registry._ENTRIES, ("sgd", "join"), registry.AlgorithmEntry(**{**entry.__dict__, "feature_dp": False})
    )
    with pytest.raises(ValueError, match="feature DP \\(DP-SGD\\) cannot be honoured by algorithm 'sgd'"):
        make_strategy(make_cfg("algorithm=sgd", "dataset=synthetic", "privacy=dpsgd"), None, log=lambda _: None)


# ------------------------------------------------------------------------------------------ ClientApp handlers


def call(app, context: Context, message_type: str, arrays: dict, config: dict) -> Message:
    DirectTransport(app, {})  # sets the process's run identity that Message() needs outside Flower's runtimes
    msg = Message(pack_payload(arrays, config), context.node_id, message_type)
    msg.metadata.__dict__["_message_id"] = "m1"
    return app(msg, context)


def test_handlers_answer_hello_and_keys_with_named_records():
    cfg = make_cfg("algorithm=sgd", "dataset=synthetic")
    app = client_app_for(cfg)
    context = Context(run_id=0, node_id=5, node_config={"partition-id": 1}, state=RecordDict(), run_config={})
    hello = unpack_reply(call(app, context, "query", {}, {"phase": "hello"}).content)
    assert hello == ({}, {"table": "d1", "shard": 0})
    reply = call(app, context, "train", {}, {"phase": "keys"})
    arrays, metrics = unpack_reply(reply.content)
    assert set(arrays) == {"row_ids", "code.0", "digest.0", "code.2", "digest.2"}  # d1 is in joins 0 and 2
    assert metrics["n_rows"] == 400 and metrics["table"] == "d1"
    # one record, so three objects on the wire (Message, RecordDict, the record) whatever the arrays
    assert list(reply.content) == [PAYLOAD] and len(get_all_nested_objects(reply)) == 3


def test_a_phase_of_another_algorithm_is_refused_naming_it():
    app = client_app_for(make_cfg("algorithm=sgd", "dataset=synthetic"))
    context = Context(run_id=0, node_id=5, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    with pytest.raises(
        ValueError, match="algorithm 'tp_join_sgd'\\) refuses phase 'admm_update': not a phase of this algorithm"
    ):
        call(app, context, "train", {"Y": np.zeros((2, 1))}, {"phase": "admm_update"})
    with pytest.raises(ValueError, match="answers only 'hello' queries"):
        call(app, context, "query", {}, {"phase": "keys"})


def test_numpyclient_fit_takes_the_arrays_in_named_order():
    """TableClient is a NumPyClient: fit(parameters, config) with config["arrays"] naming the parameters gives
    the same reply as the named-array path the ClientApp uses."""
    from tpflower.app.client_app import make_client

    cfg = make_cfg("algorithm=sgd", "dataset=synthetic")
    context = Context(run_id=0, node_id=5, node_config={"partition-id": 1}, state=RecordDict(), run_config={})
    named, metrics = make_client(cfg, context).handle({}, {"phase": "keys"})
    context.state = RecordDict()  # a fresh run: the guard answers keys once per run
    client = make_client(cfg, context)
    arrays, n, fit_metrics = client.fit([], {"phase": "keys", "arrays": ""})
    assert n == 400 and fit_metrics["arrays"] == ",".join(named)

    def per_row(d: dict) -> dict:  # a key's codes are shuffled anew per reply: compare each row's digest
        return {
            n: d["digest." + n[5:]][a] if n.startswith("code.") else a
            for n, a in d.items()
            if not n.startswith("digest.")
        }

    ours, theirs = per_row(dict(zip(named, arrays))), per_row(named)
    assert list(ours) == list(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    with pytest.raises(ValueError, match="names 1"):
        client.fit([], {"phase": "keys", "arrays": "rows"})
