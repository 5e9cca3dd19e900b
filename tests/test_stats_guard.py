"""The client's guard on the union `stats` phase: an explicit column list, order statistics (and min/max) only
for numeric sketch columns, none from small shards; the merged rule stays equal to the unioned preprocessing.

Fast and without Flower: fedprep directly, the `stats` handler on a stand-in client, and the server's
federated preprocessing (JoinSetup.federated_preprocessing) on stand-in clients answering through it.
"""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.test_fedprep import CATEGORICAL, NUMERIC, SECRET, _shard, _union, assert_onehot_blocks_equal
from tpflower import fedprep
from tpflower.fedprep import (
    DEFAULT_MIN_SKETCH_ROWS,
    DEFAULT_SKETCH_SIZE,
    GlobalRule,
    ShardSummary,
    apply_rule,
    check_stats_request,
    local_summary,
    merge_summaries,
    quantile_bin_edges,
    sketch_columns_needed,
    uniform_bin_edges,
)
from tpflower.owner import DEFAULT_MIN_GROUP_ROWS
from tpflower.preprocess import TablePreprocessor
from tpflower.records import unnumbered

COLUMNS = ",".join(NUMERIC + CATEGORICAL)


@pytest.fixture(scope="module")
def shards() -> list[tuple[pd.DataFrame, np.ndarray]]:
    """Two shards with missing years (median imputation needs a sketch) and one without fit rows."""
    rng = np.random.default_rng(11)
    a, b, c = _shard(rng, 400, rating_nan=True), _shard(rng, 150, extra_genre="Western"), _shard(rng, 30)
    return [(a, np.flatnonzero(rng.random(len(a)) < 0.8)), (b, np.arange(len(b))), (c, np.zeros(0, dtype=np.int64))]


def request(**config: Any) -> tuple[list[str], list[str]]:
    return check_stats_request(config, NUMERIC, CATEGORICAL, table="ratings", shard=1)


# ---------------------------------------------------------------------------------------------- the request


def test_default_threshold_is_four_blocks_of_the_sketch() -> None:
    assert DEFAULT_MIN_SKETCH_ROWS == 4 * DEFAULT_SKETCH_SIZE == 2048


def test_a_request_naming_exactly_the_feature_columns_is_accepted() -> None:
    assert request(columns=COLUMNS) == (NUMERIC + CATEGORICAL, [])  # sketch absent: no column, never all
    assert request(columns=COLUMNS, sketch="") == (NUMERIC + CATEGORICAL, [])
    assert request(columns=COLUMNS, sketch="year,allnan,year") == (NUMERIC + CATEGORICAL, ["year", "allnan"])


def test_stats_without_a_column_list_is_refused() -> None:
    msg = "table 'ratings' shard 1: stats without a column list (config 'columns')"
    with pytest.raises(ValueError, match=re.escape(msg)):
        request()
    with pytest.raises(ValueError, match="without a column list"):
        request(sketch="year")  # order statistics alone, no list: refused as well


@pytest.mark.parametrize(
    "columns, named",
    [
        (COLUMNS + ",unused", "'unused'"),  # a column of the frame that is no feature
        ("year,zip", "'zip'"),
        (",".join(NUMERIC), r"lacks \['genre', 'rating'\]"),  # not all feature columns
        (",".join(CATEGORICAL + NUMERIC), "repeats or reorders"),  # not in the spec order
        (COLUMNS + ",year", "repeats or reorders"),
    ],
)
def test_any_other_column_list_is_refused_naming_it(columns: str, named: str) -> None:
    with pytest.raises(ValueError, match=rf"table 'ratings' shard 1: .*{named}"):
        request(columns=columns)


@pytest.mark.parametrize("sketch, named", [("genre", "'genre'"), ("year,unused", "'unused'")])
def test_sketch_columns_outside_the_numeric_features_are_refused(sketch: str, named: str) -> None:
    with pytest.raises(ValueError, match=rf"table 'ratings' shard 1: stats asks for order statistics.*{named}"):
        request(columns=COLUMNS, sketch=sketch)
    frame = _shard(np.random.default_rng(0), 10)
    with pytest.raises(ValueError, match=named):  # local_summary refuses the same
        local_summary(frame, NUMERIC, CATEGORICAL, SECRET, sketch_columns=sketch.split(","), min_sketch_rows=1)


# ---------------------------------------------------------------------------------------------- the summary


def test_small_shard_refuses_a_sketch_naming_count_and_threshold(shards) -> None:
    frame, rows = shards[1]
    n = int((~np.isnan(frame["year"].to_numpy()[rows])).sum())
    with pytest.raises(ValueError) as err:
        local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows, table="ratings", shard=1, sketch_columns=["year"])
    text = str(err.value)
    for part in (
        "table 'ratings' shard 1",
        "column 'year'",
        f"{n} observed fit values",
        "min_sketch_rows=2048",
        "table owner can lower min_sketch_rows",
        "out of the table's binned columns",
    ):
        assert part in text, (part, text)
    with pytest.raises(ValueError, match=f"min_sketch_rows={n + 1}"):
        local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows, sketch_columns=["year"], min_sketch_rows=n + 1)
    ok = local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows, sketch_columns=["year"], min_sketch_rows=n)
    assert ok.numeric["year"].sketch.count == n  # n values: exactly at the threshold is enough
    # no observed value (all-NaN column, shard without fit rows): nothing to send, nothing refused
    empty = local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows, sketch_columns=["allnan"])
    assert empty.numeric["allnan"].count == 0 and empty.numeric["allnan"].sketch.count == 0
    c, none = shards[2]
    assert local_summary(c, NUMERIC, CATEGORICAL, SECRET, none, sketch_columns=NUMERIC).n_rows == 0


def test_threshold_default_is_read_at_call_time(shards, monkeypatch) -> None:
    frame, rows = shards[1]
    with pytest.raises(ValueError, match="min_sketch_rows=2048"):
        local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows, sketch_columns=["score"])
    monkeypatch.setattr(fedprep, "DEFAULT_MIN_SKETCH_ROWS", 10)
    summary = local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows, sketch_columns=["score"])
    assert summary.numeric["score"].sketch.count == len(rows)


def test_min_max_and_order_statistics_only_for_sketch_columns(shards) -> None:
    frame, rows = shards[0]
    s = local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows, sketch_columns=["year"], min_sketch_rows=1)
    year = frame["year"].to_numpy()[rows]
    assert s.numeric["year"].min == np.nanmin(year) and s.numeric["year"].max == np.nanmax(year)
    assert s.numeric["year"].sketch.count == s.numeric["year"].count > 0
    for col in ("score", "flag"):
        num = s.numeric[col]
        assert num.count == len(rows) and np.isnan(num.min) and np.isnan(num.max) and num.sketch.values.size == 0
    default = local_summary(frame, NUMERIC, CATEGORICAL, SECRET, rows)  # no sketch_columns: none, not all
    assert all(np.isnan(v.min) and np.isnan(v.max) and v.sketch.count == 0 for v in default.numeric.values())
    # the payload carries no raw value of a non-sketch column: its stats row holds NaN extremes, empty sketch
    arrays = default.arrays()
    for j in range(len(NUMERIC)):
        st, values, weights = arrays[1 + 3 * j : 4 + 3 * j]
        assert np.isnan(st[3]) and np.isnan(st[4]) and values.size == weights.size == 0
    blob = np.concatenate([a.ravel().astype(np.float64) for a in arrays])
    for col in ("year", "score"):  # continuous: no raw value of theirs anywhere in the payload
        x = frame[col].to_numpy(dtype=np.float64)[rows]
        assert not np.isin(x[~np.isnan(x)], blob).any()


def test_nan_extremes_merge_and_apply(shards) -> None:
    parts = [
        local_summary(f, NUMERIC, CATEGORICAL, SECRET, r, sketch_columns=["year"], min_sketch_rows=1) for f, r in shards
    ]
    rule = merge_summaries(parts)
    union, fit = _union(shards)
    year = union["year"].to_numpy()[fit]
    assert rule.numeric["year"].min == np.nanmin(year) and rule.numeric["year"].max == np.nanmax(year)
    assert np.isnan(rule.numeric["score"].min) and np.isnan(rule.numeric["score"].max)
    expected = np.linspace(np.nanmin(year), np.nanmax(year), 5)[1:-1]
    np.testing.assert_array_equal(uniform_bin_edges(rule, "year", 4), expected)
    with pytest.raises(ValueError, match="no min/max"):
        uniform_bin_edges(rule, "score", 4)
    # a shard that did not send its extremes makes them unknown (NaN), whatever the shard order
    other = ShardSummary(
        {**parts[1].numeric, "year": replace(parts[1].numeric["year"], min=np.nan, max=np.nan)},
        parts[1].categorical,
        parts[1].n_rows,
    )
    for mixed in ([parts[0], other], [other, parts[0]]):
        r = merge_summaries(mixed).numeric["year"]
        assert np.isnan(r.min) and np.isnan(r.max)
    back = GlobalRule.from_arrays(rule.arrays(with_sketch=False), NUMERIC, CATEGORICAL)
    for f, _ in shards:
        X = apply_rule(back, f, SECRET).transform(f)
        assert np.all(np.isfinite(X))
        np.testing.assert_array_equal(X, apply_rule(rule, f, SECRET).transform(f))


# ---------------------------------------------------------------------------------------------- the protocol


class StandIn:
    """What the stats handler reads of a TableClient: settings (spec, table, shard, secret) and data."""

    def __init__(self, spec: Any, shard: int, frame: pd.DataFrame, rows: np.ndarray, **settings: Any):
        settings.setdefault("min_sketch_rows", fedprep.DEFAULT_MIN_SKETCH_ROWS)  # the owner's defaults
        settings.setdefault("min_group_rows", DEFAULT_MIN_GROUP_ROWS)
        self.settings = SimpleNamespace(spec=spec, table="ratings", shard=shard, secret=SECRET, **settings)
        self.data = SimpleNamespace(rows=frame, fit_positions=rows, frame=frame)


def spec_of(binned: tuple[tuple[str, int], ...] = ()) -> Any:
    table = SimpleNamespace(numeric=tuple(NUMERIC), categorical=tuple(CATEGORICAL), binned=binned)
    return SimpleNamespace(table_names=["ratings"], table=lambda name: table)


def test_stats_handler_refuses_and_reads_the_owner_threshold(shards, monkeypatch) -> None:
    from tpflower.phases.setup import stats

    frame, rows = shards[1]
    client = StandIn(spec_of(), 1, frame, rows)
    with pytest.raises(ValueError, match=r"table 'ratings' shard 1: stats without a column list \(config 'columns'\)"):
        stats(client, {}, {"sketch": ""})
    with pytest.raises(ValueError, match="'unused'"):
        stats(client, {}, {"columns": COLUMNS + ",unused"})
    arrays, _ = stats(client, {}, {"columns": COLUMNS})
    back = ShardSummary.from_arrays(unnumbered(arrays, "summary"), NUMERIC, CATEGORICAL)
    assert all(np.isnan(v.min) and v.sketch.count == 0 for v in back.numeric.values())
    with pytest.raises(ValueError, match="table 'ratings' shard 1: column 'year'.*min_sketch_rows=2048"):
        stats(client, {}, {"columns": COLUMNS, "sketch": "year"})
    owner = StandIn(spec_of(), 1, frame, rows, min_sketch_rows=5)  # the table owner's setting
    arrays, _ = stats(owner, {}, {"columns": COLUMNS, "sketch": "year"})
    assert ShardSummary.from_arrays(unnumbered(arrays, "summary"), NUMERIC, CATEGORICAL).numeric["year"].sketch.count


def federated_preprocessing(shards, binned: tuple[tuple[str, int], ...] = ()) -> tuple[list[dict], dict]:
    """Run JoinSetup.federated_preprocessing against stand-in shard clients answering through the stats
    handler; return every config it sent and the rule message each shard got."""
    from strategies.setup import JoinSetup
    from tpflower.phases.setup import stats

    spec = spec_of(binned)
    clients = {("ratings", q): StandIn(spec, q, f, r) for q, (f, r) in enumerate(shards)}
    sent: list[dict] = []
    rules: dict = {}

    def send(messages, kind="train"):
        replies = {}
        for key, (arrays, config) in messages.items():
            sent.append(dict(config))
            if config["phase"] == "stats":
                replies[key] = stats(clients[key], arrays, config)
            else:
                rules[key] = (arrays, config)
                replies[key] = ({}, {})
        return replies

    strategy = SimpleNamespace(
        spec=spec,
        clients=list(clients),
        send=send,
        routers={"ratings": SimpleNamespace(shards=list(range(len(shards))))},
    )
    strategy._summaries = lambda replies: JoinSetup._summaries(strategy, replies)
    JoinSetup.federated_preprocessing(strategy)
    return sent, rules


def test_server_names_the_columns_and_the_rule_equals_the_unioned_preprocessing(shards, monkeypatch) -> None:
    with pytest.raises(ValueError, match="column 'year'.*min_sketch_rows=2048"):  # small shards, default threshold
        federated_preprocessing(shards)
    monkeypatch.setattr(fedprep, "DEFAULT_MIN_SKETCH_ROWS", 1)
    sent, rules = federated_preprocessing(shards, binned=(("score", 4),))
    stats_configs = [c for c in sent if c["phase"] == "stats"]
    assert len(stats_configs) == 2 * len(shards) and all(c["columns"] == COLUMNS for c in stats_configs)
    # round 1: no order statistics; round 2: the missing-value columns and the binned one only
    assert [c["sketch"] for c in stats_configs] == [""] * 3 + ["year,score,allnan"] * 3
    assert len(rules) == len(shards)

    union, fit = _union(shards)
    central = TablePreprocessor(NUMERIC, CATEGORICAL, table="ratings").fit(union, fit)
    X_central = central.transform(union)
    arrays, _ = rules[("ratings", 0)]
    payload = unnumbered(arrays, "rule")
    rule = GlobalRule.from_arrays(payload[:-1], NUMERIC, CATEGORICAL)
    assert np.isnan(rule.numeric["flag"].min) and np.isnan(rule.numeric["flag"].max)  # no sketch asked, no extremes
    assert rule.numeric["year"].min == np.nanmin(union["year"].to_numpy()[fit])
    X_fed = np.concatenate([apply_rule(rule, f, SECRET, table="ratings").transform(f) for f, _ in shards])
    k = len(NUMERIC)
    for j, col in enumerate(NUMERIC):  # exact statistics; the medians are exact (shards below 512 values)
        x = union[col].to_numpy(dtype=np.float64)
        scale = max(1.0, float(np.abs(x[~np.isnan(x)]).max(initial=0.0))) / central.stds[col]
        np.testing.assert_allclose(X_fed[:, j], X_central[:, j], rtol=1e-12, atol=1e-12 * scale)
    assert union["year"].isna().any()
    assert_onehot_blocks_equal(X_fed, X_central, central, k)
    # the binned column's edges (the rule message's last array) are the unioned quantile edges
    score = union["score"].to_numpy()[fit]
    np.testing.assert_array_equal(payload[-1], np.quantile(score, np.arange(1, 4) / 4, method="inverted_cdf"))
    merged = merge_summaries(
        [local_summary(f, NUMERIC, CATEGORICAL, SECRET, r, sketch_columns=["score"]) for f, r in shards]
    )
    np.testing.assert_array_equal(payload[-1], quantile_bin_edges(merged, "score", 4))
    assert sketch_columns_needed([local_summary(f, NUMERIC, CATEGORICAL, SECRET, r) for f, r in shards]) == [
        "year",
        "allnan",
    ]
