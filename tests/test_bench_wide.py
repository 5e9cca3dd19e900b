"""Smoke test of the wide-categorical benchmark's case (simulations/bench/wide.py), small, in a fresh process as
the suite runs it."""

from __future__ import annotations

import pytest

from simulations.bench.common import run_isolated


@pytest.mark.parametrize("algorithm", ["gbdt", "pcg"])
def test_the_wide_case_trains_on_a_categorical_column_of_many_categories(algorithm):
    out = run_isolated(
        "simulations.bench.wide", "wide_case", {"algorithm": algorithm, "categories": 120, "n_fact": 2000}
    )
    assert (out["algorithm"], out["categories"], out["n_fact"]) == (algorithm, 120, 2000)
    assert out["epochs"] >= 2 and out["first_epoch_s"] > 0 and out["per_epoch_s"] >= 0 and out["peak_rss_mb"] > 0
    assert 0 < out["test_metric"] < 1.7  # the constant predictor's RMSE on the synthetic star: about 1.7
