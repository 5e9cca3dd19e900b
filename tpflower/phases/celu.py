"""TP-Join-SGD and VFL-SGD with CELU-VFL cached local updates, client side (CELU-VFL Alg. 1-2;
docs/algorithms.md, CELU-VFL local updates; :class:`Workset` holds the cached batches).

  predict   {rows}                 -> {h}            as TP-Join-SGD; the reference of the rows is kept
  sgd_step  {Y, rows, (eval_rows)} -> {h, (h_eval)}  the exchange step (Eq. 12-13), the batch cached, up to R
                                                     local steps on cached batches, then predict the next rows
                                                     (pipelining: one round trip per exchanged batch)

The reference is what the weights compare: ``similarity=output`` the predictions the client sent (with
d_c = 1 the cosine is +-1: only rows whose prediction changed sign are dropped), ``hidden`` the MLP's last
hidden activation (kept here, never sent).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpflower.client import TableClient
from tpflower.guard import Phase, Stage, takes
from tpflower.models import l2_penalty
from tpflower.params import degrees, nonnegative_int, one_of, or_word, param, positive, positive_int
from tpflower.phases import setup
from tpflower.phases.join_sgd import SGDParams, SGDState, local_sgd_step, predict_rows
from tpflower.records import Arrays
from tpflower.registry import AlgorithmEntry, register
from tpflower.state import StateRecord


@dataclass(frozen=True)
class CELUParams(SGDParams):
    """TP-Join-SGD / VFL-SGD with CELU-VFL local updates (conf/algorithm/celu.yaml, vfl_celu.yaml).
    FedBCD: W=1, xi=null; vanilla: R=0."""

    lr: float = param(positive, 0.2)  # the exchange step's rate: TP-Join-SGD's (the paper: vanilla's, unchanged)
    W: int = param(positive_int, 5)  # workset size (batches cached)
    R: int = param(nonnegative_int, 5)  # uses per cached batch (local steps per round at most R)
    xi: float | None = param(or_word(degrees, None), 60.0)  # staleness threshold in degrees; None: no weighting
    similarity: str = param(one_of("output", "hidden"), "output")
    local_lr: float | None = param(or_word(positive, None), 0.05)  # the local steps' rate (None: lr)


@dataclass
class Workset(StateRecord):
    """The entries, concatenated: ``rows``/``ref``/``Y`` hold every entry's rows in entry order (``sizes``
    rows each); per entry ``batch`` (|B|), ``uses`` and ``picked`` (the local step of its last use, -1: never);
    ``step`` counts the local steps taken."""

    rows: np.ndarray | None = None
    ref: np.ndarray | None = None
    Y: np.ndarray | None = None
    sizes: np.ndarray | None = None
    batch: np.ndarray | None = None
    uses: np.ndarray | None = None
    picked: np.ndarray | None = None
    step: int = 0

    @classmethod
    def empty(cls, d_ref: int, d_c: int) -> Workset:
        ints = np.zeros(0, dtype=np.int64)
        return cls(ints, np.zeros((0, d_ref)), np.zeros((0, d_c)), ints, ints, ints, ints, 0)

    def __len__(self) -> int:
        return 0 if self.sizes is None else len(self.sizes)

    def _offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)])

    def entry(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(rows, ref, Y, |B|) of entry ``k``."""
        o = self._offsets()
        s = slice(o[k], o[k + 1])
        return self.rows[s], self.ref[s], self.Y[s], int(self.batch[k])

    def _keep(self, keep: np.ndarray) -> None:
        """Keep the entries where ``keep`` is True (rows vectorised: one mask over the concatenation)."""
        row_mask = np.repeat(keep, self.sizes)
        self.rows, self.ref, self.Y = self.rows[row_mask], self.ref[row_mask], self.Y[row_mask]
        self.sizes, self.batch, self.uses, self.picked = (
            a[keep] for a in (self.sizes, self.batch, self.uses, self.picked)
        )

    def insert(self, rows: np.ndarray, ref: np.ndarray, Y: np.ndarray, batch: int, W: int) -> None:
        """Alg. 1: cache the exchanged batch; keep the W newest entries."""
        self.rows = np.concatenate([self.rows, np.asarray(rows, dtype=np.int64)])
        self.ref = np.concatenate([self.ref, np.asarray(ref, dtype=np.float64).reshape(len(rows), -1)])
        self.Y = np.concatenate([self.Y, np.asarray(Y, dtype=np.float64).reshape(len(rows), -1)])
        self.sizes = np.append(self.sizes, len(rows))
        self.batch, self.uses, self.picked = (
            np.append(self.batch, batch),
            np.append(self.uses, 0),
            np.append(self.picked, -1),
        )
        if len(self) > W:
            keep = np.zeros(len(self), dtype=bool)
            keep[-W:] = True
            self._keep(keep)

    def pick(self, W: int, R: int) -> int | None:
        """Alg. 2, round robin: among entries used fewer than R times and not picked in the last W - 1 local
        steps, the least recently picked (never picked first; ties: the oldest). None: a bubble, stop."""
        if len(self) == 0:
            return None
        fresh = (self.uses < R) & ((self.picked < 0) | (self.picked < self.step - (W - 1)))
        if not fresh.any():
            return None
        candidates = np.flatnonzero(fresh)
        return int(candidates[np.argmin(self.picked[candidates])])  # argmin takes the first (oldest) on ties

    def used(self, k: int, R: int) -> None:
        """Count one local step on entry ``k``; drop it once used R times."""
        self.uses[k] += 1
        self.picked[k] = self.step
        self.step += 1
        if self.uses[k] >= R:
            keep = np.ones(len(self), dtype=bool)
            keep[k] = False
            self._keep(keep)


def staleness_weights(fresh: np.ndarray, cached: np.ndarray, xi: float | None) -> np.ndarray:
    """w_u = cos(fresh_u, cached_u) if it is >= cos(xi) else 0 (xi in degrees; None: all ones). Norms are
    floored at 1e-12; the weight is a constant of the local step (no gradient flows through it)."""
    if xi is None:
        return np.ones(len(fresh))
    a, b = (
        np.asarray(fresh, dtype=np.float64).reshape(len(fresh), -1),
        np.asarray(cached, dtype=np.float64).reshape(len(fresh), -1),
    )
    cos = (a * b).sum(axis=1) / (
        np.maximum(np.linalg.norm(a, axis=1), 1e-12) * np.maximum(np.linalg.norm(b, axis=1), 1e-12)
    )
    return np.where(cos >= math.cos(math.radians(xi)), cos, 0.0)


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


def weighted_local_step(
    client: TableClient,
    model: torch.nn.Module,
    rows: np.ndarray,
    cached: np.ndarray,
    Y: np.ndarray,
    batch: int,
    lr: float,
) -> None:
    """One local step on a cached batch (Alg. 2): theta -= lr * grad of
    (1/|B|) sum_u w_u <Y_u, f(theta; x_u)> + beta R(theta), w_u the staleness weight of the fresh reference
    (taken from the same forward pass) against the cached one; plain SGD, as the exchange step (Eq. 12-13)."""
    alg, beta = client.settings.algorithm, float(client.settings.model["beta"])
    X = client.tensor(client.rows_X(rows))
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # stateless: the exchange step's optimiser
    opt.zero_grad()
    if alg.similarity == "hidden":  # model = Sequential(Linear, ReLU, ..., Linear)
        fresh = model[:-1](X)
        out = model[-1](fresh)
    else:
        out = fresh = model(X)
    w = staleness_weights(fresh.detach().cpu().numpy(), cached, alg.xi)  # a constant: no gradient through it
    loss = (client.tensor(w[:, None] * Y) * out).sum() / batch + beta * l2_penalty(model)
    loss.backward()
    opt.step()


def local_steps(client: TableClient, model: torch.nn.Module, workset: Workset) -> int:
    """Alg. 2: up to R steps on cached batches (round robin, staleness-weighted); returns how many ran."""
    alg = client.settings.algorithm
    lr = alg.lr if alg.local_lr is None else alg.local_lr
    taken = 0
    for _ in range(alg.R):
        k = workset.pick(alg.W, alg.R)
        if k is None:  # a bubble: no entry may be used now
            break
        rows, cached, Y, batch = workset.entry(k)
        weighted_local_step(client, model, rows, cached, Y, batch, lr)
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


START = Stage("start", {"predict": Phase(predict, inputs=takes("rows", "eval_rows"), exact=True, dp_noised=True)})
TRAIN: dict[str, Phase] = {
    "sgd_step": Phase(sgd_step, inputs=takes("Y", "rows", "eval_rows"), exact=True, dp_noised=True)
}


WHY_NO_FEATURE_DP = (
    "a cached batch is replayed up to R more times, which breaks the subsampling the DP "
    "accountant assumes; run algorithm=sgd"
)

register(
    AlgorithmEntry(
        "tp_join_celu",
        "celu",
        "join",
        "celu",
        "TPJoinCELU",
        setup.loj_protocol(START, TRAIN),
        CELUParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="TP-Join-SGD with CELU-VFL cached local updates",
    )
)
register(
    AlgorithmEntry(
        "vfl_celu",
        "vfl_celu",
        "join",
        "celu",
        "VFLCELU",
        setup.loj_protocol(START, TRAIN, vfl=True),
        CELUParams,
        feature_dp=False,
        why_no_feature_dp=WHY_NO_FEATURE_DP,
        summary="CELU-VFL on the expanded join (the paper's setting)",
    )
)
