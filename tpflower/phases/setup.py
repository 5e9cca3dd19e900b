"""Setup and evaluation phases shared by every LoJ algorithm (TablePuppet Sec. 3.1.1, 4.3, 4.4).

  keys      {}                  -> {row_ids, digest.<join>..., (label owner) y, is_test}
                                   with label DP: y holds the randomized labels of the TRAINING rows only
  stats     {}                  -> {summary.*}: preprocessing summary of its fit rows (several shards, Sec. 4.4)
  rule      {rule.*}            -> {}  the merged preprocessing rule replaces the local fit
  expand    {p}                 -> {}  VFL: from now on the client's rows are the N joined rows
  evaluate  {H, rows}           -> {}  label DP: the label owner scores the test predictions H of its test
                                       rows ``rows`` against its true labels (metrics)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord

from tpflower import privacy as dp
from tpflower.client import Arrays, PhaseHandler, TableClient
from tpflower.records import numbered, unnumbered
from tpflower.fedprep import local_summary
from tpflower.losses import metrics as eval_metrics
from tpflower.mapping import project_keys


def keys(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Row ids and keyed digests of the join keys (Sec. 3.1.1); the label owner adds its labels."""
    s, data = client.settings, client.data
    if config.get("privacy") and s.privacy is None:  # the run's privacy settings, for the later phases
        client.state.records["privacy"] = ConfigRecord(
            {k: v for k, v in config.items() if k == "privacy" or str(k).startswith("privacy.")})
    proj = project_keys(s.spec, s.table, data.keys, data.row_ids, s.secret)
    out: Arrays = {"row_ids": proj.row_ids, **{f"digest.{k}": d for k, d in sorted(proj.digests.items())}}
    metrics: dict[str, Any] = {
        "table": s.table,
        "shard": s.shard,
        "region": s.region,
        "n_rows": len(data.row_ids),
        "key_kinds": ",".join(f"{c}={k}" for c, k in s.key_kinds.items()),
    }
    if data.y is not None:
        y = data.y
        priv = client.privacy()
        if dp.uses_label_dp(priv):
            # label DP, once, before the labels leave: the training rows' labels randomized
            # (tpflower.privacy.randomize_labels), the test rows' labels not sent at all (see evaluate)
            train = ~data.is_test
            rng = dp.label_rng(priv, s.seed, s.table, s.shard)
            y = dp.randomize_labels(data.y[train], s.spec.label.task, priv, rng, data.n_classes)
            metrics["labels"] = "train_randomized"
        out["y"], out["is_test"] = y, data.is_test.astype(np.uint8)
        metrics["n_classes"] = int(data.n_classes or 0)
    return out, metrics


def stats(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Federated preprocessing, step 1: a summary of this shard's fit rows (no raw values or strings)."""
    s, t = client.settings, client.settings.spec.table(client.settings.table)
    wanted = config.get("sketch")  # the columns whose order statistics the server asks for; absent: all
    columns = None if wanted is None else [c for c in str(wanted).split(",") if c]
    summary = local_summary(client.data.rows, t.numeric, t.categorical, s.secret, client.data.fit_positions,
                            table=s.table, sketch_columns=columns)
    return numbered("summary", summary.arrays()), {}


def rule(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Federated preprocessing, step 3: keep the merged global rule; features are built from it."""
    client.state.put_list("rule", unnumbered(arrays, "rule"))
    client.state.set_scalar("rule_id", str(config["rule_id"]))
    return {}, {}


def expand(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """VFL baselines: the server sent p_i; the client's rows become the N joined rows X_i[p_i]."""
    client.state.put("expand", np.asarray(arrays["p"], dtype=np.int64))
    return {}, {}


def evaluate(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Label DP: the test labels never leave the label owner. The server sends its test predictions H of this
    client's test rows ``rows`` (positions in its rows); the client returns the metrics against its true
    labels (tpflower.losses.metrics) and the row count, for the server to combine over shards."""
    H, rows = arrays["H"], np.asarray(arrays["rows"], dtype=np.int64)
    data, task = client.data, client.settings.spec.label.task
    if data.y is None or data.is_test is None:
        raise RuntimeError(f"table {client.settings.table!r} holds no labels: it cannot evaluate")
    if len(rows) and (rows.min() < 0 or rows.max() >= len(data.y) or not data.is_test[rows].all()):
        raise ValueError(f"table {client.settings.table!r}: evaluate asks for rows outside this client's test split")
    if len(rows) == 0:
        return {}, {"n": 0}
    return {}, {"n": len(rows), **eval_metrics(task, np.asarray(H), data.y[rows])}


#: The setup phases of every LoJ algorithm (expand only for the VFL baselines).
PHASES: dict[str, PhaseHandler] = {"keys": keys, "stats": stats, "rule": rule, "evaluate": evaluate}
VFL_PHASES: dict[str, PhaseHandler] = {**PHASES, "expand": expand}
