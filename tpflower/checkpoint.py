"""Checkpoints of a run, both sides: the server's (RUN_DIR/checkpoint*.pkl) and each node's own.

The server's: what the strategy built in setup (mapping, splits, labels), pickled once into
RUN_DIR/checkpoint-setup.pkl, and after every epoch the run record so far, the meters and the training loop's
state (e.g. ADMM's z, lambda and the clients' last predictions) into RUN_DIR/checkpoint.pkl; each written
atomically and streamed to the file (a crash leaves the previous epoch's file; no second copy in memory).
The file is the server's own (it holds nothing the server did not hold while running) and it is read only
by a run resumed in the same run dir with the same config (``resume=true``).

A node's own checkpoints: its state (context.state) after an epoch, kept where its owner says, so that a
run stopped by a crash (of the server, of a node) can resume.

The server marks an epoch's last training message with ``checkpoint: E`` and the run's id ``run_id``; after
answering it the client writes its whole state (theta, optimiser, ADMM terms, preprocessing rule, accepted
privacy, protocol position, DP accountant) to ``STATE_DIR/<run>/epoch-E.rd`` (atomically; the last two kept,
since the server may die before its own checkpoint of E). ``<run>`` is a digest of the run id, the run's
config and the table shard, so a checkpoint only ever restores into the same run.

A resumed run sends ``resume`` {run_id, epoch, privacy} instead of the setup rounds: the client, still
fresh, loads its state of that epoch, checks the stored privacy against its owner's floor and against the
message, and answers nothing else. DP: every DP step also advances a ledger (``dp-ledger.npy``) that never
goes back; a resumed client continues from the ledger, not from the checkpoint, so restoring an earlier
epoch never hands out privacy budget twice (the plan's step limit still holds).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common import RecordDict
from omegaconf import DictConfig, OmegaConf

from tpflower import privacy as dp  # torch-free: the hello path imports this module
from tpflower.files import atomic_write
from tpflower.guard import GuardData, ProtocolRefusal
from tpflower.owner import OwnerSettings, redact
from tpflower.records import recorddict_bytes, recorddict_of

CHECKPOINT = "checkpoint.pkl"
SETUP_CHECKPOINT = "checkpoint-setup.pkl"


def _config(cfg: Any) -> dict[str, Any]:
    """The run's config without its secret (the checkpoint never holds the join-key secret)."""
    return redact(json.loads(run_key(cfg)))


def _written_by() -> str:
    from importlib.metadata import version  # noqa: PLC0415

    return f"tpflower {version('tpflower')}"


def save_checkpoint(path: Path, cfg: Any, state: dict[str, Any]) -> None:
    record = {"config": _config(cfg), "written_by": _written_by(), **state}
    atomic_write(path, lambda f: pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL))


def config_changes(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The settings that differ between two configs, as their dotted leaf names (``algorithm.trees``, not
    ``algorithm``), sorted; a setting only one of them has counts too."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            if k not in old or k not in new:
                out += [f"{prefix}{k}"] if old.get(k) != new.get(k) else []
            else:
                out += config_changes(old[k], new[k], f"{prefix}{k}.")
        return out
    return [] if old == new else [prefix.removesuffix(".")]


def load_checkpoint(path: Path, cfg: Any) -> dict[str, Any]:
    """The checkpoint in ``path``, if this tpflower wrote it for a run of the same config (resume settings
    aside); a checkpoint of another tpflower (its objects pickled in another layout) is refused in one line."""
    another = (
        f"the checkpoint {path} was written by another tpflower than this one ({_written_by()}) and cannot be "
        "resumed: start the run again in a new run dir (or with resume=false)"
    )
    try:
        with open(path, "rb") as f:
            state = pickle.load(f)
    except (AttributeError, ImportError, TypeError, EOFError, pickle.UnpicklingError) as err:
        raise ValueError(f"{another} ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or state.get("written_by") != _written_by():
        raise ValueError(another)
    if state.get("config") != _config(cfg):
        differ = config_changes(state["config"], _config(cfg))
        raise ValueError(
            f"the checkpoint {path} was made by another config (differs in: {', '.join(differ)}); "
            "resume with the run's own settings"
        )
    return state


KEEP = 2  # checkpoints kept per run: the server's last one is at most one epoch behind the clients'
IGNORED_CONFIG_KEYS = ("resume", "nodes")  # resuming (and patience) do not make another run


def run_key(cfg: Any) -> str:
    """The run's config (a DictConfig or mapping) as a string, without the settings that do not make another
    run (resume, the server's patience): what names a run's checkpoints, on the nodes and on the server."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    assert isinstance(container, dict)
    return json.dumps({k: v for k, v in container.items() if k not in IGNORED_CONFIG_KEYS}, sort_keys=True, default=str)


class NodeStore:
    """The checkpoints of one client (table shard) for one run, under its owner's ``state_dir``."""

    def __init__(self, state_dir: str | Path, run_id: str, config_key: str, table: str, shard: int):
        digest = hashlib.sha256(f"{run_id}\0{config_key}\0{table}\0{shard}".encode()).hexdigest()[:24]
        self.dir = Path(state_dir) / f"{table}-{shard}-{digest}"

    def path(self, epoch: int) -> Path:
        return self.dir / f"epoch-{int(epoch)}.rd"

    def save(self, epoch: int, state: RecordDict) -> None:
        atomic_write(self.path(epoch), recorddict_bytes(state))
        for old in sorted(self.dir.glob("epoch-*.rd"), key=lambda p: int(p.stem.split("-")[1]))[:-KEEP]:
            old.unlink(missing_ok=True)

    def load(self, epoch: int) -> RecordDict | None:
        path = self.path(epoch)
        if not path.is_file():
            return None
        return recorddict_of(path.read_bytes())

    @property
    def ledger(self) -> Path:
        """Every DP step of this run, in any process (written under the owner's lock: tpflower.privacy.budget)."""
        return self.dir / "dp-ledger.npy"

    def ledger_history(self) -> np.ndarray | None:
        """The DP accountant history of every step this client ever took in this run."""
        return np.load(self.ledger) if self.ledger.is_file() else None


def steps(history: np.ndarray) -> int:
    """DP steps in an accountant history (rows of (noise multiplier, sample rate, steps))."""
    return int(np.asarray(history).reshape(-1, 3)[:, 2].sum())


class NodeState(typing.Protocol):
    """The client state a checkpoint saves and restores (tpflower.state.ClientState)."""

    @property
    def records(self) -> RecordDict: ...

    def scalar(self, name: str, default: Any = None) -> Any: ...

    def get(self, name: str) -> np.ndarray | None: ...

    def put(self, name: str, value: np.ndarray) -> None: ...


class NodeSettings(typing.Protocol):
    """The client settings that name its checkpoints (the client operator's ClientSettings)."""

    @property
    def owner(self) -> OwnerSettings: ...

    @property
    def table(self) -> str: ...

    @property
    def shard(self) -> int: ...


class CheckpointedClient(typing.Protocol):
    """What the checkpoints need of a client (the client operator, TableClient, provides it)."""

    @property
    def state(self) -> NodeState: ...

    @property
    def settings(self) -> NodeSettings: ...

    @property
    def data(self) -> GuardData: ...

    @property
    def config_key(self) -> str: ...

    def privacy(self) -> Mapping[str, Any]: ...


def store_of(client: CheckpointedClient, config: Mapping[str, Any]) -> NodeStore | None:
    """This client's store for the run ``config`` names (None when its owner keeps no checkpoints)."""
    s = client.settings
    if s.owner.state_dir is None or not config.get("run_id"):
        return None
    return NodeStore(s.owner.state_dir, str(config["run_id"]), client.config_key, s.table, s.shard)


def after_message(client: CheckpointedClient, config: Mapping[str, Any]) -> None:
    """After answering: checkpoint the state if the server marked this message as an epoch's last."""
    if "checkpoint" not in config:
        return
    store = store_of(client, config)
    if store is not None:
        store.save(int(config["checkpoint"]), client.state.records)


def run_ledger(client: CheckpointedClient) -> Path | None:
    """The DP ledger of the current run (None if this node keeps no checkpoints or the run has no id)."""
    run_id = client.state.scalar("run_id")
    store = None if run_id is None else store_of(client, {"run_id": run_id})
    return None if store is None else store.ledger


def resume(client: CheckpointedClient, config: Mapping[str, Any]) -> tuple[dict, dict[str, Any]]:
    """The ``resume`` phase (module docstring): restore the state of epoch ``config["epoch"]``."""
    s = client.settings
    where = f"table {s.table!r} shard {s.shard}"
    if client.state.records:
        raise ProtocolRefusal(f"{where} refuses phase 'resume': this client has already started")
    store = store_of(client, config)
    epoch = int(config.get("epoch", -1))
    saved = None if store is None else store.load(epoch)
    if saved is None:
        kept = "keeps no checkpoints" if store is None else f"has no checkpoint of epoch {epoch} in {store.dir}"
        raise ProtocolRefusal(f"{where} cannot resume: this node {kept} for this run (same run id and config)")
    for name, record in saved.items():
        client.state.records[name] = record
    asked = dp.privacy_from_message(config)
    stored = client.privacy()
    s.owner.check_privacy(stored, label_owner=client.data.y is not None)  # the floor may have risen since
    if dict(dp.privacy_message(asked)) != dict(dp.privacy_message(stored)):
        raise ProtocolRefusal(
            f"{where} refuses to resume with privacy {asked.get('name')!r}: the run's checkpoint "
            f"was made under {stored.get('name')!r} settings"
        )
    ledger = store.ledger_history()  # type: ignore[union-attr]
    kept_history = client.state.get("dp_history")
    after = 0
    if ledger is not None and (kept_history is None or steps(ledger) > steps(kept_history)):
        after = steps(ledger) - (0 if kept_history is None else steps(kept_history))
        client.state.put("dp_history", ledger)  # the budget spent after the checkpoint stays spent
    # the server planned the steps of every epoch and sent those after the checkpoint: their count is its own
    return {}, {"resumed": epoch, **({"dp_steps_after_checkpoint": after} if after else {})}
