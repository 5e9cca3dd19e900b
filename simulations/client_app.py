"""The ClientApp (Flower's Message API): one client per table (shard), under the simulation engine or a
flower-supernode.

Handlers: ``query`` answers the server's first step (which table and shard this node holds), ``train`` and
``evaluate`` unpack the message (tpflower.records), hand it to the node's TableClient (a NumPyClient that
answers the phases of the run's algorithm, from strategies.registry) and pack its reply. An exception
becomes Flower's error reply, which the server turns into one line naming the table.

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
from typing import TYPE_CHECKING, Any

import pandas as pd
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from omegaconf import DictConfig, OmegaConf

from simulations.config import compose_config
from strategies.protocol import HELLO_PHASE
from tpflower.datasets import load_spec, load_table, shard_rows
from tpflower.records import pack_reply, unpack_payload
from tpflower.schema import RelationalSpec, SpecError

if TYPE_CHECKING:  # torch and the algorithms are imported on the first training message, not for the hello
    # (in a deployment every message is a fresh process: the hello round then costs no torch import)
    from tpflower.client import ClientSettings, TableClient
    from tpflower.local_table import ShardData


@lru_cache(maxsize=32)
def _load(dataset_json: str, table: str, base_dir: str | None) -> tuple[RelationalSpec, pd.DataFrame, dict]:
    """Load one client's table once per process (Flower may rebuild the client per message)."""
    from tpflower.client import key_kinds_of

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


def config_key(cfg: DictConfig) -> str:
    """The config's content as a string: the cache key of a node's prepared table and settings."""
    return json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True, default=str)


def make_client(cfg: DictConfig, context: Context, base_dir: str | Path | None = None,
                cfg_key: str | None = None) -> TableClient:
    """The client of this node for one message; table and settings are built once per process and node.

    The cache key is the config's content (``cfg_key``, else computed: about 8 ms): under Ray the ClientApp,
    and with it ``cfg``, arrives deserialized with every message, so object identity would miss every time
    (and grow without bound); the ClientApp computes the key once and carries it.
    """
    from strategies.registry import entry_of
    from tpflower.client import TableClient

    content = cfg_key if cfg_key is not None else config_key(cfg)
    cache_key = (content, tuple(sorted(context.node_config.items())), str(base_dir))
    if cache_key in _SETTINGS:
        _SETTINGS.move_to_end(cache_key)
    else:
        _SETTINGS[cache_key] = _settings(cfg, dict(context.node_config), base_dir)
        while len(_SETTINGS) > _SETTINGS_MAX:
            _SETTINGS.popitem(last=False)
    settings, data = _SETTINGS[cache_key]
    entry = entry_of(cfg)
    return TableClient(data, settings, context.state, entry.phases, entry.name)


def _settings(cfg: DictConfig, node_config: dict[str, Any], base_dir: str | Path | None) -> tuple[ClientSettings, ShardData]:
    from strategies.registry import entry_of
    from tpflower.client import ClientSettings
    from tpflower.local_table import ShardData

    dataset = OmegaConf.to_container(cfg.dataset, resolve=True)
    assert isinstance(dataset, dict)
    root = str(base_dir) if base_dir else None
    scenario = str(cfg.scenario.name)
    table, shard = node_identity(cfg, node_config, base_dir)
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
        algorithm=entry_of(cfg).params.from_cfg(OmegaConf.to_container(cfg.algorithm, resolve=True)),  # type: ignore[arg-type]
        seed=int(cfg.seed),
        precision=str(cfg.precision),
        secret=str(cfg.mapping.secret).encode(),
        key_kinds=kinds,
        federated_prep=sum(1 for t, _ in spec.clients(scenario) if t == table) > 1,
        privacy=OmegaConf.to_container(cfg.privacy, resolve=True),  # its own settings, not the server's word
    )
    return settings, data


def node_identity(cfg: DictConfig, node_config: dict[str, Any], base_dir: str | Path | None) -> tuple[str, int]:
    """(table, shard) of this node among the run's clients (the dataset spec, parsed once per process)."""
    dataset = json.dumps(OmegaConf.to_container(cfg.dataset, resolve=True), sort_keys=True)
    keys = _spec(dataset, str(base_dir) if base_dir else None).clients(str(cfg.scenario.name))
    return identity(node_config, keys)


@lru_cache(maxsize=8)
def _spec(dataset_json: str, base_dir: str | None) -> RelationalSpec:
    return load_spec(json.loads(dataset_json), base_dir=base_dir)


def client_app_for(cfg: DictConfig | None, base_dir: str | Path | None = None) -> ClientApp:
    """The ClientApp for a fixed config (the Hydra entry point), or composing it from the run config (flwr run)."""
    app = ClientApp()
    # The handlers capture the config as its JSON string, not as a DictConfig: the simulation engine pickles
    # the ClientApp with every message (a DictConfig costs ~5 ms to pickle and load; a string nothing).
    fixed_key = config_key(cfg) if cfg is not None else None

    def settings_of(context: Context) -> tuple[DictConfig, str | Path | None, str | None]:
        if fixed_key is not None:
            run_cfg, key = _config_of(fixed_key), fixed_key
        else:
            overrides = str(context.run_config.get("overrides", ""))
            run_cfg, key = _compose(overrides), _composed_key(overrides)
        return run_cfg, base_dir if base_dir is not None else context.run_config.get("base-dir") or None, key

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """The server's first step: which table and shard this node holds (nothing else is loaded)."""
        _, config = unpack_payload(msg.content)
        if config.get("phase") != HELLO_PHASE:
            raise ValueError(f"query {config.get('phase')!r}: this client answers only {HELLO_PHASE!r} queries")
        run_cfg, root, _ = settings_of(context)
        table, shard = node_identity(run_cfg, dict(context.node_config), root)
        return Message(pack_reply({}, {"table": table, "shard": shard}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return answer(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return answer(msg, context)

    def answer(msg: Message, context: Context) -> Message:
        run_cfg, root, key = settings_of(context)
        arrays, config = unpack_payload(msg.content)
        out, metrics = make_client(run_cfg, context, root, key).handle(arrays, config)
        return Message(pack_reply(out, metrics), reply_to=msg)

    return app


@lru_cache(maxsize=8)
def _compose(overrides: str) -> DictConfig:
    return compose_config(*overrides.split())


@lru_cache(maxsize=8)
def _composed_key(overrides: str) -> str:
    return config_key(_compose(overrides))


@lru_cache(maxsize=8)
def _config_of(key: str) -> DictConfig:
    """The config whose :func:`config_key` is ``key`` (built once per process)."""
    return OmegaConf.create(json.loads(key))


def config_from_run_config(run_config: dict[str, Any]) -> DictConfig:
    """The Hydra config of a `flwr run` job: conf/ composed with the run config's `overrides` string."""
    return _compose(str(run_config.get("overrides", "")))


app = client_app_for(None)
