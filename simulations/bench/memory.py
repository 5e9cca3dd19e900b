"""The server's memory budget per algorithm family: bytes of server state per joined row and per table row.

A family's server state is every array the strategy and its training loop keep at the end of an epoch (what
an epoch's checkpoint holds and the next epoch starts from), found by walking the objects reachable from them;
an array that is a view of another array or of a message's bytes counts its base once. Two runs of the family
on the synthetic star at the same N, one with fanout 2 (few table rows per joined row) and one with fanout 1
(a fact table of N rows), separate the two terms: state = per_joined N + per_table sum_i n_i.

Adding a family is one entry of :data:`FAMILIES`: the overrides that select it and its documented budget. The
scale bench measures every family at N = 10M (docs/results.md, memory budget per family) and fails when a
measured term exceeds the documented one; tests/test_memory_budget.py does the same at N = 1M.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulations.bench.common import peak_rss_mb, scale_loader, scale_overrides


@dataclass(frozen=True)
class Family:
    """One algorithm family of the budget table: the Hydra overrides that select it (linear model, float32, no
    early stop, the algorithm's default validation part), the epochs that fill its histories, and its documented
    budget, bytes of server state per joined row and per table row."""

    overrides: tuple[str, ...]
    epochs: int
    per_joined: float
    per_table: float
    note: str = ""


#: the families that keep the model of their best validation evaluation run every epoch (their state is that of
#: a run whose validation loss keeps falling)
NO_EARLY_STOP = "algorithm.early_stopping=0"

#: boosted trees in the budget table: an evaluation (a checkpoint) every 2 trees; a larger learning rate than the
#: default's 0.1, so that 6 trees already train (the state does not depend on it)
GBDT_FAMILY = (
    "algorithm=gbdt",
    "algorithm.trees=6",
    "algorithm.eval_every=2",
    "algorithm.early_stopping=0",
    "algorithm.learning_rate=0.5",
)

#: the budget per family (bytes of server state at the end of an epoch; float32, 4 tables, d_c = 1), a little
#: above what was measured (docs/results.md): every run keeps the mapping (4 bytes per joined row and table) and
#: the labels in the run's precision; PCG its window of T_i P_j (4 tables x 4 bytes per table row each) and
#: T z, T theta (4 bytes per table row each); PCG's classic recurrence (window 0: what algorithm.window_mb leaves
#: at 100M fact rows) T z, T p and T theta; ADMM lambda and D per joined row and its subspace's pairs (8 bytes
#: per table row each). SGD and L-BFGS run with their default validation part (validation_fraction 0.1): model
#: selection keeps the best evaluation's test predictions in float64 (8 bytes per test row, 1.2 per joined row;
#: the validation rows' labels are the training labels they replace); their budgets leave less than that above
#: the measurement, so that state kept twice fails
FAMILIES: dict[str, Family] = {
    "pcg": Family(("algorithm=pcg", "algorithm.tol=0"), 5, 22.5, 74.0, "window 4, full"),
    "pcg_classic": Family(
        ("algorithm=pcg", "algorithm.tol=0", "algorithm.window=0"), 5, 22.5, 14.0, "window 0 (100M fact rows)"
    ),
    # 10 iterations: on the star's 1M rows float32's line search finds no step at the 11th (the state is the same)
    "lbfgs": Family(
        ("algorithm=lbfgs", "algorithm.tol=0", NO_EARLY_STOP), 10, 23.5, 6.0, "memory 10, validation part 0.1"
    ),
    "admm": Family(("algorithm=admm", "algorithm.tol=0"), 11, 29.5, 96.0, "subspace acceleration, memory 10, full"),
    "sgd": Family(
        ("algorithm=sgd", "algorithm.batch_size=65536", "algorithm.min_steps=0", NO_EARLY_STOP),
        2,
        23.5,
        2.0,
        "batches of 65,536 joined rows, validation part 0.1",
    ),
    # an epoch is an evaluation: the scores F of the training rows (float64), the fit rows, the evaluated rows'
    # scores and distinct table rows; the forest itself is a few kB
    "gbdt": Family(GBDT_FAMILY, 3, 37.0, 2.0, "scores F in float64, 63 leaves a tree"),
}


def _base(a: np.ndarray) -> Any:
    """The object that owns an array's memory: its last array base, or the buffer (bytes) it views."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None else a.base


def _nbytes(owner: Any) -> int:
    if isinstance(owner, np.ndarray):
        return int(owner.nbytes)
    try:
        return memoryview(owner).nbytes
    except TypeError:
        return 0


#: objects of these modules are followed when walking the server's state (not the transport, clients, Flower)
OWN_MODULES = ("strategies.", "tpflower.mapping", "tpflower.results", "tpflower.losses", "tpflower.schema")


def state_bytes(roots: dict[str, Any]) -> dict[str, int]:
    """Bytes of the arrays reachable from each root (counted once overall, under the first root that reaches
    them): containers, dataclasses and the objects of :data:`OWN_MODULES` are followed; arrays are not."""
    seen: set[int] = set()
    owners: set[int] = set()
    out: dict[str, int] = {}
    for name, root in roots.items():
        total, todo = 0, [root]
        while todo:
            obj = todo.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, np.ndarray):
                owner = _base(obj)
                if id(owner) not in owners:
                    owners.add(id(owner))
                    total += _nbytes(owner)
                continue
            if isinstance(obj, dict):
                todo += obj.values()
            elif isinstance(obj, list | tuple | set | frozenset):
                todo += obj
            elif type(obj).__module__.startswith(OWN_MODULES):
                todo += gc.get_referents(obj)
        out[name] = total
    return out


class StateProbe:
    """Stands in for a strategy's epoch checkpoints: at each epoch's end, the bytes of the server's state by
    attribute (:func:`state_bytes`), then the checkpoints it wraps."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.epochs: list[dict[str, int]] = []

    def begin(self, strategy, start):
        return self.inner.begin(strategy, start)

    def config(self, epoch: int, run_id: str) -> dict[str, Any]:
        return self.inner.config(epoch, run_id)

    def end_epoch(self, strategy, epoch: int, loop: dict[str, Any]) -> None:
        attrs = {k: v for k, v in vars(strategy).items() if k not in ("checkpoints", "transport")}
        self.epochs.append(state_bytes({"loop": loop, **attrs}))
        self.inner.end_epoch(strategy, epoch, loop)


def family_state(
    family: str, n_joined: int, fanout: int, epochs: int | None = None, overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One family's server state at the end of each epoch of an in-process run on the synthetic star of the
    scale bench at N = ``n_joined`` (``fanout`` 1: a fact table of N rows; 2: the scale schema); ``overrides``:
    more settings (the gbdt scale goal's 50 trees)."""
    from simulations.federated import run_in_process  # noqa: PLC0415
    from tpflower.app.server_app import make_strategy  # noqa: PLC0415
    from tpflower.config import compose_config  # noqa: PLC0415

    fam = FAMILIES[family]
    cfg = compose_config(
        *fam.overrides,
        *scale_overrides(n_joined, fanout),
        f"epochs={epochs or fam.epochs}",
        "runtime=inprocess",
        *overrides,
    )
    strategy = make_strategy(cfg, None, None, log=lambda _: None)
    probe = strategy.checkpoints = StateProbe(strategy.checkpoints)
    t0 = time.perf_counter()
    run_in_process(cfg, None, log=lambda _: None, strategy=strategy)
    wall = time.perf_counter() - t0
    last = probe.epochs[-1]
    tables = strategy.train.n_rows
    n_valid = 0 if strategy.valid is None else strategy.valid.N
    return {
        "family": family,
        "algorithm": strategy.algorithm,
        "n_joined": strategy.train.N + n_valid + strategy.test.N,
        "n_train": strategy.train.N,
        "n_valid": n_valid,
        "fanout": fanout,
        "n_fact": scale_loader(n_joined, fanout)["n_fact"],
        "table_rows": int(sum(tables.values())),
        "epochs": len(probe.epochs),
        "state_bytes": int(sum(last.values())),
        "by_attribute": {k: v for k, v in sorted(last.items(), key=lambda kv: -kv[1]) if v >= 1 << 16},
        "test_metric": strategy.results.history[-1].test_metric if strategy.results.history else None,
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def budget_fit(two: list[dict[str, Any]]) -> dict[str, float]:
    """Bytes per joined row and per table row from two measurements at the same N (fanout 2 and 1):
    state = per_joined N + per_table sum_i n_i."""
    (a, b) = sorted(two, key=lambda r: r["table_rows"])
    per_table = (b["state_bytes"] - a["state_bytes"]) / (b["table_rows"] - a["table_rows"])
    per_joined = (a["state_bytes"] - per_table * a["table_rows"]) / a["n_joined"]
    return {"per_joined": round(per_joined, 2), "per_table": round(per_table, 2)}


def over_budget(family: str, fit: dict[str, float]) -> list[str]:
    """What of a family's measured budget exceeds the documented one (FAMILIES), one line each."""
    doc = FAMILIES[family]
    return [
        f"{family}: {fit[k]:.1f} bytes of server state per {what} row, documented budget {limit:g}"
        for k, what, limit in (("per_joined", "joined", doc.per_joined), ("per_table", "table", doc.per_table))
        if fit[k] > limit
    ]
