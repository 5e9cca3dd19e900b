"""Shared test helpers: compose the project's Hydra config with overrides."""

from __future__ import annotations

import pytest

from tpflower.config import compose_config as make_cfg  # noqa: F401  (tests import make_cfg from here)


@pytest.fixture(autouse=True)
def no_key_secret_from_the_users_environment(monkeypatch):
    """A user's TPFLOWER_KEY_SECRET (conf/config.yaml reads it as mapping.secret) would set every simulation's
    join-key secret, in this process and in the runs it starts: the suite runs without it (a test that wants
    it sets it)."""
    monkeypatch.delenv("TPFLOWER_KEY_SECRET", raising=False)
