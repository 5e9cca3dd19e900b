"""The server's checkpoints of a run's epochs, as an object the strategy uses (files: tpflower.checkpoint).

A strategy that checkpoints gets an :class:`EpochCheckpoints`: ``begin`` starts the run fresh or resumes it
from the last checkpoint, ``config`` marks an epoch's last training message (each client checkpoints its own
state after answering it) and ``end_epoch`` writes the server's state. What setup built (the
:class:`~strategies.setup.JoinSetup`'s state) is written once, into checkpoint-setup.pkl, with the first
epoch; the run record (:class:`~strategies.evaluation.RunRecord`) and the training loop's state every epoch,
into checkpoint.pkl. A strategy without one (k-means: one shot, or a run without a run dir) gets
:data:`NO_CHECKPOINTS`, which starts fresh and writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tpflower import privacy as dp
from tpflower.checkpoint import CHECKPOINT, SETUP_CHECKPOINT, load_checkpoint, save_checkpoint


class Saved:
    """An object whose state is its attributes named in SAVED (a checkpoint keeps those, not its callables)."""

    SAVED: tuple[str, ...] = ()

    def state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.SAVED if hasattr(self, name)}

    def restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


class CheckpointedRun(Protocol):
    """What checkpointing needs of a strategy (strategies.base.LoJStrategy): its run id, its setup and run
    record (each with state() / restore()), the attributes its loop keeps, and a round to send ``resume``."""

    run_id: str
    clients: list
    privacy: Any
    join: Any
    record: Any
    checkpointed: tuple[str, ...]

    def send(self, payloads: dict) -> dict: ...

    def log(self, line: str) -> None: ...


class NoCheckpoints:
    """A run whose epochs are not checkpointed: it starts fresh and writes nothing."""

    def begin(self, strategy: CheckpointedRun, start: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        return 0, start()

    def config(self, epoch: int, run_id: str) -> dict[str, Any]:
        return {}

    def end_epoch(self, strategy: CheckpointedRun, epoch: int, loop: dict[str, Any]) -> None:
        pass


NO_CHECKPOINTS = NoCheckpoints()


class EpochCheckpoints(NoCheckpoints):
    """The checkpoints of a resumable run in ``run_dir`` (``resume``: start from the last one)."""

    def __init__(self, run_dir: Path, cfg: Any, resume: bool):
        self.run_dir, self.cfg, self.resume = run_dir, cfg, resume
        self.setup_saved = False
        if resume and not (run_dir / CHECKPOINT).is_file():
            raise ValueError(f"resume=true but there is no checkpoint {CHECKPOINT} in the run dir {run_dir}")

    def begin(self, strategy: CheckpointedRun, start: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """The epochs done and the training loop's state: (0, ``start()``) for a fresh run (``start`` runs the
        setup and the algorithm's first rounds); for ``resume=true`` the last checkpoint's, after a ``resume``
        round in which every client restores its own checkpoint of that epoch (tpflower.checkpoint)."""
        if not self.resume:
            return 0, start()
        saved = load_checkpoint(self.run_dir / CHECKPOINT, self.cfg)
        setup = load_checkpoint(self.run_dir / SETUP_CHECKPOINT, self.cfg)
        if setup["run_id"] != saved["run_id"]:
            raise ValueError(f"{SETUP_CHECKPOINT} and {CHECKPOINT} in {self.run_dir} are of different runs")
        epoch = int(saved["epoch"])
        strategy.run_id = str(saved["run_id"])
        replies = strategy.send(
            {
                k: (
                    {},
                    {
                        "phase": "resume",
                        "run_id": strategy.run_id,
                        "epoch": epoch,
                        **dp.privacy_message(strategy.privacy),
                    },
                )
                for k in strategy.clients
            }
        )
        strategy.join.restore(setup["setup"])
        strategy.record.restore(saved["record"])
        for name, value in saved["attributes"].items():
            setattr(strategy, name, value)
        self.setup_saved = True
        strategy.record.t0 = time.perf_counter() - float(saved["elapsed"])
        history = strategy.record.results.history
        after = f"{epoch} trees" if history and "trees" in history[-1].extra else f"epoch {epoch}"  # boosted trees
        strategy.log(f"resumed after {after} from {self.run_dir / CHECKPOINT}")
        for (table, shard), (_, metrics) in sorted(replies.items()):
            if int(metrics.get("dp_steps_after_checkpoint", 0)):  # said now, not at the run's last epoch
                n = int(metrics["dp_steps_after_checkpoint"])
                strategy.log(
                    f"warning: table {table!r} shard {shard} took {n} DP step(s) after the checkpoint of epoch "
                    f"{epoch}, which stay spent: its DP plan runs out {n} step(s) before the run's last epoch, where "
                    "the node refuses and the run stops (docs/deployment.md, checkpoint and resume); a new run "
                    "has a whole plan"
                )
        return epoch, saved["loop"]

    def config(self, epoch: int, run_id: str) -> dict[str, Any]:
        """Config of an epoch's last training message: each client checkpoints its state after answering it."""
        return {"checkpoint": int(epoch), "run_id": run_id}

    def end_epoch(self, strategy: CheckpointedRun, epoch: int, loop: dict[str, Any]) -> None:
        """Checkpoint the server's state after epoch ``epoch`` (atomically, into the run dir); what setup built
        is written with the first epoch only."""
        if not self.setup_saved:
            save_checkpoint(
                self.run_dir / SETUP_CHECKPOINT, self.cfg, {"run_id": strategy.run_id, "setup": strategy.join.state()}
            )
            self.setup_saved = True
        save_checkpoint(
            self.run_dir / CHECKPOINT,
            self.cfg,
            {
                "epoch": int(epoch),
                "run_id": strategy.run_id,
                "elapsed": strategy.record.elapsed(),
                "loop": loop,
                "record": strategy.record.state(),
                "attributes": {
                    name: getattr(strategy, name) for name in strategy.checkpointed if hasattr(strategy, name)
                },
            },
        )
