"""A client's state between Flower messages: named arrays and scalars in ``context.state`` (Flower rebuilds the
client object per message), and the typed per-family records (:class:`StateRecord`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.common import Array, ArrayRecord, ConfigRecord, RecordDict

from tpflower.records import npy_array, npy_bytes


def _array(value: np.ndarray) -> Array:
    """A Flower Array of ``value``, as ``Array(value)`` makes it (its ``np.save`` bytes) at half the cost: the
    bytes written by tpflower.records.npy_bytes (a state written per message adds up)."""
    value = np.ascontiguousarray(value)
    return Array(str(value.dtype), tuple(value.shape), "numpy.ndarray", npy_bytes(value))


def _numpy(array: Array) -> np.ndarray:
    """A writable copy of a Flower Array's ndarray, as ``Array.numpy()`` gives, with the header read by a
    pattern (tpflower.records.npy_array) rather than parsed as Python: a state read per message adds up."""
    if array.stype != "numpy.ndarray":
        return array.numpy()
    return npy_array(array.data).copy()


class ClientState:
    """Named ndarrays and scalars in a Flower RecordDict (context.state)."""

    def __init__(self, records: RecordDict):
        self.records = records

    def get(self, name: str) -> np.ndarray | None:
        rec = self.records.get(f"arr.{name}")
        return None if rec is None else _numpy(rec["a"])

    def put(self, name: str, value: np.ndarray) -> None:
        self.records[f"arr.{name}"] = ArrayRecord(array_dict={"a": _array(value)})

    def scalar(self, name: str, default: Any = None) -> Any:
        rec = self.records.get("scalars")
        return default if rec is None else rec.get(name, default)

    def set_scalar(self, name: str, value: Any) -> None:
        self.set_scalars({name: value})

    def set_scalars(self, values: Mapping[str, Any]) -> None:
        rec = self.records.get("scalars") or ConfigRecord()
        for name, value in values.items():
            rec[name] = value
        self.records["scalars"] = rec

    def load_model(self, model: torch.nn.Module) -> bool:
        rec = self.records.get("theta")
        if rec is None:
            return False
        model.load_state_dict(rec.to_torch_state_dict())
        return True

    def put_list(self, name: str, values: list[np.ndarray]) -> None:
        arrays = {str(k): _array(v) for k, v in enumerate(values)}
        self.records[f"list.{name}"] = ArrayRecord(array_dict=arrays)

    def get_list(self, name: str) -> list[np.ndarray] | None:
        rec = self.records.get(f"list.{name}")
        return None if rec is None else [_numpy(rec[str(k)]) for k in range(len(rec))]

    def save_model(self, model: torch.nn.Module) -> None:
        self.records["theta"] = ArrayRecord(torch_state_dict={k: v.cpu() for k, v in model.state_dict().items()})


S = TypeVar("S", bound="StateRecord")


@dataclass
class StateRecord:
    """A family's typed client state, kept in context.state: ndarray fields in one ArrayRecord, the other
    fields (int, float, str) in one ConfigRecord, both named after the class."""

    @classmethod
    def load(cls: type[S], state: ClientState) -> S | None:
        arrays = state.records.get(f"{cls.__name__}.arrays")
        scalars = state.records.get(f"{cls.__name__}.scalars")
        if arrays is None and scalars is None:
            return None
        values = {k: _numpy(a) for k, a in (arrays or {}).items()}
        values.update(dict(scalars or {}))
        return cls(**{f.name: values.get(f.name) for f in fields(cls)})

    @classmethod
    def required(cls: type[S], state: ClientState, table: str, missing: str) -> S:
        """The state, or a RuntimeError naming the table and the step that came before its setup (``missing``)."""
        found = cls.load(state)
        if found is None:
            raise RuntimeError(f"table {table!r}: {missing}")
        return found

    def save(self, state: ClientState) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        arrays = {k: _array(v) for k, v in values.items() if isinstance(v, np.ndarray)}
        state.records[f"{type(self).__name__}.arrays"] = ArrayRecord(array_dict=arrays)
        state.records[f"{type(self).__name__}.scalars"] = ConfigRecord(
            {k: v for k, v in values.items() if k not in arrays and v is not None}
        )
