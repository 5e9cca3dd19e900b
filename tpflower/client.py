"""The client operator: a Flower NumPyClient that holds one table (or shard) and its local model f_i.

``fit(parameters, config)`` dispatches on ``config["phase"]``; arrays travel in ``parameters``, small
scalars in ``config``. What a client sends is row ids, keyed digests of join keys, model predictions
and (the label owner) labels: never raw features or raw keys. Its state (theta, the pending batch, G_i,
the VFL expansion) lives in ``context.state``, because Flower may rebuild the client object per message.

Phases (server config["phase"] -> reply arrays):
  keys         -> [row_ids, digest per join of this table..., (label owner) y, is_test]
                  with label DP: y holds the randomized labels of the TRAINING rows only
  stats        -> preprocessing summary of its fit rows (union: a table with several shards, Sec. 4.4)
  rule         [global rule]      -> []            the merged preprocessing rule replaces the local fit
  expand       [p_i]              -> []            VFL: from now on the client's rows are the N joined rows
  predict      [rows]             -> [h(rows)]      rows: indices into the client's rows; remembered as pending
  sgd_step     [Y, rows, (eval)]  -> [h(rows), (h(eval))]  Eq. 12-13 on the pending rows, then predict
  sgd_partial  [Y]                -> [g]             union: unnormalised partial gradient of Eq. 18
  sgd_apply    [g, rows, (eval)]  -> [h(rows), (h(eval))]  union: the coordinator's step (Eq. 19), then predict
  admm_setup   [G]                -> [h(all rows), theta]  config: N, rho
  admm_update  [Y]                -> [h(all rows)]  Eq. 16 (closed form for linear models)
  admm_shard   [(Y), v]           -> [theta^q]       union: consensus step of Eq. 22 with v = w - u^q
  admm_consensus [w]              -> [h(all rows)]  union: theta = w (Eq. 20), then predict
  evaluate     [H, rows]          -> []              label DP: the label owner scores the test predictions H
                                                     of its test rows ``rows`` against its true labels (metrics)

Privacy (tpflower.privacy; ALGORITHMS.md "Privacy"). The settings come from the client's own config
(``ClientSettings.privacy``) or else from the server's keys message, and are kept in ``context.state``.
Label DP: the label owner randomizes its training labels once, in ``keys``, and never sends test labels.
Feature DP: the first training message (``predict`` / ``admm_setup``) carries ``dp_steps`` and ``dp_q``
(the local DP steps of the whole run and the per-step sample rate of a table row, planned by the server);
the client derives sigma from them ONCE and stores it. Every update is then a DP step of a
:class:`~tpflower.privacy.DPLocalTrainer` rebuilt per message from theta and the accountant history in
``context.state``; every reply that follows a step reports ``eps`` (spent at ``delta``) in its metrics.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import Array, ArrayRecord, ConfigRecord, RecordDict

from tpflower import privacy as dp
from tpflower.fedprep import GlobalRule, apply_rule, local_summary
from tpflower.local_table import LocalTable, ShardData
from tpflower.local_update import (
    admm_update_linear,
    admm_update_local_opt,
    apply_step,
    sgd_partial_gradient,
    sgd_step,
)
from tpflower.losses import metrics as eval_metrics
from tpflower.mapping import project_keys, segment_sum
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
    federated_prep: bool = False  # union scenario, table with several shards: preprocessing by global rule
    # the client's own privacy settings (conf/privacy); None: take those of the server's keys message
    privacy: Mapping[str, Any] | None = None


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

    def put_list(self, name: str, values: list[np.ndarray]) -> None:
        self.records[f"list.{name}"] = ArrayRecord(array_dict={str(k): Array(np.ascontiguousarray(v)) for k, v in enumerate(values)})

    def get_list(self, name: str) -> list[np.ndarray] | None:
        rec = self.records.get(f"list.{name}")
        return None if rec is None else [rec[str(k)].numpy() for k in range(len(rec))]

    def save_model(self, model: torch.nn.Module) -> None:
        self.records["theta"] = ArrayRecord(torch_state_dict={k: v.cpu() for k, v in model.state_dict().items()})


class TableClient(NumPyClient):
    """One table's (or shard's) client operator."""

    def __init__(self, data: ShardData, settings: ClientSettings, state: RecordDict):
        self.data = data
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
        return arrays, len(self.data.row_ids), metrics

    # ---------------------------------------------------------------------------------------- helpers

    @property
    def local(self) -> LocalTable:
        """The preprocessed table: own fit, or (union, several shards) the global rule received in `rule`."""
        if not self.settings.federated_prep:
            return self.data.table()
        rule = self.state.get_list("rule")
        if rule is None:
            raise RuntimeError(f"table {self.settings.table!r} shard {self.settings.shard}: no preprocessing rule received")
        t = self.settings.spec.table(self.settings.table)
        n_edges = len(t.binned)  # the rule message ends with the bin edges of the binned columns
        rule_arrays, edge_arrays = rule[: len(rule) - n_edges], rule[len(rule) - n_edges :]
        return self.data.table(
            str(self.state.scalar("rule_id")),
            lambda: (
                apply_rule(GlobalRule.from_arrays(rule_arrays, t.numeric, t.categorical), self.data.rows,
                           self.settings.secret, self.settings.table),
                {c: np.asarray(e, dtype=np.float64) for (c, _), e in zip(t.binned, edge_arrays)},
            ),
        )

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

    @staticmethod
    def _theta(model: torch.nn.Module) -> np.ndarray:
        """The model's parameters as one flat vector (the consensus ADMM's unit of exchange)."""
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()

    def _local_generator(self, config: Mapping[str, Any]) -> torch.Generator:
        """Row order of a non-DP local optimisation (MLP theta-update): seeded by the run seed and the epoch."""
        return torch.Generator().manual_seed(int(self.settings.seed) * 7919 + int(config.get("epoch", 0)))

    def _predict(self, model: torch.nn.Module, rows: np.ndarray | None) -> np.ndarray:
        with torch.no_grad():
            return model(self._tensor(self._rows_X(rows))).cpu().numpy()

    def _metrics(self, model: torch.nn.Module) -> dict[str, float]:
        with torch.no_grad():
            return {"R": float(l2_penalty(model))}  # R_i(theta_i), for the server's objective

    # ---------------------------------------------------------------------------------------- privacy

    def _privacy(self) -> Mapping[str, Any]:
        """The privacy settings: the client's own, else those the keys message carried (kept in state)."""
        if self.settings.privacy is not None:
            return self.settings.privacy
        rec = self.state.records.get("privacy")
        return dp.privacy_from_message(dict(rec) if rec is not None else {})

    def _feature_dp(self) -> bool:
        return dp.uses_feature_dp(self._privacy())

    def _seed(self, purpose: str) -> int | None:
        s = self.settings
        return dp.dp_seed(self._privacy(), s.seed, purpose, s.table, s.shard)

    def _dp_init(self, config: Mapping[str, Any]) -> None:
        """Feature DP: sigma for the run's planned local steps and sample rate, computed once and stored."""
        if not self._feature_dp() or self.state.scalar("dp_sigma") is not None:
            return
        if "dp_steps" not in config or "dp_q" not in config:
            raise RuntimeError(
                f"table {self.settings.table!r}: feature DP is on but the server sent no DP plan (dp_steps, dp_q)"
            )
        priv = self._privacy()
        steps, q = int(config["dp_steps"]), float(config["dp_q"])
        # no step planned (a shard without active rows): sigma is never used; _dp_done refuses any step
        sigma = dp.noise_multiplier_for(priv["epsilon"], priv["delta"], q, steps) if steps >= 1 else 0.0
        self.state.set_scalar("dp_sigma", float(sigma))
        self.state.set_scalar("dp_q", q)
        self.state.set_scalar("dp_steps", steps)

    def _trainer(self, model: torch.nn.Module) -> dp.DPLocalTrainer:
        """A DP-SGD trainer around ``model`` (theta already loaded), with the accountant history of the run."""
        sigma = self.state.scalar("dp_sigma")
        if sigma is None:
            raise RuntimeError(f"table {self.settings.table!r}: a DP step before the DP plan arrived")
        history = self.state.get("dp_history")
        return dp.DPLocalTrainer(
            model,
            noise_multiplier=float(sigma),
            max_grad_norm=float(self._privacy()["clip"]),
            sample_rate=float(self.state.scalar("dp_q")),
            seed=self._seed("noise"),
            history=[] if history is None else history.tolist(),
        )

    def _dp_done(self, trainer: dp.DPLocalTrainer, metrics: dict[str, Any]) -> None:
        """Store the accountant history, report the epsilon spent, remove the Opacus hooks from the model."""
        planned = int(self.state.scalar("dp_steps"))
        if trainer.steps > planned:  # nothing of this step leaves the client
            raise RuntimeError(
                f"table {self.settings.table!r} shard {self.settings.shard}: {trainer.steps} DP steps exceed the "
                f"{planned} the noise was calibrated for (privacy budget exhausted)"
            )
        self.state.put("dp_history", np.asarray(trainer.accountant_state(), dtype=np.float64).reshape(-1, 3))
        metrics["eps"] = trainer.epsilon(float(self._privacy()["delta"]))
        trainer.close()

    def _sample_generator(self, steps: int) -> torch.Generator:
        """Row sampling of a DP theta-update (fresh per call: seeded by the steps taken so far)."""
        seed = self._seed(f"sample:{int(steps)}")
        return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)

    def _table_rows(self, rows: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feature DP: the privacy unit is one TABLE row. Given the client's rows ``rows`` and their Y, the
        distinct table rows and Y summed over each one's rows. TP-Join: the rows are table rows already;
        VFL: they are joined rows, summed over the duplicates with the expand map p_i (Eq. 10 on the client)."""
        expand = self.state.get("expand")
        if expand is None:
            return rows, np.asarray(Y)
        U, inv = np.unique(expand[rows], return_inverse=True)
        return U, segment_sum(inv.reshape(-1), np.asarray(Y, dtype=np.float64), len(U))

    def _admm_rows(self, G: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Feature DP, Eq. 16 over TABLE rows: (X, G, Y) of the table. VFL-ADMM (G = 1 per joined row) sums
        G and Y over each table row's joined rows, which gives exactly TP-Join-ADMM's per-row term."""
        expand = self.state.get("expand")
        X = self.local.X
        if expand is None:
            return X, G, np.asarray(Y)
        n = len(X)
        G_t = segment_sum(expand, np.asarray(G, dtype=np.float64), n)
        return X, G_t, segment_sum(expand, np.asarray(Y, dtype=np.float64), n)

    # ---------------------------------------------------------------------------------------- phases

    def phase_keys(self, parameters, config):
        """Row ids and keyed digests of the join keys (Sec. 3.1.1); the label owner adds its labels."""
        s, data = self.settings, self.data
        if config.get("privacy") and s.privacy is None:  # the run's privacy settings, for the later phases
            rec = ConfigRecord()
            for k, v in config.items():
                if k == "privacy" or str(k).startswith("privacy."):
                    rec[k] = v
            self.state.records["privacy"] = rec
        proj = project_keys(s.spec, s.table, data.keys, data.row_ids, s.secret)
        arrays = proj.arrays()
        metrics: dict[str, Any] = {
            "table": s.table,
            "shard": s.shard,
            "region": s.region,
            "n_rows": len(data.row_ids),
            "key_kinds": ",".join(f"{c}={k}" for c, k in s.key_kinds.items()),
        }
        if data.y is not None:
            y = data.y
            priv = self._privacy()
            if dp.uses_label_dp(priv):
                # label DP, once, before the labels leave: the training rows' labels randomized
                # (tpflower.privacy.randomize_labels), the test rows' labels not sent at all (see evaluate)
                train = ~data.is_test
                rng = dp.label_rng(priv, s.seed, s.table, s.shard)
                y = dp.randomize_labels(data.y[train], s.spec.label.task, priv, rng, data.n_classes)
                metrics["labels"] = "train_randomized"
            arrays += [y, data.is_test.astype(np.uint8)]
            metrics["n_classes"] = int(data.n_classes or 0)
        return arrays, metrics

    def phase_stats(self, parameters, config):
        """Federated preprocessing, step 1: a summary of this shard's fit rows (no raw values or strings)."""
        s, t = self.settings, self.settings.spec.table(self.settings.table)
        wanted = config.get("sketch")  # the columns whose order statistics the server asks for; absent: all
        columns = None if wanted is None else [c for c in str(wanted).split(",") if c]
        summary = local_summary(self.data.rows, t.numeric, t.categorical, s.secret, self.data.fit_positions,
                                table=s.table, sketch_columns=columns)
        return summary.arrays(), {}

    def phase_rule(self, parameters, config):
        """Federated preprocessing, step 3: keep the merged global rule; features are built from it."""
        self.state.put_list("rule", list(parameters))
        self.state.set_scalar("rule_id", str(config["rule_id"]))
        return [], {}

    def phase_expand(self, parameters, config):
        """VFL baselines: the server sent p_i; the client's rows become the N joined rows X_i[p_i]."""
        self.state.put("expand", np.asarray(parameters[0], dtype=np.int64))
        return [], {}

    def phase_predict(self, parameters, config):
        self._dp_init(config)
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
        lr, beta, batch = float(self.settings.algorithm["lr"]), float(self.settings.model["beta"]), int(config["batch_size"])
        privacy: dict[str, Any] = {}
        if self._feature_dp():  # DP-SGD: per TABLE row clipped terms of Eq. 12, Gaussian noise
            rows, Y_rows = self._table_rows(pending, Y)
            trainer = self._trainer(model)
            trainer.sgd_step(self._tensor(self.local.X[rows]), self._tensor(Y_rows), batch, lr, beta)
            self._dp_done(trainer, privacy)
        else:
            sgd_step(model, self._tensor(self._rows_X(pending)), self._tensor(Y), batch, lr, beta)
        self.state.save_model(model)
        self.state.put("pending", np.asarray(next_rows, dtype=np.int64))
        out = [self._predict(model, np.asarray(rows, dtype=np.int64)) for rows in [next_rows, *eval_rows]]
        return out, {**self._metrics(model), **privacy}

    def phase_admm_setup(self, parameters, config):
        """Store G_i (Eq. 15, constant) and N; predict every row."""
        self.state.put("G", np.asarray(parameters[0], dtype=np.float64))
        self.state.set_scalar("N", int(config["N"]))
        self.state.set_scalar("rho", float(config["rho"]))  # the server resolves algorithm.rho=auto
        self._dp_init(config)
        model = self._model(config)
        self.state.save_model(model)
        return [self._predict(model, None), self._theta(model)], self._metrics(model)  # theta: the consensus start (union)

    def phase_admm_update(self, parameters, config):
        """theta_i = argmin Eq. 16 given Y_i, G_i; then predict every row with the new theta."""
        (Y,) = parameters
        model = self._model(config)
        G = self.state.get("G")
        N = int(self.state.scalar("N"))
        alg, beta = self.settings.algorithm, float(self.settings.model["beta"])
        rho = float(self.state.scalar("rho"))
        privacy: dict[str, Any] = {}
        if self._feature_dp():  # Eq. 16 as DP-SGD over the table's rows (also for linear models)
            Xt, Gt, Yt = self._admm_rows(G, Y)
            trainer = self._trainer(model)
            trainer.admm_update(
                self._tensor(Xt), self._tensor(Gt), self._tensor(Yt), N, rho, beta, int(alg["local_epochs"]),
                float(alg["local_lr"]), int(alg["local_batch_size"]), self._sample_generator(trainer.steps),
            )
            self._dp_done(trainer, privacy)
        elif isinstance(model, torch.nn.Linear):  # closed form, solved in float64 numpy
            admm_update_linear(model, self._rows_X(None), G, np.asarray(Y, dtype=np.float64), N, rho, beta)
        else:
            admm_update_local_opt(
                model, self._tensor(self._rows_X(None)), self._tensor(G), self._tensor(Y), N, rho, beta,
                int(alg["local_epochs"]), float(alg["local_lr"]), int(alg["local_batch_size"]),
                self._local_generator(config),
            )
        self.state.save_model(model)
        return [self._predict(model, None)], {**self._metrics(model), **privacy}

    def phase_evaluate(self, parameters, config):
        """Label DP: the test labels never leave the label owner. The server sends its test predictions H of
        this client's test rows ``rows`` (positions in its rows); the client returns the metrics against its
        true labels (tpflower.losses.metrics) and the row count, for the server to combine over shards."""
        H, rows = parameters
        data, task = self.data, self.settings.spec.label.task
        if data.y is None or data.is_test is None:
            raise RuntimeError(f"table {self.settings.table!r} holds no labels: it cannot evaluate")
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(data.y) or not data.is_test[rows].all()):
            raise ValueError(f"table {self.settings.table!r}: evaluate asks for rows outside this client's test split")
        if len(rows) == 0:
            return [], {"n": 0}
        return [], {"n": len(rows), **eval_metrics(task, np.asarray(H), data.y[rows])}

    # ---------------------------------------------------------------------------------------- union phases

    def phase_sgd_partial(self, parameters, config):
        """Eq. 18: this shard's unnormalised partial gradient over its pending rows, given their Y."""
        (Y,) = parameters
        model = self._model(config)
        pending = self.state.get("pending")
        if pending is None or len(pending) != len(Y):
            raise RuntimeError(f"table {self.settings.table!r}: sgd_partial without a matching predict of its rows")
        X, beta, count = self._tensor(self._rows_X(pending)), float(self.settings.model["beta"]), float(config["count"])
        if self._feature_dp():  # Eq. 18 with clipped per-row terms and this shard's own Gaussian noise
            trainer = self._trainer(model)
            g = trainer.partial_gradient(X, self._tensor(Y), beta * count)
            privacy: dict[str, Any] = {}
            self._dp_done(trainer, privacy)
            return [g.detach().cpu().numpy()], privacy
        g = sgd_partial_gradient(model, X, self._tensor(Y), count, beta)
        return [g.detach().cpu().numpy()], {}

    def phase_sgd_apply(self, parameters, config):
        """Eq. 19: the coordinator's aggregate gradient, the same step on every shard; then predict."""
        g, next_rows, *eval_rows = parameters
        model = self._model(config)
        apply_step(model, self._tensor(g), float(self.settings.algorithm["lr"]))
        self.state.save_model(model)
        self.state.put("pending", np.asarray(next_rows, dtype=np.int64))
        out = [self._predict(model, np.asarray(rows, dtype=np.int64)) for rows in [next_rows, *eval_rows]]
        return out, self._metrics(model)

    def phase_admm_shard(self, parameters, config):
        """Eq. 22: theta^q = argmin (1/N) sum_{u in shard} [Y_u^T f + rho G_u/2 ||f||^2] + rho'/2 ||theta - v||^2."""
        if len(parameters) == 2:
            self.state.put("Y", np.asarray(parameters[0]))  # the epoch's Y_i of this shard's rows
        v = np.asarray(parameters[-1], dtype=np.float64)
        Y, G = self.state.get("Y"), self.state.get("G")
        model = self._model(config)
        N, rho, rho_c = int(self.state.scalar("N")), float(self.state.scalar("rho")), float(config["rho_c"])
        X = self._rows_X(None)
        alg = self.settings.algorithm
        privacy: dict[str, Any] = {}
        if self._feature_dp():  # Eq. 22 as DP-SGD: the prox term replaces beta R, added unclipped after the noise
            trainer = self._trainer(model)
            vt = self._tensor(v)

            def prox(m: torch.nn.Module) -> torch.Tensor:
                return 0.5 * rho_c * ((torch.nn.utils.parameters_to_vector(m.parameters()) - vt) ** 2).sum()

            trainer.admm_update(
                self._tensor(X), self._tensor(G), self._tensor(Y), N, rho, 1.0, int(alg["local_epochs"]),
                float(alg["local_lr"]), int(alg["local_batch_size"]), self._sample_generator(trainer.steps),
                regularizer=prox,
            )
            self._dp_done(trainer, privacy)
        elif isinstance(model, torch.nn.Linear):
            admm_update_linear(model, X, G, np.asarray(Y, dtype=np.float64), N, rho, 0.0, prox=(v, rho_c))
        else:
            gen = self._local_generator(config)
            admm_update_local_opt(
                model, self._tensor(X), self._tensor(G), self._tensor(Y), N, rho, 0.0, int(alg["local_epochs"]),
                float(alg["local_lr"]), int(alg["local_batch_size"]), gen, prox=(self._tensor(v), rho_c),
            )
        self.state.save_model(model)
        return [self._theta(model).astype(np.float64)], privacy

    def phase_admm_consensus(self, parameters, config):
        """Eq. 20 done by the coordinator: every shard takes the consensus model w and predicts its rows."""
        (w,) = parameters
        model = self._model(config)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(self._tensor(w), model.parameters())
        self.state.save_model(model)
        return [self._predict(model, None)], self._metrics(model)


def key_kinds_of(spec: RelationalSpec, table: str, frame) -> dict[str, str]:
    """The comparison kind of each join-key column (sent so the server can check joined columns agree)."""
    return {c: key_kind(frame[c].dtype) for c in spec.key_columns(table)}
