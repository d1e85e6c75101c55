"""The shape of the package: its import graph has no circle, and nothing inside a subpackage imports the façade
(``lordo``, ``lordo.api``, ``lordo.cli``) that sits above it; no optimizer keeps state in its ``__dict__`` by hand."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
FACADE = ("lordo", "lordo.api", "lordo.cli", "lordo.__main__")


def modules() -> dict[str, Path]:
    out = {}
    for f in (ROOT / "lordo").rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


class Imports(ast.NodeVisitor):
    """The lordo modules one module imports (``package``: the package its relative imports start from)."""

    def __init__(self, package: str, known: dict[str, Path]) -> None:
        self.package, self.known, self.found = package, known, set()

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(a.name for a in node.names if a.name in self.known)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for a in node.names:
            sub = f"{target}.{a.name}"
            self.found.add(sub if sub in self.known else target)


def import_graph() -> dict[str, set[str]]:
    """Module → the lordo modules it imports (at the top or inside functions; not under TYPE_CHECKING). ``from X
    import name`` is an edge to the submodule X.name where there is one, else to X."""
    mods = modules()
    edges = {}
    for name, path in mods.items():
        visitor = Imports(name if path.name == "__init__.py" else name.rsplit(".", 1)[0], mods)
        visitor.visit(ast.parse(path.read_text()))
        edges[name] = {t for t in visitor.found if t in mods and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    assert cycles(import_graph()) == []


def test_the_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_no_subpackage_imports_the_facade_above_it():
    climbing = [(m, t) for m, targets in import_graph().items() if m.count(".") >= 2 for t in targets if t in FACADE]
    assert climbing == []


def test_no_optimizer_sets_its_state_through_its_dict():
    for f in (ROOT / "lordo" / "optim").glob("*.py"):
        assert "__dict__" not in f.read_text(), f


def private_imports() -> list[tuple[str, str]]:
    """(module, name) for each ``from <lordo module> import _name``: a name another module keeps to itself."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lordo")):
                found += [(name, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_s_private_name():
    assert private_imports() == []
