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
from tpflower.join_counts import compact_counts
from tpflower.losses import loss_np
from tpflower.mapping import SegmentSums, TableMapping, chunks, segment_sum
from tpflower.phases.pcg import PCGParams

#: the stopping tolerance's floor, in machine epsilons of the run's precision: with float32 messages the relative
#: residual stalls between 1e-6 and 1e-4 (measured: nycflights13 and movielens, 25 iterations, window 4 and 0), so
#: a float32 run stops at 1000 eps = 1.2e-4 instead of never; float64's floor (2.2e-13) is far below any tol used
TOL_FLOOR_EPS = 1000.0


class PCGSolver(LoJStrategy):
    """The PCG loop over a problem: the joined rows of :attr:`pcg_map` with weights :attr:`pcg_w` (None: 1),
    the objective's N, and the client messages of :meth:`pcg_messages`. Subclasses set the problem in their
    start method and evaluate with :meth:`pcg_test_predictions`."""

    params_type = PCGParams
    resumable = True
    setup_phase = "pcg_setup"
    validation = "none"  # it solves its problem to the end: no model selection on a validation part
    pcg_map: TableMapping
    pcg_w: np.ndarray | None = None
    pcg_N: int = 0
    pcg_y: np.ndarray

    def check_task(self, cfg) -> None:
        if self.task != "regression" or str(cfg.model.kind) != "linear":
            raise ValueError(
                f"algorithm={self.public_name} solves the ridge normal equations: it needs a regression label and "
                f"model=linear (here task={self.task}, model={cfg.model.kind}); use algorithm=admm or sgd"
            )

    # ------------------------------------------------------------------------------------------ problem

    def weighted(self, v: np.ndarray, rows: slice = slice(None)) -> np.ndarray:
        """W v for the problem's joined rows ``rows`` (v: their values)."""
        return v if self.pcg_w is None else self.pcg_w[rows].reshape((-1,) + (1,) * (v.ndim - 1)) * v

    def segment_sums(self, v: np.ndarray) -> dict[str, np.ndarray]:
        """s_i = P_i^T (W v) over the problem's joined rows, per table (its rows in the problem's order), summed
        over chunks of rows in float64 (no N-sized copy of v)."""
        v = np.asarray(v).reshape(-1)
        sums = {t: SegmentSums(n) for t, n in self.pcg_map.n_rows.items()}
        for s in chunks(len(v)):
            wv = self.weighted(np.asarray(v[s], np.float64), s)
            for t, p in self.pcg_map.p.items():
                sums[t].add(p[s], wv)
        return {t: acc.result() for t, acc in sums.items()}

    def joined_sums(
        self, h: Mapping[str, np.ndarray], dtype: np.dtype | type = np.float64
    ) -> tuple[dict[str, np.ndarray], float]:
        """With H = sum_i h_i[p_i] over the problem's joined rows (h_i: one value per table row): the segment
        sums s_i = P_i^T (W H) in ``dtype`` (summed in float64, each table's float64 sums released as soon as
        they are converted) and ||H||_W^2, over chunks of rows (H is never held whole)."""
        sums = {t: SegmentSums(n) for t, n in self.pcg_map.n_rows.items()}
        norm = 0.0
        for s in chunks(self.pcg_map.N):
            H = joined_predictions(self.pcg_map.p, h, s).astype(np.float64, copy=False).ravel()
            WH = self.weighted(H, s)
            norm += float(WH @ H)
            for t, p in self.pcg_map.p.items():
                sums[t].add(p[s], WH)
        return {t: sums.pop(t).result(dtype) for t in list(sums)}, norm

    def train_loss(self, htheta: Mapping[str, np.ndarray]) -> float:
        """The weighted training loss of the outputs ``htheta`` over the problem's joined rows, chunk by chunk."""
        total = 0.0
        for s in chunks(self.pcg_map.N):
            H = joined_predictions(self.pcg_map.p, htheta, s).astype(np.float64, copy=False)
            y = np.asarray(self.pcg_y[s], np.float64).reshape(H.shape)
            total += float(np.sum(self.weighted(loss_np(self.task, H, y).ravel(), s)))
        return total / self.pcg_N

    def counts(self) -> dict[str, np.ndarray]:
        """G_i: the summed weights of each table row's joined rows (unweighted: whole counts in the narrowest
        unsigned dtype, as ADMM sends them)."""
        if self.pcg_w is None:
            return {t: compact_counts(self.pcg_map.G(t)) for t in self.pcg_map.p}
        return {t: segment_sum(p, self.pcg_w, self.pcg_map.n_rows[t]) for t, p in self.pcg_map.p.items()}

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
        window = self.pcg_window()
        if window:
            return self.mpcg_start(rows, grams, {**config, "window": window, "cols": len(self.spec.table_names)})
        replies = self.send(self.pcg_messages(rows, grams, config))
        del rows, s, G
        rz, zz, zp, rr = self.dots(replies)
        hz = self.gather(replies, "h")
        return {
            "hz": hz,
            # T p and T theta per table row in the run's precision, updated in place (zero pages until written)
            "hp": {t: np.zeros_like(h, dtype=self.state_dtype) for t, h in hz.items()},
            "htheta": {t: np.zeros_like(h, dtype=self.state_dtype) for t, h in hz.items()},
            "pp": 0.0,
            "dots": [rz, zz, zp, rr],
            "rz_prev": 0.0,
            "rr0": rr,
            "stopped": False,  # a zero residual (theta = 0 exact: a constant label) still takes one step of 0
        }

    def pcg_window(self) -> int:
        """algorithm.window: the multipreconditioned CG's window (0: the classic recurrence), at most what fits in
        algorithm.window_mb (with a line saying so); PCGParams' defaults where the algorithm's settings have none
        (a coreset's train=pcg)."""
        asked = int(getattr(self.params, "window", PCGParams.window))
        budget = float(getattr(self.params, "window_mb", PCGParams.window_mb))
        fits = window_fit(self.pcg_map, np.dtype(self.pcg_history_dtype()).itemsize, budget)
        if fits < asked:
            self.log(
                f"algorithm.window: {fits} (asked {asked}; 0: the classic recurrence), the most whose directions "
                f"fit algorithm.window_mb={budget:g} MB at {sum(self.pcg_map.n_rows.values()):,} table rows"
            )
        return min(asked, fits)

    def pcg_history_dtype(self) -> np.dtype:
        """The precision of the window's T_i P_j: the run's (the outputs T_i z_i arrive in it)."""
        return np.dtype(self.state_dtype)

    def pcg_loop(self, done: int, loop: dict) -> None:
        if "window" in loop:
            self.mpcg_loop(done, loop)
            return
        beta_ridge = float(self.cfg.model.beta)
        for it in range(done + 1, int(self.cfg.epochs) + 1):
            if loop.get("stopped"):
                break
            rz, zz, zp, _ = loop["dots"]
            beta = rz / loop["rz_prev"] if loop["rz_prev"] else 0.0
            # T p_k = T z_k + beta_k T p_{k-1}, in place; T z_k is then no longer needed (released before the round)
            hp, htheta = loop["hp"], loop["htheta"]
            for t, hz in loop.pop("hz").items():
                combine(hp[t], beta, hz)
            del hz
            pp = zz + 2 * beta * zp + beta * beta * loop["pp"]
            dtype = self.state_dtype  # the run's precision, as ADMM's Y (float64 runs stay exact)
            s, HWH = self.joined_sums(hp, dtype)
            p_Ap = HWH / self.pcg_N + beta_ridge * pp
            alpha = rz / p_Ap if p_Ap > 0 else 0.0  # p = 0: the residual is 0 (theta exact), no step
            rows = {t: {"s": s.pop(t)} for t in self.spec.table_names}
            g = {t: {"g": v["g"]} for t, v in self.shard_sums(rows, "pcg_partial", "inner").items()}
            config = {"phase": "pcg_step", "epoch": it, "alpha": alpha, "beta": beta, **self.checkpoint_config(it)}
            replies = self.send(self.pcg_messages(rows, g, config))
            del rows
            dots = self.dots(replies)
            # T theta_{k+1} = T theta_k + alpha T p_k: the server follows the model's outputs itself (in place)
            for t in hp:
                combine(htheta[t], 1.0, hp[t], alpha)
            relative = relative_residual(dots[3], loop["rr0"])
            train_loss = self.train_loss(htheta)
            reg = sum(float(replies[(t, r.shards[0])][1].get("R", 0.0)) for t, r in self.routers.items())
            self.record_epoch(
                it,
                self.pcg_test_predictions(htheta),
                train_loss,
                {"objective": train_loss + beta_ridge * reg, "relative_residual": relative, **self.pcg_extra()},
            )
            stop = dots[3] == 0.0 or relative <= self.stop_tol()
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

    # ------------------------------------------------------------------------------------------ one direction per table

    def mpcg_start(self, rows, grams, config: dict) -> dict:
        """pcg_setup with ``window``: each table is told its column of the direction blocks."""
        col = {t: i for i, t in enumerate(self.spec.table_names)}
        msgs = self.pcg_messages(rows, grams, config)
        msgs = {k: (a, {**c, "col": col[k[0]]}) for k, (a, c) in msgs.items()}
        replies = self.send(msgs)
        dots = self.table_dots(replies)
        rr = sum(float(v[2]) for v in dots.values())
        # T theta per table row in the run's precision, updated in place (zero pages until written)
        htheta = {t: np.zeros(len(h), self.state_dtype) for t, h in self.gather(replies, "h").items()}
        return {
            "window": int(config["window"]),
            "hz": self.gather(replies, "h"),
            "dots": dots,
            "htheta": htheta,
            "past": [],  # per window iteration: T_i P_j per table (the run's precision), pinv(P_j^T K P_j)
            "S": np.zeros((0, 0)),  # the Euclidean Gram of the window's direction blocks, P_i^T P_j
            "rr0": rr,
            "stopped": False,  # a zero residual: one step of 0 (pinv of a zero Q), then the stop
        }

    def table_dots(self, replies: Mapping[ClientKey, Reply]) -> dict[str, np.ndarray]:
        """Each table's partial inner products (one shard per table: the shards hold the same block vectors)."""
        out = {t: np.asarray(replies[(t, r.shards[0])][0]["dots"], np.float64).ravel() for t, r in self.routers.items()}
        bad = [t for t, v in out.items() if not np.all(np.isfinite(v))]
        if bad:
            raise RuntimeError(f"pcg: non-finite inner products from table {bad[0]!r}")
        return out

    def mpcg_direction(self, loop: dict, dtype) -> dict:
        """The next direction block from the tables' T_i z_i and partial dots (Bridson & Greif 2006, Alg. 2):
        Z = [z_1 e_1 .. z_M e_M] (the block-Jacobi preconditioned residual split by table), A-orthogonalized
        against the window's blocks, P = Z - sum_j P_j C_j with C_j = (P_j^T K P_j)^+ P_j^T K Z, and the step
        alpha = (P^T K P)^+ P^T r that minimizes the K-norm error over x + span(P) (K = A^T W A / N + beta I).
        Everything from values the server holds: A Z from the outputs, the K-products from A P over the joined
        rows and the Euclidean ones (beta's term) from the tables' partial dots and the window's Gram S.
        C and alpha are rounded to ``dtype``, the precision they travel in, before the server uses them: the
        server's A P, T_i P and step are those of the tables' P."""
        tables = list(self.spec.table_names)
        c, N, beta = len(tables), self.pcg_N, float(self.cfg.model.beta)
        past, S = loop["past"], loop["S"]
        k = len(past)
        dots = loop["dots"]
        rz = np.array([dots[t][0] for t in tables])
        ZtP = [np.zeros((c, c)) for _ in range(k)]  # Z^T P_j: row col from the table in that column
        Ptr = [np.zeros(c) for _ in range(k)]  # P_j^T r: summed over the tables
        for col, t in enumerate(tables):
            v = dots[t][3:]
            if v.shape != (2 * c * k,):
                raise RuntimeError(f"pcg: table {t!r} sent {v.size} window dots, expected {2 * c * k}")
            v = v.reshape(k, 2, c)
            for j in range(k):
                ZtP[j][col] = v[j, 0]
                Ptr[j] += v[j, 1]
        p, W = self.pcg_map.p, self.pcg_w
        hz = {t: np.asarray(loop["hz"][t]).reshape(-1) for t in tables}
        # A P_j^T W A Z over the joined rows, chunk by chunk: A Z's column of table t is (T_t z_t)[p_t] and
        # A P_j = sum_t (T_t P_j)[p_t] (neither is held over all joined rows)
        PtWZ = [np.zeros((c, c)) for _ in range(k)]
        if k:
            for s in chunks(self.pcg_map.N):
                AZ = np.stack([hz[t][p[t][s]] for t in tables], axis=1).astype(np.float64)
                WAZ = AZ if W is None else W[s, None] * AZ
                for j in range(k):
                    PtWZ[j] += joined_predictions(p, past[j]["TP"], s).astype(np.float64).T @ WAZ
        C = [past[j]["Qp"] @ (PtWZ[j] / N + beta * ZtP[j].T) for j in range(k)]
        C = [np.asarray(Cj, dtype).astype(np.float64) for Cj in C]
        TP = {}  # T_t P = Z_t - sum_j (T_t P_j) C_j, per chunk of the table's rows, kept in ``hist`` (the history's)
        for col, t in enumerate(tables):
            out = np.empty((len(hz[t]), c), dtype=self.pcg_history_dtype())
            for s in chunks(len(out)):
                block = np.zeros((s.stop - s.start, c))
                block[:, col] = hz[t][s]
                for j in range(k):
                    block -= np.asarray(past[j]["TP"][t][s], np.float64) @ C[j]
                out[s] = block
            TP[t] = out
        QA = np.zeros((c, c))  # A P^T W A P, A P = sum_t (T_t P)[p_t] chunk by chunk
        for s in chunks(self.pcg_map.N):
            AP = joined_predictions(p, TP, s).astype(np.float64)
            QA += AP.T @ (AP if W is None else W[s, None] * AP)
        # Euclidean products: P^T P_i = Z^T P_i - sum_j C_j^T P_j^T P_i, P^T P = Z^T P - sum_j C_j^T (P_j^T P)
        blocks = [[S[j * c : (j + 1) * c, i * c : (i + 1) * c] for i in range(k)] for j in range(k)]
        PtPi = [ZtP[i] - sum((C[j].T @ blocks[j][i] for j in range(k)), np.zeros((c, c))) for i in range(k)]
        ZtPnew = np.diag([dots[t][1] for t in tables]) - sum((ZtP[j] @ C[j] for j in range(k)), np.zeros((c, c)))
        PtP = ZtPnew - sum((C[j].T @ PtPi[j].T for j in range(k)), np.zeros((c, c)))
        Pr = rz - sum((C[j].T @ Ptr[j] for j in range(k)), np.zeros(c))
        Q = QA / N + beta * (PtP + PtP.T) / 2
        Q = (Q + Q.T) / 2
        Qp = np.linalg.pinv(Q, rcond=1e-13, hermitian=True)
        alpha = np.asarray(Qp @ Pr, dtype).astype(np.float64)
        S_new = np.zeros(((k + 1) * c, (k + 1) * c))
        S_new[: k * c, : k * c] = S
        for i in range(k):  # P^T P_i and its transpose
            S_new[k * c :, i * c : (i + 1) * c] = PtPi[i]
            S_new[i * c : (i + 1) * c, k * c :] = PtPi[i].T
        S_new[k * c :, k * c :] = (PtP + PtP.T) / 2
        h = {t: np.empty(len(TP[t])) for t in tables}  # T_t P alpha: this step's outputs, chunk by chunk
        for t in tables:
            for s in chunks(len(h[t])):
                h[t][s] = np.asarray(TP[t][s], np.float64) @ alpha
        sums, _ = self.joined_sums(h, dtype)  # s_i = P_i^T W A P alpha, in the precision it travels in
        out = {"C": np.array(C).reshape(k, c, c), "alpha": alpha, "TP": TP, "Qp": Qp, "S": S_new}
        return {**out, "h": h, "s": sums}

    def mpcg_loop(self, done: int, loop: dict) -> None:
        """The iterations of the multipreconditioned CG: one round trip each (s, C, alpha down; T z and the
        partial dots up), as the classic recurrence's."""
        beta_ridge, tables = float(self.cfg.model.beta), list(self.spec.table_names)
        c, window = len(tables), int(loop["window"])
        for it in range(done + 1, int(self.cfg.epochs) + 1):
            if loop.get("stopped"):
                break
            dtype = self.state_dtype  # the messages in the run's precision, as ADMM's (float64 runs stay exact)
            step = self.mpcg_direction(loop, dtype)
            C, alpha, s = step["C"], step["alpha"], step["s"]
            rows = {t: {"s": s[t]} for t in tables}
            g = {t: {"g": v["g"]} for t, v in self.shard_sums(rows, "pcg_partial", "inner").items()}
            small = {"coef": np.concatenate([alpha, C.reshape(-1)]).astype(dtype)}  # alpha, then C_1..C_k
            msgs = self.pcg_messages(rows, g, {"phase": "pcg_step", "epoch": it, **self.checkpoint_config(it)})
            replies = self.send({k: ({**a, **small}, cfg) for k, (a, cfg) in msgs.items()})
            dots = self.table_dots(replies)
            htheta = loop["htheta"]
            for t in tables:
                combine(htheta[t], 1.0, step["h"][t])
            rr = sum(float(v[2]) for v in dots.values())
            relative = relative_residual(rr, loop["rr0"])
            train_loss = self.train_loss({t: v[:, None] for t, v in htheta.items()})
            reg = sum(float(replies[(t, r.shards[0])][1].get("R", 0.0)) for t, r in self.routers.items())
            self.record_epoch(
                it,
                self.pcg_test_predictions({t: v[:, None] for t, v in htheta.items()}),
                train_loss,
                {"objective": train_loss + beta_ridge * reg, "relative_residual": relative, **self.pcg_extra()},
            )
            stop = rr == 0.0 or relative <= self.stop_tol()
            past = [*loop["past"], {"TP": step["TP"], "Qp": step["Qp"]}][-window:]
            S = step["S"][-window * c :, -window * c :]
            loop = {**loop, "hz": self.gather(replies, "h"), "dots": dots, "htheta": htheta, "past": past, "S": S}
            loop["stopped"] = stop
            self.record_stop(it, relative, stop)
            self.end_epoch(it, loop)

    def stop_tol(self) -> float:
        """The relative residual that stops the loop: algorithm.tol, floored at TOL_FLOOR_EPS machine epsilons of
        the run's precision (the residual the run can reach); 0 stays 0 (never stop early)."""
        tol = float(self.params.tol)
        return max(tol, TOL_FLOOR_EPS * float(np.finfo(self.state_dtype).eps)) if tol > 0 else 0.0

    def pcg_test_predictions(self, htheta: Mapping[str, np.ndarray]) -> np.ndarray:
        """The test split's predictions from the tables' outputs T_i theta_i over all their rows."""
        return joined_predictions(self.test.p, htheta)

    def pcg_extra(self) -> dict[str, float]:
        return {}

    def record_stop(self, it: int, relative: float, stop: bool) -> None:
        """results.stopped: "tol" (||r|| <= tol ||r_0||) or "epochs" (the maximum iterations)."""
        assert self.results is not None
        if stop or it >= int(self.cfg.epochs):
            tol, asked = self.stop_tol(), float(self.params.tol)
            floor = (
                f" (algorithm.tol={asked:g} floored at the {np.dtype(self.state_dtype).name} run's)"
                if tol > asked
                else ""
            )
            detail = f"relative residual {relative:.3g}" + (f" <= tol {tol:g}{floor}" if stop else "")
            self.results.stopped = {"epoch": it, "reason": "tol" if stop else "epochs", "detail": detail}
            if stop:
                self.log(f"stopped after iteration {it}: {detail}")

    def plan_feature_dp(self) -> dict:  # pragma: no cover - the registry refuses feature DP first
        raise ValueError(f"algorithm={self.public_name} has no feature-DP plan")


def relative_residual(rr: float, rr0: float) -> float:
    """||r_k|| / ||r_0|| from the squared norms; 0 when r_0 is 0 (theta = 0 solves the system exactly)."""
    return float(np.sqrt(max(rr, 0.0) / rr0)) if rr0 > 0 else 0.0


def combine(out: np.ndarray, a: float, x: np.ndarray, b: float = 1.0) -> None:
    """out = a out + b x in place, chunk by chunk in float64 (``out`` keeps its dtype, the run's precision: no
    float64 copy of a per-row vector; in float64 the same values as the whole-array expression)."""
    flat, xs = out.reshape(-1), np.asarray(x).reshape(-1)
    for s in chunks(len(flat)):
        flat[s] = a * np.asarray(flat[s], np.float64) + b * np.asarray(xs[s], np.float64)


def window_fit(mapping: TableMapping, itemsize: int, budget_mb: float) -> int:
    """The largest window whose server state fits ``budget_mb``: each direction block of the window and the one
    being formed holds T_i P_j, c values per table row (c = the tables), in ``itemsize`` bytes each."""
    c = len(mapping.n_rows)
    block = sum(int(n) for n in mapping.n_rows.values()) * c * itemsize
    return max(int(budget_mb * 1e6 // max(block, 1)) - 1, 0)


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
        self.pcg_y = np.asarray(self.y_train).reshape(-1)  # in the run's precision (summed in float64)

    def start_pcg(self) -> dict:
        self.setup()
        self.pcg_problem()
        return self.pcg_start()


class TPUCQPCG(TPJoinPCG):
    """algorithm=pcg scenario=ucq: the same iterates; a sharded table's blocks are sums over its shards."""

    algorithm = "tp_ucq_pcg"
