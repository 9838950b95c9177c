"""docs/architecture.md's layers, measured on the imports, those inside functions included:
every import points down (or sideways between the services the page names), ``loading/``
never imports ``memory/`` and hides no import in a function (nor behind ``importlib``), the
project's modules import each other in no circle, no private name crosses a package, and the
base modules import nothing outside the standard library but torch when imported (issues 34,
41)."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path


SRC = Path(__file__).resolve().parents[1] / "src"

# The layers of docs/architecture.md, top down; a module may import its own layer and below.
LAYERS = {"interfaces": 6, "api": 5, "distributed": 4, "pipeline": 3,
          "memory": 2, "loading": 2, "io": 2, "options": 2, "faults": 2, "models": 1,
          "errors": 0, "kernels": 0, "version": 0}
# Imports between services (one layer), each stated in docs/architecture.md; never the reverse.
SIDEWAYS = {("memory", "loading"), ("memory", "options"), ("loading", "options"),
            ("io", "options")}


def _module(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class _Imports(ast.NodeVisitor):
    """The project modules a file imports: (target, line, inside a function)."""

    def __init__(self, module: str, package: str):
        self.module, self.package, self.depth, self.found = module, package, 0, []
        self.names, self.dynamic, self.external = [], [], []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.split(".")[0] == "seedvr2":
            targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            self.found += [(t, node.lineno, self.depth > 0) for t in targets]
            self.names += [(target, a.name, node.lineno) for a in node.names]
        elif not node.level and not self.depth:
            self.external.append(target.split(".")[0])

    def visit_Import(self, node):
        self.found += [(a.name, node.lineno, self.depth > 0) for a in node.names
                       if a.name.split(".")[0] == "seedvr2"]
        if not self.depth:
            self.external += [a.name.split(".")[0] for a in node.names
                              if a.name.split(".")[0] != "seedvr2"]

    def visit_Call(self, node):
        called = node.func
        if isinstance(called, ast.Attribute) and called.attr == "import_module" or \
                isinstance(called, ast.Name) and called.id in ("import_module", "__import__"):
            self.dynamic.append(node.lineno)
        self.generic_visit(node)


def imports() -> list[tuple[str, str, int, bool]]:
    """(importing module, imported module, line, inside a function) for every project import."""
    return list(_imports_under(SRC))


def _imports_under(src: Path) -> tuple:
    return tuple((v.module, target, line, inner) for v in _visited(src)
                 for target, line, inner in v.found)


@functools.lru_cache(maxsize=4)
def _visited(src: Path) -> tuple:
    visitors = []
    for path in sorted((src / "seedvr2").rglob("*.py")):
        module = _module(path, src)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        visitors.append(_Imports(module, package))
        visitors[-1].visit(ast.parse(path.read_text()))
    return tuple(visitors)


INTERFACES = {"cli", "__main__", "workflow"}  # one layer: the command line runs workflows


def _layer(module: str) -> str:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "(package)"
    if name in INTERFACES:
        return "interfaces"
    return name if name in LAYERS else "(package)"  # the package root: above every layer


def test_imports_point_down_and_sideways_only_as_documented():
    assert wrong_way_imports() == []


def wrong_way_imports() -> list[str]:
    wrong = []
    for source, target, line, _ in imports():
        a, b = _layer(source), _layer(target)
        if a == "(package)" or a == b:
            continue
        up = b == "(package)" or LAYERS[b] > LAYERS[a]
        if up or (LAYERS[b] == LAYERS[a] and (a, b) not in SIDEWAYS):
            wrong.append(f"{source}:{line} imports {target}")
    return wrong


def test_loading_never_imports_memory_and_hides_no_import_in_a_function():
    assert loading_problems() == []


def loading_problems() -> list[str]:
    found = [(s, t, line, inner) for s, t, line, inner in imports() if _layer(s) == "loading"]
    return [f"{s}:{line} -> {t}" + (" (memory)" if _layer(t) == "memory" else "") +
            (" (in a function)" if inner else "")
            for s, t, line, inner in found if inner or _layer(t) == "memory"] + \
        [f"{v.module}:{line} -> importlib" for v in _visited(SRC)
         if _layer(v.module) == "loading" for line in v.dynamic]


def import_cycles() -> list[list[str]]:
    """Circles among the project's modules (strongly connected groups of more than one),
    every import counted: at the top of a module or inside a function."""
    modules = {v.module for v in _visited(SRC)}
    graph = {m: set() for m in modules}
    for source, target, _, _ in imports():
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != source:
            graph[source].add(target)
    index, low, stack, cycles = {}, {}, [], []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(group) > 1:
                cycles.append(sorted(group))
    for module in sorted(graph):
        if module not in index:
            connect(module)
    return cycles


def test_the_modules_import_each_other_in_no_circle():
    assert import_cycles() == []


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def private_crossings() -> list[str]:
    """Private names (``_x``, or a ``_module``) imported from another package."""
    return [f"{v.module}:{line} imports {name} from {target}" for v in _visited(SRC)
            for target, name, line in v.names if _package(target) != _package(v.module)
            and (name.startswith("_") and not name.startswith("__")
                 or any(part.startswith("_") and part != "__init__"
                        for part in target.split(".")))]


def test_no_private_name_crosses_a_package():
    assert private_crossings() == []


BASE = {"seedvr2.errors", "seedvr2.kernels", "seedvr2.version"}


def test_the_base_modules_import_only_torch_beyond_the_standard_library():
    """docs/architecture.md: the base modules import torch at most when imported
    (``kernels.kitchen()`` imports comfy-kitchen on the first kernel call)."""
    allowed = set(sys.stdlib_module_names) | {"__future__", "torch"}
    assert {v.module: sorted(set(v.external) - allowed) for v in _visited(SRC)
            if v.module in BASE} == dict.fromkeys(sorted(BASE), [])


def test_loading_imports_form_no_circle():
    modules = {s for s, *_ in imports() if _layer(s) == "loading"}
    graph = {m: set() for m in modules}
    for source, target, _, inner in imports():
        if source in graph and not inner:
            owner = next((m for m in sorted(modules, key=len, reverse=True)
                          if target == m or target.startswith(m + ".")), None)
            if owner and owner != source and owner != "seedvr2.loading":
                graph[source].add(owner)
    order, state = [], {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", " -> ".join(path + [node])
        state[node] = "open"
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        state[node] = "done"
        order.append(node)
    for module in sorted(graph):
        visit(module, [])
    assert len(order) == len(graph)


def test_the_checks_see_an_upward_import_and_a_hidden_one(tmp_path, monkeypatch):
    """The measures above can fail: a models/ module importing the pipeline, a loading/
    module importing memory/ inside a function or through importlib, a circle closed inside a
    function and a private name taken from another package are all found."""
    fake = tmp_path / "seedvr2"
    (fake / "models").mkdir(parents=True)
    (fake / "loading").mkdir()
    (fake / "models" / "bad.py").write_text("from ..pipeline import runner\n")
    (fake / "loading" / "bad.py").write_text("def f():\n    from ..memory import budget\n")
    (fake / "pipeline").mkdir()
    (fake / "pipeline" / "bad.py").write_text("from .. import __version__\n")
    (fake / "loading" / "lazy.py").write_text("import importlib\nimportlib.import_module('x')\n")
    (fake / "models" / "a.py").write_text("from . import b\n")
    (fake / "models" / "b.py").write_text("def f():\n    from .a import x\n")
    (fake / "models" / "c.py").write_text("from ..loading.bad import _hidden\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    assert sorted(imports()) == [
        ("seedvr2.loading.bad", "seedvr2.memory", 2, True),
        ("seedvr2.models.a", "seedvr2.models.b", 1, False),
        ("seedvr2.models.b", "seedvr2.models.a", 2, True),
        ("seedvr2.models.bad", "seedvr2.pipeline", 1, False),
        ("seedvr2.models.c", "seedvr2.loading.bad", 1, False),
        ("seedvr2.pipeline.bad", "seedvr2.__version__", 1, False)]
    assert wrong_way_imports() == ["seedvr2.loading.bad:2 imports seedvr2.memory",
                                   "seedvr2.models.bad:1 imports seedvr2.pipeline",
                                   "seedvr2.models.c:1 imports seedvr2.loading.bad",
                                   "seedvr2.pipeline.bad:1 imports seedvr2.__version__"]
    assert loading_problems() == ["seedvr2.loading.bad:2 -> seedvr2.memory (memory) "
                                  "(in a function)", "seedvr2.loading.lazy:2 -> importlib"]
    assert import_cycles() == [["seedvr2.models.a", "seedvr2.models.b"]]
    assert private_crossings() == ["seedvr2.models.c:1 imports _hidden from seedvr2.loading.bad"]
