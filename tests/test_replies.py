"""Replies checked at the door (strategies.replies): a client whose reply does not answer what the round asked
for stops the run with one line naming its table, shard and phase, before the strategy uses the reply.

In-process runs (the same strategy, ClientApp and records as under Flower) on the synthetic snowflake, with
one client's replies tampered with after its ClientApp answered.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Message

from simulations.federated import in_process_contexts
from strategies.replies import MAX_ABS, ReplyError, check_reply
from strategies.transport import DirectTransport
from tpflower.app.client_app import client_app_for
from tpflower.app.server_app import make_strategy
from tpflower.config import compose_config
from tpflower.records import pack_reply, unpack_payload, unpack_reply

Tamper = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def run_tampered(table: str, phase: str, tamper: Tamper, *overrides: str) -> None:
    """A short in-process run in which ``table``'s replies to ``phase`` go through ``tamper``."""
    cfg = compose_config("dataset=synthetic", "epochs=1", "precision=float64", *overrides)
    strategy = make_strategy(cfg, None, log=lambda _: None)
    contexts = in_process_contexts(strategy)
    app = client_app_for(cfg)
    key_of = {c.node_id: k for k, c in contexts.items()}

    def tampering(msg: Message, context) -> Message:
        reply = app(msg, context)
        if msg.metadata.message_type == "query":
            return reply
        _, config = unpack_payload(msg.content)
        if key_of[context.node_id][0] == table and config.get("phase") == phase:
            out, metrics = unpack_reply(reply.content)
            return Message(pack_reply(tamper(dict(out)), metrics), reply_to=msg)
        return reply

    strategy.run(DirectTransport(tampering, {c.node_id: c for c in contexts.values()}))


def short(out):
    return {**out, "h": out["h"][:-1]}


def long(out):
    return {**out, "h": np.concatenate([out["h"], out["h"][:1]])}


def huge(out):
    h = out["h"].copy()
    h[3, 0] = 1e30
    return {**out, "h": h}


def nan(out):
    h = out["h"].copy()
    h[5, 0] = np.nan
    return {**out, "h": h}


def dropped(out):
    return {k: v for k, v in out.items() if k != "h"}


@pytest.mark.parametrize(
    "algorithm, phase, tamper, expected",
    [
        (
            "admm",
            "admm_update",
            short,
            r"table 'd1' shard 0, phase 'admm_update': reply array 'h' has \d+ rows; "
            r"the round asked for \d+ \(the client's rows\)",
        ),
        ("admm", "admm_update", long, r"table 'd1' shard 0, phase 'admm_update': reply array 'h' has \d+ rows"),
        (
            "admm",
            "admm_update",
            huge,
            r"table 'd1' shard 0, phase 'admm_update': reply array 'h' holds 1 non-finite or "
            r"out-of-range value\(s\) .*1e\+30 at index \(3, 0\)",
        ),
        (
            "admm",
            "admm_update",
            nan,
            r"phase 'admm_update': reply array 'h' holds 1 non-finite .*nan at index \(5, 0\)",
        ),
        ("admm", "admm_update", dropped, r"table 'd1' shard 0, phase 'admm_update': the reply lacks array\(s\) 'h'"),
        (
            "sgd",
            "sgd_step",
            short,
            r"table 'd1' shard 0, phase 'sgd_step': reply array 'h' has \d+ rows; the round "
            r"asked for \d+ \(the rows of its 'rows'\)",
        ),
    ],
    ids=["short", "long", "1e30", "nan", "missing", "sgd-short"],
)
def test_a_bad_reply_stops_the_run_naming_table_shard_and_phase(algorithm, phase, tamper, expected):
    with pytest.raises(ReplyError, match=expected):
        run_tampered(
            "d1",
            phase,
            tamper,
            f"algorithm={algorithm}",
            *(["algorithm.batch_size=4000"] if algorithm == "sgd" else []),
        )


def test_keys_with_repeated_row_ids_or_a_code_or_digest_short_are_refused():
    with pytest.raises(ReplyError, match=r"table 'd2' shard 0, phase 'keys': row_ids must be distinct"):
        run_tampered("d2", "keys", lambda o: {**o, "row_ids": np.zeros_like(o["row_ids"])})
    with pytest.raises(ReplyError, match=r"table 'fact' shard 0, phase 'keys': reply array 'code\.0' has"):
        run_tampered("fact", "keys", lambda o: {**o, "code.0": o["code.0"][1:]})
    with pytest.raises(ReplyError, match=r"'code\.0' must hold codes into its \d+ digests"):
        run_tampered("fact", "keys", lambda o: {**o, "digest.0": o["digest.0"][:-1]})
    with pytest.raises(ReplyError, match=r"'digest\.0' comes without the rows' codes"):
        run_tampered("fact", "keys", lambda o: {k: v for k, v in o.items() if k != "code.0"})


def test_the_width_of_predictions_is_d_out():
    sent = ({}, {"phase": "admm_update"})
    with pytest.raises(ReplyError, match=r"shape \(4, 2\); predictions have 1 column"):
        check_reply(("t", 0), sent, ({"h": np.zeros((4, 2))}, {}), 4, 1)
    check_reply(("t", 0), sent, ({"h": np.full((4, 1), MAX_ABS)}, {}), 4, 1)  # at the bound: accepted


def test_a_consensus_mask_must_be_0_1_and_shaped_like_theta():
    sent = ({"Y": np.zeros((4, 1)), "v": np.zeros(3)}, {"phase": "admm_shard"})
    theta = np.zeros(3)
    check_reply(("t", 1), sent, ({"theta": theta, "used": np.array([1, 0, 1], np.uint8)}, {}), 4, 1)
    for used in (np.array([1, 0], np.uint8), np.array([1, 2, 0])):
        with pytest.raises(ReplyError, match=r"table 't' shard 1, phase 'admm_shard': reply array 'used' must be"):
            check_reply(("t", 1), sent, ({"theta": theta, "used": used}, {}), 4, 1)


def test_a_duplicate_in_a_table_declared_unique_names_table_column_and_an_example():
    from simulations.federated import run_in_process

    def run(*overrides):
        cfg = compose_config("algorithm=admm", "dataset=movielens", "epochs=1", *overrides)  # ADMM: algorithm.rho
        return run_in_process(cfg, None, log=lambda _: None)

    with pytest.raises(
        RuntimeError,
        match=r"table 'movies' shard 0: 1 problem in the data: table 'movies' declares its key movieId unique, but "
        r"[\d,]+ rows share a value, first at row \d+: movieId=\d+",
    ):
        run("dataset.tables.movies.unique=true")  # one row per movie AND genre: not unique
    assert run("+dataset.tables.users.unique=true", "algorithm.rho=3").strategy.finished  # one row per user


def test_a_duplicate_string_key_is_named_with_its_value(tmp_path):
    import pandas as pd

    from simulations.federated import run_in_process
    from tests.conftest import make_cfg
    from tests.test_checks import shop

    rng = np.random.default_rng(0)
    codes = np.array([f"c{i}" for i in range(50)], dtype=object)
    orders = pd.DataFrame(
        {"cust": codes[rng.integers(0, 50, 400)], "qty": rng.integers(1, 5, 400), "spend": rng.normal(10, 2, 400)}
    )
    customers = pd.DataFrame({"cust": np.r_[codes, ["c7"]], "age": rng.integers(18, 80, 51)})
    dataset = shop(tmp_path, orders, customers)
    dataset["tables"]["customers"]["unique"] = True
    with pytest.raises(
        RuntimeError, match=r"key cust unique, but 2 rows share a value, first at row 7 \(line 9 of .*\): cust='c7'"
    ):
        run_in_process(make_cfg("algorithm=admm", "epochs=1", dataset=dataset), None, log=lambda _: None)


@pytest.mark.parametrize(
    "overrides, phase, tamper, match",
    [
        (
            ("algorithm=coreset", "algorithm.m=100"),
            "weigh",
            lambda o: {**o, "sens": o["sens"][:-1]},
            "reply array 'sens' has .* rows; the round asked for",
        ),
        (
            ("algorithm=coreset", "algorithm.m=100"),
            "sensitivity",
            lambda o: {**o, "total": np.r_[o["total"], 1.0]},
            "reply array 'total' holds 2 values; the round asked for one number",
        ),
        (("algorithm=coreset", "algorithm.m=100"), "coreset_admm_update", short, "reply array 'h' has .* rows"),
        (
            ("algorithm=kmeans", "algorithm.k=3"),
            "kmeans_local",
            lambda o: {**o, "labels": o["labels"][:-1]},
            "reply array 'labels' has .* rows; the round asked for .* \\(the client's rows\\)",
        ),
        (
            ("algorithm=kmeans", "algorithm.k=3"),
            "kmeans_cost",
            lambda o: {"cost": np.r_[o["cost"], o["cost"]]},
            "reply array 'cost' holds 2 values",
        ),
        (("algorithm=kmeans", "algorithm.k=3"), "kmeans_cost", lambda o: {}, "the reply lacks array\\(s\\) 'cost'"),
    ],
    ids=["weigh-short", "total-two", "coreset-h-short", "labels-short", "cost-two", "cost-missing"],
)
def test_coreset_and_kmeans_replies_are_checked(overrides, phase, tamper, match):
    with pytest.raises(ReplyError, match=f"table 'd1' shard 0, phase '{phase}': {match}"):
        run_tampered("d1", phase, tamper, *overrides)


@pytest.mark.parametrize(
    "phase, tamper, match",
    [
        ("gbdt_split", lambda o: {**o, "bits": o["bits"][:-1]}, r"reply array 'bits' is uint8 \(\d+,\); the round"),
        ("gbdt_split", lambda o: {**o, "gain": o["gain"][:-1]}, r"reply array 'gain' is float64 \(\d+,\); the round"),
        ("gbdt_split", lambda o: {**o, "gain": np.full_like(o["gain"], np.nan)}, "reply array 'gain' is float64"),
        ("gbdt_split", lambda o: {k: v for k, v in o.items() if k != "bits"}, r"the reply lacks array\(s\) 'bits'"),
        ("gbdt_route", lambda o: {**o, "bits": o["bits"][:-1]}, r"reply array 'bits' is uint8 \(\d+, \d+\); the round"),
    ],
    ids=["bits-short", "gain-short", "gain-nan", "bits-missing", "route-bits-short"],
)
def test_boosted_trees_replies_are_checked(phase, tamper, match):
    """A gain per node sent (finite or -inf) and side bits packed one per row (and split) sent: anything else
    stops the run naming the table, shard and phase, before the server routes a row by it."""
    with pytest.raises(ReplyError, match=f"table 'd1' shard 0, phase '{phase}': {match}"):
        run_tampered("d1", phase, tamper, "algorithm=gbdt", "algorithm.trees=2", "algorithm.eval_every=1")


def test_a_shards_histograms_are_finite_one_per_node_and_alike_across_the_table():
    """A shard's part of the histograms comes as its non-empty bins (tpflower.trees.sparse_histograms): a bit per
    bin of its dense (nodes, 3, bins), the finite sums of g (and h) and a count per set bit. A mask of the wrong
    length or with a bit past the last bin, sums or counts of another number than the set bits, a value not
    finite, or another number of nodes than asked stops the run in one line naming the table and shard."""
    from types import SimpleNamespace

    from strategies.gbdt import JoinGBDT
    from tpflower.trees import dense_histograms, sparse_histograms

    def reply(hist, shape=None):
        return ({**sparse_histograms(hist), "shape": np.array(shape or (hist.shape[0], hist.shape[2]))}, {})

    sent = ({"nodes": np.arange(2)}, {"phase": "gbdt_hist"})
    dense = np.zeros((2, 3, 5))
    dense[0, :, 1], dense[1, :, 4], dense[1, 0, 2] = (0.5, 0.25, 1.0), (-1.5, 2.0, 3.0), -0.0  # -0.0 is sent
    check_reply(("t", 1), sent, reply(dense), 10, 1)
    sparse = sparse_histograms(dense)
    assert (
        sparse["hist"].shape == (3, 2) and sparse["count"].tolist() == [1, 0, 3] and sparse["count"].dtype == np.uint8
    )
    back = dense_histograms(*sparse.values(), 2, 5)
    assert back.view(np.uint64).tolist() == dense.view(np.uint64).tolist()  # bit for bit, the -0.0 too
    dense[:, 1] = dense[:, 2]  # squared error: h = 1, each sum of h its count: g only
    assert sparse_histograms(dense)["hist"].shape == (3, 1)
    assert dense_histograms(*sparse_histograms(dense).values(), 2, 5).tolist() == dense.tolist()
    good = reply(dense)[0]
    bad_parts = {
        "mask is not one bit per bin": {**good, "mask": np.zeros(1, dtype=np.uint8)},
        "mask sets a bit past the last bin": {**good, "mask": good["mask"] | np.array([0, 0x3F], dtype=np.uint8)},
        "not the g (and h) sums of each bin the mask sets": {**good, "hist": good["hist"][:2]},
        "not one non-negative count per bin the mask sets": {**good, "count": good["count"][:2]},
        "not finite": {**good, "hist": np.where(good["hist"] == 0.5, np.nan, good["hist"])},
    }
    for problem, out in bad_parts.items():
        with pytest.raises(
            ReplyError, match=r"table 't' shard 1, phase 'gbdt_hist': reply arrays 'mask', 'hist', 'count'"
        ) as e:
            check_reply(("t", 1), sent, (out, {}), 10, 1)
        assert problem in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ReplyError, match=r"table 't' shard 1, phase 'gbdt_hist': reply array 'shape' is"):
        check_reply(("t", 1), sent, reply(dense[:1]), 10, 1)
    derive = ({"nodes": np.arange(2), "derive": np.array([1])}, {"phase": "gbdt_hist"})  # one node derived
    check_reply(("t", 1), derive, reply(np.zeros((1, 3, 5))), 10, 1)
    check_reply(("t", 1), derive, reply(np.zeros((2, 3, 5))), 10, 1)  # a shard that lost its memory
    with pytest.raises(ReplyError, match=r"node built from rows \(1\) or per node of the step"):
        check_reply(("t", 1), derive, reply(np.zeros((3, 3, 5))), 10, 1)
    table = SimpleNamespace(routers={"t": SimpleNamespace(shards=[0, 1])})
    parts = {("t", 0): reply(np.ones((2, 3, 5))), ("t", 1): reply(np.ones((2, 3, 5)))}
    assert JoinGBDT.summed_hist(table, "t", parts, [0, 1]).sum() == 60
    assert JoinGBDT.summed_hist(table, "t", parts, [1]).sum() == 30  # node 0 derived (a part of every node: cut)
    parts[("t", 1)] = reply(np.ones((2, 3, 4)))
    with pytest.raises(ReplyError, match=r"table 't', phase 'gbdt_hist': its shards' histograms differ in shape"):
        JoinGBDT.summed_hist(table, "t", parts, [0, 1])


def test_a_shards_side_bits_are_checked_against_its_rows():
    """Over the union a shard's side bits answer its own rows of each node, which only the server's step knows:
    a short reply stops the run naming the shard, not zero-padded into routing."""
    with pytest.raises(ReplyError, match=r"table 'fact' shard \d, phase 'gbdt_shard_split': reply array 'bits' is"):
        run_tampered(
            "fact",
            "gbdt_shard_split",
            lambda o: {**o, "bits": o["bits"][:-1]},
            "algorithm=gbdt",
            "algorithm.trees=2",
            "scenario=ucq",
            "min_sketch_rows=1",
        )


def test_an_in_process_handlers_traceback_reaches_the_run_log_not_the_console(tmp_path, monkeypatch):
    """In-process the handlers run in this process: their traceback is kept as a note of the run's error, so
    the run's log file shows the frame that failed; the console line stays the one line naming the table."""
    import logging

    from simulations.federated import run_in_process
    from simulations.job import failure_message, log_file
    from strategies.transport import RunError
    from tpflower.client import TableClient

    handle = TableClient.handle

    def failing(self, arrays, config):
        if self.settings.table == "d1" and str(config.get("phase", "")).startswith("admm"):
            raise ZeroDivisionError("a bug in a phase")
        return handle(self, arrays, config)

    monkeypatch.setattr(TableClient, "handle", failing)
    root = logging.getLogger()  # the log file: the run dir's (no file handler of another run)
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers if not isinstance(h, logging.FileHandler)])
    with pytest.raises(RunError) as info:
        run_in_process(compose_config("algorithm=admm", "dataset=synthetic", "epochs=1"), None, log=lambda _: None)
    assert str(info.value).startswith("table 'd1' shard 0: ") and "\n" not in str(info.value)
    line = failure_message(info.value, tmp_path)
    assert "Traceback" not in line
    log = log_file(tmp_path).read_text()
    assert "table 'd1' shard 0:\nTraceback" in log and "in failing" in log and "ZeroDivisionError" in log


def test_a_nodes_error_line_keeps_its_last_quote_and_names_the_node_once():
    from types import SimpleNamespace

    from strategies.base import node_line
    from tpflower.records import error_reason

    reason = "rows file x.csv lacks feature column(s) ['table'] of table 'stones'"
    reply = SimpleNamespace(error=SimpleNamespace(code=0, reason=f"{ValueError}:<'{reason}'>"))  # the engine's form
    assert error_reason(reply) == reason
    wrapped = f"{ValueError}:<'\nException ClientAppException occurred. Message: {reason}'>"  # Ray's actor's
    assert error_reason(SimpleNamespace(error=SimpleNamespace(code=0, reason=wrapped))) == reason
    name = "table 'stones' shard 0"
    assert node_line(name, reason) == f"{name}: {reason}"
    assert node_line(name, f"{name}: a summary of 4 rows") == f"{name}: a summary of 4 rows"
    assert (
        node_line(name, f"{name} (algorithm 'gbdt') refuses phase 'x'")
        == f"{name} (algorithm 'gbdt') refuses phase 'x'"
    )
    # a phase's refusal names its table: the line says the node (table and shard) once
    refusal = "table 'stones' (algorithm 'coreset'), phase 'g': m beyond the bound"
    assert node_line(name, refusal, "stones") == f"{name} (algorithm 'coreset'), phase 'g': m beyond the bound"
    assert node_line(name, "table 'stonesx' has no rows", "stones") == f"{name}: table 'stonesx' has no rows"


def test_the_shards_of_a_table_that_refuse_alike_make_one_line():
    from strategies.base import merged_lines

    why = "table 'f' (gbdt_bins) refuses the message: too few rows"
    failed = [
        ("table 'f' shard 1", ("f", 1), f"{why} (7 rows)"),
        ("table 'f' shard 0", ("f", 0), f"{why} (9 rows)"),
        ("table 'g' shard 0", ("g", 0), "table 'g' shard 0: another problem"),
        ("node 5", None, "no table"),
    ]
    assert merged_lines(failed) == [
        "node 5: no table",
        "table 'f' shards 0, 1 (gbdt_bins) refuses the message: too few rows (shard 0: 9 rows; shard 1: 7 rows)",
        "table 'g' shard 0: another problem",
    ]
    alike = [(f"table 'f' shard {q}", ("f", q), f"{why} (the detail is in this node's log)") for q in (0, 1)]
    assert merged_lines(alike) == [
        "table 'f' shards 0, 1 (gbdt_bins) refuses the message: too few rows (the detail is in this node's log)"
    ]
    assert merged_lines(alike[:1]) == [
        "table 'f' shard 0 (gbdt_bins) refuses the message: too few rows (the detail is in this node's log)"
    ]


def test_rays_out_of_memory_kill_is_its_gist_not_a_paragraph():
    """Ray's memory monitor's message (object store stats, its top 10 processes: 2 kB) was each node's line."""
    from types import SimpleNamespace

    from tpflower.records import error_reason

    ray = (
        "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: 48a)"
        " was 22.37GB / 23.54GB (0.950451), which exceeds the memory usage threshold of 0.950000; Object store "
        "memory usage: [- objects spillable: 0; ...]; Top 10 memory users: PID\tMEM(GB)\tCOMMAND, 27062\t19.90\t"
        "python -m simulations.run ..., Refer to the documentation ..."
    )
    line = error_reason(SimpleNamespace(error=SimpleNamespace(code=0, reason=f"{RuntimeError}:<'{ray}'>")))
    assert line == (
        "Ray killed the node's worker: the machine ran low on memory (22.37GB / 23.54GB in use, above Ray's "
        "threshold 0.950000, RAY_memory_usage_threshold); free memory and run again"
    )
