"""TP-Join-SGD and VFL-SGD with CELU-VFL cached local updates, client side (seed 002, Alg. 1-2; ALGORITHMS.md
"CELU-VFL local updates"; tpflower/celu.py holds the workset).

  predict   {rows}                 -> {h}            as TP-Join-SGD; the reference of the rows is kept
  sgd_step  {Y, rows, (eval_rows)} -> {h, (h_eval)}  the exchange step (Eq. 12-13), the batch cached, up to R
                                                     local steps on cached batches, then predict the next rows
                                                     (pipelining: one round trip per exchanged batch)

The reference is what the weights compare: ``similarity=output`` the predictions the client sent (with
d_c = 1 the cosine is +-1: only rows whose prediction changed sign are dropped), ``hidden`` the MLP's last
hidden activation (kept here, never sent).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpflower.celu import Workset, staleness_weights
from tpflower.client import TableClient
from tpflower.guard import Phase, Stage
from tpflower.local_update import sgd_step as local_sgd_step
from tpflower.phases.join_sgd import SGDState, predict_rows
from tpflower.records import Arrays
from tpflower.state import StateRecord


@dataclass
class SentReference(StateRecord):
    """The reference of the pending rows, taken when their predictions were sent."""

    ref: np.ndarray | None = None


def reference(client: TableClient, model: torch.nn.Module, rows: np.ndarray, h: np.ndarray | None = None) -> np.ndarray:
    """The rows' reference for the staleness weights: their predictions (``h`` if already computed), or the
    MLP's last hidden layer."""
    if client.settings.algorithm.similarity == "output":
        return np.asarray(client.predict(model, rows) if h is None else h, dtype=np.float64)
    with torch.no_grad():  # model = Sequential(Linear, ReLU, ..., Linear): all but the output layer
        return model[:-1](client.tensor(client.rows_X(rows))).cpu().numpy().astype(np.float64)


def predict_and_keep(client: TableClient, model: torch.nn.Module, arrays: Arrays) -> Arrays:
    out = predict_rows(client, model, arrays)
    rows = np.asarray(arrays["rows"], dtype=np.int64)
    SentReference(reference(client, model, rows, out["h"])).save(client.state)
    return out


def predict(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    model = client.model(config)
    client.state.save_model(model)
    return predict_and_keep(client, model, arrays), client.reg_metrics(model)


def local_steps(client: TableClient, model: torch.nn.Module, workset: Workset) -> int:
    """Alg. 2: up to R steps on cached batches (round robin, staleness-weighted); returns how many ran."""
    alg, beta = client.settings.algorithm, float(client.settings.model["beta"])
    taken = 0
    for _ in range(alg.R):
        k = workset.pick(alg.W, alg.R)
        if k is None:  # a bubble: no entry may be used now
            break
        rows, cached, Y, batch = workset.entry(k)
        w = staleness_weights(reference(client, model, rows), cached, alg.xi)
        local_sgd_step(model, client.tensor(client.rows_X(rows)), client.tensor(w[:, None] * Y), batch, alg.lr, beta)
        workset.used(k, alg.R)
        taken += 1
    return taken


def sgd_step(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """The exchange step on the pending rows, the batch into the workset, the local steps, the next prediction."""
    Y = arrays["Y"]
    model = client.model(config)
    pending = (SGDState.load(client.state) or SGDState()).check(client, Y, "sgd_step")
    alg, beta, batch = client.settings.algorithm, float(client.settings.model["beta"]), int(config["batch_size"])
    local_sgd_step(model, client.tensor(client.rows_X(pending)), client.tensor(Y), batch, alg.lr, beta)  # Eq. 12-13
    taken = 0
    if alg.R > 0:
        sent = (SentReference.load(client.state) or SentReference()).ref
        workset = Workset.load(client.state) or Workset.empty(sent.shape[1], Y.shape[1])
        workset.insert(pending, sent, Y, batch, alg.W)
        taken = local_steps(client, model, workset)
        workset.save(client.state)
    client.state.save_model(model)
    return predict_and_keep(client, model, arrays), {**client.reg_metrics(model), "local_steps": taken}


START = Stage("start", {"predict": Phase(predict)})
TRAIN: dict[str, Phase] = {"sgd_step": Phase(sgd_step)}
