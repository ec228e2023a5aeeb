"""The import graph of colibri_server, read from the sources (ast, no import runs): no circle, the
layers in their order, and no module too long to read. Function-level imports count as edges:
a circle through a deferred import is still a circle, only a later one."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "colibri_server"
MAX_LINES = 700


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in module `mod`."""
    if level == 0:
        return target or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(mods: dict[str, pathlib.Path] | None = None) -> dict[str, set[str]]:
    """module -> the colibri_server modules it imports (at module level or inside functions). An
    import of a name from a package counts as an import of the submodule when one has that name,
    else of the package itself."""
    mods = _modules() if mods is None else mods
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_pkg, node.level, node.module)
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods:          # `import a.b.c` of a module: the longest known prefix
                    n = n.rpartition(".")[0]
                if n and n != mod:
                    edges.add(n)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle [a, b, ..., a], or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(m):
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if color.get(n, BLACK) == GREY:
                return stack[stack.index(n):] + [n]
            if color.get(n) == WHITE:
                c = visit(n)
                if c:
                    return c
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            c = visit(m)
            if c:
                return c
    return None


def test_the_graph_reader_sees_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import x\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import y\n")
    mods = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.b": pkg / "b.py",
            "p.sub": pkg / "sub" / "__init__.py", "p.sub.c": pkg / "sub" / "c.py"}
    g = import_graph(mods)
    assert g["p.a"] == {"p.b"} and g["p.b"] == {"p.sub.c"} and g["p.sub.c"] == {"p.a"}
    assert find_cycle(g) == ["p.a", "p.b", "p.sub.c", "p.a"]
    (pkg / "sub" / "c.py").write_text("import numpy\n")
    assert find_cycle(import_graph(mods)) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _reach(graph, start):
    seen, todo = set(), [start]
    while todo:
        for n in graph.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_kernels_import_nothing_of_the_model_but_the_format():
    g = import_graph()
    kernels = "colibri_server.model.kernels"
    for mod, edges in g.items():
        if mod == kernels or mod.startswith(kernels + "."):
            outside = {n for n in edges if not (n == kernels or n.startswith(kernels + "."))}
            assert outside <= {"colibri_server.model.format"}, (mod, outside)


def test_format_describes_bytes_only():
    g = import_graph()
    assert "colibri_server.model.hugepages" not in _reach(g, "colibri_server.model.format")
    assert g["colibri_server.model.format"] == set()


def test_cli_reaches_the_model_through_its_api_only():
    g = import_graph()
    helpers = {"colibri_server.model.kernels", "colibri_server.model.panels", "colibri_server.model.sampler"}
    assert not {n for n in g["colibri_server.cli"] if n in helpers or n.startswith("colibri_server.model.kernels.")}


def test_the_model_never_imports_the_roles_the_wire_or_the_gateway():
    g = import_graph()
    above = ("colibri_server.cli", "colibri_server.master", "colibri_server.router", "colibri_server.worker",
             "colibri_server.http", "colibri_server.client", "colibri_server.wire", "colibri_server.commands")
    for mod, edges in g.items():
        if mod.startswith("colibri_server.model"):
            assert not {n for n in edges if n.startswith(above)}, mod


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_too_long_to_read(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)}: {n} lines (split it by concept)"
