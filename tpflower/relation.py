"""A whole relational dataset in one process: spec, tables, mapping and split.

For the centralized baseline, tests and benchmarks. The federated algorithms never use this: each client
builds only its own :class:`LocalTable` and the server builds the mapping from digests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from tpflower.datasets import load_dataset
from tpflower.local_table import LocalTable, prepare_local_table
from tpflower.losses import output_dim
from tpflower.mapping import TableMapping, build_mapping, project_keys, split_mapping
from tpflower.models import init_seed, local_model, model_seed
from tpflower.schema import RelationalSpec


@dataclass
class Relation:
    spec: RelationalSpec
    frames: dict[str, pd.DataFrame]
    mapping: TableMapping
    train: TableMapping
    test: TableMapping
    tables: dict[str, LocalTable]

    @property
    def label(self) -> LocalTable:
        return self.tables[self.spec.label_table]

    @property
    def d_out(self) -> int:
        return output_dim(self.spec.label.task, self.label.n_classes)

    def labels(self, mapping: TableMapping) -> np.ndarray:
        """y_j for the joined rows of ``mapping`` (the server's view after the label owner sent its labels)."""
        assert self.label.y is not None
        return self.label.y[mapping.p[self.spec.label_table]]

    def features(self, table: str, keep_missing: bool = False) -> np.ndarray:
        """A table's preprocessed features X_i; ``keep_missing``: with its numeric columns' missing values kept
        missing (NaN), as boosted trees bin them (TablePreprocessor.with_missing)."""
        local = self.tables[table]
        if not keep_missing:
            return local.X
        assert local.preprocessor is not None
        return local.preprocessor.with_missing(local.X, self.frames[table])

    def joined_features(
        self, mapping: TableMapping, rows: np.ndarray | slice = slice(None), keep_missing: bool = False
    ) -> np.ndarray:
        """The materialized join's features for ``rows`` of ``mapping``: [X_1[p_1] | ... | X_M[p_M]]
        (``keep_missing``: :meth:`features`').

        Centralized baseline and reference checks only.
        """
        parts = [self.features(t, keep_missing)[mapping.p[t][rows]] for t in self.spec.table_names]
        return np.concatenate(parts, axis=1)


def summary_line(spec: RelationalSpec, mapping: TableMapping, shards: Mapping[str, Sequence[int]] | None = None) -> str:
    """Rows per table, joined rows N and the duplication factor N / rows of the label table; a union's sharded
    tables (``shards``: table -> each shard's rows, :func:`shard_rows`) with their shards' rows."""
    shards = shards or {}
    rows = ", ".join(
        f"{t}={mapping.n_rows[t]:,}" + (shard_text(shards[t]) if t in shards else "") for t in spec.table_names
    )
    dup = mapping.N / max(mapping.n_rows[spec.label_table], 1)
    return f"[{spec.name}] tables: {rows} | joined rows N={mapping.N:,} | duplication N/n_{spec.label_table}={dup:.2f}"


def shard_text(rows: Sequence[int], listed: int = 4) -> str:
    """A sharded table's shards for the dataset line: each one's rows up to ``listed`` shards (`` (shards 2,700 +
    300)``), else their count and range (`` (12 shards of 225 to 275 rows)``; results.json lists them all)."""
    if len(rows) <= listed:
        return f" (shards {' + '.join(f'{n:,}' for n in rows)})"
    sizes = f"{min(rows):,}" if min(rows) == max(rows) else f"{min(rows):,} to {max(rows):,}"
    return f" ({len(rows)} shards of {sizes} rows)"


def shard_rows(client_rows: Mapping[tuple[str, int], int]) -> dict[str, list[int]]:
    """Each sharded table's rows per shard, in shard order, from the clients' (table, shard) row counts; a table
    of one client is left out."""
    by_table: dict[str, dict[int, int]] = {}
    for (table, shard), n in client_rows.items():
        by_table.setdefault(table, {})[shard] = int(n)
    return {t: [q[s] for s in sorted(q)] for t, q in by_table.items() if len(q) > 1}


def load_relation(
    dataset_cfg: Any, secret: bytes, base_dir: str | Path | None = None, verbose: bool = True
) -> Relation:
    """Load, validate, map (through digests, as the federated path does) and preprocess a dataset."""
    spec, frames = load_dataset(dataset_cfg, base_dir=base_dir)
    projections = {t: [project_keys(spec, t, frames[t], np.arange(len(frames[t])), secret)] for t in spec.table_names}
    mapping = build_mapping(spec, projections)
    if verbose:
        print(summary_line(spec, mapping), flush=True)
    train, test = split_mapping(spec, mapping)
    tables = {t: prepare_local_table(spec, t, frames[t]) for t in spec.table_names}
    return Relation(spec=spec, frames=frames, mapping=mapping, train=train, test=test, tables=tables)


def has_bias(model_cfg: Mapping[str, Any], table: str, label_table: str) -> bool:
    """Which local models carry an output bias (model.bias: label | all | none)."""
    choice = model_cfg.get("bias", "label")
    if choice not in ("label", "all", "none"):
        raise ValueError(f"model.bias must be label, all or none, got {choice!r}")
    return choice == "all" or (choice == "label" and table == label_table)


def build_local_model(
    model_cfg: Mapping[str, Any],
    spec: RelationalSpec,
    table: str,
    d_in: int,
    d_out: int,
    seed: int,
    dtype: torch.dtype,
    owner_key: tuple[bytes, str] | None = None,
) -> torch.nn.Module:
    """f_i for one table, identical wherever it is built (client, centralized baseline) for the same seed.

    ``owner_key`` = (secret, nonce): a deployed node's theta_i^0 from :func:`tpflower.models.init_seed`, which a
    server without the owner's secret cannot rebuild; None (a simulation, whose user plays every party and whose
    secret derives from the seed anyway): :func:`tpflower.models.model_seed`, as the centralized baseline."""
    return local_model(
        d_in,
        d_out,
        kind=model_cfg.get("kind", "linear"),
        hidden=tuple(model_cfg.get("hidden") or ()),
        bias=has_bias(model_cfg, table, spec.label_table),
        init=model_cfg.get("init", "default"),
        dtype=dtype,
        seed=model_seed(seed, table) if owner_key is None else init_seed(owner_key[0], seed, table, owner_key[1]),
    )
