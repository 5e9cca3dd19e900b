"""Reading a table from a user's file (the ``source`` of a table spec)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tpflower.checks import DataProblems, Problem
from tpflower.schema import SpecError

SUFFIXES: tuple[str, ...] = (".csv", ".parquet", ".pq")


def resolve_path(path: str | Path, base_dir: str | Path | None = None) -> Path:
    """``path`` as is when absolute (``~`` expanded), else relative to ``base_dir`` (default: the cwd)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    return Path(base_dir if base_dir is not None else Path.cwd()) / p


def _unreadable(table: str, path: Path, what: str, fix: str) -> DataProblems:
    return DataProblems([Problem(table, f"cannot be read from {str(path)!r}: {what}", fix)])


def read_table(table: str, source: str | Path, base_dir: str | Path | None = None) -> pd.DataFrame:
    """Read table ``table`` from a .csv, .parquet or .pq file; the frame gets a fresh RangeIndex.

    Raises SpecError (tpflower.checks.DataProblems: one problem) naming the table and the file when the file is
    missing, empty or unreadable, or its suffix is not supported.
    """
    path = resolve_path(source, base_dir)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise SpecError(f"table {table!r}: source {str(source)!r} must be a {'/'.join(SUFFIXES)} file")
    if not path.is_file():
        raise DataProblems(
            [
                Problem(
                    table,
                    f"source file {str(path)!r} does not exist",
                    "fix the table's source path (relative paths start at the working directory)",
                )
            ]
        )
    try:
        frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    except pd.errors.EmptyDataError:
        raise _unreadable(
            table,
            path,
            "the file is empty (not even a header row)",
            "write the table into it: a header row with the column names, then one line per row",
        ) from None
    except pd.errors.ParserError as exc:
        raise _unreadable(
            table,
            path,
            f"not a well-formed CSV ({str(exc).strip().splitlines()[-1]})",
            "give every line as many fields as the header",
        ) from None
    except UnicodeDecodeError as exc:
        raise _unreadable(
            table, path, f"not UTF-8 text ({exc.reason} at byte {exc.start})", "save the file as UTF-8"
        ) from None
    except OSError as exc:
        raise _unreadable(table, path, exc.strerror or str(exc), "check the file's permissions") from None
    except Exception as exc:  # pyarrow's errors for a broken parquet file (ArrowInvalid, ...)
        raise _unreadable(
            table,
            path,
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            f"check that it is a valid {suffix[1:]} file",
        ) from None
    return frame.reset_index(drop=True)
