"""The centralized baseline's registry entry and settings (TablePuppet Sec. 6).

The baseline trains the global model on the materialized join in one place, so it has no client phases:
its protocol is empty and strategies/centralized.py runs it without Flower (``python -m simulations.run
algorithm=centralized``). It is registered like the federated algorithms so that one registry lists every
``algorithm=`` selector with its settings and the privacy it supports.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpflower.guard import Protocol
from tpflower.params import AlgorithmParams, nonnegative_int, one_of, or_word, param, positive
from tpflower.phases.gbdt import TREE_MODELS, WHY_TREE_MODELS, GBDTParams
from tpflower.phases.join_sgd import MIN_STEPS
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
    # fewest mini-batch steps without privacy, as algorithm=sgd's: a training join of few batches trains more
    # epochs than `epochs`; 0: exactly `epochs` (docs/algorithms.md#small-training-joins)
    min_steps: int = param(nonnegative_int, MIN_STEPS)


#: (selector, server class, settings, summary); the GBDT is algorithm=gbdt's reference, with gbdt's settings
_BASELINES = (
    ("centralized", "Centralized", CentralizedParams, "SGD or exact ridge on the materialized join"),
    (
        "centralized_gbdt",
        "CentralizedGBDT",
        GBDTParams,
        "histogram GBDT on the materialized join (gbdt's reference)",
    ),
)
for _selector, _cls, _params, _what in _BASELINES:
    for _scenario in ("join", "ucq"):  # the union is materialized like the join
        register(
            AlgorithmEntry(
                _selector,
                _selector,
                _scenario,
                "centralized",
                _cls,
                Protocol(()),
                _params,
                feature_dp=False,
                why_no_feature_dp=WHY_NO_FEATURE_DP,
                federated=False,
                summary=f"centralized baseline: {_what}",
                **({"models": TREE_MODELS, "why_models": WHY_TREE_MODELS} if _params is GBDTParams else {}),
            )
        )
