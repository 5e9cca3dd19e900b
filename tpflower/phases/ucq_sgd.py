"""TP-UCQ-SGD, the shard side of learning over union with SGD (TablePuppet Eq. 17-19).

A table split into shards answers TP-Join-SGD's messages through the union: the coordinator (server) asks
each shard for its unnormalised partial gradient over its pending rows (Eq. 18), sums them and sends every
shard the same aggregate step (Eq. 19); each shard then predicts its rows of the next batch. Tables with one
shard answer the join's phases unchanged.

  sgd_partial     {Y}                  -> {g}            Eq. 18: unnormalised partial gradient on the pending rows
  sgd_apply       {(g), rows, (eval_rows)} -> {h, (h_eval)} Eq. 19: the coordinator's step (g: a shard of a
                                       sharded table; one shard: its own gradient / batch_rows), then predict
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tpflower.client import TableClient
from tpflower.guard import Phase, ProtocolRefusal, takes
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
        return kept(client, g.detach().cpu().numpy()), privacy
    g = sgd_partial_gradient(model, X, client.tensor(Y), count, beta)
    return kept(client, g.detach().cpu().numpy()), {}


def kept(client: TableClient, g: np.ndarray) -> Arrays:
    """The partial gradient as sent; a table with one shard keeps it for its sgd_apply (its whole gradient)."""
    if not client.settings.federated_prep:
        client.state.put(OWN_GRADIENT, g)
    return {"g": g}


OWN_GRADIENT = "ucq_sgd.g"


def sgd_apply(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Eq. 19: the coordinator's aggregate gradient (a shard of a sharded table), or this table's own partial
    gradient divided by |B| (a table with one shard: the server's sum over its one shard), the same step on
    every shard; then predict."""
    model = client.model(config)
    if "g" in arrays:
        g = np.asarray(arrays["g"])
    else:
        own = client.state.get(OWN_GRADIENT)
        if own is None:
            raise ProtocolRefusal(f"table {client.settings.table!r}: sgd_apply before its sgd_partial")
        g = own / int(config["batch_rows"])  # as the coordinator's Eq. 17: the sum over its one shard / |B|
    apply_step(model, client.tensor(g), client.settings.algorithm.lr)
    client.state.save_model(model)
    return predict_rows(client, model, arrays), client.reg_metrics(model)


SGD_TRAIN: dict[str, Phase] = {
    "sgd_partial": Phase(sgd_partial, inputs=takes("Y"), exact=True, dp_noised=True),
    # the server's sum g over a sharded table's shards only on such a shard, right after its own sgd_partial;
    # a table with one shard applies the gradient it computed itself (its own reply, kept)
    "sgd_apply": Phase(
        sgd_apply, inputs=takes("rows", "eval_rows", union={"g": "sgd_partial"}), exact=True, dp_noised=True
    ),
}


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
