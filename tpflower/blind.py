"""Blinded join keys: table mapping without a secret shared by the owners (docs/algorithms.md, Blinded keys).

Commutative blinding in the prime-order group of edwards25519 (libsodium through PyNaCl; no curve arithmetic
here). A key value k maps to the point H(k) (hash to the group: two Elligator maps of a SHA-512 digest, added);
an owner with the private scalar a sends H(k)^a, the owners on the other side of the join raise it to their
scalars, and the fully blinded point H(k)^(a b ...) is equal for equal keys whatever the order. Nobody inverts
a blinded point without every scalar of that key (the discrete logarithm problem), so the server, or an owner
holding the server's view and its own scalar, cannot test guesses against another owner's keys
(Hazay and Lindell, "Efficient protocols for set intersection", 2008; Meadows 1986, DH-based PSI).

Blinding runs once per distinct key value, not per row: :func:`blind_keys` factorizes the key tuples, shuffles
the distinct values (the server learns nothing from their order) and returns each row's code into the
shuffled list. The private scalar never leaves the node: :func:`node_scalar` keeps it in the owner's
``state_dir`` (mode 0600), created on first use.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
from nacl import bindings as sodium

from tpflower.mapping import DIGEST_WORDS, canonical_tuples, key_codes

POINT_BYTES = 32
SCALAR_FILE = "blind.key"
_DOMAIN = b"tpflower join key v1\x1f"


#: values per task of :func:`_parallel` (libsodium releases the GIL: the node's cores share the work)
TASK_VALUES = 4096


def _parallel(fn: Callable[[Sequence[bytes]], list[bytes]], items: Sequence[bytes]) -> list[bytes]:
    """``fn`` over consecutive slices of ``items`` on the node's cores, results in order."""
    if len(items) <= TASK_VALUES:
        return fn(items)
    parts = [items[i : i + TASK_VALUES] for i in range(0, len(items), TASK_VALUES)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return [x for part in pool.map(fn, parts) for x in part]


def new_scalar() -> bytes:
    """A fresh private scalar, uniform mod the group order (64 bytes of OS entropy reduced); never zero."""
    while True:
        s = sodium.crypto_core_ed25519_scalar_reduce(os.urandom(64))
        if any(s):
            return s


def node_scalar(state_dir: str | Path) -> bytes:
    """The owner's private scalar in ``state_dir``/blind.key (hex, mode 0600), created on first use."""
    path = Path(state_dir) / SCALAR_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_scalar().hex())
    value = bytes.fromhex(path.read_text().strip())
    if len(value) != sodium.crypto_core_ed25519_SCALARBYTES or not any(value):
        raise ValueError(f"{path}: not a blinding scalar (64 hex digits); delete it to create a new one")
    return value


def _hash_to_group(encoded: Sequence[bytes]) -> list[bytes]:
    out = []
    for e in encoded:
        h = hashlib.sha512(_DOMAIN + e).digest()
        out.append(
            sodium.crypto_core_ed25519_add(
                sodium.crypto_core_ed25519_from_uniform(h[:32]), sodium.crypto_core_ed25519_from_uniform(h[32:])
            )
        )
    return out


def hash_to_group(encoded: Sequence[bytes]) -> list[bytes]:
    """H(k) for canonical key encodings: the sum of two Elligator maps of SHA-512(domain, k)."""
    return _parallel(_hash_to_group, encoded)


def _multiply(scalar: bytes, points: Sequence[bytes]) -> list[bytes]:
    """Every point raised to ``scalar`` (in parallel); libsodium refuses a byte string that is not a point of
    the prime-order group (ValueError with the position of the first one)."""

    def part(chunk: Sequence[bytes]) -> list[bytes]:
        return [sodium.crypto_scalarmult_ed25519_noclamp(scalar, p) for p in chunk]

    try:
        return _parallel(part, points)
    except Exception:  # libsodium refuses small-order and invalid points
        bad = next((i for i, p in enumerate(points) if not sodium.crypto_core_ed25519_is_valid_point(p)), "?")
        raise ValueError(f"blinded key {bad} is not a point of the group") from None


def as_array(points: Sequence[bytes]) -> np.ndarray:
    """Points as a (n, 32) uint8 array (the message payload)."""
    return np.frombuffer(b"".join(points), dtype=np.uint8).reshape(-1, POINT_BYTES).copy()


def reblind(points: np.ndarray, scalar: bytes, where: str) -> np.ndarray:
    """Raise every point of a (n, 32) uint8 array to ``scalar``; a byte string that is not a point of the
    prime-order group is refused (ValueError naming ``where``)."""
    points = np.ascontiguousarray(points, dtype=np.uint8)
    if points.ndim != 2 or points.shape[1] != POINT_BYTES:
        raise ValueError(f"{where}: blinded keys must be an (n, {POINT_BYTES}) byte array, got {points.shape}")
    blob = points.tobytes()
    try:
        out = _multiply(scalar, [blob[i : i + POINT_BYTES] for i in range(0, len(blob), POINT_BYTES)])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return as_array(out)


def blind_keys(frame: pd.DataFrame, columns: Sequence[str], scalar: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(codes, points): each row's position in the shuffled list of its table's distinct key tuples, and that
    list as H(k)^scalar ((n_distinct, 32) uint8). The shuffle uses OS entropy."""
    codes, tuples, kinds = key_codes(frame, columns)
    points = as_array(_multiply(scalar, hash_to_group(canonical_tuples(tuples, kinds))))
    order = np.random.default_rng(int.from_bytes(os.urandom(16), "little")).permutation(len(points))
    rank = np.empty(len(points), dtype=np.int64)
    rank[order] = np.arange(len(points))
    return rank[codes].astype(np.int32 if len(points) < 2**31 else np.int64), points[order]


def point_digests(points: np.ndarray) -> np.ndarray:
    """128-bit digests of fully blinded points ((n, 2) uint64), the form the server's mapping build joins on."""
    points = np.ascontiguousarray(points, dtype=np.uint8)
    blob = b"".join(hashlib.sha256(points[i].tobytes()).digest()[:16] for i in range(len(points)))
    return np.frombuffer(blob, dtype="<u8").reshape(-1, DIGEST_WORDS)
