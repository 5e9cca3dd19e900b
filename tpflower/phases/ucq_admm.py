"""TP-UCQ-SGD and TP-UCQ-ADMM, the shard side of learning over union (TablePuppet Eq. 17-22).

sgd_partial     {Y}                  -> {g}            Eq. 18: unnormalised partial gradient on the pending rows
sgd_apply       {g, rows, (eval_rows)} -> {h, (h_eval)} Eq. 19: the coordinator's step, then predict
admm_shard      {(Y), (v)}           -> {theta, (used)} Eq. 22: consensus step with v = w - u^q (Y with an epoch's
                                                       first; with it, without feature DP, the parameters its rows use);
                                                       no v only in the run's first step: v = theta_i^0 (w^0, which the
                                                       server does not know)
admm_consensus  {w}                  -> {h}            Eq. 20: theta = w, predict every row
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpflower.client import TableClient
from tpflower.guard import Phase, ProtocolRefusal, sharded, takes, unsharded
from tpflower.models import used_parameters
from tpflower.phases import join_admm, setup
from tpflower.phases.join_admm import ADMMParams, ADMMState, admm_update, epoch_rho, theta_update
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.state import StateRecord


@dataclass
class ShardY(StateRecord):
    """The epoch's Y_i of this shard's rows (the inner rounds of one epoch reuse it)."""

    Y: np.ndarray | None = None


def admm_shard(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Eq. 22: theta^q = argmin (1/N) sum_{u in shard} [Y_u^T f + rho G_u/2 ||f||^2] + rho'/2 ||theta - v||^2."""
    if "Y" in arrays:
        ShardY(np.asarray(arrays["Y"])).save(client.state)
    Y, s = (ShardY.load(client.state) or ShardY()).Y, ADMMState.of(client)
    model = client.model(config)
    if "v" in arrays:
        v = np.asarray(arrays["v"], dtype=np.float64)
    elif client.state.scalar("ucq.started", 0):
        raise ProtocolRefusal(f"table {client.settings.table!r}: admm_shard without v after the run's first step")
    else:  # the run's first step: the consensus starts at theta_i^0, which stays on the node
        v = client.theta(model).astype(np.float64)
    client.state.set_scalar("ucq.started", 1)
    rho_c, rho = float(config["rho_c"]), epoch_rho(config, s)
    X = client.rows_X(None)
    alg = client.settings.algorithm
    privacy: dict[str, Any] = {}
    if client.dp.on:  # Eq. 22 as DP-SGD: the prox term replaces beta R, added unclipped after the noise
        trainer = client.dp.trainer(model)
        vt = client.tensor(v)

        def prox(m: torch.nn.Module) -> torch.Tensor:
            return 0.5 * rho_c * ((torch.nn.utils.parameters_to_vector(m.parameters()) - vt) ** 2).sum()

        trainer.admm_update(
            client.tensor(X),
            client.tensor(s.G),
            client.tensor(Y),
            s.N,
            rho,
            1.0,
            alg.local_epochs,
            alg.local_lr,
            alg.local_batch_size,
            client.dp.sample_generator(),
            regularizer=prox,
        )
        client.dp.done(trainer, privacy)
    else:
        theta_update(client, model, None, s.G, Y, s.N, rho, 0.0, config, prox=(v, rho_c))
    client.state.save_model(model)
    out = {"theta": client.theta(model).astype(np.float64)}
    if "Y" in arrays and not client.dp.on:
        # for the general-form consensus (Boyd Sec. 7.2). Which weights the rows use is what theta^q = v on the
        # unused ones shows anyway; under feature DP theta^q is noisy and the server averages plainly instead
        out["used"] = used_parameters(model, torch.as_tensor((X != 0).any(axis=0))).numpy().astype(np.uint8)
    return out, privacy


def admm_consensus(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Eq. 20 done by the coordinator: every shard takes the consensus model w and predicts its rows."""
    model = client.model(config)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(client.tensor(arrays["w"]), model.parameters())
    client.state.save_model(model)
    return {"h": client.predict(model, None)}, client.reg_metrics(model)


#: a table with one shard makes TP-Join-ADMM's update; the shards of a sharded table the consensus steps, and
#: take the consensus model once per consensus
ADMM_TRAIN: dict[str, Phase] = {
    "admm_update": Phase(admm_update, unsharded, inputs=takes("Y"), exact=True, dp_noised=True),
    # v and w are the server's sums over the table's shards (the consensus): a shard takes v (= w - u) right
    # after its own theta^q or its consensus reply, and w right after its own theta^q (h = X w under the server's w: exact even under DP)
    "admm_shard": Phase(
        admm_shard,
        sharded,
        inputs=takes("Y", union={"v": ("admm_shard", "admm_consensus")}),
        exact=True,
        dp_noised=True,
    ),
    "admm_consensus": Phase(admm_consensus, sharded, spaced=True, inputs=takes(union={"w": "admm_shard"}), exact=True),
}


register(
    AlgorithmEntry(
        "tp_ucq_admm",
        "admm",
        "ucq",
        "ucq_admm",
        "TPUCQADMM",
        setup.loj_protocol(join_admm.START, ADMM_TRAIN),
        ADMMParams,
        summary="TP-UCQ-ADMM (Eq. 20-24): consensus ADMM over the shards",
    )
)
