"""Preconditioned conjugate gradient over the join (tpflower/phases/pcg.py, strategies/pcg.py): it reaches the
exact ridge solution on the materialized join, keeps its vectors on the tables, and refuses what it cannot do."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from simulations.bench.convergence import cell_overrides, matrix_cell, summarize
from simulations.federated import run_in_process
from strategies.centralized import exact_ridge
from strategies.pcg import TOL_FLOOR_EPS
from tests.conftest import make_cfg
from tests.test_checks import shop
from tests.test_conformance import call
from tests.test_curious_server import refused
from tests.test_privacy_e2e import Recorded
from tpflower.app.client_app import client_app_for
from tpflower.app.server_app import make_strategy
from tpflower.config import compose_config
from tpflower.design import SPARSE_WIDTH, Design
from tpflower.owner import simulation_secret
from tpflower.phases.pcg import PCGState
from tpflower.relation import has_bias, load_relation
from tpflower.state import ClientState


def quiet(_: str) -> None:
    pass


@pytest.mark.parametrize("dataset", ["synthetic", "movielens"])
def test_pcg_reaches_the_exact_ridge_solution_over_the_join(dataset):
    cfg = make_cfg("algorithm=pcg", f"dataset={dataset}", "precision=float64", "algorithm.tol=1e-12", "epochs=60")
    run = run_in_process(cfg, None, log=quiet)
    s = run.strategy
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    label = rel.spec.label_table
    w, b = exact_ridge(rel, float(cfg.model.beta), True, s.label_scale)
    start = 0
    for t in rel.spec.table_names:
        width = rel.tables[t].width
        theta = run.theta((t, 0))
        np.testing.assert_allclose(theta["weight"].ravel(), w[start : start + width], rtol=1e-8, atol=1e-9)
        if has_bias(cfg.model, t, label):
            np.testing.assert_allclose(theta["bias"], [b], rtol=1e-8, atol=1e-9)
        start += width
    history = s.results.history
    assert s.results.stopped["reason"] == "tol" and len(history) < 60
    residuals = [h.extra["relative_residual"] for h in history]
    assert residuals[-1] <= 1e-12
    exact = run_in_process(make_cfg("algorithm=admm", f"dataset={dataset}", "precision=float64"), None, log=quiet)
    assert history[-1].test_metric <= exact.strategy.results.history[-1].test_metric * (1 + 1e-3)


def test_one_round_trip_per_iteration_and_no_vector_leaves_a_table():
    rec = Recorded("algorithm=pcg", "dataset=synthetic", "epochs=3", "algorithm.tol=0")
    train_rounds = [r for r in rec.strategy.results.history]
    assert len(train_rounds) == 3
    for key in rec.strategy.clients:  # 1 round trip per iteration, every table in it
        phases = [phase for k, phase, _, _ in rec.got if k == key]
        assert phases.count("pcg_step") == 3 and "pcg_partial" not in phases
    c, window = len(rec.strategy.spec.table_names), int(rec.strategy.params.window)
    for key, phase, arrays, _ in rec.sent:
        if phase in ("pcg_setup", "pcg_step"):
            n = rec.strategy.client_rows[key]
            for name, a in arrays.items():  # per-row outputs of the table's own rows, or a few scalars: r.z, z.z,
                # r.r and the window's P_j^T z, P_j^T r (c each)
                assert (name == "h" and len(a) == n) or (name == "dots" and a.size <= 3 + 2 * c * window), (phase, name)
    # the rounds between the first and the last training iteration: exactly one per iteration
    rounds = [h.rounds for h in rec.strategy.results.history]
    assert rounds[2] - rounds[1] == rounds[1] - rounds[0] == 1


def materialized_solution(rec: Recorded) -> tuple[dict, dict]:
    """The exact weighted ridge solution on the materialized problem, built from the clients' own preprocessed
    rows (shards put back together), and the federated theta of every table (its first shard's PCG state)."""
    s = rec.strategy
    blocks, thetas = [], {}
    for t, router in s.routers.items():
        X = router.gather_all({q: rec.client((t, q)).rows_X(None) for q in router.shards})
        st = PCGState.load(rec.client((t, router.shards[0])).state)
        thetas[t] = st.theta
        T = np.concatenate([X, np.ones((len(X), 1))], axis=1) if len(st.theta) > X.shape[1] else X
        p = s.S.p[t] if hasattr(s, "S") else s.train.p[t]
        blocks.append(T[p].astype(np.float64))
    A = np.concatenate(blocks, axis=1)
    w = np.ones(len(A)) if s.pcg_w is None else s.pcg_w
    lhs = (A.T * w) @ A / s.pcg_N + float(s.cfg.model.beta) * np.eye(A.shape[1])
    solution = np.linalg.solve(lhs, (A.T * w) @ s.pcg_y / s.pcg_N)
    out, start = {}, 0
    for t in s.routers:
        out[t] = solution[start : start + len(thetas[t])]
        start += len(thetas[t])
    return out, thetas


def test_pcg_on_wide_one_hot_tables_reaches_the_exact_ridge_solution_through_sparse_designs(monkeypatch):
    """Tables whose features are mostly a one-hot block of many categories: each owner's T_i is sparse
    (tpflower.design.Design) and built once per run, and PCG still reaches the exact ridge solution."""
    built = []
    init = Design.__init__

    def spy(self, X, bias):
        init(self, X, bias)
        built.append(self.sparse is not None)

    monkeypatch.setattr(Design, "__init__", spy)
    cfg = make_cfg(
        "algorithm=pcg", "dataset=synthetic", "+dataset.loader.categories=120", "precision=float64",
        "algorithm.tol=1e-12", "epochs=60",
    )  # fmt: skip
    run = run_in_process(cfg, None, log=quiet)
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    w, b = exact_ridge(rel, float(cfg.model.beta), True, run.strategy.label_scale)
    start = 0
    for t in rel.spec.table_names:
        width, theta = rel.tables[t].width, run.theta((t, 0))
        assert width >= SPARSE_WIDTH
        np.testing.assert_allclose(theta["weight"].ravel(), w[start : start + width], rtol=1e-8, atol=1e-9)
        if has_bias(cfg.model, t, rel.spec.label_table):
            np.testing.assert_allclose(theta["bias"], [b], rtol=1e-8, atol=1e-9)
        start += width
    assert run.strategy.results.stopped["reason"] == "tol"
    assert built == [True] * len(rel.spec.table_names)  # one sparse design per table for the whole run


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=pcg",),
        ("algorithm=pcg", "scenario=ucq"),
        ("algorithm=coreset", "algorithm.train=pcg"),
        ("algorithm=pcg", "algorithm.window=0"),
        ("algorithm=pcg", "scenario=ucq", "algorithm.window=0"),
    ],
    ids=["join", "union", "coreset", "join-classic", "union-classic"],
)
def test_d_plus_one_iterations_reach_the_exact_ridge_solution(overrides):
    """PCG after d + 1 iterations (d = the number of parameters) equals the exact (weighted) ridge solution on
    the materialized join, union or coreset to 1e-8 in float64: one direction per table (the default) or the
    classic recurrence (window=0)."""
    d = 4 * 4 + 1  # synthetic: fact, d1, d2, d3 with 4 features each, the label table's intercept
    rec = Recorded(*overrides, "dataset=synthetic", "precision=float64", "algorithm.tol=0", f"epochs={d + 1}")
    exact, theta = materialized_solution(rec)
    assert sum(len(v) for v in theta.values()) == d
    for t in exact:
        np.testing.assert_allclose(theta[t], exact[t], rtol=1e-8, atol=1e-10 * np.abs(exact[t]).max())
    if "scenario=ucq" in overrides:  # the shards of a sharded table hold the same block, their partial products
        for t, router in rec.strategy.routers.items():  # summed by the server once per iteration
            for q in router.shards:
                np.testing.assert_array_equal(PCGState.load(rec.client((t, q)).state).theta, theta[t])
            phases = [phase for k, phase, _, _ in rec.got if k == (t, router.shards[0])]
            assert phases.count("pcg_partial") == (d + 1 if len(router.shards) > 1 else 0)
            assert phases.count("pcg_gram") == (1 if len(router.shards) > 1 else 0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("dataset=nycflights13_delayed",), "^algorithm=pcg solves .* needs a regression label"),  # public name
        (("model=mlp",), "model=linear"),
        (("privacy=dpsgd",), "cannot be honoured by algorithm 'pcg'"),
        (("scenario=ucq", "model=mlp"), "model=linear"),
    ],
)
def test_pcg_refuses_what_it_cannot_solve(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(make_cfg("algorithm=pcg", *overrides), None, log=quiet)


@pytest.mark.parametrize("window", [4, 0])
def test_a_constant_label_takes_one_step_of_zero_and_saves_the_model(tmp_path, window):
    """A constant label leaves a zero residual at the start (theta = 0 is exact): one step of 0, then the stop;
    the run records its epoch and saves every table's part (it stopped before any step: save refused)."""
    dataset = shop(tmp_path)
    orders = pd.read_csv(tmp_path / "orders.csv")
    orders["spend"] = 5.0
    orders.to_csv(tmp_path / "orders.csv", index=False)
    cfg = make_cfg("algorithm=pcg", f"algorithm.window={window}", "precision=float64")
    cfg.dataset = OmegaConf.create(dataset)
    s = run_in_process(cfg, str(tmp_path / "run"), log=quiet).strategy
    (epoch,) = s.results.history
    assert epoch.test_metric == 0.0 and s.results.stopped["reason"] == "tol"
    assert (tmp_path / "run" / "model.json").exists()


def test_a_curious_server_gets_one_partial_product_per_step_and_the_gram_block_once():
    cfg = compose_config("algorithm=pcg", "dataset=synthetic", "scenario=ucq", "epochs=1")
    run = run_in_process(cfg, None, log=quiet)
    key = next(k for k in run.contexts if k[0] == "fact")
    app, context = client_app_for(cfg), run.contexts[key]
    n = run.strategy.client_rows[key]
    probe = np.zeros(n)
    probe[0] = 1.0  # s = e_u would give the server row u's features
    call(app, context, "train", {"s": probe}, {"phase": "pcg_partial"})  # the one of the coming step
    refused(app, context, "one pcg_partial per pcg_step", "train", {"s": probe}, {"phase": "pcg_partial"})
    refused(
        app,
        context,
        "refuses phase 'pcg_gram': out of order",
        "train",
        {"G": np.ones(n), "s": probe},
        {"phase": "pcg_gram", "N": n, "d_out": 1},
    )
    join = compose_config("algorithm=pcg", "dataset=synthetic", "epochs=1")
    run = run_in_process(join, None, log=quiet)
    key = next(iter(run.contexts))
    refused(
        client_app_for(join),
        run.contexts[key],
        "refuses phase 'pcg_partial': not a phase",
        "train",
        {"s": probe},
        {"phase": "pcg_partial"},
    )


SMALL_CELLS = [  # (cell, the most round trips PCG may take to 0.1% of the exact ridge test RMSE)
    ({"schema": "star", "dim_rows": 20, "dup": 15, "correlation": 0.9, "label_scale": 0.001}, 10),
    # fact ~ d1 ~ d2 ~ d3 (0.95 along the chain): one direction per table sees the cross-table correlation
    ({"schema": "chain", "dim_rows": 30, "dup": 10, "correlation": 0.95, "label_scale": 10000.0}, 10),
    ({"schema": "snowflake", "dim_rows": 60, "dup": 10, "correlation": 0.5}, 10),
]


@pytest.mark.parametrize(("cell", "most"), SMALL_CELLS, ids=lambda c: f"{c['schema']}" if isinstance(c, dict) else "")
def test_schema_matrix_small_cells(cell, most):
    """The benchmark's schema matrix on small cells (300-600 joined rows): PCG within 0.1% of the exact ridge
    test RMSE in at most ``most`` round trips; no algorithm ends below the constant predictor with shipped
    defaults; a PCG round trip carries what an ADMM epoch carries."""
    epochs = max(10, most)
    out = matrix_cell(cell_overrides(cell), epochs, ["pcg", "admm"])
    summary = summarize(out, epochs)
    assert summary["pcg"]["rounds_to_0.1pct"] is not None and summary["pcg"]["rounds_to_0.1pct"] <= most, summary
    assert not any(a["below_constant"] for a in summary.values()), summary
    # s travels in the run's precision as ADMM's Y: the same vectors (one per table each way), plus a few
    # scalars whatever the rows (alpha and C down, the partial dots up: under 1 kB per table)
    extra = summary["pcg"]["bytes_per_round"] - summary["admm"]["bytes_per_round"]
    assert 0 <= extra <= 1000 * len(out["table_rows"]), (extra, summary)


def test_a_step_with_the_wrong_number_of_direction_coefficients_is_refused():
    """One direction per table: pcg_step needs alpha and one M x M block C_j per window block the table holds."""
    cfg = compose_config("algorithm=pcg", "dataset=synthetic", "epochs=2", "algorithm.tol=0")
    run = run_in_process(cfg, None, log=quiet)
    key = next(k for k in run.contexts if k[0] == "fact")
    n, c = run.strategy.client_rows[key], len(run.strategy.spec.table_names)
    held = len(PCGState.load(ClientState(run.contexts[key].state)).P)  # the window blocks after two steps
    assert held == 2
    refused(
        client_app_for(cfg),
        run.contexts[key],
        f"coef must hold alpha and {held} {c}x{c} blocks",
        "train",
        {"s": np.zeros(n), "coef": np.zeros(c + (held - 1) * c * c)},
        {"phase": "pcg_step", "epoch": 3},
    )


@pytest.mark.parametrize("window", [4, 0])
def test_a_float32_run_stops_at_its_precision_floor(window):
    """float32 messages leave a relative residual far above algorithm.tol=1e-8: the tolerance is floored at
    TOL_FLOOR_EPS machine epsilons of the run's precision, so the run stops early instead of running every
    iteration; a float64 run keeps its tol."""
    cell = cell_overrides(SMALL_CELLS[1][0])
    runs = {}
    for precision in ("float32", "float64"):
        overrides = (f"algorithm.window={window}", "algorithm.tol=1e-8", f"precision={precision}", "epochs=60")
        cfg = compose_config(*cell, "algorithm=pcg", *overrides)
        runs[precision] = run_in_process(cfg, None, log=quiet).strategy
    s32, s64 = runs["float32"], runs["float64"]
    floor = TOL_FLOOR_EPS * float(np.finfo(np.float32).eps)
    assert s32.stop_tol() == pytest.approx(floor) and s64.stop_tol() == 1e-8
    stopped = s32.results.stopped
    assert stopped["reason"] == "tol" and stopped["epoch"] < 60 and "floored" in stopped["detail"], stopped
    assert s32.results.history[-1].extra["relative_residual"] <= floor
    assert s64.results.stopped["reason"] == "tol" and "floored" not in s64.results.stopped["detail"]
    assert s64.results.history[-1].extra["relative_residual"] <= 1e-8
