"""Payloads in Flower records (flwr.app): named arrays and scalars, both directions, in ONE record.

  server -> client  RecordDict{"payload": ConfigRecord{"a/NAME": npy bytes, ..., "v/KEY": config value, ...}}
  client -> server  RecordDict{"payload": ConfigRecord{"a/NAME": npy bytes, ..., "v/KEY": metric or info, ...}}

Flower sends a Message as a tree of objects, each pushed and pulled in its own request (Message -> RecordDict
-> each record -> each Array -> its chunks), four times per message on a deployment (pushed to the SuperLink,
pulled by the SuperNode, by the node service, and back the same way for the reply). One ConfigRecord holding
every array as its ``np.save`` bytes (what Flower's Array holds, ``allow_pickle=False``) and every scalar keeps
each message at three objects whatever the number of arrays: exact (the arrays' bytes, dtype and shape), and
the same on every runtime. Used by the ClientApp and by the strategies alike; bytes_up/down count the
serialized arrays (:func:`record_bytes`).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

Arrays = dict[str, np.ndarray]

PAYLOAD = "payload"  # the one record of every tpflower message and reply
ARRAY, VALUE = "a/", "v/"  # key prefixes in it: an array's npy bytes, a config / metric / info value


_MAGIC = b"\x93NUMPY"
_GROWTH_DIGITS = 21  # numpy.lib.format.GROWTH_AXIS_MAX_DIGITS: the header's spare room for the first axis
_ALIGN = 64  # numpy.lib.format.ARRAY_ALIGN: the header pads the data's start to this


def npy_bytes(a: np.ndarray) -> bytes:
    """``a`` as ``np.save`` writes it (Flower's Array.from_numpy_ndarray: no pickles), byte for byte. The
    format 1.0 header of a plain dtype is written here (numpy's writer, through a file object, cost every array
    of every message tens of microseconds); any other dtype by ``np.save``."""
    a = np.ascontiguousarray(a)
    dtype = a.dtype
    if dtype.hasobject or dtype.names is not None or dtype.subdtype is not None or dtype.metadata:
        buffer = io.BytesIO()
        np.save(buffer, a, allow_pickle=False)
        return buffer.getvalue()
    header = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {a.shape!r}, }}"
    if a.ndim:
        header += " " * (_GROWTH_DIGITS - len(repr(a.shape[0])))
    size = len(header) + 1  # and the newline
    size += _ALIGN - (len(_MAGIC) + 4 + size) % _ALIGN
    head = _MAGIC + b"\x01\x00" + size.to_bytes(2, "little") + header.encode("latin1")
    return b"".join((head, b" " * (size - len(header) - 1), b"\n", a.data if a.size else b""))


_HEADER = re.compile(
    rb"\{'descr': '([<>|=][a-zA-Z]\d*)', 'fortran_order': (True|False), 'shape': \(([0-9, ]*)\), \} *\n"
)


@lru_cache(maxsize=64)
def _dtype(descr: bytes) -> np.dtype:
    return np.dtype(descr.decode())


def npy_array(data: bytes) -> np.ndarray:
    """The array :func:`npy_bytes` wrote (never unpickles): a read-only view of ``data``, no copy (the
    message's bytes are the array's memory; a receiver that changes an array copies it first). The header
    ``np.save`` writes for a plain dtype is read by a pattern (numpy's reader parses it as Python source, a
    cost every array of every message paid); any other header by numpy's reader."""
    view = memoryview(data)
    if bytes(view[:6]) == _MAGIC and view[6] == 1:  # format 1.0: a 2-byte header length
        start = 10
        end = start + int.from_bytes(view[8:10], "little")
        found = _HEADER.fullmatch(bytes(view[start:end]))
        if found is not None:
            dtype = _dtype(found.group(1))
            if dtype.hasobject:
                raise ValueError("an array of Python objects in a message: refused (no pickles)")
            shape = tuple(int(x) for x in found.group(3).split(b",") if x.strip())
            count = int(np.prod(shape, dtype=np.int64))
            flat = np.frombuffer(data, dtype=dtype, count=count, offset=end)
            return flat.reshape(shape, order="F" if found.group(2) == b"True" else "C")
    buffer = io.BytesIO(data)
    version = np.lib.format.read_magic(buffer)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buffer)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(buffer)
    else:
        return np.load(io.BytesIO(data), allow_pickle=False)
    if dtype.hasobject:
        raise ValueError("an array of Python objects in a message: refused (no pickles)")
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=buffer.tell())
    return flat.reshape(shape, order="F" if fortran else "C")


def pack(arrays: Mapping[str, np.ndarray], values: Mapping[str, Any]) -> RecordDict:
    """Named arrays and scalar values as one ConfigRecord (three objects on the wire: see the module doc)."""
    record: dict[str, Any] = {ARRAY + name: npy_bytes(a) for name, a in arrays.items()}
    record.update((VALUE + key, value) for key, value in values.items())
    return RecordDict({PAYLOAD: ConfigRecord(record)})


def unpack(content: RecordDict) -> tuple[Arrays, dict[str, Any]]:
    """The (arrays, values) that :func:`pack` wrote; ({}, {}) for a message without a payload record."""
    record = content.config_records.get(PAYLOAD)
    if record is None:
        return {}, {}
    arrays = {key[len(ARRAY) :]: npy_array(v) for key, v in record.items() if key.startswith(ARRAY)}
    values = {key[len(VALUE) :]: v for key, v in record.items() if key.startswith(VALUE)}
    return arrays, values


def record_bytes(content: RecordDict) -> int:
    """Bytes of the arrays a message carries (the serialized ndarrays: what bytes_up/down count)."""
    record = content.config_records.get(PAYLOAD)
    if record is None:
        return 0
    return int(sum(len(v) for key, v in record.items() if key.startswith(ARRAY)))


def pack_payload(arrays: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> RecordDict:
    """A server -> client message: the arrays and the config (the phase and its scalars)."""
    return pack(arrays, config)


def unpack_payload(content: RecordDict) -> tuple[Arrays, dict[str, Any]]:
    return unpack(content)


def pack_reply(arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any]) -> RecordDict:
    """A client -> server reply: the arrays and the metrics (numbers, and the few strings, e.g. the table)."""
    return pack(arrays, metrics)


def unpack_reply(content: RecordDict) -> tuple[Arrays, dict[str, Any]]:
    return unpack(content)


#: Ray's memory monitor killing a worker (the simulation engine's node): "... Memory on the node (IP: ..., ID: ...)
#: was 22.37GB / 23.54GB (0.950451), which exceeds the memory usage threshold of 0.950000; ..." and 2 kB more
RAY_OOM = re.compile(r"killed due to the node running low on memory\..*? was (\S+ / \S+) .*?threshold of ([\d.]+)")


def error_reason(reply: Message) -> str:
    """The useful line of an error reply: the ClientApp's exception message, without Flower's wrapping."""
    reason = str(reply.error.reason)
    if ":<'" in reason:  # "<class 'ValueError'>:<'table 'x': ...'>" (the simulation engine's format)
        reason = reason.split(":<'", 1)[1].removesuffix("'>")  # the message's own last quote kept
    # Flower's ClientAppException wrapping: "\nException ClientAppException occurred. Message: ..."
    reason = re.sub(r"Exception \w+ occurred\. Message: ", "", reason)
    oom = RAY_OOM.search(reason)
    if oom:  # Ray's memory monitor's paragraph (object store stats, its top 10 processes) as its gist
        return (
            f"Ray killed the node's worker: the machine ran low on memory ({oom[1]} in use, above Ray's threshold "
            f"{oom[2]}, RAY_memory_usage_threshold); free memory and run again"
        )
    return reason.strip().splitlines()[-1] if reason.strip() else f"error code {reply.error.code}"


def numbered(prefix: str, arrays: list[np.ndarray]) -> Arrays:
    """A variable-length list of arrays as named arrays ``prefix.0``, ``prefix.1``, ... (order kept)."""
    return {f"{prefix}.{k}": a for k, a in enumerate(arrays)}


def unnumbered(arrays: Mapping[str, np.ndarray], prefix: str) -> list[np.ndarray]:
    """The inverse of :func:`numbered`, in index order."""
    found = {int(name.rsplit(".", 1)[1]): a for name, a in arrays.items() if name.rsplit(".", 1)[0] == prefix}
    return [found[k] for k in range(len(found))]


def recorddict_bytes(records: RecordDict) -> bytes:
    """A RecordDict as Flower's own wire format (its protobuf): a node's checkpoint file."""
    return recorddict_to_proto(records).SerializeToString()


def recorddict_of(data: bytes) -> RecordDict:
    """The RecordDict that :func:`recorddict_bytes` wrote."""
    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


#: the phase of the query a server sends every node before a run (is it there, which table does it serve)
HELLO_PHASE = "hello"
