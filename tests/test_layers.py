"""docs/architecture.md's layers, measured on the imports: every import points down (or
sideways between the services the page names), ``loading/`` never imports ``memory/``, and
inside ``loading/`` the imports form no circle and none hides in a function (issue 34)."""

from __future__ import annotations

import ast
import functools
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

    def visit_Import(self, node):
        self.found += [(a.name, node.lineno, self.depth > 0) for a in node.names
                       if a.name.split(".")[0] == "seedvr2"]


def imports() -> list[tuple[str, str, int, bool]]:
    """(importing module, imported module, line, inside a function) for every project import."""
    return list(_imports_under(SRC))


@functools.lru_cache(maxsize=4)
def _imports_under(src: Path) -> tuple:
    found = []
    for path in sorted((src / "seedvr2").rglob("*.py")):
        module = _module(path, src)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        visitor = _Imports(module, package)
        visitor.visit(ast.parse(path.read_text()))
        found += [(module, target, line, inner) for target, line, inner in visitor.found]
    return tuple(found)


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
            for s, t, line, inner in found if inner or _layer(t) == "memory"]


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
    """The measures above can fail: a models/ module importing the pipeline, and a loading/
    module importing memory/ inside a function, are both found."""
    fake = tmp_path / "seedvr2"
    (fake / "models").mkdir(parents=True)
    (fake / "loading").mkdir()
    (fake / "models" / "bad.py").write_text("from ..pipeline import runner\n")
    (fake / "loading" / "bad.py").write_text("def f():\n    from ..memory import budget\n")
    (fake / "pipeline").mkdir()
    (fake / "pipeline" / "bad.py").write_text("from .. import __version__\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    assert sorted(imports()) == [
        ("seedvr2.loading.bad", "seedvr2.memory", 2, True),
        ("seedvr2.models.bad", "seedvr2.pipeline", 1, False),
        ("seedvr2.pipeline.bad", "seedvr2.__version__", 1, False)]
    assert wrong_way_imports() == ["seedvr2.loading.bad:2 imports seedvr2.memory",
                                   "seedvr2.models.bad:1 imports seedvr2.pipeline",
                                   "seedvr2.pipeline.bad:1 imports seedvr2.__version__"]
    assert loading_problems() == ["seedvr2.loading.bad:2 -> seedvr2.memory (memory) "
                                  "(in a function)"]
