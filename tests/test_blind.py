"""mapping.keys=blind (tpflower.blind): the same table mapping as HMAC, no secret shared by the owners, and
nothing a colluding owner and server can match against a third owner's keys."""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from flwr.app import RecordDict
from nacl import bindings as sodium

from simulations.deploy import deployment_overrides, write_client_configs
from simulations.federated import run_flower_simulation, run_in_process
from strategies.replies import ReplyError, check_reply
from strategies.setup import JoinSetup, key_mode
from tests.conftest import make_cfg
from tests.mapping_reference import SECRET, mapping_of
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, node
from tests.test_privacy_e2e import Recorded, raw_columns
from tests.test_schema_mapping import STAR, frames_star_mn, spec_of
from tpflower import blind
from tpflower.app.client_app import app as deployed_app
from tpflower.blind import SCALAR_FILE, as_array, blind_keys, hash_to_group, point_digests
from tpflower.config import compose_config
from tpflower.datasets import load_dataset
from tpflower.mapping import KeyProjection, TableMapping, build_mapping, canonical_tuples, key_codes, key_digests
from tpflower.owner import SECRET_ENV, load_owner_settings
from tpflower.phases.setup import blinding_scalar, reblind_keys
from tpflower.records import unpack_reply
from tpflower.schema import RelationalSpec, validate_tables
from tpflower.state import ClientState

# ------------------------------------------------------------------------------- the protocol, played out


class Transcript:
    """keys=blind played by fake owners (the real key and reblind handlers of tpflower.phases.setup) and the
    real server rounds (JoinSetup.blind_rounds); ``shards``: rows of a table split over that many clients.
    Keeps everything the server saw (``seen``) and each client's scalar."""

    def __init__(self, spec: RelationalSpec, frames: Mapping[str, pd.DataFrame], shards: Mapping[str, int] = {}):
        self.clients: dict[tuple[str, int], SimpleNamespace] = {}
        self.rows: dict[tuple[str, int], np.ndarray] = {}
        for t in spec.table_names:
            for q, ids in enumerate(np.array_split(np.arange(len(frames[t])), shards.get(t, 1))):
                owner = SimpleNamespace(state_dir=None, keys="blind", threads=None, peers=None, deployed=False)
                settings = SimpleNamespace(spec=spec, table=t, shard=q, owner=owner)
                self.clients[(t, q)] = SimpleNamespace(settings=settings, state=ClientState(RecordDict()))
                self.rows[(t, q)] = ids
        self.seen: list[tuple[int, np.ndarray]] = []  # (join, points) of every message
        replies = {}
        for (t, q), client in self.clients.items():
            out: dict[str, np.ndarray] = {"row_ids": self.rows[(t, q)]}
            frame = frames[t].iloc[self.rows[(t, q)]]
            for k, j in enumerate(spec.joins):
                if t in (j.left, j.right):
                    out[f"code.{k}"], out[f"blind.{k}"] = blind_keys(frame, j.columns_of(t), blinding_scalar(client))
                    self.seen.append((k, out[f"blind.{k}"]))
            replies[(t, q)] = (out, {})

        def send(messages):
            back = {}
            for key, (arrays, config) in messages.items():
                back[key] = reblind_keys(self.clients[key], arrays, config)
                for name in arrays:
                    self.seen += [
                        (int(name.split(".")[1]), arrays[name]),
                        (int(name.split(".")[1]), back[key][0][name]),
                    ]
            return back

        JoinSetup(send, spec, {}, list(self.clients), {}).blind_rounds(replies)
        projections: dict[str, list[KeyProjection]] = {t: [] for t in spec.table_names}
        for (t, _), (arrays, _) in replies.items():
            digests = {int(n.split(".")[1]): d for n, d in arrays.items() if n.startswith("digest.")}
            codes = {k: arrays[f"code.{k}"] for k in digests}
            projections[t].append(KeyProjection(t, arrays["row_ids"], codes, digests))
        self.mapping: TableMapping = build_mapping(spec, projections)

    def scalar(self, table: str, shard: int = 0) -> bytes:
        return blinding_scalar(self.clients[(table, shard)])


def assert_same_mapping(a: TableMapping, b: TableMapping) -> None:
    assert a.n_rows == b.n_rows and a.N == b.N
    for t in a.p:
        np.testing.assert_array_equal(a.p[t], b.p[t], err_msg=f"p[{t}]")


def frames_chain_snowflake() -> tuple[RelationalSpec, dict[str, pd.DataFrame]]:
    """fact -(k1)- A -(k2)- B (a chain through A), fact -(k3)- C (snowflake arm), composite key (k1, k3) to D."""
    rng = np.random.default_rng(3)
    n = 400
    fact = pd.DataFrame({"k1": rng.integers(0, 30, n), "k3": rng.integers(0, 6, n), "y": rng.normal(size=n)})
    A = pd.DataFrame({"k1": np.arange(30), "k2": rng.integers(0, 8, 30), "xa": rng.normal(size=30)})
    B = pd.DataFrame({"k2": np.repeat(np.arange(8), 3), "xb": rng.normal(size=24)})  # many-to-many
    C = pd.DataFrame({"k3": np.arange(0, 6), "xc": rng.normal(size=6)})
    D = pd.DataFrame({"k1": rng.integers(0, 30, 50), "k3": rng.integers(0, 6, 50), "xd": rng.normal(size=50)})
    D["k1"] = D["k1"].astype("int32")  # another integer width: still the same key
    frames = {"fact": fact, "A": A, "B": B, "C": C, "D": D}
    spec = spec_of(
        tables={
            "fact": {},
            "A": {"numeric": ["xa"]},
            "B": {"numeric": ["xb"]},
            "C": {"numeric": ["xc"]},
            "D": {"numeric": ["xd"]},
        },
        joins=[
            {"left": "fact", "right": "A", "on": "k1"},
            {"left": "A", "right": "B", "on": "k2"},
            {"left": "fact", "right": "C", "on": "k3"},
            {"left": "fact", "right": "D", "on": ["k1", "k3"]},
        ],
    )
    return validate_tables(spec, frames), frames


def test_blind_mapping_equals_hmac_on_star_many_to_many():
    frames = frames_star_mn()
    spec = validate_tables(spec_of(**STAR), frames)
    assert_same_mapping(Transcript(spec, frames).mapping, mapping_of(spec, frames))


def test_blind_mapping_equals_hmac_on_chain_snowflake_and_composite_keys():
    spec, frames = frames_chain_snowflake()
    hmac_mapping = mapping_of(spec, frames)
    assert hmac_mapping.N > 0
    assert_same_mapping(Transcript(spec, frames).mapping, hmac_mapping)


def test_blind_mapping_with_sharded_tables_blinds_by_every_shard():
    """A table split over several clients (each its own scalar): every list is blinded by every client of the
    join's tables, over several reblind rounds, and the mapping is still the HMAC one."""
    spec, frames = frames_chain_snowflake()
    assert_same_mapping(Transcript(spec, frames, shards={"fact": 3, "B": 2}).mapping, mapping_of(spec, frames))


@pytest.mark.parametrize("dataset", ["synthetic", "movielens", "nycflights13", "nycflights13_delayed"])
def test_blind_mapping_equals_hmac_on_bundled_datasets(dataset):
    spec, frames = load_dataset(compose_config(f"dataset={dataset}").dataset)
    frames = {t: f.reset_index(drop=True) for t, f in frames.items()}
    assert_same_mapping(Transcript(spec, frames).mapping, mapping_of(spec, frames))


# ------------------------------------------------------------------------------- a colluding owner and server


def test_a_colluding_owner_and_server_recover_no_key_of_a_third_owner():
    """Star fact -(a)- A, fact -(b)- B. Owner A hands its scalar to the server, which holds every message of
    the protocol. A dictionary of every possible value of B's key, raised to A's scalar (and to nothing), matches
    none of the points it saw of B's keys; under HMAC the leaked secret recovers every one of B's keys."""
    frames = frames_star_mn()
    spec = validate_tables(spec_of(**STAR), frames)
    run = Transcript(spec, frames)
    b_keys = set(frames["B"]["b"].tolist())
    dictionary = pd.DataFrame({"b": np.arange(-1000, 1000)})  # every value B's key could take, and more
    _, tuples, kinds = key_codes(dictionary, ["b"])
    plain = hash_to_group(canonical_tuples(tuples, kinds))
    a_scalar = run.scalar("A")
    guesses = {
        *plain,
        *(sodium.crypto_scalarmult(a_scalar, p) for p in plain),
    }
    seen = {bytes(row) for k, arr in run.seen if k == 1 for row in arr}  # every point of B's join (fact-B)
    seen |= {bytes(d) for d in point_digests(as_array(list(seen))).view(np.uint8).reshape(-1, 16)}
    guesses |= {bytes(d) for d in point_digests(as_array(list(guesses))).view(np.uint8).reshape(-1, 16)}
    assert len(seen) > 0 and not guesses & seen  # 0 of B's keys recovered

    # HMAC with the secret leaked by A: the server's dictionary recovers all of B's key values
    leaked = key_digests(dictionary, ["b"], SECRET)
    sent = key_digests(frames["B"], ["b"], SECRET)
    table = {tuple(d): v for d, v in zip(leaked.tolist(), dictionary["b"])}
    recovered_hmac = {table[tuple(d)] for d in sent.tolist() if tuple(d) in table}
    assert recovered_hmac == b_keys


def test_a_colluding_owner_learns_only_the_intersection_with_its_own_keys():
    """Same edge: owner fact colludes. The fully blinded points of C's keys match fact's only on the keys both
    hold (what the join itself tells); C's keys outside fact's set stay unmatched."""
    frames = frames_star_mn()
    frames["C"] = pd.DataFrame({"c": np.arange(0, 40, 2), "xc": np.zeros(20)})  # keys 16..38 fact does not hold
    spec = validate_tables(spec_of(**STAR), frames)
    run = Transcript(spec, frames)
    assert_same_mapping(run.mapping, mapping_of(spec, frames))
    joined_c = set(frames["C"]["c"].iloc[np.unique(run.mapping.p["C"])].tolist())
    assert joined_c == set(frames["C"]["c"]) & set(frames["fact"]["c"])
    assert joined_c != set(frames["C"]["c"])


# ------------------------------------------------------------------------------- the scalar stays on the node


def test_scalars_never_leave_the_nodes_and_no_key_column_is_sent():
    rec = Recorded("algorithm=admm", "dataset=synthetic", "epochs=1", "mapping.keys=blind")
    scalars = {k: bytes.fromhex(ClientState(c.state).scalar("blind.scalar")) for k, c in rec.contexts.items()}
    assert len(set(scalars.values())) == len(scalars)  # one scalar per node
    phases = {p for _, p, _, _ in rec.sent}
    assert {"keys", "reblind"} <= phases
    for key, phase, arrays, metrics in rec.sent:
        assert not any(n.startswith("digest.") for n in arrays) or phase != "keys"
        blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values()) + repr(metrics).encode()
        for s in scalars.values():
            assert s not in blob and s.hex().encode() not in blob, f"a scalar in {key}'s {phase} reply"
        if phase == "keys":
            assert all(arrays[n].dtype == np.uint16 for n in arrays if n.startswith("code."))  # few distinct keys
    for _, _, arrays, config in rec.got:  # nor in what the server sends
        blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values()) + repr(config).encode()
        assert not any(s in blob for s in scalars.values())
    keys, _, _ = raw_columns(rec)
    for key, phase, arrays, _ in rec.sent:
        for a in arrays.values():
            for name, col in keys.items():
                assert not (a.ndim == 1 and len(a) == len(col) and np.array_equal(a, col)), (name, key, phase)


def test_a_deployed_blind_node_needs_no_secret_and_keeps_its_scalar_0600(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)

    def blind(settings: dict) -> None:
        settings.pop("secret_file")
        settings["keys"] = "blind"

    context = node(tmp_path / "again", "d1", SYNTHETIC, SYNTHETIC, edit=blind)
    arrays = unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys"}).content)[0]
    assert {"row_ids", "code.0", "blind.0"} <= set(arrays) and not any(n.startswith("digest") for n in arrays)
    files = list(Path(tmp_path / "again").rglob(SCALAR_FILE))
    assert len(files) == 1
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    scalar = bytes.fromhex(files[0].read_text())
    assert scalar not in b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())


def test_owners_that_map_keys_differently_stop_the_run_naming_the_tables():
    replies = {("fact", 0): ({}, {"blind_keys": 1}), ("A", 0): ({}, {"blind_keys": 0}), ("B", 0): ({}, {})}
    with pytest.raises(ValueError, match=r"\(fact by blind; A, B by hmac\): set one `keys` on every node"):
        key_mode(replies)
    assert key_mode({("fact", 0): ({}, {"blind_keys": 1})}) == "blind"


def test_a_deployment_writes_blind_owners_without_a_shared_secret(tmp_path):
    paths = write_client_configs(deployment_overrides("dataset=synthetic"), tmp_path)
    settings = [yaml.safe_load(p.read_text()) for p in paths.values()]
    assert {s["keys"] for s in settings} == {"blind"} and not (tmp_path / "key").exists()
    assert len({s["secret_file"] for s in settings}) == len(settings)  # each owner its own, none shared
    hmac_paths = write_client_configs(deployment_overrides("dataset=synthetic mapping.keys=hmac"), tmp_path / "h")
    assert {yaml.safe_load(p.read_text())["secret_file"] for p in hmac_paths.values()} == {str(tmp_path / "h" / "key")}
    # the run's own bounds (the one-machine deployment's user is every owner): each node's settings keep them
    bounds = write_client_configs("dataset=synthetic min_group_rows=1 min_sketch_rows=3", tmp_path / "b")
    owners = [load_owner_settings(p, t) for (t, _), p in bounds.items()]
    assert {(o.min_group_rows, o.min_sketch_rows) for o in owners} == {(1, 3)}


def test_the_server_checks_blind_replies():

    pts = np.zeros((3, 32), dtype=np.uint8)
    ok = {"row_ids": np.arange(4), "code.0": np.array([0, 1, 2, 2], dtype=np.int32), "blind.0": pts}
    check_reply(("A", 0), ({}, {"phase": "keys"}), (ok, {}), None, None)
    bad = {**ok, "code.0": np.array([0, 1, 2, 3], dtype=np.int32)}
    with pytest.raises(ReplyError, match="'code.0' must hold codes into its 3 blinded values"):
        check_reply(("A", 0), ({}, {"phase": "keys"}), (bad, {}), None, None)
    sent = ({"pts.0.1": pts}, {"phase": "reblind"})
    with pytest.raises(ReplyError, match=r"'pts.0.1' has 2 rows; the round asked for 3 \(one per value sent\)"):
        check_reply(("A", 0), sent, ({"pts.0.1": pts[:2]}, {}), None, None)
    with pytest.raises(ReplyError, match="the round sent"):
        check_reply(("A", 0), sent, ({"pts.0.2": pts}, {}), None, None)


def test_reblind_refuses_a_join_its_table_is_not_in_and_non_points():
    frames = frames_star_mn()
    spec = validate_tables(spec_of(**STAR), frames)
    run = Transcript(spec, frames)
    client = run.clients[("A", 0)]
    with pytest.raises(ValueError, match=r"reblind sends 'pts.1.0'; it re-blinds only the keys of its joins"):
        reblind_keys(client, {"pts.1.0": np.zeros((1, 32), np.uint8)}, {"phase": "reblind"})
    with pytest.raises(ValueError, match="blinded key 0 is not a point of the group"):
        reblind_keys(client, {"pts.0.0": np.zeros((1, 32), np.uint8)}, {"phase": "reblind"})


@pytest.mark.slow
def test_a_blind_flower_simulation_trains_as_the_hmac_run(tmp_path):
    """keys=blind through Flower's simulation engine (keys, reblind and training messages): the same iterates
    as the HMAC run in process (the mapping is the same, p_i in the same order)."""
    overrides = ["algorithm=admm", "dataset=synthetic", "epochs=2"]
    blind = run_flower_simulation(make_cfg(*overrides, "mapping.keys=blind"), tmp_path, log=lambda _: None)
    hmac_run = run_in_process(make_cfg(*overrides, "mapping.keys=hmac"), None, log=lambda _: None).strategy.results
    np.testing.assert_allclose(
        [h.test_metric for h in blind.history], [h.test_metric for h in hmac_run.history], rtol=1e-6
    )


# ------------------------------------------------------------------------------- the group


def test_hash_to_group_is_libsodiums_point_in_montgomery_form_and_blinding_commutes():
    """H(k) is the u-coordinate of libsodium's hash to edwards25519 (converted as libsodium converts a public
    key); X25519 blinding commutes, and distinct keys give distinct blinded values."""
    encoded = [f"i{v}".encode() for v in range(300)]
    u = hash_to_group(encoded)
    for e, point in zip(encoded[:20], u[:20]):
        h = hashlib.sha512(blind._DOMAIN + e).digest()
        ed = ctypes.create_string_buffer(32)
        assert blind._FROM_HASH(ed, h) == 0 and sodium.crypto_core_ed25519_is_valid_point(ed.raw)
        assert point == sodium.crypto_sign_ed25519_pk_to_curve25519(ed.raw)
    a, b = blind.new_scalar(), blind.new_scalar()
    ab = blind.reblind(blind.reblind(as_array(u), a, "t"), b, "t")
    ba = blind.reblind(blind.reblind(as_array(u), b, "t"), a, "t")
    np.testing.assert_array_equal(ab, ba)
    assert len({bytes(r) for r in ab}) == len(encoded) and not np.array_equal(ab, as_array(u))


def test_blinding_on_any_number_of_threads_gives_the_same_values_and_the_owner_sets_them(tmp_path, monkeypatch):
    """tpflower.blind splits its work over threads (libsodium releases the GIL): 1, 2 or 3 threads give the
    same blinded values; a node's owner sets them (``threads``; default: the CPUs the node may run on), and a
    count that is not a whole number >= 1 is refused with one line."""
    encoded = [f"i{v}".encode() for v in range(3 * blind.TASK_VALUES + 5)]
    scalar = blind.new_scalar()
    values = [blind.blind_encoded(encoded, scalar, n) for n in (1, 2, 3)]
    for v in values[1:]:
        np.testing.assert_array_equal(v, values[0])
    np.testing.assert_array_equal(blind.reblind(values[0], scalar, "t", 1), blind.reblind(values[0], scalar, "t", 2))
    assert blind.threads(None) == len(os.sched_getaffinity(0)) and blind.threads(3) == 3
    used: list[int | None] = []
    real = blind._parallel
    monkeypatch.setattr(blind, "_parallel", lambda fn, items, n=None: used.append(n) or real(fn, items, n))

    def settings(threads):
        def edit(s: dict) -> None:
            s.pop("secret_file")
            s.update(keys="blind", threads=threads)

        return edit

    monkeypatch.delenv(SECRET_ENV, raising=False)
    context = node(tmp_path / "one", "d1", SYNTHETIC, SYNTHETIC, edit=settings(1))
    call(deployed_app, context, "train", {}, {"phase": "keys"})
    assert used and set(used) == {1}
    bad = node(tmp_path / "zero", "d1", SYNTHETIC, SYNTHETIC, edit=settings(0))
    with pytest.raises(ValueError, match=r"threads must be a whole number >= 1, got 0"):
        call(deployed_app, bad, "query", {}, {"phase": "hello"})
