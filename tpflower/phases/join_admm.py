"""TP-Join-ADMM and VFL-ADMM, client side (TablePuppet Eq. 14-16).

  admm_setup   {G}  -> {h, theta}  store G_i (Eq. 15, constant), N and rho; predict every row
  admm_update  {Y}  -> {h}         theta_i = argmin Eq. 16 (closed form for linear models); predict every row;
                                   config ``rho``: the epoch's penalty (residual balancing changes it)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpflower.client import TableClient
from tpflower.records import Arrays
from tpflower.state import StateRecord
from tpflower.guard import Phase, Stage
from tpflower.local_update import admm_update_lbfgs, admm_update_linear, admm_update_local_opt


@dataclass
class ADMMState(StateRecord):
    """G_i over the client's rows (Eq. 15), the number of joined training rows N and the penalty rho."""

    G: np.ndarray | None = None
    N: int = 0
    rho: float = 0.0

    @classmethod
    def of(cls, client: TableClient) -> "ADMMState":
        state = cls.load(client.state)
        if state is None:
            raise RuntimeError(f"table {client.settings.table!r}: an ADMM update before admm_setup")
        return state


def epoch_rho(config: Mapping[str, Any], state: ADMMState) -> float:
    """The rho of this theta-update: the round's config (residual balancing, Boyd Sec. 3.4.1), else setup's."""
    rho = float(config.get("rho", state.rho))
    if not (np.isfinite(rho) and rho > 0):
        raise ValueError(f"admm: rho must be a positive number, got {rho!r}")
    return rho


def theta_update(client: TableClient, model: torch.nn.Module, X: np.ndarray, G: np.ndarray, Y: np.ndarray, N: int,
                 rho: float, beta: float, config: Mapping[str, Any],
                 prox: tuple[np.ndarray, float] | None = None) -> None:
    """theta_i = argmin Eq. 16 without DP, in place: the closed form for a linear model, else the client's
    algorithm.local_solver (lbfgs: local_steps L-BFGS iterations; adam: local_epochs of Adam). ``prox`` = (v, rho'):
    the consensus step of a shard (Eq. 22), rho'/2 ||theta - v||^2 added."""
    alg = client.settings.algorithm
    if isinstance(model, torch.nn.Linear):  # closed form, solved in float64 numpy
        admm_update_linear(model, X, G, np.asarray(Y, dtype=np.float64), N, rho, beta, prox=prox)
        return
    prox_t = None if prox is None else (client.tensor(prox[0]), prox[1])
    if alg.local_solver == "lbfgs":
        admm_update_lbfgs(model, client.tensor(X), client.tensor(G), client.tensor(Y), N, rho, beta, alg.local_steps,
                          prox=prox_t)
    else:
        admm_update_local_opt(model, client.tensor(X), client.tensor(G), client.tensor(Y), N, rho, beta,
                              alg.local_epochs, alg.local_lr, alg.local_batch_size, client.local_generator(config),
                              prox=prox_t)


def admm_setup(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Store G_i, N and rho (the server resolves algorithm.rho=auto); predict every row."""
    ADMMState(np.asarray(arrays["G"], dtype=np.float64), int(config["N"]), float(config["rho"])).save(client.state)
    client.dp.init(config)
    model = client.model(config)
    client.state.save_model(model)
    # theta: the consensus ADMM's starting point (union scenario)
    return {"h": client.predict(model, None), "theta": client.theta(model)}, client.reg_metrics(model)


def admm_update(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """theta_i = argmin Eq. 16 given Y_i, G_i; then predict every row with the new theta."""
    Y = arrays["Y"]
    model = client.model(config)
    s = ADMMState.of(client)
    rho = epoch_rho(config, s)
    alg, beta = client.settings.algorithm, float(client.settings.model["beta"])
    privacy: dict[str, Any] = {}
    if client.dp.on:  # Eq. 16 as DP-SGD over the table's rows (also for linear models)
        Xt, Gt, Yt = client.dp.admm_rows(s.G, Y)
        trainer = client.dp.trainer(model)
        trainer.admm_update(
            client.tensor(Xt), client.tensor(Gt), client.tensor(Yt), s.N, rho, beta, alg.local_epochs,
            alg.local_lr, alg.local_batch_size, client.dp.sample_generator(),
        )
        client.dp.done(trainer, privacy)
    else:
        theta_update(client, model, client.rows_X(None), s.G, Y, s.N, rho, beta, config)
    client.state.save_model(model)
    return {"h": client.predict(model, None)}, {**client.reg_metrics(model), **privacy}


START = Stage("start", {"admm_setup": Phase(admm_setup)})
TRAIN: dict[str, Phase] = {"admm_update": Phase(admm_update)}
