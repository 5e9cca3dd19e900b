"""The ClientApp (Flower's Message API): one client per table (shard), under the simulation engine or a
flower-supernode.

Handlers: ``query`` answers the server's first step (which table and shard this node holds), ``train`` and
``evaluate`` unpack the message (tpflower.records), hand it to the node's TableClient (a NumPyClient that
answers the phases of the run's algorithm, from tpflower.registry) and pack its reply. An exception
becomes Flower's error reply, which the server turns into one line naming the table.

Which table a client holds comes from its node config: ``table`` (and ``shard``) and ``client-config`` on a
flower-supernode (``--node-config "table='ratings' client-config='/path/ratings.yaml'"``), else the
simulation's ``partition-id`` (clients in spec order). The run config's ``overrides`` string carries the
Hydra overrides of the run (the model, the algorithm and its hyperparameters, the dataset's spec). What is
the owner's to decide comes from the owner (tpflower.owner): on a deployed node its client-config file (data
file, exposed columns, privacy floor, secret), in a simulation the same settings built from the run config.
The node checks the run against them in the hello query already, before it loads or sends anything.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pandas as pd
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from omegaconf import DictConfig, OmegaConf

from tpflower.auto import resolve
from tpflower.checkpoint import run_key
from tpflower.checks import DataProblems
from tpflower.config import compose_config
from tpflower.datasets import load_spec, load_table, shard_rows
from tpflower.local_table import ShardData
from tpflower.overrides import split_overrides
from tpflower.owner import (
    OwnerSettings,
    load_owner_settings,
    simulation_owner,
    uses_feature_dp,
    uses_label_dp,
    without_paths,
)
from tpflower.records import HELLO_PHASE, pack_reply, unpack_payload
from tpflower.registry import AlgorithmEntry, entry_of
from tpflower.schema import RelationalSpec, SpecError

if TYPE_CHECKING:  # torch and the algorithms are imported on the first training message, not for the hello
    # (in a deployment every message is a fresh process: the hello round then costs no torch import)
    from tpflower.client import ClientSettings, TableClient
    from tpflower.guard import Protocol


@lru_cache(maxsize=32)
def _load(
    dataset_json: str, table: str, base_dir: str | None, kept: tuple[str, ...], deployed: bool = False
) -> tuple[RelationalSpec, pd.DataFrame, dict]:
    """Load one client's table once per process (Flower may rebuild the client per message); only the columns
    ``kept`` (what its owner exposes, and a shard column) stay in memory. A deployed node's data warnings go to
    its own log (a simulation's data check printed them)."""
    from tpflower.client import key_kinds_of  # noqa: PLC0415  torch: not on the hello path (see TYPE_CHECKING)

    warn = logging.getLogger("tpflower").warning if deployed else None
    spec, frame = load_table(json.loads(dataset_json), table, base_dir=base_dir, warn=warn)
    frame = frame[[c for c in frame.columns if c in kept]]
    return spec, frame, key_kinds_of(spec, table, frame)


class CheckedNode(NamedTuple):
    table: str
    shard: int
    owner: OwnerSettings
    dataset: dict[str, Any]  # the dataset config to load the table with (the owner's file in place of any other)
    spec: RelationalSpec  # the run's spec


def owner_checked(
    cfg: DictConfig, node_config: dict[str, Any], base_dir: str | Path | None, state_dir: str | None = None
) -> CheckedNode:
    """This node's table and shard and its owner's settings (its client-config file, or in a simulation the
    run config's, with ``state_dir`` for its checkpoints), with the run checked against them: the table's
    source, exposed columns and label, and the privacy floor."""
    dataset = OmegaConf.to_container(cfg.dataset, resolve=True)
    assert isinstance(dataset, dict)
    root = str(base_dir) if base_dir else None
    spec = _spec(json.dumps(dataset, sort_keys=True), root)
    table, shard = identity(node_config, spec.clients(str(cfg.scenario.name)))
    if node_config.get("client-config"):
        owner = load_owner_settings(str(node_config["client-config"]), table)
    elif "table" in node_config:
        raise SpecError(
            f"node config names table {table!r} but no client-config: a deployed node serves its table "
            "under its owner's settings file (README 'Deployment'; simulations.deploy start writes one)"
        )
    else:
        owner = replace(
            simulation_owner(OmegaConf.to_container(cfg, resolve=True), spec, table, root),  # type: ignore[arg-type]
            state_dir=state_dir,
            prediction_rows=simulated_query_rows(cfg, table, shard),
            prediction_rows_name=(cfg.get("predict") or {}).get("rows_name"),
        )
    owner.check_spec(spec, dataset, root)
    owner.check_shards(spec, str(cfg.scenario.name))
    owner.check_privacy(
        OmegaConf.to_container(cfg.privacy, resolve=True) if cfg.get("privacy") else {"name": "none"},
        label_owner=spec.label.table == table,
    )
    # a deployed owner's file in place of the run's; a simulated owner's is the run's own (its source resolved
    # at base_dir): kept as the dataset says it, so an error about it says where relative paths start
    if owner.source is not None and owner.origin != "simulation" and isinstance(dataset.get("tables"), dict):
        dataset["tables"][table] = {**(dataset["tables"].get(table) or {}), "source": owner.source}
    return CheckedNode(table, shard, owner, dataset, spec)


def check_budget(cfg: DictConfig, node: CheckedNode) -> None:
    """A node refuses, at the hello, a feature-DP run once its owner's feature-DP budget
    (``privacy.total_epsilon``, its ledger in ``state_dir``) is spent, and the label owner under label DP a run
    whose planned evaluations its owner's evaluation budget (``privacy.total_eval_epsilon``) cannot cover
    (docs/settings.md, Privacy): refused there, the run is stopped before any node released anything. A
    simulated node without a state_dir bounds this run alone: its plan is checked against an empty ledger."""
    from tpflower.privacy.budget import (  # noqa: PLC0415
        check_eval_plan,
        check_feature_room,
        owner_bound,
        planned_evaluations,
        spent_eval,
    )

    owner = node.owner
    if cfg.get("predict"):
        return
    run = OmegaConf.to_container(cfg.privacy, resolve=True) if cfg.get("privacy") else {"name": "none"}
    assert isinstance(run, dict)
    if uses_feature_dp(run) or uses_feature_dp(owner.privacy):  # a spent owner budget: refused before the keys
        problem = check_feature_room(owner.state_dir, node.table, node.shard, owner.privacy, run)
        if problem is not None:
            raise owner.refuse(f"shard {node.shard}: {problem}")
    if node.spec.label.table != node.table:
        return
    if not (uses_label_dp(run) or uses_label_dp(owner.privacy)):
        return
    whole = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(whole, dict)
    plan = planned_evaluations(whole)  # type: ignore[arg-type]
    if plan == 0:
        return
    spent = spent_eval(owner.state_dir, node.table, node.shard)
    epsilon = owner_bound(owner.privacy, run, "eval_epsilon")
    problem = check_eval_plan(spent, epsilon, owner_bound(owner.privacy, run, "total_eval_epsilon"), plan, whole)
    if problem is not None:
        raise owner.refuse(f"shard {node.shard}: {problem}")


def simulated_query_rows(cfg: DictConfig, table: str, shard: int) -> str | None:
    """A simulated prediction (simulations.predict): the query owner's file of new rows (``predict.rows``,
    the user owns every table); None on every other node, and in training."""
    predict = cfg.get("predict") or {}
    if predict.get("rows") and (str(predict.get("table")), int(predict.get("shard", 0))) == (table, shard):
        return str(predict["rows"])
    return None


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


_SETTINGS: OrderedDict[tuple, tuple[ClientSettings, ShardData, AlgorithmEntry, Protocol]] = OrderedDict()
_SETTINGS_MAX = 16  # nodes x configs one process serves at once (Ray actors serve several virtual nodes)


def config_key(cfg: DictConfig) -> str:
    """The config's content as a string: the cache key of a node's prepared table and settings."""
    return json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True, default=str)


def make_client(
    cfg: DictConfig,
    context: Context,
    base_dir: str | Path | None = None,
    cfg_key: str | None = None,
    state_dir: str | None = None,
) -> TableClient:
    """The client of this node for one message; table and settings are built once per process and node.

    The cache key is the config's content (``cfg_key``, else computed: about 8 ms): under Ray the ClientApp,
    and with it ``cfg``, arrives deserialized with every message, so object identity would miss every time
    (and grow without bound); the ClientApp computes the key once and carries it.
    """
    from tpflower.client import TableClient  # noqa: PLC0415  torch: not on the hello path (see TYPE_CHECKING)

    content = cfg_key if cfg_key is not None else config_key(cfg)
    cache_key = (content, tuple(sorted(context.node_config.items())), str(base_dir), state_dir)
    from tpflower.phases.predict import PREDICT, with_save  # noqa: PLC0415  torch (see TYPE_CHECKING)
    from tpflower.releases import PREDICTION  # noqa: PLC0415  the ledger: not on the hello path

    if cache_key in _SETTINGS:
        _SETTINGS.move_to_end(cache_key)
    else:  # the training protocol once per node too: it builds its phase tables on first use
        entry = entry_of(cfg)
        _SETTINGS[cache_key] = (
            *_settings(cfg, dict(context.node_config), base_dir, state_dir),
            entry,
            with_save(entry.protocol),
        )
        while len(_SETTINGS) > _SETTINGS_MAX:
            _SETTINGS.popitem(last=False)
    settings, data, entry, training = _SETTINGS[cache_key]

    # a prediction request (config `predict`) is a protocol of its own; training ends with the save stage
    if cfg.get("predict"):
        return TableClient(data, settings, context.state, PREDICT, entry.name, PREDICTION)
    return TableClient(data, settings, context.state, training, entry.name, entry.family)


def _settings(
    cfg: DictConfig, node_config: dict[str, Any], base_dir: str | Path | None, state_dir: str | None = None
) -> tuple[ClientSettings, ShardData]:
    from tpflower.client import ClientSettings  # noqa: PLC0415  torch: not on the hello path (see TYPE_CHECKING)

    root = str(base_dir) if base_dir else None
    scenario = str(cfg.scenario.name)
    table, shard, owner, dataset, _ = owner_checked(cfg, node_config, base_dir, state_dir)
    kept = owner.exposed.all  # a shard column is an exposed one (OwnerSettings.check_shards)
    try:
        spec, frame, kinds = _load(json.dumps(dataset, sort_keys=True), table, root, kept, owner.origin != "simulation")
    except DataProblems as exc:
        raise node_data_error(exc, owner) from None
    sharded = scenario == "ucq" and spec.table(table).shards is not None
    rows = shard_rows(spec.table(table), frame)[shard] if sharded else None
    data = ShardData(spec, table, frame, rows, precision=str(cfg.precision))
    settings = ClientSettings(
        spec=spec,
        table=table,
        shard=shard,
        region=spec.table(table).region or "",  # "": the network's default link
        model=OmegaConf.to_container(cfg.model, resolve=True),  # type: ignore[arg-type]
        algorithm=entry_of(cfg).params.from_cfg(
            OmegaConf.to_container(cfg.algorithm, resolve=True)  # type: ignore[arg-type]
        ),
        seed=int(cfg.seed),
        precision=str(cfg.precision),
        owner=owner,
        key_kinds=kinds,
        federated_prep=sum(1 for t, _ in spec.clients(scenario) if t == table) > 1,
        config_key=run_key(cfg),
        num_gpus=float((cfg.get("resources") or {}).get("num_gpus") or 0.0),
    )
    return settings, data


def node_data_error(exc: DataProblems, owner: OwnerSettings) -> SpecError:
    """The error a node replies with for its table's problems: one line (the server shows one line per
    table). A deployed node sends table, column, problem and count only; the example values and rows stay in
    its own log (stderr of its ClientApp process). In a simulation the user owns every table: values shown."""
    deployed = owner.origin != "simulation"
    if deployed:
        logging.getLogger("tpflower").error("table %r: %s", owner.table, exc.report(values=True))
    return SpecError(exc.one_line(values=not deployed))


def node_identity(cfg: DictConfig, node_config: dict[str, Any], base_dir: str | Path | None) -> tuple[str, int]:
    """(table, shard) of this node among the run's clients (the dataset spec, parsed once per process)."""
    dataset = json.dumps(OmegaConf.to_container(cfg.dataset, resolve=True), sort_keys=True)
    keys = _spec(dataset, str(base_dir) if base_dir else None).clients(str(cfg.scenario.name))
    return identity(node_config, keys)


@lru_cache(maxsize=8)
def _spec(dataset_json: str, base_dir: str | None) -> RelationalSpec:
    return load_spec(json.loads(dataset_json), base_dir=base_dir)


def client_app_for(
    cfg: DictConfig | None, base_dir: str | Path | None = None, run_dir: str | Path | None = None
) -> ClientApp:
    """The ClientApp for a fixed config (the Hydra entry point), or composing it from the run config (flwr run).

    Simulated nodes keep their checkpoints in RUN_DIR/node-state (``run_dir``, else the run config's
    ``run-dir``; none without either); a deployed node where its owner's settings say."""
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

    def state_dir_of(context: Context) -> str | None:
        out = run_dir or context.run_config.get("run-dir")
        return str(Path(str(out)).resolve() / "node-state") if out else None

    def respond(message_type: str, content: RecordDict, context: Context) -> RecordDict:
        """The reply content to one message (what every handler returns, here or in a node's worker)."""
        run_cfg, root, key = settings_of(context)
        arrays, config = unpack_payload(content)
        if message_type == "query":  # the server's first step: which table and shard this node holds
            if config.get("phase") != HELLO_PHASE:
                raise ValueError(f"query {config.get('phase')!r}: this client answers only {HELLO_PHASE!r} queries")
            # refuse a run it would not serve, now; with the state_dir its ledger is in (a simulated node's too)
            node = owner_checked(run_cfg, dict(context.node_config), root, state_dir_of(context))
            check_budget(run_cfg, node)  # and one its privacy budget cannot cover, before setup releases anything
            return pack_reply({}, {"table": node.table, "shard": node.shard})
        if config.get("phase") == "keys":  # the first release: checked again (a server may skip the hello)
            check_budget(run_cfg, owner_checked(run_cfg, dict(context.node_config), root, state_dir_of(context)))
        out, metrics = make_client(run_cfg, context, root, key, state_dir_of(context)).handle(arrays, config)
        return pack_reply(out, metrics)

    def respond_deployed(message_type: str, content: RecordDict, context: Context) -> RecordDict:
        """``respond``; on a deployed node (its owner's client-config) an error line holding an absolute path
        reaches the server with the path as ``<a path>`` (docs/deployment.md), the node's log keeps it whole."""
        try:
            return respond(message_type, content, context)
        except Exception as exc:
            if not context.node_config.get("client-config"):
                raise
            line = str(exc)
            safe = without_paths(line)
            if safe == line:
                raise
            logging.getLogger("tpflower").error("%s", line)
            raise SpecError(safe) from None

    def handler(msg: Message, context: Context) -> Message:
        return Message(respond_deployed(msg.metadata.message_type, msg.content, context), reply_to=msg)

    app.query()(handler)
    app.train()(handler)
    app.evaluate()(handler)
    # for the owner's node service (tpflower.app.node_service)
    app.respond = respond_deployed  # type: ignore[attr-defined]
    return app


@lru_cache(maxsize=8)
def _compose(overrides: str) -> DictConfig:
    """The run config of ``overrides``, ``algorithm=auto`` resolved (tpflower.auto: as the server resolves it)."""
    cfg = compose_config(*split_overrides(overrides))
    resolve(cfg)
    return cfg


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


def warm_up() -> None:
    """Import the training code (torch) and build one throwaway optimizer, as a long-lived node does before its
    first task: torch.optim's first optimizer imports about 800 more modules (~1.5 s CPU, more under load),
    which the first training message would otherwise wait for. The node's answers are unchanged."""
    import torch  # noqa: PLC0415  the point of this function

    import tpflower.client  # noqa: F401, PLC0415  the algorithms (see TYPE_CHECKING)

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
