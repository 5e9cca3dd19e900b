"""Label DP of the label owner across runs (TablePuppet Sec. 4.3.1, Eq. 25; docs/algorithms.md, Label DP).

* Training labels: randomized ONCE per (table, shard, label column, the owner's label-DP setting) and the same
  draw served to every later run (:class:`~tpflower.privacy.budget.OwnerBudget`, in the owner's state_dir). The
  draw is made under the owner's floor (its level, :func:`~tpflower.owner.label_levels`: classification at
  its lambda; regression at its epsilon and its ``label_range``, else the range of its own labels), never
  under the run's range. A run asking for stronger label DP gets the stored draw randomized again under its
  own setting: post-processing of the stored draw, so every run gets its own epsilon and all runs together
  never more than the floor's.
* Evaluation: the metric released to the server is itself differentially private in the test labels: Laplace
  noise calibrated to one test label's effect on the metric (predictions and labels clipped to the owner's range,
  logits to +-LOGIT_BOUND), epsilon ``privacy.eval_epsilon`` per release, charged to the owner's
  ``privacy.total_eval_epsilon`` over all runs. Why noise and not a limit: the server chooses the predictions,
  so one exact metric can encode several test labels (crafted predictions of distinct magnitudes), and any two
  evaluations difference out one; only noise bounds what each release says about one label.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import numpy as np

from tpflower import privacy as dp
from tpflower.local_table import ShardData
from tpflower.losses import loss_np
from tpflower.owner import OwnerSettings, label_levels
from tpflower.privacy.budget import BudgetExhausted, OwnerBudget, owner_bound
from tpflower.privacy.settings import label_range
from tpflower.schema import RelationalSpec
from tpflower.state import ClientState

#: logits are clipped to [-LOGIT_BOUND, LOGIT_BOUND] for the released loss (bounds one row's loss)
LOGIT_BOUND = 10.0


class LabelSettings(typing.Protocol):
    """The client settings the label-DP services read (the client operator's ClientSettings)."""

    @property
    def spec(self) -> RelationalSpec: ...

    @property
    def table(self) -> str: ...

    @property
    def shard(self) -> int: ...

    @property
    def owner(self) -> OwnerSettings: ...


class LabelClient(typing.Protocol):
    """What the label-DP services need of the label owner's client (TableClient provides it)."""

    @property
    def state(self) -> ClientState: ...

    @property
    def data(self) -> ShardData: ...

    @property
    def settings(self) -> LabelSettings: ...

    def privacy(self) -> Mapping[str, Any]: ...


def where_of(client: LabelClient) -> str:
    return f"table {client.settings.table!r} shard {client.settings.shard}"


def budget_of(client: LabelClient) -> OwnerBudget | None:
    """This shard's budget files, when its owner keeps a state_dir (a simulated node without a run dir: none)."""
    s = client.settings
    return None if s.owner.state_dir is None else OwnerBudget(s.owner.state_dir, s.table, s.shard)


def setting(privacy: Mapping[str, Any], task: str, n_classes: int | None, y: np.ndarray) -> dict[str, Any]:
    """The label-DP setting a draw is made under: classification ``label_lambda``; regression ``label_epsilon``
    and ``label_range`` (when ``privacy`` has none: the range of the owner's labels ``y``). Either name sets
    the level (:func:`~tpflower.owner.label_levels`)."""
    lam, epsilon = label_levels(privacy)
    if task != "regression":
        return {"task": task, "n_classes": int(n_classes or 2), "label_lambda": lam}
    rng = privacy.get("label_range")
    lo, hi = (float(np.min(y)), float(np.max(y))) if rng is None else label_range("label DP", rng)
    if not lo < hi:
        hi = lo + 1.0  # constant labels: any positive width
    return {"task": task, "label_epsilon": epsilon, "label_range": [lo, hi]}


def base_setting(client: LabelClient) -> dict[str, Any]:
    """The owner's setting (its floor), or the run's when the floor has no label DP (the labels are then not
    the owner's to protect)."""
    floor, run = client.settings.owner.privacy, client.privacy()
    data, task = client.data, client.settings.spec.label.task
    return setting(floor if dp.uses_label_dp(floor) else run, task, data.n_classes, data.y)


def owner_setting(client: LabelClient, base: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the owner's label-DP setting, the label task the run declares) when the owner's floor has label DP:
    the draw is the owner's once per setting, whatever task a run declares (OwnerBudget.stored_labels). None
    when the floor has none (the draw is then the run's setting: the labels are not the owner's to protect)."""
    floor = client.settings.owner.privacy
    if not dp.uses_label_dp(floor):
        return None
    own = {k: floor.get(k) for k in ("label_lambda", "label_epsilon", "label_range")}
    setting = {"table": client.settings.table, "label": client.settings.spec.label.column, **own}
    return setting, {k: base[k] for k in ("task", "n_classes") if k in base}


def training_labels(client: LabelClient) -> np.ndarray:
    """The randomized labels of this shard's training rows (the ``keys`` reply under label DP)."""
    data, task = client.data, client.settings.spec.label.task
    base = base_setting(client)

    def draw() -> np.ndarray:  # every row of the shard, once: a later run with another split gets the same draw
        return dp.randomize_labels(data.y, task, base, dp.label_rng(), data.n_classes)

    budget = budget_of(client)
    key = {"table": client.settings.table, "label": client.settings.spec.label.column, **base}
    noisy = (
        draw()
        if budget is None
        else budget.stored_labels(key, data.y, data.row_ids, draw, where_of(client), owner_setting(client, base))
    )
    train = noisy[~data.is_test]
    run = setting(client.privacy(), task, data.n_classes, data.y)
    if run == base:
        return train
    # stronger than the floor: the run's own mechanism on the stored draw (post-processing of it)
    return dp.randomize_labels(train, task, run, dp.label_rng(), data.n_classes)


# ------------------------------------------------------------------------------------------------ evaluation


def released_metrics(
    task: str,
    H: np.ndarray,
    y: np.ndarray,
    multiplicity: int,
    label_range: tuple[float, float] | None,
    epsilon: float,
    rng: np.random.Generator,
) -> dict[str, float]:
    """The test metrics as ``epsilon``-DP releases in one test label (the Laplace mechanism).

    One label changes at most ``multiplicity`` of the n scored rows. Regression: H and y clipped to
    ``label_range`` [lo, hi], the MSE's sensitivity ``multiplicity (hi - lo)^2 / n``; rmse and loss (MSE / 2)
    are post-processing of the one noisy MSE. Classification: accuracy (sensitivity ``multiplicity / n``) and
    the mean loss of logits clipped to +-LOGIT_BOUND (one row's loss lies in [0, 2 LOGIT_BOUND + log C]), at
    epsilon / 2 each. AUC is not released (one label moves it by up to 1 / min(positives, negatives))."""
    H = np.asarray(H, dtype=np.float64)
    n = len(y)
    if task == "regression":
        lo, hi = label_range  # type: ignore[misc]
        err = np.clip(H[:, 0], lo, hi) - np.clip(np.asarray(y, dtype=np.float64), lo, hi)
        mse = float(np.mean(err**2)) + rng.laplace(0.0, multiplicity * (hi - lo) ** 2 / (n * epsilon))
        mse = max(mse, 0.0)
        return {"loss": 0.5 * mse, "rmse": float(np.sqrt(mse))}
    Hc = np.clip(H, -LOGIT_BOUND, LOGIT_BOUND)
    hits = (Hc[:, 0] > 0.0) == (y == 1) if task == "binary" else np.argmax(Hc, axis=1) == y
    width = 2 * LOGIT_BOUND + np.log(max(H.shape[1], 2))
    accuracy = float(np.mean(hits)) + rng.laplace(0.0, multiplicity / (n * epsilon / 2))
    loss = float(np.mean(loss_np(task, Hc, y))) + rng.laplace(0.0, multiplicity * width / (n * epsilon / 2))
    return {"loss": max(loss, 0.0), "accuracy": float(np.clip(accuracy, 0.0, 1.0))}


def evaluation_metrics(client: LabelClient, H: np.ndarray, rows: np.ndarray) -> dict[str, float]:
    """One released evaluation of predictions ``H`` of the test rows ``rows``: charged, then noised."""
    data, task = client.data, client.settings.spec.label.task
    floor, run = client.settings.owner.privacy, client.privacy()
    epsilon = owner_bound(floor, run, "eval_epsilon")
    charge(client, epsilon)
    base = base_setting(client)
    rng = base.get("label_range")
    multiplicity = int(np.bincount(rows).max()) if len(rows) else 1
    y = data.y[rows]
    return released_metrics(task, H, y, multiplicity, None if rng is None else tuple(rng), epsilon, dp.label_rng())


def charge(client: LabelClient, epsilon: float) -> None:
    """Charge one release to the owner's evaluation budget (its ledger; a node without a state_dir: this run)."""
    floor, run = client.settings.owner.privacy, client.privacy()
    total = owner_bound(floor, run, "total_eval_epsilon")
    budget = budget_of(client)
    if budget is not None:
        budget.charge_eval(epsilon, total, where_of(client))
        return
    after = float(client.state.scalar("eval_epsilon_spent", 0.0)) + epsilon
    if after > total * (1 + 1e-12):
        raise BudgetExhausted(
            f"{where_of(client)}: this evaluation would bring its label-DP evaluations to epsilon {after:.3g}; "
            f"its owner allows {total:.3g} (privacy.total_eval_epsilon)"
        )
    client.state.set_scalar("eval_epsilon_spent", after)
