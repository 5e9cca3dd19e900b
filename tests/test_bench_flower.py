"""Smoke test of the Flower-overhead benchmark's transport case (simulations/bench/flower.py): a few empty
rounds under Flower's simulation engine and in-process, in a fresh process as the suite runs it."""

from __future__ import annotations

from simulations.bench.common import run_isolated


def test_empty_rounds_case_runs_under_flower_and_in_process():
    out = run_isolated("simulations.bench.flower", "empty_rounds_case", {"rounds": 3, "dataset": "synthetic"})
    assert out["case"] == "empty_rounds" and out["rounds"] == 3 and out["nodes"] >= 2
    assert out["s_per_round_flower"] > 0 and out["s_per_round_inprocess"] > 0
