"""A node's saved part of a trained model (docs/prediction.md): what it needs to compute f_i(theta_i; x) of
new rows after the run, and nothing of anyone else's.

One file per run and table shard, ``STATE_DIR/models/<run_id>/<table>-<shard>.npz`` under the owner's
state_dir (a simulation: RUN_DIR/node-state), written atomically, mode 0600 in a 0700 directory. It holds the
trained parameters theta_i (torch state dict), the fitted preprocessing (imputation medians, means, stds,
one-hot categories, bin edges) and the model spec (kind, width, outputs, precision); read back with
``allow_pickle=False``. Its part id is the SHA-256 of the file (first 16 hex digits): the server's model
record lists the ids, so a prediction notices a part that was replaced. Deleting the file withdraws the part.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from tpflower.fedprep import bin_transform, name_placeholders
from tpflower.files import atomic_write
from tpflower.models import torch_dtype
from tpflower.preprocess import TablePreprocessor
from tpflower.relation import build_local_model
from tpflower.schema import RelationalSpec
from tpflower.trees import importance

MODELS_DIR = "models"


def part_path(state_dir: str | Path, run_id: str, table: str, shard: int) -> Path:
    """Where the part of (table, shard) of run ``run_id`` lives under ``state_dir``."""
    if not run_id or not all(c in "0123456789abcdef" for c in run_id):
        raise ValueError(f"table {table!r}: run id {run_id!r} is not a run id (hex digits)")
    return Path(state_dir) / MODELS_DIR / run_id / f"{table}-{int(shard)}.npz"


@dataclass
class ModelPart:
    """One table shard's part of a trained model (module docstring)."""

    run_id: str
    algorithm: str
    table: str
    shard: int
    model: Mapping[str, Any]  # the run's model config (kind, hidden, bias, init, beta)
    width: int  # d_i: the preprocessed feature width
    d_out: int  # outputs per row
    precision: str
    seed: int
    preprocessing: dict[str, Any]  # TablePreprocessor.stats() (numeric and categorical columns)
    numeric: tuple[str, ...]
    categorical: tuple[str, ...]
    bin_edges: dict[str, np.ndarray] = field(default_factory=dict)
    theta: dict[str, np.ndarray] = field(default_factory=dict)
    centres: np.ndarray | None = None  # k-means: the table's local centres (k x d_i) instead of theta
    # boosted trees: the table's splits (split id, feature) in id order, "x_feature <= threshold" (preprocessed
    # units, as features() gives them) and the same threshold in the column's raw units (numeric columns)
    splits: np.ndarray | None = None
    thresholds: np.ndarray | None = None
    raw_thresholds: np.ndarray | None = None
    # native categorical splits (threshold NaN): per category going left, (split id, its one-hot column) and its
    # raw value; a row goes left when its category is one of its split's (an unseen category goes right)
    category_splits: np.ndarray | None = None
    category_values: np.ndarray | None = None
    # the gain of each split (Chen & Guestrin Eq. 7), as the owner answered it: the table's own importance
    split_gains: np.ndarray | None = None
    # per split, whether a row missing the split's numeric value goes left (else right); None (a part saved
    # before trees kept missing values): missing values are filled with the median, as preprocessing does
    missing_left: np.ndarray | None = None
    # per feature, whether training gave it a bin of missing values; a missing value of a feature without one
    # (no training row missed it) is the median preprocessing fills in. None (saved before): every numeric one
    missing_bins: np.ndarray | None = None

    # ------------------------------------------------------------------------------------------ storage

    def save(self, state_dir: str | Path) -> str:
        """Write the part (0600) and return its part id."""
        path = part_path(state_dir, self.run_id, self.table, self.shard)
        for d in (Path(state_dir), path.parent.parent, path.parent):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        meta = {
            "run_id": self.run_id,
            "algorithm": self.algorithm,
            "table": self.table,
            "shard": self.shard,
            "model": dict(self.model),
            "width": self.width,
            "d_out": self.d_out,
            "precision": self.precision,
            "seed": self.seed,
            "preprocessing": {k: dict(v) for k, v in self.preprocessing.items()},
            "numeric": list(self.numeric),
            "categorical": list(self.categorical),
            "bins": list(self.bin_edges),
            "theta": list(self.theta),
            "centres": self.centres is not None,
            "splits": self.splits is not None,
        }
        arrays = {"meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)}
        arrays.update({f"theta.{k}": np.asarray(v) for k, v in self.theta.items()})
        arrays.update({f"edges.{k}": np.asarray(v, dtype=np.float64) for k, v in self.bin_edges.items()})
        if self.centres is not None:
            arrays["centres"] = np.asarray(self.centres, dtype=np.float64)
        if self.splits is not None:
            arrays["splits"] = np.asarray(self.splits, dtype=np.int64)
            arrays["thresholds"] = np.asarray(self.thresholds, dtype=np.float64)
            arrays["raw_thresholds"] = np.asarray(self.raw_thresholds, dtype=np.float64)
            if self.split_gains is not None:
                arrays["split_gains"] = np.asarray(self.split_gains, dtype=np.float64)
            if self.missing_left is not None:
                arrays["missing_left"] = np.asarray(self.missing_left, dtype=bool)
            if self.missing_bins is not None:
                arrays["missing_bins"] = np.asarray(self.missing_bins, dtype=bool)
        if self.category_splits is not None:
            arrays["category_splits"] = np.asarray(self.category_splits, dtype=np.int64)
            arrays["category_values"] = np.asarray(self.category_values, dtype=str)
        atomic_write(path, lambda f: np.savez(f, **arrays))  # mkstemp: the file is 0600
        os.chmod(path, 0o600)
        return part_id(path)

    @classmethod
    def load(cls, state_dir: str | Path, run_id: str, table: str, shard: int) -> ModelPart | None:
        """The saved part, or None when there is none (never trained here, or deleted by its owner)."""
        path = part_path(state_dir, run_id, table, shard)
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            theta = {k: z[f"theta.{k}"] for k in meta["theta"]}
            edges = {k: z[f"edges.{k}"] for k in meta["bins"]}
            centres = z["centres"] if meta.get("centres") else None
            trees = {k: z[k] for k in ("splits", "thresholds", "raw_thresholds")} if meta.get("splits") else {}
            trees.update(
                {
                    k: z[k]
                    for k in ("category_splits", "category_values", "split_gains", "missing_left", "missing_bins")
                    if k in z.files
                }
            )
        return cls(
            run_id=meta["run_id"],
            algorithm=meta["algorithm"],
            table=meta["table"],
            shard=int(meta["shard"]),
            model=meta["model"],
            width=int(meta["width"]),
            d_out=int(meta["d_out"]),
            precision=meta["precision"],
            seed=int(meta["seed"]),
            preprocessing=meta["preprocessing"],
            numeric=tuple(meta["numeric"]),
            categorical=tuple(meta["categorical"]),
            bin_edges=edges,
            theta=theta,
            centres=centres,
            **trees,
        )

    # ------------------------------------------------------------------------------------------ use

    @property
    def columns(self) -> tuple[str, ...]:
        """The feature columns the part was trained on (numeric, categorical, binned)."""
        return self.numeric + self.categorical + tuple(c for c in self.bin_edges if c not in self.numeric)

    def naming(self, frame: pd.DataFrame, secret: bytes) -> ModelPart:
        """This part with the categories it knows by their digests only (a shard of a union whose rows never held
        them: tpflower.fedprep.name_placeholders) named by the values of ``frame`` that digest to them, so a new
        row of such a category gets the feature training gave it on the shards that held it."""
        categories = self.preprocessing.get("categories")
        if not categories:
            return self
        named = name_placeholders(categories, frame, secret)
        return replace(self, preprocessing={**self.preprocessing, "categories": named})

    def median_filled(self, frame: pd.DataFrame) -> dict[str, tuple[int, int, float]]:
        """Boosted trees: per numeric column of ``frame`` no training row missed (no bin of missing values,
        ``missing_bins``), the rows missing it: (count, first row, the training median that scores them, as
        :meth:`features` fills it). Empty for other models (they fill every missing value with the median, as in
        training) and for a column training had missing values in (its trees route them)."""
        if self.missing_bins is None:
            return {}
        medians = self.preprocessing.get("medians") or {}
        out = {}
        for c, has_bin in zip(self.numeric, self.missing_bins[: len(self.numeric)].tolist()):
            if has_bin or c not in frame.columns:
                continue
            missing = frame[c].isna().to_numpy(dtype=bool)
            if missing.any():
                out[c] = (int(missing.sum()), int(np.flatnonzero(missing)[0]), float(medians.get(c, np.nan)))
        return out

    def features(self, frame: pd.DataFrame) -> np.ndarray:
        """The preprocessed features of ``frame``'s rows with the fitted preprocessing of training (the same
        transform as training's, row by row), in the run's precision."""
        pre = TablePreprocessor.from_stats(self.numeric, self.categorical, table=self.table, **self.preprocessing)
        X = pre.transform(frame)
        if self.missing_left is not None:  # boosted trees route a missing value by its split's side for them
            kept = pre.with_missing(X, frame)
            if self.missing_bins is not None and kept is not X:  # the median where training had no missing bin
                filled = ~self.missing_bins[: len(self.numeric)]
                kept[:, : len(self.numeric)][:, filled] = X[:, : len(self.numeric)][:, filled]
            X = kept
        if self.bin_edges:
            X = np.concatenate([X, bin_transform(frame, self.bin_edges, table=self.table)], axis=1)
        if X.shape[1] != self.width:
            raise ValueError(
                f"table {self.table!r}: the saved preprocessing gives {X.shape[1]} features, not {self.width}"
            )
        return X.astype(np.float32 if self.precision == "float32" else np.float64, copy=False)

    def module(self, spec: RelationalSpec) -> torch.nn.Module:
        """f_i with the saved theta_i."""
        dtype = torch_dtype(self.precision)
        model = build_local_model(self.model, spec, self.table, self.width, self.d_out, self.seed, dtype)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in self.theta.items()})
        return model

    def predict(self, spec: RelationalSpec, X: np.ndarray) -> np.ndarray:
        """f_i(theta_i; X), float64."""
        model = self.module(spec)
        with torch.no_grad():
            return model(torch.as_tensor(X, dtype=torch_dtype(self.precision))).numpy().astype(np.float64)

    def cluster_labels(self, X: np.ndarray) -> np.ndarray:
        """k-means: each row's nearest local centre, computed as the run's Lloyd steps compute it
        (tpflower.clustering: ||c||^2 - 2 x.c, the same argmin and ties)."""
        assert self.centres is not None
        X, C = np.asarray(X, dtype=np.float64), self.centres
        return ((C * C).sum(1)[None, :] - 2.0 * np.einsum("ij,kj->ik", X, C)).argmin(1)

    def feature_columns(self) -> list[str]:
        """The column of the table behind each preprocessed feature (a categorical or binned column's one-hot
        block: that column for each of its features)."""
        categories = self.preprocessing.get("categories") or {}
        out = list(self.numeric) + [c for c in self.categorical for _ in categories.get(c, ())]
        return out + [c for c, e in self.bin_edges.items() for _ in range(len(e) + 1)]

    def importance(self) -> dict[str, dict[str, float]]:
        """Boosted trees: per column of the table, the number of the model's splits on it, the sum of their
        gains and its share of this table's (tpflower.trees.importance), largest first: the owner's own view
        (the server sees which table won each split and its gain: results.json's ``importance``)."""
        if self.splits is None or self.split_gains is None:
            what = "not a part of boosted trees" if self.splits is None else "saved without its splits' gains"
            raise ValueError(f"table {self.table!r} shard {self.shard}: the part of run {self.run_id} is {what}")
        names = self.feature_columns()
        return importance((names[f], gain) for f, gain in zip(self.splits[:, 1].tolist(), self.split_gains.tolist()))

    def split_sides(self, X: np.ndarray) -> np.ndarray:
        """Boosted trees: the side of each row at each of the part's splits (rows x splits, True: left), as
        training decided it (a training row's bin <= b iff its value <= the bin's edge)."""
        assert self.splits is not None and self.thresholds is not None
        X = np.asarray(X, dtype=np.float64)
        values = X[:, self.splits[:, 1]]
        sides = values <= self.thresholds[None, :]  # NaN (a category split, a missing value): False
        if self.missing_left is not None:  # a missing value goes where its split sends them
            sides |= np.isnan(values) & self.missing_left[None, :]
        for j in np.flatnonzero(np.isnan(self.thresholds)):
            assert self.category_splits is not None
            chosen = self.category_splits[self.category_splits[:, 0] == self.splits[j, 0], 1]
            sides[:, j] = (X[:, chosen] > 0.5).any(axis=1)  # one-hot: the row's category is one of them
        return sides


def part_id(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
