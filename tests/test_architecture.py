"""The package's layout: imports flow one way (type-only imports included), and no module reads
another module's underscored names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pergrad"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` in module ``name`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path) -> set[str]:
    """The pergrad modules ``name`` imports, anywhere in it (``if TYPE_CHECKING:`` and functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= submodules or ({module} & MODULES.keys())
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & MODULES.keys()
    return found - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_graph_is_read_from_the_sources() -> None:
    assert "pergrad._core.backward.state" in GRAPH["pergrad._core.backward.engine"]
    assert (
        "pergrad._core.parallel.world" in GRAPH["pergrad._core.parallel.distributed"]
    )  # a type-only import would count too


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state:
                found = visit(dep, [*path, dep])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_imports_flow_one_way() -> None:
    # the package's __init__ sits above everything (the demo imports it, as a user would)
    inner = {n: deps - {"pergrad"} for n, deps in GRAPH.items() if n != "pergrad"}
    assert _cycle(inner) is None, f"import cycle: {' -> '.join(_cycle(inner) or [])}"


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _private_names(tree: ast.AST) -> set[str]:
    """Underscored names a module defines: functions, classes, methods, ``self._x`` attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            names.add(node.attr)
    for statement in getattr(tree, "body", []):  # module-level names
        for target in getattr(statement, "targets", [getattr(statement, "target", None)]):
            if isinstance(target, ast.Name):
                names.add(target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
PRIVATE = {name: _private_names(tree) for name, tree in TREES.items()}


def _foreign_reads(name: str) -> list[str]:
    """Reads of another pergrad module's underscored names in module ``name``."""
    own = PRIVATE[name]
    others = set().union(*(names for other, names in PRIVATE.items() if other != name)) - own
    found = []
    for node in ast.walk(TREES[name]):
        if (isinstance(node, ast.ImportFrom) and node.level) or (
            isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pergrad")
        ):
            module = _absolute(name, node)
            found += [
                alias.name
                for alias in node.names
                if alias.name.startswith("_") and f"{module}.{alias.name}" not in MODULES  # a private module is no read
            ]
        elif isinstance(node, ast.Attribute) and node.attr in others and not _on_self(node):
            found.append(f"{ast.unparse(node.value)}.{node.attr}")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reads_another_modules_private_names(name: str) -> None:
    assert _foreign_reads(name) == []
