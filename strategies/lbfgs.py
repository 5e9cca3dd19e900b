"""L-BFGS over the join, server side (docs/algorithms.md, section "L-BFGS"; the client side and the message
table are in tpflower/phases/lbfgs.py).

The server holds no parameter vector. It turns the tables' per-row outputs into the objective F (Eq. 2 over
the whole training join) and the aggregated derivatives Y_i = S_i dl/dH (Eq. 10 with B = [N]), sums the
tables' partial Gram matrices of [s_0..s_{c-1}, y_0..y_{c-1}, g] and runs the two-loop recursion (Nocedal &
Wright Alg. 7.4) on those scalars (:func:`two_loop`), so the direction reaches the tables as coefficients over
their own blocks. Backtracking Armijo line search: one trial (one round trip: per-row outputs at
theta + t d) per step length, the gradient at the accepted point with the next iteration's first message. An
iteration costs 2 round trips when the first step length is accepted, one more per rejected trial.

Over the union (:class:`TPUCQLBFGS`) the gradient round also coordinates the shards of a sharded table: they
send their partial gradients and inner products, the server assembles the table's Gram matrix
(:func:`shard_gram`) and sends the summed gradient with the first trial, so an iteration costs the same round
trips as over the join.
"""

from __future__ import annotations

import numpy as np

from strategies.base import LoJStrategy
from tpflower.batches import joined_predictions
from tpflower.losses import loss_grad_np, loss_np
from tpflower.phases.lbfgs import LBFGSParams

EPS = np.finfo(np.float64).eps


def two_loop(G: np.ndarray, c: int, keep: list[int]) -> np.ndarray:
    """The L-BFGS direction d = -H_k g as coefficients over the basis [s_0..s_{c-1}, y_0..y_{c-1}, g] whose Gram
    matrix is ``G``, using the pairs ``keep`` (oldest first) and H_0 = (s.y / y.y) I of the newest pair
    (Nocedal & Wright Alg. 7.4, every inner product read from G)."""
    n = 2 * c + 1
    q = np.zeros(n)
    q[2 * c] = 1.0
    alpha, rho = {}, {}
    for j in reversed(keep):
        rho[j] = 1.0 / G[j, c + j]
        alpha[j] = rho[j] * (G[j] @ q)
        q[c + j] -= alpha[j]
    gamma = G[keep[-1], c + keep[-1]] / G[c + keep[-1], c + keep[-1]] if keep else 1.0
    r = gamma * q
    for j in keep:
        b = rho[j] * (G[c + j] @ r)
        r[j] += alpha[j] - b
    return -r


def keep_pairs(G: np.ndarray, c: int, candidate: bool, memory: int) -> list[int]:
    """The pairs the memory keeps: the ones kept before and the candidate (the newest pair) if it has positive
    curvature s.y > eps y.y (else the update is skipped, as L-BFGS-B does), at most ``memory`` of the newest."""
    keep = list(range(c - 1 if candidate else c))
    if candidate and G[c - 1, 2 * c - 1] > EPS * G[2 * c - 1, 2 * c - 1]:
        keep.append(c - 1)
    return keep[-memory:]


def summed_gram(grams: list[np.ndarray]) -> np.ndarray:
    """The sum of the tables' Gram matrices of their blocks of the basis, checked square, alike and finite."""
    if len({g.shape for g in grams}) != 1 or grams[0].ndim != 2 or grams[0].shape[0] != grams[0].shape[1]:
        raise RuntimeError(f"lbfgs: the tables' Gram matrices differ in shape {[g.shape for g in grams]}")
    total = sum(grams)
    if not np.all(np.isfinite(total)):
        raise RuntimeError("lbfgs: non-finite inner products")
    return total


def shard_gram(VV: np.ndarray, Va: np.ndarray, aa: float, c: int, candidate: bool) -> np.ndarray:
    """A sharded table's Gram matrix of its blocks of [s_0..s_{c'-1}, y_0..y_{c'-1}, g] (c' = c + candidate)
    from the inner products of W = [S, Y, r, (s, u), a]: the shards' V^T V (V = W without a), the summed
    V^T a_q and a.a of the summed partial gradient a. The new basis is W M with g = a + r, the candidate pair
    (s, y = a + u) appended to the c kept ones (u = r - g_prev): its Gram matrix is M^T (W^T W) M."""
    n = VV.shape[0]
    if n != 2 * c + 1 + 2 * int(candidate) or VV.shape != (n, n) or Va.shape != (n,):
        raise RuntimeError(f"lbfgs: a shard's inner products ({VV.shape}, {Va.shape}) for c={c}, candidate={candidate}")
    WW = np.empty((n + 1, n + 1))
    WW[:n, :n], WW[:n, n], WW[n, :n], WW[n, n] = VV, Va, Va, aa
    k = c + int(candidate)
    r, a = 2 * c, n
    M = np.zeros((n + 1, 2 * k + 1))
    for j in range(c):
        M[j, j] = M[c + j, k + j] = 1.0
    if candidate:
        M[2 * c + 1, c] = 1.0  # s
        M[a, k + c] = M[2 * c + 2, k + c] = 1.0  # y = a + u
    M[a, 2 * k] = M[r, 2 * k] = 1.0  # g = a + r
    return M.T @ WW @ M


class TPJoinLBFGS(LoJStrategy):
    algorithm = "tp_join_lbfgs"
    params_type = LBFGSParams
    resumable = True
    validation = "select"

    def protocol(self) -> None:
        done, loop = self.begin(self.start_lbfgs)
        p = self.params
        for it in range(done + 1, int(self.cfg.epochs) + 1):
            if loop.get("stopped"):
                break
            G = self.gradient_round(it, loop["h"], loop["t"])
            c = (len(G) - 1) // 2
            gnorm = float(np.sqrt(max(G[-1, -1], 0.0)))
            g0 = loop.get("g0") or gnorm
            loop = {**loop, "t": 0.0}  # the clients took the step
            if gnorm == 0.0 or (p.tol > 0 and gnorm <= p.tol * g0):
                self.stop(it - 1, "tol", f"gradient norm {gnorm:.3g} <= tol {p.tol:g} x {g0:.3g}")
                break
            keep = keep_pairs(G, c, it > 1 and c > 0, p.memory)
            delta = two_loop(G, c, keep)
            slope = float(delta @ G[:, -1])  # g.d
            if slope >= 0:  # not a descent direction (round-off): restart from steepest descent
                keep, delta = [], two_loop(G, c, [])
                slope = float(delta @ G[:, -1])
            step = 1.0 if keep else min(1.0, 1.0 / gnorm)
            accepted = self.line_search(it, delta, np.array(keep, dtype=np.int64), step, loop["F"], slope)
            if accepted is None:
                self.record_point(it, loop["h"], loop["F"])
                self.stop(it, "line search", f"no step of {p.max_trials} trials met Armijo's condition")
                self.end_epoch(it, {**loop, "stopped": True})
                break
            t, h, F, R = accepted
            selected = self.record_point(it, h, F)
            change = loop["F"] - F
            small = p.tol > 0 and change <= p.tol * max(abs(loop["F"]), abs(F), 1.0)
            if small:
                self.stop(it, "tol", f"relative loss change {change / max(abs(F), 1.0):.3g} <= tol {p.tol:g}")
            elif it == int(self.cfg.epochs) and not selected:
                self.stop(it, "epochs", f"gradient norm {gnorm:.3g} before the last step")
            loop = {"h": h, "F": F, "R": R, "t": t, "g0": g0, "stopped": small or selected}
            self.end_epoch(it, loop)
        if loop["t"]:  # the last accepted step, which no gradient message took
            self.send(self.messages(lambda _: ({}, {"phase": "lbfgs_take", "t": loop["t"]})))
        self.finish()

    def start_lbfgs(self) -> dict:
        """Setup, then every table's outputs at theta_0 (the objective there)."""
        self.setup()
        h, R = self.trial_round({}, {"phase": "lbfgs_start", "d_out": self.d_out})
        return {"h": h, "F": self.objective(h, R), "R": R, "t": 0.0, "g0": None, "stopped": False}

    def line_search(
        self, it: int, delta: np.ndarray, pairs: np.ndarray, step: float, F: float, slope: float
    ) -> tuple[float, dict[str, np.ndarray], float, float] | None:
        """Backtracking (Nocedal & Wright Alg. 3.1): the first t in step, step*backtrack, ... with
        F(theta + t d) <= F + c1 t g.d; (t, outputs, F, R) there, or None after max_trials trials."""
        p, t = self.params, step
        for trial in range(p.max_trials):
            arrays = {"delta": delta, "pairs": pairs} if trial == 0 else {}
            config = {"phase": "lbfgs_trial", "epoch": it, "t": t, **self.checkpoint_config(it)}
            h, R = self.trial_round(arrays, config)
            F_t = self.objective(h, R)
            if np.isfinite(F_t) and F_t <= F + p.c1 * t * slope:
                return t, h, F_t, R
            t *= p.backtrack
        return None

    def gradient_round(self, it: int, h: dict[str, np.ndarray], t: float) -> np.ndarray:
        """The gradient message (the clients take the accepted step t d first: then they hold the model of the
        last evaluation, which they copy with a validation part): the summed Gram matrix of
        [s_0..s_{c-1}, y_0..y_{c-1}, g] at the new point."""
        Y = self.derivatives(h)
        config = {"phase": "lbfgs_grad", "epoch": it, "t": t, "N": self.train.N, **self.step_selection()}
        return self.gram(self.send(self.messages(lambda table: ({"Y": Y[table]}, config))))

    def trial_round(self, arrays: dict[str, np.ndarray], config: dict) -> tuple[dict[str, np.ndarray], float]:
        """One outputs message (lbfgs_start, lbfgs_trial): every table's outputs h and the penalty sum R."""
        replies = self.send(self.messages(lambda _: (arrays, config)))
        return self.outputs(replies), self.penalty(replies)

    def derivatives(self, h: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Y_i = S_i g, g_j = dl(H_j; y_j)/dH_j over the training join (Eq. 10 with B = [N])."""
        g = loss_grad_np(self.task, joined_predictions(self.train.p, h), self.y_train)
        dtype = next(iter(h.values())).dtype
        return {t: self.train.segment_sum(t, g).astype(dtype, copy=False) for t in self.spec.table_names}

    def objective(self, h: dict[str, np.ndarray], R: float) -> float:
        """F = (1/N) sum_j l(H_j; y_j) + beta sum_i R_i (Eq. 2), in float64."""
        return self.data_loss(h) + float(self.cfg.model.beta) * R

    def data_loss(self, h: dict[str, np.ndarray]) -> float:
        return float(np.mean(loss_np(self.task, joined_predictions(self.train.p, h), self.y_train)))

    @staticmethod
    def penalty(replies) -> float:
        return sum(float(r[1]["R"]) for r in replies.values())

    @staticmethod
    def gram(replies) -> np.ndarray:
        """The sum over tables of their partial Gram matrices (every block of the basis lives on one table)."""
        return summed_gram([np.asarray(r[0]["gram"], dtype=np.float64) for r in replies.values()])

    def step_selection(self) -> dict:
        """The selection's config of a message that takes the last evaluation's step (strategies.selection)."""
        return self.selection.config(self.selection.evaluations)

    def record_point(self, it: int, h: dict[str, np.ndarray], F: float) -> bool:
        """Record iteration ``it`` at outputs ``h``; True when the validation loss stops the run here."""
        return self.record_evaluation(it, joined_predictions(self.evaluated.p, h), self.data_loss(h), {"objective": F})

    def stop(self, it: int, reason: str, detail: str) -> None:
        """results.stopped: "tol", "line search" or "epochs" (the maximum iterations)."""
        assert self.results is not None
        self.results.stopped = {"epoch": it, "reason": reason, "detail": detail}
        if reason != "epochs":
            self.log(f"stopped after iteration {it}: {detail}")

    def plan_feature_dp(self) -> dict:  # pragma: no cover - the registry refuses feature DP first
        raise ValueError("algorithm=lbfgs has no feature-DP plan")


class TPUCQLBFGS(TPJoinLBFGS):
    """algorithm=lbfgs scenario=ucq: the same iterates, the same 2 round trips per iteration. The shards of a
    sharded table hold the same theta_i and memory; in the gradient round each sends its partial data gradient
    a_q and the products :func:`shard_gram` needs (tpflower/phases/lbfgs.py, lbfgs_partial); the server, the
    shards' coordinator (as in TP-UCQ-SGD, Eq. 17), sums them and sends a with the first trial."""

    algorithm = "tp_ucq_lbfgs"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.summed: dict[str, np.ndarray] = {}  # a per sharded table, from the gradient round to the first trial

    def sharded(self, table: str) -> bool:
        return len(self.routers[table].shards) > 1

    def gradient_round(self, it: int, h: dict[str, np.ndarray], t: float) -> np.ndarray:
        Y = self.derivatives(h)
        parts = {table: self.routers[table].scatter_all(Y[table]) for table in Y if self.sharded(table)}
        common = {"epoch": it, "t": t, "N": self.train.N, **self.step_selection()}
        replies = self.send(
            {
                (table, q): ({"Y": parts[table][q]}, {"phase": "lbfgs_partial", **common})
                if table in parts
                else ({"Y": Y[table]}, {"phase": "lbfgs_grad", **common})
                for table, q in self.clients
            }
        )
        grams, self.summed = [], {}
        for table, router in self.routers.items():
            first = replies[(table, router.shards[0])][0]
            if table not in parts:
                grams.append(np.asarray(first["gram"], dtype=np.float64))
                continue
            shards = [replies[(table, q)][0] for q in router.shards]
            layouts = {tuple(np.asarray(r["layout"]).tolist()) for r in shards}
            if len(layouts) != 1:
                raise RuntimeError(f"lbfgs: the shards of table {table!r} hold different memories {sorted(layouts)}")
            c, candidate = next(iter(layouts))
            a = sum(np.asarray(r["g"], dtype=np.float64) for r in shards)
            Va = sum(np.asarray(r["cross"], dtype=np.float64) for r in shards)
            self.summed[table] = a
            grams.append(shard_gram(np.asarray(first["gram"], np.float64), Va, float(a @ a), c, bool(candidate)))
        return summed_gram(grams)

    def trial_round(self, arrays: dict[str, np.ndarray], config: dict) -> tuple[dict[str, np.ndarray], float]:
        """Every shard's outputs put back over its table; the first trial of an iteration carries a sharded
        table's summed partial gradient a."""
        first = "delta" in arrays
        replies = self.send(
            {
                (table, q): ({**arrays, "g": self.summed[table]} if first and table in self.summed else arrays, config)
                for table, q in self.clients
            }
        )
        if first:
            self.summed = {}
        h = {
            table: router.gather_all({q: replies[(table, q)][0]["h"] for q in router.shards})
            for table, router in self.routers.items()
        }
        R = sum(float(replies[(table, router.shards[0])][1]["R"]) for table, router in self.routers.items())
        return h, R
