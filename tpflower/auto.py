"""``algorithm=auto``: the fastest registered algorithm that fits the run's model, label and privacy settings,
chosen before anything else reads the config (docs/algorithms.md, section "auto").

- feature DP (privacy=dpsgd or label_dpsgd): ``admm`` (TP-Join/UCQ-ADMM, DP-SGD local steps; pcg and lbfgs
  exchange exact full-batch quantities and refuse it);
- linear regression: ``pcg`` (the ridge normal equations, exact in at most d iterations), over a join or a union;
- a linear model on a class label and an MLP: ``admm`` (TP-Join/UCQ-ADMM: each table's model by local L-BFGS
  steps per epoch); measured at the default epochs, full-batch L-BFGS ends at a lower accuracy wherever a categorical
  column's one-hot block makes the problem ill-conditioned, in twice the round trips, and ties elsewhere; for an
  MLP it ends well above it on a regression label (docs/results.md, What algorithm=auto picks);
- ``model=gbdt``: ``gbdt`` (boosted trees over the join or the union; refused under feature DP).

Label DP composes with all of them. :func:`resolve` replaces ``cfg.algorithm`` in place by the chosen
algorithm's settings (its defaults, then any ``+algorithm.KEY`` given with auto) and records the choice in
``cfg.algorithm_auto``, so the server, every client (which resolve the same run config the same way) and
results.json see the resolved algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict

from tpflower import registry
from tpflower.config import algorithm_defaults
from tpflower.owner import uses_feature_dp
from tpflower.schema import RelationalSpec

AUTO = "auto"


def choose(task: str, model: str, privacy: Mapping[str, Any] | None, scenario: str) -> tuple[str, str]:
    """The selector ``algorithm=auto`` resolves to, and why (module docstring); each runs over a join and a
    union alike (``scenario`` picks the registered version, :func:`resolve`)."""
    if model == "gbdt":  # first: under feature DP the privacy check refuses it in one line, naming gbdt
        return "gbdt", "boosted trees (model=gbdt)"
    if uses_feature_dp(privacy or {}):
        return "admm", "feature DP: DP-SGD local steps"
    if task == "regression" and model == "linear":
        return "pcg", "linear regression without feature DP"
    return "admm", f"{model} model, {task} label, without feature DP"


def resolve(
    cfg: Any,
    spec: RelationalSpec | None = None,
    base_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> str | None:
    """With ``algorithm=auto``: put the chosen algorithm's settings in ``cfg.algorithm`` (in place), log the
    choice and return its selector; any other algorithm: None, ``cfg`` untouched. ``spec``: the dataset's
    spec if already parsed (its label's task decides), else parsed here."""
    if str(cfg.algorithm.name) != AUTO:
        return None
    if spec is None:
        from tpflower.datasets import load_spec  # noqa: PLC0415  pandas: only when auto needs the label's task

        spec = load_spec(cfg.dataset, base_dir=base_dir)
    scenario = str(cfg.scenario.name)
    selector, why = choose(spec.label.task, str(cfg.model.kind), cfg.get("privacy"), scenario)
    entry = registry.lookup(selector, scenario)
    given = {k: v for k, v in OmegaConf.to_container(cfg.algorithm, resolve=True).items() if k != "name"}
    with open_dict(cfg):
        cfg.algorithm = OmegaConf.create({"name": selector, **algorithm_defaults(entry), **given})
        cfg.algorithm_auto = f"{selector}: {why}"
    if log is not None:
        log(f"algorithm=auto: {selector} ({why})")
    return selector
