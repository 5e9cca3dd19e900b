"""Coresets for VFL over joins, client side (seed 004 Alg. 1-3; ALGORITHMS.md "Coresets for VFL").

DIS (Alg. 1), sampling=sensitivity only:
  sensitivity  {G}       -> {total}   local sensitivities g_u of its rows given G_i (kept); total = sum_u G_iu g_u
  sample       {a}       -> {rows}    a_i base rows, i.i.d. with replacement, P(u) = G_iu g_u / total
  weigh        {rows}    -> {g}       g at the rows p_i(j), j in S
Ridge on the coreset (algorithm=coreset):
  coreset_admm_setup  {rows, G}  -> {h}   the coreset's rows U_i^S and G^S_iu = sum of the weights of their
                                          joined rows; predict them
  coreset_admm_update {Y}        -> {h}   Eq. 16 on U_i^S with G^S (closed form for linear models)
  predict / sgd_step                      TP-Join-SGD's phases (tpflower.phases.join_sgd) on the coreset's rows
  coreset_predict     {rows}     -> {h}   evaluation: f_i on the test rows (no state change)
k-means (algorithm=kmeans | coreset_kmeans):
  kmeans_local  {G} or {rows, w} -> {labels, C}  local k-means weighted by G_iu (or w on the coreset's rows):
                                                 one centre label per row and its k centres (DistDim)
  kmeans_cost   {C}              -> {D}          ||x_u - c_i||^2 of every row for the final centres' block
Only row ids, sensitivities, predictions (ridge) and, for k-means, centre labels, its own centres and squared
distances leave a client; never a feature column.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpflower import coreset as cs
from tpflower.client import Arrays, StateRecord, TableClient
from tpflower.guard import Phase, Stage
from tpflower.local_update import admm_update_linear, admm_update_local_opt
from tpflower.phases import join_sgd
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


def _rows(client: TableClient, arrays: Arrays, name: str = "rows") -> np.ndarray:
    rows = np.asarray(arrays[name], dtype=np.int64)
    n = len(client.local.X)
    if len(rows) and (rows.min() < 0 or rows.max() >= n):
        raise ValueError(f"table {client.settings.table!r}: {name} outside its {n} rows")
    return rows


def _G(client: TableClient, arrays: Arrays) -> np.ndarray:
    G = np.asarray(arrays["G"], dtype=np.float64)
    if G.shape != (len(client.local.X),) or (G < 0).any():
        raise ValueError(f"table {client.settings.table!r}: G must hold one count >= 0 per row")
    return G


def sensitivity(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 1: local sensitivities (ridge: Alg. 2 leverage; k-means: Alg. 3) and their total."""
    G = _G(client, arrays)
    s, X = client.settings, np.asarray(client.local.X, dtype=np.float64)
    if str(config["kind"]) == "ridge":
        extra = []
        if client.data.y is not None:  # the label owner: its intercept (if its model has one) and y
            if has_bias(s.model, s.table, s.spec.label_table):
                extra.append(np.ones(len(X)))
            extra.append(np.asarray(client.data.y, dtype=np.float64))
        g = cs.leverage_sensitivities(X, G, np.column_stack(extra) if extra else None)
        if client.data.y is not None:  # + 1/N once per joined row, for the regulariser (the authors' code)
            g[G > 0] += 1.0 / float(config["N"])
    else:
        alg = s.algorithm
        g = cs.kmeans_sensitivities(X, G, int(alg.k), cs.client_rng(s.seed, s.table, 1), int(alg.iters))
    DISState(G, g).save(client.state)
    return {"total": np.array([cs.local_total(G, g)])}, {}


def sample(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 2: a_i base rows with replacement, P(u) = G_iu g_u / G^(i)."""
    st = DISState.of(client)
    a = int(np.asarray(arrays["a"]).reshape(-1)[0])
    if a < 0:
        raise ValueError(f"table {client.settings.table!r}: a negative sample count {a}")
    rows = cs.draw_base_rows(st.G, st.g, a, cs.client_rng(client.settings.seed, client.settings.table, 2))
    return {"rows": rows.astype(np.int32 if len(st.g) < 2**31 else np.int64)}, {}


def weigh(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Alg. 1 round 3: g at the rows p_i(j) of the coreset's joined rows j in S."""
    st = DISState.of(client)
    return {"g": st.g[_rows(client, arrays)].astype(client.local.X.dtype)}, {}


def coreset_admm_setup(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Store U_i^S, G^S, N and rho; predict the coreset's rows."""
    rows = _rows(client, arrays)
    G = np.asarray(arrays["G"], dtype=np.float64)
    if G.shape != rows.shape or (G < 0).any():
        raise ValueError(f"table {client.settings.table!r}: G must hold one weight >= 0 per coreset row")
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
    alg, beta = client.settings.algorithm, float(client.settings.model["beta"])
    X = client.rows_X(s.rows)
    if isinstance(model, torch.nn.Linear):
        admm_update_linear(model, X, s.G, np.asarray(Y, dtype=np.float64), s.N, s.rho, beta)
    else:
        admm_update_local_opt(model, client.tensor(X), client.tensor(s.G), client.tensor(Y), s.N, s.rho, beta,
                              alg.local_epochs, alg.local_lr, alg.local_batch_size, client.local_generator(config))
    client.state.save_model(model)
    return {"h": client.predict(model, s.rows)}, client.reg_metrics(model)


def coreset_predict(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Evaluation: f_i on the test rows ``rows`` with the current theta (nothing stored)."""
    model = client.model(config)
    return {"h": client.predict(model, _rows(client, arrays))}, {}


def kmeans_local(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """DistDim, the party's step: weighted local k-means, one centre label per row sent, its k centres.

    {G}: all its rows weighted by G_iu (the full join); {rows, w}: the coreset's rows with their weights."""
    s = client.settings
    X = np.asarray(client.local.X, dtype=np.float64)
    if "rows" in arrays:
        rows = _rows(client, arrays)
        w = np.asarray(arrays["w"], dtype=np.float64)
        if w.shape != rows.shape or (w < 0).any():
            raise ValueError(f"table {s.table!r}: w must hold one weight >= 0 per row")
        X = X[rows]
    else:
        w = _G(client, arrays)
    C, labels = cs.weighted_kmeans(X, w, int(s.algorithm.k), cs.client_rng(s.seed, s.table, 3), int(s.algorithm.iters),
                                   float(s.algorithm.tol))
    return {"labels": labels.astype(np.uint16 if len(C) > 255 else np.uint8), "C": C}, {}


def kmeans_cost(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Squared distances of every row to this table's block of the final centres (the factorized cost)."""
    C = np.asarray(arrays["C"], dtype=np.float64)
    X = np.asarray(client.local.X, dtype=np.float64)
    if C.ndim != 2 or C.shape[1] != X.shape[1]:
        raise ValueError(f"table {client.settings.table!r}: C must be k x {X.shape[1]}, got {C.shape}")
    return {"D": cs.sq_distances(X, C).astype(client.local.X.dtype)}, {}


# ------------------------------------------------------------------------------------------------ roles


def dis_client(client: TableClient) -> bool:
    """sampling=sensitivity: the client takes part in DIS (uniform sampling needs no client round)."""
    return getattr(client.settings.algorithm, "sampling", "") == "sensitivity"


def admm_client(client: TableClient) -> bool:
    return getattr(client.settings.algorithm, "train", "") == "admm"


def sgd_client(client: TableClient) -> bool:
    return getattr(client.settings.algorithm, "train", "") == "sgd"


DIS: tuple[Stage, ...] = (
    Stage("sensitivity", {"sensitivity": Phase(sensitivity, dis_client)}),
    Stage("sample", {"sample": Phase(sample, dis_client)}),
    Stage("weigh", {"weigh": Phase(weigh, dis_client)}),
)
RIDGE_START = Stage("start", {"coreset_admm_setup": Phase(coreset_admm_setup, admm_client),
                              "predict": Phase(join_sgd.predict, sgd_client)})
RIDGE_TRAIN: dict[str, Phase] = {
    "coreset_admm_update": Phase(coreset_admm_update, admm_client),
    "sgd_step": Phase(join_sgd.sgd_step, sgd_client),
    "coreset_predict": Phase(coreset_predict, spaced=True),
}
KMEANS: tuple[Stage, ...] = (
    Stage("kmeans_local", {"kmeans_local": Phase(kmeans_local)}),
    Stage("kmeans_cost", {"kmeans_cost": Phase(kmeans_cost)}),
)
