"""Smoke test of the Flower-overhead benchmark's transport case (simulations/bench/flower.py): a few empty
rounds under Flower's simulation engine and in-process, in a fresh process as the suite runs it."""

from __future__ import annotations

from simulations.bench.common import run_isolated


def test_empty_rounds_case_runs_under_flower_and_in_process():
    out = run_isolated("simulations.bench.flower", "empty_rounds_case", {"rounds": 3, "dataset": "synthetic"})
    assert out["case"] == "empty_rounds" and out["rounds"] == 3 and out["nodes"] >= 2
    assert out["s_per_round_flower"] > 0 and out["s_per_round_inprocess"] > 0


def test_the_adapters_bench_reads_its_variants_and_compares_medians_to_the_first():
    from simulations.bench.adapters import Variant, parse_variant, summary

    v = parse_variant("before=/opt/py/bin/python@/tmp/old+held-pulls,fast-fetch")
    assert (v.name, v.python, v.root, v.off) == ("before", "/opt/py/bin/python", "/tmp/old", "held-pulls,fast-fetch")
    assert parse_variant("1.42=/opt/py/bin/python").off == ""
    variants = [Variant("on"), Variant("off", off="all")]
    samples = {
        "on": [{"flwr": "1.42.0", "load_avg_1min": 1.0, "empty_round_s": t} for t in (0.1, 0.3, 0.2)],
        "off": [{"flwr": "1.42.0", "load_avg_1min": 2.0, "empty_round_s": t} for t in (0.9, 0.4, 0.5)],
    }
    rows = summary(variants, samples)
    assert rows[0]["median"] == {"empty_round_s": 0.2} and rows[1]["over_first"] == {"empty_round_s": 2.5}
