"""The server's record of a trained model: RUN_DIR/model.json (docs/prediction.md).

Written at the end of a successful run after every node saved its part (tpflower/phases/predict.py,
``save_part``): the run id that names the parts on the nodes, the algorithm, the dataset and a digest of its
spec, the task, the prediction width and classes, the label transform (the standardization of a regression
label, fitted on the training labels the server held) and each table shard's part id. No owner parameter:
theta_i, the preprocessing and the data stay on the nodes. The run's config (secret redacted, as in
results.json) lets a simulated prediction rebuild the same nodes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from strategies.transport import ClientKey
from tpflower.files import atomic_write
from tpflower.losses import LabelScale
from tpflower.owner import redact

MODEL_FILE = "model.json"


def dataset_digest(cfg: Any) -> str:
    """SHA-256 of the run's dataset spec (its config, keys sorted): a prediction names a changed spec."""
    dataset = OmegaConf.to_container(cfg.dataset, resolve=True) if OmegaConf.is_config(cfg) else cfg["dataset"]
    return hashlib.sha256(json.dumps(dataset, sort_keys=True, default=str).encode()).hexdigest()


def model_record(
    cfg: Any,
    run_id: str,
    algorithm: str,
    task: str,
    d_out: int | None,
    label_scale: LabelScale,
    parts: Mapping[ClientKey, str],
) -> dict[str, Any]:
    """The content of model.json (module docstring)."""
    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return {
        "run_id": run_id,
        "algorithm": algorithm,
        "scenario": str(config["scenario"]["name"]),
        "dataset": str(config["dataset"].get("name", "")),
        "dataset_digest": dataset_digest(cfg),
        "task": task,
        "d_out": d_out,
        "classes": list(range(d_out)) if task == "multiclass" and d_out else ([0, 1] if task == "binary" else None),
        "label_transform": {"kind": "standardize", "mean": label_scale.mean, "std": label_scale.std}
        if task == "regression"
        else None,
        "parts": [{"table": t, "shard": q, "part": p} for (t, q), p in sorted(parts.items())],
        "config": redact(config),
    }


def write_model_record(record: Mapping[str, Any], run_dir: str | Path) -> Path:
    path = Path(run_dir) / MODEL_FILE
    atomic_write(path, json.dumps(record, indent=2).encode())
    path.chmod(0o644)
    return path


def read_model_record(run_dir: str | Path) -> dict[str, Any]:
    """model.json of ``run_dir``; a clear error when there is none."""
    path = Path(run_dir) / MODEL_FILE
    if not path.is_file():
        raise ValueError(
            f"{run_dir}: no {MODEL_FILE} (a run writes it when it ends and its algorithm trains a predictor)"
        )
    return json.loads(path.read_text())


def label_scale_of(record: Mapping[str, Any]) -> LabelScale:
    transform = record.get("label_transform") or {}
    return LabelScale(float(transform.get("mean", 0.0)), float(transform.get("std", 1.0)))
