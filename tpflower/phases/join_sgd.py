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
import torch

from tpflower.client import TableClient
from tpflower.guard import Phase, Stage, takes
from tpflower.models import l2_penalty
from tpflower.params import AlgorithmParams, nonnegative_int, or_word, param, positive, positive_int
from tpflower.phases import setup
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.state import StateRecord
from tpflower.validation import PATIENCE


def local_sgd_step(
    model: torch.nn.Module, X: torch.Tensor, Y: torch.Tensor, batch_size: int, lr: float, beta: float
) -> None:
    """theta_i -= lr * [(1/|B|) sum_u Y_iu^T dh_iu/dtheta_i + beta dR_i/dtheta_i] (Eq. 12, 13).

    X: the rows U_i of the table (|U_i| x d_i); Y: the aggregated dl/dH of those rows (|U_i| x d_c).
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD keeps no state between steps
    opt.zero_grad()
    loss = (Y * model(X)).sum() / batch_size + beta * l2_penalty(model)
    loss.backward()
    opt.step()


def sgd_partial_gradient(
    model: torch.nn.Module, X: torch.Tensor, Y: torch.Tensor, count: float, beta: float
) -> torch.Tensor:
    """One shard's unnormalised partial gradient (Eq. 18): sum_u Y_iu^T dh_iu/dtheta + beta G_sum dR/dtheta,
    with G_sum = sum over its rows u of G_iu (how many joined rows of the batch use them); flat vector."""
    model.zero_grad()
    loss = (Y * model(X)).sum() + beta * count * l2_penalty(model)
    loss.backward()
    return torch.cat(
        [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in model.parameters()]
    )


def apply_step(model: torch.nn.Module, gradient: torch.Tensor, lr: float) -> None:
    """theta -= lr * gradient (Eq. 19), the gradient given as one flat vector."""
    with torch.no_grad():
        theta = torch.nn.utils.parameters_to_vector(model.parameters())
        torch.nn.utils.vector_to_parameters(theta - lr * gradient, model.parameters())


#: algorithm.min_steps' default: measured on small joins of 1,000-10,000 rows (docs/algorithms.md#small-training-joins)
MIN_STEPS = 500


@dataclass(frozen=True)
class SGDParams(AlgorithmParams):
    """TP-Join-SGD, TP-UCQ-SGD, VFL-SGD (conf/algorithm/sgd.yaml)."""

    lr: float = param(positive, 0.2)
    batch_size: int | str = param(or_word(positive_int, "full"), 1024)
    # fewest mini-batch steps a run makes without DP: a training join of few batches trains more epochs
    # than `epochs` (early stopping still ends it); 0: exactly `epochs` (docs/algorithms.md#small-training-joins)
    min_steps: int = param(nonnegative_int, MIN_STEPS)
    eval_every: int | None = param(or_word(positive_int, None), None)  # rounds; None: once per epoch
    # evaluations without a lower validation loss that stop the run (0: never), with a validation part
    early_stopping: int = param(nonnegative_int, PATIENCE)


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
    client.dp.init(config, lambda: client.dp.batch_rate(np.asarray(arrays["rows"], dtype=np.int64)))
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
        q = client.dp.step_rate(len(rows))  # the share of its rows this step holds, when above the plan's q
        trainer.sgd_step(client.tensor(client.local.X[rows]), client.tensor(Y_rows), batch, lr, beta, q)
        client.dp.done(trainer, privacy)
    else:
        local_sgd_step(model, client.tensor(client.rows_X(pending)), client.tensor(Y), batch, lr, beta)
    client.state.save_model(model)
    return predict_rows(client, model, arrays), {**client.reg_metrics(model), **privacy}


#: the rows of the next batch (and the test rows at an evaluation point); with Y_i of the pending rows
ROWS = takes("rows", "eval_rows")
START = Stage("start", {"predict": Phase(predict, inputs=ROWS, exact=True, dp_noised=True)})
TRAIN: dict[str, Phase] = {
    "sgd_step": Phase(sgd_step, inputs=takes("Y", "rows", "eval_rows"), exact=True, dp_noised=True)
}


register(
    AlgorithmEntry(
        "tp_join_sgd",
        "sgd",
        "join",
        "join_sgd",
        "TPJoinSGD",
        setup.loj_protocol(START, TRAIN),
        SGDParams,
        summary="TP-Join-SGD (Eq. 10-13): one round trip per mini-batch",
    )
)
register(
    AlgorithmEntry(
        "vfl_sgd",
        "vfl_sgd",
        "join",
        "join_sgd",
        "VFLSGD",
        setup.loj_protocol(START, TRAIN, vfl=True),
        SGDParams,
        summary="VFL-SGD baseline on the expanded join",
    )
)
