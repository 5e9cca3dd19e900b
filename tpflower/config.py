"""The project's Hydra configuration composed outside a Hydra main (tests, benchmarks, `flwr run` apps)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def compose_config(*overrides: str, dataset: dict | None = None) -> DictConfig:
    """The run config as `python -m simulations.run OVERRIDES` sees it; ``dataset`` replaces the dataset group."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    if dataset is not None:
        with open_dict(cfg):
            cfg.dataset = OmegaConf.create(dataset)
    return cfg
