"""TP-Join-SGD and VFL-SGD, client side (TablePuppet Eq. 10-13).

  predict   {rows}                    -> {h}            h = f_i(rows); the rows are remembered as pending
  sgd_step  {Y, rows, (eval_rows)}    -> {h, (h_eval)}  Eq. 12-13 on the pending rows, then predict the next
                                                        batch's rows (pipelining) and, at an epoch's end, the test rows
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpflower.client import TableClient
from tpflower.records import Arrays
from tpflower.state import StateRecord
from tpflower.guard import Phase, Stage
from tpflower.local_update import sgd_step as local_sgd_step


@dataclass
class SGDState(StateRecord):
    """The rows (indices into the client's rows) of the batch the server will send Y for next."""

    pending: np.ndarray | None = None

    def check(self, client: TableClient, Y: np.ndarray, phase: str) -> np.ndarray:
        if self.pending is None or len(self.pending) != len(Y):
            raise RuntimeError(f"table {client.settings.table!r}: {phase} without a matching predict of its rows")
        return self.pending


def predict_rows(client: TableClient, model, arrays: Arrays) -> Arrays:
    """h of the next batch's rows (kept as pending) and, when sent, of the test rows."""
    rows = np.asarray(arrays["rows"], dtype=np.int64)
    SGDState(rows).save(client.state)
    out = {"h": client.predict(model, rows)}
    if "eval_rows" in arrays:
        out["h_eval"] = client.predict(model, np.asarray(arrays["eval_rows"], dtype=np.int64))
    return out


def predict(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    client.dp.init(config)
    model = client.model(config)
    client.state.save_model(model)
    return predict_rows(client, model, arrays), client.reg_metrics(model)


def sgd_step(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Eq. 12-13 on the pending rows with their aggregated Y_i, then predict the next rows (pipelining)."""
    Y = arrays["Y"]
    model = client.model(config)
    pending = (SGDState.load(client.state) or SGDState()).check(client, Y, "sgd_step")
    lr, beta, batch = client.settings.algorithm.lr, float(client.settings.model["beta"]), int(config["batch_size"])
    privacy: dict[str, Any] = {}
    if client.dp.on:  # DP-SGD: per TABLE row clipped terms of Eq. 12, Gaussian noise
        rows, Y_rows = client.dp.table_rows(pending, Y)
        trainer = client.dp.trainer(model)
        trainer.sgd_step(client.tensor(client.local.X[rows]), client.tensor(Y_rows), batch, lr, beta)
        client.dp.done(trainer, privacy)
    else:
        local_sgd_step(model, client.tensor(client.rows_X(pending)), client.tensor(Y), batch, lr, beta)
    client.state.save_model(model)
    return predict_rows(client, model, arrays), {**client.reg_metrics(model), **privacy}


START = Stage("start", {"predict": Phase(predict)})
TRAIN: dict[str, Phase] = {"sgd_step": Phase(sgd_step)}
