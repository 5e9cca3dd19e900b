"""The documentation's commands work: README.md and docs/*.md.

Every shell command in a fenced ```bash / ```sh block is checked: each `python -m MODULE` must name a module
of this repository (simulations/X.py, simulations/X/__main__.py, tpflower/..., strategies/...), each
`make TARGET` a target of the Makefile. The fast commands of FAST are run exactly as printed (`python` is this
interpreter, PYTHONPATH the repository root), and must stay printed in the docs, so this test cannot silently
stop running them. Also: relative links resolve, docs/results.md is what simulations/report.py generates, and
no tracker label (issue N, session N, seed 00N) appears.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell"}
PYTHONS = {"python", "python3", ".venv/bin/python", "$(BIN)/python"}

# Commands run as printed: (command, working directory: "repo" or "tmp", timeout in seconds).
FAST = [
    ("python -m simulations.report --check", "repo", 120),
    ("python -m simulations.run dataset=synthetic epochs=1 runtime=inprocess", "tmp", 240),
]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [
        (m.group(1).strip().lower(), m.group(2))
        for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    ]


def shell_commands(path: Path) -> list[str]:
    """The commands of the shell blocks of one file: continuation lines joined, comments dropped."""
    commands = []
    for lang, body in fenced_blocks(path.read_text()):
        if lang not in SHELL_LANGS:
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


ALL = {(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in shell_commands(p)}


def module_exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.MULTILINE)}


def test_the_docs_have_commands() -> None:
    assert len(ALL) >= 20, sorted(ALL)


@pytest.mark.parametrize("where,command", sorted(ALL))
def test_modules_and_make_targets_exist(where: str, command: str) -> None:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return
    if words[0] in PYTHONS and len(words) > 2 and words[1] == "-m":
        assert module_exists(words[2]), f"{where}: `{command}` names module {words[2]}, not in the repository"
    if words[0] == "tpflower" and len(words) > 1 and not words[1].startswith("-"):
        from simulations.cli import COMMANDS

        assert words[1] in COMMANDS, f"{where}: `{command}`: no tpflower command {words[1]!r}"
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        for t in targets:
            assert t in makefile_targets(), f"{where}: `{command}`: no Makefile target {t!r}"


@pytest.mark.parametrize("command", [c for c, _, _ in FAST])
def test_fast_commands_are_printed(command: str) -> None:
    assert command in {c for _, c in ALL}, f"`{command}` is no longer in a shell block of the docs"


@pytest.mark.parametrize("command,where,timeout", FAST)
def test_fast_commands_run(command: str, where: str, timeout: int, tmp_path: Path) -> None:
    words = shlex.split(command)
    assert words[0] == "python"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *words[1:]],
        check=False,
        cwd=ROOT if where == "repo" else tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"`{command}` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#")[0]
        assert (path.parent / file).exists(), f"{path.name}: link to {target} does not resolve"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_tracker_labels(path: Path) -> None:
    bad = re.findall(r"\b(?:issues?[- ]#?\d+|sessions? \d+|seed 00\d)\b", path.read_text(), flags=re.IGNORECASE)
    assert not bad, f"{path.name}: tracker labels {bad}"
