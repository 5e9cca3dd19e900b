"""Federated preprocessing of a union table (fedprep): equal to TablePreprocessor fitted on the unioned table."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tpflower.fedprep import (
    GlobalRule,
    RankSketch,
    ShardSummary,
    apply_rule,
    bin_feature_names,
    bin_transform,
    category_digests,
    digest_name,
    local_summary,
    merge_summaries,
    quantile_bin_edges,
    uniform_bin_edges,
)
from tpflower.preprocess import NA_CATEGORY, TablePreprocessor
from tpflower.schema import SpecError

SECRET = b"clients-only-secret"
NUMERIC = ["year", "score", "flag", "allnan"]
CATEGORICAL = ["genre", "rating"]
GENRES = np.array(["Comedy", "Drama", "Horror", "Thriller", "Documentary"], dtype=object)


def _shard(rng: np.random.Generator, n: int, extra_genre: str | None = None, rating_nan: bool = False) -> pd.DataFrame:
    year = 2000.0 + 10.0 * rng.standard_normal(n)
    year[rng.random(n) < 0.15] = np.nan
    genre = rng.choice(GENRES, size=n).astype(object)
    genre[rng.random(n) < 0.1] = np.nan
    if extra_genre is not None:
        genre[:5] = extra_genre
    rating = rng.integers(1, 6, size=n)
    frame = pd.DataFrame(
        {
            "year": year,
            "score": 1e6 + rng.standard_normal(n),  # large offset: raw sums of squares would cancel badly
            "flag": rng.random(n) < 0.3,
            "allnan": np.full(n, np.nan),
            "genre": genre,
            "rating": rating,  # int64 here, float64 with NaN in another shard: same category strings
            "unused": rng.standard_normal(n),
        }
    )
    if rating_nan:
        r = frame["rating"].astype(np.float64)
        r[rng.random(n) < 0.1] = np.nan
        frame["rating"] = r
    return frame


@pytest.fixture(scope="module")
def shards() -> list[tuple[pd.DataFrame, np.ndarray]]:
    """Three shards of unequal sizes: (frame, fit rows). Shard C holds no fit rows (all test rows)."""
    rng = np.random.default_rng(7)
    a = _shard(rng, 700, rating_nan=True)
    b = _shard(rng, 230, extra_genre="Western")  # "Western": fit rows of shard B only
    c = _shard(rng, 60, extra_genre="Musical")  # "Musical": never a fit row anywhere
    a.loc[a.index[-3:], "genre"] = "Western"  # test rows of A hold a category only B fits on
    fit_a = np.flatnonzero(rng.random(len(a)) < 0.8)
    fit_a = fit_a[fit_a < len(a) - 3]
    return [(a, fit_a), (b, np.arange(len(b))), (c, np.zeros(0, dtype=np.int64))]


def _union(shards: list[tuple[pd.DataFrame, np.ndarray]]) -> tuple[pd.DataFrame, np.ndarray]:
    offsets = np.cumsum([0] + [len(f) for f, _ in shards])
    frame = pd.concat([f for f, _ in shards], ignore_index=True)
    return frame, np.concatenate([rows + off for (_, rows), off in zip(shards, offsets)])


def _federate(shards, sketch_size: int) -> tuple[GlobalRule, list[TablePreprocessor]]:
    """Every numeric column with a sketch; the shards are small, so the threshold is lowered explicitly."""
    summaries = [
        local_summary(
            f,
            NUMERIC,
            CATEGORICAL,
            SECRET,
            rows=rows,
            sketch_size=sketch_size,
            table="movies",
            sketch_columns=NUMERIC,
            min_sketch_rows=1,
        )
        for f, rows in shards
    ]
    rule = merge_summaries(summaries)
    return rule, [apply_rule(rule, f, SECRET, table="movies") for f, _ in shards]


def _sorted_observed(frame: pd.DataFrame, rows: np.ndarray, col: str) -> np.ndarray:
    x = frame[col].to_numpy(dtype=np.float64)[rows]
    return np.sort(x[~np.isnan(x)])


def _onehot_permutation(central: TablePreprocessor, col: str) -> np.ndarray:
    """perm with federated one-hot column j == central one-hot column perm[j] (sorted strings -> sorted digests)."""
    cats = np.array(central.categories[col], dtype=object)
    d = category_digests(cats, col, SECRET)
    return np.lexsort((d[:, 1], d[:, 0]))


def has_sketch(rule: GlobalRule) -> bool:
    """Whether every numeric column of ``rule`` carries its full rank sketch."""
    return all(r.sketch.count == r.count for r in rule.numeric.values())


# ---------------------------------------------------------------------------------------------- scaling


@pytest.mark.parametrize("sketch_size", [16, 4096])
def test_federated_equals_unioned_preprocessing(shards, sketch_size: int) -> None:
    union, fit_rows = _union(shards)
    central = TablePreprocessor(NUMERIC, CATEGORICAL, table="movies").fit(union, fit_rows)
    X_central = central.transform(union)
    rule, pres = _federate(shards, sketch_size)
    X_fed = np.concatenate([p.transform(f) for p, (f, _) in zip(pres, shards)])
    assert len({p.width for p in pres}) == 1 and pres[0].width == central.width

    # exact statistics (the federated ones go through count/sum/m2 only)
    for col in NUMERIC:
        np.testing.assert_allclose(rule.numeric[col].mean, central.means[col], rtol=1e-12, atol=1e-300)
        std = rule.numeric[col].std if rule.numeric[col].std > 0 else 1.0
        np.testing.assert_allclose(std, central.stds[col], rtol=1e-12)
    assert rule.numeric["allnan"].count == 0 and rule.numeric["allnan"].median == 0.0

    # numeric block: exact except the imputed entries, whose value comes from the sketch median. "Exact" is
    # relative to the raw magnitude: (x - mean) / std inherits an ulp of mean (~1e-10 for score ~ 1e6),
    # which np.mean and the merged sum round differently, so atol = 1e-12 * max|x| / std per column.
    k = len(NUMERIC)
    missing = union[NUMERIC].isna().to_numpy()
    for j, col in enumerate(NUMERIC):
        ok = ~missing[:, j]
        if ok.any():
            scale = max(1.0, float(np.abs(union[col].to_numpy(dtype=np.float64)[ok]).max())) / central.stds[col]
            np.testing.assert_allclose(X_fed[ok, j], X_central[ok, j], rtol=1e-12, atol=1e-12 * scale)
    for j, col in enumerate(NUMERIC):
        r = rule.numeric[col]
        if r.count == 0:
            assert np.all(X_fed[missing[:, j], j] == 0.0)
            continue
        s = _sorted_observed(union, fit_rows, col)
        n = s.size
        assert r.count == n and r.min == s[0] and r.max == s[-1]
        assert r.rank_error < n / sketch_size
        lo, hi = (n + 1) // 2, n // 2 + 1  # 1-based ranks of the two middle values
        assert s[lo - 1] <= r.median <= s[min(hi + r.rank_error, n) - 1]
        if sketch_size >= max(len(f) for f, _ in shards):
            assert r.rank_error == 0 and r.median == central.medians[col]
        np.testing.assert_allclose(X_fed[missing[:, j], j], (r.median - r.mean) / central.stds[col], rtol=1e-12)
    if sketch_size == 16:
        assert rule.numeric["year"].rank_error > 0  # the approximate path is exercised
    assert missing[:, 0].any()  # the NaN column really had imputed entries

    assert_onehot_blocks_equal(X_fed, X_central, central, k)


def assert_onehot_blocks_equal(X_fed: np.ndarray, X_central: np.ndarray, central, offset: int) -> None:
    """The one-hot blocks (from column ``offset`` on) are equal up to the permutation sorted strings -> sorted
    digests."""
    for col in CATEGORICAL:
        width = len(central.categories[col])
        perm = _onehot_permutation(central, col)
        np.testing.assert_array_equal(X_fed[:, offset : offset + width], X_central[:, offset : offset + width][:, perm])
        offset += width


def test_onehot_columns_exist_in_every_shard(shards) -> None:
    rule, pres = _federate(shards, 64)
    a, b, c = pres
    fa, fc = shards[0][0], shards[2][0]
    assert a.feature_names[len(NUMERIC) :] != c.feature_names[len(NUMERIC) :] and a.width == b.width == c.width
    # "Western" is fitted by B only; A holds it in test rows (raw name), C never (digest name, zero column)
    western = category_digests(np.array(["Western"], dtype=object), "genre", SECRET)[0]
    pos = [d.tobytes() for d in rule.categories["genre"]].index(western.tobytes())
    assert a.categories["genre"][pos] == "Western" and b.categories["genre"][pos] == "Western"
    assert c.categories["genre"][pos] == digest_name(western)
    assert digest_name(western) not in fc["genre"].astype(str).tolist()
    col_c = len(NUMERIC) + pos
    assert c.feature_names[col_c] == "genre=" + digest_name(western)
    assert np.all(c.transform(fc)[:, col_c] == 0.0)
    XA = a.transform(fa)
    assert np.all(XA[-3:, col_c] == 1.0)  # A's test rows with a category only B fitted on are encoded
    # "Musical" is no fit row anywhere: not a category, all-zero genre block in C's rows 0..4
    assert all("Musical" not in p.categories["genre"] for p in pres)
    genre_block = slice(len(NUMERIC), len(NUMERIC) + len(c.categories["genre"]))
    assert np.all(c.transform(fc)[:5, genre_block] == 0.0)
    # missing values are the "<NA>" category; int and float-with-NaN ratings agree
    assert NA_CATEGORY in a.categories["genre"]
    assert set(a.categories["rating"]) == {"1", "2", "3", "4", "5", NA_CATEGORY}
    assert b.categories["rating"].count("1") == 1


def test_digest_name_clash_is_rejected() -> None:
    frame = pd.DataFrame({"g": ["x", "y"]})
    other = pd.DataFrame({"g": ["z"]})
    rule = merge_summaries([local_summary(other, [], ["g"], SECRET)])
    trap = pd.DataFrame({"g": [digest_name(rule.categories["g"][0])]})
    assert apply_rule(rule, frame, SECRET).transform(frame).sum() == 0.0
    with pytest.raises(SpecError, match="digest names"):
        apply_rule(rule, trap, SECRET)


# ---------------------------------------------------------------------------------------------- sketch


def test_rank_sketch_contract_with_ties() -> None:
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 50, size=n).astype(np.float64) for n in (1000, 37, 0, 401)]
    sketch = RankSketch.merge([RankSketch.build(x, 20) for x in parts])
    x = np.sort(np.concatenate(parts))
    n = x.size
    assert sketch.count == n and 0 < sketch.error < n / 20
    t = np.arange(-1, 52, 0.5)
    F = np.searchsorted(x, t, side="right")
    W = np.concatenate([[0], np.cumsum(sketch.weights)])[np.searchsorted(sketch.values, t, side="right")]
    assert np.all(W <= F) and np.all(F - sketch.error <= W)
    k = np.arange(1, n + 1)
    y = sketch.rank_value(k)
    first = np.searchsorted(x, y, side="left") + 1  # ranks occupied by y: [first, last]
    last = np.searchsorted(x, y, side="right")
    assert np.all(last >= k) and np.all(first <= k + sketch.error)
    exact = RankSketch.merge([RankSketch.build(p, 2000) for p in parts])
    assert exact.error == 0 and np.array_equal(exact.rank_value(k), x)


@pytest.mark.parametrize("zeros, ones", [(0, 0), (0, 5), (7, 0), (3, 4), (1500, 2), (999, 1001), (5000, 40000)])
@pytest.mark.parametrize("size", [1, 16, 2048])
def test_rank_sketch_of_two_values_from_their_counts_equals_the_sketch_of_the_values(zeros, ones, size) -> None:
    built = RankSketch.build(np.repeat([0.0, 1.0], [zeros, ones]), size)
    counted = RankSketch.two_values(zeros, ones, size)
    assert np.array_equal(counted.values, built.values) and np.array_equal(counted.weights, built.weights)
    assert counted.error == built.error


def test_quantile_bin_edges_within_rank_error(shards) -> None:
    union, fit_rows = _union(shards)
    s = _sorted_observed(union, fit_rows, "year")
    n = s.size
    for size, n_bins in ((16, 10), (5000, 7)):
        rule, _ = _federate(shards, size)
        r = rule.numeric["year"]
        edges = quantile_bin_edges(rule, "year", n_bins)
        assert edges.size == n_bins - 1 and np.all(np.diff(edges) > 0)  # continuous data: no ties
        k = -((-np.arange(1, n_bins) * n) // n_bins)  # ceil(j n / n_bins)
        first = np.searchsorted(s, edges, side="left") + 1
        last = np.searchsorted(s, edges, side="right")
        assert np.all(last >= k) and np.all(first <= k + r.rank_error)
        if r.rank_error == 0:
            q = np.quantile(s, np.arange(1, n_bins) / n_bins, method="inverted_cdf")
            np.testing.assert_array_equal(edges, q)
    assert quantile_bin_edges(rule, "allnan", 4).size == 0


def test_bin_transform(shards) -> None:
    union, fit_rows = _union(shards)
    rule, _ = _federate(shards, 32)
    s = _sorted_observed(union, fit_rows, "year")
    uni = uniform_bin_edges(rule, "year", 4)
    np.testing.assert_array_equal(uni, np.linspace(s[0], s[-1], 5)[1:-1])
    edges = {"year": quantile_bin_edges(rule, "year", 5), "score": uni * 0 + np.array([1e6 - 1, 1e6, 1e6 + 1])}
    frame = shards[0][0]
    idx = bin_transform(frame, edges, one_hot=False)
    year = frame["year"].to_numpy()
    expected = np.digitize(year, edges["year"], right=False)
    nan = np.isnan(year)
    np.testing.assert_array_equal(idx[~nan, 0], expected[~nan])
    assert np.all(idx[nan, 0] == -1) and idx.dtype == np.int64
    oh = bin_transform(frame, edges)
    assert oh.shape == (len(frame), len(bin_feature_names(edges))) == (len(frame), 5 + 4)
    np.testing.assert_array_equal(oh[:, :5].sum(axis=1), (~nan).astype(float))
    np.testing.assert_array_equal(oh[~nan, :5].argmax(axis=1), expected[~nan])
    assert bin_feature_names(edges)[:2] == ["year#bin0", "year#bin1"]
    with pytest.raises(ValueError, match="strictly increasing"):
        bin_transform(frame, {"year": np.array([1.0, 1.0])})


# ---------------------------------------------------------------------------------------------- transport


def test_transport_round_trips_without_raw_strings(shards) -> None:
    summaries = [
        local_summary(
            f, NUMERIC, CATEGORICAL, SECRET, rows=r, sketch_size=16, sketch_columns=NUMERIC, min_sketch_rows=1
        )
        for f, r in shards
    ]
    rule = merge_summaries(summaries)
    raw = [g for g in GENRES] + ["Western", "Musical", NA_CATEGORY]
    payloads = [s.arrays() for s in summaries] + [rule.arrays(), rule.arrays(with_sketch=False)]
    for arrays in payloads:
        assert all(isinstance(a, np.ndarray) and a.dtype.kind in "iuf" for a in arrays)
        blob = b"".join(a.tobytes() for a in arrays)
        assert not any(word.encode() in blob or word.encode("utf-32-le") in blob for word in raw)

    for s in summaries:
        back = ShardSummary.from_arrays(s.arrays(), NUMERIC, CATEGORICAL)
        assert back.n_rows == s.n_rows and back.sketch_size == s.sketch_size
        for col in NUMERIC:
            a, b = s.numeric[col], back.numeric[col]
            np.testing.assert_array_equal(
                [a.count, a.total, a.m2, a.min, a.max], [b.count, b.total, b.m2, b.min, b.max]
            )
            np.testing.assert_array_equal(a.sketch.values, b.sketch.values)
            np.testing.assert_array_equal(a.sketch.weights, b.sketch.weights)
            assert a.sketch.error == b.sketch.error
        for col in CATEGORICAL:
            np.testing.assert_array_equal(s.categorical[col].digests, back.categorical[col].digests)
            np.testing.assert_array_equal(s.categorical[col].counts, back.categorical[col].counts)
    remerged = merge_summaries([ShardSummary.from_arrays(s.arrays(), NUMERIC, CATEGORICAL) for s in summaries])
    for x, y in zip(remerged.arrays(), rule.arrays(), strict=True):
        np.testing.assert_array_equal(x, y)

    full = GlobalRule.from_arrays(rule.arrays(), NUMERIC, CATEGORICAL)
    slim = GlobalRule.from_arrays(rule.arrays(with_sketch=False), NUMERIC, CATEGORICAL)
    assert has_sketch(full) and not has_sketch(slim)
    np.testing.assert_array_equal(quantile_bin_edges(full, "year", 6), quantile_bin_edges(rule, "year", 6))
    with pytest.raises(ValueError, match="no sketch"):
        quantile_bin_edges(slim, "year", 6)
    for back in (full, slim):
        for col in CATEGORICAL:
            np.testing.assert_array_equal(back.categories[col], rule.categories[col])
            np.testing.assert_array_equal(back.category_counts[col], rule.category_counts[col])
        for f, _ in shards:
            np.testing.assert_array_equal(
                apply_rule(back, f, SECRET).transform(f), apply_rule(rule, f, SECRET).transform(f)
            )
    # global counts are the fit-row counts of the union (in digest order)
    union, fit_rows = _union(shards)
    central = TablePreprocessor([], ["genre"]).fit(union, fit_rows)
    exact = central.transform(union)[fit_rows].sum(axis=0)[_onehot_permutation(central, "genre")]
    np.testing.assert_array_equal(rule.category_counts["genre"], exact.astype(np.int64))
    with pytest.raises(SpecError, match="expected"):
        ShardSummary.from_arrays(summaries[0].arrays(), NUMERIC[:-1], CATEGORICAL)


def test_wrong_secret_gives_different_index(shards) -> None:
    f, rows = shards[1]
    d1 = local_summary(f, [], ["genre"], SECRET, rows=rows).categorical["genre"].digests
    d2 = local_summary(f, [], ["genre"], b"other", rows=rows).categorical["genre"].digests
    d3 = local_summary(f.rename(columns={"genre": "g2"}), [], ["g2"], SECRET, rows=rows).categorical["g2"].digests
    assert not np.array_equal(d1, d2) and not np.array_equal(d1, d3)  # keyed and per-column domain-separated
    with pytest.raises(ValueError, match="secret"):
        local_summary(f, [], ["genre"], b"", rows=rows)


def test_sketches_only_for_columns_with_missing_values_or_binned():
    """Order statistics are raw values: the server asks for them only where the rule needs them."""
    from tpflower.fedprep import sketch_columns_needed

    rng = np.random.default_rng(5)
    a = pd.DataFrame({"full": rng.normal(size=40), "gappy": rng.normal(size=40), "binme": rng.normal(size=40)})
    b = a.copy()
    b.loc[3, "gappy"] = np.nan
    cols = ["full", "gappy", "binme"]
    first = [local_summary(f, cols, [], b"k", sketch_columns=[]) for f in (a, b)]
    assert all(s.numeric[c].sketch.count == 0 for s in first for c in cols)  # round 1 sends no order statistics
    assert all(np.isnan([s.numeric[c].min, s.numeric[c].max]).all() for s in first for c in cols)  # nor extremes
    assert sketch_columns_needed(first, binned=["binme"]) == ["gappy", "binme"]
    rule = merge_summaries(first)
    union = pd.concat([a, b])["full"]
    assert rule.numeric["full"].median == pytest.approx(union.mean())  # no sketch: the mean stands in
    second = [local_summary(f, cols, [], b"k", sketch_columns=["gappy", "binme"], min_sketch_rows=39) for f in (a, b)]
    assert second[0].numeric["full"].sketch.count == 0 and second[0].numeric["gappy"].sketch.count == 40
    assert np.isnan(second[0].numeric["full"].min) and second[0].numeric["gappy"].min == a["gappy"].min()
    rule = merge_summaries(second)
    assert rule.numeric["gappy"].median == pytest.approx(np.nanmedian(pd.concat([a, b])["gappy"]))
    with pytest.raises(ValueError) as small:  # a shard too small: the settings that lift the refusal
        local_summary(b, cols, [], b"k", table="t", sketch_columns=["gappy"], min_sketch_rows=41)
    assert "lower min_sketch_rows to at most the count" in str(small.value)
    assert str(small.value).endswith("(39 observed fit values)")
    assert "out of the table's binned columns" in str(small.value) and "where: gappy IS NOT NULL" in str(small.value)
