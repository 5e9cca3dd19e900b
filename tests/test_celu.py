"""CELU-VFL cached local updates (tpflower/celu.py, tpflower/phases/celu.py, strategies/celu.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simulations.federated import run_in_process
from tests.conftest import make_cfg
from tpflower.app.server_app import make_strategy
from tpflower.phases.celu import Workset, staleness_weights
from tpflower.state import ClientState

# 7 rounds/epoch on the whole training split (no validation part), exactly the epochs asked for
EXACT = (
    "dataset=synthetic",
    "precision=float64",
    "model.init=zeros",
    "algorithm.batch_size=2000",
    "validation_fraction=0",
    "algorithm.min_steps=0",
)


def run(*overrides: str):
    return run_in_process(make_cfg(*overrides), None, log=lambda _: None)


def thetas(r) -> dict:
    return {k: np.concatenate([v.ravel() for v in r.theta(k).values()]) for k in r.contexts}


def test_r0_is_tp_join_sgd():
    sgd = run("algorithm=sgd", *EXACT, "epochs=1")
    celu = run("algorithm=celu", "algorithm.R=0", "algorithm.lr=0.2", *EXACT, "epochs=1")  # TP-Join-SGD's lr
    for key, theta in thetas(sgd).items():
        np.testing.assert_allclose(thetas(celu)[key], theta, rtol=0, atol=1e-12)
    assert [h.test_metric for h in celu.strategy.results.history] == [
        h.test_metric for h in sgd.strategy.results.history
    ]


@pytest.mark.parametrize(
    "extra",
    [(), ("algorithm.xi=null", "algorithm.W=1"), ("model=mlp", "algorithm.similarity=hidden")],
    ids=["defaults", "fedbcd", "mlp-hidden"],
)
def test_celu_over_reduced_batches_equals_celu_vfl_on_the_expanded_join(extra):
    """Every joined row j with p_i(j) = u shares h_u and h'_u, so its weight is w_u: CELU on the duplicate-
    reduced batch (Y_iu summed over the duplicates) takes the same local steps as CELU-VFL on the join."""
    base = [o for o in EXACT if "model=mlp" not in extra or not o.startswith("model.init")]  # an MLP needs random init
    tp = run("algorithm=celu", *base, "epochs=1", *extra)
    vfl = run("algorithm=vfl_celu", *base, "epochs=1", *extra)
    assert tp.strategy.local_steps == vfl.strategy.local_steps and max(tp.strategy.local_steps) > 0
    for key, theta in thetas(tp).items():
        np.testing.assert_allclose(thetas(vfl)[key], theta, rtol=1e-9, atol=1e-12)


def test_local_lr_steps_only_the_local_updates():
    """algorithm.local_lr is the local steps' rate: null means lr; it changes nothing when R=0."""
    same = run("algorithm=celu", *EXACT, "epochs=1", "algorithm.lr=0.1", "algorithm.local_lr=null")
    explicit = run("algorithm=celu", *EXACT, "epochs=1", "algorithm.lr=0.1", "algorithm.local_lr=0.1")
    other = run("algorithm=celu", *EXACT, "epochs=1", "algorithm.lr=0.1", "algorithm.local_lr=0.01")
    for key, theta in thetas(same).items():
        np.testing.assert_allclose(thetas(explicit)[key], theta, rtol=0, atol=1e-12)
        assert np.abs(thetas(other)[key] - theta).max() > 1e-6
    sgd = run("algorithm=sgd", *EXACT, "epochs=1", "algorithm.lr=0.1")
    r0 = run("algorithm=celu", *EXACT, "epochs=1", "algorithm.lr=0.1", "algorithm.R=0", "algorithm.local_lr=0.01")
    for key, theta in thetas(sgd).items():
        np.testing.assert_allclose(thetas(r0)[key], theta, rtol=0, atol=1e-12)


def test_round_robin_never_reuses_a_batch_within_w_minus_1_steps_and_caps_uses_at_r():
    W, R = 3, 2
    ws = Workset.empty(1, 1)
    picks: list[int] = []  # batch ids in the order they were used
    ids: list[int] = []  # the batch id of each live entry
    for batch in range(6):
        ws.insert(np.array([batch]), np.ones((1, 1)), np.ones((1, 1)), 1, W)
        ids = (ids + [batch])[-W:]
        for _ in range(R):
            k = ws.pick(W, R)
            if k is None:
                break
            picks.append(ids[k])
            if ws.uses[k] + 1 >= R:
                ids.pop(k)
            ws.used(k, R)
    assert all(picks.count(b) <= R for b in set(picks))
    for t, b in enumerate(picks):  # never the same batch within W - 1 local steps
        assert b not in picks[max(0, t - (W - 1)) : t]
    # by hand: the newest batch (never picked) first, then the least recently picked that the gap allows; a
    # bubble when none qualifies (rounds 1 and 2 take one step each)
    assert picks[:6] == [0, 1, 2, 0, 3, 1]
    assert len(ws) <= W and len(ws.rows) <= W


def test_fedbcd_takes_r_consecutive_steps_on_the_newest_batch():
    ws = Workset.empty(1, 1)
    for batch in range(3):
        ws.insert(np.array([batch, batch]), np.ones((2, 1)), np.ones((2, 1)), 2, W=1)
        steps = 0
        while (k := ws.pick(1, 4)) is not None:
            assert ws.rows[0] == batch  # W = 1: only the newest batch
            ws.used(k, 4)
            steps += 1
        assert steps == 4 and len(ws) == 0


def test_staleness_weights():
    fresh = np.array([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0], [0.0, 0.0]])
    cached = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    np.testing.assert_allclose(staleness_weights(fresh, cached, 60), [1.0, math.cos(math.pi / 4), 0.0, 0.0])
    np.testing.assert_allclose(staleness_weights(fresh, cached, 30), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(staleness_weights(fresh, cached, None), np.ones(4))


def test_workset_stays_within_w_batches():
    r = run("algorithm=celu", *EXACT, "epochs=1", "algorithm.W=2", "algorithm.R=8")
    assert max(r.strategy.local_steps) <= 8
    for _key, context in r.contexts.items():
        ws = Workset.load(ClientState(context.state))  # the client's own record
        assert 1 <= len(ws) <= 2 and ws.Y.shape[1] == ws.ref.shape[1] == 1
        assert len(ws.rows) <= 2 * 2000  # W x |U_i| numbers per column (|U_i| <= |B|)


def test_eval_every_records_fractional_epochs():
    r = run("algorithm=celu", *EXACT, "epochs=1", "algorithm.batch_size=500", "algorithm.eval_every=7")  # 28 rounds
    history = r.strategy.results.history
    assert [h.epoch for h in history] == [0.25, 0.5, 0.75, 1]
    assert [h.rounds for h in history] == [8, 15, 22, 29]  # the first predict round, then 7 per evaluation
    assert all(h.extra["local_steps_per_round"] > 0 for h in history)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (("algorithm=celu", "privacy=dpsgd"), "cached batch is replayed"),
        (("algorithm=celu", "algorithm.similarity=hidden"), "needs model=mlp"),
        (("algorithm=celu", "algorithm.W=0"), "algorithm.W must be an integer >= 1"),
        (("algorithm=celu", "algorithm.xi=200"), "algorithm.xi must be an angle"),
        (("algorithm=celu", "scenario=ucq"), "has no ucq version"),
    ],
)
def test_refusals_before_any_client(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(make_cfg("dataset=synthetic", *overrides), None, log=lambda _: None)


def test_bench_reads_rounds_to_target_per_seed():
    """simulations/bench/celu.py: each seed's target is vanilla's last metric; a variant is read off at its first
    evaluation at least as good (RMSE: lower), with the modelled comm time there; never reached -> left out."""
    from simulations.bench.celu import lower_is_better, rounds_to, summarize

    assert lower_is_better("movielens") and not lower_is_better("nycflights13_delayed")  # RMSE; accuracy

    assert rounds_to([(10, 1.2, 0.5), (20, 0.99, 1.0), (30, 0.98, 1.5)], 0.99, lower=True) == (20, 1.0)
    assert rounds_to([(10, 0.7, 0.5), (20, 0.8, 1.0)], 0.9, lower=False) is None

    def case(seed, history, end="done"):
        return {"seed": seed, "end": end, "history": history, "local_steps_per_round": 0.0, "wall_s": 1.0}

    runs = {
        "vanilla": [case(0, [(50, 1.1, 5.0), (100, 1.0, 10.0)]), case(1, [(50, 1.05, 5.0), (100, 0.9, 10.0)])],
        "celu": [case(0, [(20, 1.0, 2.0)], "target"), case(1, [(20, 1.0, 2.0), (40, 0.95, 4.0)], "diverged")],
    }
    rows = summarize("movielens", runs, {"vanilla": 0.1, "celu": 0.5})["variants"]
    assert rows["vanilla"]["rounds_to_target"] == [100, 100] and rows["vanilla"]["vs_vanilla"] == 0
    assert rows["celu"]["rounds_to_target"] == [20] and rows["celu"]["reached"] == "1/2"
    assert rows["celu"]["vs_vanilla"] == -0.8 and rows["celu"]["flower_wall_s"]["mean"] == 10.0
    assert rows["celu"]["wan_s"]["mean"] == 2.0 and rows["celu"]["end"] == ["target", "diverged"]
