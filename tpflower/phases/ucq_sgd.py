"""TP-UCQ-SGD, the shard side of learning over union with SGD (TablePuppet Eq. 17-19).

A table split into shards answers TP-Join-SGD's messages through the union: the coordinator (server) asks
each shard for its unnormalised partial gradient over its pending rows (Eq. 18), sums them and sends every
shard the same aggregate step (Eq. 19); each shard then predicts its rows of the next batch. Tables with one
shard answer the join's phases unchanged.

  sgd_partial     {Y}                  -> {g}            Eq. 18: unnormalised partial gradient on the pending rows
  sgd_apply       {g, rows, (eval_rows)} -> {h, (h_eval)} Eq. 19: the coordinator's step, then predict
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tpflower.client import TableClient
from tpflower.guard import Phase
from tpflower.phases import join_sgd, setup
from tpflower.phases.join_sgd import SGDParams, SGDState, apply_step, predict_rows, sgd_partial_gradient
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register


def sgd_partial(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Eq. 18: this shard's unnormalised partial gradient over its pending rows, given their Y."""
    Y = arrays["Y"]
    model = client.model(config)
    pending = (SGDState.load(client.state) or SGDState()).check(client, Y, "sgd_partial")
    X, beta, count = client.tensor(client.rows_X(pending)), float(client.settings.model["beta"]), float(config["count"])
    if client.dp.on:  # Eq. 18 with clipped per-row terms and this shard's own Gaussian noise
        trainer = client.dp.trainer(model)
        q = client.dp.step_rate(len(np.unique(pending)))  # observed, when above the plan's q
        g = trainer.partial_gradient(X, client.tensor(Y), beta * count, q)
        privacy: dict[str, Any] = {}
        client.dp.done(trainer, privacy)
        return {"g": g.detach().cpu().numpy()}, privacy
    g = sgd_partial_gradient(model, X, client.tensor(Y), count, beta)
    return {"g": g.detach().cpu().numpy()}, {}


def sgd_apply(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Eq. 19: the coordinator's aggregate gradient, the same step on every shard; then predict."""
    model = client.model(config)
    apply_step(model, client.tensor(arrays["g"]), client.settings.algorithm.lr)
    client.state.save_model(model)
    return predict_rows(client, model, arrays), client.reg_metrics(model)


SGD_TRAIN: dict[str, Phase] = {"sgd_partial": Phase(sgd_partial), "sgd_apply": Phase(sgd_apply)}


register(
    AlgorithmEntry(
        "tp_ucq_sgd",
        "sgd",
        "ucq",
        "ucq_sgd",
        "TPUCQSGD",
        setup.loj_protocol(join_sgd.START, SGD_TRAIN),
        SGDParams,
        summary="TP-UCQ-SGD (Eq. 17-19): TP-Join-SGD through the union",
    )
)
