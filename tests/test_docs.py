"""The documentation's commands work: README.md and docs/*.md.

Every shell command in a fenced ```bash / ```sh block is checked: each `python -m MODULE` must name a module
of this repository (simulations/X.py, simulations/X/__main__.py, tpflower/..., strategies/...), each
`make TARGET` a target of the Makefile. The fast commands of FAST are run exactly as printed (`python` is this
interpreter, PYTHONPATH the repository root), and must stay printed in the docs, so this test cannot silently
stop running them. Also: relative links resolve, and so do their #anchors; docs/settings.md lists every setting
conf/ composes (every algorithm's, every group's) with the default conf/ gives it; docs/results.md is what
simulations/report.py generates, and no tracker label (issue N, session N, seed 00N) appears.
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
    if "simulations.run" in command:  # README: the first line names the job and results.json, the second auto's pick
        first, second = done.stdout.splitlines()[:2]
        assert first.startswith("tpflower train: algorithm=auto") and "results: " in first, first
        assert second.startswith("algorithm=auto: pcg "), second


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


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading suffixed -1, -2 ..."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_link_anchors_resolve(path: Path) -> None:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        file, anchor = target.split("#", 1)
        linked = path.parent / file if file else path
        if linked.suffix == ".md":
            assert anchor in heading_anchors(linked), f"{path.name}: link to {target}: no such heading"


# docs/settings.md against conf/: every setting a run composes is documented, with the default it has.
SETTINGS = ROOT / "docs" / "settings.md"


def settings_rows() -> dict[str, str]:
    """docs/settings.md's table rows: each key of the first cell (`a`, `b`) -> the rest of the row."""
    rows = {}
    for line in SETTINGS.read_text().splitlines():
        m = re.match(r"\| ((?:`[^`|]+`(?:, )?)+)(?: \([^|]*\))? \| (.*) \|$", line)
        if m:
            for key in re.findall(r"`([^`]+)`", m.group(1)):
                rows[key] = m.group(2)
    return rows


def doc_value(value: object) -> str:
    """A config value as the docs write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def same_default(doc: str, value: object) -> bool:
    doc = doc.strip().strip("`")
    try:
        return float(doc) == float(value)  # 1e-3 and 0.001
    except (TypeError, ValueError):
        return doc == doc_value(value)


def algorithm_settings() -> dict[str, dict]:
    from tpflower import registry
    from tpflower.config import compose_config

    selectors = {"auto", *(entry.selector for entry in registry.entries())}
    return {a: dict(compose_config(f"algorithm={a}").algorithm) for a in sorted(selectors)}


def test_settings_lists_every_algorithm_setting_with_its_default() -> None:
    rows = settings_rows()
    problems = []
    for algorithm, settings in algorithm_settings().items():
        if algorithm not in rows:
            problems.append(f"algorithm={algorithm}: no row in the algorithms table")
            continue
        row = rows[algorithm]
        keys = {k: v for k, v in settings.items() if k != "name"}
        problems += [f"algorithm={algorithm}: `{k}` undocumented" for k in keys if f"`{k}`" not in row]
        if algorithm == "auto":
            continue
        # `key` (DEFAULT ...: the default the docs state, where they state one (a value, not words)
        for key, doc in re.findall(r"`([a-z_][a-z0-9_]*)` \(([^;:,() ]+)[;:,) ]", row):
            if key not in keys:
                problems.append(f"algorithm={algorithm}: `{key}` ({doc}) is no setting of it")
            elif re.fullmatch(r"`[^`]+`|[-+0-9.e]+|true|false|null", doc) and not same_default(doc, keys[key]):
                problems.append(f"algorithm={algorithm}: `{key}` documented as {doc}, conf/ says {keys[key]!r}")
    assert not problems, "\n".join(problems)


def test_settings_lists_every_other_setting_with_its_default() -> None:
    """The keys outside algorithm.* and dataset.* (datasets.md has those), for every group option."""
    from omegaconf import OmegaConf

    from tpflower.config import compose_config

    rows, text = settings_rows(), SETTINGS.read_text()
    overrides = [f"{group}={p.stem}" for group in ("model", "privacy") for p in (ROOT / "conf" / group).glob("*.yaml")]
    problems = set()
    for override in ["seed=0", *overrides]:
        cfg = OmegaConf.to_container(compose_config(override), resolve=False)
        flat: dict[str, object] = {}

        def walk(node: object, path: str) -> None:
            # a group's choice (`name`, the model's `kind`) is its option; network's links are one table
            if isinstance(node, dict) and path != "network.links" and path != "network.default_link":
                for key, value in node.items():
                    walk(value, f"{path}.{key}" if path else key)
            elif path.split(".")[-1] not in ("name", "kind"):
                flat[path] = node

        walk({k: v for k, v in cfg.items() if k not in ("algorithm", "dataset", "hydra")}, "")
        for key, value in flat.items():
            if f"`{key}`" not in text:
                problems.add(f"`{key}` undocumented")
            elif key in rows and override == "seed=0":  # the defaults: of the default options
                cells = [c.strip() for c in _row_line(key).strip().strip("|").split("|")]
                keys = re.findall(r"`([^`]+)`", cells[0])
                defaults = [d.split(" (")[0].strip() for d in cells[1].split(", ")]
                doc = defaults[keys.index(key)] if len(defaults) == len(keys) else ""
                a_value = re.fullmatch(r"`[^`$]+`|[-+0-9.e]+|true|false|null|[a-z_0-9]+", doc)
                if a_value and not same_default(doc, value):
                    problems.add(f"`{key}` documented default {doc}, conf/ says {value!r}")
    cfg = compose_config("model=mlp", "privacy=label_dpsgd")
    problems |= {  # and the other way: every row's setting is one of conf/
        f"`{key}` is documented but no setting of conf/"
        for key in rows
        if "." in key and not key.startswith("privacy.") and OmegaConf.select(cfg, key, default="<none>") == "<none>"
    }
    assert not problems, "\n".join(sorted(problems))


def _row_line(key: str) -> str:
    return next(line for line in SETTINGS.read_text().splitlines() if re.match(rf"\| [^|]*`{re.escape(key)}`", line))


def test_readme_results_are_measured() -> None:
    """Every metric README's Results section quotes (3 decimals or more) is one docs/results.md reports."""
    section = (ROOT / "README.md").read_text().split("\n## Results\n")[1].split("\n## ")[0]
    results = (ROOT / "docs" / "results.md").read_text()
    missing = [n for n in re.findall(r"(?<![\w.])\d+\.\d{3,}\b", section) if n not in results]
    assert not missing, f"README's Results quote {missing}, which docs/results.md does not hold"


def test_readme_layout_names_modules_that_exist() -> None:
    """Each module README's Layout names (`x.py`, `x/`, or a bare name in a comma list) is a file of its folder."""
    layout = (ROOT / "README.md").read_text().split("\n## Layout\n")[1].split("```")[1]
    blocks = re.split(r"^(\w+)/\s", layout, flags=re.MULTILINE)[1:]
    missing = []
    for folder, text in zip(blocks[::2], blocks[1::2]):
        if folder in ("conf", "tests", "docs"):
            continue
        text = " ".join(re.sub(r"\([^()]*(?:\([^()]*\)[^()]*)*\)", "", text).split())  # descriptions dropped
        named = re.findall(r"\b([a-z_][a-z0-9_]*)(?:\.py|/)", text)
        named += re.findall(r"(?:^|[,:] )([a-z_][a-z0-9_]*)(?=,)", text)  # a comma list's bare names
        for word in named:
            if not ((ROOT / folder / f"{word}.py").is_file() or (ROOT / folder / word).is_dir()):
                missing.append(f"{folder}/{word}")
    assert not missing, f"README's Layout names {missing}, not in the repository"


def test_python_api_documents_every_argument_and_command() -> None:
    """docs/python-api.md's tables: every argument of fit, load and Model.predict, and every tpflower command
    (with the module it runs)."""
    import inspect

    from simulations import api
    from simulations.cli import COMMANDS

    text = (ROOT / "docs" / "python-api.md").read_text()
    missing = [
        f"{f.__qualname__}({name})"
        for f in (api.fit, api.load, api.Model.predict)
        for name, p in inspect.signature(f).parameters.items()
        if name != "self"
        and f"`{'**' if p.kind is p.VAR_KEYWORD else ''}{name}" not in text
        and not re.search(rf"`{f.__name__}\([^`]*\b{name}\b", text)
    ]
    missing += [
        f"tpflower {c} ({module})"
        for c, module in COMMANDS.items()
        if not re.search(rf"`tpflower {c}\b.*`python -m {module}`", text)
    ]
    assert not missing, f"docs/python-api.md does not document {missing}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_repository_paths_named_exist(path: Path) -> None:
    """A path of the repository the docs name (tpflower/checks.py, strategies/base.py, conf/network/wan.yaml,
    bench_results/gbdt.json, a module as tpflower/sql/, a family of files as bench_results/coreset-...) exists:
    placeholders (NAME, FAMILY, DS ...) and the user's own files of the examples (conf/dataset/shop.yaml) aside."""
    text = path.read_text()
    named = re.findall(r"(?<![\w/.])((?:tpflower|strategies|simulations|conf|tests|bench_results)/[\w./-]*\w)", text)
    examples = ("conf/dataset/shop", "tpflower/tpflower")  # the docs' own tables; an image name
    missing = {
        n
        for n in named
        if not re.search(r"[A-Z]{2,}", n)  # a placeholder: NAME, FAMILY, SELECTOR, DATE, DS
        and not n.startswith(examples)
        and not ((ROOT / n).exists() or (ROOT / f"{n}.py").exists() or any((ROOT / n).parent.glob(f"{Path(n).name}-*")))
    }
    assert not missing, f"{path.name} names {sorted(missing)}, not in the repository"


def test_tests_the_docs_cite_exist() -> None:
    """A test the docs name as the proof of a claim (`test_dp_steps_taken_after_the_checkpoint_stay_spent`) is
    one of tests/ (its full name, or the start of a parametrized family's)."""
    defined = {m for p in (ROOT / "tests").glob("*.py") for m in re.findall(r"def (test_\w+)", p.read_text())}
    missing = [
        f"{path.name}: {name}"
        for path in DOCS
        # a test's name has words; `test_metric`, `test_auc`, `test_NAME` are results.json's fields
        for name in sorted(set(re.findall(r"`(test_[a-z0-9]+(?:_[a-z0-9]+){2,})", path.read_text())))
        if not any(d.startswith(name) for d in defined)
    ]
    assert not missing, f"the docs cite tests that do not exist: {missing}"


def test_readme_algorithms_table_gives_each_algorithm_its_scenarios() -> None:
    """README's algorithms table: each `algorithm=` row's scenarios (join; union or ucq) are the registry's."""
    from tpflower import registry

    documented: dict[str, set[str]] = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)`(?: \(default\))? \| ([a-z, ]+) \|", line)
        if m:
            scenarios = {"ucq" if s.strip() in ("union", "ucq") else s.strip() for s in m.group(2).split(",")}
            documented.setdefault(m.group(1), set()).update(scenarios)
    registered: dict[str, set[str]] = {"auto": {"join", "ucq"}}
    for entry in registry.entries():
        registered.setdefault(entry.selector, set()).add(entry.scenario)
    assert documented == registered
