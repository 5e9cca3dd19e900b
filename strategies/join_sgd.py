"""TP-Join-SGD (TablePuppet Eq. 10-13) and the VFL-SGD baseline (FDML/VAFL style).

Per mini-batch B the server asks each table for f_i on U_i = unique(p_i[B]) only, aggregates dl/dH over the
duplicates into Y_i (Eq. 10) and scatters it. Pipelining: the message with Y for batch b also carries the
rows of batch b+1 (and, with an epoch's last batch, the test rows), so one round trip per batch.

Feature DP (privacy=dpsgd): every client's step is a DP-SGD step over its TABLE rows (the VFL client sums its
duplicated rows first); one step per batch, ``sgd_steps(epochs, N, B)`` in all (plan_feature_dp).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from strategies.base import LoJStrategy
from tpflower import privacy as dp
from tpflower.batches import BatchPlan, SGDSchedule, batch_size_of, joined_predictions
from tpflower.losses import loss_grad_np, loss_np, sgd_parameter_noise
from tpflower.mapping import segment_sum
from tpflower.phases.join_sgd import SGDParams
from tpflower.privacy import sgd_steps, table_row_sample_rate


def sgd_aggregate(
    task: str, plan: BatchPlan, h: Mapping[str, np.ndarray], y: np.ndarray
) -> tuple[dict[str, np.ndarray], float]:
    """Y_iu = sum_{j in B, p_i(j) = u} dl(H_j; y_j)/dH_j for u in U_i (Eq. 10), and the batch's summed loss.

    h[t] holds f_i on the rows U_i (|U_i| x d_c); y the labels of the batch's joined rows.
    """
    H = joined_predictions(plan.inv, h)
    g = loss_grad_np(task, H, y)
    Y = {t: segment_sum(plan.inv[t], g, len(plan.U[t])).astype(h[t].dtype, copy=False) for t in plan.U}
    return Y, float(loss_np(task, H, y).sum())


EMPTY = np.zeros(0, dtype=np.int64)


def sgd_schedule(strategy: LoJStrategy) -> tuple[SGDSchedule, BatchPlan]:
    """The run's mini-batches over the training join (algorithm.batch_size, seed) and the plan of the rows
    every evaluation predicts (the validation rows, then the test rows)."""
    train, evaluated, cfg = strategy.train, strategy.evaluated, strategy.cfg
    B = batch_size_of(cfg.algorithm.batch_size, train.N)
    epochs = sgd_epochs(strategy, -(-train.N // B))
    schedule = SGDSchedule(train, B, epochs, np.random.default_rng(int(cfg.seed)))
    return schedule, BatchPlan.of(evaluated, np.arange(evaluated.N))


def sgd_epochs(strategy: LoJStrategy, per_epoch: int) -> int:
    """The run's epochs: ``epochs``, or more when its ``per_epoch`` mini-batch steps times ``epochs`` fall short
    of ``algorithm.min_steps`` (a small training join, a few batches long), unless the run has DP (feature DP:
    the noise of each step grows with the steps for the same epsilon; label DP: each epoch's evaluation is a
    release of the test labels), or full batches (``epochs`` gradient-descent steps:
    the iterations asked for) (docs/algorithms.md#small-training-joins)."""
    epochs = int(strategy.cfg.epochs)
    if str(strategy.privacy.get("name", "none")) != "none" or strategy.params.batch_size == "full":
        return epochs
    return epochs_for_steps(epochs, per_epoch, int(getattr(strategy.params, "min_steps", 0) or 0))


def epochs_for_steps(epochs: int, per_epoch: int, min_steps: int) -> int:
    """``epochs``, or the fewest epochs of ``per_epoch`` mini-batch steps that make ``min_steps``."""
    return epochs if per_epoch * epochs >= min_steps else -(-min_steps // per_epoch)


#: fewer mini-batch steps than this over a whole run are worth a line (a table smaller than the batch size)
FEW_STEPS = 100


def warn_few_steps(strategy: LoJStrategy, schedule: SGDSchedule) -> None:
    """One line when the run trains more epochs than ``epochs`` (:func:`sgd_epochs`), and one when its whole
    schedule holds fewer than :data:`FEW_STEPS` mini-batch steps: a training join a few batches long gets a few
    updates (one per epoch when it is smaller than the batch), as with algorithm.min_steps=0 or under DP."""
    epochs = int(strategy.cfg.epochs)
    if schedule.epochs > epochs:
        strategy.log(
            f"epochs: {schedule.per_epoch} mini-batch step(s) per epoch ({strategy.train.N:,} training rows, "
            f"algorithm.batch_size={strategy.cfg.algorithm.batch_size}): up to {schedule.epochs} epochs, not "
            f"{epochs}, for algorithm.min_steps={strategy.params.min_steps} steps (early stopping may end it sooner; "
            "algorithm.min_steps=0: exactly epochs)"
        )
    steps = schedule.per_epoch * schedule.epochs
    if steps < FEW_STEPS and strategy.cfg.algorithm.batch_size != "full":
        strategy.log(
            f"warning: {schedule.per_epoch} mini-batch step(s) per epoch ({strategy.train.N:,} training rows, "
            f"algorithm.batch_size={strategy.cfg.algorithm.batch_size}): {steps} updates in all; a smaller "
            "algorithm.batch_size or more epochs train further"
        )


def sgd_rounds(schedule: SGDSchedule, done: int) -> Iterator[tuple[int, tuple]]:
    """The schedule's rounds, numbered from 1, after the ``done`` epochs a resumed run already has (the same
    seed draws the same batches, so they are drawn and skipped)."""
    rounds = enumerate(schedule, start=1)
    if done:
        for _, (epoch, _, _, _, last) in rounds:
            if epoch == done and last:
                break
    return rounds


def eval_point(params: Any, round_no: int, epoch: int, last: bool, per_epoch: int) -> float | None:
    """Whether exchange round ``round_no`` (1-based) carries an evaluation, as the epoch it stands for: an
    epoch's last batch (the epoch, an int) and every ``params.eval_every`` rounds (a fraction: the batches done
    so far over the batches of an epoch); None: no evaluation."""
    if last:
        return epoch
    every = getattr(params, "eval_every", None)
    if every and round_no % every == 0:
        return round(epoch - 1 + ((round_no - 1) % per_epoch + 1) / per_epoch, 6)
    return None


class TPJoinSGD(LoJStrategy):
    algorithm = "tp_join_sgd"
    params_type = SGDParams
    validation = "select"
    resumable = True

    def protocol(self) -> None:
        done, loop = self.begin(self.start_sgd)
        schedule, evaluation = sgd_schedule(self)
        h = loop["h"]
        rounds = sgd_rounds(schedule, done)
        loss_sum, seen = 0.0, 0
        for round_no, (epoch, rows, plan, nxt, last) in rounds:
            Y, loss_b = sgd_aggregate(self.task, plan, h, self.y_train[rows])
            loss_sum, seen = loss_sum + loss_b, seen + len(rows)
            point = eval_point(self.params, round_no, epoch, last, schedule.per_epoch)
            selection = self.selection.config(self.selection.evaluations + 1 if point is not None else None)
            replies = self.send(
                self.messages(
                    lambda t: (
                        {
                            "Y": Y[t],
                            "rows": nxt.U[t] if nxt else EMPTY,
                            **({"eval_rows": evaluation.U[t]} if point is not None else {}),
                        },
                        {
                            "phase": "sgd_step",
                            "batch_size": len(rows),
                            **selection,
                            **(self.checkpoint_config(epoch) if last else {}),
                        },
                    )
                )
            )
            self.after_round(replies)
            h = self.outputs(replies)
            stop = False
            if point is not None:
                H_eval = joined_predictions(evaluation.inv, self.outputs(replies, "h_eval"))
                stop = self.record_evaluation(point, H_eval, loss_sum / seen, self.round_extra())
            if last:
                loss_sum, seen = 0.0, 0
                self.end_epoch(epoch, {"h": h})  # h: the next epoch's first batch, predicted in this round
            if stop:
                break
        self.finish()

    def start_sgd(self) -> dict:
        """Setup, then the predictions of the first batch."""
        self.setup()
        schedule, _ = sgd_schedule(self)
        warn_few_steps(self, schedule)
        replies = self.send(
            self.messages(
                lambda t: (
                    {"rows": schedule.first.U[t]},
                    {"phase": "predict", "d_out": self.d_out, **self.dp_config((t, 0))},
                )
            )
        )
        return {"h": self.outputs(replies)}

    def after_round(self, replies) -> None:
        """A hook after every exchange round (CELU counts its local steps here)."""

    def round_extra(self) -> dict[str, float]:
        """Extra values for the next evaluation's record."""
        return {}

    def plan_feature_dp(self) -> dict:
        return sgd_dp_plan(self)

    def dp_parameter_noise(self, plan: dict) -> float:
        return sgd_noise(self, plan)


def sgd_dp_plan(strategy: LoJStrategy) -> dict:
    """One DP step per batch for every client; the sample rate of a row of its table (or shard).

    The server draws each batch of B joined rows from a fresh shuffle of [N]; a table row u takes part iff one
    of its G_iu joined rows is drawn. DP is worst case over rows, so q is that of the most duplicated row,
    g = max_u G_iu over the client's rows in the TRAINING join (privacy.table_row_sample_rate, "shuffle": the
    server's actual batching; the Poisson accountant is then the usual approximation, as for shuffled loaders).
    """
    N = strategy.train.N
    B = batch_size_of(strategy.params.batch_size, N)
    steps = sgd_steps(sgd_epochs(strategy, -(-N // B)), N, B)  # under DP: exactly `epochs`
    rate = str(strategy.cfg.privacy.get("sample_rate", "worst_row"))
    if rate not in ("worst_row", "batch"):
        raise ValueError(f"privacy.sample_rate must be worst_row or batch, got {rate!r}")
    plan = {}
    for key in strategy.clients:
        G = strategy.client_G(key)
        g = max(int(G.max()) if len(G) else 0, 1)  # a shard without joined rows: any q is an upper bound
        if rate == "batch":  # the paper's accounting, q = B / N: as if no row occurred twice in the join
            g = 1
        plan[key] = (steps, table_row_sample_rate(B, N, g, "shuffle"))
    return plan


def sgd_noise(strategy: LoJStrategy, plan: dict) -> float:
    """The DP noise one parameter accumulates over the run (tpflower.losses.sgd_parameter_noise): learning
    rate, C and batch B of the run, each client's sigma as its node calibrates it (tpflower.local_dp)."""
    priv = strategy.cfg.privacy
    B = batch_size_of(strategy.params.batch_size, strategy.train.N)

    def sigma(steps: int, q: float) -> float:
        return dp.noise_multiplier_for(float(priv.epsilon), float(priv.delta), min(max(q, 1e-12), 1.0), steps)

    return sgd_parameter_noise(float(strategy.params.lr), float(priv.clip), B, plan, sigma)


class VFLSGD(TPJoinSGD):
    """VFL-SGD: the same protocol on the expanded tables: |B| rows per client per batch, no duplicate reduction."""

    algorithm = "vfl_sgd"
    expand = True
