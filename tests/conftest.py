"""Shared test helpers: compose the project's Hydra config with overrides."""

from __future__ import annotations

from tpflower.config import compose_config as make_cfg  # noqa: F401  (tests import make_cfg from here)
