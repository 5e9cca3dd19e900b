"""CELU-VFL (Fu et al., VLDB 2022, "Towards Communication-efficient Vertical Federated Learning Training via
Cache-enabled Local Updates") on TP-Join-SGD and VFL-SGD: cached local updates between exchanges.

The server protocol is TP-Join-SGD's (one round trip per exchanged batch, pipelined); what changes is the
client (tpflower/phases/celu.py): after the exchange step on batch b it caches (U_i, h it sent, Y_i it got)
and takes up to R local steps on cached batches before predicting batch b + 1. Every table is a "party A":
tpflower's server holds no model, so the paper's party-B update has no counterpart. FedBCD is W=1 with
xi=null; vanilla is R=0 (then exactly TP-Join-SGD). The epoch line shows the local steps per round (mean over
the tables).

Feature DP is refused: replaying a cached batch up to R more times breaks the per-step subsampling the
accountant assumes (each batch would have to be accounted as one Gaussian mechanism with the noise scaled by
sqrt(R + 1)). Label DP composes unchanged (the labels are randomized once, before they leave their owner).
"""

from __future__ import annotations

import numpy as np

from strategies.join_sgd import TPJoinSGD
from tpflower.phases.celu import CELUParams


class TPJoinCELU(TPJoinSGD):
    algorithm = "tp_join_celu"
    params_type = CELUParams
    checkpointed = TPJoinSGD.checkpointed + ("local_steps",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.params.similarity == "hidden" and str(self.cfg.model.kind) != "mlp":
            raise ValueError("algorithm.similarity=hidden compares the MLP's last hidden layer: it needs model=mlp")
        self.local_steps: list[float] = []  # per exchange round: the mean over tables of the local steps taken

    def after_round(self, replies) -> None:
        self.local_steps.append(float(np.mean([int(m.get("local_steps", 0)) for _, m in replies.values()])))

    def round_extra(self) -> dict[str, float]:
        return {"local_steps_per_round": float(np.mean(self.local_steps)) if self.local_steps else 0.0}


class VFLCELU(TPJoinCELU):
    """CELU-VFL as the paper: the same on the expanded tables (|B| rows per client per batch)."""

    algorithm = "vfl_celu"
    expand = True
