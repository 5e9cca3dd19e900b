"""TP-UCQ-ADMM (TablePuppet Eq. 20-24): TP-Join-ADMM whose theta-update (Eq. 16) of a sharded table is
solved by consensus ADMM over its shards.

After the LoJ scatter of epoch t, a table with Q_i > 1 shards runs up to algorithm.inner_rounds rounds:
every shard solves Eq. 22 against v^q = w - u^q; the coordinator (the server) sets
w = Q_i rho' (mean theta^q + mean u^q) / (beta + Q_i rho') (Eq. 20, with Q_i where the paper prints M; in
general form, each weight averaged over the shards whose rows use it: consensus_step) and
u^q += theta^q - w (Eq. 21); it stops early once max_q ||theta^q - w|| < algorithm.inner_tol. Then every shard
takes w and predicts its rows. w is warm-started across epochs, u reset. rho' (algorithm.rho_inner) defaults
to `auto`, scaled to the curvature of the shard problem (consensus_rho). Tables with one shard make the
plain update of Eq. 16. The first inner round carries the epoch's Y_i (the LoJ scatter) and the closing round
the predictions (the LoJ gather); the rounds between are the union's, counted in rounds_inner.

Feature DP (privacy=dpsgd): each shard's Eq. 22 step is DP-SGD over its rows with the prox term
rho'/2 ||theta - v^q||^2 in place of beta R (added unclipped after the noise); single-shard tables make the DP
Eq. 16 update of TP-Join-ADMM. The noise is calibrated for every inner round being used (inner_rounds per
epoch); stopping early spends less. The consensus w is post-processing of the shards' DP models.
"""

from __future__ import annotations

import numpy as np

from strategies.join_admm import Balancing, TPJoinADMM, admm_dp_plan, residual_extra
from tpflower.batches import joined_predictions
from tpflower.relation import has_bias


def consensus_step(
    theta: dict[int, np.ndarray],
    u: dict[int, np.ndarray],
    used: dict[int, np.ndarray],
    w_prev: np.ndarray | None,
    rho_c: float,
    beta: float,
) -> tuple[np.ndarray, dict[int, np.ndarray], float]:
    """Eq. 20 in general form (Boyd et al. 2011, Sec. 7.2): each weight of the consensus model w is averaged
    over the shards whose rows use it (``used[q]``, a mask over the flat parameters),
    w = rho' sum_{q uses} (theta^q + u^q) / (beta + |{q uses}| rho'), so a one-hot column held by one shard
    of Q moves at once instead of by 1/Q per inner round. With every weight used by every shard this is
    Eq. 20: w = Q rho' (mean theta^q + mean u^q) / (beta + Q rho'). The minimiser is the same (a shard's loss
    does not depend on the weights it does not use). Returns w, the primal residuals theta^q - w on the
    weights q uses (0 elsewhere) and the dual residual rho' sqrt(sum_q ||w - w_prev||^2 on q's weights); inf
    when ``w_prev`` is None (the first step: w^0 = theta_i^0 stays on the shards)."""
    count = sum(m.astype(np.float64) for m in used.values())
    total = sum(np.where(used[q], theta[q] + u[q], 0.0) for q in theta)
    w = rho_c * total / (beta + count * rho_c)
    primal = {q: np.where(used[q], theta[q] - w, 0.0) for q in theta}
    dual = np.inf if w_prev is None else rho_c * float(np.sqrt(np.sum(count * (w - w_prev) ** 2)))
    return w, primal, dual


class TPUCQADMM(TPJoinADMM):
    algorithm = "tp_ucq_admm"
    checkpointed = TPJoinADMM.checkpointed + ("inner_rounds_used",)

    def protocol(self) -> None:
        done, loop = self.begin(self.start_ucq)
        alg, beta = self.params, float(self.cfg.model.beta)
        inner_rounds, inner_tol = alg.inner_rounds, alg.inner_tol
        admm, h, w, rho_c, u = loop["admm"], loop["h"], loop["w"], loop["rho_c"], loop["u"]
        self.admm = admm
        routers = self.routers
        multi = [t for t in self.spec.table_names if t in w]
        inner_balance = Balancing(alg.rho_mu, alg.rho_tau, 0) if self.balancing_on(0) else None
        last_done = done if not loop.get("stopped") else int(self.cfg.epochs)
        for epoch in range(last_done + 1, int(self.cfg.epochs) + 1):
            rho = admm.rho
            selection = self.selection.config(self.selection.evaluations + 1)  # each epoch's last messages
            Y = {t: routers[t].scatter_all(y) for t, y in admm.scatter(h).items()}
            if epoch == 1 or not alg.warm_dual or not u:  # 0.0: before the first consensus (w unknown, None)
                u = {k: 0.0 if w[k[0]] is None else np.zeros_like(w[k[0]]) for k in self.clients if k[0] in multi}
            for r in range(inner_rounds):
                messages = {}
                for k in self.clients:
                    t, q = k
                    if t in multi:
                        # no v in the run's first step: the shards take v = theta_i^0, their common start (Eq. 22)
                        v = {} if w[t] is None else {"v": w[t] - u[k]}
                        arrays = ({"Y": Y[t][q]} if r == 0 else {}) | v
                        messages[k] = (arrays, {"phase": "admm_shard", "rho_c": rho_c[t], "rho": rho, "epoch": epoch})
                    elif r == 0:  # a table with one shard: its last message of the epoch (it checkpoints)
                        messages[k] = (
                            {"Y": Y[t][q]},
                            {
                                "phase": "admm_update",
                                "epoch": epoch,
                                "rho": rho,
                                **self.checkpoint_config(epoch),
                                **selection,
                            },
                        )
                replies = self.send(messages, kind="inner" if r > 0 else "train")
                if r == 0:
                    h.update(
                        {
                            t: routers[t].gather_all({q: replies[(t, q)][0]["h"] for q in routers[t].shards})
                            for t in self.spec.table_names
                            if t not in multi
                        }
                    )
                    # which parameters each shard's rows use (not sent under feature DP: all)
                    used = {
                        k: np.asarray(replies[k][0]["used"], dtype=bool)
                        if "used" in replies[k][0]
                        else np.ones(np.shape(replies[k][0]["theta"]), dtype=bool)
                        for k in self.clients
                        if k[0] in multi
                    }
                residual = dual = 0.0
                for t in multi:
                    shards = routers[t].shards
                    theta = {q: np.asarray(replies[(t, q)][0]["theta"], dtype=np.float64) for q in shards}
                    w[t], primal, dual_t = consensus_step(
                        theta, {q: u[(t, q)] for q in shards}, {q: used[(t, q)] for q in shards}, w[t], rho_c[t], beta
                    )
                    for q in shards:  # Eq. 21 (u scaled: u = y / rho'); 0 on the weights q does not use
                        u[(t, q)] = np.where(used[(t, q)], u[(t, q)], 0.0) + primal[q]
                    residual = max(residual, max(float(np.linalg.norm(p)) for p in primal.values()))
                    dual = max(dual, dual_t)
                    if inner_balance is not None and r + 1 < inner_rounds and np.isfinite(dual_t):
                        primal_norm = float(np.sqrt(sum(float(np.sum(p**2)) for p in primal.values())))
                        f = inner_balance.factor(primal_norm, dual_t)  # Boyd Eq. 3.13
                        if f != 1.0:
                            rho_c[t] *= f
                            for q in shards:  # the scaled dual u = y / rho' follows rho' (Boyd Sec. 3.4.1)
                                u[(t, q)] /= f
                if residual < inner_tol and dual < inner_tol:
                    break
            self.inner_rounds_used.append(r + 1)
            if multi:
                replies = self.send(
                    {
                        k: ({"w": w[k[0]]}, {"phase": "admm_consensus", **self.checkpoint_config(epoch), **selection})
                        for k in self.clients
                        if k[0] in multi
                    }
                )
                h.update(
                    {t: routers[t].gather_all({q: replies[(t, q)][0]["h"] for q in routers[t].shards}) for t in multi}
                )
            res = admm.update(h)  # z, lambda (Eq. 7, 8), residuals and the next rho (Boyd Sec. 3.4.1)
            train_loss = admm.train_loss()  # at the H of this update (computed there, chunk by chunk)
            selected = self.record_evaluation(
                epoch,
                joined_predictions(self.evaluated.p, h),
                train_loss,
                {
                    **residual_extra(res, rho),
                    "inner_rounds": r + 1,
                    "inner_residual": residual,
                    "inner_dual": dual if np.isfinite(dual) else None,
                    **({"rho_inner": max(rho_c.values())} if rho_c else {}),
                },
            )
            stop = self.stop_early(epoch, res, f"; {r + 1} inner rounds in the last epoch") or selected
            self.end_epoch(epoch, {"admm": admm, "h": h, "w": w, "rho_c": rho_c, "u": u, "stopped": stop})
            if stop:
                break
        self.finish()

    def anderson_memory(self) -> int:
        """0: the union's iteration has inner consensus rounds whose state lives on the shards (w, u), which the
        server-side Anderson acceleration of TP-Join-ADMM does not cover; an explicit memory is refused."""
        if self.params.anderson not in ("auto", 0):
            raise ValueError(
                f"algorithm.anderson={self.params.anderson} applies over a join (scenario=join); "
                "over a union use algorithm.anderson=0 or auto"
            )
        return 0

    def subspace_memory(self) -> int:
        """0: as :meth:`anderson_memory` (the union's consensus state lives on the shards); an explicit memory is
        refused."""
        if self.params.subspace not in ("auto", 0):
            raise ValueError(
                f"algorithm.subspace={self.params.subspace} applies over a join (scenario=join); "
                "over a union use algorithm.subspace=0 or auto"
            )
        return 0

    def start_ucq(self) -> dict:
        """Setup, the admm_setup round; the consensus models start at the shards' common initial theta."""
        self.setup()
        alg = self.params
        admm = self.admm_server()
        routers = self.routers
        multi = [t for t in self.spec.table_names if len(routers[t].shards) > 1]
        G = {t: routers[t].scatter_all(g) for t, g in admm.G().items()}
        config = {"phase": "admm_setup", "N": self.train.N, "d_out": self.d_out, "rho": admm.rho}
        config.update(self.held_out())
        replies = self.send(self.shard_messages(lambda k: ({"G": G[k[0]][k[1]]}, {**config, **self.dp_config(k)})))
        # as TP-Join-ADMM: ADMM starts from x^0 = 0 (Boyd Sec. 3.1)
        h = {t: np.zeros((len(g), self.d_out), dtype=self.cfg.precision) for t, g in admm.G().items()}
        # all shards of a table start from the same theta_i^0 (the owner's secret), which stays on the shards: the
        # consensus model starts there too, so the first consensus step takes v = theta_i^0 on the shards (w: None)
        w = {t: None for t in multi}
        n_params = {t: int(replies[(t, routers[t].shards[0])][1]["n_params"]) for t in multi}
        rho_c = {t: self.consensus_rho(alg.rho_inner, admm.rho, t, n_params[t]) for t in multi}
        self.inner_rounds_used: list[int] = []
        admm.update(h)
        return {"admm": admm, "h": h, "w": w, "rho_c": rho_c, "u": {}}

    def consensus_rho(self, value, rho: float, table: str, n_params: int) -> float:
        """algorithm.rho_inner: a number, null (= rho), or auto: rho times the mean diagonal of the shard
        problem's Gram matrix X1^T X1 / n, which the spec alone gives for a linear model (a standardized column
        contributes 1, a one-hot block 1 in all, the bias 1, spread over the model's input width). One-hot
        tables are wide and flat (movielens users: 1/671 of rho): there a rho' equal to rho lets the proximal
        term swamp the shard's data and the consensus barely moves in T' rounds. Non-linear models: rho."""
        if value not in (None, "auto"):
            return float(value)
        if value is None or str(self.cfg.model.kind) != "linear":
            return rho
        t = self.spec.table(table)
        bias = int(has_bias(self.cfg.model, table, self.spec.label_table))
        width = n_params // self.d_out  # input columns (+ 1 for the bias) of the linear model
        return rho * (len(t.numeric) + len(t.categorical) + bias) / max(width, 1)

    def plan_feature_dp(self) -> dict:
        """As TP-Join-ADMM's, with inner_rounds theta-updates per epoch for the shards of sharded tables."""
        rounds = self.params.inner_rounds
        return {k: admm_dp_plan(self, k, rounds if len(self.routers[k[0]].shards) > 1 else 1) for k in self.clients}
