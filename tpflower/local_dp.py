"""Feature DP of one client (TablePuppet Sec. 4.3; tpflower.privacy): the privacy unit is one row of its table.

The first training message (``predict`` / ``admm_setup``) carries ``dp_steps`` and ``dp_q`` (the local DP
steps of the whole run and the per-step sample rate of a table row, planned by the server); :meth:`LocalDP.init`
derives sigma from them ONCE and stores it, never at a smaller q than the node observes itself. Every update is
then a DP step of a :class:`~tpflower.privacy.trainer.DPLocalTrainer` rebuilt per message from theta and the
accountant history in ``context.state`` (:meth:`LocalDP.trainer`); :meth:`LocalDP.done` charges it to the run's
and the owner's ledgers (tpflower.privacy.budget), refuses a step beyond the plan, beyond the accepted epsilon
or beyond the owner's total, and reports ``eps`` (spent at ``delta``). Noise and sampling generators are seeded
from the OS entropy.
"""

from __future__ import annotations

import math
import secrets
import typing
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from tpflower import checkpoint
from tpflower import privacy as dp
from tpflower.local_table import LocalTable
from tpflower.mapping import segment_sum
from tpflower.privacy.budget import (
    BudgetExhausted,
    OwnerBudget,
    added,
    feature_room,
    merged,
    owner_bound,
    owner_delta,
    steps_of,
)
from tpflower.privacy.trainer import DPLocalTrainer
from tpflower.state import ClientState

#: slack on the epsilon checks: Opacus calibrates sigma to within 0.01 of the target epsilon
EPS_TOLERANCE = 0.02


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

    def init(self, config: Mapping[str, Any], own_rate: Callable[[], float]) -> None:
        """Feature DP: sigma for the run's planned local steps, computed once and stored, at the plan's
        ``dp_q`` unless ``own_rate()`` (what the node itself observes: ADMM its own Poisson rate b / n_a, SGD the
        share of its rows in the first batch) is beyond chance for it (:meth:`credible_rate`): an understated
        ``dp_q`` buys no smaller sigma. The plan is refused when it would take the owner's ledger beyond
        ``privacy.total_epsilon``."""
        if not self.on or self.client.state.scalar("dp_sigma") is not None:
            return
        if "dp_steps" not in config or "dp_q" not in config:
            raise RuntimeError(
                f"table {self.client.settings.table!r}: feature DP is on but the server sent no DP plan "
                "(dp_steps, dp_q)"
            )
        priv = self.client.privacy()
        steps = int(config["dp_steps"])
        q = min(max(float(config["dp_q"]), 1e-12), 1.0)
        if not self.paper_accounting:
            q = self.credible_rate(q, float(own_rate()))
        # no step planned (a shard without active rows): sigma is never used; done() refuses any step
        sigma = dp.noise_multiplier_for(priv["epsilon"], priv["delta"], q, steps) if steps >= 1 else 0.0
        if steps >= 1:
            self.check_total([[float(sigma), q, float(steps)]])
        self.client.state.set_scalar("dp_sigma", float(sigma))
        self.client.state.set_scalar("dp_q", q)
        self.client.state.set_scalar("dp_steps", steps)

    @property
    def paper_accounting(self) -> bool:
        """The owner's floor accepts the paper's q = B / N (``sample_rate: batch``): the plan's q is then used
        as sent. Otherwise (the default, worst_row) the node accounts the sampling it observes."""
        return str(self.client.settings.owner.privacy.get("sample_rate", "worst_row")) == "batch"

    def step_rate(self, n_rows: int) -> float:
        """The q a DP step over ``n_rows`` of this client's table rows is accounted at: the calibrated q, or the
        share of its rows the step actually holds when that is beyond chance (an understated plan)."""
        q = float(self.client.state.scalar("dp_q"))
        if self.paper_accounting:
            return q
        return self.credible_rate(q, int(n_rows) / max(len(self.client.local.X), 1))

    def credible_rate(self, q: float, observed: float) -> float:
        """``q``, unless the share of rows ``observed`` in one step is beyond what sampling at rate q gives by
        chance (more than q + 4 sd + 1 / n of a binomial share of the n table rows): then ``observed``. An
        honest plan's q is each row's worst inclusion probability, so its steps fluctuate below the bound."""
        n = max(len(self.client.local.X), 1)
        slack = 4.0 * math.sqrt(q * (1.0 - q) / n) + 1.0 / n
        return q if observed <= q + slack else min(observed, 1.0)

    def batch_rate(self, rows: np.ndarray) -> float:
        """SGD: the share of this client's table rows in a batch of its ``rows`` (joined rows under VFL)."""
        expand = self.client.state.get("expand")
        table_rows = np.unique(rows if expand is None else expand[np.asarray(rows, dtype=np.int64)])
        return len(table_rows) / max(len(self.client.local.X), 1)

    def admm_rate(self, G: np.ndarray) -> float:
        """ADMM: the node's own Poisson rate ``min(1, b / n_a)`` over its active table rows (Eq. 16)."""
        _, G_t, _ = self.admm_rows(np.asarray(G, dtype=np.float64), np.zeros((len(G), 1)))
        n_a = int(np.count_nonzero(G_t))
        return min(1.0, self.client.settings.algorithm.local_batch_size / n_a) if n_a else 1.0

    # ------------------------------------------------------------------------------------------ the budget

    def bounds(self) -> tuple[float, float, float]:
        """(the run's accepted epsilon, its delta, the owner's total_epsilon) and the floor's delta."""
        floor, run = self.client.settings.owner.privacy, self.client.privacy()
        return float(run["epsilon"]), float(run["delta"]), owner_bound(floor, run, "total_epsilon")

    def owner_delta(self) -> float:
        return owner_delta(self.client.settings.owner.privacy, self.client.privacy())

    def check_total(self, plan: list[list[float]]) -> None:
        """Refuse a plan that would take the owner's ledger (every earlier run) beyond its total budget."""
        budget = self.budget()
        if budget is None:
            return
        _, run_delta, total = self.bounds()
        delta = self.owner_delta()
        with budget.locked():
            history = list(budget.read()["dp"])  # one read: before, after and what fits from the same ledger
        before, after = dp.rdp_epsilon(merged(history), delta), dp.rdp_epsilon(merged(history + list(plan)), delta)
        if after > total * (1 + EPS_TOLERANCE):
            _, q, steps = plan[0]
            room = feature_room(history, total, delta, run_delta, q, int(steps))
            raise BudgetExhausted(
                f"{self.where}: this run's DP plan would bring its owner's feature-DP budget to epsilon "
                f"{after:.3g} (spent before: {before:.3g}); the owner allows {total:.3g} over all runs "
                f"(privacy.total_epsilon); {room}"
            )

    def budget(self) -> OwnerBudget | None:
        s = self.client.settings
        return None if s.owner.state_dir is None else OwnerBudget(s.owner.state_dir, s.table, s.shard)

    @property
    def where(self) -> str:
        return f"table {self.client.settings.table!r} shard {self.client.settings.shard}"

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
        """Charge the steps of this message, store the run's accountant history, report the epsilon spent;
        remove the Opacus hooks from the model.

        The steps are charged, under the owner's lock, to this run's ledger (every process of the run: fresh,
        restarted with the same run id, resumed, concurrent) and to the owner ledger (every run). Refused, so
        that nothing of the step leaves the node: more steps than the plan, a run epsilon (at the sampling the
        node observed) above the accepted one, or an owner total above ``privacy.total_epsilon``.
        The hooks come off whatever happens: a refused step must not leave them on the node's cached model
        (the node keeps serving, and its next DP step would wrap the model twice)."""
        try:
            planned = int(self.client.state.scalar("dp_steps"))
            if trainer.steps > planned:  # nothing of this step leaves the client
                raise BudgetExhausted(
                    f"{self.where}: {trainer.steps} DP steps exceed the {planned} the noise was calibrated for "
                    "(privacy budget exhausted)"
                )
            before = self.client.state.get("dp_history")
            new = added([] if before is None else before.tolist(), trainer.accountant_state())
            epsilon, delta, total = self.bounds()

            def check(run_after: list[list[float]], owner_after: list[list[float]]) -> None:
                if steps_of(run_after) > planned:
                    raise BudgetExhausted(
                        f"{self.where}: {steps_of(run_after)} DP steps exceed the {planned} the noise was calibrated "
                        "for (privacy budget exhausted), counting every process of this run (restarts, resumes)"
                    )
                spent = dp.rdp_epsilon(run_after, delta)
                if spent > epsilon * (1 + EPS_TOLERANCE):
                    raise BudgetExhausted(
                        f"{self.where}: at the sampling this node observes the run would spend epsilon "
                        f"{spent:.3g} > the accepted {epsilon:.3g} (an understated DP plan)"
                    )
                if owner_after is not run_after:
                    owner = dp.rdp_epsilon(owner_after, self.owner_delta())
                    if owner > total * (1 + EPS_TOLERANCE):
                        raise BudgetExhausted(
                            f"{self.where}: this step would bring its owner's feature-DP budget to epsilon "
                            f"{owner:.3g}; the owner allows {total:.3g} over all runs (privacy.total_epsilon)"
                        )

            budget = self.budget()
            if budget is None:  # a simulated node without a run dir: this run is all its owner ever runs
                run_after = merged(([] if before is None else before.tolist()) + new)
                check(run_after, run_after)
            else:
                run_after = budget.charge_dp(new, checkpoint.run_ledger(self.client), check)
            history = np.asarray(run_after, dtype=np.float64).reshape(-1, 3)
            self.client.state.put("dp_history", history)
            metrics["eps"] = dp.rdp_epsilon(run_after, delta)
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
