"""Reading a table from a user's file (the ``source`` of a table spec)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tpflower.schema import SpecError

SUFFIXES: tuple[str, ...] = (".csv", ".parquet", ".pq")


def resolve_path(path: str | Path, base_dir: str | Path | None = None) -> Path:
    """``path`` as is when absolute (``~`` expanded), else relative to ``base_dir`` (default: the cwd)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    return Path(base_dir if base_dir is not None else Path.cwd()) / p


def read_table(table: str, source: str | Path, base_dir: str | Path | None = None) -> pd.DataFrame:
    """Read table ``table`` from a .csv, .parquet or .pq file; the frame gets a fresh RangeIndex.

    Raises SpecError naming the table when the file is missing or its suffix is not supported.
    """
    path = resolve_path(source, base_dir)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise SpecError(f"table {table!r}: source {str(source)!r} must be a {'/'.join(SUFFIXES)} file")
    if not path.is_file():
        raise SpecError(f"table {table!r}: source file {str(path)!r} does not exist")
    frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    return frame.reset_index(drop=True)
