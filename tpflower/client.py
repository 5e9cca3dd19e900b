"""The client operator: a Flower NumPyClient that holds one table (or shard) and its local model f_i.

``fit(parameters, config)`` dispatches on ``config["phase"]``; arrays travel in ``parameters``, small
scalars in ``config``. What a client sends is row ids, keyed digests of join keys, model predictions
and (the label owner) labels: never raw features or raw keys. Its state (theta, the pending batch, G_i,
the VFL expansion) lives in ``context.state``, because Flower may rebuild the client object per message.

Phases (server config["phase"] -> reply arrays):
  keys         -> [row_ids, digest per join of this table..., (label owner) y, is_test]
  expand       [p_i]              -> []            VFL: from now on the client's rows are the N joined rows
  predict      [rows]             -> [h(rows)]      rows: indices into the client's rows; remembered as pending
  sgd_step     [Y, rows, (eval)]  -> [h(rows), (h(eval))]  Eq. 12-13 on the pending rows, then predict
  admm_setup   [G]                -> [h(all rows)]  config: N, rho
  admm_update  [Y]                -> [h(all rows)]  Eq. 16 (closed form for linear models)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import Array, ArrayRecord, ConfigRecord, RecordDict

from tpflower.local_table import LocalTable
from tpflower.local_update import admm_update_linear, admm_update_local_opt, sgd_step
from tpflower.mapping import project_keys
from tpflower.models import l2_penalty, torch_dtype
from tpflower.relation import build_local_model
from tpflower.schema import RelationalSpec, key_kind


@dataclass(frozen=True)
class ClientSettings:
    """What a client knows from the run config (not from the server): its table, model and hyperparameters."""

    spec: RelationalSpec
    table: str
    shard: int
    region: str
    model: Mapping[str, Any]
    algorithm: Mapping[str, Any]
    seed: int
    precision: str
    secret: bytes
    key_kinds: Mapping[str, str]


class ClientState:
    """Named ndarrays and scalars in a Flower RecordDict (context.state)."""

    def __init__(self, records: RecordDict):
        self.records = records

    def get(self, name: str) -> np.ndarray | None:
        rec = self.records.get(f"arr.{name}")
        return None if rec is None else rec["a"].numpy()

    def put(self, name: str, value: np.ndarray) -> None:
        self.records[f"arr.{name}"] = ArrayRecord(array_dict={"a": Array(np.ascontiguousarray(value))})

    def scalar(self, name: str, default: Any = None) -> Any:
        rec = self.records.get("scalars")
        return default if rec is None else rec.get(name, default)

    def set_scalar(self, name: str, value: Any) -> None:
        rec = self.records.get("scalars") or ConfigRecord()
        rec[name] = value
        self.records["scalars"] = rec

    def load_model(self, model: torch.nn.Module) -> bool:
        rec = self.records.get("theta")
        if rec is None:
            return False
        model.load_state_dict(rec.to_torch_state_dict())
        return True

    def save_model(self, model: torch.nn.Module) -> None:
        self.records["theta"] = ArrayRecord(torch_state_dict={k: v.cpu() for k, v in model.state_dict().items()})


class TableClient(NumPyClient):
    """One table's (or shard's) client operator."""

    def __init__(self, local: LocalTable, settings: ClientSettings, state: RecordDict):
        self.local = local
        self.settings = settings
        self.state = ClientState(state)
        self.dtype = torch_dtype(settings.precision)
        # a client given a GPU (conf/resources num_gpus > 0) computes on it; Ray sets CUDA_VISIBLE_DEVICES
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # ---------------------------------------------------------------------------------------- Flower API

    def fit(self, parameters: list[np.ndarray], config: Mapping[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        phase = str(config.get("phase"))
        handler = getattr(self, f"phase_{phase}", None)
        if handler is None:
            raise ValueError(f"table {self.settings.table!r}: unknown phase {phase!r} in the server's message")
        arrays, metrics = handler(parameters, config)
        return arrays, len(self.local.row_ids), metrics

    # ---------------------------------------------------------------------------------------- helpers

    def _model(self, config: Mapping[str, Any]) -> torch.nn.Module:
        """f_i with the stored theta, built identically to the centralized model's part on first use."""
        d_out = int(config.get("d_out") or self.state.scalar("d_out"))
        self.state.set_scalar("d_out", d_out)
        s = self.settings
        model = build_local_model(s.model, s.spec, s.table, self.local.width, d_out, s.seed, self.dtype)
        self.state.load_model(model)
        return model.to(self.device)

    def _rows_X(self, rows: np.ndarray | None) -> np.ndarray:
        """Features of the client's rows ``rows`` (all when None); under VFL these are joined rows."""
        expand = self.state.get("expand")
        if expand is not None:
            rows = expand if rows is None else expand[rows]
        return self.local.X if rows is None else self.local.X[rows]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, dtype=self.dtype, device=self.device)

    def _predict(self, model: torch.nn.Module, rows: np.ndarray | None) -> np.ndarray:
        with torch.no_grad():
            return model(self._tensor(self._rows_X(rows))).cpu().numpy()

    def _metrics(self, model: torch.nn.Module) -> dict[str, float]:
        with torch.no_grad():
            return {"R": float(l2_penalty(model))}  # R_i(theta_i), for the server's objective

    # ---------------------------------------------------------------------------------------- phases

    def phase_keys(self, parameters, config):
        """Row ids and keyed digests of the join keys (Sec. 3.1.1); the label owner adds its labels."""
        s, local = self.settings, self.local
        proj = project_keys(s.spec, s.table, local.keys, local.row_ids, s.secret)
        arrays = proj.arrays()
        metrics: dict[str, Any] = {
            "table": s.table,
            "shard": s.shard,
            "region": s.region,
            "n_rows": len(local.row_ids),
            "width": local.width,
            "key_kinds": ",".join(f"{c}={k}" for c, k in s.key_kinds.items()),
        }
        if local.y is not None:
            arrays += [local.y, local.is_test.astype(np.uint8)]
            metrics["n_classes"] = int(local.n_classes or 0)
        return arrays, metrics

    def phase_expand(self, parameters, config):
        """VFL baselines: the server sent p_i; the client's rows become the N joined rows X_i[p_i]."""
        self.state.put("expand", np.asarray(parameters[0], dtype=np.int64))
        return [], {}

    def phase_predict(self, parameters, config):
        model = self._model(config)
        rows = np.asarray(parameters[0], dtype=np.int64) if parameters else None
        if rows is not None:
            self.state.put("pending", rows)
        self.state.save_model(model)
        return [self._predict(model, rows)], self._metrics(model)

    def phase_sgd_step(self, parameters, config):
        """Eq. 12-13 on the pending rows with their aggregated Y_i, then predict the next rows (pipelining)."""
        Y, next_rows, *eval_rows = parameters
        model = self._model(config)
        pending = self.state.get("pending")
        if pending is None or len(pending) != len(Y):
            raise RuntimeError(f"table {self.settings.table!r}: sgd_step without a matching predict of its rows")
        sgd_step(model, self._tensor(self._rows_X(pending)), self._tensor(Y), int(config["batch_size"]),
                 float(self.settings.algorithm["lr"]), float(self.settings.model["beta"]))
        self.state.save_model(model)
        self.state.put("pending", np.asarray(next_rows, dtype=np.int64))
        out = [self._predict(model, np.asarray(rows, dtype=np.int64)) for rows in [next_rows, *eval_rows]]
        return out, self._metrics(model)

    def phase_admm_setup(self, parameters, config):
        """Store G_i (Eq. 15, constant) and N; predict every row."""
        self.state.put("G", np.asarray(parameters[0], dtype=np.float64))
        self.state.set_scalar("N", int(config["N"]))
        self.state.set_scalar("rho", float(config["rho"]))  # the server resolves algorithm.rho=auto
        model = self._model(config)
        self.state.save_model(model)
        return [self._predict(model, None)], self._metrics(model)

    def phase_admm_update(self, parameters, config):
        """theta_i = argmin Eq. 16 given Y_i, G_i; then predict every row with the new theta."""
        (Y,) = parameters
        model = self._model(config)
        G = self.state.get("G")
        N = int(self.state.scalar("N"))
        alg, beta = self.settings.algorithm, float(self.settings.model["beta"])
        rho = float(self.state.scalar("rho"))
        X = self._rows_X(None)
        if isinstance(model, torch.nn.Linear):  # closed form, solved in float64 numpy
            admm_update_linear(model, X, G, np.asarray(Y, dtype=np.float64), N, rho, beta)
        else:
            gen = torch.Generator().manual_seed(int(self.settings.seed) * 7919 + int(config.get("epoch", 0)))
            admm_update_local_opt(
                model, self._tensor(X), self._tensor(G), self._tensor(Y), N, rho, beta, int(alg["local_epochs"]),
                float(alg["local_lr"]), int(alg["local_batch_size"]), gen,
            )
        self.state.save_model(model)
        return [self._predict(model, None)], self._metrics(model)


def key_kinds_of(spec: RelationalSpec, table: str, frame) -> dict[str, str]:
    """The comparison kind of each join-key column (sent so the server can check joined columns agree)."""
    return {c: key_kind(frame[c].dtype) for c in spec.key_columns(table)}
