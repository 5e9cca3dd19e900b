"""Coresets for VFL over joins, server side (Huang et al., NeurIPS 2022, "Coresets for Vertical Federated
Learning": Alg. 1 DIS, Alg. 2 VRLR; docs/algorithms.md, "Coresets for VFL").

algorithm=coreset: a weighted coreset S of m joined training rows, built by distributed importance sampling
(DIS, Alg. 1) over the join without materializing it, then ridge trained on S inside the privacy model:
TP-Join-ADMM on the restricted mapping p_i|S with weights (train=admm) or TP-Join-SGD with weighted Y_i
(train=sgd). sampling=uniform is the baseline: m joined rows drawn uniformly by the server, weights N / m.

DIS over a join (exact: the same distribution as DIS on the materialized join):
  round 1  server -> client i: G_i (its rows' counts in the join);  client -> server: G^(i) = sum_u G_iu g_u
           the server draws (a_1..a_T) ~ Multinomial(m, G^(i) / G), G = sum_i G^(i)
  round 2  server -> client i: a_i;  client -> server: a_i base rows u, P(u) = G_iu g_u / G^(i);
           the server turns each u into a uniform joined row of G_i(u)  (so P(j) = sum_i g^(i)_{p_i(j)} / G)
  round 3  server -> client i: the distinct rows p_i(j), j in S (n_i^S <= m);  client -> server: g^(i) at
           those rows; g_j = sum_i g^(i)_{p_i(j)}, w_j = G / (m g_j); repeated draws add their weights.
Numbers exchanged besides G_i: 2T + m + 2 sum_i n_i^S <= 2T + m + 2mT (the paper and the authors' code count
T + 3mT, an upper bound for T, m >= 2). Test predictions are evaluation rounds (not training traffic). The
clients bound every row-indexed request (tpflower/phases/coreset.py): at most m rows, distinct, in the join,
weigh once per run, the training rows within the weighed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from strategies.base import LoJStrategy
from strategies.join_admm import ADMMServer, admm_rho
from strategies.join_sgd import sgd_rounds
from strategies.pcg import PCGSolver
from tpflower.batches import BatchPlan, SGDSchedule, batch_size_of, joined_predictions
from tpflower.join_counts import compact_counts
from tpflower.losses import loss_grad_np, loss_np
from tpflower.mapping import TableMapping, index_dtype, segment_sum
from tpflower.owner import DEFAULT_MIN_GROUP_ROWS
from tpflower.phases.coreset import CoresetParams, coreset_size


@dataclass
class Coreset:
    """A weighted coreset: distinct joined rows ``rows`` (indices into the sampled mapping) and their summed
    weights; ``draws`` = m; ``total`` = G (sum of the sensitivities; N for uniform sampling)."""

    rows: np.ndarray
    weights: np.ndarray
    draws: int
    total: float

    @classmethod
    def of_draws(cls, joined: np.ndarray, w: np.ndarray, total: float) -> Coreset:
        """Collapse repeated draws: a joined row drawn r times carries the sum of its r weights."""
        rows, inv = np.unique(joined, return_inverse=True)
        return cls(rows, np.bincount(inv.reshape(-1), weights=w, minlength=len(rows)), len(joined), float(total))


def row_ids(rows: np.ndarray, n_rows: int) -> np.ndarray:
    """Table row ids as sent: int32 when the table allows it."""
    return rows.astype(index_dtype(n_rows))


def uniform_joined_rows(p: np.ndarray, n_rows: int, base_rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each base row u -> a joined row drawn uniformly from G_i(u) = {j : p_i(j) = u} (vectorized)."""
    G = np.bincount(p, minlength=n_rows)
    if len(base_rows) and (base_rows.min() < 0 or base_rows.max() >= n_rows or (G[base_rows] == 0).any()):
        raise ValueError("a client sampled a row that does not occur in the join")
    order = np.argsort(p, kind="stable")
    starts = np.cumsum(G) - G
    offsets = np.floor(rng.random(len(base_rows)) * G[base_rows]).astype(np.int64)
    return order[starts[base_rows] + offsets]


def joined_sampling_probabilities(mapping: TableMapping, g: dict[str, np.ndarray]) -> np.ndarray:
    """P(j) of one DIS draw, from the tables' per-row sensitivities: sum_i g^(i)_{p_i(j)} / G (tests, checks)."""
    gj = sum(g[t][p] for t, p in mapping.p.items())
    return gj / gj.sum()


class WeightedADMMServer(ADMMServer):
    """TP-Join-ADMM on weighted joined rows: sum_j w_j l(H_j; y_j) with the penalty weighted alike.

    With the scaled dual mu_j = lambda_j / w_j the z-update (Eq. 7) and dual update (Eq. 8) are TP-Join-ADMM's
    (:meth:`ADMMServer.update`, unchanged) and Y_iu = sum_{j in G_i(u)} w_j (mu_j + rho s_ij) (Eq. 14),
    G_iu = sum_{j in G_i(u)} w_j (Eq. 15): with integer weights, exactly TP-Join-ADMM on the rows repeated w_j
    times (tested). The coreset holds at most m rows: no chunking."""

    def __init__(
        self, task: str, y: np.ndarray, mapping: TableMapping, d_c: int, rho: float, variant: str, weights: np.ndarray
    ):
        super().__init__(task, y, mapping, d_c, rho, variant)
        self.w = np.asarray(weights, dtype=np.float64)

    def G(self) -> dict[str, np.ndarray]:
        return {t: segment_sum(p, self.w, self.mapping.n_rows[t]) for t, p in self.mapping.p.items()}

    def scatter(self, h: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Y_iu = sum_{j in G_i(u)} w_j (mu_j + rho s_ij) at the latest update (Eq. 14, weighted)."""
        assert self._h is not None, "scatter() before update()"
        base = np.negative(self.D, dtype=np.float64)  # H - z
        if self.variant == "sharing":
            base /= self.M
        lam = self.lam.astype(np.float64)
        Y = {}
        for t, p_t in self.mapping.p.items():
            term = lam + self.rho * (base - np.asarray(h[t], dtype=np.float64)[p_t])  # mu_j + rho s_ij
            Y[t] = segment_sum(p_t, self.w[:, None] * term, self.mapping.n_rows[t]).astype(h[t].dtype, copy=False)
        return Y


def construction_line(construction: dict[str, float], sampling: str, joined: int) -> str:
    """The coreset's one line, once its construction is done (its numbers stay in every history entry):
    ``coreset: m=2000 draws (DIS) over 230,862 joined rows, 1,986 distinct; 3 rounds, 0.42 MB``."""
    how = "DIS" if sampling == "sensitivity" else "uniform"
    mb = (construction["bytes_up"] + construction["bytes_down"]) / 1e6
    return (
        f"coreset: m={int(construction['m'])} draws ({how}) over {joined:,} joined rows, "
        f"{int(construction['distinct_rows']):,} distinct; {int(construction['rounds'])} rounds, {mb:.2f} MB"
    )


class DISStrategy(LoJStrategy):
    """DIS (Alg. 1) over a join, or uniform sampling, for the coreset algorithms."""

    kind = "ridge"  # the sensitivity the clients compute: ridge (Alg. 2) | kmeans (Alg. 3)
    construction: dict[str, float]
    validation = "none"  # it solves its problem to the end: no model selection on a validation part

    def require_join(self) -> None:
        """After setup: these algorithms run on the join scenario, one client per table."""
        if self.scenario != "join" or any(len(r.shards) > 1 for r in self.routers.values()):
            raise ValueError(f"algorithm={self.public_name} runs on the join scenario (one client per table)")

    @property
    def min_group_rows(self) -> int:
        """The run's min_group_rows (a deployed owner with a larger one refuses on its node, naming its bound)."""
        return int(self.cfg.get("min_group_rows") or DEFAULT_MIN_GROUP_ROWS)

    def sample_coreset(self, mapping: TableMapping, m_asked: int | str, sampling: str) -> Coreset:
        """m draws over the joined rows of ``mapping`` (DIS or uniform); the construction's traffic is noted.
        ``algorithm.m: auto`` resolves to min(2000, N / min_group_rows) (the run's min_group_rows: a deployed
        owner with a larger one refuses, naming its bound)."""
        assert self.comm is not None
        g = self.min_group_rows
        m = coreset_size(m_asked, mapping.N, g)
        if m < 1:
            raise ValueError(
                f"algorithm.m=auto: the join has {mapping.N} rows, fewer than min_group_rows = {g}: too few for "
                "a coreset whose every row stands for min_group_rows joined rows"
            )
        if m * g > mapping.N:  # every node would refuse it (tpflower.phases.coreset.check_G): one line here
            raise ValueError(
                f"algorithm.m={m}: a coreset of the join's {mapping.N} rows has at most {mapping.N // g} rows, "
                f"each standing for at least min_group_rows = {g} joined rows (the owners' bound); set "
                f"algorithm.m={mapping.N // g} or less, or algorithm.m=auto"
            )
        before = self.comm.snapshot()
        rng = np.random.default_rng([int(self.cfg.seed) & 0xFFFFFFFF, 0xC05E])
        if sampling == "uniform":  # the baseline: no client round, weights N / m
            joined = rng.integers(0, mapping.N, size=m)
            core = Coreset.of_draws(joined, np.full(m, mapping.N / m), float(mapping.N))
        else:
            core = self.dis(mapping, m, rng)
        after = self.comm.snapshot()
        self.construction = {k: after[k] - before[k] for k in ("rounds", "bytes_up", "bytes_down")}
        self.construction["distinct_rows"] = float(len(core.rows))
        self.construction["m"] = float(m)  # the draws (algorithm.m, auto resolved)
        self.log(construction_line(self.construction, sampling, mapping.N))
        return core

    def dis(self, mapping: TableMapping, m: int, rng: np.random.Generator) -> Coreset:
        """Alg. 1 over the join (three rounds; see the module docstring)."""
        tables = list(mapping.p)
        G = {t: mapping.G(t) for t in tables}
        replies = self.send(
            self.messages(
                lambda t: ({"G": compact_counts(G[t])}, {"phase": "sensitivity", "kind": self.kind, "N": mapping.N})
            )
        )
        totals = np.array([float(replies[(t, 0)][0]["total"][0]) for t in tables])
        if not (np.isfinite(totals).all() and (totals >= 0).all() and totals.sum() > 0):
            raise RuntimeError(f"DIS: the clients' sensitivity totals are not usable: {totals.tolist()}")
        total = float(totals.sum())
        a = rng.multinomial(m, totals / total)  # round 1: (a_1..a_T) ~ Multinomial(m, G^(i) / G)
        counts = dict(zip(tables, a))
        replies = self.send(
            self.messages(lambda t: ({"a": np.array([counts[t]], dtype=np.int64)}, {"phase": "sample"}))
        )
        parts = []
        for t in tables:  # round 2: base rows -> uniform joined rows of G_i(u)
            base = np.asarray(replies[(t, 0)][0]["rows"], dtype=np.int64)
            if len(base) != counts[t]:
                raise RuntimeError(f"DIS: table {t!r} sent {len(base)} rows for a_i = {counts[t]}")
            parts.append(uniform_joined_rows(mapping.p[t], mapping.n_rows[t], base, rng))
        joined = np.concatenate(parts)
        # round 3: each table is asked once about the DISTINCT rows p_i(j), j in S (at most m; the clients refuse
        # anything else), and the server reads the answers back along p_i(j)
        asked = {t: np.unique(mapping.p[t][joined], return_inverse=True) for t in tables}
        replies = self.send(
            self.messages(lambda t: ({"rows": row_ids(asked[t][0], mapping.n_rows[t])}, {"phase": "weigh"}))
        )
        g = sum(np.asarray(replies[(t, 0)][0]["sens"], dtype=np.float64)[asked[t][1].reshape(-1)] for t in tables)
        if len(g) != m or not (g > 0).all():
            raise RuntimeError("DIS: a sampled joined row has no positive sensitivity")
        self.dis_joined, self.dis_g = joined, g  # the draws (for checks)
        return Coreset.of_draws(joined, total / (m * g), total)  # w_j = G / (m g_j)


class CoresetRidge(PCGSolver, DISStrategy):
    """algorithm=coreset: ridge (VRLR) on a DIS coreset of the training join, trained by weighted
    TP-Join-ADMM, TP-Join-SGD or PCG on the weighted normal equations (train=pcg, strategies/pcg.py);
    sampling=uniform is the baseline.

    Resumable: the construction and the training's first round run once (``begin``); every epoch checkpoints
    the coreset, the training loop's state and the run record, and each client its state (its bounds on the
    rows asked about included), on the epoch's last training message."""

    algorithm = "coreset"
    params_type = CoresetParams
    resumable = True
    checkpointed = ("coreset", "S", "y_S", "test_plan", "construction")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.task != "regression":  # before any node is contacted
            raise ValueError(
                f"algorithm=coreset trains ridge regression; dataset {self.spec.name!r} has a {self.task} label"
            )
        if self.params.train == "pcg" and str(self.cfg.model.kind) != "linear":  # each node would refuse it
            raise ValueError(
                f"algorithm.train=pcg solves linear ridge regression (model=linear); model={self.cfg.model.kind} "
                "trains with algorithm.train=admm or algorithm.train=sgd"
            )

    def protocol(self) -> None:
        alg = self.params
        done, loop = self.begin(self.start_coreset)
        if alg.train == "admm":
            self._train_admm(done, loop)
        elif alg.train == "pcg":
            self._pcg_problem()
            self.pcg_loop(done, loop)
        else:
            self._train_sgd(done, loop)
        self.finish()

    def start_coreset(self) -> dict:
        """Setup, the construction (DIS or uniform), then the training's first round."""
        self.setup()
        self.require_join()
        alg = self.params
        core = self.sample_coreset(self.train, alg.m, alg.sampling)
        self.coreset = core
        self.S = self.train.subset(core.rows)  # p_i|S: the global table rows of the coreset's joined rows
        self.y_S = self.y_train[core.rows].astype(np.float64)
        self.test_plan = BatchPlan.of(self.test, np.arange(self.test.N))
        if alg.train == "pcg":
            return self._start_pcg()
        return self._start_admm(core) if alg.train == "admm" else self._start_sgd()

    def _pcg_problem(self) -> TableMapping:
        """PCG on sum_j w_j 1/2 (H_j - y_j)^2 / N + beta/2 ||theta||^2 over the coreset's rows (local mapping)."""
        plan = BatchPlan.of(self.S, np.arange(self.S.N))
        self.pcg_map = TableMapping(plan.inv, {t: len(U) for t, U in plan.U.items()})
        self.pcg_w, self.pcg_N, self.pcg_y = self.coreset.weights, self.train.N, self.y_S.ravel()
        return plan

    def _start_pcg(self) -> dict:
        plan = self._pcg_problem()
        self.setup_phase = "coreset_pcg_setup"
        loop = self.pcg_start({t: {"rows": plan.U[t]} for t in plan.U})
        # from now on each client answers for its coreset rows only: the replies are checked against that count
        self.client_rows = {k: len(plan.U[k[0]]) for k in self.clients}
        return loop

    def pcg_test_predictions(self, htheta: Mapping[str, np.ndarray]) -> np.ndarray:
        return self._evaluate()

    def pcg_extra(self) -> dict[str, float]:
        return self._extra()

    def _evaluate(self) -> np.ndarray:
        """Test predictions: f_i on the test rows U_i (an evaluation round, not training traffic; the clients
        answer the same rows every time, at most once per training step)."""
        replies = self.send(
            self.messages(lambda t: ({"rows": self.test_plan.U[t]}, {"phase": "coreset_predict"})), kind="eval"
        )
        return joined_predictions(self.test_plan.inv, self.outputs(replies))

    def _extra(self) -> dict[str, float]:
        c = self.construction
        return {
            "coreset_rows": c["distinct_rows"],
            "coreset_m": c.get("m", c["distinct_rows"]),
            "construction_rounds": c["rounds"],
            "construction_bytes": c["bytes_up"] + c["bytes_down"],
        }

    def _start_admm(self, core: Coreset) -> dict:
        plan = BatchPlan.of(self.S, np.arange(self.S.N))  # U_i^S and the local mapping inv_i
        local = TableMapping(plan.inv, {t: len(U) for t, U in plan.U.items()})
        rho = admm_rho(self.params.rho, self.task)
        admm = WeightedADMMServer(self.task, self.y_S, local, self.d_out, rho, self.params.variant, core.weights)
        GS = admm.G()
        config = {"phase": "coreset_admm_setup", "N": self.train.N, "d_out": self.d_out, "rho": rho}
        self.send(self.messages(lambda t: ({"rows": plan.U[t], "G": GS[t]}, config)))
        # from now on each client predicts its coreset rows only: the replies are checked against that count
        self.client_rows = {k: len(plan.U[k[0]]) for k in self.clients}
        # ADMM starts from x^0 = 0 (as TP-Join-ADMM); the initial models stay on the nodes
        h = {t: np.zeros((len(U), self.d_out), dtype=self.cfg.precision) for t, U in plan.U.items()}
        return {"admm": admm, "h": h}

    def _train_admm(self, done: int, loop: dict) -> None:
        admm, h, core = loop["admm"], loop["h"], self.coreset
        self.admm = admm
        for epoch in range(done + 1, int(self.cfg.epochs) + 1):
            Y = admm.step(h)
            replies = self.send(
                self.messages(
                    lambda t: (
                        {"Y": Y[t]},
                        {"phase": "coreset_admm_update", "epoch": epoch, **self.checkpoint_config(epoch)},
                    )
                )
            )
            h = self.outputs(replies)
            H = joined_predictions(admm.mapping.p, h)
            train_loss = float((core.weights * loss_np(self.task, H, self.y_S)).sum() / self.train.N)
            self.record_epoch(
                epoch, self._evaluate(), train_loss, {**self._extra(), "primal_residual": admm.primal_residual()}
            )
            self.end_epoch(epoch, {"admm": admm, "h": h})

    def _schedule(self) -> SGDSchedule:
        B = batch_size_of(self.params.batch_size, self.S.N)
        return SGDSchedule(self.S, B, int(self.cfg.epochs), np.random.default_rng(int(self.cfg.seed)))

    def _start_sgd(self) -> dict:
        schedule = self._schedule()
        replies = self.send(
            self.messages(lambda t: ({"rows": schedule.first.U[t]}, {"phase": "predict", "d_out": self.d_out}))
        )
        return {"h": self.outputs(replies)}

    def _train_sgd(self, done: int, loop: dict) -> None:
        """TP-Join-SGD on S; Y_iu sums omega_j dl/dH_j, omega_j = w_j |S| / N, so a mini-batch's mean over S
        estimates (1/N) sum_j w_j dl/dH_j without bias."""
        core, S, N = self.coreset, self.S, self.train.N
        omega = core.weights * S.N / N
        schedule = self._schedule()
        h = loop["h"]
        loss_sum = 0.0
        for _, (epoch, rows, plan, nxt, last) in sgd_rounds(schedule, done):
            H = joined_predictions(plan.inv, h)
            g = loss_grad_np(self.task, H, self.y_S[rows]) * omega[rows, None]
            loss_sum += float((core.weights[rows] * loss_np(self.task, H, self.y_S[rows])).sum())
            Y = {t: segment_sum(plan.inv[t], g, len(plan.U[t])).astype(h[t].dtype, copy=False) for t in plan.U}
            replies = self.send(
                self.messages(
                    lambda t: (
                        {"Y": Y[t], "rows": nxt.U[t] if nxt else np.zeros(0, dtype=np.int64)},
                        {
                            "phase": "sgd_step",
                            "batch_size": len(rows),
                            **(self.checkpoint_config(epoch) if last else {}),
                        },
                    )
                )
            )
            h = self.outputs(replies)
            if last:
                self.record_epoch(epoch, self._evaluate(), loss_sum / N, self._extra())
                loss_sum = 0.0
                self.end_epoch(epoch, {"h": h})
