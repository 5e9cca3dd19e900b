"""Signed re-blinding lists (docs/threat-model.md, Blinded join keys; docs/algorithms.md, Blinded keys).

Under ``keys: blind`` an owner raises the lists the server routes to it to its own scalar. A list the server
made itself (H(k')^x for guesses k') would come back raised to the owner's scalar and test the guesses against
that owner's keys, so each owner signs every slice of a list it sends for re-blinding (its own blinded keys in
the keys reply, or a list it re-blinded) with an Ed25519 key of its own (PyNaCl), and an owner re-blinds a
slice only when the signature verifies against a peer key its own settings name (``peers``: the federation's
members, exchanged out of band as the CA certificate is; ``simulations.deploy`` fills them in). The signed
statement binds the list's origin, its signer, the join, the list's announced length, the slice's position and
the SHA-256 of its values, so a slice cannot be moved to another join, list, position or length.

The signing key lives in the owner's ``state_dir`` (``sign.key``, 0600, created on first use); a simulated node
without a state_dir keeps one in its memory for the run (the user plays every owner; no peers to check).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

SIGNING_KEY_FILE = "sign.key"
_DOMAIN = b"tpflower re-blinding list v1\x1f"


def node_signing_key(state_dir: str | Path) -> SigningKey:
    """The owner's Ed25519 signing key in ``state_dir``/sign.key (its 32-byte seed in hex, 0600), created on
    first use."""
    path = Path(state_dir) / SIGNING_KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
    seed = bytes.fromhex(path.read_text().strip())
    if len(seed) != 32:
        raise ValueError(f"{path}: not a signing key (64 hex digits); delete it to create a new one")
    return SigningKey(seed)


def verify_key_hex(key: SigningKey) -> str:
    """What the owner hands its peers out of band (their settings' ``peers`` entry for its node)."""
    return key.verify_key.encode().hex()


def node_name(table: str, shard: int) -> str:
    """A node's name in a signed statement and in an owner's ``peers``: ``table/shard``."""
    return f"{table}/{int(shard)}"


def statement(origin: str, signer: str, join: int, n: int, lo: int, values: np.ndarray) -> bytes:
    """What a signature covers: the list's origin node, the signing node, the join, the list's length, the
    slice's first position and the SHA-256 of the slice's values."""
    head = f"{origin}\x1f{signer}\x1f{int(join)}\x1f{int(n)}\x1f{int(lo)}\x1f".encode()
    return _DOMAIN + head + hashlib.sha256(np.ascontiguousarray(values).tobytes()).digest()


def sign(key: SigningKey, message: bytes) -> str:
    """The detached signature of ``message`` in hex (a metric: metrics carry no bytes)."""
    return key.sign(message).signature.hex()


def verifies(peer_hex: str, signature_hex: str, message: bytes) -> bool:
    """Whether ``signature_hex`` is the peer's signature of ``message``."""
    try:
        VerifyKey(bytes.fromhex(peer_hex)).verify(message, bytes.fromhex(signature_hex))
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True
