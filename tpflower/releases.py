"""The owner's ledger of exact releases, across runs (docs/threat-model.md, "Exact releases").

One unit is one reply computed from the owner's features on arrays the server supplied, without DP noise:
the phases that give one declare it (``Phase(..., exact=True)``, tpflower.guard), and the client checks the
cap before the handler runs and charges the unit once the reply is computed, before it is sent
(:func:`charge_exact_release`; a refused phase is not charged). A server choosing those arrays learns exact
functions of the features it chose; two runs that differ in one input difference out one measurement, so
runs are not free: the count lives in the owner's ``state_dir`` (the ledger file of the DP budget,
tpflower.privacy.budget: written atomically, under its lock) and is bounded per algorithm family by the
owner's ``exact_releases`` setting, whose default is :data:`DEFAULT_CAPS`. A simulation, where the user plays
every owner, keeps no ledger (its runs are bounded by nothing but the user's own settings).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tpflower.guard import refusal
from tpflower.owner import TOTAL_RELEASES
from tpflower.privacy.budget import OwnerBudget

#: The family a prediction request's replies would be charged to (tpflower.phases.predict declares none exact:
#: a request scores the owner's saved model, which the server does not choose, on the owner's new rows).
PREDICTION = "predict"

#: Exact releases one owner's node allows per family over all runs, when its settings name none: 20 times the
#: most one node released in one default run of the family on the bundled datasets (measured with
#: simulations/bench/releases.py; bench_results/releases.json). A family without an entry here (and none in
#: the owner's ``exact_releases``) answers no exact release on a node that keeps a ledger.
DEFAULT_CAPS: dict[str, int] = {
    "join_sgd": 45_220,  # TP-Join-SGD, VFL-SGD: 2,261 on nycflights13 (10 epochs of mini-batches)
    "celu": 45_220,  # CELU-VFL: 2,261 on nycflights13
    # TP-UCQ-SGD: 1,009 on the synthetic schema (the only bundled union a default run takes: 36 epochs of its 14
    # mini-batches, algorithm.min_steps)
    "ucq_sgd": 20_180,
    "join_admm": 140,  # TP-Join-ADMM, VFL-ADMM: 7 on movielens and nycflights13
    "ucq_admm": 2_200,  # TP-UCQ-ADMM: 110 on the synthetic schema (inner consensus rounds)
    "pcg": 220,  # 11 on movielens and nycflights13
    "lbfgs": 400,  # 20 on movielens and nycflights13
    "coreset": 460,  # 23 (DIS and the ridge on the coreset)
    "kmeans": 120,  # 6 (coreset k-means; DistDim: 2)
    "gbdt": 74_340,  # boosted trees: 3,717 on movielens (300 trees: one reply per expansion step and evaluation)
}

#: how many default runs the default cap allows (the factor behind DEFAULT_CAPS)
DEFAULT_RUNS = 20

_LOG = logging.getLogger("tpflower")


def release_cap(caps: Mapping[str, int] | None, family: str) -> int | None:
    """The owner's cap of ``family`` (its ``exact_releases``, else :data:`DEFAULT_CAPS`); None: no default."""
    if caps is not None and family in caps:
        return int(caps[family])
    return DEFAULT_CAPS.get(family)


def charge_exact_release(client: Any, phase: str, dry_run: bool = False) -> None:
    """One exact release of ``phase`` charged to the owner's ledger, under its lock, once its reply is computed
    and before it is sent; refused (nothing leaves) when it would pass the owner's cap for the client's family.
    ``dry_run``: only the check, before the phase computes anything. The refusal line names the table, the
    family and the setting, never the counts (those go to the node's log)."""
    s = client.settings
    owner = s.owner
    if owner.state_dir is None or not owner.deployed:  # a simulation: the user plays every owner
        return
    family = client.release_family
    cap = release_cap(owner.exact_releases, family)
    if cap is None:
        raise refusal(
            client,
            f"phase {phase!r} is an exact release of family {family!r}, for which its owner names no cap "
            "(exact_releases in its settings)",
        )
    budget = OwnerBudget(owner.state_dir, s.table, s.shard)
    with budget.locked():
        ledger = budget.read()
        spent = dict(ledger.get("exact") or {})
        after = int(spent.get(family, 0)) + 1
        if after > cap:
            raise refusal(
                client,
                f"phase {phase!r}: its owner's cap on exact releases of family {family!r} over all runs is reached "
                "(exact_releases in its settings)",
                f"{after - 1} released, cap {cap}",
            )
        total = (owner.exact_releases or {}).get(TOTAL_RELEASES)
        together = sum(int(n) for n in spent.values()) + 1
        if total is not None and together > int(total):
            raise refusal(
                client,
                f"phase {phase!r}: its owner's cap on exact releases of all families together over all runs is "
                "reached (exact_releases.total in its settings)",
                f"{together - 1} released, cap {total}",
            )
        if dry_run:
            return
        spent[family] = after
        budget.write({**ledger, "exact": spent})


def released(state_dir: str, table: str, shard: int) -> dict[str, int]:
    """The exact releases charged so far per family (the owner's ledger; for the owner and its tests)."""
    return {k: int(v) for k, v in (OwnerBudget(state_dir, table, shard).read().get("exact") or {}).items()}
