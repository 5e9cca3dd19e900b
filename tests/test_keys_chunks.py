"""The keys reply in chunks (mapping.keys_chunk_rows): the same mapping as one message, in both key modes and
both scenarios; the client refuses chunk requests out of order, twice or beyond its table."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from simulations.federated import in_process_contexts, run_in_process
from simulations.predict import predict_run
from strategies import predict as predict_strategy
from strategies import setup as setup_strategy
from strategies.key_chunks import gather_chunks
from strategies.replies import ReplyError, check_reply
from strategies.setup import JoinSetup
from strategies.transport import DirectTransport, RunError
from tests.conftest import make_cfg
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, node, refused
from tests.test_predict import QUIET, held_out_rows, train
from tpflower import blind, label_dp
from tpflower.app.client_app import app as deployed_app
from tpflower.app.client_app import client_app_for
from tpflower.app.server_app import make_strategy
from tpflower.phases import setup as setup_phases
from tpflower.records import unpack_payload, unpack_reply
from tpflower.signing import SIGNING_KEY_FILE, node_signing_key, sign, statement


def setup_of(*overrides: str):
    """The server's setup (mapping, train/test partition, labels) of a run with ``overrides`` (no training)."""
    run = run_in_process(make_cfg("algorithm=admm", "epochs=1", *overrides), None, log=lambda _: None)
    return run.strategy.join


@pytest.mark.parametrize(
    "keys, scenario, privacy",
    [
        ("hmac", "join", "none"),
        ("blind", "join", "none"),
        ("hmac", "ucq", "none"),
        ("blind", "ucq", "none"),
        ("hmac", "join", "label"),  # label DP: the training rows' labels only, chunked by the training rows
    ],
)
def test_chunked_keys_give_the_same_mapping(keys, scenario, privacy, monkeypatch):
    """7-row chunks: every table of the synthetic dataset (hundreds of rows, shards in the union) sends its
    keys in many rounds; p_i, the train/test partition and the labels equal those of one message per client."""
    common = ("dataset=synthetic", f"scenario={scenario}", f"mapping.keys={keys}", f"privacy={privacy}")
    common += ("privacy.label_range=[-20,20]",) if privacy == "label" else ()
    draws = iter(range(1_000_000))  # label DP: the n-th draw of a run the same in both runs; a redraw differs
    monkeypatch.setattr(label_dp.dp, "label_rng", lambda: np.random.default_rng(next(draws)))
    whole = setup_of(*common)
    draws = iter(range(1_000_000))
    served: list[int] = []
    real = setup_phases.key_chunk

    def spy(out, j, chunk_rows):
        served.append(j)
        if j == 2:  # as if another process answered: the payload recomputed from the node's shuffle seed
            setup_phases._PAYLOADS.clear()
        return real(out, j, chunk_rows)

    monkeypatch.setattr(setup_phases, "key_chunk", spy)
    chunked = setup_of(*common, "mapping.keys_chunk_rows=7")
    n_rows = sum(whole.client_rows.values())
    assert len(served) == sum(-(-n // 7) - 1 for n in whole.client_rows.values()) and len(served) > n_rows / 8
    for a, b in ((whole.mapping, chunked.mapping), (whole.train, chunked.train), (whole.test, chunked.test)):
        assert a.n_rows == b.n_rows and a.N == b.N
        for t in a.p:
            np.testing.assert_array_equal(a.p[t], b.p[t], err_msg=f"p[{t}]")
    np.testing.assert_array_equal(whole.y_train, chunked.y_train)
    np.testing.assert_array_equal(np.asarray(whole.y_test), np.asarray(chunked.y_test))
    for k, (idx, pos) in whole.evaluation_split.items():  # label DP: the test rows the label owner scores
        np.testing.assert_array_equal(idx, chunked.evaluation_split[k][0])
        np.testing.assert_array_equal(pos, chunked.evaluation_split[k][1])
    assert whole.client_rows == chunked.client_rows
    for t, router in whole.routers.items():
        assert router.shards == chunked.routers[t].shards
        for q in router.shards:
            np.testing.assert_array_equal(router.ids[q], chunked.routers[t].ids[q])


def test_a_curious_server_gets_chunks_in_order_once_and_within_the_table(tmp_path):
    """A deployed node answers keys in 50-row chunks, in order only: a chunk out of order, one asked twice,
    one beyond its table and a chunk request to a node whose reply was whole are refused (table and shard
    named); the chunks put together are the node's rows, codes and digests."""
    context = node(tmp_path, "d1", SYNTHETIC, SYNTHETIC)
    first, metrics = unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys", "chunk_rows": 50}).content)
    n, n_chunks = int(metrics["n_rows"]), int(metrics["n_chunks"])
    assert n_chunks == -(-n // 50) > 2 and len(first["row_ids"]) == 50
    refused(
        deployed_app,
        context,
        "table 'd1' shard 0: keys_chunk asks for chunk 2 out of order",
        "train",
        config={"phase": "keys_chunk", "chunk": 2},
    )
    parts = [first]
    for j in range(1, n_chunks):
        parts.append(
            unpack_reply(call(deployed_app, context, "train", {}, {"phase": "keys_chunk", "chunk": j}).content)[0]
        )
        if j == 1:
            refused(
                deployed_app,
                context,
                "chunk 1 out of order or twice",
                "train",
                config={"phase": "keys_chunk", "chunk": 1},
            )
    refused(
        deployed_app,
        context,
        f"table 'd1' shard 0: keys_chunk asks for chunk {n_chunks}; its {n} rows make",
        "train",
        config={"phase": "keys_chunk", "chunk": n_chunks},
    )
    ids = np.concatenate([p["row_ids"] for p in parts])
    np.testing.assert_array_equal(ids, np.arange(n))
    digests = np.concatenate([p["digest.0"] for p in parts])
    assert len(digests) == metrics["n_values.0"] and len(np.unique(digests, axis=0)) == len(digests)
    codes = np.concatenate([p["code.0"] for p in parts])
    assert len(codes) == n and codes.max() == len(digests) - 1
    whole = node(tmp_path / "whole", "d1", SYNTHETIC, SYNTHETIC)
    call(deployed_app, whole, "train", {}, {"phase": "keys"})
    refused(
        deployed_app,
        whole,
        "answered by a table whose keys reply is chunked only",
        "train",
        config={"phase": "keys_chunk", "chunk": 1},
    )


def chunked_reply_of(n: int = 10, values: int = 4, chunk_rows: int = 4):
    """A client's keys reply of ``n`` rows in chunks of ``chunk_rows``: (chunk j -> arrays, chunk 0's metrics)."""
    rows = {"row_ids": np.arange(n, dtype=np.int32), "code.0": (np.arange(n) % values).astype(np.uint16)}
    digests = np.arange(2 * values, dtype=np.uint64).reshape(values, 2)
    first = {"n_rows": n, "n_chunks": -(-n // chunk_rows), "n_values.0": values}

    def chunk(j: int, drop: int = 0) -> dict:
        lo, hi = chunk_rows * j, chunk_rows * (j + 1)
        return {**{name: a[lo : hi - drop] for name, a in rows.items()}, "digest.0": digests[lo:hi]}

    return chunk, first, rows, digests


def gather(first_arrays: dict, first_metrics: dict, later, chunk_rows: int = 4) -> dict:
    """The server's gathering of one client's chunks (strategies.key_chunks.gather_chunks)."""
    replies = {("d1", 0): (first_arrays, dict(first_metrics))}
    send = lambda messages: {k: (later(c["chunk"]), {}) for k, (_, c) in messages.items()}  # noqa: E731
    gather_chunks(send, replies, chunk_rows)
    return replies[("d1", 0)][0]


def test_the_server_refuses_chunks_that_do_not_fill_what_chunk_0_announced():
    """A client whose later chunks hold fewer rows than its chunk 0 announced, or another array, stops the run
    at the keys round with one line naming it; whole chunks are put together in order and checked. The
    JoinSetup of a run asks for the chunk size of its mapping.keys_chunk_rows."""
    chunk, first, rows, digests = chunked_reply_of()
    spec = SimpleNamespace(label=SimpleNamespace(task="regression"))
    replies = {("d1", 0): (chunk(0), dict(first))}
    send = lambda messages: {k: (chunk(c["chunk"]), {}) for k, (_, c) in messages.items()}  # noqa: E731
    JoinSetup(send, spec, {"mapping": {"keys_chunk_rows": 4}}, [("d1", 0)], {}).gather_chunks(replies)
    got = replies[("d1", 0)][0]
    np.testing.assert_array_equal(got["row_ids"], rows["row_ids"])
    np.testing.assert_array_equal(got["code.0"], rows["code.0"])
    np.testing.assert_array_equal(got["digest.0"], digests)
    with pytest.raises(ReplyError, match=r"table 'd1' shard 0: keys chunk 1 array 'row_ids' .* \(4 entries after 4\)"):
        gather(chunk(0), first, lambda j: chunk(j, drop=int(j == 1)))
    with pytest.raises(ReplyError, match="table 'd1' shard 0: keys chunk 1 holds"):
        gather(chunk(0), first, lambda j: {n: a for n, a in chunk(j).items() if n != "code.0"})
    with pytest.raises(ReplyError, match="table 'd1' shard 0: keys chunk 1 array 'row_ids'"):
        gather(chunk(0), first, lambda j: {**chunk(j), "row_ids": np.arange(5, dtype=np.int32)})


@pytest.mark.parametrize(
    "edit, line",
    [
        # announced sizes the server would allocate from
        (
            lambda a, m: m.update(n_rows=10**12, n_chunks=3),
            r"announces 1000000000000 rows in 3 chunks; the round asked",
        ),
        (
            lambda a, m: m.update(n_rows=10**12, n_chunks=-(-(10**12) // 4)),
            r"announces 1000000000000 entries of 'row_ids' \(4000.0 GB\), more than this server can hold",
        ),
        (lambda a, m: m.update(**{"n_values.0": 11}), r"announces 11 entries of 'digest.0' for its 10 rows"),
        (lambda a, m: m.update(**{"n_values.0": 2**60}), r"announces n_values.0=1152921504606846976, not a count"),
        (lambda a, m: m.update(**{"n_values.0": -1}), r"announces n_values.0=-1, not a count"),
        (lambda a, m: m.update(n_y=11) or a.update(y=np.zeros(4), is_test=np.zeros(4, np.uint8)), r"11 entries of 'y'"),
        (lambda a, m: m.pop("n_values.0"), r"announces n_values.0=None, not a count"),
        # the width of a digest or a blinded value, and the kind of every array
        (
            lambda a, m: a.update(**{"digest.0": np.zeros((4, 3), np.uint64)}),
            r"'digest.0' is uint64 \(4, 3\); it must be uint64 \('n', 2\)",
        ),
        (lambda a, m: a.update(**{"digest.0": np.zeros((4, 2), np.float64)}), r"'digest.0' is float64"),
        (
            lambda a, m: a.update(**{"blind.0": np.zeros((4, 10**6), np.uint8)}) or a.pop("digest.0"),
            r"'blind.0' is uint8 \(4, 1000000\)",
        ),
        (lambda a, m: a.update(**{"code.0": np.zeros((4, 1000), np.uint16)}), r"'code.0' is uint16 \(4, 1000\)"),
        (
            lambda a, m: a.update(**{"code.0": np.zeros(4, np.float64)}),
            r"'code.0' is float64 \(4,\); it must be integers",
        ),
        (lambda a, m: a.update(extra=np.zeros(4)), r"holds array 'extra', not an array of a keys reply"),
        # a chunk 0 of more rows than the round asked for
        (
            lambda a, m: a.update(row_ids=np.arange(9, dtype=np.int32)),
            r"keys chunk 0 array 'row_ids' .* \(4 entries after 0\)",
        ),
    ],
)
def test_the_server_bounds_what_it_allocates_from_a_chunked_reply(edit, line):
    """What chunk 0 announces is checked against the chunk size the server asked for before any allocation:
    row and chunk counts consistent with it, listed values and labels at most the rows, digests (n, 2) uint64
    and blinded values (n, 32) uint8, codes integer vectors; one line naming the client."""
    chunk, first, _, _ = chunked_reply_of()
    arrays, metrics = chunk(0), dict(first)
    edit(arrays, metrics)
    with pytest.raises(ReplyError, match="table 'd1' shard 0: .*" + line):
        gather(arrays, metrics, chunk)


def test_the_server_refuses_a_one_message_reply_beyond_its_chunk_size_and_later_chunks_off_their_place():
    chunk, first, rows, _ = chunked_reply_of()
    with pytest.raises(ReplyError, match="table 'd1' shard 0: its keys reply holds 10 rows in one message; the round"):
        gather({**rows, "digest.0": np.zeros((4, 2), np.uint64)}, {"n_rows": 10}, chunk)
    with pytest.raises(ReplyError, match=r"keys chunk 1 array 'code.0' \(uint32"):  # a dtype chunk 0 did not have
        gather(chunk(0), first, lambda j: {**chunk(j), "code.0": chunk(j)["code.0"].astype(np.uint32)})
    with pytest.raises(
        ReplyError, match=r"keys chunk 2 array 'digest.0' .* \(0 entries after 4\)"
    ):  # values past the list
        gather(chunk(0), first, lambda j: {**chunk(j), "digest.0": np.zeros((1, 2), np.uint64)} if j == 2 else chunk(j))


def test_a_node_announcing_too_many_values_stops_the_run_before_training(monkeypatch):
    """A broken node (its keys reply announces more digests than rows) ends the run in the keys round with
    one line naming its table, before any training round."""
    real = setup_phases.chunked_reply

    def inflated(client, config, build, source):
        out, metrics = real(client, config, build, source)
        if client.settings.table == "d1":
            metrics["n_values.0"] = 10**9
        return out, metrics

    monkeypatch.setattr(setup_phases, "chunked_reply", inflated)
    cfg = make_cfg("algorithm=admm", "epochs=1", "dataset=synthetic", "mapping.keys_chunk_rows=50")
    phases: list[str] = []
    with pytest.raises(
        RunError, match=r"^table 'd1' shard 0: its keys reply announces 1000000000 entries of 'digest.0'"
    ):
        strategy = make_strategy(cfg, None, log=lambda _: None)
        contexts = in_process_contexts(strategy)
        app = client_app_for(cfg)

        def recording(msg, context):
            phases.append(str(unpack_payload(msg.content)[1]["phase"]))
            return app(msg, context)

        strategy.run(DirectTransport(recording, {c.node_id: c for c in contexts.values()}))
    assert set(phases) == {"hello", "keys"}  # not a chunk asked, no training round


# ------------------------------------------------------------------------------- re-blinding in chunks


def blind_node(tmp_path):
    """A deployed keys=blind node of table d1 that answered its keys round."""

    def blind(settings: dict) -> None:
        settings["keys"] = "blind"

    context = node(tmp_path, "d1", SYNTHETIC, SYNTHETIC, edit=blind)
    call(deployed_app, context, "train", {}, {"phase": "keys"})
    return context


def signed_by_peer(directory: Path, name: str, values: np.ndarray, total: int, lo: int) -> dict[str, str]:
    """The provenance config of list ``name`` as the node fact/0 of ``directory``'s deployment signs it (its
    key in its state_dir, simulations.deploy): d1 re-blinds only lists a peer signed (tpflower.signing)."""
    (key_file,) = directory.rglob(f"fact-0/{SIGNING_KEY_FILE}")
    message = statement("fact/0", "fact/0", int(name.split(".")[1]), total, lo, values)
    signature = sign(node_signing_key(key_file.parent), message)
    return {f"origin.{name}": "fact/0", f"signer.{name}": "fact/0", f"sig.{name}": signature}


def points(n: int, seed: int = 0) -> np.ndarray:
    return blind.as_array(blind.hash_to_group([f"i{seed}-{v}".encode() for v in range(n)]))


def test_a_curious_server_gets_reblind_chunks_in_order_once_and_within_the_list(tmp_path):
    """A deployed blind node re-blinds a list of 17 values in chunks of 7 in order only: chunk 1 first, a chunk
    twice, a list again once done, a chunk beyond its length, a chunk of the wrong size and a length changed
    mid-list are refused (table and shard named); the chunks re-blinded are the list re-blinded whole."""
    context = blind_node(tmp_path / "a")
    pts = points(17)

    def ask(j: int, values: np.ndarray, total: int = 17, name: str = "pts.0.1", rows: int = 7) -> dict:
        config = {"phase": "reblind", "chunk": j, "chunk_rows": rows, f"n.{name}": total}
        config.update(signed_by_peer(tmp_path / "a", name, values, total, j * rows))
        return {"arrays": {name: values}, "config": config}

    where = "table 'd1' shard 0: reblind"
    for bad in ({"chunk_rows": -7}, {"chunk_rows": 0, "chunk": 1}):  # no chunk size, or a later chunk of none
        config = {**ask(0, pts[:7])["config"], **bad}
        refused(
            deployed_app,
            context,
            f"{where} announces 'pts.0.1' as 17 values in chunks of",
            "train",
            {"pts.0.1": pts[:7]},
            config,
        )
    refused(deployed_app, context, f"{where} sends chunk 1 of 'pts.0.1' out of order", "train", **ask(1, pts[7:14]))
    refused(
        deployed_app,
        context,
        f"{where}: chunk 0 of 'pts.0.1' holds 17 values; a list of 17 in chunks of 7 holds 7",
        "train",
        **ask(0, pts),
    )
    parts = [unpack_reply(call(deployed_app, context, "train", **ask(0, pts[:7])).content)[0]["pts.0.1"]]
    refused(deployed_app, context, f"{where} sends chunk 0 of 'pts.0.1' again", "train", **ask(0, pts[:7]))
    refused(deployed_app, context, "announces another length or chunk size", "train", **ask(1, pts[7:14], total=30))
    parts.append(unpack_reply(call(deployed_app, context, "train", **ask(1, pts[7:14])).content)[0]["pts.0.1"])
    refused(
        deployed_app, context, f"{where} sends chunk 1 of 'pts.0.1' out of order or twice", "train", **ask(1, pts[7:14])
    )
    parts.append(unpack_reply(call(deployed_app, context, "train", **ask(2, pts[14:])).content)[0]["pts.0.1"])
    refused(
        deployed_app, context, f"{where} sends chunk 3 of 'pts.0.1', beyond its 17 values", "train", **ask(3, pts[:1])
    )
    refused(deployed_app, context, f"{where} sends chunk 0 of 'pts.0.1' again", "train", **ask(0, pts[:7]))
    whole = blind_node(tmp_path / "b")
    (key_file,) = Path(tmp_path / "a").rglob(blind.SCALAR_FILE)  # a deployed node's scalar: its state_dir
    scalar = blind.node_scalar(key_file.parent)
    np.testing.assert_array_equal(np.concatenate(parts), blind.reblind(pts, scalar, "t"))
    # a server that does not chunk: the whole list in one message, once
    one, signed = {"pts.0.1": pts}, {"phase": "reblind", **signed_by_peer(tmp_path / "b", "pts.0.1", pts, 17, 0)}
    out = unpack_reply(call(deployed_app, whole, "train", one, signed).content)[0]["pts.0.1"]
    assert out.shape == pts.shape
    refused(deployed_app, whole, f"{where} sends chunk 0 of 'pts.0.1' again", "train", one, signed)


# ------------------------------------------------------------------------------- prediction requests in chunks


@pytest.mark.parametrize("keys", ["hmac", "blind"])
def test_a_prediction_request_in_chunks_gives_the_same_predictions(keys, tmp_path, monkeypatch):
    """predict_keys in 7-row chunks (keys_chunk rounds) and, keys=blind, the re-blinding lists in chunks of 7
    values: the same joined rows, predictions and unjoined rows as one message per node."""
    strategy = train(tmp_path / "run", "algorithm=admm", "dataset=synthetic", f"mapping.keys={keys}")
    rows, _ = held_out_rows(strategy, tmp_path)
    whole = predict_run(tmp_path / "run", rows, **QUIET)
    served: list[str] = []
    real_chunk, real_reblind = setup_phases.key_chunk, setup_phases.check_reblind_chunk

    def chunk_spy(payload, j, chunk_rows):
        served.append("keys_chunk")
        return real_chunk(payload, j, chunk_rows)

    def reblind_spy(client, name, n_points, config):
        if int(config.get("chunk", 0)) > 0:
            served.append("reblind")
        return real_reblind(client, name, n_points, config)

    monkeypatch.setattr(setup_phases, "key_chunk", chunk_spy)
    monkeypatch.setattr(setup_phases, "check_reblind_chunk", reblind_spy)
    for module in (predict_strategy, setup_strategy):  # the server's chunk size (blind_rounds: strategies.setup)
        monkeypatch.setattr(module, "keys_chunk_rows", lambda cfg: 7)
    chunked = predict_run(tmp_path / "run", rows, **QUIET)
    assert served.count("keys_chunk") > 20 and (served.count("reblind") > 10) == (keys == "blind")
    np.testing.assert_array_equal(chunked.rows, whole.rows)
    np.testing.assert_array_equal(chunked.unjoined, whole.unjoined)
    np.testing.assert_allclose(chunked.H, whole.H, rtol=0, atol=1e-12)
    for t, p in whole.p.items():
        np.testing.assert_array_equal(chunked.p[t], p, err_msg=t)


@pytest.mark.parametrize("n_chunks", ["many", 0, 2.5, -3])
def test_a_keys_reply_announcing_no_number_of_chunks_is_refused_at_the_door(n_chunks):
    chunk, first, _, _ = chunked_reply_of()
    with pytest.raises(
        ReplyError, match=rf"table 'd1' shard 0, phase 'keys': its reply announces n_chunks={n_chunks!r}"
    ):
        check_reply(("d1", 0), ({}, {"phase": "keys"}), (chunk(0), {**first, "n_chunks": n_chunks}), None, None)
