"""TP-UCQ-SGD (TablePuppet Eq. 17-19): TP-Join-SGD pushed through the union to the shards of each table.

All shards of table i hold the same theta_i. Per mini-batch: the shards predict their rows of U_i; the
LoJ operator computes Y_i and scatters each shard its part; each shard returns its unnormalised partial
gradient (Eq. 18); the coordinator (the server) sums them and divides by |B| (Eq. 17) and every shard
applies the same step (Eq. 19), then predicts its rows of the next batch. A table with one shard takes no
gradient from the server: it applies its own partial gradient divided by |B| (``batch_rows``), the same step. Two round trips per batch; the
first (partial gradients) is the union's coordinator round and is counted in rounds_inner. Without DP the
trajectory equals TP-Join-SGD's.

Feature DP (privacy=dpsgd): each shard clips the per-row data terms of its partial gradient and adds its own
Gaussian noise sigma C before sending (Eq. 18; DPLocalTrainer.partial_gradient). The regulariser term
beta G_sum dR/dtheta is added by the shard after the noise: G_sum (the batch's joined rows on its rows) is
the server's ``count``, so the term is data independent given what the server already knows. The
coordinator's sum over Q_i shards then carries sqrt(Q_i) sigma C of noise (no secure aggregation). Sample
rate and steps as TP-Join-SGD's, per shard (tp_join_sgd.sgd_dp_plan).
"""

from __future__ import annotations

import numpy as np

from strategies.base import LoJStrategy
from strategies.join_sgd import (
    EMPTY,
    eval_point,
    sgd_aggregate,
    sgd_dp_plan,
    sgd_noise,
    sgd_rounds,
    sgd_schedule,
    warn_few_steps,
)
from tpflower.batches import joined_predictions
from tpflower.phases.join_sgd import SGDParams


class TPUCQSGD(LoJStrategy):
    algorithm = "tp_ucq_sgd"
    params_type = SGDParams
    validation = "select"
    resumable = True

    def protocol(self) -> None:
        done, loop = self.begin(self.start_sgd)
        schedule, evaluation = sgd_schedule(self)
        eval_split = {t: self.routers[t].split(evaluation.U[t]) for t in self.spec.table_names}
        h = loop["h"]
        rounds = sgd_rounds(schedule, done)
        loss_sum, seen = 0.0, 0
        for round_no, (epoch, rows, plan, nxt, last) in rounds:
            Y, loss_b = sgd_aggregate(self.task, plan, h, self.y_train[rows])
            loss_sum, seen = loss_sum + loss_b, seen + len(rows)
            point = eval_point(self.params, round_no, epoch, last, schedule.per_epoch)
            counts = {t: np.bincount(plan.inv[t], minlength=len(plan.U[t])) for t in plan.U}  # G_iu in B
            masks = {t: self.routers[t].masks(plan.U[t]) for t in plan.U}
            replies = self.send(
                self.shard_messages(
                    lambda k: (
                        {"Y": Y[k[0]][masks[k[0]][k[1]]]},
                        {"phase": "sgd_partial", "count": float(counts[k[0]][masks[k[0]][k[1]]].sum())},
                    )
                ),
                kind="inner",
            )
            g = {
                t: sum(r[0]["g"] for (tt, _), r in sorted(replies.items()) if tt == t) / len(rows) for t in plan.U
            }  # Eq. 17
            nsplit = {t: self.routers[t].split(nxt.U[t]) for t in nxt.U} if nxt else None
            selection = self.selection.config(self.selection.evaluations + 1 if point is not None else None)
            replies = self.send(
                self.shard_messages(
                    lambda k: (
                        {
                            # a table with one shard applies its own gradient / |B| (it takes no server g)
                            **({"g": g[k[0]]} if len(self.routers[k[0]].shards) > 1 else {}),
                            "rows": nsplit[k[0]][k[1]] if nsplit else EMPTY,
                            **({"eval_rows": eval_split[k[0]][k[1]]} if point is not None else {}),
                        },
                        {
                            "phase": "sgd_apply",
                            "batch_rows": len(rows),
                            **selection,
                            **(self.checkpoint_config(epoch) if last else {}),
                        },
                    )
                )
            )
            if nxt is not None:
                h = self.gather_rows(replies, nxt.U)
            stop = False
            if point is not None:
                H_eval = joined_predictions(evaluation.inv, self.gather_rows(replies, evaluation.U, "h_eval"))
                stop = self.record_evaluation(point, H_eval, loss_sum / seen)
            if last:
                loss_sum, seen = 0.0, 0
                self.end_epoch(epoch, {"h": h})
            if stop:
                break
        self.finish()

    def start_sgd(self) -> dict:
        """Setup, then the predictions of the first batch (each shard its rows of it)."""
        self.setup()
        schedule, _ = sgd_schedule(self)
        warn_few_steps(self, schedule)
        split = {t: self.routers[t].split(schedule.first.U[t]) for t in self.spec.table_names}
        replies = self.send(
            self.shard_messages(
                lambda k: ({"rows": split[k[0]][k[1]]}, {"phase": "predict", "d_out": self.d_out, **self.dp_config(k)})
            )
        )
        return {"h": self.gather_rows(replies, schedule.first.U)}

    def plan_feature_dp(self) -> dict:
        return sgd_dp_plan(self)

    def dp_parameter_noise(self, plan: dict) -> float:
        return sgd_noise(self, plan)
