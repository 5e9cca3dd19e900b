"""Blinded join keys: table mapping without a secret shared by the owners (docs/algorithms.md, Blinded keys).

Commutative blinding in the prime-order group of Curve25519 (libsodium, the copy PyNaCl ships; no curve
arithmetic here). A key value k maps to the point H(k): libsodium's hash to the group of edwards25519
(``crypto_core_ed25519_from_hash``: two Elligator maps of SHA-512(domain, k), added, cofactor cleared), carried
to its Montgomery u-coordinate (RFC 7748, Sec. 4.1). An owner with the private scalar a sends X25519(a, H(k))
= H(k)^a, the owners on the other side of the join raise it to their scalars with X25519 (the cheapest
scalar multiplication libsodium has: no point decoding or subgroup check per value), and the fully blinded
value H(k)^(a b ...) is equal for equal keys whatever the order (X25519 clamps a scalar to a multiple of 8
below 2^255: [a'][b']P = [b'][a']P). Nobody inverts a blinded value without every scalar of that key (the
Diffie-Hellman problem), so the server, or an owner holding the server's view and its own scalar, cannot test
guesses against another owner's keys (Hazay and Lindell, "Efficient protocols for set intersection", 2008;
Meadows 1986, DH-based PSI). A value sent for re-blinding that is not on the curve lies on its twist, whose
prime-order part is as hard (Curve25519 is twist-secure): the answer reveals nothing of the scalar; small-order
values are refused.

Blinding runs once per distinct key value, not per row: :func:`blind_keys` factorizes the key tuples, shuffles
the distinct values (the server learns nothing from their order) and returns each row's code into the
shuffled list. The private scalar never leaves the node: :func:`node_scalar` keeps it in the owner's
``state_dir`` (mode 0600), created on first use.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nacl._sodium
import numpy as np
import pandas as pd
from nacl import bindings as sodium

from tpflower.mapping import DIGEST_WORDS, canonical_tuples, code_dtype, key_codes, shuffled

POINT_BYTES = 32
SCALAR_FILE = "blind.key"
_DOMAIN = b"tpflower join key v2\x1f"
_P = 2**255 - 19  # the field of Curve25519 (RFC 7748)
_Y_BITS = (1 << 255) - 1  # an edwards25519 encoding: y, and the sign of x in the top bit


#: values per task of :func:`_parallel` (libsodium releases the GIL: the node's cores share the work)
TASK_VALUES = 4096


def threads(asked: int | None = None) -> int:
    """The threads blinding runs on: ``asked`` (the owner's ``threads`` setting), else the CPUs this process
    may run on (its affinity mask)."""
    if asked is not None:
        return max(1, int(asked))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - a platform without affinity masks
        return os.cpu_count() or 1


def _parallel(
    fn: Callable[[Sequence[bytes]], list[bytes]], items: Sequence[bytes], n_threads: int | None = None
) -> list[bytes]:
    """``fn`` over consecutive slices of ``items`` on ``n_threads`` threads (:func:`threads`), in order."""
    n_threads = threads(n_threads)
    if len(items) <= TASK_VALUES or n_threads == 1:
        return fn(items)
    parts = [items[i : i + TASK_VALUES] for i in range(0, len(items), TASK_VALUES)]
    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        return [x for part in pool.map(fn, parts) for x in part]


def _libsodium_from_hash() -> Callable[[ctypes.Array, bytes], int]:
    """libsodium's hash to edwards25519 (64 bytes in, a point of the prime-order group out). PyNaCl ships
    libsodium but binds only the one-map ``from_uniform``; the two-map hash (a random oracle to the group, what
    DH blinding needs) is called in the same library (ctypes releases the GIL)."""
    fn = getattr(ctypes.CDLL(nacl._sodium.__file__), "crypto_core_ed25519_from_hash", None)
    if fn is None:  # pragma: no cover - a PyNaCl build without the symbol
        raise ImportError("keys=blind needs libsodium's crypto_core_ed25519_from_hash (PyNaCl >= 1.5)")
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int
    return fn


_FROM_HASH = _libsodium_from_hash()


def new_scalar() -> bytes:
    """A fresh private scalar: 32 bytes of OS entropy (an X25519 private key; X25519 clamps it)."""
    while True:
        s = os.urandom(sodium.crypto_scalarmult_SCALARBYTES)
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
    if len(value) != sodium.crypto_scalarmult_SCALARBYTES or not any(value):
        raise ValueError(f"{path}: not a blinding scalar (64 hex digits); delete it to create a new one")
    return value


def edwards_to_montgomery(points: Sequence[bytes]) -> list[bytes]:
    """The Curve25519 u-coordinates u = (1 + y) / (1 - y) (RFC 7748, Sec. 4.1) of edwards25519 points of the
    prime-order group (not the identity), one field inversion for all (Montgomery's batch inversion)."""
    ys = [int.from_bytes(p, "little") & _Y_BITS for p in points]
    den = [(1 - y) % _P for y in ys]
    prefix, acc = [], 1
    for d in den:
        prefix.append(acc)
        acc = acc * d % _P
    if acc == 0:
        raise ValueError("the identity point has no Montgomery u-coordinate")
    inv = pow(acc, -1, _P)  # 1 / (den_0 ... den_{n-1})
    out = [b""] * len(ys)
    for i in range(len(ys) - 1, -1, -1):
        out[i] = ((1 + ys[i]) * inv * prefix[i] % _P).to_bytes(POINT_BYTES, "little")
        inv = inv * den[i] % _P
    return out


def _hash_to_group(encoded: Sequence[bytes]) -> list[bytes]:
    buf = ctypes.create_string_buffer(POINT_BYTES)
    points = []
    for e in encoded:
        _FROM_HASH(buf, hashlib.sha512(_DOMAIN + e).digest())
        points.append(buf.raw)
    return edwards_to_montgomery(points)


def hash_to_group(encoded: Sequence[bytes], n_threads: int | None = None) -> list[bytes]:
    """H(k) for canonical key encodings: libsodium's hash to edwards25519 of SHA-512(domain, k), as a
    Curve25519 u-coordinate."""
    return _parallel(_hash_to_group, encoded, n_threads)


def _multiply(scalar: bytes, points: Sequence[bytes], n_threads: int | None = None) -> list[bytes]:
    """X25519(scalar, point) for every point (in parallel); libsodium refuses a small-order point (its
    product is zero): ValueError with the position of the first one."""
    try:
        return _parallel(lambda part: _times(scalar, part), points, n_threads)
    except Exception:  # libsodium's non-zero return (a small-order point), raised by PyNaCl
        bad = next((i for i, p in enumerate(points) if _small_order(scalar, p)), "?")
        raise ValueError(f"blinded key {bad} is not a point of the group") from None


def _times(scalar: bytes, points: Sequence[bytes]) -> list[bytes]:
    """X25519(scalar, point) of every point, in this thread."""
    mult = sodium.crypto_scalarmult
    return [mult(scalar, p) for p in points]


def _small_order(scalar: bytes, point: bytes) -> bool:
    try:
        sodium.crypto_scalarmult(scalar, point)
    except Exception:
        return True
    return False


def as_array(points: Sequence[bytes]) -> np.ndarray:
    """Points as a (n, 32) uint8 array (the message payload)."""
    return np.frombuffer(b"".join(points), dtype=np.uint8).reshape(-1, POINT_BYTES).copy()


def reblind(points: np.ndarray, scalar: bytes, where: str, n_threads: int | None = None) -> np.ndarray:
    """Raise every point (u-coordinate) of a (n, 32) uint8 array to ``scalar`` (on ``n_threads`` threads,
    :func:`threads`); a small-order point is refused (ValueError naming ``where``)."""
    points = np.ascontiguousarray(points, dtype=np.uint8)
    if points.ndim != 2 or points.shape[1] != POINT_BYTES:
        raise ValueError(f"{where}: blinded keys must be an (n, {POINT_BYTES}) byte array, got {points.shape}")
    blob = points.tobytes()
    try:
        out = _multiply(scalar, [blob[i : i + POINT_BYTES] for i in range(0, len(blob), POINT_BYTES)], n_threads)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return as_array(out)


def blind_keys(
    frame: pd.DataFrame, columns: Sequence[str], scalar: bytes, seed: bytes | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(codes, points): each row's position (:func:`tpflower.mapping.code_dtype`) in the shuffled list of its
    table's distinct key tuples, and that list as H(k)^scalar ((n_distinct, 32) uint8). The shuffle uses OS
    entropy, or the node's secret ``seed`` (the same list again)."""
    codes, tuples, kinds = key_codes(frame, columns)
    points = as_array(_multiply(scalar, hash_to_group(canonical_tuples(tuples, kinds))))
    rank, order = shuffled(len(points), seed)
    return rank.astype(code_dtype(len(points)))[codes], points[order]


def blind_encoded(encoded: Sequence[bytes], scalar: bytes, n_threads: int | None = None) -> np.ndarray:
    """H(k)^scalar of canonical key encodings ((n, 32) uint8, in order): each slice hashed to the group and
    multiplied in one task on ``n_threads`` threads (:func:`threads`; H(k) is never small-order)."""
    return as_array(_parallel(lambda part: _times(scalar, _hash_to_group(part)), encoded, n_threads))


def point_digests(points: np.ndarray) -> np.ndarray:
    """128-bit digests of fully blinded points ((n, 2) uint64), the form the server's mapping build joins on."""
    blob = np.ascontiguousarray(points, dtype=np.uint8).tobytes()
    blob = b"".join(hashlib.sha256(blob[i : i + POINT_BYTES]).digest()[:16] for i in range(0, len(blob), POINT_BYTES))
    return np.frombuffer(blob, dtype="<u8").reshape(-1, DIGEST_WORDS)
