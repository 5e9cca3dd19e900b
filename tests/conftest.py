"""Shared test helpers: compose the project's Hydra config with overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def make_cfg(*overrides: str, dataset: dict | None = None) -> DictConfig:
    """The run config as `python -m simulations.run OVERRIDES` would see it; `dataset` replaces the dataset group."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    if dataset is not None:
        with open_dict(cfg):
            cfg.dataset = OmegaConf.create(dataset)
    return cfg


@pytest.fixture
def cfg_factory():
    return make_cfg
