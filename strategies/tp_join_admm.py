"""TP-Join-ADMM (TablePuppet Eq. 7, 8, 14-16) and the VFL-ADMM baseline (VIMADMM style).

One round trip per epoch: clients send f_i(theta_i) on all their rows (n_i x d_c); the server updates z and
lambda and scatters Y_i (Eq. 14); each client solves its theta-update (Eq. 16) and replies with its new
predictions, which also give the test predictions of that epoch. G_i (Eq. 15) is constant and sent once.

Feature DP (privacy=dpsgd): the theta-update is DP-SGD (DP-Adam, algorithm.local_*) over the table's active
rows instead of the closed form, linear models included; the client samples its rows itself (Poisson,
q = min(1, b / n_a)), ``admm_steps(epochs, local_epochs, n_a, b)`` steps in all. VFL-ADMM's client sums the
terms of each table row's duplicates first, which gives exactly the TP-Join-ADMM per-row term.
"""

from __future__ import annotations

import numpy as np

from strategies.loj import LoJStrategy
from strategies.registry import AlgorithmEntry, register
from tpflower.loj import ADMMServer, Balancing, Residuals, joined_predictions
from tpflower.params import ADMMParams
from tpflower.phases import join_admm, setup
from tpflower.privacy import admm_steps


#: algorithm.rho=auto: the penalty that reached the exact solution fastest on the bundled data (README):
#: the squared loss has curvature 1, the logistic/softmax losses at most 1/4 and far less once fitted.
AUTO_RHO = {"regression": 3.0, "binary": 0.1, "multiclass": 0.1}


def admm_rho(value, task: str) -> float:
    """algorithm.rho: a positive number, or `auto` (by task, AUTO_RHO)."""
    return AUTO_RHO[task] if value == "auto" else float(value)


class TPJoinADMM(LoJStrategy):
    algorithm = "tp_join_admm"
    params_type = ADMMParams
    resumable = True

    def protocol(self) -> None:
        done, loop = self.begin(self.start_admm)
        admm, h = loop["admm"], loop["h"]
        self.admm = admm
        last = done if not loop.get("stopped") else int(self.cfg.epochs)  # a resumed run that had stopped early
        for epoch in range(last + 1, int(self.cfg.epochs) + 1):
            Y, rho = admm.scatter(h), admm.rho
            replies = self.send(self.messages(lambda t: (
                {"Y": Y[t]}, {"phase": "admm_update", "epoch": epoch, "rho": rho, **self.checkpoint_config(epoch)})))
            h = self.outputs(replies)
            res = admm.update(h)  # z, lambda (Eq. 7, 8), residuals and the next rho (Boyd Sec. 3.4.1)
            train_loss = admm.train_loss()  # at the H of this update (computed there, chunk by chunk)
            reg = sum(float(r[1]["R"]) for r in replies.values())
            self.record_epoch(
                epoch,
                joined_predictions(self.test.p, h),
                train_loss,
                {"objective": train_loss + float(self.cfg.model.beta) * reg, **residual_extra(res, rho)},
            )
            stop = self.stop_early(epoch, res)
            self.end_epoch(epoch, {"admm": admm, "h": h, "stopped": stop})
            if stop:
                break
        self.finish()

    def start_admm(self) -> dict:
        """Setup, then the admm_setup round (G_i, Eq. 15, sent once)."""
        self.setup()
        admm = self.admm_server()
        G = admm.G()
        config = {"phase": "admm_setup", "N": self.train.N, "d_out": self.d_out, "rho": admm.rho}
        replies = self.send(self.messages(lambda t: ({"G": G[t]}, {**config, **self.dp_config((t, 0))})))
        # ADMM starts from x^0 = 0, z^0 = 0, lambda^0 = 0 (Boyd Sec. 3.1): not from the initial models' predictions,
        # whose random part would have to be undone (the theta-update of Eq. 16 does not depend on them)
        h = {t: np.zeros_like(v) for t, v in self.outputs(replies).items()}
        admm.update(h)
        return {"admm": admm, "h": h}

    def admm_server(self) -> ADMMServer:
        """The server's z, lambda and rho (algorithm.rho, adapt_rho, rho_mu, rho_tau, tol)."""
        alg = self.params
        balancing = Balancing(alg.rho_mu, alg.rho_tau, alg.rho_warmup) if alg.adapt_rho else None
        self.admm = ADMMServer(self.task, self.y_train, self.train, self.d_out, admm_rho(alg.rho, self.task),
                               alg.variant, balancing, alg.tol, dtype=self.state_dtype)
        return self.admm

    def stop_early(self, epoch: int, res: Residuals, inner: str = "") -> bool:
        """Record in results.stopped whether training stops after ``epoch``: "tol" (both residuals below
        algorithm.tol, Boyd Eq. 3.12) or "epochs" (the maximum); True to stop now."""
        assert self.results is not None
        done = self.params.tol > 0 and res.converged
        if done or epoch >= int(self.cfg.epochs):
            why = "tol" if done else "epochs"
            detail = res.reason() if done else f"epochs={epoch} reached (algorithm.tol={self.params.tol:g} not met)"
            self.results.stopped = {"epoch": epoch, "reason": why, "detail": detail + inner}
            if done:  # reaching the maximum needs no line of its own
                self.log(f"stopped after epoch {epoch}: {detail}{inner}")
        return done

    def plan_feature_dp(self) -> dict:
        """Per client: epochs x local_epochs x ceil(n_a / b) local DP steps at q = min(1, b / n_a), n_a = its
        rows that occur in the training join (the client's own Poisson sampling, DPLocalTrainer.admm_update)."""
        return {k: admm_dp_plan(self, k, 1) for k in self.clients}


def residual_extra(res: Residuals, rho: float) -> dict[str, float]:
    """The epoch line's ADMM entries: the residuals (Boyd Sec. 3.3) and the rho the epoch's theta-update used."""
    out = {"rho": rho, "primal_residual": res.primal}
    if res.dual is not None:
        out["dual_residual"] = res.dual
    return out


def admm_dp_plan(strategy: LoJStrategy, key, calls_per_epoch: int) -> tuple[int, float]:
    """(steps, q) of one client whose DP theta-update runs ``calls_per_epoch`` times per epoch."""
    alg = strategy.params
    n_a = int(np.count_nonzero(strategy.client_G(key)))
    b = alg.local_batch_size
    steps = calls_per_epoch * admm_steps(int(strategy.cfg.epochs), alg.local_epochs, n_a, b)
    return steps, (min(1.0, b / n_a) if n_a else 1.0)


class VFLADMM(TPJoinADMM):
    """VFL-ADMM: the same ADMM on the expanded tables (G = 1 per joined row): O(M N) traffic per epoch."""

    algorithm = "vfl_admm"
    expand = True


register(AlgorithmEntry("tp_join_admm", "tp_join_admm", "join", TPJoinADMM,
                        setup.loj_protocol(join_admm.START, join_admm.TRAIN), ADMMParams, summary="TP-Join-ADMM (Eq. 7, 8, 14-16): one round trip per epoch"))
register(AlgorithmEntry("vfl_admm", "vfl_admm", "join", VFLADMM,
                        setup.loj_protocol(join_admm.START, join_admm.TRAIN, vfl=True), ADMMParams, summary="VFL-ADMM baseline on the expanded join"))
