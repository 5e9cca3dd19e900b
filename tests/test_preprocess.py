"""TablePreprocessor: statistics from the fit rows only, imputation, one-hot, names, errors, from_stats."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tpflower.preprocess import NA_CATEGORY, TablePreprocessor, unseen_categories
from tpflower.schema import SpecError


@pytest.fixture
def frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "year": [2000.0, 2002.0, np.nan, 2010.0, 1990.0, 2004.0],
            "flag": [True, False, True, True, False, False],
            "genre": ["Drama", "Comedy", np.nan, "Comedy", "Horror", "Drama"],
            "unused": ["x", "y", "z", "w", "v", "u"],
        }
    )


def test_fit_on_subset_uses_only_those_rows(frame: pd.DataFrame) -> None:
    rows = np.array([0, 1, 2, 3])
    pre = TablePreprocessor(["year"], ["genre"], table="movies").fit(frame, rows)
    observed = np.array([2000.0, 2002.0, 2010.0])  # row 2 is NaN; rows 4, 5 are not fit rows
    assert pre.means == {"year": pytest.approx(observed.mean())}
    assert pre.stds == {"year": pytest.approx(observed.std())}
    assert pre.medians == {"year": 2002.0}
    assert pre.categories == {"genre": (NA_CATEGORY, "Comedy", "Drama")}  # sorted; "Horror" only in row 4

    X = pre.transform(frame)
    year = frame["year"].fillna(2002.0).to_numpy()
    np.testing.assert_allclose(X[:, 0], (year - observed.mean()) / observed.std(), rtol=0, atol=1e-12)
    # row 4 ("Horror", unseen) has an all-zero one-hot block; row 2 (NaN) is the "<NA>" category
    np.testing.assert_array_equal(X[:, 1:], [[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 1]])


def test_boolean_row_mask_equals_positions(frame: pd.DataFrame) -> None:
    mask = np.array([True, False, True, False, True, True])
    a = TablePreprocessor(["year", "flag"], ["genre"]).fit(frame, mask)
    b = TablePreprocessor(["year", "flag"], ["genre"]).fit(frame, np.flatnonzero(mask))
    assert a.stats() == b.stats()


def test_output_layout_and_feature_names(frame: pd.DataFrame) -> None:
    pre = TablePreprocessor(["year", "flag"], ["genre"], table="movies").fit(frame)
    assert pre.feature_names == ["year", "flag", "genre=<NA>", "genre=Comedy", "genre=Drama", "genre=Horror"]
    assert pre.width == 6
    X = pre.transform(frame)
    assert X.dtype == np.float64 and X.shape == (6, 6) and X.flags.c_contiguous
    # standardized numeric columns (NaN imputed with the median 2002 shifts the mean slightly)
    np.testing.assert_allclose(X[:, 1].mean(), 0.0, atol=1e-12)  # bool column is numeric
    np.testing.assert_allclose(X[:, 1].std(), 1.0, atol=1e-12)
    np.testing.assert_array_equal(X[:, 2:].sum(axis=1), 1.0)  # every category seen at fit: one 1 per row


def test_nan_imputation_constant_and_all_nan_columns() -> None:
    frame = pd.DataFrame({"a": [1.0, np.nan, 3.0, 10.0], "c": [5.0] * 4, "e": [np.nan] * 4})
    pre = TablePreprocessor(["a", "c", "e"], []).fit(frame)
    X = pre.transform(frame)
    observed = np.array([1.0, 3.0, 10.0])
    assert X[1, 0] == pytest.approx((3.0 - observed.mean()) / observed.std())  # median of 1, 3, 10
    assert pre.stds["c"] == 1.0 and np.all(X[:, 1] == 0.0)  # std 0 -> 1
    assert pre.medians["e"] == 0.0 and pre.means["e"] == 0.0 and pre.stds["e"] == 1.0
    np.testing.assert_array_equal(X[:, 2], 0.0)
    new = pd.DataFrame({"a": [np.nan], "c": [7.0], "e": [2.5]})
    np.testing.assert_allclose(pre.transform(new), [[(3.0 - observed.mean()) / observed.std(), 2.0, 2.5]])


def test_unseen_category_gives_zero_row() -> None:
    train = pd.DataFrame({"city": ["b", "a", "b"]})
    pre = TablePreprocessor([], ["city"]).fit(train)
    X = pre.transform(pd.DataFrame({"city": ["a", "zzz", np.nan, "b"]}))
    np.testing.assert_array_equal(X, [[1, 0], [0, 0], [0, 0], [0, 1]])


def test_integral_floats_and_ints_give_the_same_categories() -> None:
    as_int = pd.DataFrame({"zip": [10, 20, 10]})
    as_float = pd.DataFrame({"zip": [10.0, np.nan, 20.0, 2.5]})  # int column read as float because of NaN
    pre = TablePreprocessor([], ["zip"]).fit(as_int)
    assert pre.categories == {"zip": ("10", "20")}
    np.testing.assert_array_equal(pre.transform(as_float), [[1, 0], [0, 0], [0, 1], [0, 0]])
    assert TablePreprocessor([], ["zip"]).fit(as_float).categories == {"zip": ("10", "2.5", "20", NA_CATEGORY)}


def test_from_stats_and_settable_attributes(frame: pd.DataFrame) -> None:
    fitted = TablePreprocessor(["year", "flag"], ["genre"], table="movies").fit(frame, np.arange(4))
    rebuilt = TablePreprocessor.from_stats(["year", "flag"], ["genre"], table="movies", **fitted.stats())
    np.testing.assert_array_equal(rebuilt.transform(frame), fitted.transform(frame))
    # e.g. a federated merge adds a category seen on another shard: names and width follow
    rebuilt.categories = {"genre": ("Comedy", "Drama", "Horror", "Western")}
    assert rebuilt.width == 6
    assert rebuilt.feature_names[-1] == "genre=Western"
    assert rebuilt.transform(frame)[4, 2:].tolist() == [0, 0, 1, 0]
    with pytest.raises(SpecError, match="positive"):
        TablePreprocessor.from_stats(
            ["year"], [], medians={"year": 0.0}, means={"year": 0.0}, stds={"year": 0.0}, categories={}
        )
    with pytest.raises(SpecError, match="numeric columns"):
        TablePreprocessor.from_stats(["year"], [], medians={}, means={}, stds={}, categories={})


def test_errors_name_table_and_column(frame: pd.DataFrame) -> None:
    with pytest.raises(SpecError, match=r"'movies'.*'budget'"):
        TablePreprocessor(["budget"], [], table="movies").fit(frame)
    fitted = TablePreprocessor(["year"], ["genre"], table="movies").fit(frame)
    with pytest.raises(SpecError, match=r"'movies'.*'genre'"):
        fitted.transform(frame.drop(columns=["genre"]))
    with pytest.raises(SpecError, match=r"'movies'.*'unused'.*non-numeric"):
        TablePreprocessor(["unused"], [], table="movies").fit(frame)
    with pytest.raises(SpecError, match="both numeric and categorical"):
        TablePreprocessor(["year"], ["year"], table="movies")
    with pytest.raises(SpecError, match="infinite"):
        TablePreprocessor(["x"], [], table="t").fit(pd.DataFrame({"x": [1.0, np.inf]}))
    with pytest.raises(RuntimeError, match="not fitted"):
        TablePreprocessor(["year"], [], table="movies").transform(frame)
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        TablePreprocessor(["year"], [], table="movies").fit(frame, np.array([0, 6]))


def test_unseen_categories_are_counted_with_their_first_row_missing_values_aside():
    train = pd.DataFrame({"c": ["a", "b", "a"], "d": [1.0, 2.0, 2.0]})
    stats = TablePreprocessor([], ["c", "d"], "t").fit(train).stats()["categories"]
    new = pd.DataFrame({"c": ["a", "z", None, "z"], "d": [2.0, 3.0, 1.0, np.nan]})
    assert unseen_categories(stats, new) == {"c": (2, 1, "z"), "d": (1, 1, "3")}
    assert unseen_categories(stats, train) == {}
