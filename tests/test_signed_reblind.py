"""Re-blinding only of lists another owner signed (tpflower.signing), on the deployed client path.

Main re-blinded any list the server sent: the server hashed 30,000 candidate key values, sent them as three
lists under fresh names and compared the answers with the owner's own keys reply: 300 of 300 of the victim's
join keys recovered, 0 false, in 3 messages. Now a node re-blinds a slice only when another node of the
federation signed it (a verify key its owner's ``peers`` name, which simulations.deploy fills in), for a join
both tables take part in, of the length the signer announced, once per origin and join in a run.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from nacl.signing import SigningKey

from tests.test_conformance import call
from tests.test_curious_server import node
from tpflower.app.client_app import app as deployed_app
from tpflower.blind import blind_encoded, new_scalar
from tpflower.mapping import encode_values
from tpflower.records import unpack_reply
from tpflower.schema import key_kind
from tpflower.signing import sign, statement

BLIND = "algorithm=admm dataset=synthetic mapping.keys=blind"
JOIN = 0  # fact - d1


def keys_reply(context) -> tuple[dict, dict]:
    return unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys"}).content)


def reblind(context, lists: dict[str, np.ndarray], extra: dict | None = None) -> tuple[dict, dict]:
    config = {"phase": "reblind", "chunk": 0, "chunk_rows": 0, **{f"n.{n}": len(p) for n, p in lists.items()}}
    return unpack_reply(call(deployed_app, context, "train", lists, {**config, **(extra or {})}).content)


def provenance(name: str, origin: str, signer: str, signature: str) -> dict[str, str]:
    return {f"origin.{name}": origin, f"signer.{name}": signer, f"sig.{name}": signature}


@pytest.fixture
def nodes(tmp_path):
    """The victim d1 and its peer fact (the join fact - d1), deployed with keys: blind; each has sent keys."""
    victim, peer = (node(tmp_path, t, BLIND, BLIND) for t in ("d1", "fact"))
    return (victim, *keys_reply(victim)), (peer, *keys_reply(peer))


def assert_one_line_without_digits(line: str) -> None:
    assert "\n" not in line
    kind = re.sub(r"^table '[^']*' shard \d+: ", "", line)
    assert not re.search(r"\d", re.sub(r"'pts\.\d+\.\d+'|'\w+/\d+'", "", kind)), line  # a list's, a peer's name


def test_a_dictionary_of_guessed_keys_recovers_nothing(nodes):
    """30,000 guesses (the victim's own 300-odd key values among them), blinded with the server's own scalar,
    sent as three lists under fresh names: refused, unsigned; at most 1% of the victim's keys recovered (0)."""
    (victim, arrays, _), _ = nodes
    own = np.unique(np.asarray(arrays[f"blind.{JOIN}"]), axis=0)
    keys = np.arange(30_000)  # the synthetic schema's keys are small integers: the true ones are among these
    x = new_scalar()
    guesses = blind_encoded(encode_values(pd.Index(keys), key_kind(keys.dtype)), x)
    recovered = 0
    for i, part in enumerate(np.array_split(guesses, 3)):
        name = f"pts.{JOIN}.{7 + i}"
        for claim in ({}, provenance(name, "fact/0", "fact/0", "00" * 64)):  # unsigned; claiming the peer's name
            with pytest.raises(ValueError) as refusal:
                reblind(victim, {name: part}, claim)
            assert re.search(r"is not (signed by a peer|another owner's list)", str(refusal.value))
            assert_one_line_without_digits(str(refusal.value))
    assert recovered <= 0.01 * len(own)


def test_a_peers_signed_list_is_reblinded_once_and_anything_else_refused(nodes):
    """The honest hop: the peer's signed list is re-blinded, with the re-blinder's signature for the next hop.
    Refused: the same origin's list again in the run (under a fresh name), a list signed by a key no peer
    entry names, a list longer than its signer announced, the victim's own list sent back to it."""
    (victim, v_arrays, v_metrics), (_, p_arrays, p_metrics) = nodes
    points = np.asarray(p_arrays[f"blind.{JOIN}"])
    signed = provenance(f"pts.{JOIN}.0", "fact/0", "fact/0", p_metrics[f"sig.{JOIN}"])
    longer = np.concatenate([points, points[:1]])
    with pytest.raises(ValueError, match="is not signed by a peer"):  # longer than announced: its signature fails
        reblind(victim, {f"pts.{JOIN}.0": longer}, signed)
    rogue = SigningKey.generate()
    forged = sign(rogue, statement("fact/0", "fact/0", JOIN, len(points), 0, points))
    with pytest.raises(ValueError, match="is not signed by a peer") as refusal:
        reblind(victim, {f"pts.{JOIN}.0": points}, provenance(f"pts.{JOIN}.0", "fact/0", "fact/0", forged))
    # the operator learns whose key to check (a node whose state_dir moved signs with a new key)
    assert "the signature of 'fact/0' does not verify with its peers key" in str(refusal.value)
    assert_one_line_without_digits(str(refusal.value))
    own = np.asarray(v_arrays[f"blind.{JOIN}"])
    mine = provenance(f"pts.{JOIN}.0", "d1/0", "d1/0", v_metrics[f"sig.{JOIN}"])
    with pytest.raises(ValueError, match="not another owner's list of this join"):
        reblind(victim, {f"pts.{JOIN}.0": own}, mine)
    out, metrics = reblind(victim, {f"pts.{JOIN}.0": points}, signed)
    assert out[f"pts.{JOIN}.0"].shape == points.shape and len(metrics[f"sig.pts.{JOIN}.0"]) == 128
    again = provenance(f"pts.{JOIN}.5", "fact/0", "fact/0", p_metrics[f"sig.{JOIN}"])
    with pytest.raises(ValueError) as refusal:
        reblind(victim, {f"pts.{JOIN}.5": points}, again)
    assert "a second list of one origin for one join" in str(refusal.value)
    assert_one_line_without_digits(str(refusal.value))


def test_a_node_without_peer_keys_reblinds_nothing(tmp_path):
    """A deployed owner whose settings name no peers re-blinds no list (the safe default)."""
    victim = node(tmp_path, "d1", BLIND, BLIND, edit=lambda s: s.pop("peers"))
    keys_reply(victim)
    with pytest.raises(ValueError, match=r"settings name no peer keys \(peers\)"):
        reblind(victim, {f"pts.{JOIN}.0": np.zeros((1, 32), np.uint8)})
