"""Block-Jacobi preconditioned conjugate gradient for ridge regression over the join, the union and a weighted
coreset, server side (docs/algorithms.md, section "pcg"; the client side and the messages are in
tpflower/phases/pcg.py).

The server holds no parameter vector. It keeps the per-row outputs of the current direction,
T_i p_k = T_i z_k + beta_k T_i p_{k-1} (the tables send T_i z), turns them into H = A p over the problem's
joined rows and s_i = P_i^T (W H) (the segment sums, as a TP-Join-SGD round sends Y_i), and forms CG's scalars
from the tables' partial inner products: beta_k = r_k.z_k / r_{k-1}.z_{k-1},
||p_k||^2 = ||z_k||^2 + 2 beta_k z_k.p_{k-1} + beta_k^2 ||p_{k-1}||^2,
p_k.A p_k = ||H||_W^2 / N + beta ||p_k||^2 and alpha_k = r_k.z_k / p_k.A p_k. One round trip per iteration
(s, alpha, beta down; T z and four partial dots up: the traffic of a TP-Join-ADMM epoch). The model's
outputs follow as T theta_{k+1} = T theta_k + alpha_k T p_k; the union adds one round per iteration between
the server and the shards of sharded tables (their partial products T_q^T s_q, summed by the server).
Exact in at most d iterations in exact arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from strategies.base import LoJStrategy
from strategies.transport import ClientKey, Reply
from tpflower.batches import joined_predictions
from tpflower.losses import loss_np
from tpflower.mapping import TableMapping, segment_sum
from tpflower.phases.pcg import PCGParams


class PCGSolver(LoJStrategy):
    """The PCG loop over a problem: the joined rows of :attr:`pcg_map` with weights :attr:`pcg_w` (None: 1),
    the objective's N, and the client messages of :meth:`pcg_messages`. Subclasses set the problem in their
    start method and evaluate with :meth:`pcg_test_predictions`."""

    params_type = PCGParams
    resumable = True
    setup_phase = "pcg_setup"
    pcg_map: TableMapping
    pcg_w: np.ndarray | None = None
    pcg_N: int = 0
    pcg_y: np.ndarray

    def check_task(self, cfg) -> None:
        if self.task != "regression" or str(cfg.model.kind) != "linear":
            raise ValueError(
                f"algorithm={self.algorithm} solves the ridge normal equations: it needs a regression label and "
                f"model=linear (here task={self.task}, model={cfg.model.kind}); use algorithm=admm or sgd"
            )

    # ------------------------------------------------------------------------------------------ problem

    def weighted(self, v: np.ndarray) -> np.ndarray:
        return v if self.pcg_w is None else self.pcg_w * v

    def segment_sums(self, v: np.ndarray) -> dict[str, np.ndarray]:
        """s_i = P_i^T (W v) over the problem's joined rows, per table (its rows in the problem's order)."""
        v = self.weighted(np.asarray(v, dtype=np.float64).ravel())
        return {t: segment_sum(p, v, self.pcg_map.n_rows[t]) for t, p in self.pcg_map.p.items()}

    def counts(self) -> dict[str, np.ndarray]:
        """G_i: the summed weights of each table row's joined rows."""
        ones = np.ones(len(self.pcg_y)) if self.pcg_w is None else self.pcg_w
        return {t: segment_sum(p, ones, self.pcg_map.n_rows[t]) for t, p in self.pcg_map.p.items()}

    # ------------------------------------------------------------------------------------------ messages

    def sharded_tables(self) -> list[str]:
        return [t for t in self.spec.table_names if len(self.routers[t].shards) > 1]

    def pcg_messages(self, rows: Mapping[str, Mapping[str, np.ndarray]], summed, config) -> dict:
        """One message per client: a table's per-row arrays ``rows[t]`` cut into its shards' rows, or for a
        sharded table the sums over its shards ``summed[t]``."""
        out = {}
        for key in self.clients:
            t, q = key
            if t in summed:
                out[key] = (dict(summed[t]), dict(config))
            elif len(self.routers[t].shards) == 1:  # the problem's rows of the table, in the problem's order
                out[key] = (dict(rows[t]), dict(config))
            else:
                out[key] = ({n: self.routers[t].scatter_all(a)[q] for n, a in rows[t].items()}, dict(config))
        return out

    def shard_sums(self, rows: Mapping[str, Mapping[str, np.ndarray]], phase: str, kind) -> dict:
        """For the union: the sharded tables' partial products (``phase``: pcg_gram | pcg_partial), summed."""
        sharded = self.sharded_tables()
        if not sharded:
            return {}
        msgs = {
            (t, q): (
                {n: self.routers[t].scatter_all(a)[q] for n, a in rows[t].items()},
                {"phase": phase, "N": self.pcg_N, "d_out": self.d_out},
            )
            for t in sharded
            for q in self.routers[t].shards
        }
        replies = self.send(msgs, kind=kind)
        names = next(iter(replies.values()))[0].keys()
        return {
            t: {n: sum(np.asarray(replies[(t, q)][0][n], np.float64) for q in self.routers[t].shards) for n in names}
            for t in sharded
        }

    def gather(self, replies: Mapping[ClientKey, Reply], name: str) -> dict[str, np.ndarray]:
        """Reply array ``name`` per table, over the problem's rows of the table (shards put back together)."""
        return {
            t: replies[(t, r.shards[0])][0][name]
            if len(r.shards) == 1
            else r.gather_all({q: replies[(t, q)][0][name] for q in r.shards})
            for t, r in self.routers.items()
        }

    def dots(self, replies: Mapping[ClientKey, Reply]) -> np.ndarray:
        """The sum over tables of their partial inner products [r.z, z.z, z.p, r.r] (one shard per table:
        the shards of a table hold the same block vectors)."""
        total = sum(np.asarray(replies[(t, r.shards[0])][0]["dots"], np.float64) for t, r in self.routers.items())
        if not np.all(np.isfinite(total)):
            raise RuntimeError(f"pcg: non-finite inner products {total}")
        return total

    # ------------------------------------------------------------------------------------------ the loop

    def pcg_start(self, extra: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> dict:
        """pcg_setup: G_i and s = P_i^T W y to every table; theta = 0, r = A^T W y / N, z = M^-1 r, p = 0."""
        G, s = self.counts(), self.segment_sums(self.pcg_y)
        grams = self.shard_sums({t: {"G": G[t], "s": s[t]} for t in G}, "pcg_gram", "train")
        rows = {t: {"G": G[t], "s": s[t], **(extra or {}).get(t, {})} for t in self.spec.table_names}
        config = {"phase": self.setup_phase, "N": self.pcg_N, "d_out": self.d_out}
        replies = self.send(self.pcg_messages(rows, grams, config))
        rz, zz, zp, rr = self.dots(replies)
        zero = {t: np.zeros_like(h, dtype=np.float64) for t, h in self.gather(replies, "h").items()}
        return {
            "hz": self.gather(replies, "h"),
            "hp": zero,
            "htheta": zero,
            "pp": 0.0,
            "dots": [rz, zz, zp, rr],
            "rz_prev": 0.0,
            "rr0": rr,
            "stopped": rr == 0.0,
        }

    def pcg_loop(self, done: int, loop: dict) -> None:
        beta_ridge = float(self.cfg.model.beta)
        for it in range(done + 1, int(self.cfg.epochs) + 1):
            if loop.get("stopped"):
                break
            rz, zz, zp, _ = loop["dots"]
            beta = rz / loop["rz_prev"] if loop["rz_prev"] else 0.0
            hp = {t: np.asarray(loop["hz"][t], np.float64) + beta * loop["hp"][t] for t in loop["hz"]}
            pp = zz + 2 * beta * zp + beta * beta * loop["pp"]
            H = joined_predictions(self.pcg_map.p, hp).ravel()
            p_Ap = float(np.dot(self.weighted(H), H)) / self.pcg_N + beta_ridge * pp
            alpha = rz / p_Ap
            s = self.segment_sums(H)
            # float64 whatever the run's precision (float32 segment sums stall CG near the solution)
            rows = {t: {"s": s[t]} for t in self.spec.table_names}
            g = {t: {"g": v["g"]} for t, v in self.shard_sums(rows, "pcg_partial", "inner").items()}
            config = {"phase": "pcg_step", "epoch": it, "alpha": alpha, "beta": beta, **self.checkpoint_config(it)}
            replies = self.send(self.pcg_messages(rows, g, config))
            dots = self.dots(replies)
            # T theta_{k+1} = T theta_k + alpha T p_k: the server follows the model's outputs itself
            htheta = {t: loop["htheta"][t] + alpha * hp[t] for t in hp}
            relative = float(np.sqrt(max(dots[3], 0.0) / loop["rr0"]))
            H_theta = joined_predictions(self.pcg_map.p, htheta).astype(np.float64)
            losses = loss_np(self.task, H_theta, self.pcg_y.reshape(H_theta.shape)).ravel()
            train_loss = float(np.sum(self.weighted(losses))) / self.pcg_N
            reg = sum(float(replies[(t, r.shards[0])][1].get("R", 0.0)) for t, r in self.routers.items())
            self.record_epoch(
                it,
                self.pcg_test_predictions(htheta),
                train_loss,
                {"objective": train_loss + beta_ridge * reg, "relative_residual": relative, **self.pcg_extra()},
            )
            stop = dots[3] == 0.0 or (self.params.tol > 0 and relative <= self.params.tol)
            loop = {
                "hz": self.gather(replies, "h"),
                "hp": hp,
                "htheta": htheta,
                "pp": pp,
                "dots": list(dots),
                "rz_prev": rz,
                "rr0": loop["rr0"],
                "stopped": stop,
            }
            self.record_stop(it, relative, stop)
            self.end_epoch(it, loop)

    def pcg_test_predictions(self, htheta: Mapping[str, np.ndarray]) -> np.ndarray:
        """The test split's predictions from the tables' outputs T_i theta_i over all their rows."""
        return joined_predictions(self.test.p, htheta)

    def pcg_extra(self) -> dict[str, float]:
        return {}

    def record_stop(self, it: int, relative: float, stop: bool) -> None:
        """results.stopped: "tol" (||r|| <= tol ||r_0||) or "epochs" (the maximum iterations)."""
        assert self.results is not None
        if stop or it >= int(self.cfg.epochs):
            detail = f"relative residual {relative:.3g}" + (f" <= tol {self.params.tol:g}" if stop else "")
            self.results.stopped = {"epoch": it, "reason": "tol" if stop else "epochs", "detail": detail}
            if stop:
                self.log(f"stopped after iteration {it}: {detail}")

    def plan_feature_dp(self) -> dict:  # pragma: no cover - the registry refuses feature DP first
        raise ValueError(f"algorithm={self.algorithm} has no feature-DP plan")


class TPJoinPCG(PCGSolver):
    """algorithm=pcg over the join: the training join's rows, unweighted."""

    algorithm = "tp_join_pcg"

    def __init__(self, cfg, spec, *args, **kwargs):
        super().__init__(cfg, spec, *args, **kwargs)
        self.check_task(cfg)

    def protocol(self) -> None:
        done, loop = self.begin(self.start_pcg)
        self.pcg_problem()
        self.pcg_loop(done, loop)
        self.finish()

    def pcg_problem(self) -> None:
        self.pcg_map, self.pcg_w, self.pcg_N = self.train, None, self.train.N
        self.pcg_y = np.asarray(self.y_train, dtype=np.float64).ravel()

    def start_pcg(self) -> dict:
        self.setup()
        self.pcg_problem()
        return self.pcg_start()


class TPUCQPCG(TPJoinPCG):
    """algorithm=pcg scenario=ucq: the same iterates; a sharded table's blocks are sums over its shards."""

    algorithm = "tp_ucq_pcg"
