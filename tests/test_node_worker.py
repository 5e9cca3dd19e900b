"""A deployed node's worker (tpflower.app.node_worker): the ClientApp entry point of a deployed node forwards
each message to one long-lived process per node, which answers exactly as the message's own process would
(the same replies, the same context.state), keeps its caches between messages, and hands a client's error
back as the node's error line."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from tests.test_conformance import call
from tests.test_curious_server import SYNTHETIC, node
from tpflower.app import node_worker
from tpflower.app.client_app import app as in_process_app
from tpflower.app.node_app import app as node_app
from tpflower.records import unpack_reply


def worker_pid(context) -> int:
    log = node_worker.socket_path(dict(context.node_config)).with_suffix(".log")
    return int(log.read_text().split("node worker ")[-1].split()[0])


@pytest.fixture
def deployed(tmp_path):
    context = node(tmp_path, "d1", SYNTHETIC, SYNTHETIC)
    twin = node(tmp_path / "twin", "d1", SYNTHETIC, SYNTHETIC)  # the same node answered in this process
    twin.node_config = dict(context.node_config)
    yield context, twin
    try:
        os.kill(worker_pid(context), signal.SIGTERM)
    except (OSError, ValueError, IndexError):
        pass


def test_the_worker_answers_as_the_message_process_would(deployed):
    context, twin = deployed
    assert node_worker.enabled(context)
    for message_type, config in (("query", {"phase": "hello"}), ("train", {"phase": "keys"})):
        got = unpack_reply(call(node_app, context, message_type, {}, config).content)
        want = unpack_reply(call(in_process_app, twin, message_type, {}, config).content)
        assert got[1] == want[1]
        assert got[0].keys() == want[0].keys()
        for name in got[0]:
            if name.startswith(("code.", "digest.")):  # codes are drawn afresh per reply: compare each row's digest
                k = name.split(".")[1]
                np.testing.assert_array_equal(
                    got[0][f"digest.{k}"][got[0][f"code.{k}"]], want[0][f"digest.{k}"][want[0][f"code.{k}"]]
                )
            else:
                np.testing.assert_array_equal(got[0][name], want[0][name])
    assert set(context.state.keys()) == set(twin.state.keys()) and context.state.keys()  # the state came back
    pid = worker_pid(context)
    call(node_app, context, "query", {}, {"phase": "hello"})
    assert worker_pid(context) == pid  # one worker per node, alive between messages


def test_a_client_error_in_the_worker_is_the_nodes_error_line(deployed):
    context, _ = deployed
    call(node_app, context, "train", {}, {"phase": "keys"})
    with pytest.raises(node_worker.WorkerError, match="refuses phase 'keys': out of order"):
        call(node_app, context, "train", {}, {"phase": "keys"})


def test_the_socket_directory_is_private_and_refused_when_not_ours(tmp_path):
    folder = node_worker.private_dir(tmp_path / "w")
    assert (folder.stat().st_mode & 0o777) == 0o700
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="not a directory owned by"):
        node_worker.private_dir(tmp_path / "link")
    if os.getuid() == 0:  # root can make a directory another user owns
        (tmp_path / "theirs").mkdir()
        os.chown(tmp_path / "theirs", 65534, 65534)
        with pytest.raises(PermissionError, match="not a directory owned by"):
            node_worker.private_dir(tmp_path / "theirs")
