"""The centralized baseline's registry entry and settings (TablePuppet Sec. 6).

The baseline trains the global model on the materialized join in one place, so it has no client phases:
its protocol is empty and strategies/centralized.py runs it without Flower (``python -m simulations.run
algorithm=centralized``). It is registered like the federated algorithms so that one registry lists every
``algorithm=`` selector with its settings and the privacy it supports.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpflower.guard import Protocol
from tpflower.params import AlgorithmParams, one_of, or_word, param, positive
from tpflower.phases.gbdt import GBDTParams
from tpflower.registry import AlgorithmEntry, register

#: Why the centralized baseline refuses feature DP (shown in the error).
WHY_NO_FEATURE_DP = (
    "the centralized baseline trains one model on the materialized join (features of all tables in one place); "
    "there is no per-client local model whose table row could be the privacy unit"
)


@dataclass(frozen=True)
class CentralizedParams(AlgorithmParams):
    """algorithm.* of the centralized baseline (conf/algorithm/centralized.yaml)."""

    solver: str = param(one_of("sgd", "exact"), "sgd")  # exact: closed-form ridge (linear regression only)
    optimizer: str = param(one_of("sgd", "adam"), "sgd")  # sgd: Eq. 6, the update the federated SGD applies
    lr: float = param(positive, 0.1)
    batch_size: int | str = param(or_word(positive, "full"), 256)


for _scenario in ("join", "ucq"):  # the union is materialized like the join
    register(
        AlgorithmEntry(
            "centralized",
            "centralized",
            _scenario,
            "centralized",
            "Centralized",
            Protocol(()),
            CentralizedParams,
            feature_dp=False,
            why_no_feature_dp=WHY_NO_FEATURE_DP,
            federated=False,
            summary="centralized baseline: SGD or exact ridge on the materialized join",
        )
    )


# the central histogram GBDT on the materialized join: the reference of algorithm=gbdt, with gbdt's settings
for _scenario in ("join", "ucq"):
    register(
        AlgorithmEntry(
            "centralized_gbdt",
            "centralized_gbdt",
            _scenario,
            "centralized",
            "CentralizedGBDT",
            Protocol(()),
            GBDTParams,
            feature_dp=False,
            why_no_feature_dp=WHY_NO_FEATURE_DP,
            federated=False,
            summary="centralized baseline: histogram GBDT on the materialized join (gbdt's reference)",
        )
    )
