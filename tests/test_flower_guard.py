"""tpflower.app.flower_guard: an adapter runs only while the Flower code it relies on hashes to a code it was
checked against; a comment or a moved line does not count, a code change does; one notice line when off."""

from __future__ import annotations

import logging
import subprocess
import sys

from tpflower.app import flower_guard
from tpflower.app.flower_guard import ABSENT, ADAPTERS, code_hash, enabled, state


def test_every_adapter_is_on_with_the_installed_flower():
    # fails on a Flower release that changed a function an adapter relies on: read its diff (docs/deployment.md)
    assert {name: state(name) for name in ADAPTERS if not state(name)[0]} == {}


def test_the_hash_is_the_codes_not_its_comments_or_place(tmp_path, monkeypatch):
    module = tmp_path / "flower_like.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(flower_guard, "code_hash", flower_guard.code_hash.__wrapped__)  # no cache
    monkeypatch.setattr(flower_guard, "_parsed", flower_guard._parsed.__wrapped__)

    def hash_of(source: str, target: str = "flower_like:Loop.run") -> str:
        module.write_text(source)
        return flower_guard.code_hash(target)

    first = hash_of("class Loop:\n    def run(self):\n        time.sleep(3)\n")
    assert first != ABSENT
    assert hash_of("\n\nclass Loop:  # moved\n    def run(self):\n        time.sleep(3)  # idle\n") == first
    assert hash_of("class Loop:\n    def run(self):\n        time.sleep(2)\n") != first
    assert hash_of("class Loop:\n    pass\n") == ABSENT
    assert flower_guard.code_hash("no_such_module_here:f") == ABSENT


def test_a_changed_function_turns_its_adapter_off_with_one_line(monkeypatch, caplog):
    target = ADAPTERS["held-pulls"].targets[0]
    monkeypatch.setitem(flower_guard.CHECKED, target, {"0" * 16: "a release with other code"})
    with caplog.at_level(logging.WARNING, logger="tpflower"):
        assert enabled("held-pulls") is False
        assert enabled("fast-supernode") is True  # the others stay on
    (line,) = [r.getMessage() for r in caplog.records]
    assert target in line and "pulls answered at once" in line and "same results" in line
    report = flower_guard.report()
    assert any(r.startswith("held-pulls") and "off" in r for r in report)
    assert any(target in r and "new code: read its diff" in r for r in report)


def test_adapters_turned_off_by_hand_log_nothing(monkeypatch, caplog):
    monkeypatch.setenv(flower_guard.OFF_ENV, "fast-fetch, held-pulls")
    with caplog.at_level(logging.WARNING, logger="tpflower"):
        assert not enabled("fast-fetch") and not enabled("held-pulls") and enabled("fast-supernode")
    assert caplog.records == []
    monkeypatch.setenv(flower_guard.OFF_ENV, "all")
    assert not any(enabled(name) for name in ADAPTERS)


def test_the_check_command_prints_every_adapters_state():
    done = subprocess.run(
        [sys.executable, "-m", "simulations.node", "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Flower ")
    for name in ADAPTERS:
        assert any(line.split()[:2] == [name, "on"] for line in lines), name
    assert code_hash(ADAPTERS["fast-fetch"].targets[0]) in done.stdout
