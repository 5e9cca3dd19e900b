"""The client operator: a Flower NumPyClient that holds one table (or shard) and its local model f_i, with
the services every algorithm's phases use (data, model, predictions; feature DP in tpflower.local_dp; state in
tpflower.state).

The ClientApp hands every message to :meth:`TableClient.handle` (or the NumPyClient entry :meth:`fit`), which
dispatches ``config["phase"]`` through the protocol guard (tpflower.guard) of the algorithm the client was
built for (the registry's entry; the phases live in tpflower/phases/: setup.py for the setup phases every
algorithm shares, one module per algorithm family beside it); a phase outside that protocol, or out of its
order, is refused, naming the phase. Arrays travel by name, small scalars in the config. What a client sends
is row ids, keyed digests of join keys, model predictions and (the label owner) labels: never raw features or
raw keys.

Privacy (tpflower.privacy; TablePuppet Sec. 4.3; docs/algorithms.md, Privacy). The run's settings come with
the server's keys message; the client accepts them only if they are at least its owner's floor (tpflower.owner)
and keeps them in ``context.state``. Label DP: the label owner randomizes its training labels once, in ``keys``, and never
sends test labels. Feature DP: :class:`~tpflower.local_dp.LocalDP`. All noise comes from the OS entropy.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import RecordDict

from tpflower import checkpoint, selection
from tpflower import privacy as dp
from tpflower.blind import node_scalar
from tpflower.fedprep import GlobalRule, apply_rule
from tpflower.guard import Protocol, ProtocolRefusal
from tpflower.local_dp import LocalDP
from tpflower.local_table import LocalTable, ShardData
from tpflower.models import l2_penalty, torch_dtype
from tpflower.owner import OwnerSettings
from tpflower.records import Arrays
from tpflower.relation import build_local_model
from tpflower.releases import charge_exact_release
from tpflower.schema import RelationalSpec, key_kind
from tpflower.state import ClientState


def choose_device(num_gpus: float) -> torch.device:
    """Where a client computes: CUDA only when its resources give it a GPU share (``resources.num_gpus`` > 0)
    and one is visible; else the CPU (a GPU that is merely visible is not this client's to use)."""
    return torch.device("cuda" if float(num_gpus) > 0 and torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class ClientSettings:
    """What a client holds for one run: its own settings (``owner``: data, exposed columns, privacy floor,
    secret; never the server's word) and the run's model and hyperparameters."""

    spec: RelationalSpec
    table: str
    shard: int
    region: str
    model: Mapping[str, Any]
    algorithm: Any  # the algorithm's typed settings (tpflower.params.AlgorithmParams)
    seed: int
    precision: str
    owner: OwnerSettings
    key_kinds: Mapping[str, str]
    federated_prep: bool = False  # union scenario, table with several shards: preprocessing by global rule
    config_key: str = ""  # the run's config (without resume settings): part of the name of its checkpoints
    num_gpus: float = 0.0  # conf/resources num_gpus: this virtual client's GPU share (0: it computes on the CPU)

    @property
    def secret(self) -> bytes:
        return self.owner.secret

    @property
    def min_sketch_rows(self) -> int:
        return self.owner.min_sketch_rows

    @property
    def min_group_rows(self) -> int:
        return self.owner.min_group_rows


class TableClient(NumPyClient):
    """One table's (or shard's) client operator, answering the phases of one algorithm."""

    def __init__(
        self,
        data: ShardData,
        settings: ClientSettings,
        state: RecordDict,
        protocol: Protocol,
        algorithm: str = "",
        release_family: str = "",
    ):
        self.data = data
        self.release_family = release_family  # the ledger's family of its exact releases (tpflower.releases)
        self.settings = settings
        self.state = ClientState(state)
        self.protocol = protocol
        self.algorithm = algorithm
        self.dtype = torch_dtype(settings.precision)
        self.device = choose_device(settings.num_gpus)

    # ---------------------------------------------------------------------------------------- Flower API

    def handle(self, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
        """Answer one message: ``config["phase"]`` names the phase, ``arrays`` its named arrays. The protocol
        guard (tpflower.guard) refuses a phase outside the algorithm's protocol, or an array the phase does not
        accept at its position, before anything is computed; a reply the phase declares an exact release is
        charged to the owner's ledger first (tpflower.releases).
        ``resume`` (a fresh client taking its checkpointed state) and checkpoints: tpflower.checkpoint; the model
        kept at the best validation evaluation (``snapshot``, ``keep``): tpflower.selection."""
        phase = str(config.get("phase"))
        if phase == "resume":
            return checkpoint.resume(self, config)
        declared = self.protocol.admit(self, phase, arrays)
        if config.get("run_id") and self.state.scalar("run_id") is None:
            self.state.set_scalar("run_id", str(config["run_id"]))
        exact = declared.exact and not (declared.dp_noised and self.dp.on)
        if exact:
            charge_exact_release(self, phase, dry_run=True)  # at the cap already: refused before computing
        selection.before_message(self, config)
        out = declared.handler(self, arrays, config)
        if exact:
            charge_exact_release(self, phase)  # a refused phase releases nothing and is not charged
        self.protocol.replied(self, phase)
        selection.after_message(self, config)
        checkpoint.after_message(self, config)
        return out

    @property
    def config_key(self) -> str:
        return self.settings.config_key

    def fit(self, parameters: list[np.ndarray], config: Mapping[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        """NumPyClient's entry: ``parameters`` are the message's arrays in the order ``config["arrays"]`` names
        them (comma-separated); the reply's arrays come back in the order its metrics' ``arrays`` names."""
        names = [n for n in str(config.get("arrays", "")).split(",") if n]
        if len(names) != len(parameters):
            raise ValueError(f"fit: {len(parameters)} arrays but config['arrays'] names {len(names)}")
        out, metrics = self.handle(dict(zip(names, parameters)), config)
        return list(out.values()), len(self.data.row_ids), {**metrics, "arrays": ",".join(out)}

    # ---------------------------------------------------------------------------------------- helpers

    @property
    def local(self) -> LocalTable:
        """The preprocessed table: own fit, or (union, several shards) the global rule received in `rule`."""
        if not self.settings.federated_prep:
            return self.data.table()
        rule_id = self.state.scalar("rule_id")
        if rule_id is None:
            raise RuntimeError(
                f"table {self.settings.table!r} shard {self.settings.shard}: no preprocessing rule received"
            )
        t = self.settings.spec.table(self.settings.table)

        def build() -> tuple[Any, dict[str, np.ndarray]]:  # once per rule id: the rule's arrays are read here only
            rule = self.state.get_list("rule") or []
            n_edges = len(t.binned)  # the rule message ends with the bin edges of the binned columns
            rule_arrays, edge_arrays = rule[: len(rule) - n_edges], rule[len(rule) - n_edges :]
            return (
                apply_rule(
                    GlobalRule.from_arrays(rule_arrays, t.numeric, t.categorical),
                    self.data.rows,
                    self.settings.secret,
                    self.settings.table,
                ),
                {c: np.asarray(e, dtype=np.float64) for (c, _), e in zip(t.binned, edge_arrays)},
            )

        return self.data.table(str(rule_id), build)

    def model(self, config: Mapping[str, Any]) -> torch.nn.Module:
        """f_i with the stored theta, built identically to the centralized model's part on first use.

        The module is built once per node and width and reused (building one costs milliseconds, a round of
        SGD little more); theta always comes from context.state, and without a stored theta (the run's first
        message) the module is built afresh from the seed."""
        d_out = self.output_width(config)
        s, key = self.settings, (self.local.width, d_out)
        model = self.data.models.get(key)
        if model is None or not self.state.load_model(model):
            model = build_local_model(
                s.model, s.spec, s.table, self.local.width, d_out, s.seed, self.dtype, self.init_key()
            )
            self.state.load_model(model)
            self.data.models[key] = model
        return model.to(self.device)

    def init_key(self) -> tuple[bytes, str] | None:
        """(secret, nonce) of a deployed node's theta_i^0 (tpflower.models.init_seed): its owner's secret, or
        without one (blinded keys) its blinding scalar, and the run id. Never sent: the server cannot rebuild the
        initial model, so h = f_i(theta_i^0; X) does not give X away (docs/threat-model.md). None in a
        simulation (the user plays every party; theta_i^0 from the run seed, as the centralized baseline's)."""
        owner = self.settings.owner
        if not owner.deployed:
            return None
        secret = owner.secret
        if not secret and owner.state_dir is not None:
            secret = node_scalar(owner.state_dir)
        return secret, str(self.state.scalar("run_id") or "")

    def output_width(self, config: Mapping[str, Any]) -> int:
        """d_c, fixed by the first training message: a server that widens it later (to read more outputs per
        row from one message) is refused; a regression label has one output."""
        stored, asked = self.state.scalar("d_out"), config.get("d_out")
        if stored is not None:
            if asked is not None and int(asked) != int(stored):
                raise ProtocolRefusal(
                    f"table {self.settings.table!r}: d_out {asked} after {stored}: the output width is fixed"
                )
            return int(stored)
        d_out = int(asked or 0)
        if d_out < 1 or (self.settings.spec.label.task == "regression" and d_out != 1):
            raise ProtocolRefusal(
                f"table {self.settings.table!r}: d_out {asked} for a {self.settings.spec.label.task} label"
            )
        bound = self.settings.owner.max_outputs
        if bound is not None and d_out > bound:
            raise ProtocolRefusal(
                f"table {self.settings.table!r}: the run asks for {d_out} outputs per row; this node's owner "
                f"allows at most {bound} (max_outputs in its settings)"
            )
        self.state.set_scalar("d_out", d_out)
        return d_out

    def rows_X(self, rows: np.ndarray | None) -> np.ndarray:
        """Features of the client's rows ``rows`` (all when None); under VFL these are joined rows."""
        expand = self.state.get("expand")
        if expand is not None:
            rows = expand if rows is None else expand[rows]
        return self.local.X if rows is None else self.local.X[rows]

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a tensor of the run's dtype on the client's device (no copy where torch can share it;
        a message's arrays are read-only views of its bytes, which torch only reads)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.as_tensor(array, dtype=self.dtype, device=self.device)

    @staticmethod
    def theta(model: torch.nn.Module) -> np.ndarray:
        """The model's parameters as one flat vector (the consensus ADMM's unit of exchange)."""
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()

    def local_generator(self, config: Mapping[str, Any]) -> torch.Generator:
        """Row order of a non-DP local optimisation (MLP theta-update): seeded by the run seed and the epoch."""
        return torch.Generator().manual_seed(int(self.settings.seed) * 7919 + int(config.get("epoch", 0)))

    def predict(self, model: torch.nn.Module, rows: np.ndarray | None) -> np.ndarray:
        with torch.no_grad():
            return model(self.tensor(self.rows_X(rows))).cpu().numpy()

    def reg_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        with torch.no_grad():
            return {"R": float(l2_penalty(model))}  # R_i(theta_i), for the server's objective

    # ---------------------------------------------------------------------------------------- privacy

    def privacy(self) -> Mapping[str, Any]:
        """The run's privacy settings, accepted in ``keys`` against the owner's floor (kept in state)."""
        rec = self.state.records.get("privacy")
        if rec is None:
            raise ProtocolRefusal(f"table {self.settings.table!r}: no privacy settings accepted yet (keys first)")
        return dp.privacy_from_message(dict(rec))

    @property
    def dp(self) -> LocalDP:
        """Feature DP services of this client (tpflower.local_dp)."""
        return LocalDP(self)


def key_kinds_of(spec: RelationalSpec, table: str, frame) -> dict[str, str]:
    """The comparison kind of each join-key column (sent so the server can check joined columns agree)."""
    return {c: key_kind(frame[c].dtype) for c in spec.key_columns(table)}
