"""Feature DP of one client (TablePuppet Sec. 4.3; tpflower.privacy): the privacy unit is one row of its table.

The first training message (``predict`` / ``admm_setup``) carries ``dp_steps`` and ``dp_q`` (the local DP
steps of the whole run and the per-step sample rate of a table row, planned by the server); :meth:`LocalDP.init`
derives sigma from them ONCE and stores it. Every update is then a DP step of a
:class:`~tpflower.privacy.trainer.DPLocalTrainer` rebuilt per message from theta and the accountant history in
``context.state`` (:meth:`LocalDP.trainer`); :meth:`LocalDP.done` refuses a step beyond the plan and reports
``eps`` (spent at ``delta``). Noise and sampling generators are seeded from the OS entropy.
"""

from __future__ import annotations

import secrets
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tpflower import checkpoint
from tpflower import privacy as dp
from tpflower.local_table import LocalTable
from tpflower.mapping import segment_sum
from tpflower.privacy.trainer import DPLocalTrainer
from tpflower.state import ClientState


class DPClient(checkpoint.CheckpointedClient, typing.Protocol):
    """What the feature-DP services need of a client (the client operator, TableClient, provides it): its state,
    settings and accepted privacy, its preprocessed table, and what a checkpoint of its DP ledger needs."""

    @property
    def state(self) -> ClientState: ...

    @property
    def local(self) -> LocalTable: ...


class LocalDP:
    """The feature-DP services of ``client`` (its state, settings and accepted privacy)."""

    def __init__(self, client: DPClient):
        self.client = client

    @property
    def on(self) -> bool:
        """Whether the run's (accepted) privacy has feature DP."""
        return dp.uses_feature_dp(self.client.privacy())

    def init(self, config: Mapping[str, Any]) -> None:
        """Feature DP: sigma for the run's planned local steps and sample rate, computed once and stored."""
        if not self.on or self.client.state.scalar("dp_sigma") is not None:
            return
        if "dp_steps" not in config or "dp_q" not in config:
            raise RuntimeError(
                f"table {self.client.settings.table!r}: feature DP is on but the server sent no DP plan "
                "(dp_steps, dp_q)"
            )
        priv = self.client.privacy()
        steps, q = int(config["dp_steps"]), float(config["dp_q"])
        # no step planned (a shard without active rows): sigma is never used; done() refuses any step
        sigma = dp.noise_multiplier_for(priv["epsilon"], priv["delta"], q, steps) if steps >= 1 else 0.0
        self.client.state.set_scalar("dp_sigma", float(sigma))
        self.client.state.set_scalar("dp_q", q)
        self.client.state.set_scalar("dp_steps", steps)

    def trainer(self, model: torch.nn.Module) -> DPLocalTrainer:
        """A DP-SGD trainer around ``model`` (theta already loaded), with the accountant history of the run."""
        sigma = self.client.state.scalar("dp_sigma")
        if sigma is None:
            raise RuntimeError(f"table {self.client.settings.table!r}: a DP step before the DP plan arrived")
        history = self.client.state.get("dp_history")
        return DPLocalTrainer(
            model,
            noise_multiplier=float(sigma),
            max_grad_norm=float(self.client.privacy()["clip"]),
            sample_rate=float(self.client.state.scalar("dp_q")),
            history=[] if history is None else history.tolist(),
        )  # no seed: the noise generator is seeded from the OS entropy

    def done(self, trainer: DPLocalTrainer, metrics: dict[str, Any]) -> None:
        """Store the accountant history, report the epsilon spent, remove the Opacus hooks from the model.

        The hooks come off whatever happens: a refused step must not leave them on the node's cached model
        (the node keeps serving, and its next DP step would wrap the model twice)."""
        try:
            planned = int(self.client.state.scalar("dp_steps"))
            if trainer.steps > planned:  # nothing of this step leaves the client
                raise RuntimeError(
                    f"table {self.client.settings.table!r} shard {self.client.settings.shard}: {trainer.steps} DP "
                    f"steps exceed the {planned} the noise was calibrated for (privacy budget exhausted)"
                )
            history = np.asarray(trainer.accountant_state(), dtype=np.float64).reshape(-1, 3)
            self.client.state.put("dp_history", history)
            checkpoint.record_dp_step(self.client, history)
            metrics["eps"] = trainer.epsilon(float(self.client.privacy()["delta"]))
        finally:
            trainer.close()

    def sample_generator(self) -> torch.Generator:
        """Row sampling of a DP theta-update: fresh per call, seeded from the OS entropy."""
        return torch.Generator().manual_seed(secrets.randbits(63))

    def table_rows(self, rows: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feature DP: the privacy unit is one TABLE row. Given the client's rows ``rows`` and their Y, the
        distinct table rows and Y summed over each one's rows. TP-Join: the rows are table rows already;
        VFL: they are joined rows, summed over the duplicates with the expand map p_i (Eq. 10 on the client)."""
        expand = self.client.state.get("expand")
        if expand is None:
            return rows, np.asarray(Y)
        U, inv = np.unique(expand[rows], return_inverse=True)
        return U, segment_sum(inv.reshape(-1), np.asarray(Y, dtype=np.float64), len(U))

    def admm_rows(self, G: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Feature DP, Eq. 16 over TABLE rows: (X, G, Y) of the table. VFL-ADMM (G = 1 per joined row) sums
        G and Y over each table row's joined rows, which gives exactly TP-Join-ADMM's per-row term."""
        expand = self.client.state.get("expand")
        X = self.client.local.X
        if expand is None:
            return X, G, np.asarray(Y)
        n = len(X)
        G_t = segment_sum(expand, np.asarray(G, dtype=np.float64), n)
        return X, G_t, segment_sum(expand, np.asarray(Y, dtype=np.float64), n)
