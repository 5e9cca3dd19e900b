"""Setup and evaluation phases shared by every LoJ algorithm (TablePuppet Sec. 3.1.1, 4.3, 4.4).

keys      {chunk_rows}        -> {row_ids, code.<join>, digest.<join>..., (label owner) y, is_test}  keys=hmac:
                                 per row the code (uint16/uint32) of its key value, per distinct value its
                                 keyed digest (tpflower.keys_payload)
                                 {row_ids, code.<join>, blind.<join>..., ...}          keys=blind: per row the
                                 code of its key value, per distinct value H(k)^a (shuffled; tpflower.blind)
                                 with label DP: y holds the randomized labels of the TRAINING rows only.
                                 A table of more than chunk_rows rows (the run's mapping.keys_chunk_rows) sends
                                 chunk 0 here (rows and values 0..chunk_rows-1; metrics n_chunks, n_values.<join>)
keys_chunk {chunk}            -> the same arrays for rows and values j*chunk_rows.. of chunk j = 1, 2, ... (in
                                 order, each once, none beyond the table: else refused), each chunk built
                                 when asked for (tpflower.keys_payload)
reblind   {pts.<join>.<j>...} -> {pts.<join>.<j>...}  keys=blind: another owner's blinded keys of a join this
          {chunk, chunk_rows,    table takes part in, raised to this node's scalar (same order); a list of
           n.<list>}             more values than chunk_rows in chunks (each list once, its chunks in order,
                                 none beyond its length n.<list>: else refused)
stats     {columns, sketch}   -> {summary.*}: preprocessing summary of its fit rows (several shards, Sec. 4.4)
rule      {rule.*}            -> {}  the merged preprocessing rule replaces the local fit
expand    {p}                 -> {}  VFL: from now on the client's rows are the N joined rows
evaluate  {H, rows}           -> {}  label DP: the label owner scores the test predictions H of its test
                                     rows ``rows`` against its true labels (metrics)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord

from tpflower import fedprep, label_dp, registry
from tpflower import privacy as dp
from tpflower.blind import new_scalar, node_scalar, reblind
from tpflower.checks import key_value_text
from tpflower.client import TableClient
from tpflower.guard import (
    Phase,
    Protocol,
    ProtocolRefusal,
    Stage,
    chunked_keys,
    label_dp_owner,
    refusal,
    sharded,
    takes,
)
from tpflower.keys_payload import KeysPayload
from tpflower.records import Arrays, numbered, unnumbered
from tpflower.signing import SigningKey, node_name, node_signing_key, sign, statement, verifies

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import pandas as pd


def key_payload(
    client: TableClient,
    keys: pd.DataFrame,
    row_ids: np.ndarray,
    seed: bytes | None = None,
    labels: bool = False,
    rebuilt: bool = False,
) -> KeysPayload:
    """The mapping payload of ``keys`` (the rows' join-key columns) and ``row_ids``, built chunk by chunk
    (tpflower.keys_payload): per join of this table each row's code and per distinct value a keyed digest
    (keys=hmac) or a blinded value (keys=blind) by the owner's key mode, which is recorded in the node's
    state; with ``labels`` the label owner's labels and test flags. The values' shuffle: OS entropy, or the
    node's secret ``seed`` (the same payload again; ``rebuilt``: for a later chunk, with the labels sent
    before)."""
    s = client.settings
    client.state.set_scalar("keys", s.owner.keys)
    mode = "blind" if s.owner.keys == "blind" else "hmac"
    scalar = blinding_scalar(client) if mode == "blind" else b""
    y = is_test = None
    if labels and client.data.y is not None:
        y, is_test = sent_labels(client, rebuilt), client.data.is_test
    secret = s.secret if mode == "hmac" else b""
    return KeysPayload(s.spec, s.table, keys, row_ids, mode, secret, scalar, seed, y, is_test, s.owner.threads)


def sent_labels(client: TableClient, rebuilt: bool) -> np.ndarray:
    """The labels the label owner sends: its rows' labels, or under label DP the training rows' labels
    randomized once per owner setting, the same draw served to every run (tpflower.label_dp; the test rows'
    labels are not sent at all, see evaluate). A payload ``rebuilt`` for its later chunks serves the labels
    chunk 0 came from."""
    data = client.data
    assert data.y is not None
    if not dp.uses_label_dp(client.privacy()):
        return data.y
    sent = client.state.get("labels.sent") if rebuilt else None
    y = label_dp.training_labels(client) if sent is None else sent
    client.state.put("labels.sent", np.asarray(y))  # what later phases may use of the labels (coresets)
    return y


def secret_check(secret: bytes) -> str:
    """A keyed check value of the node's secret ("" without one), in every keys reply: nodes holding the same
    secret report the same value, which tells the server (strategies.setup.key_mode compares them) nothing
    else. Under keys=hmac every node holds the owners' join-key secret; under keys=blind a sharded table's
    shards hold their owner's secret for its preprocessing (category digests, the initial model)."""
    return hmac.digest(secret, b"tpflower secret check", hashlib.sha256)[:16].hex() if secret else ""


def label_metrics(client: TableClient) -> dict[str, Any]:
    """What the keys reply says of its labels (the label owner only)."""
    data = client.data
    if data.y is None:
        return {}
    out: dict[str, Any] = {"n_classes": int(data.n_classes or 0)}
    secret = client.settings.secret
    if not data.whole and data.classes is not None and secret:
        # a shard: its class list keyed by the secret its table's shards share (the join-key secret, or under
        # keys=blind its owner's), so the server can tell only whether the shards' lists agree (shards in
        # separate files may hold different classes: their ids would disagree)
        text = "\x1f".join(map(str, data.classes)).encode()
        out["classes_digest"] = hmac.digest(secret, b"classes\x1f" + text, hashlib.sha256)[:16].hex()
    if dp.uses_label_dp(client.privacy()):
        out["labels"] = "train_randomized"
    return out


def train_payload(client: TableClient, seed: bytes | None, rebuilt: bool = False) -> KeysPayload:
    """This node's keys payload of training: its table's rows, keys and (label owner) labels."""
    return key_payload(client, client.data.keys, client.data.row_ids, seed, labels=True, rebuilt=rebuilt)


#: Rebuilds a node's keys payload from its secret shuffle seed (another process answers a later chunk).
Rebuild = Callable[[TableClient, bytes, bool], KeysPayload]


def chunked_reply(
    client: TableClient, config: Mapping[str, Any], build: Callable[[bytes | None], KeysPayload], source: str
) -> tuple[Arrays, dict[str, Any]]:
    """The reply of a keys phase: the whole payload, or with more rows than the message's ``chunk_rows`` its
    chunk 0 (metrics ``n_chunks`` and ``n_values.<join>``, ``n_y``), the rest by :func:`keys_chunk`. ``build``
    makes the payload from a shuffle seed; ``source`` names what :func:`keys_chunk` rebuilds it from."""
    s = client.settings
    chunk_rows = int(config.get("chunk_rows") or 0)  # 0: one message (a server that does not chunk)
    if chunk_rows < 0:
        raise ProtocolRefusal(f"table {s.table!r} shard {s.shard}: keys asks for chunks of {chunk_rows} rows")
    seed = os.urandom(16)  # never leaves the node: the shuffle, to recompute the payload for a later chunk
    payload = build(seed)
    n = payload.n_rows
    n_chunks = max(1, -(-n // chunk_rows)) if chunk_rows else 1
    metrics: dict[str, Any] = {"n_rows": n}
    if n_chunks == 1:
        whole = payload.whole()
        return whole, {**metrics, **signed_lists(client, payload, whole, 0)}
    token = os.urandom(16).hex()
    for name, value in (("token", token), ("seed", seed.hex()), ("chunk_rows", chunk_rows), ("source", source)):
        client.state.set_scalar(f"keys.{name}", value)
    client.state.set_scalar("keys.chunks", n_chunks)
    client.state.set_scalar("keys.n_rows", n)
    client.state.set_scalar("keys.next", 1)
    _remember(token, payload)
    metrics["n_chunks"] = n_chunks
    metrics.update({f"n_values.{k}": n_k for k, n_k in payload.n_values().items()})
    if payload.y is not None:
        metrics["n_y"] = len(payload.y)
    first = payload.chunk(0, chunk_rows)
    return first, {**metrics, **signed_lists(client, payload, first, 0)}


def keys(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Row ids, and per join key each row's code and per distinct value a keyed digest or blinded value
    (Sec. 3.1.1); the label owner adds its labels. More rows than the message's ``chunk_rows``: chunk 0 of
    the payload, the rest by :func:`keys_chunk` (metrics ``n_chunks``, and ``n_values.<join>``, ``n_y``)."""
    s = client.settings
    accept_privacy(client, config)
    check_unique_key(client)
    mode = s.owner.keys  # the owner's choice (its settings; in a simulation mapping.keys), never the server's
    out, metrics = chunked_reply(client, config, lambda seed: train_payload(client, seed), "train")
    metrics.update(label_metrics(client))
    metrics.update({"table": s.table, "shard": s.shard, "region": s.region})
    metrics["blind_keys"] = int(mode == "blind")  # the owner's key mode (a number: metrics carry no free text)
    metrics["secret_check"] = secret_check(s.secret)
    metrics["key_kinds"] = ",".join(f"{c}={k}" for c, k in s.key_kinds.items())
    return out, metrics


#: how :func:`keys_chunk` rebuilds a payload, by the ``source`` its keys phase recorded (training's keys
#: here; a prediction request's predict_keys registers its own in tpflower.phases.predict)
REBUILD: dict[str, Rebuild] = {"train": train_payload}


def keys_chunk(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Chunk ``chunk`` (1, 2, ...) of this node's keys payload (:meth:`KeysPayload.chunk`): in order, each
    once, none beyond its table. The payload is the one chunk 0 came from (kept in this process; rebuilt from
    the node's secret shuffle seed when another process answers); each chunk is built when asked for."""
    s, state = client.settings, client.state
    n_chunks, expected = int(state.scalar("keys.chunks", 1)), int(state.scalar("keys.next", 1))
    j = int(config.get("chunk", -1))
    where = f"table {s.table!r} shard {s.shard}"
    if j >= n_chunks or j < 1:
        n = int(state.scalar("keys.n_rows", 0))
        raise ProtocolRefusal(f"{where}: keys_chunk asks for chunk {j}; its {n} rows make chunks 1..{n_chunks - 1}")
    if j != expected:
        raise ProtocolRefusal(f"{where}: keys_chunk asks for chunk {j} out of order or twice (next: chunk {expected})")
    token = str(state.scalar("keys.token"))
    payload = _PAYLOADS.get(token)
    if payload is None:
        seed = bytes.fromhex(str(state.scalar("keys.seed")))
        payload = REBUILD[str(state.scalar("keys.source", "train"))](client, seed, True)
        _remember(token, payload)
    state.set_scalar("keys.next", j + 1)
    chunk_rows = int(state.scalar("keys.chunk_rows"))
    chunk = key_chunk(payload, j, chunk_rows)
    if j == n_chunks - 1:
        _PAYLOADS.pop(token, None)
    return chunk, signed_lists(client, payload, chunk, j * chunk_rows)


def key_chunk(payload: KeysPayload, j: int, chunk_rows: int) -> Arrays:
    """Chunk ``j`` of a keys payload: rows and listed values j*chunk_rows .. (j+1)*chunk_rows - 1."""
    return payload.chunk(j * chunk_rows, (j + 1) * chunk_rows)


_PAYLOADS: OrderedDict[str, KeysPayload] = OrderedDict()  # keys payloads being sent in chunks, by the node's token
_PAYLOADS_MAX = 16  # nodes one process serves at once (as tpflower.app.client_app's table cache)


def _remember(token: str, payload: KeysPayload) -> None:
    _PAYLOADS[token] = payload
    while len(_PAYLOADS) > _PAYLOADS_MAX:
        _PAYLOADS.popitem(last=False)


def blinding_scalar(client: TableClient) -> bytes:
    """This node's private scalar (tpflower.blind): in the owner's state_dir (blind.key, 0600) when it has one,
    else in the node's memory for the run (a simulated node). It never leaves the node."""
    s = client.settings
    if s.owner.state_dir is not None:
        return node_scalar(s.owner.state_dir)
    stored = client.state.scalar("blind.scalar")
    if stored is None:
        stored = new_scalar().hex()
        client.state.set_scalar("blind.scalar", stored)
    return bytes.fromhex(str(stored))


def signing_key(client: TableClient) -> SigningKey:
    """This node's Ed25519 key for re-blinding lists (tpflower.signing): in the owner's state_dir, else (a
    simulated node) in the node's memory for the run."""
    s = client.settings
    if s.owner.state_dir is not None:
        return node_signing_key(s.owner.state_dir)
    stored = client.state.scalar("sign.seed")
    if stored is None:
        stored = os.urandom(32).hex()
        client.state.set_scalar("sign.seed", stored)
    return SigningKey(bytes.fromhex(str(stored)))


def signed_lists(client: TableClient, payload: KeysPayload, arrays: Arrays, lo: int) -> dict[str, str]:
    """keys=blind: this node's signature of each list slice of a keys reply (``blind.<join>``, values lo..),
    as metrics ``sig.<join>`` (hex), for the owners that re-blind it (tpflower.signing)."""
    if payload.mode != "blind":
        return {}
    key, me = signing_key(client), node_name(client.settings.table, client.settings.shard)
    n = payload.n_values()
    return {
        f"sig.{k}": sign(key, statement(me, me, int(k), n[int(k)], lo, np.asarray(arrays[f"blind.{k}"])))
        for k in (name.split(".", 1)[1] for name in arrays if name.startswith("blind."))
    }


def check_signed(client: TableClient, name: str, points: np.ndarray, config: Mapping[str, Any]) -> str:
    """A slice of list ``name`` (``pts.<join>.<j>``) is re-blinded only when another node of the federation
    signed it: the signer's signature verifies against the verify key the owner's ``peers`` name for it, over
    the list's origin, the join, its announced length, the slice's position and its values; origin and
    signer are other nodes whose tables take part in that join. Each origin's list of a join is re-blinded
    once per run. Returns the list's origin (a node name). A simulated node without peers checks nothing."""
    s = client.settings
    join = int(name.split(".")[1])
    origin, signer = str(config.get(f"origin.{name}", "")), str(config.get(f"signer.{name}", ""))
    peers = s.owner.peers
    if peers is None and not s.owner.deployed:
        return origin
    if peers is None:
        raise refusal(client, "reblind: its owner's settings name no peer keys (peers), so it re-blinds no list")
    j = s.spec.joins[join]
    me = node_name(s.table, s.shard)
    tables = {n.rsplit("/", 1)[0] for n in (origin, signer)}
    if me in (origin, signer) or not tables <= {j.left, j.right}:
        raise refusal(client, f"reblind: list {name!r} is not another owner's list of this join")
    chunk_rows, at = int(config.get("chunk_rows") or 0), int(config.get("chunk", 0))
    n = int(config.get(f"n.{name}", len(points)))
    message = statement(origin, signer, join, n, at * chunk_rows, points)
    if signer not in peers or not verifies(peers[signer], str(config.get(f"sig.{name}", "")), message):
        why = (  # which node, so the operator knows whose key to check (a moved state_dir makes a new sign.key)
            "its signer is none of its peers"  # the server's claim: not echoed
            if signer not in peers
            else f"the signature of {signer!r} does not verify with its peers key (is that node's state_dir, so its "
            "sign.key, another?)"
        )
        raise refusal(
            client,
            f"reblind: list {name!r} is not signed by a peer its owner's settings name (for this join, length "
            f"and position): {why}",
        )
    return origin


def reblind_keys(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """keys=blind: raise other owners' blinded key values (``pts.<join>.<j>``) to this node's scalar, in the
    order sent. Only joins this table takes part in; anything but points of the group is refused. The server
    sends a list in chunks (config ``chunk`` j, ``chunk_rows`` c, ``n.<list>`` its length; none: the whole
    list in one message): chunk j holds values j*c .. (j+1)*c - 1; each list is re-blinded once, its chunks in
    order, none beyond its length (:func:`check_reblind_chunk`)."""
    s = client.settings
    mine = {str(k) for k, j in enumerate(s.spec.joins) if s.table in (j.left, j.right)}
    scalar = blinding_scalar(client)
    out: Arrays = {}
    for name in arrays:
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "pts" or parts[1] not in mine:
            raise ProtocolRefusal(
                f"table {s.table!r} shard {s.shard}: reblind sends {name!r}; it re-blinds only the keys of its "
                f"joins ({', '.join('pts.' + k + '.*' for k in sorted(mine))})"
            )
    moves = [check_reblind_chunk(client, name, len(points), config) for name, points in arrays.items()]
    origins = {name: check_signed(client, name, np.asarray(points), config) for name, points in arrays.items()}
    lists = [(origin, name.split(".")[1]) for name, origin in origins.items()]
    for name, origin in origins.items():  # each origin's list of a join once per run
        if int(config.get("chunk", 0)) == 0:
            once = f"reblind.origin.{origin}.{name.split('.')[1]}"
            if client.state.scalar(once) is not None or lists.count((origin, name.split(".")[1])) > 1:
                raise refusal(client, f"reblind: a second list of one origin for one join in this run ({name!r})")
            moves.append({once: 1})
    for move in moves:  # every list checked before the node's position in any of them moves on
        for key, value in move.items():
            client.state.set_scalar(key, value)
    key, me = signing_key(client), node_name(s.table, s.shard)
    chunk_rows, at = int(config.get("chunk_rows") or 0), int(config.get("chunk", 0))
    metrics: dict[str, Any] = {}
    for name, points in arrays.items():
        out[name] = reblind(points, scalar, f"table {s.table!r} shard {s.shard}, {name}", s.owner.threads)
        n = int(config.get(f"n.{name}", len(points)))
        message = statement(origins[name], me, int(name.split(".")[1]), n, at * chunk_rows, np.asarray(out[name]))
        metrics[f"sig.{name}"] = sign(key, message)  # the next owner re-blinds it only with this signature
    return out, metrics


def check_reblind_chunk(client: TableClient, name: str, n_points: int, config: Mapping[str, Any]) -> dict[str, int]:
    """A reblind chunk of list ``name`` holding ``n_points`` values: the list announced with the same length
    and chunk size at every chunk, chunk 0 first and then 1, 2, ... each once (a list once done is not taken
    again), exactly the values of that chunk. Returns the node's new position in the list (state scalars)."""
    s, state = client.settings, client.state
    where = f"table {s.table!r} shard {s.shard}: reblind"
    j = int(config.get("chunk", 0))
    chunk_rows = int(config.get("chunk_rows") or 0)  # 0: the whole list in one message
    total = int(config.get(f"n.{name}", n_points))
    expected = int(state.scalar(f"reblind.{name}.next", 0))
    if chunk_rows < 0 or total < 0 or (chunk_rows == 0 and j != 0):
        raise ProtocolRefusal(f"{where} announces {name!r} as {total} values in chunks of {chunk_rows}")
    if j != expected:
        again = "again (each list is re-blinded once)" if j == 0 else "out of order or twice"
        raise ProtocolRefusal(f"{where} sends chunk {j} of {name!r} {again} (next: chunk {expected})")
    if j > 0 and (
        total != int(state.scalar(f"reblind.{name}.n", -1))
        or chunk_rows != int(state.scalar(f"reblind.{name}.rows", -1))
    ):
        raise ProtocolRefusal(f"{where}: chunk {j} of {name!r} announces another length or chunk size than chunk 0")
    lo = j * chunk_rows
    if j > 0 and lo >= total:
        raise ProtocolRefusal(f"{where} sends chunk {j} of {name!r}, beyond its {total} values")
    want = total if chunk_rows == 0 else min(chunk_rows, total - lo)
    if n_points != want:
        raise ProtocolRefusal(
            f"{where}: chunk {j} of {name!r} holds {n_points} values; a list of {total} in chunks of "
            f"{chunk_rows or total} holds {want} there"
        )
    move = {f"reblind.{name}.next": j + 1}
    if j == 0:
        move.update({f"reblind.{name}.n": total, f"reblind.{name}.rows": chunk_rows})
    return move


def blinds_keys(client: TableClient) -> bool:
    """The clients of a run that maps keys by blinding (keys=blind in its keys message)."""
    return client.state.scalar("keys") == "blind"


def check_unique_key(client: TableClient) -> None:
    """A table declared ``unique`` has at most one row per key value (its owner's data, checked on the node).
    The error names the table, column and count; an example value only where the data is the run's own
    (simulation): a deployed node keeps its values and logs the example locally."""
    s = client.settings
    if not s.spec.table(s.table).unique:
        return
    cols = list(s.spec.unique_key(s.table))
    dup = client.data.keys.duplicated(subset=cols, keep=False).to_numpy()
    if not dup.any():
        return
    first = int(np.flatnonzero(dup)[0])
    example = key_value_text(client.data.keys, cols, first)
    where = f"table {s.table!r} declares its key {'+'.join(cols)} unique, but {int(dup.sum())} rows share a value"
    if s.owner.origin == "simulation":
        raise ValueError(f"{where}, e.g. {example} (row {first}): remove the duplicates or drop `unique: true`")
    print(f"tpflower: {where}, e.g. {example} (row {first})", file=sys.stderr, flush=True)
    raise ValueError(f"{where} (an example is in this node's log): the table's owner removes the duplicates")


def accept_privacy(client: TableClient, config: Mapping[str, Any]) -> None:
    """The run's privacy settings (the keys message) checked against the owner's floor, then kept for the
    later phases. Weaker than the floor, or impossible: refused before anything is sent."""
    run = dp.privacy_from_message(config)
    s = client.settings
    # what the algorithm is and supports is the node's own registry's word (the run cannot claim DP it does not do)
    entry = registry.by_name(client.algorithm)
    s.owner.check_algorithm(entry.name, entry.selector, entry.scenario)
    s.owner.check_privacy(run, label_owner=client.data.y is not None)
    dp.validate_privacy(
        run,
        client.algorithm,
        s.spec.label.task,
        feature_dp=entry.feature_dp,
        label_dp=entry.label_dp,
        why_not=entry.why_no_feature_dp,
    )
    client.state.records["privacy"] = ConfigRecord(dict(dp.privacy_message(run)))


def stats(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Federated preprocessing, step 1: a summary of this shard's fit rows (no raw rows or strings).

    Refused (ValueError) unless ``columns`` names exactly the table's feature columns and ``sketch`` (default:
    none) only numeric ones (fedprep.check_stats_request); min, max and order statistics only for ``sketch``,
    and only from at least ``min_sketch_rows`` observed values (the table owner's setting); the summary covers
    at least ``min_group_rows`` fit rows (or none), and a sketch only columns the rule needs (sketch_needed)."""
    s, t = client.settings, client.settings.spec.table(client.settings.table)
    _, sketch = fedprep.check_stats_request(config, t.numeric, t.categorical, table=s.table, shard=s.shard)
    fit = client.data.fit_positions  # None: every row; else positions or a boolean mask
    n_fit = len(client.data.rows) if fit is None else int(np.count_nonzero(fit) if fit.dtype == bool else fit.size)
    if 0 < n_fit < s.min_group_rows:
        where = (
            f"table {s.table!r} shard {s.shard}: a summary of fewer fit rows than min_group_rows = {s.min_group_rows}"
        )
        if s.owner.deployed:  # the count stays in the owner's log
            log.warning("%s (%d fit rows)", where, n_fit)
            raise ProtocolRefusal(f"{where}, the smallest group of rows its owner releases (its owner may lower it)")
        raise ProtocolRefusal(  # a simulation: the user sets the run's min_group_rows (shards: one line, merged)
            f"{where}, the smallest group of rows a node releases: set min_group_rows=N, N at most the smallest "
            f"shard's fit rows, or split the table into fewer shards ({n_fit} fit rows)"
        )
    summary = fedprep.local_summary(
        client.data.rows,
        t.numeric,
        t.categorical,
        s.secret,
        client.data.fit_positions,
        table=s.table,
        shard=s.shard,
        sketch_columns=sketch,
        min_sketch_rows=s.min_sketch_rows,
    )
    unneeded = [c for c in sketch if c not in sketch_needed(client)]
    if unneeded:
        raise ProtocolRefusal(
            f"table {s.table!r} shard {s.shard}: stats asks for order statistics of column(s) {unneeded}, which "
            "the preprocessing rule does not need (it needs those of binned columns and columns with missing values)"
        )
    return numbered("summary", summary.arrays()), {}


def sketch_needed(client: TableClient) -> set[str]:
    """The numeric columns whose order statistics the global rule needs (fedprep.sketch_columns_needed): the
    binned ones and those with a missing value in the table (the node holds the whole file it splits, so it
    knows the other shards' gaps too)."""
    t = client.settings.spec.table(client.settings.table)
    frame = client.data.frame
    return {c for c, _ in t.binned} | {c for c in t.numeric if bool(frame[c].isna().any())}


def rule(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Federated preprocessing, step 3: keep the merged global rule; features are built from it."""
    client.state.put_list("rule", unnumbered(arrays, "rule"))
    client.state.set_scalar("rule_id", str(config["rule_id"]))
    return {}, {}


def expand(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """VFL baselines: the server sent p_i; the client's rows become the N joined rows X_i[p_i]."""
    client.state.put("expand", np.asarray(arrays["p"], dtype=np.int64))
    return {}, {}


EVAL_COVERAGE = 0.5
"""The least share of its test rows a label owner scores (the inner join may drop some): a server cannot ask
for the metric of one row, or of a few, to read their labels."""


def evaluate(client: TableClient, arrays: Arrays, config: Mapping[str, Any]) -> tuple[Arrays, dict[str, Any]]:
    """Label DP: the test labels never leave the label owner. The server sends its test predictions H of this
    client's test rows ``rows`` (positions in its rows); the client returns the metrics against its true
    labels, as differentially private releases charged to its owner's budget (tpflower.label_dp), and the row
    count, for the server to combine over shards.

    The guard: rows within the test split, covering at least EVAL_COVERAGE of it, and the same rows (with
    their multiplicities) at every evaluation; the protocol allows one evaluation per training step."""
    H, rows = arrays["H"], np.asarray(arrays["rows"], dtype=np.int64)
    data, where = client.data, f"table {client.settings.table!r} shard {client.settings.shard}"
    if data.y is None or data.is_test is None:
        raise RuntimeError(f"{where} holds no labels: it cannot evaluate")
    if len(H) != len(rows):
        raise ValueError(f"{where}: evaluate sends {len(H)} predictions for {len(rows)} rows")
    if len(rows) and (rows.min() < 0 or rows.max() >= len(data.y) or not data.is_test[rows].all()):
        raise ValueError(f"{where}: evaluate asks for rows outside this client's test split")
    first, ordered = client.state.get("evaluate_rows"), np.sort(rows)
    if first is None:
        n_test, n_asked = int(data.is_test.sum()), len(np.unique(rows))
        if n_asked < EVAL_COVERAGE * n_test:
            raise ProtocolRefusal(
                f"{where}: evaluate over {n_asked} of its {n_test} test rows; it scores at "
                f"least {EVAL_COVERAGE:.0%} of its test split"
            )
        if 0 < n_asked < client.settings.min_group_rows:
            raise ProtocolRefusal(
                f"{where}: evaluate over {n_asked} test rows; this node's owner releases aggregates of at least "
                f"min_group_rows = {client.settings.min_group_rows} rows"
            )
        client.state.put("evaluate_rows", ordered)
    elif not np.array_equal(first, ordered):
        raise ProtocolRefusal(f"{where}: evaluate over other test rows than its first evaluation")
    out = reference_score(client, arrays, rows, first is None, where)
    if len(rows) == 0:
        return {}, {"n": 0}
    return {}, {"n": len(rows), **label_dp.evaluation_metrics(client, np.asarray(H), rows), **out}


def reference_score(client: TableClient, arrays: Arrays, rows: np.ndarray, first: bool, where: str) -> dict[str, Any]:
    """The constant predictor's metrics (``ref_*``) when the server sends one (``H_ref``): at the first
    evaluation only, and only a constant one (every row the same prediction), so it learns one number more
    (released like every metric: differentially private, charged; tpflower.label_dp)."""
    if "H_ref" not in arrays:
        return {}
    H_ref = np.asarray(arrays["H_ref"])
    if not first or len(H_ref) != len(rows) or (len(H_ref) and not np.all(H_ref == H_ref[:1])):
        raise ProtocolRefusal(
            f"{where}: evaluate scores a reference only at its first evaluation, and only a constant one"
        )
    if len(rows) == 0:
        return {}
    return {f"ref_{k}": v for k, v in label_dp.evaluation_metrics(client, H_ref, rows).items()}


#: another owner's blinded keys of a join this table takes part in (training and prediction alike)
REBLIND = Phase(reblind_keys, blinds_keys, inputs=takes(prefixes=["pts."]))
#: The setup stages of every LoJ algorithm, in order; federated preprocessing (stats: a first summary and at
#: most one more with order statistics, then the rule) only on the shards of a sharded table.
SETUP: tuple[Stage, ...] = (
    Stage("keys", {"keys": Phase(keys)}),
    Stage("keys_chunk", {"keys_chunk": Phase(keys_chunk, chunked_keys)}, calls=None),
    Stage("reblind", {"reblind": REBLIND}, calls=None),
    Stage("stats", {"stats": Phase(stats, sharded)}, calls=2),
    Stage("rule", {"rule": Phase(rule, sharded, inputs=takes(prefixes=["rule."]))}),
)
#: Label DP: the label owner scores the test predictions, once per training step (a phase of the training stage).
EVALUATE: dict[str, Phase] = {
    "evaluate": Phase(evaluate, label_dp_owner, spaced=True, inputs=takes("H", "rows", "H_ref"))
}


def loj_protocol(start: Stage, train: Mapping[str, Phase], vfl: bool = False) -> Protocol:
    """Setup (with expand for the VFL baselines), the algorithm's start stage, then its training stage
    (any number of messages; evaluate among them)."""
    expand_stage = (Stage("expand", {"expand": Phase(expand, inputs=takes("p"))}),) if vfl else ()
    return Protocol(SETUP + expand_stage + (start, Stage("train", {**train, **EVALUATE}, calls=None)))
