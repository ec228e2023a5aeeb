"""The import graph of colibri_server, read from the sources (ast, no import runs): no circle, the
layers in their order, and no module too long to read. Function-level imports count as edges:
a circle through a deferred import is still a circle, only a later one."""
from __future__ import annotations

import ast
import pathlib
import sys

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


def test_kernels_import_nothing_of_the_model_but_the_format_and_their_cache():
    g = import_graph()
    kernels = "colibri_server.model.kernels"
    for mod, edges in g.items():
        if mod == kernels or mod.startswith(kernels + "."):
            outside = {n for n in edges if not (n == kernels or n.startswith(kernels + "."))}
            assert outside <= {"colibri_server.model.format", "colibri_server.model.numba_cache",
                                "colibri_server.model.numba_link", "colibri_server.model.numba_wrappers"}, (mod, outside)


def test_format_describes_bytes_only():
    """The file format reads only the table of llama.cpp's block kinds (their bytes) and release (how a mapping
    with live views is dropped), which read nothing."""
    g = import_graph()
    assert "colibri_server.model.hugepages" not in _reach(g, "colibri_server.model.format")
    assert g["colibri_server.model.format"] <= {"colibri_server.model.blocks", "colibri_server.model.release"}
    assert g["colibri_server.model.blocks"] == set() and g["colibri_server.model.release"] == set()


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


# -- the house: a package per process role ------------------------------------------------------
MAX_TOP_LEVEL = 15
PKG = "colibri_server"


def top_level(root: pathlib.Path = ROOT) -> list[str]:
    """The modules and packages directly under the package (its own __init__ not counted)."""
    return sorted([p.stem for p in root.glob("*.py") if p.name != "__init__.py"] +
                  [p.name for p in root.iterdir() if (p / "__init__.py").is_file()])


def test_at_most_15_modules_and_packages_at_the_top():
    names = top_level()
    assert len(names) <= MAX_TOP_LEVEL, f"{len(names)} at the top of colibri_server: {names}"


def _home(mod: str) -> str:
    """The package a module belongs to (a top-level module is its own)."""
    parts = mod.split(".")
    return ".".join(parts[:-1]) if len(parts) > 2 else mod


def _in(mod: str, pkg: str) -> bool:
    """mod is package `pkg` of colibri_server or inside it ("": anything of colibri_server)."""
    if not pkg:
        return mod.startswith(PKG + ".")
    return mod == f"{PKG}.{pkg}" or mod.startswith(f"{PKG}.{pkg}.")


def private_imports(mods: dict[str, pathlib.Path] | None = None) -> list[str]:
    """`from X import _name` where X is outside the importing module's own package (another package
    or a top-level module): a name used there is that package's public name."""
    mods = _modules() if mods is None else mods
    out = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        own = mod if is_pkg else _home(mod)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = _resolve(mod, is_pkg, node.level, node.module)
            if not _in(src, "") and src != PKG:
                continue
            holder = src if src in mods and mods[src].name == "__init__.py" else _home(src)
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and holder != own:
                    out.append(f"{mod}:{node.lineno}: {a.name} from {src}")
    return out


def test_no_private_name_is_imported_from_another_package():
    assert private_imports() == []


def test_the_private_name_rule_sees_a_crossing(tmp_path):
    pkg = tmp_path / "colibri_server"
    (pkg / "a").mkdir(parents=True)
    for f, text in {"__init__.py": "", "a/__init__.py": "", "a/x.py": "from .y import _ok\n",
                    "a/y.py": "_ok = 1\n", "b.py": "from .a.y import _bad\nfrom .a import y\n"}.items():
        (pkg / f).write_text(text)
    mods = {"colibri_server": pkg / "__init__.py", "colibri_server.a": pkg / "a/__init__.py",
            "colibri_server.a.x": pkg / "a/x.py", "colibri_server.a.y": pkg / "a/y.py", "colibri_server.b": pkg / "b.py"}
    bad = private_imports(mods)
    assert len(bad) == 1 and bad[0].endswith("_bad from colibri_server.a.y")


def test_the_worker_never_imports_the_router_or_the_master():
    g = import_graph()
    for mod in g:
        if _in(mod, "worker"):
            reached = _reach(g, mod)
            assert not {n for n in reached if _in(n, "router") or _in(n, "master")}, mod


def _third_party(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out - set(sys.stdlib_module_names) - {PKG}


def test_the_client_imports_only_the_wire_zmq_and_msgpack():
    g, mods = import_graph(), _modules()
    for mod, edges in g.items():
        if _in(mod, "client"):
            assert {n for n in edges if not (_in(n, "client") or _in(n, "wire"))} == set(), mod
            assert _third_party(mods[mod]) <= {"zmq", "msgpack"}, mod


# what the router may take from the model: the tokenizer and the block key, nothing else
ROUTER_FROM_MODEL = {f"{PKG}.model.tokenizer": {"Tokenizer"}, f"{PKG}.model.kv": {"first_block_key"}}


def test_the_router_takes_only_the_tokenizer_and_the_block_key_from_the_model():
    for mod, path in _modules().items():
        if not _in(mod, "router"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                assert not [a.name for a in node.names if _in(a.name, "model")], mod
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, path.name == "__init__.py", node.level, node.module)
                if _in(src, "model"):
                    names = {a.name for a in node.names}
                    assert names <= ROUTER_FROM_MODEL.get(src, set()), f"{mod} takes {sorted(names)} from {src}"


# -- collaborators passed in, not mixed in --------------------------------------------------------


def _self_attrs(cls: ast.ClassDef, ctx) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and isinstance(n.ctx, ctx) and not n.attr.startswith("__")}


def _defined(cls: ast.ClassDef) -> set[str]:
    """What a class sets itself: its methods, class attributes, __slots__ and self.X assignments."""
    names = _self_attrs(cls, ast.Store)
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                names |= set(ast.literal_eval(n.value))
    return names


def mixins(paths) -> list[str]:
    """Classes whose methods read self attributes that neither they nor their bases (classes of the
    same files) set: parts that work only when mixed into a class that provides them. A class with a
    base from elsewhere (Exception, a library's) is not judged."""
    classes = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)

    def provided(cls, seen=()):
        names = _defined(cls)
        for b in cls.bases:
            base = classes.get(b.id) if isinstance(b, ast.Name) and b.id not in seen else None
            if base is None:
                return None
            more = provided(base, seen + (b.id,))
            if more is None:
                return None
            names |= more
        return names

    out = []
    for name, cls in classes.items():
        have = provided(cls)
        if have is not None and _self_attrs(cls, ast.Load) - have:
            out.append(f"{name}: {sorted(_self_attrs(cls, ast.Load) - have)}")
    return out


def test_the_roles_are_assembled_from_collaborators_not_mixins():
    assert mixins(sorted(ROOT.rglob("*.py"))) == []


def test_the_mixin_rule_sees_a_mixin(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("class Part:\n    def go(self):\n        return self.workers\n\n"
                 "class Whole(Part):\n    def __init__(self):\n        self.workers = {}\n\n"
                 "class Held:\n    def __init__(self, workers):\n        self.workers = workers\n"
                 "    def go(self):\n        return self.workers\n")
    assert mixins([f]) == ["Part: ['workers']"]
