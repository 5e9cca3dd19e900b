"""tpflower: relational federated learning on Flower (README.md). The Python API (docs/python-api.md)::

    import tpflower
    model = tpflower.fit(dataset="movielens", algorithm="admm", epochs=3)
    model.metrics, model.history            # {'rmse': ...}, a DataFrame of the epochs
    model.predict(new_ratings)              # a DataFrame of predictions
    tpflower.load(model.run_dir)            # the same model, later

``fit``, ``load`` and ``Model`` run the server side of a run (strategies/, simulations/api.py): they are
imported on first use, by name, so that importing tpflower (as a table owner's node does) loads no server code,
the rule tpflower.registry follows for the strategies.
"""

from __future__ import annotations

import importlib
from typing import Any

from tpflower.errors import TpflowerError

API_MODULE = "simulations.api"  # the server-side entry points: above tpflower in the layering
__all__ = ["Model", "TpflowerError", "fit", "load"]


def __getattr__(name: str) -> Any:
    if name in ("fit", "load", "Model"):
        return getattr(importlib.import_module(API_MODULE), name)
    raise AttributeError(f"module 'tpflower' has no attribute {name!r}")
