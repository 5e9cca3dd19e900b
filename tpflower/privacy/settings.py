"""Privacy settings (TablePuppet Sec. 4.3; docs/algorithms.md, Privacy): the names, their validation before
training, the results.json summary and the flat Flower-config wire format. No torch.

Config (``conf/privacy/*.yaml``, checked by :func:`validate_privacy`): ``name`` (none | label | dpsgd |
label_dpsgd), ``epsilon`` and ``delta`` (feature DP target per client), ``clip`` (C), ``label_lambda`` or
``label_epsilon`` (label DP's level, one of the two: epsilon = 2 sqrt(2) / lambda), ``label_range``
(regression), ``sample_rate`` (worst_row | batch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tpflower.owner import label_levels, uses_feature_dp, uses_label_dp
from tpflower.params import number, one_of, positive_finite, probability
from tpflower.privacy.accounting import epsilon_floor_problem
from tpflower.schema import TASKS

PRIVACY_NAMES: tuple[str, ...] = ("none", "label", "dpsgd", "label_dpsgd")

#: Which algorithm supports which privacy is declared in its registry entry (tpflower.registry:
#: feature_dp, label_dp) and passed to :func:`validate_privacy`. Feature DP needs a client that runs DP-SGD on
#: its local model with a TABLE row as the privacy unit. VFL baselines qualify only because the client sums
#: the expanded (duplicated) rows of one table row before clipping (it expanded its table with p_i itself);
#: clipping per joined row would make the unit a joined row and the sensitivity of a table row G_max * C. The
#: same holds for VFL-ADMM: summing the expanded rows' terms of one table row gives exactly TP-Join-ADMM's
#: per-row term (Y_u, G_u) of Eq. 16. LoU (tp_ucq_*): every shard adds the FULL noise sigma C to its own
#: partial gradient (:meth:`~tpflower.privacy.trainer.DPLocalTrainer.partial_gradient`): the server sees each shard's message
#: separately, so each message alone must be the Gaussian mechanism on that shard's rows. The coordinator's
#: sum then carries sqrt(Q_i) sigma C of noise; adding it once per table step (sigma / sqrt(Q_i) per shard)
#: would need secure aggregation, which this project does not have.


def label_epsilon(lam: float) -> float:
    """epsilon of classification label DP with per-coordinate Laplace standard deviation ``lam``: ``2 sqrt(2)/lam``.

    (TablePuppet Eq. 25; docs/algorithms.md, Privacy.) ``label_epsilon(0.5) = 5.657``.
    """
    lam = positive_finite("label_lambda", lam)
    return 2.0 * math.sqrt(2.0) / lam


def validate_privacy(
    privacy_cfg: Mapping[str, Any],
    algorithm: str,
    task: str,
    *,
    feature_dp: bool,
    label_dp: bool = True,
    why_not: str = "",
    why_no_label: str = "",
) -> None:
    """Refuse, before training, privacy settings that are impossible or that ``algorithm`` cannot honour.

    Checks (ValueError naming the setting and the value): ``name`` in none | label | dpsgd | label_dpsgd;
    label DP: ``label_lambda`` or ``label_epsilon`` > 0, agreeing if both are set
    (:func:`~tpflower.owner.label_levels`), regression a finite ``label_range [lo, hi]`` with ``lo < hi``;
    feature DP: ``epsilon`` > 0 (finite), ``0 < delta < 1``,
    ``clip`` > 0, and an ``epsilon`` the RDP accountant can reach at ``delta`` with some noise
    (:func:`~tpflower.privacy.accounting.epsilon_floor_problem`). ``feature_dp`` / ``label_dp``: whether the algorithm supports them (its registry entry);
    ``why_not`` says why feature DP is not supported (shown in the error), ``why_no_label`` why label DP is not. ``privacy=none`` ignores the rest.
    """
    name = privacy_cfg.get("name", "none")
    if name not in PRIVACY_NAMES:
        raise ValueError(f"privacy.name must be one of {list(PRIVACY_NAMES)}, got {name!r}")
    if name == "none":
        return
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {list(TASKS)}")
    if uses_label_dp(privacy_cfg):
        if not label_dp:
            why = f": {why_no_label}" if why_no_label else ""
            raise ValueError(f"privacy={name}: label DP is not supported for algorithm {algorithm!r}{why}")
        if task == "regression":
            label_range(f"privacy={name} (regression labels)", privacy_cfg.get("label_range"))
        label_levels(privacy_cfg, f"privacy={name}")
    if uses_feature_dp(privacy_cfg):
        if not feature_dp:
            why = why_not or "it is not known to support DP-SGD on local models"
            raise ValueError(
                f"privacy={name}: feature DP (DP-SGD) cannot be honoured by algorithm {algorithm!r}: {why}"
            )
        epsilon = positive_finite(f"privacy={name}: privacy.epsilon", cfg_get(privacy_cfg, "epsilon"))
        delta = probability(f"privacy={name}: privacy.delta", cfg_get(privacy_cfg, "delta"))
        positive_finite(f"privacy={name}: privacy.clip (clipping norm C)", cfg_get(privacy_cfg, "clip"))
        rate = cfg_get(privacy_cfg, "sample_rate")  # else checked by TP-Join-SGD's plan, after the data loaded
        one_of("worst_row", "batch")(f"privacy={name}: privacy.sample_rate", "worst_row" if rate is None else rate)
        floor = epsilon_floor_problem(epsilon, delta)
        if floor is not None:
            raise ValueError(f"privacy={name}: {floor}")


def privacy_summary(
    privacy_cfg: Mapping[str, Any], task: str, feature_epsilon: float | None = None
) -> dict[str, float | None]:
    """The ``privacy`` entry of results.json: ``{"label_epsilon", "feature_epsilon", "delta"}`` (None if unused).

    ``feature_epsilon``: the spent epsilon to report (e.g. the max over clients of
    :meth:`DPLocalTrainer.epsilon`); defaults to the configured target.
    """
    label_eps: float | None = None
    feat_eps: float | None = None
    delta: float | None = None
    if uses_label_dp(privacy_cfg):
        lam, label_eps = label_levels(privacy_cfg)
        if task != "regression":  # the level the draw is made at: lambda's
            label_eps = label_epsilon(lam)
    if uses_feature_dp(privacy_cfg):
        feat_eps = float(feature_epsilon) if feature_epsilon is not None else cfg_number(privacy_cfg, "epsilon")
        delta = cfg_number(privacy_cfg, "delta")
    return {"label_epsilon": label_eps, "feature_epsilon": feat_eps, "delta": delta}


#: The privacy settings a client needs, as flat Flower config scalars (the keys message carries them).
_MESSAGE_FIELDS: tuple[str, ...] = ("epsilon", "delta", "clip", "label_lambda", "label_epsilon")
_MESSAGE_WORDS: tuple[str, ...] = ("sample_rate",)  # sent as strings


def privacy_message(privacy_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """``privacy_cfg`` as flat scalars for a Flower config (``{}`` for privacy=none).

    Keys ``privacy`` (the name) and ``privacy.<field>``; ``label_range`` travels as ``privacy.label_lo`` and
    ``privacy.label_hi`` (Flower config values are scalars). :func:`privacy_from_message` inverts it.
    """
    if privacy_cfg is None or str(privacy_cfg.get("name", "none")) == "none":
        return {}
    out: dict[str, Any] = {"privacy": str(privacy_cfg.get("name"))}
    if uses_label_dp(privacy_cfg):  # the label-DP level under both names (the run may have set one)
        privacy_cfg = {**privacy_cfg, **dict(zip(("label_lambda", "label_epsilon"), label_levels(privacy_cfg)))}
    for key in _MESSAGE_FIELDS:
        value = cfg_get(privacy_cfg, key)
        if value is not None:
            out[f"privacy.{key}"] = float(value)
    for key in _MESSAGE_WORDS:
        if cfg_get(privacy_cfg, key) is not None:
            out[f"privacy.{key}"] = str(cfg_get(privacy_cfg, key))
    rng = cfg_get(privacy_cfg, "label_range")
    if rng is not None:
        lo, hi = list(rng)
        out["privacy.label_lo"], out["privacy.label_hi"] = float(lo), float(hi)
    return out


def privacy_from_message(config: Mapping[str, Any]) -> dict[str, Any]:
    """The privacy settings carried by a config made with :func:`privacy_message` (``{"name": "none"}`` if none)."""
    name = config.get("privacy")
    if not name:
        return {"name": "none"}
    out: dict[str, Any] = {"name": str(name)}
    for key in _MESSAGE_FIELDS + _MESSAGE_WORDS:
        if f"privacy.{key}" in config:
            out[key] = config[f"privacy.{key}"]
    if "privacy.label_lo" in config:
        out["label_range"] = [config["privacy.label_lo"], config["privacy.label_hi"]]
    return out


def label_range(what: str, value: Any) -> tuple[float, float]:
    """``privacy.label_range`` as ``(lo, hi)``, finite with ``lo < hi``; ``what`` names the context. None (not
    set): the line names both places it is set, the dataset's top-level ``label_range`` and the override."""
    if value is None:
        raise ValueError(
            f"{what}: the label's public range [lo, hi] is not set: add label_range: [lo, hi] at the top level of "
            "the dataset config, beside label (docs/datasets.md), or give privacy.label_range=[lo,hi]"
        )
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {value!r}")
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {value!r}") from None
    if len(items) != 2:
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {value!r}")
    lo, hi = (number(f"{what}: privacy.label_range", v) for v in items)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{what}: privacy.label_range must be [lo, hi] with finite lo < hi, got {items!r}")
    return lo, hi


def cfg_get(cfg: Mapping[str, Any], key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else None


def cfg_number(cfg: Mapping[str, Any], key: str) -> float:
    return number(f"privacy.{key}", cfg_get(cfg, key))
