"""A deviating server gets no more than the protocol gives: every phase accepts only the arrays its position
allows (tpflower.guard.Inputs), union-only sums only on a shard of a sharded table right after its own partial
products, and exact releases are counted across runs against the owner's cap (tpflower.releases).

Replayed on the deployed client path (a node with its owner's settings file written by simulations.deploy;
the run config and every message are the attacker's), as tests/test_curious_server.py does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from tests.test_conformance import ENTRIES, call, overrides_of
from tests.test_curious_server import node, refused
from tests.test_owner_bounds import features, keys_round
from tpflower.app import client_app
from tpflower.app.client_app import app as deployed_app
from tpflower.app.client_app import make_client
from tpflower.config import compose_config
from tpflower.guard import ProtocolRefusal
from tpflower.phases.predict import PREDICT, with_save
from tpflower.records import unpack_reply
from tpflower.releases import DEFAULT_CAPS, DEFAULT_RUNS, released
from tpflower.state import ClientState

#: every array name some phase of some protocol declares, and one no phase takes
UNIVERSE = sorted(
    {n for e in ENTRIES for p in with_save(e.protocol).phases().values() for n in p.inputs.all_names}
    | {n for p in PREDICT.phases().values() for n in p.inputs.all_names}
    | {"rule.0", "pts.0.0", "col.row", "X"}
)
PREFIX = re.compile(r"^table '[^']*' shard \d+ \(algorithm '[^']*'\) refuses phase '[^']*': ")


def assert_refused_without_digits(context: Context, phase: str, name: str) -> None:
    """One line naming the table and the kind of problem; nothing of the table's contents (no digit once the
    table, shard, algorithm, phase and array names are taken out)."""
    with pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "train", {name: np.zeros(3)}, {"phase": phase})
    line = str(refusal.value)
    assert "\n" not in line and PREFIX.match(line), line
    kind = PREFIX.sub("", line).replace(repr(name), "")
    assert "array" in kind and not re.search(r"\d", kind), line


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_phase_refuses_every_array_it_must_not_accept(tmp_path, entry):
    """Generated from the registry: every phase of every family (and the save stage), on a table with one shard
    and (union) on a shard of a sharded table, is sent each array it does not accept at its position, one
    message each, on a fresh node: each is refused in one line with no digit about the table, and nothing moves
    the node's position (a phase of the first stage is answered afterwards)."""
    overrides = " ".join(o for o in overrides_of(entry) if not o.startswith("algorithm.batch_size"))
    # the synthetic schema: fact and d1 are sharded over the union, d2 is not; over the join none is
    tables = ["d2", "fact"] if entry.scenario == "ucq" else ["d1"]
    for table in tables:
        context = node(tmp_path / table, table, overrides, overrides)
        protocol = with_save(entry.protocol)
        for phase, declared in protocol.phases().items():
            for name in UNIVERSE:
                if declared.inputs.accepts(name):
                    continue
                assert_refused_without_digits(context, phase, name)
        assert len(keys_round(context)["row_ids"]) > 0  # the refusals moved nothing: keys is still first


def test_the_prediction_protocol_refuses_what_it_must_not_accept():
    """The prediction request's phases (tpflower.phases.predict.PREDICT) through the same guard: each phase
    refuses every array it does not accept, in one line without a digit about the table."""
    owner = SimpleNamespace(deployed=True)
    settings = SimpleNamespace(table="movies", shard=0, federated_prep=False, owner=owner)
    client = SimpleNamespace(state=ClientState(RecordDict()), settings=settings, algorithm="tp_join_admm")
    for phase, declared in PREDICT.phases().items():
        for name in UNIVERSE:
            if declared.inputs.accepts(name):
                continue
            with pytest.raises(ProtocolRefusal) as refusal:
                PREDICT.admit(client, phase, [name])
            kind = PREFIX.sub("", str(refusal.value)).replace(repr(name), "")
            assert "array" in kind and not re.search(r"\d", kind), str(refusal.value)
    assert PREDICT.admit(client, "predict_keys").handler is PREDICT.phases()["predict_keys"].handler


# ------------------------------------------------------------------------------------ union-only arrays


def ledger(overrides: str, context: Context) -> dict[str, int]:
    """The node's exact releases so far, per family (its owner's ledger in its state_dir)."""
    client = make_client(compose_config(*overrides.split()), context)
    return released(str(client.settings.owner.state_dir), client.settings.table, client.settings.shard)


def test_forged_gram_on_a_table_with_one_shard_is_refused_before_any_computation(tmp_path, caplog):
    """The measured attack: on a dimension table that is not sharded, pcg_setup with the server's own gram and
    g makes M, r and z the server's and h = T z spells out T (main: relative error 1.7e-15 from 12 messages).
    Now refused before anything is computed, naming no width, also for an owner whose allow-list names only
    tp_join_admm and tp_join_pcg; the honest pcg_setup of the same node is still answered."""
    pcg = "algorithm=pcg dataset=synthetic precision=float64"
    allow = lambda s: s.update(algorithms=["tp_join_admm", "tp_join_pcg"])  # noqa: E731
    context = node(tmp_path, "d1", pcg, pcg, edit=allow)
    keys = keys_round(context)
    n = len(keys["row_ids"])
    X = features(pcg, context)
    d = X.shape[1] + 1
    forged = {"gram": np.eye(d), "g": np.eye(d)[0]}
    with caplog.at_level("ERROR", logger="tpflower"), pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "train", forged, {"phase": "pcg_setup", "N": 1, "d_out": 1})
    line = str(refusal.value)
    assert "'g'" in line and "one shard" in line and str(d) not in PREFIX.sub("", line), line
    assert ledger(pcg, context) == {}  # refused before anything was computed or charged
    honest = {"G": np.ones(n), "s": np.zeros(n)}
    reply = call(deployed_app, context, "train", honest, {"phase": "pcg_setup", "N": n, "d_out": 1})
    h = unpack_reply(reply.content)[0]["h"]
    assert np.allclose(h, 0.0)  # s = 0: r = 0, z = 0 (nothing of T)


def test_a_forged_sum_on_a_shard_only_right_after_its_own_partial_products(tmp_path):
    """On a shard of a sharded table the sums come only right after its own partial products: pcg_setup's
    gram and g before pcg_gram are refused (their shape is pcg_setup's check, after its own products)."""
    ucq = "algorithm=pcg dataset=synthetic scenario=ucq precision=float64"
    context = node(tmp_path, "fact", ucq, ucq)
    keys_round(context)
    with pytest.raises(ValueError, match=r"array 'g(ram)?' comes only right after this shard's own pcg_gram"):
        call(deployed_app, context, "train", {"gram": np.eye(3), "g": np.ones(3)}, {"phase": "pcg_setup", "N": 1})


@pytest.mark.parametrize(
    "overrides, table, phase, arrays",
    [
        ("algorithm=lbfgs dataset=synthetic", "d1", "lbfgs_trial", {"g": np.ones(3), "delta": np.ones(1)}),
        ("algorithm=sgd scenario=ucq dataset=synthetic", "d2", "sgd_apply", {"g": np.ones(3)}),
        ("algorithm=pcg dataset=synthetic", "d1", "pcg_step", {"g": np.ones(3)}),
    ],
    ids=["lbfgs-g", "ucq-sgd-g", "pcg-step-g"],
)
def test_every_union_sum_is_refused_on_a_table_with_one_shard(tmp_path, overrides, table, phase, arrays):
    """TP-UCQ-SGD's aggregate gradient g included: a table with one shard now applies its own partial gradient,
    so the server cannot step its model by a g of its choosing and read X g from the next predictions."""
    context = node(tmp_path, table, overrides, overrides)
    refused(
        deployed_app,
        context,
        r"sum over the shards of a sharded table; this table has one shard",
        "train",
        arrays,
        {"phase": phase},
    )


# ------------------------------------------------------------------------------------ the ledger across runs


def fresh_run(context: Context, run: int) -> Context:
    """The same node (its settings file, its state_dir) serving a fresh run: a new context, caches dropped as
    after a restart of the node."""
    client_app._SETTINGS.clear()
    return Context(
        run_id=run,
        node_id=context.node_id,
        node_config=context.node_config,
        state=RecordDict(),
        run_config=context.run_config,
    )


def test_a_loop_of_fresh_runs_stops_at_the_owners_cap_across_restarts(tmp_path):
    """One pcg_setup per fresh run (main: 9 such runs gave a dimension table's whole matrix to 3.5e-5): each is
    an exact release; with the owner's cap of 3 the fourth run's is refused, in a line naming the family and
    the setting and no count, also after the node restarts (the count lives in its state_dir)."""
    pcg = "algorithm=pcg dataset=synthetic precision=float64"
    context = node(tmp_path, "d1", pcg, pcg, edit=lambda s: s.update(exact_releases={"pcg": 3}))
    for run in range(5):
        context = fresh_run(context, run)
        n = len(keys_round(context)["row_ids"])
        message = (
            {"G": np.ones(n), "s": np.random.default_rng(run).normal(size=n)},
            {"phase": "pcg_setup", "N": n, "d_out": 1},
        )
        line = past_the_cap(context, message, run, 3)
        assert line is None or ("cap on exact releases of family 'pcg'" in line and "exact_releases" in line), line
    assert ledger(pcg, context) == {"pcg": 3}


def past_the_cap(context: Context, message: tuple, run: int, cap: int) -> str | None:
    """The node answers ``message`` (arrays, config) in runs below ``cap``; from it on, its refusal's line,
    which names no count."""
    if run < cap:
        call(deployed_app, context, "train", *message)
        return None
    with pytest.raises(ValueError) as refusal:
        call(deployed_app, context, "train", *message)
    line = str(refusal.value)
    assert not re.search(r"\d", line.split("shard", 1)[1][2:]), line
    return line


def test_the_owners_total_caps_every_family_together(tmp_path):
    """Each family's cap bounds it alone, so a server alternating families (pcg, then TP-Join-ADMM) got each
    family's cap; the owner's ``exact_releases.total`` bounds all of them together, across runs: with total 3
    the fourth exact release, of whichever family, is refused in one line naming the setting and no count."""
    pcg = "algorithm=pcg dataset=synthetic precision=float64"
    admm = "algorithm=admm dataset=synthetic precision=float64"
    context = node(tmp_path, "d1", pcg, pcg, edit=lambda s: s.update(exact_releases={"total": 3}))
    for run, overrides in enumerate([pcg, admm, pcg, admm]):
        context = fresh_run(Context(0, 1, context.node_config, RecordDict(), {"overrides": overrides}), run)
        n = len(keys_round(context)["row_ids"])
        if overrides == pcg:  # the setup itself is pcg's exact release; ADMM's is its update
            message = ({"G": np.ones(n), "s": np.ones(n)}, {"phase": "pcg_setup", "N": n, "d_out": 1})
        else:
            setup = {"phase": "admm_setup", "N": float(n), "rho": 1.0, "d_out": 1}
            call(deployed_app, context, "train", {"G": np.ones(n)}, setup)
            message = ({"Y": np.zeros((n, 1))}, {"phase": "admm_update"})
        line = past_the_cap(context, message, run, 3)
        assert line is None or "of all families together over all runs is reached (exact_releases.total" in line
    assert sum(ledger(pcg, context).values()) == 3
    owner = make_client(compose_config(*pcg.split()), context).settings.owner
    assert owner.releases_problem({"pcg", "join_admm"}) is None  # total is no family: the node starts with it


def test_the_default_caps_cover_every_family_at_twenty_default_runs():
    """Every registered family has a default cap, 20 times its largest default run on the bundled datasets
    (bench_results/releases.json); a new family adds its line to tpflower.releases.DEFAULT_CAPS."""
    measured = json.loads((Path(__file__).resolve().parents[1] / "bench_results" / "releases.json").read_text())
    for entry in ENTRIES:
        assert DEFAULT_CAPS.get(entry.family, 0) > 0, entry.family
        assert DEFAULT_CAPS[entry.family] == DEFAULT_RUNS * measured["largest"][entry.family]
    assert set(DEFAULT_CAPS) == {e.family for e in ENTRIES}


# ------------------------------------------------------------------------------------ k-means cost


def test_kmeans_cost_only_against_centres_built_from_the_nodes_own(tmp_path):
    """kmeans_cost takes the server's centres: differencing two runs whose assignments differ in one row gives
    one exact linear measurement of that row (main: recovered to 7e-14). Now the centres must be weighted
    means of the local centres the node released in this run; centres of the server's choosing are refused."""
    km = "algorithm=kmeans dataset=synthetic algorithm.k=2"
    context = node(tmp_path, "d1", km, km)
    n = len(keys_round(context)["row_ids"])
    G = np.ones(n)
    local = unpack_reply(call(deployed_app, context, "train", {"G": G}, {"phase": "kmeans_local"}).content)[0]
    C_local = np.asarray(local["C"])
    rows = np.arange(n)
    query = {"rows": rows, "centres": np.zeros(n, dtype=np.int64), "counts": np.ones(n, dtype=np.int64)}
    chosen = C_local[:1] + 3.0  # outside the hull of its own centres
    refused(
        deployed_app,
        context,
        "built from this table's own released local centres",
        "train",
        {**query, "C": chosen},
        {"phase": "kmeans_cost"},
    )
    mean = C_local.mean(0, keepdims=True)  # a weighted mean of its own centres: answered
    cost = unpack_reply(call(deployed_app, context, "train", {**query, "C": mean}, {"phase": "kmeans_cost"}).content)
    assert np.isfinite(cost[0]["cost"]).all()
    assert ledger(km, context) == {"kmeans": 2}  # kmeans_local and the one cost: exact releases
