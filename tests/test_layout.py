"""The house rules, checked on the source: imports point one way (simulations -> strategies -> tpflower) with no
circle, and every registered algorithm family is one same-named pair of files with its config and its tests."""

from __future__ import annotations

import ast
from pathlib import Path

from tpflower import registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tpflower", "strategies", "simulations")
LAYER = {"tpflower": 0, "strategies": 1, "simulations": 2}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module that ``path`` imports, at any depth (function-local and TYPE_CHECKING ones too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    edges = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    for m in modules:  # importing a.b.c runs a/__init__ and a/b/__init__ first: not an edge a reader follows
        edges[m] -= {m.rsplit(".", k)[0] for k in range(1, m.count(".") + 1)}
    return edges


def test_imports_point_one_way():
    bad = sorted(
        f"{m} -> {d}" for m, deps in graph().items() for d in deps if LAYER[d.split(".")[0]] > LAYER[m.split(".")[0]]
    )
    assert bad == [], "imports against the layering simulations -> strategies -> tpflower:\n" + "\n".join(bad)


def test_no_import_circle():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert circles == [], f"import circles: {circles}"


def test_every_family_is_one_named_pair():
    for entry in registry.entries():
        assert (ROOT / "tpflower" / "phases" / f"{entry.family}.py").is_file(), entry.name
        assert (ROOT / "strategies" / f"{entry.family}.py").is_file(), entry.name
        assert (ROOT / "conf" / "algorithm" / f"{entry.selector}.yaml").is_file(), f"{entry.name}: conf file"
        assert (ROOT / "tests" / f"test_{entry.family}.py").is_file(), f"{entry.name}: its tests"
        assert entry.strategy.__module__ == f"strategies.{entry.family}"


def test_every_config_file_selects_a_registered_algorithm():
    selectors = {e.selector for e in registry.entries()}
    files = {p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml")}
    assert files == selectors | {"auto"}  # auto: resolved to a registered one before use (tpflower.auto)
