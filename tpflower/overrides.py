"""Hydra overrides as one string (a run config's ``overrides``, as ``flwr run`` and a deployment carry them) and
the ``hydra.searchpath`` override of a ``--config-dir``: no import beyond the standard library (a deployment's
launcher composes them before it starts any Flower process)."""

from __future__ import annotations

import re
from pathlib import Path

#: one override of a run config's ``overrides`` string: unquoted text, or text in single or double quotes (kept
#: for Hydra's grammar), so that a quoted value may hold spaces (a folder's path, a SQL query)
OVERRIDE_TOKEN = re.compile(r"""(?:[^\s'"]+|'[^']*'|"[^"]*")+""")


def split_overrides(overrides: str) -> list[str]:
    """The overrides of a run config's ``overrides`` string (``flwr run``'s, a deployment's): split at spaces
    outside quotes, the quotes kept (``hydra.searchpath=['file:///my data/conf']`` stays one override)."""
    return OVERRIDE_TOKEN.findall(overrides)


def searchpath_override(*folders: str | Path) -> str:
    """``hydra.searchpath`` with ``folders`` (``--config-dir``'s), each quoted so that a path may hold spaces."""
    paths = [str(Path(f).expanduser().resolve()).replace("\\", "\\\\").replace("'", "\\'") for f in folders]
    return "hydra.searchpath=[" + ",".join(f"'file://{p}'" for p in paths) + "]"
