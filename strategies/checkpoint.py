"""The server's checkpoint: what the strategy built in setup (mapping, splits, labels), pickled once into
RUN_DIR/checkpoint-setup.pkl, and after every epoch the run record so far, the meters and the training loop's
state (e.g. ADMM's z, lambda and the clients' last predictions) into RUN_DIR/checkpoint.pkl; each written
atomically and streamed to the file (a crash leaves the previous epoch's file; no second copy in memory).

The file is the server's own (it holds nothing the server did not hold while running) and it is read only
by a run resumed in the same run dir with the same config (``resume=true``); the clients' side of the same
epoch is in each node's own store (tpflower.checkpoint).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

from tpflower.checkpoint import atomic_write, run_key as _key
from tpflower.owner import redact

CHECKPOINT = "checkpoint.pkl"
SETUP_CHECKPOINT = "checkpoint-setup.pkl"


def _config(cfg: Any) -> dict[str, Any]:
    """The run's config without its secret (the checkpoint never holds the join-key secret)."""
    return redact(json.loads(_key(cfg)))


def save_checkpoint(path: Path, cfg: Any, state: dict[str, Any]) -> None:
    record = {"config": _config(cfg), **state}
    atomic_write(path, lambda f: pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL))


def load_checkpoint(path: Path, cfg: Any) -> dict[str, Any]:
    """The checkpoint in ``path``, if it was made by a run of the same config (resume settings aside)."""
    with open(path, "rb") as f:
        state = pickle.load(f)
    if state.get("config") != _config(cfg):
        old, new = state["config"], _config(cfg)
        differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ValueError(f"the checkpoint {path} was made by another config (differs in: {', '.join(differ)}); "
                         "resume with the run's own settings")
    return state
