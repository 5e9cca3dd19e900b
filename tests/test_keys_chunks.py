"""The keys reply in chunks (mapping.keys_chunk_rows): the same mapping as one message, in both key modes and
both scenarios; the client refuses chunk requests out of order, twice or beyond its table."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from simulations.federated import run_in_process
from strategies.replies import ReplyError
from strategies.setup import JoinSetup
from tests.conftest import make_cfg
from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, node, refused
from tpflower import label_dp
from tpflower.app.client_app import app as deployed_app
from tpflower.phases import setup as setup_phases
from tpflower.records import unpack_reply


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
    assert len(served) == sum(-(-n // 7) for n in whole.client_rows.values()) and len(served) > n_rows / 7
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


def test_the_server_refuses_chunks_that_do_not_fill_what_chunk_0_announced():
    """A client whose later chunks hold fewer rows than its chunk 0 announced, or another array, stops the run
    at the keys round with one line naming it; whole chunks are put together in order and checked."""
    codes, digests = np.arange(10, dtype=np.uint16) % 4, np.arange(8, dtype=np.uint64).reshape(4, 2)
    rows = {"row_ids": np.arange(10, dtype=np.int32), "code.0": codes}
    first = {"n_rows": 10, "n_chunks": 3, "n_values.0": 4}

    def chunk(j: int, drop: int = 0) -> dict:
        out = {n: a[4 * j : 4 * j + 4 - drop] for n, a in rows.items()}
        return {**out, "digest.0": digests[4 * j : 4 * j + 4]}

    def gather(later):
        replies = {("d1", 0): (chunk(0), dict(first))}
        send = lambda messages: {k: (later(c["chunk"]), {}) for k, (_, c) in messages.items()}  # noqa: E731
        JoinSetup(send, SimpleNamespace(label=SimpleNamespace(task="regression")), {}, [("d1", 0)], {}).gather_chunks(
            replies
        )
        return replies[("d1", 0)][0]

    got = gather(chunk)
    np.testing.assert_array_equal(got["row_ids"], rows["row_ids"])
    np.testing.assert_array_equal(got["code.0"], codes)
    np.testing.assert_array_equal(got["digest.0"], digests)
    with pytest.raises(ReplyError, match="table 'd1' shard 0: its keys chunks hold 9 of the 10 entries of 'row_ids'"):
        gather(lambda j: chunk(j, drop=int(j == 1)))
    with pytest.raises(ReplyError, match="table 'd1' shard 0: a keys chunk holds"):
        gather(lambda j: {n: a for n, a in chunk(j).items() if n != "code.0"})
    with pytest.raises(ReplyError, match="table 'd1' shard 0: keys chunk array 'row_ids'"):
        gather(lambda j: {**chunk(j), "row_ids": np.arange(5, dtype=np.int32)})
