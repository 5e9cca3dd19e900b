"""The project's Hydra configuration: the conf/ directory, the algorithms' defaults, and composing a run config
outside a Hydra main (tests, benchmarks, `flwr run` apps).

Each algorithm's settings and their defaults are written once, in its parameter dataclass (tpflower/phases/
FAMILY.py). :func:`register_algorithm_defaults` stores them in Hydra's ConfigStore as ``algorithm/_SELECTOR``;
conf/algorithm/SELECTOR.yaml extends that node (Hydra's "extending configs") and adds only its ``name``, so
``algorithm.rho=3`` and sweeps over any setting work as if the values were written in the YAML.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from tpflower import registry
from tpflower.schema import canonical_joins

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def algorithm_defaults(entry: registry.AlgorithmEntry) -> dict[str, Any]:
    """The algorithm.* defaults of a registered algorithm, from its parameter dataclass."""
    return {f.name: f.default for f in fields(entry.params) if f.default is not MISSING}


def register_algorithm_defaults() -> None:
    """Store every registered algorithm's defaults as the Hydra config ``algorithm/_SELECTOR`` and the run's help
    (:func:`run_help`) as ``hydra/help/tpflower`` (idempotent)."""
    store = ConfigStore.instance()
    for entry in registry.entries():
        store.store(group="algorithm", name=f"_{entry.selector}", node=algorithm_defaults(entry))

    store.store(group="hydra/help", name="tpflower", node=run_help())


def run_help() -> dict[str, str]:
    """``tpflower train --help`` (Hydra's help config ``hydra/help``): the groups' options as a user selects
    them (the algorithms' ``_SELECTOR`` defaults left out), what each algorithm is, then the composed config."""
    conf = Path(CONF_DIR)
    groups = "\n".join(
        f"  {d.name}: {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}"
        for d in sorted(conf.iterdir())
        if d.is_dir()
    )
    summaries: dict[str, str] = {"auto": "the fastest that fits model, label and privacy (its second line says which)"}
    for entry in registry.entries():
        summaries.setdefault(entry.selector, entry.summary)
    algorithms = "\n".join(f"  {name:<17} {text}" for name, text in sorted(summaries.items()))
    template = f"""tpflower train: one model over the join (or the union: scenario=ucq) of the owners' tables, without building it.

Usage: tpflower train [GROUP=OPTION ...] [KEY=VALUE ...]       (the same: python -m simulations.run ...)
  tpflower train dataset=nycflights13 algorithm=gbdt
  tpflower train -m algorithm=pcg,admm model.beta=1e-4,1e-2     (a sweep: one run per combination)
Every setting: docs/settings.md; your own tables: docs/datasets.md (dataset=NAME, --config-dir DIR holding DIR/dataset/NAME.yaml).

== Groups (GROUP=OPTION) ==
{groups}

== algorithm= ==
{algorithms}

== Config (override any key: KEY=VALUE) ==
$CONFIG
Hydra's own flags: --hydra-help
"""
    return {"app_name": "tpflower train", "header": "", "footer": "", "template": template}


def compose_config(*overrides: str, dataset: dict | None = None) -> DictConfig:
    """The run config as `python -m simulations.run OVERRIDES` sees it; ``dataset`` replaces the dataset group."""
    register_algorithm_defaults()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    if dataset is not None:
        with open_dict(cfg):
            cfg.dataset = OmegaConf.create(dataset)
    canonical_joins(cfg.dataset)
    return cfg
