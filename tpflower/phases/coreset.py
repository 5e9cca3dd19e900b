"""Coresets for VFL over joins, client side (VFL coresets Alg. 1-3; docs/algorithms.md, Coresets for VFL).

DIS (Alg. 1), sampling=sensitivity only:
  sensitivity  {G}       -> {total}   local sensitivities g_u of its rows given G_i (kept); total = sum_u G_iu g_u
  sample       {a}       -> {rows}    a_i <= m base rows, i.i.d. with replacement, P(u) = G_iu g_u / total
  weigh        {rows}    -> {sens}    g at the distinct rows p_i(j), j in S
Ridge on the coreset (algorithm=coreset):
  coreset_admm_setup  {rows, G}  -> {}    the coreset's rows U_i^S and G^S_iu = sum of the weights of their
                                          joined rows (theta_i^0 stays on the node)
  coreset_admm_update {Y}        -> {h}   Eq. 16 on U_i^S with G^S (closed form for linear models)
  predict / sgd_step                      TP-Join-SGD's phases (tpflower.phases.join_sgd) on the coreset's rows
  coreset_predict     {rows}     -> {h}   evaluation: f_i on the test rows (no state change)
k-means (algorithm=kmeans | coreset_kmeans):
  kmeans_local  {G} or {rows, w} -> {labels, C}  local k-means weighted by G_iu (or w on the coreset's rows):
                                                 one centre label per row and its k centres (DistDim)
  kmeans_assign {G}              -> {labels}     coreset_kmeans, evaluation: every row's nearest local centre
  kmeans_cost   {rows, centres, counts, C} -> {cost}  evaluation: ONE number, sum_u sum_c counts[u, c]
                                                 ||x_u - C_c||^2, for sparse counts whose every row adds up to G_iu

Bounds (each refused with an error naming the table and the phase; the ledgers live in context.state, so
they survive a resume): a row-indexed request names distinct rows of the table that occur in the join;
G_i is a join's (tpflower.join_counts); m <= sum G_i / min_group_rows (the owner's bound; ``algorithm.m: auto``
resolves within it, :func:`coreset_size`); ``sample`` draws at most m rows; ``weigh`` is answered once per run, about at
most m rows; the training rows (coreset_admm_setup, predict / sgd_step, kmeans_local's rows) are at most m
distinct rows per run and, after DIS, rows the client was asked to weigh; ``coreset_predict`` answers the same
rows at every evaluation (fixed by the first) and no training step asks for evaluation rows; ``kmeans_cost``
is answered once per run (two answers for different counts would difference out one row's distances).
Only row ids, sensitivities, predictions (ridge) and, for k-means, centre labels, its own centres and one
cost number leave a client; never a feature column, never a row's distances. Under label DP the label
owner's sensitivities see only the randomized training labels it released (:func:`sensitivity_labels`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpflower import privacy as dp
from tpflower.client import TableClient
from tpflower.clustering import sq_distances, weighted_kmeans
from tpflower.guard import Phase, Protocol, ProtocolRefusal, Stage, takes
from tpflower.join_counts import check_join_counts
from tpflower.mapping import index_dtype
from tpflower.params import AlgorithmParams, nonnegative, one_of, or_word, param, positive, positive_int
from tpflower.phases import join_sgd, pcg, setup
from tpflower.phases.join_admm import theta_update
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.relation import has_bias
from tpflower.state import StateRecord

ALPHA = 2.0  # VKMC sensitivity constant (VFL coresets Alg. 3 with alpha = 2)
#: the coreset size of ``algorithm.m: auto`` where the join is large enough (the paper's largest m but one)
DEFAULT_M = 2000


def coreset_size(m: int | str, joined: float, min_group_rows: int) -> int:
    """The coreset size a run uses: ``m``, or for ``auto`` min(DEFAULT_M, joined // min_group_rows), so that
    each coreset row stands for at least ``min_group_rows`` joined rows on average (the owner's bound on every
    aggregate; at 0 the join is too small for a coreset under that bound and the nodes refuse)."""
    if m == "auto":
        return min(DEFAULT_M, int(joined) // int(min_group_rows))
    return int(m)


def fraction(what: str, value) -> float:
    out = nonnegative(what, value)
    if out > 1:
        raise ValueError(f"{what} must be in [0, 1], got {value!r}")
    return out


@dataclass(frozen=True)
class CoresetParams(AlgorithmParams):
    """algorithm=coreset (conf/algorithm/coreset.yaml): ridge on a DIS coreset of the training join."""

    # coreset size (draws, with replacement); auto: min(2000, joined rows / min_group_rows) (coreset_size)
    m: int | str = param(or_word(positive_int, "auto"), "auto")
    sampling: str = param(one_of("sensitivity", "uniform"), "sensitivity")
    mix: float = param(fraction, 0.0)  # share of uniform sampling in DIS: P = (1 - mix) g_j / G + mix / N
    leverage_ridge: float = param(nonnegative, 64.0)  # ridge leverage scores, lam = leverage_ridge N / m; 0: Alg. 2
    train: str = param(one_of("admm", "sgd", "pcg"), "admm")  # pcg: block-Jacobi PCG on the weighted ridge problem
    tol: float = param(nonnegative, 1e-8)  # train=pcg: stop once ||r|| <= tol ||r_0|| (0: never)
    rho: float | str = param(or_word(positive, "auto"), "auto")  # train=admm
    variant: str = param(one_of("sharing", "paper"), "sharing")
    local_solver: str = param(one_of("lbfgs", "adam"), "lbfgs")  # MLP theta-update (train=admm), as TP-Join-ADMM
    local_steps: int = param(positive_int, 20)
    local_epochs: int = param(positive_int, 1)
    local_lr: float = param(positive, 0.01)
    local_batch_size: int = param(positive_int, 256)
    lr: float = param(positive, 0.05)  # train=sgd
    batch_size: int | str = param(or_word(positive_int, "full"), 256)


def leverage_sensitivities(
    X: np.ndarray, G: np.ndarray, extra: np.ndarray | None = None, lam: float = 0.0
) -> np.ndarray:
    """Per table row u: the (ridge) leverage of ONE joined row of u, 0 where G_u = 0.

    A = diag(sqrt(G)) [X | extra], thin SVD A = U S V^T. lam = 0: ||U[u]||^2 / G_u (Alg. 2; summed over the
    joined rows, sum_u G_u g_u, it is rank(A)). lam > 0: the ridge leverage score
    a_u^T (A^T A + lam I)^{-1} a_u / G_u = sum_k U_uk^2 s_k^2 / (s_k^2 + lam) / G_u (Alaoui & Mahoney 2015),
    whose sum is the statistical dimension sum_k s_k^2 / (s_k^2 + lam) < rank(A): a direction carried by r
    joined rows contributes about r / (r + lam). ``extra`` columns (the label owner's intercept and y) are
    divided by their root mean square over the joined rows first, so the label's units do not matter (no
    effect when lam = 0)."""
    A = np.asarray(X, dtype=np.float64)
    G = np.asarray(G, dtype=np.float64)
    if extra is not None:
        E = np.asarray(extra, dtype=np.float64).reshape(len(A), -1)
        rms = np.sqrt((G[:, None] * E * E).sum(0) / max(G.sum(), 1e-300))
        A = np.column_stack([A, E / np.where(rms > 0, rms, 1.0)])
    g = np.zeros(len(A))
    active = np.flatnonzero(G > 0)
    if len(active) == 0 or A.shape[1] == 0:
        return g
    B = A[active] * np.sqrt(G[active])[:, None]
    U, s, _ = np.linalg.svd(B, full_matrices=False)
    if s.size == 0 or s[0] == 0:
        return g
    rank = int(np.sum(s > s[0] * max(B.shape) * np.finfo(np.float64).eps))
    shrink = s[:rank] ** 2 / (s[:rank] ** 2 + lam)  # 1 for plain leverage (lam = 0)
    g[active] = (U[:, :rank] ** 2 @ shrink) / G[active]
    return g


def ridge_lambda(leverage_ridge: float, N: int, m: int) -> float:
    """lam of the ridge leverage scores, in joined rows: leverage_ridge * N / m. A direction that m uniform
    draws would see fewer than about ``leverage_ridge`` times is damped instead of sampled at full weight."""
    return float(leverage_ridge) * float(N) / float(m)


def kmeans_sensitivities(
    X: np.ndarray, G: np.ndarray, k: int, rng: np.random.Generator, iters: int = 100, alpha: float = ALPHA
) -> np.ndarray:
    """VKMC local sensitivities (Alg. 3) of one joined row of each table row: local k-means++ / Lloyd weighted
    by G (= on the table's expanded slice of the join), then :func:`cluster_sensitivities`."""
    C, _ = weighted_kmeans(X, np.asarray(G, dtype=np.float64), k, rng, iters)
    return cluster_sensitivities(X, G, C, alpha)


def cluster_sensitivities(X: np.ndarray, G: np.ndarray, C: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """g_u = alpha d^2(x_u, C) / cost + 2 alpha cost(P_c) / (|P_c| cost) + 4 / |P_c| (Alg. 3), c = the cluster
    of u, cost = sum_u G_u d^2(x_u, C), cost(P_c) and |P_c| summed with G; 0 where G_u = 0. With G = 1 on the
    materialized join's rows it is the paper's formula; with G_iu it gives the same value per joined row."""
    X, G = np.asarray(X, dtype=np.float64), np.asarray(G, dtype=np.float64)
    D = sq_distances(X, C)
    labels = D.argmin(1)
    d2 = D[np.arange(len(X)), labels]
    size = np.bincount(labels, weights=G, minlength=len(C))
    group_cost = np.bincount(labels, weights=G * d2, minlength=len(C))
    cost = float(group_cost.sum())
    g = np.zeros(len(X))
    act = G > 0
    sz = size[labels[act]]
    if cost > 0:
        g[act] = alpha * d2[act] / cost + 2 * alpha * group_cost[labels[act]] / (sz * cost) + 4.0 / sz
    else:  # every point on its centre: only the cluster-size term
        g[act] = 4.0 / sz
    return g


def mix_uniform(G: np.ndarray, g: np.ndarray, N: int, mix: float) -> np.ndarray:
    """g' = (1 - mix) g + mix G^(i) / N on the rows in the join (G^(i) = sum_u G_iu g_u, unchanged by this).

    Summed over the tables, g'_j = (1 - mix) g_j + mix G / N, so one DIS draw picks joined row j with
    P'(j) = (1 - mix) g_j / G + mix / N: a mixture of the sensitivity sampling and uniform sampling, computed
    by each table alone (it knows its own total and N). The weights G / (m g'_j) are then at most N / (mix m),
    and a sensitivity plus anything stays an upper bound (the coreset guarantee holds with G unchanged)."""
    if mix <= 0:
        return g
    total = local_total(G, g)
    out = np.zeros_like(g)
    act = np.asarray(G) > 0
    out[act] = (1.0 - mix) * g[act] + mix * total / float(N)
    return out


def local_total(G: np.ndarray, g: np.ndarray) -> float:
    """G^(i) = sum over the joined rows of the local sensitivity = sum_u G_iu g_u (Alg. 1, round 1)."""
    return float((np.asarray(G, dtype=np.float64) * g).sum())  # not np.dot: BLAS threads change its rounding


def sampling_probabilities(G: np.ndarray, g: np.ndarray) -> np.ndarray:
    """P(u) = G_iu g_u / G^(i): the client's draw over its base rows (Alg. 1, round 2)."""
    p = np.asarray(G, dtype=np.float64) * g
    return p / p.sum()


def draw_base_rows(G: np.ndarray, g: np.ndarray, a: int, rng: np.random.Generator) -> np.ndarray:
    """a base rows i.i.d. with replacement, P(u) = G_iu g_u / G^(i) (Alg. 1, round 2)."""
    if a <= 0:
        return np.zeros(0, dtype=np.int64)
    p = sampling_probabilities(G, g)
    return rng.choice(len(p), size=int(a), replace=True, p=p).astype(np.int64)


def client_rng(seed: int, table: str, stream: int) -> np.random.Generator:
    """The client's sampling generator: the run seed, the table's name and a stream number."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(table.encode()), int(stream)])


@dataclass
class DISState(StateRecord):
    """G_i over the client's rows and its local sensitivities g (one joined row of each row)."""

    G: np.ndarray | None = None
    g: np.ndarray | None = None

    @classmethod
    def of(cls, client: TableClient) -> DISState:
        state = cls.load(client.state)
        if state is None or state.g is None:
            raise RuntimeError(f"table {client.settings.table!r}: a DIS round before its sensitivities")
        return state


@dataclass
class CoresetADMMState(StateRecord):
    """The coreset's rows U_i^S of this table, G^S on them (Eq. 15 with weights), N and rho."""

    rows: np.ndarray | None = None
    G: np.ndarray | None = None
    N: int = 0
    rho: float = 0.0


class CoresetRefusal(ProtocolRefusal):
    """A coreset request outside the client's bounds (module docstring)."""


def _where(client: TableClient, phase: str) -> str:
    return f"table {client.settings.table!r} (algorithm {client.algorithm!r}), phase {phase!r}"


def _m(client: TableClient) -> int:
    """The coreset size m: once DIS gave G_i, the size check_G admitted; before (uniform sampling, whose rows
    are the server's draw) the run's m, ``auto`` at most DEFAULT_M (k-means on the full join: 0, no m)."""
    admitted = client.state.scalar("coreset.m", 0)
    if admitted:
        return int(admitted)
    m = getattr(client.settings.algorithm, "m", 0) or 0
    return DEFAULT_M if m == "auto" else int(m)


def _m_bound(client: TableClient) -> str:
    """The coreset size m as a refusal names it: ``algorithm.m = M``, and when the run's ``auto`` resolved on
    this node to fewer than DEFAULT_M under its owner's ``min_group_rows`` (check_G), that bound and what a run
    sets to fit it: the server resolves ``auto`` under the run's min_group_rows, so a run whose min_group_rows is
    below the owner's asks for more draws than the node admits (docs/settings.md, min_group_rows)."""
    m = _m(client)
    if (
        getattr(client.settings.algorithm, "m", None) != "auto"
        or not client.state.scalar("coreset.m", 0)
        or m >= DEFAULT_M
    ):
        return f"algorithm.m = {m}"
    g = client.settings.min_group_rows
    return (
        f"algorithm.m = {m} (auto under min_group_rows = {g}, its owner's setting: each coreset row stands for at "
        f"least {g} joined rows; a run with min_group_rows={g} or algorithm.m={m} fits)"
    )


def _rows(client: TableClient, arrays: Arrays, phase: str, name: str = "rows", in_join: bool = True) -> np.ndarray:
    """The request's row ids: integers, distinct, within the table's rows; with ``in_join``, when the client
    knows G_i, rows that occur in the join (G_iu > 0)."""
    rows = np.asarray(arrays[name])
    n = len(client.local.X)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise CoresetRefusal(
            f"{_where(client, phase)}: {name!r} must be a vector of row ids, got {rows.dtype} {rows.shape}"
        )
    rows = rows.astype(np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= n):
        raise CoresetRefusal(f"{_where(client, phase)}: {name!r} names rows outside its {n} rows")
    if len(np.unique(rows)) != len(rows):
        raise CoresetRefusal(
            f"{_where(client, phase)}: {name!r} repeats row ids ({len(rows) - len(np.unique(rows))} "
            "repeats); a request names distinct rows"
        )
    G = client.state.get("coreset.G") if in_join else None
    if G is not None and len(rows) and (G[rows] == 0).any():
        raise CoresetRefusal(
            f"{_where(client, phase)}: {name!r} names {int((G[rows] == 0).sum())} row(s) that do not "
            "occur in the join (G_iu = 0)"
        )
    return rows


def _keep_G(client: TableClient, arrays: Arrays, phase: str) -> np.ndarray:
    """G_i, checked against the join (tpflower.join_counts) and kept: any later G must be the same."""
    kept = client.state.get("coreset.G")
    G = check_join_counts(client, arrays["G"], _where(client, phase), training_join=_labelled(client))
    if kept is None:
        check_G(client, G, phase)
        client.state.put("coreset.G", G)
    return G


def _labelled(client: TableClient) -> bool:
    """A model trained on the labels joins the training rows only: the label owner's test rows have G = 0
    (k-means ignores labels and clusters every joined row)."""
    return client.data.is_test is not None and isinstance(client.settings.algorithm, CoresetParams)


def check_G(client: TableClient, G: np.ndarray, phase: str) -> None:
    """G_i as the join gives it (tpflower.join_counts: whole counts, equal on rows with equal join keys, none
    on the label owner's test rows for a coreset trained on labels), and a coreset that is a sample of at most
    sum G_i / min_group_rows rows (the owner's bound; m = N would weigh every joined row)."""
    where = _where(client, phase)
    asked = getattr(client.settings.algorithm, "m", None)
    if asked is None:  # k-means on the full join: no coreset
        return
    g, joined = client.settings.min_group_rows, int(G.sum())
    m = coreset_size(asked, joined, g)
    if m < 1 or m * g > joined:
        size = "algorithm.m = auto" if asked == "auto" else f"m = {m}"
        raise CoresetRefusal(
            f"{where}: a coreset ({size}) of {joined} joined rows; each coreset row stands for at least "
            f"min_group_rows = {g} joined rows (its owner's setting), so m <= {joined // g}"
            + (": the join is too small for a coreset under that bound" if joined < g else "")
        )
    client.state.set_scalar("coreset.m", m)


def admit_training_rows(client: TableClient, rows: np.ndarray, phase: str) -> None:
    """The training rows of the coreset: at most m distinct rows per run (the union of every request) and,
    after DIS, rows the client was asked to weigh."""
    weighed = client.state.get("coreset.weighed")
    if weighed is not None and not np.isin(rows, weighed).all():
        raise CoresetRefusal(
            f"{_where(client, phase)}: {int((~np.isin(rows, weighed)).sum())} row(s) outside the "
            "coreset (the rows it was asked to weigh)"
        )
    seen = client.state.get("coreset.rows")
    union = np.union1d(seen if seen is not None else np.zeros(0, dtype=np.int64), rows)
    m = _m(client)
    if len(union) > m:
        raise CoresetRefusal(
            f"{_where(client, phase)}: the run would ask about {len(union)} distinct training rows "
            f"of this table; a coreset has at most {_m_bound(client)}"
        )
    client.state.put("coreset.rows", union.astype(np.int64))


def sensitivity(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 1: local sensitivities (ridge: Alg. 2 leverage; k-means: Alg. 3) and their total."""
    if DISState.load(client.state) is not None:
        raise CoresetRefusal(f"{_where(client, 'sensitivity')}: the sensitivities are computed once per run")
    G = _keep_G(client, arrays, "sensitivity")
    if float(config["N"]) != float(G.sum()):
        raise ValueError(
            f"{_where(client, 'sensitivity')}: N = {config['N']} but G_i adds up to {G.sum():g} joined rows"
        )
    s, X = client.settings, np.asarray(client.local.X, dtype=np.float64)
    if str(config["kind"]) == "ridge":
        extra = []
        if client.data.y is not None:  # the label owner: its intercept (if its model has one) and y
            if has_bias(s.model, s.table, s.spec.label_table):
                extra.append(np.ones(len(X)))
            extra.append(sensitivity_labels(client))
        lam = ridge_lambda(s.algorithm.leverage_ridge, int(config["N"]), _m(client))
        g = leverage_sensitivities(X, G, np.column_stack(extra) if extra else None, lam)
        if client.data.y is not None:  # + 1/N once per joined row, for the regulariser (the authors' code)
            g[G > 0] += 1.0 / float(config["N"])
    else:
        alg = s.algorithm
        g = kmeans_sensitivities(X, G, int(alg.k), client_rng(s.seed, s.table, 1), int(alg.iters))
    g = mix_uniform(G, g, int(config["N"]), float(getattr(s.algorithm, "mix", 0.0)))
    DISState(G, g).save(client.state)
    return {"total": np.array([local_total(G, g)])}, {}


def sensitivity_labels(client: TableClient) -> np.ndarray:
    """The labels the label owner's sensitivities see: its own, or under label DP only the randomized training
    labels it released in the keys round (the test rows, whose G_iu is 0, get 0): the sensitivities are then
    post-processing of that release and say nothing more of a label."""
    if not dp.uses_label_dp(client.privacy()):
        return np.asarray(client.data.y, dtype=np.float64)
    sent = client.state.get("labels.sent")
    if sent is None:
        raise RuntimeError(f"{_where(client, 'sensitivity')}: label DP, but no labels were released in keys")
    y = np.zeros(len(client.data.y), dtype=np.float64)
    y[~client.data.is_test] = np.asarray(sent, dtype=np.float64)
    return y


def sample(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 2: a_i <= m base rows with replacement, P(u) = G_iu g_u / G^(i)."""
    st = DISState.of(client)
    a = int(np.asarray(arrays["a"]).reshape(-1)[0])
    if not 0 <= a <= _m(client):
        raise CoresetRefusal(f"{_where(client, 'sample')}: a_i = {a} draws; at most {_m_bound(client)}")
    rows = draw_base_rows(st.G, st.g, a, client_rng(client.settings.seed, client.settings.table, 2))
    return {"rows": rows.astype(index_dtype(len(st.g)))}, {}


def weigh(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 3: g at the distinct rows p_i(j) of the coreset's joined rows j in S; once per run, at
    most m rows (the ids are kept: the training rows must be among them)."""
    st = DISState.of(client)
    if client.state.get("coreset.weighed") is not None:
        raise CoresetRefusal(
            f"{_where(client, 'weigh')}: answered once per run (one construction); a second request is refused"
        )
    rows = _rows(client, arrays, "weigh")
    if len(rows) > _m(client):
        raise CoresetRefusal(
            f"{_where(client, 'weigh')}: {len(rows)} rows asked; a coreset has at most {_m_bound(client)}"
        )
    client.state.put("coreset.weighed", np.sort(rows))
    return {"sens": st.g[rows].astype(client.local.X.dtype)}, {}


def coreset_admm_setup(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Store U_i^S, G^S, N and rho; build theta_i^0 and keep it (ADMM starts from x^0 = 0: nothing of the
    initial model leaves, as in join_admm.admm_setup)."""
    rows = _rows(client, arrays, "coreset_admm_setup")
    G = np.asarray(arrays["G"], dtype=np.float64)
    if G.shape != rows.shape or (G < 0).any():
        raise ValueError(f"{_where(client, 'coreset_admm_setup')}: G must hold one weight >= 0 per coreset row")
    admit_training_rows(client, rows, "coreset_admm_setup")
    CoresetADMMState(rows, G, int(config["N"]), float(config["rho"])).save(client.state)
    model = client.model(config)
    client.state.save_model(model)
    return {}, {}


def coreset_admm_update(
    client: TableClient, arrays: Arrays, config: Mapping[str, Any]
) -> tuple[Arrays, dict[str, Any]]:
    """theta_i = argmin Eq. 16 over the coreset's rows U_i^S with G^S; then predict them."""
    s = CoresetADMMState.load(client.state)
    if s is None or s.rows is None:
        raise RuntimeError(f"table {client.settings.table!r}: an ADMM update before coreset_admm_setup")
    Y = np.asarray(arrays["Y"])
    if len(Y) != len(s.rows):
        raise ValueError(f"table {client.settings.table!r}: Y for {len(Y)} rows, the coreset has {len(s.rows)}")
    model = client.model(config)
    theta_update(client, model, s.rows, s.G, Y, s.N, s.rho, float(client.settings.model["beta"]), config)
    client.state.save_model(model)
    return {"h": client.predict(model, s.rows)}, client.reg_metrics(model)


def coreset_pcg_setup(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """PCG's setup (tpflower/phases/pcg.py) on the coreset's rows U_i^S, G = their summed weights."""
    rows = _rows(client, arrays, "coreset_pcg_setup")
    admit_training_rows(client, rows, "coreset_pcg_setup")
    return pcg.pcg_setup(client, arrays, config, rows=rows)


def _sgd_rows(client: TableClient, arrays: Arrays, phase: str) -> None:
    """TP-Join-SGD's phases on the coreset: the rows of the next batch are coreset rows; no evaluation rows
    (the evaluation is coreset_predict's)."""
    if "eval_rows" in arrays:
        raise CoresetRefusal(f"{_where(client, phase)}: evaluation rows go through coreset_predict only")
    admit_training_rows(client, _rows(client, arrays, phase), phase)


def coreset_sgd_predict(
    client: TableClient, arrays: Arrays, config: Mapping[str, Any]
) -> tuple[Arrays, dict[str, Any]]:
    _sgd_rows(client, arrays, "predict")
    return join_sgd.predict(client, arrays, config)


def coreset_sgd_step(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    _sgd_rows(client, arrays, "sgd_step")
    return join_sgd.sgd_step(client, arrays, config)


def coreset_predict(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Evaluation: f_i on the test rows ``rows`` with the current theta (nothing else stored). The rows are
    fixed by the first evaluation: the server sees f_i on one row set per epoch, as TP-Join-ADMM shows f_i on
    every row per epoch, and cannot walk the table with changing requests."""
    rows = _rows(client, arrays, "coreset_predict", in_join=False)  # test rows: not in the training join
    first = client.state.get("coreset.eval_rows")
    if first is None:
        client.state.put("coreset.eval_rows", rows)
    elif not np.array_equal(first, rows):
        raise CoresetRefusal(
            f"{_where(client, 'coreset_predict')}: other rows than its first evaluation's; the "
            "evaluation rows are fixed for the run"
        )
    model = client.model(config)
    return {"h": client.predict(model, rows)}, {}


# ------------------------------------------------------------------------------------------------ roles


def dis_client(client: TableClient) -> bool:
    """sampling=sensitivity: the client takes part in DIS (uniform sampling needs no client round)."""
    return getattr(client.settings.algorithm, "sampling", "") == "sensitivity"


def admm_client(client: TableClient) -> bool:
    return getattr(client.settings.algorithm, "train", "") == "admm"


def sgd_client(client: TableClient) -> bool:
    return getattr(client.settings.algorithm, "train", "") == "sgd"


def pcg_client(client: TableClient) -> bool:
    return getattr(client.settings.algorithm, "train", "") == "pcg"


# the once-per-run bounds are the handlers' (clear errors): their stages take any number of messages
DIS: tuple[Stage, ...] = (
    Stage("sensitivity", {"sensitivity": Phase(sensitivity, dis_client, inputs=takes("G"), exact=True)}, calls=None),
    Stage("sample", {"sample": Phase(sample, dis_client, inputs=takes("a"), exact=True)}),
    Stage("weigh", {"weigh": Phase(weigh, dis_client, inputs=takes("rows"), exact=True)}, calls=None),
)
RIDGE_START = Stage(
    "start",
    {
        "coreset_admm_setup": Phase(coreset_admm_setup, admm_client, inputs=takes("rows", "G")),
        # eval_rows: taken to be refused by the handler (the evaluation is coreset_predict's)
        "predict": Phase(coreset_sgd_predict, sgd_client, inputs=takes("rows", "eval_rows"), exact=True),
        "coreset_pcg_setup": Phase(coreset_pcg_setup, pcg_client, inputs=takes("rows", "G", "s"), exact=True),
    },
)
RIDGE_TRAIN: dict[str, Phase] = {
    "coreset_admm_update": Phase(coreset_admm_update, admm_client, inputs=takes("Y"), exact=True),
    "sgd_step": Phase(coreset_sgd_step, sgd_client, inputs=takes("Y", "rows", "eval_rows"), exact=True),
    "pcg_step": Phase(pcg.pcg_step, pcg_client, inputs=takes("s", "coef"), exact=True),
    "coreset_predict": Phase(coreset_predict, spaced=True, inputs=takes("rows"), exact=True),
    **setup.EVALUATE,  # label DP: the label owner scores the test predictions (tpflower.label_dp)
}


RIDGE_PROTOCOL = Protocol(setup.SETUP + DIS + (RIDGE_START, Stage("train", RIDGE_TRAIN, calls=None)))

register(
    AlgorithmEntry(
        "coreset",
        "coreset",
        "join",
        "coreset",
        "CoresetRidge",
        RIDGE_PROTOCOL,
        CoresetParams,
        feature_dp=False,
        why_no_feature_dp=(
            "its sensitivity scores and the sampled rows' updates are exact functions of the features (Alg. 1-2); "
            "there is no DP-SGD version of them. Run algorithm=admm or sgd"
        ),
        label_dp=True,  # the sensitivities use the released randomized labels only (sensitivity_labels)
        summary="VFL coreset (DIS, Alg. 1-2) over the join, ridge by weighted TP-Join-ADMM/SGD",
    )
)
