"""The ClientApp: one client per table (shard), under the simulation engine or a flower-supernode.

Which table a client holds comes from its node config: ``table`` (and ``shard``) on a flower-supernode
(``--node-config "table='ratings'"``), else the simulation's ``partition-id`` (clients in spec order).
``source`` in the node config overrides the table's data file. The run config's ``overrides`` string
carries the Hydra overrides of the run, so every process composes the same configuration.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pandas as pd
from flwr.client import Client, ClientApp
from flwr.common import Context
from omegaconf import DictConfig, OmegaConf

from simulations.config import compose_config
from tpflower.client import ClientSettings, TableClient, key_kinds_of
from tpflower.datasets import load_spec, load_table, shard_rows
from tpflower.local_table import ShardData
from tpflower.schema import RelationalSpec, SpecError


@lru_cache(maxsize=32)
def _load(dataset_json: str, table: str, base_dir: str | None) -> tuple[RelationalSpec, pd.DataFrame, dict]:
    """Load one client's table once per process (Flower may rebuild the client per message)."""
    spec, frame = load_table(json.loads(dataset_json), table, base_dir=base_dir)
    return spec, frame, key_kinds_of(spec, table, frame)


def identity(node_config: dict[str, Any], keys: list[tuple[str, int]]) -> tuple[str, int]:
    """(table, shard) of this node, from its node config."""
    if "table" in node_config:
        key = (str(node_config["table"]), int(node_config.get("shard", 0)))
        if key not in keys:
            raise SpecError(f"node config names table {key[0]!r} shard {key[1]}, which the run does not have: {keys}")
        return key
    pid = int(node_config.get("partition-id", -1))
    if not 0 <= pid < len(keys):
        raise SpecError(f"partition-id {pid} out of range for {len(keys)} clients {keys}; set node config 'table'")
    return keys[pid]


_SETTINGS: "OrderedDict[tuple, tuple[ClientSettings, ShardData]]" = OrderedDict()
_SETTINGS_MAX = 16  # nodes x configs one process serves at once (Ray actors serve several virtual nodes)


def make_client(cfg: DictConfig, context: Context, base_dir: str | Path | None = None) -> TableClient:
    """The client of this node for one message; table and settings are built once per process and node.

    The cache key is the config's content: under Ray the ClientApp, and with it ``cfg``, arrives
    deserialized with every message, so object identity would miss every time (and grow without bound).
    """
    content = json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True, default=str)
    cache_key = (content, tuple(sorted(context.node_config.items())), str(base_dir))
    if cache_key in _SETTINGS:
        _SETTINGS.move_to_end(cache_key)
    else:
        _SETTINGS[cache_key] = _settings(cfg, dict(context.node_config), base_dir)
        while len(_SETTINGS) > _SETTINGS_MAX:
            _SETTINGS.popitem(last=False)
    settings, data = _SETTINGS[cache_key]
    return TableClient(data, settings, context.state)


def _settings(cfg: DictConfig, node_config: dict[str, Any], base_dir: str | Path | None) -> tuple[ClientSettings, ShardData]:
    dataset = OmegaConf.to_container(cfg.dataset, resolve=True)
    assert isinstance(dataset, dict)
    root = str(base_dir) if base_dir else None
    scenario = str(cfg.scenario.name)
    table, shard = identity(node_config, _spec(json.dumps(dataset, sort_keys=True), root).clients(scenario))
    if node_config.get("source"):
        if scenario == "ucq":
            raise SpecError("node config 'source' (a per-node data file) is supported in the join scenario only")
        dataset["tables"][table] = {**dataset["tables"].get(table, {}), "source": str(node_config["source"])}
    spec, frame, kinds = _load(json.dumps(dataset, sort_keys=True), table, root)
    sharded = scenario == "ucq" and spec.table(table).shards is not None
    rows = shard_rows(spec.table(table), frame)[shard] if sharded else None
    data = ShardData(spec, table, frame, rows, precision=str(cfg.precision))
    settings = ClientSettings(
        spec=spec,
        table=table,
        shard=shard,
        region=spec.table(table).region,
        model=OmegaConf.to_container(cfg.model, resolve=True),  # type: ignore[arg-type]
        algorithm=OmegaConf.to_container(cfg.algorithm, resolve=True),  # type: ignore[arg-type]
        seed=int(cfg.seed),
        precision=str(cfg.precision),
        secret=str(cfg.mapping.secret).encode(),
        key_kinds=kinds,
        federated_prep=sum(1 for t, _ in spec.clients(scenario) if t == table) > 1,
        privacy=OmegaConf.to_container(cfg.privacy, resolve=True),  # its own settings, not the server's word
    )
    return settings, data


@lru_cache(maxsize=8)
def _spec(dataset_json: str, base_dir: str | None) -> RelationalSpec:
    return load_spec(json.loads(dataset_json), base_dir=base_dir)


def client_fn_for(cfg: DictConfig | None, base_dir: str | Path | None = None) -> Callable[[Context], Client]:
    """A client_fn for a fixed config (run_simulation), or composing it from the run config (flwr run)."""

    def client_fn(context: Context) -> Client:
        run_cfg = cfg if cfg is not None else config_from_run_config(context.run_config)
        root = base_dir if base_dir is not None else context.run_config.get("base-dir") or None
        return make_client(run_cfg, context, root).to_client()

    return client_fn


@lru_cache(maxsize=8)
def _compose(overrides: str) -> DictConfig:
    return compose_config(*overrides.split())


def config_from_run_config(run_config: dict[str, Any]) -> DictConfig:
    """The Hydra config of a `flwr run` job: conf/ composed with the run config's `overrides` string."""
    return _compose(str(run_config.get("overrides", "")))


app = ClientApp(client_fn=client_fn_for(None))
