"""The owner's node service (tpflower.app.node_service, simulations.node): a run whose app is not the tpflower
the owner installed is refused, with one line naming the node and the app, before any handler runs; a
claimed task always gets a reply and a task output; the handler sees the owner's node config, never the
SuperNode's; the SuperNode adapter patches only the Flower version it was written for."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import SubStatus

from tpflower.app import flower_patch, node_service
from tpflower.app.node_service import OwnerNode, answer, installed_app, refusal

OWNER = OwnerNode("d1", 0, "/owner/d1-0.yaml")


def task_message(message_type: str = "query") -> tuple[Message, Context]:
    from flwr.supercore.task_identity import TaskIdentity  # the ServerApp side of the message, for the test

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    msg = Message(RecordDict({"config": ConfigRecord({"phase": "hello"})}), dst_node_id=7, message_type=message_type)
    context = Context(run_id=1, node_id=7, node_config={"table": "d1", "shard": 0}, state=RecordDict(), run_config={})
    return msg, context


def run_of(fab_id: str, fab_version: str) -> SimpleNamespace:
    return SimpleNamespace(fab_id=fab_id, fab_version=fab_version, fab_hash="0" * 64)


def never_called(*_args):
    raise AssertionError("a handler ran for a refused run")


def test_refusal_names_the_node_and_the_app():
    expected = installed_app()
    assert refusal(OWNER.name, *expected, expected) is None
    line = refusal(OWNER.name, "tpflower/tpflower", "0.0.9", expected)
    assert line is not None and "\n" not in line
    assert "table 'd1' shard 0" in line and "tpflower/tpflower 0.0.9" in line and expected[1] in line
    assert "attacker/foreign 1.0" in refusal(OWNER.name, "attacker/foreign", "1.0", expected)


@pytest.mark.parametrize("fab", [("tpflower/tpflower", "0.0.9"), ("attacker/foreign", installed_app()[1])])
def test_a_fab_of_another_version_or_app_is_refused_before_any_handler(fab):
    msg, context = task_message()
    reply, details = answer(msg, context, run_of(*fab), OWNER, never_called, installed_app())
    assert reply.has_error() and "refuses app" in reply.error.reason and "table 'd1' shard 0" in reply.error.reason
    assert details == reply.error.reason
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id


def test_the_handler_sees_the_owners_node_config_and_flowers_is_restored():
    msg, context = task_message()
    seen = {}

    def respond(message_type, content, ctx):
        seen.update(type=message_type, config=dict(ctx.node_config))
        return RecordDict({"info": ConfigRecord({"table": "d1"})})

    reply, details = answer(msg, context, run_of(*installed_app()), OWNER, respond, installed_app())
    assert details == "" and not reply.has_error()
    assert seen == {"type": "query", "config": {"table": "d1", "shard": 0, "client-config": "/owner/d1-0.yaml"}}
    assert dict(context.node_config) == {"table": "d1", "shard": 0}  # what goes back to the SuperNode


def test_a_handler_error_is_the_nodes_error_reply():
    msg, context = task_message("train")

    def respond(*_):
        raise ValueError("table 'd1': column 'x' is not exposed")

    reply, details = answer(msg, context, run_of(*installed_app()), OWNER, respond, installed_app())
    from tpflower.records import error_reason

    assert reply.has_error() and error_reason(reply) == "table 'd1': column 'x' is not exposed" and details


def test_a_refused_task_still_gets_its_reply_and_task_output(monkeypatch):
    msg, context = task_message()
    pushed = []
    monkeypatch.setattr(node_service, "pull_task", lambda client: (msg, context, run_of("attacker/x", "1")))
    monkeypatch.setattr(node_service, "push_message", lambda client, reply, ctx: pushed.append(("reply", reply)))
    monkeypatch.setattr(
        node_service, "push_task_output", lambda **kw: pushed.append(("output", kw["sub_status"], kw["details"]))
    )
    client = SimpleNamespace(SendTaskHeartbeat=lambda req: SimpleNamespace(success=True))
    details = node_service.serve_task(client, OWNER, never_called, installed_app())
    assert [p[0] for p in pushed] == ["reply", "output"]
    assert pushed[0][1].has_error() and pushed[1][1] == SubStatus.FAILED and "refuses app" in details


def test_the_supernode_runs_process_isolated_without_the_owners_paths():
    from simulations.node import supernode_command

    cmd = supernode_command("127.0.0.1:9092", 9094, 'table="d1" shard=0', "ca.crt", "d1.key")
    assert cmd[cmd.index("--isolation") + 1] == "process" and "--insecure" not in cmd
    assert "client-config" not in " ".join(cmd) and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_supernode_adapter_only_on_the_version_it_was_written_for(monkeypatch, caplog):
    from flwr.supernode import start_client_internal

    with caplog.at_level(logging.WARNING, logger="tpflower"):
        assert flower_patch.install_fast_supernode("9.9.0") is False
    assert len(caplog.records) == 1 and "9.9.0" in caplog.records[0].getMessage()
    monkeypatch.setattr(start_client_internal, "time", start_client_internal.time)  # restored after the test
    assert flower_patch.install_fast_supernode() is True
    fast = start_client_internal.time
    assert fast.monotonic() > 0  # the rest of the time module
    slept = []
    monkeypatch.setattr(flower_patch.time, "sleep", slept.append)
    fast.sleep(3)
    fast.sleep(3)
    fast.sleep(0.5)
    fast.sleep(3)
    assert slept == [
        flower_patch.NODE_MIN_WAIT_S,
        2 * flower_patch.NODE_MIN_WAIT_S,
        flower_patch.NODE_MIN_WAIT_S,
        flower_patch.NODE_MIN_WAIT_S,
    ]
