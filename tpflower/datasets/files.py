"""Reading a table from a user's file (the ``source`` of a table spec)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from tpflower.checks import NA_ATTR, DataProblems, Problem
from tpflower.schema import SpecError

SUFFIXES: tuple[str, ...] = (".csv", ".parquet", ".pq")


def resolve_path(path: str | Path, base_dir: str | Path | None = None) -> Path:
    """``path`` as is when absolute (``~`` expanded), else relative to ``base_dir`` (default: the cwd)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    return Path(base_dir if base_dir is not None else Path.cwd()) / p


def source_fix(source: str | Path, base_dir: str | Path | None) -> str:
    """What to do about a source file that does not exist: where a relative path starts, and how to move it
    (the prediction command's ``--base-dir``, the Python API's ``base_dir=``, docs/python-api.md)."""
    if Path(source).expanduser().is_absolute():
        return "fix the table's source path"
    start = f"base_dir {str(base_dir)!r}" if base_dir is not None else f"the working directory {str(Path.cwd())!r}"
    return (
        f"fix the table's source path (relative paths start at {start}; `tpflower predict --base-dir DIR`, or "
        "from Python base_dir= of tpflower.fit, tpflower.load or predict, says where they start)"
    )


def _unreadable(table: str, path: Path, what: str, fix: str) -> DataProblems:
    return DataProblems([Problem(table, f"cannot be read from {str(path)!r}: {what}", fix)])


def read_table(
    table: str, source: str | Path, base_dir: str | Path | None = None, keys: Sequence[str] = ()
) -> pd.DataFrame:
    """Read table ``table`` from a .csv, .parquet or .pq file; the frame gets a fresh RangeIndex. ``keys``: its
    join key columns, read from a CSV file by :func:`key_columns`.

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
                    source_fix(source, base_dir),
                )
            ]
        )
    try:
        if suffix == ".csv":
            frame = read_csv_noting_na_strings(path, keys)
        else:
            frame = parquet_keys(pd.read_parquet(path), keys)
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
    names = header_names(path, suffix, frame)
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        raise _unreadable(
            table,
            path,
            f"the column name(s) {twice} appear more than once in its header",
            "give every column its own name",
        )
    return booleans_as_flags(frame).reset_index(drop=True)


#: the text pandas' read_csv reads as True and as False (its true_values / false_values defaults)
TRUE_TEXT: frozenset[str] = frozenset(("True", "TRUE", "true"))
FALSE_TEXT: frozenset[str] = frozenset(("False", "FALSE", "false"))


def _flag(value: object) -> bool | None:
    """``value`` as a boolean if it is one (a bool or TRUE_TEXT / FALSE_TEXT), else None."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str):
        return True if value in TRUE_TEXT else False if value in FALSE_TEXT else None
    return None


def booleans_as_flags(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every text or object column whose values, missing ones aside, are all booleans (True /
    False as pandas parses them, or TRUE_TEXT / FALSE_TEXT) made a boolean column: bool when complete, else
    pandas' nullable ``boolean`` (a 0/1 column with missing values: numeric, its gaps imputed as any numeric
    column's). pandas reads a CSV column of True, (blank), False as object: without this it would be text.
    Every file read goes through here (a table's source, a rows file), so training, prediction and SQL's type
    inference see one kind. ``frame.attrs`` are kept."""
    for col in frame.select_dtypes(include=["object", "string"]).columns:
        s = frame[col]
        present = s.notna().to_numpy()
        if not present.any() or _flag(s.iloc[int(np.argmax(present))]) is None:
            continue  # the first value decides cheaply for a column of text
        codes, uniques = pd.factorize(s)
        flags = [_flag(v) for v in uniques]
        if any(f is None for f in flags):
            continue
        values = np.asarray(flags, dtype=bool)[codes]
        frame[col] = values if present.all() else pd.arrays.BooleanArray(values, ~present)
    return frame


#: the text pandas' read_csv reads as a missing value by default (its na_values documentation), the empty field aside
NA_TEXT: frozenset[str] = frozenset(
    ("#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A", "NA")
    + ("NULL", "NaN", "None", "n/a", "nan", "null")
)


def read_csv_noting_na_strings(path: Path, keys: Sequence[str] = ()) -> pd.DataFrame:
    """A CSV file read as pandas reads it (NA_TEXT values are missing), noting in ``frame.attrs[NA_ATTR]``
    where such text stood in an otherwise numeric column: "n/a" in a column of numbers is worth a line. The
    join key columns ``keys`` are read by :func:`key_columns`."""
    header = pd.read_csv(path, nrows=0).columns if keys else ()
    text = {k: str for k in keys if k in header}
    frame = key_columns(pd.read_csv(path, keep_default_na=False, na_values=[""], dtype=text or None), list(text))
    noted: dict[str, tuple[int, int, str]] = {}
    for col in frame.select_dtypes(include=["object", "string"]).columns:
        s = frame[col]
        is_na = s.isin(NA_TEXT).to_numpy()
        if not is_na.any():
            continue
        rest = s[~is_na]
        numbers = pd.to_numeric(rest, errors="coerce")
        if (numbers.notna() | rest.isna()).all():  # the others are numbers: the column is numeric, as pandas reads it
            first = int(np.flatnonzero(is_na)[0])
            noted[str(col)] = (int(is_na.sum()), first, str(s.iloc[first]))
            frame[col] = pd.to_numeric(s.mask(is_na))
        else:
            frame[col] = s.mask(is_na)
    frame.attrs[NA_ATTR] = noted
    return frame


#: a number written with a leading zero ("00501", "-01"): a code, whose zeros a number would lose
ZERO_PADDED = re.compile(r"^[+-]?0\d")


def key_columns(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """``frame`` whose key columns ``keys``, read as text, are numbers as pandas would read them, unless one of
    their values is zero-padded (a code such as a zip code "00501": text, its zeros kept, so "00501" never joins
    "501"), and whole numbers written as decimals ("1412.0", as a column once holding a NaN is written) are
    integers. The rule reads each file alone, so two files of the same codes read alike."""
    for k in keys:
        s = frame[k]
        if s.dropna().astype(str).str.match(ZERO_PADDED).any():
            continue
        try:
            frame[k] = whole_as_integers(pd.to_numeric(s))
        except (ValueError, TypeError):
            continue  # text keys stay text
    return frame


def whole_as_integers(keys: pd.Series) -> pd.Series:
    """A float key column whose values are all whole numbers (``1412.0``: an integer column that once held a
    missing value, as CSV and Parquet writers keep it) as int64, so it joins a column of the same integers;
    any other column as it is."""
    x = keys.to_numpy()
    whole = x.dtype.kind == "f" and np.isfinite(x).all() and (x == np.round(x)).all() and (np.abs(x) < 2**53).all()
    return keys.astype(np.int64) if whole else keys


def parquet_keys(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """A Parquet file's join key columns ``keys``: whole-number floats as integers (:func:`whole_as_integers`),
    as a CSV file's are read."""
    for k in keys:
        if k in frame.columns:
            frame[k] = whole_as_integers(frame[k])
    return frame


def is_parquet(path: Path) -> bool:
    """Whether ``path`` names a Parquet file (.parquet or .pq, as a table's source may)."""
    return path.suffix.lower() in (".parquet", ".pq")


def read_rows_file(path: Path, keys: Sequence[str] = ()) -> pd.DataFrame:
    """New rows to score from a .parquet / .pq or (any other suffix) CSV file, read as a table's source is: text for a
    missing number noted (:func:`read_csv_noting_na_strings`), booleans as flags (:func:`booleans_as_flags`).
    pandas' and pyarrow's errors pass through (the caller names the file)."""
    parquet = is_parquet(path)
    frame = parquet_keys(pd.read_parquet(path), keys) if parquet else read_csv_noting_na_strings(path, keys)
    return booleans_as_flags(frame)


def header_names(path: Path, suffix: str, frame: pd.DataFrame) -> list[str]:
    """The column names as the file's header has them (pandas renames a repeated CSV name to NAME.1)."""
    if suffix == ".csv":
        return [
            str(c) for c in pd.read_csv(path, nrows=1, header=None, dtype=str, keep_default_na=False).iloc[0].tolist()
        ]
    return [str(c) for c in frame.columns]
