"""Atomic file writes: a reader, or a crash, sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(
    path: Path, data: bytes | Callable[[Any], None], dir_mode: int = 0o777, mode: int | None = None
) -> None:
    """Write ``data`` (bytes, or a function writing to the open binary file) to ``path`` atomically; the file is
    ``mode`` (None: 0600, mkstemp's) and missing parent folders are made with ``dir_mode`` (0o700: the owner's
    alone). A failed write leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=dir_mode)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
