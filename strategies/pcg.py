"""Block-Jacobi preconditioned conjugate gradient for ridge regression over the join, server side
(docs/algorithms.md, section "pcg"; the client side and the message table are in tpflower/phases/pcg.py).

The server holds no parameter vector: per iteration it turns the tables' outputs h_i = T_i p_i into
s_i = P_i^T (sum_j P_j h_j) (the segment sums of A p, as a TP-Join-SGD round does for Y_i), and combines the
tables' partial inner products into CG's step sizes alpha = r.z / p.Ap and beta = r'.z' / r.z. It keeps A p
as the per-row outputs of the current direction: T_i p'_i = T_i z'_i + beta T_i p_i. Two round trips per
iteration (s down, p.Ap up; alpha down, T z and T theta up); exact in at most d iterations in exact arithmetic.
"""

from __future__ import annotations

import numpy as np

from strategies.base import LoJStrategy
from tpflower.batches import joined_predictions
from tpflower.losses import loss_np
from tpflower.phases.pcg import PCGParams


class TPJoinPCG(LoJStrategy):
    algorithm = "tp_join_pcg"
    params_type = PCGParams
    resumable = True

    def __init__(self, cfg, spec, *args, **kwargs):
        super().__init__(cfg, spec, *args, **kwargs)
        if self.task != "regression" or str(cfg.model.kind) != "linear":
            raise ValueError(
                f"algorithm=pcg solves the ridge normal equations: it needs a regression label and model=linear "
                f"(here task={self.task}, model={cfg.model.kind}); use algorithm=admm or sgd"
            )

    def protocol(self) -> None:
        done, loop = self.begin(self.start_pcg)
        epochs = int(self.cfg.epochs)
        for it in range(done + 1, epochs + 1):
            if loop.get("stopped"):
                break
            s = self.segment_sums(loop["hp"])
            replies = self.send(
                self.messages(lambda t: ({"s": s[t]}, {"phase": "pcg_apply", "epoch": it, "beta": loop["beta"]}))
            )
            p_Ap = self.dot(replies)[0]
            alpha = loop["rz"] / p_Ap
            cfg = {"phase": "pcg_step", "epoch": it, "alpha": alpha, **self.checkpoint_config(it)}
            replies = self.send(self.messages(lambda t: ({}, cfg)))
            rz, rr = self.dot(replies)
            hz, htheta = self.outputs(replies), self.outputs(replies, "h_eval")
            beta = rz / loop["rz"] if loop["rz"] else 0.0
            hp = {t: hz[t] + beta * loop["hp"][t] for t in hz}
            H = joined_predictions(self.train.p, htheta)
            train_loss = float(np.mean(loss_np(self.task, H, self.y_train)))
            relative = float(np.sqrt(max(rr, 0.0) / loop["rr0"]))
            reg = sum(float(r[1]["R"]) for r in replies.values())
            self.record_epoch(
                it,
                joined_predictions(self.test.p, htheta),
                train_loss,
                {"objective": train_loss + float(self.cfg.model.beta) * reg, "relative_residual": relative},
            )
            stop = rr == 0.0 or (self.params.tol > 0 and relative <= self.params.tol)
            loop = {"hp": hp, "rz": rz, "rr0": loop["rr0"], "beta": beta, "stopped": stop}
            self.record_stop(it, relative, stop)
            self.end_epoch(it, loop)
        self.finish()

    def start_pcg(self) -> dict:
        """Setup, then pcg_setup: G_i and s = P_i^T y to every table (theta = 0, r = A^T y / N, p = z = M^-1 r)."""
        self.setup()
        G = {t: self.train.G(t) for t in self.spec.table_names}
        s = self.segment_sums_of(np.asarray(self.y_train, dtype=np.float64).reshape(-1, 1))
        config = {"phase": "pcg_setup", "N": self.train.N, "d_out": self.d_out}
        replies = self.send(self.messages(lambda t: ({"G": G[t], "s": s[t]}, config)))
        rz, rr = self.dot(replies)
        return {"hp": self.outputs(replies), "rz": rz, "rr0": rr, "beta": 0.0, "stopped": rr == 0.0}

    def segment_sums(self, h: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """s_i = P_i^T (A p) over the training join, from the tables' outputs h_i = T_i p_i."""
        return self.segment_sums_of(joined_predictions(self.train.p, h, chunk=None).astype(np.float64))

    def segment_sums_of(self, q: np.ndarray) -> dict[str, np.ndarray]:
        return {t: self.train.segment_sum(t, q) for t in self.spec.table_names}

    @staticmethod
    def dot(replies) -> np.ndarray:
        """The sum over tables of their partial inner products (each block of the vectors lives on one table)."""
        total = sum(np.asarray(r[0]["dots"], dtype=np.float64) for r in replies.values())
        if not np.all(np.isfinite(total)):
            raise RuntimeError(f"pcg: non-finite inner products {total}")
        return total

    def record_stop(self, it: int, relative: float, stop: bool) -> None:
        """results.stopped: "tol" (||r|| <= tol ||r_0||) or "epochs" (the maximum iterations)."""
        assert self.results is not None
        if stop or it >= int(self.cfg.epochs):
            detail = f"relative residual {relative:.3g}" + (f" <= tol {self.params.tol:g}" if stop else "")
            self.results.stopped = {"epoch": it, "reason": "tol" if stop else "epochs", "detail": detail}
            if stop:
                self.log(f"stopped after iteration {it}: {detail}")

    def plan_feature_dp(self) -> dict:  # pragma: no cover - the registry refuses feature DP first
        raise ValueError("algorithm=pcg has no feature-DP plan")
