"""Coresets for VFL over joins, client side (seed 004 Alg. 1-3; ALGORITHMS.md "Coresets for VFL").

DIS (Alg. 1), sampling=sensitivity only:
  sensitivity  {G}       -> {total}   local sensitivities g_u of its rows given G_i (kept); total = sum_u G_iu g_u
  sample       {a}       -> {rows}    a_i <= m base rows, i.i.d. with replacement, P(u) = G_iu g_u / total
  weigh        {rows}    -> {sens}    g at the distinct rows p_i(j), j in S
Ridge on the coreset (algorithm=coreset):
  coreset_admm_setup  {rows, G}  -> {h}   the coreset's rows U_i^S and G^S_iu = sum of the weights of their
                                          joined rows; predict them
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
``sample`` draws at most m rows (the client's own algorithm.m); ``weigh`` is answered once per run, about at
most m rows; the training rows (coreset_admm_setup, predict / sgd_step, kmeans_local's rows) are at most m
distinct rows per run and, after DIS, rows the client was asked to weigh; ``coreset_predict`` answers the same
rows at every evaluation (fixed by the first) and no training step asks for evaluation rows; ``kmeans_cost``
is answered once per run (two answers for different counts would difference out one row's distances).
Only row ids, sensitivities, predictions (ridge) and, for k-means, centre labels, its own centres and one
cost number leave a client; never a feature column, never a row's distances.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpflower import coreset as cs
from tpflower.client import TableClient
from tpflower.records import Arrays
from tpflower.state import StateRecord
from tpflower.guard import Phase, ProtocolRefusal, Stage
from tpflower.mapping import index_dtype
from tpflower.phases import join_sgd
from tpflower.phases.join_admm import theta_update
from tpflower.relation import has_bias


@dataclass
class DISState(StateRecord):
    """G_i over the client's rows and its local sensitivities g (one joined row of each row)."""

    G: np.ndarray | None = None
    g: np.ndarray | None = None

    @classmethod
    def of(cls, client: TableClient) -> "DISState":
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
    """The coreset size m of the client's own settings (k-means on the full join: no bound from m)."""
    return int(getattr(client.settings.algorithm, "m", 0) or 0)


def _rows(client: TableClient, arrays: Arrays, phase: str, name: str = "rows", in_join: bool = True) -> np.ndarray:
    """The request's row ids: integers, distinct, within the table's rows; with ``in_join``, when the client
    knows G_i, rows that occur in the join (G_iu > 0)."""
    rows = np.asarray(arrays[name])
    n = len(client.local.X)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise CoresetRefusal(f"{_where(client, phase)}: {name!r} must be a vector of row ids, got {rows.dtype} {rows.shape}")
    rows = rows.astype(np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= n):
        raise CoresetRefusal(f"{_where(client, phase)}: {name!r} names rows outside its {n} rows")
    if len(np.unique(rows)) != len(rows):
        raise CoresetRefusal(f"{_where(client, phase)}: {name!r} repeats row ids ({len(rows) - len(np.unique(rows))} "
                             "repeats); a request names distinct rows")
    G = client.state.get("coreset.G") if in_join else None
    if G is not None and len(rows) and (G[rows] == 0).any():
        raise CoresetRefusal(f"{_where(client, phase)}: {name!r} names {int((G[rows] == 0).sum())} row(s) that do not "
                             "occur in the join (G_iu = 0)")
    return rows


def _keep_G(client: TableClient, arrays: Arrays, phase: str) -> np.ndarray:
    """G_i, one count >= 0 per row; kept the first time, and any later G must be the same."""
    G = np.asarray(arrays["G"], dtype=np.float64)
    if G.shape != (len(client.local.X),) or (G < 0).any() or not np.isfinite(G).all():
        raise ValueError(f"{_where(client, phase)}: G must hold one count >= 0 per row ({len(client.local.X)}), "
                         f"got shape {G.shape}")
    kept = client.state.get("coreset.G")
    if kept is None:
        client.state.put("coreset.G", G)
    elif not np.array_equal(kept, G):
        raise CoresetRefusal(f"{_where(client, phase)}: G differs from the G_i this client received earlier in the run")
    return G


def admit_training_rows(client: TableClient, rows: np.ndarray, phase: str) -> None:
    """The training rows of the coreset: at most m distinct rows per run (the union of every request) and,
    after DIS, rows the client was asked to weigh."""
    weighed = client.state.get("coreset.weighed")
    if weighed is not None and not np.isin(rows, weighed).all():
        raise CoresetRefusal(f"{_where(client, phase)}: {int((~np.isin(rows, weighed)).sum())} row(s) outside the "
                             "coreset (the rows it was asked to weigh)")
    seen = client.state.get("coreset.rows")
    union = np.union1d(seen if seen is not None else np.zeros(0, dtype=np.int64), rows)
    m = _m(client)
    if len(union) > m:
        raise CoresetRefusal(f"{_where(client, phase)}: the run would ask about {len(union)} distinct training rows "
                             f"of this table; a coreset has at most algorithm.m = {m}")
    client.state.put("coreset.rows", union.astype(np.int64))


def sensitivity(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 1: local sensitivities (ridge: Alg. 2 leverage; k-means: Alg. 3) and their total."""
    if DISState.load(client.state) is not None:
        raise CoresetRefusal(f"{_where(client, 'sensitivity')}: the sensitivities are computed once per run")
    G = _keep_G(client, arrays, "sensitivity")
    if float(config["N"]) != float(G.sum()):
        raise ValueError(f"{_where(client, 'sensitivity')}: N = {config['N']} but G_i adds up to {G.sum():g} joined rows")
    s, X = client.settings, np.asarray(client.local.X, dtype=np.float64)
    if str(config["kind"]) == "ridge":
        extra = []
        if client.data.y is not None:  # the label owner: its intercept (if its model has one) and y
            if has_bias(s.model, s.table, s.spec.label_table):
                extra.append(np.ones(len(X)))
            extra.append(np.asarray(client.data.y, dtype=np.float64))
        lam = cs.ridge_lambda(s.algorithm.leverage_ridge, int(config["N"]), _m(client))
        g = cs.leverage_sensitivities(X, G, np.column_stack(extra) if extra else None, lam)
        if client.data.y is not None:  # + 1/N once per joined row, for the regulariser (the authors' code)
            g[G > 0] += 1.0 / float(config["N"])
    else:
        alg = s.algorithm
        g = cs.kmeans_sensitivities(X, G, int(alg.k), cs.client_rng(s.seed, s.table, 1), int(alg.iters))
    g = cs.mix_uniform(G, g, int(config["N"]), float(getattr(s.algorithm, "mix", 0.0)))
    DISState(G, g).save(client.state)
    return {"total": np.array([cs.local_total(G, g)])}, {}


def sample(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 2: a_i <= m base rows with replacement, P(u) = G_iu g_u / G^(i)."""
    st = DISState.of(client)
    a = int(np.asarray(arrays["a"]).reshape(-1)[0])
    if not 0 <= a <= _m(client):
        raise CoresetRefusal(f"{_where(client, 'sample')}: a_i = {a} draws; at most algorithm.m = {_m(client)}")
    rows = cs.draw_base_rows(st.G, st.g, a, cs.client_rng(client.settings.seed, client.settings.table, 2))
    return {"rows": rows.astype(index_dtype(len(st.g)))}, {}


def weigh(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 3: g at the distinct rows p_i(j) of the coreset's joined rows j in S; once per run, at
    most m rows (the ids are kept: the training rows must be among them)."""
    st = DISState.of(client)
    if client.state.get("coreset.weighed") is not None:
        raise CoresetRefusal(f"{_where(client, 'weigh')}: answered once per run (one construction); a second "
                             "request is refused")
    rows = _rows(client, arrays, "weigh")
    if len(rows) > _m(client):
        raise CoresetRefusal(f"{_where(client, 'weigh')}: {len(rows)} rows asked; a coreset has at most "
                             f"algorithm.m = {_m(client)}")
    client.state.put("coreset.weighed", np.sort(rows))
    return {"sens": st.g[rows].astype(client.local.X.dtype)}, {}


def coreset_admm_setup(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Store U_i^S, G^S, N and rho; predict the coreset's rows."""
    rows = _rows(client, arrays, "coreset_admm_setup")
    G = np.asarray(arrays["G"], dtype=np.float64)
    if G.shape != rows.shape or (G < 0).any():
        raise ValueError(f"{_where(client, 'coreset_admm_setup')}: G must hold one weight >= 0 per coreset row")
    admit_training_rows(client, rows, "coreset_admm_setup")
    CoresetADMMState(rows, G, int(config["N"]), float(config["rho"])).save(client.state)
    model = client.model(config)
    client.state.save_model(model)
    return {"h": client.predict(model, rows)}, client.reg_metrics(model)


def coreset_admm_update(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """theta_i = argmin Eq. 16 over the coreset's rows U_i^S with G^S; then predict them."""
    s = CoresetADMMState.load(client.state)
    if s is None or s.rows is None:
        raise RuntimeError(f"table {client.settings.table!r}: an ADMM update before coreset_admm_setup")
    Y = np.asarray(arrays["Y"])
    if len(Y) != len(s.rows):
        raise ValueError(f"table {client.settings.table!r}: Y for {len(Y)} rows, the coreset has {len(s.rows)}")
    model = client.model(config)
    theta_update(client, model, client.rows_X(s.rows), s.G, Y, s.N, s.rho, float(client.settings.model["beta"]),
                 config)
    client.state.save_model(model)
    return {"h": client.predict(model, s.rows)}, client.reg_metrics(model)


def _sgd_rows(client: TableClient, arrays: Arrays, phase: str) -> None:
    """TP-Join-SGD's phases on the coreset: the rows of the next batch are coreset rows; no evaluation rows
    (the evaluation is coreset_predict's)."""
    if "eval_rows" in arrays:
        raise CoresetRefusal(f"{_where(client, phase)}: evaluation rows go through coreset_predict only")
    admit_training_rows(client, _rows(client, arrays, phase), phase)


def coreset_sgd_predict(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
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
        raise CoresetRefusal(f"{_where(client, 'coreset_predict')}: other rows than its first evaluation's; the "
                             "evaluation rows are fixed for the run")
    model = client.model(config)
    return {"h": client.predict(model, rows)}, {}


def kmeans_local(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """DistDim, the party's step: weighted local k-means, one centre label per row sent, its k centres (kept
    for kmeans_assign).

    {G}: all its rows weighted by G_iu (the full join); {rows, w}: the coreset's rows with their weights."""
    s = client.settings
    X = np.asarray(client.local.X, dtype=np.float64)
    if "rows" in arrays:
        rows = _rows(client, arrays, "kmeans_local")
        w = np.asarray(arrays["w"], dtype=np.float64)
        if w.shape != rows.shape or (w < 0).any():
            raise ValueError(f"{_where(client, 'kmeans_local')}: w must hold one weight >= 0 per row")
        admit_training_rows(client, rows, "kmeans_local")
        X = X[rows]
    else:
        if _m(client):
            raise CoresetRefusal(f"{_where(client, 'kmeans_local')}: coreset k-means clusters the coreset's rows only")
        w = _keep_G(client, arrays, "kmeans_local")
    C, labels = cs.weighted_kmeans(X, w, int(s.algorithm.k), cs.client_rng(s.seed, s.table, 3), int(s.algorithm.iters),
                                   float(s.algorithm.tol), restarts=int(s.algorithm.restarts))
    client.state.put("kmeans.C", C)
    return {"labels": labels.astype(cs.label_dtype(len(C))), "C": C}, {}


def kmeans_assign(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """coreset_kmeans, evaluation: every row's nearest local centre (what DistDim on the full join sends), for
    the server to place every joined row in its grid cell."""
    C = client.state.get("kmeans.C")
    if C is None:
        raise RuntimeError(f"{_where(client, 'kmeans_assign')}: before kmeans_local")
    if "G" in arrays:  # uniform sampling: the first G_i of the run (after DIS: must be the same)
        _keep_G(client, arrays, "kmeans_assign")
    labels = cs.sq_distances(np.asarray(client.local.X, dtype=np.float64), C).argmin(1)
    return {"labels": labels.astype(cs.label_dtype(len(C)))}, {}


def kmeans_cost(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The factorized cost of the final clustering (strategies/kmeans.py): ONE number,
    sum_u sum_c counts[u, c] ||x_u - C_c||^2, for the sparse counts (rows, centres, counts) of the joined rows
    of each row u assigned to each final centre c. Refused unless every row's counts add up to its G_iu (the
    G_i this client received earlier: each row enters with all its joined rows) and the first time in the run."""
    where = _where(client, "kmeans_cost")
    if client.state.scalar("kmeans.cost_answered", 0):
        raise CoresetRefusal(f"{where}: the cost is answered once per run (two answers for different counts "
                             "would reveal a row's distances)")
    G = client.state.get("coreset.G")
    if G is None:
        raise CoresetRefusal(f"{where}: this client never received G_i, so it cannot check the counts")
    X = np.asarray(client.local.X, dtype=np.float64)
    C = np.asarray(arrays["C"], dtype=np.float64)
    k = int(client.settings.algorithm.k)
    if C.ndim != 2 or C.shape[1] != X.shape[1] or not 1 <= C.shape[0] <= k or not np.isfinite(C).all():
        raise ValueError(f"{where}: C must be at most k = {k} finite centres of width {X.shape[1]}, got {C.shape}")
    rows, centres, counts = (np.asarray(arrays[n]) for n in ("rows", "centres", "counts"))
    if not (rows.ndim == centres.ndim == counts.ndim == 1 and len(rows) == len(centres) == len(counts)):
        raise ValueError(f"{where}: rows, centres and counts must be vectors of one length")
    if any(a.size and a.dtype.kind not in "iu" for a in (rows, centres, counts)):
        raise ValueError(f"{where}: rows, centres and counts must be integers")
    rows, centres, counts = rows.astype(np.int64), centres.astype(np.int64), counts.astype(np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= len(X) or centres.min() < 0 or centres.max() >= len(C)
                      or counts.min() <= 0):
        raise ValueError(f"{where}: counts must name rows of the table, centres of C and be >= 1")
    if len(np.unique(rows * len(C) + centres)) != len(rows):
        raise CoresetRefusal(f"{where}: a (row, centre) pair appears twice in the counts")
    per_row = np.bincount(rows, weights=counts, minlength=len(X))
    bad = per_row != G
    if bad.any():
        u = int(np.flatnonzero(bad)[0])
        raise CoresetRefusal(f"{where}: the counts of {int(bad.sum())} row(s) do not add up to the row's G_iu "
                             f"(row {u}: {per_row[u]:g} vs G = {G[u]:g}); every row enters with all its joined rows")
    client.state.set_scalar("kmeans.cost_answered", 1)
    diff = X[rows] - C[centres]
    d2 = np.einsum("ij,ij->i", diff, diff)  # no BLAS: the same rounding with any thread count
    return {"cost": np.array([float((counts * d2).sum())])}, {}


# ------------------------------------------------------------------------------------------------ roles


def dis_client(client: TableClient) -> bool:
    """sampling=sensitivity: the client takes part in DIS (uniform sampling needs no client round)."""
    return getattr(client.settings.algorithm, "sampling", "") == "sensitivity"


def admm_client(client: TableClient) -> bool:
    return getattr(client.settings.algorithm, "train", "") == "admm"


def sgd_client(client: TableClient) -> bool:
    return getattr(client.settings.algorithm, "train", "") == "sgd"


# the once-per-run bounds are the handlers' (clear errors): their stages take any number of messages
DIS: tuple[Stage, ...] = (
    Stage("sensitivity", {"sensitivity": Phase(sensitivity, dis_client)}, calls=None),
    Stage("sample", {"sample": Phase(sample, dis_client)}),
    Stage("weigh", {"weigh": Phase(weigh, dis_client)}, calls=None),
)
RIDGE_START = Stage("start", {"coreset_admm_setup": Phase(coreset_admm_setup, admm_client),
                              "predict": Phase(coreset_sgd_predict, sgd_client)})
RIDGE_TRAIN: dict[str, Phase] = {
    "coreset_admm_update": Phase(coreset_admm_update, admm_client),
    "sgd_step": Phase(coreset_sgd_step, sgd_client),
    "coreset_predict": Phase(coreset_predict, spaced=True),
}
KMEANS_LOCAL = Stage("kmeans_local", {"kmeans_local": Phase(kmeans_local)})
KMEANS_COST = Stage("kmeans_cost", {"kmeans_cost": Phase(kmeans_cost)}, calls=None)
KMEANS: tuple[Stage, ...] = (KMEANS_LOCAL, KMEANS_COST)
CORESET_KMEANS: tuple[Stage, ...] = (KMEANS_LOCAL, Stage("kmeans_assign", {"kmeans_assign": Phase(kmeans_assign)}),
                                     KMEANS_COST)
