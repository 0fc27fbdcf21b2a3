"""The package's layout: imports flow one way, in the order of the layer table of docs/how-it-works.md
(type-only imports and imports inside functions included), and no module reads another module's
underscored names."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
import sys
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
    assert "pergrad._core.parallel.world" in GRAPH["pergrad._core.parallel.distributed"]  # type-only counts too


HOW_IT_WORKS = PACKAGE.parent / "docs" / "how-it-works.md"


def _layers(text: str) -> list[tuple[str, list[str]]]:
    """The rows of the layer table (``| layer | modules | what they do |``): each layer's name and the
    patterns of its modules, relative to ``pergrad``, in the order imports flow."""
    rows = text.split("| layer | modules | what they do |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [(row.split("|")[1].strip(), re.findall(r"`([^`]+)`", row.split("|")[2])) for row in rows]


LAYERS = _layers(HOW_IT_WORKS.read_text())


def _rows_of(name: str) -> list[int]:
    short = "pergrad" if name == "pergrad" else name.removeprefix("pergrad.")
    return [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(short, p) for p in patterns)]


def test_every_module_is_in_exactly_one_row_of_the_documented_layers() -> None:
    assert len(LAYERS) >= 8 and LAYERS[0][0] == "base"
    assert {name: rows for name in MODULES if len(rows := _rows_of(name)) != 1} == {}


def _upward(graph: dict[str, set[str]], row: dict[str, int]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if row[b] > row[a])


# The one way up, documented in docs/how-it-works.md: the wrapper's projection methods delegate to the attribution
# feature, importing it inside those methods (test_a_clipped_step_loads_no_feature_module_unless_asked checks that it
# is never loaded with the wrapper)
DELEGATIONS = {"pergrad.module": "pergrad.attribution"}


def test_imports_flow_in_the_documented_order() -> None:
    row = {name: _rows_of(name)[0] for name in MODULES}
    graph = {
        name: {dep for dep in deps if not dep.startswith(DELEGATIONS.get(name, "-"))} for name, deps in GRAPH.items()
    }
    assert _upward(graph, row) == []
    assert any(dep.startswith("pergrad.attribution") for dep in GRAPH["pergrad.module"])  # the exception is needed


def test_an_upward_import_is_found() -> None:
    # the core importing a feature: what the order forbids
    row = {"pergrad._core.backward.engine": 6, "pergrad.attribution.projection": 8, "pergrad.errors": 0}
    graph = {"pergrad._core.backward.engine": {"pergrad.attribution.projection", "pergrad.errors"}}
    assert _upward(graph, row) == ["pergrad._core.backward.engine -> pergrad.attribution.projection"]
    assert [name for name, _ in LAYERS][-2:] == ["features", "package"]
    assert _rows_of("pergrad.attribution.projection") == [len(LAYERS) - 2]


FEATURES = {name for name in MODULES if LAYERS[_rows_of(name)[0]][0] == "features"}

# the feature modules `import pergrad` loads for its public names: the integrations' errors, the LM loss and the
# checks Opacus and Lightning plug into the core (each imports its library only once the user has); every other
# feature module, and every optional library, loads only when asked for
WITH_THE_PACKAGE = {
    "pergrad.integrations",
    "pergrad.integrations.errors",
    "pergrad.integrations.lightning_loop",
    "pergrad.integrations.lm",
    "pergrad.integrations.opacus",
}
OPTIONAL = ("captum", "dp_accounting", "lightning", "opacus", "pytorch_lightning", "transformers")

A_CLIPPED_STEP = f"""
import json, sys, torch, pergrad
from torch import nn

def loaded():
    return sorted(m for m in sys.modules if m.startswith("pergrad") or m.split(".")[0] in {OPTIONAL!r})

net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
psm = pergrad.PerSampleModule(net, keep_grad_sample=False)
psm.register_transform(net, pergrad.transforms.clip_norm(1.0))
def step():
    net.zero_grad()
    nn.functional.cross_entropy(psm(torch.randn(5, 4)), torch.randint(0, 2, (5,))).backward()
for _ in range(3):
    step()
clipped = loaded()
psm.register_projection(net, dim=4)
step()
print(json.dumps([clipped, loaded()]))
"""


def test_a_clipped_step_loads_no_feature_module_unless_asked() -> None:
    """Pay for what you use, and ``DELEGATIONS`` stays inside the wrapper's methods: a fresh process (other
    tests import features into this one) that imports pergrad, wraps a model and trains it with clipping has loaded
    no module of the features row but ``WITH_THE_PACKAGE``, nor any optional library; registering a projection then
    loads ``pergrad.attribution``."""
    assert {"pergrad.attribution", "pergrad.privacy", "pergrad.integrations.captum", "pergrad.cli"} <= FEATURES
    assert WITH_THE_PACKAGE <= FEATURES
    done = subprocess.run(
        [sys.executable, "-c", A_CLIPPED_STEP], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    clipped, projected = json.loads(done.stdout)
    assert sorted(FEATURES.intersection(clipped) - WITH_THE_PACKAGE) == []
    assert [name for name in clipped if name.split(".")[0] in OPTIONAL] == []
    assert FEATURES.intersection(clipped) == WITH_THE_PACKAGE, "WITH_THE_PACKAGE lists a module no longer loaded"
    assert "pergrad.attribution.projection" in projected


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
