"""MovieLens-1M (the TablePuppet paper's dataset) from the GroupLens files in a local folder.

Files (``::``-separated, no header): ratings.dat (UserID::MovieID::Rating::Timestamp),
movies.dat (MovieID::Title::Genres, latin-1, genres '|'-separated),
users.dat (UserID::Gender::Age::Occupation::Zip-code). Tables:

* ``ratings``: userId, movieId, rating, timestamp, rating_year, rating_month, rating_hour, rating_weekday.
* ``movies``: movieId, title, year (from the title's "(YYYY)"), genre: one row per (movie, genre) pair.
* ``users``: userId, gender, age, occupation, zip (age and occupation are the dataset's integer codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from tpflower.datasets.movielens import split_genres, timestamp_features
from tpflower.schema import SpecError

TABLES: tuple[str, ...] = ("ratings", "movies", "users")


def _read_colon_file(path: Path, names: list[str], dtypes: dict[str, str]) -> pd.DataFrame:
    """A '::' file whose fields contain no ':' (ratings, users): read with the fast C parser on ':'."""
    frame = pd.read_csv(
        path,
        sep=":",
        header=None,
        usecols=list(range(0, 2 * len(names), 2)),
        dtype=str,
        encoding="latin-1",
        engine="c",
    )
    frame.columns = names
    return frame.astype(dtypes)


def _require(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise SpecError(f"movielens1m: file {str(path)!r} not found (set loader.path or TPFLOWER_ML1M)")
    return path


def load(path: str | Path = "data/ml-1m", tables: Sequence[str] | None = None) -> dict[str, pd.DataFrame]:
    """The ratings/movies/users tables of MovieLens-1M read from folder ``path``; ``tables``: only these (only
    their files are read)."""
    folder = Path(path).expanduser()
    wanted = TABLES if tables is None else tuple(tables)
    unknown = sorted(set(wanted) - set(TABLES))
    if unknown:
        raise SpecError(f"movielens1m: no table(s) {unknown}; the tables are {list(TABLES)}")
    out: dict[str, pd.DataFrame] = {}
    if "ratings" in wanted:
        ratings = _read_colon_file(
            _require(folder, "ratings.dat"),
            ["userId", "movieId", "rating", "timestamp"],
            {"userId": "int64", "movieId": "int64", "rating": "float64", "timestamp": "int64"},
        )
        out["ratings"] = pd.concat([ratings, timestamp_features(ratings["timestamp"])], axis=1)
    if "users" in wanted:
        out["users"] = _read_colon_file(
            _require(folder, "users.dat"),
            ["userId", "gender", "age", "occupation", "zip"],
            {"userId": "int64", "gender": "str", "age": "int64", "occupation": "int64", "zip": "str"},
        )
    if "movies" in wanted:
        raw_movies = pd.read_csv(
            _require(folder, "movies.dat"),
            sep="::",
            header=None,
            names=["movieId", "title", "genres"],
            engine="python",
            encoding="latin-1",
            dtype={"movieId": "int64", "title": str, "genres": str},
        )
        year = raw_movies["title"].str.extract(r"\((\d{4})\)\s*$", expand=False).astype("float64")
        out["movies"] = split_genres(raw_movies.assign(year=year))[["movieId", "title", "year", "genre"]]
    return {t: out[t] for t in wanted}
