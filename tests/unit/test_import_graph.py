"""The packages depend one way: admission decides from what routing knows about the replicas, and routing imports
nothing from admission (admission/README.md says why). Read from the source with `ast`, every import statement
counted (top level, inside functions, under TYPE_CHECKING): a cycle is a cycle for the reader too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in (ROOT / "extproc").rglob("*.py")}


def imports(name: str) -> set[str]:
    """The extproc modules one module imports (`from extproc.pkg import mod` counts extproc.pkg.mod)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            out.update(s for s in subs if s in MODULES)
            if not all(s in MODULES for s in subs):
                out.add(node.module)
    return {m for m in out if m in MODULES and m != name}


def graph(*prefixes: str) -> dict[str, set[str]]:
    inside = {m for m in MODULES if m.startswith(prefixes)}
    return {m: imports(m) & inside for m in inside}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    return found


def test_routing_imports_nothing_from_admission():
    routing = [m for m in MODULES if m.startswith("extproc.routing")]
    assert len(routing) > 5
    assert {m: sorted(i for i in imports(m) if i.startswith("extproc.admission")) for m in routing} == \
        {m: [] for m in routing}


def test_no_import_cycle_between_admission_and_routing():
    g = graph("extproc.admission", "extproc.routing")
    assert any(".admission." in m for m in g) and any(".routing." in m for m in g)
    assert cycles(g) == []


def test_the_operator_commands_import_one_way():
    assert "extproc.opscli" in imports("extproc.top")
    assert cycles(graph("extproc.opscli", "extproc.top", "extproc.admin")) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
