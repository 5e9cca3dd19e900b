"""Payloads in Flower records (flwr.app): named arrays and scalars, both directions.

  server -> client  RecordDict{"arrays": ArrayRecord, "config": ConfigRecord}
  client -> server  RecordDict{"arrays": ArrayRecord, "metrics": MetricRecord, "info": ConfigRecord}

("info" holds the few string-valued reply fields, e.g. the table a node holds.) Used by the ClientApp and by
the strategies alike; bytes_up/down count the serialized arrays (:func:`record_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

Arrays = dict[str, np.ndarray]


def array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})


def record_arrays(record: ArrayRecord | None) -> Arrays:
    return {} if record is None else {name: a.numpy() for name, a in record.items()}


def record_bytes(content: RecordDict) -> int:
    """Bytes of the arrays a message carries (the serialized ndarrays: what bytes_up/down count)."""
    rec = content.array_records.get("arrays")
    return 0 if rec is None else int(sum(len(a.data) for a in rec.values()))


def pack_payload(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> RecordDict:
    return RecordDict({"arrays": array_record(arrays), "config": ConfigRecord(dict(config))})


def unpack_payload(content: RecordDict) -> tuple[Arrays, dict[str, Any]]:
    return record_arrays(content.array_records.get("arrays")), dict(content.config_records.get("config") or {})


def pack_reply(arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any]) -> RecordDict:
    """Numbers go to the MetricRecord, strings to the "info" ConfigRecord."""
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    info = {k: v for k, v in metrics.items() if k not in numbers}
    return RecordDict({"arrays": array_record(arrays), "metrics": MetricRecord(numbers), "info": ConfigRecord(info)})


def unpack_reply(content: RecordDict) -> tuple[Arrays, dict[str, Any]]:
    metrics = dict(content.metric_records.get("metrics") or {})
    metrics.update(dict(content.config_records.get("info") or {}))
    return record_arrays(content.array_records.get("arrays")), metrics


def error_reason(reply: Message) -> str:
    """The useful line of an error reply: the ClientApp's exception message, without Flower's wrapping."""
    reason = str(reply.error.reason)
    if ":<'" in reason:  # "<class 'ValueError'>:<'table 'x': ...'>" (the simulation engine's format)
        reason = reason.split(":<'", 1)[1].rstrip(">").rstrip("'")
    return reason.strip().splitlines()[-1] if reason.strip() else f"error code {reply.error.code}"


def numbered(prefix: str, arrays: list[np.ndarray]) -> Arrays:
    """A variable-length list of arrays as named arrays ``prefix.0``, ``prefix.1``, ... (order kept)."""
    return {f"{prefix}.{k}": a for k, a in enumerate(arrays)}


def unnumbered(arrays: Mapping[str, np.ndarray], prefix: str) -> list[np.ndarray]:
    """The inverse of :func:`numbered`, in index order."""
    found = {int(name.rsplit(".", 1)[1]): a for name, a in arrays.items() if name.rsplit(".", 1)[0] == prefix}
    return [found[k] for k in range(len(found))]


def recorddict_bytes(records: RecordDict) -> bytes:
    """A RecordDict as Flower's own wire format (its protobuf), e.g. for a checkpoint or a node's worker."""
    return recorddict_to_proto(records).SerializeToString()


def recorddict_of(data: bytes) -> RecordDict:
    """The RecordDict that :func:`recorddict_bytes` wrote."""
    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


#: the phase of the query a server sends every node before a run (is it there, which table does it serve)
HELLO_PHASE = "hello"
