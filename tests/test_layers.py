"""The layering of maskc, checked on its import graph so that it stays one-way.

Every import of every module under maskc/ counts (also one inside a function: it runs when
called), except those under `if TYPE_CHECKING:`, which never run. A module belongs to the layer
of its subpackage (maskc.runtime is the folder runtime/); a module directly in maskc/ is a layer
of its own, except the small leaves every layer may use (BASE).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from maskc.lazy import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]
#: Where each package's source lives (pyproject.toml's package-dir).
PACKAGE_DIRS = {"maskc": ROOT / "maskc", "maskc.runtime": ROOT / "runtime", "maskc.templates": ROOT / "templates"}

#: Modules of maskc/ that import no other layer: errors, limits, file writing, lazy imports, the version,
#: values kept on tensors.
BASE = ("maskc.errors", "maskc.limits", "maskc.files", "maskc.lazy", "maskc.version", "maskc.derived")

#: The layers each layer may import, besides its own modules: only layers below it. The build
#: side runs frontend -> ir -> codegen -> artifact directories; the run side reads them through
#: the runtime; the artifact package (kernel families, variants, the argument ABI, the manifest
#: format) is the contract both sides share, below everything else.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "artifact": {"base"},
    "ir": {"base", "artifact"},
    "frontend": {"base", "ir"},
    "reference": {"base", "ir"},  # maskc/reference.py: the oracle attention
    "picture": {"base", "ir"},  # maskc/picture.py
    "templates": set(),
    "codegen": {"base", "artifact", "ir"},
    "runtime": {"base", "artifact", "ir", "reference"},
    "dist": {"base", "ir", "runtime", "reference", "picture"},
    # The public surface: the top-level package, the command line.
    "api": {"base", "artifact", "ir", "frontend", "reference", "picture", "codegen", "runtime", "dist"},
    # maskc inside other libraries (maskc.integrations.*), through the public surface only: the
    # top-level package, and maskc.dist's for the torchtitan integration's context parallelism.
    "integrations": {"base", "api", "dist"},
}
API = ("maskc", "maskc.cli", "maskc.__main__")

#: Third-party packages a layer must never import: the runtime runs where only torch and numpy
#: are installed (none of the optional dependencies), the artifact package is read by `maskc
#: --help`, which imports nothing heavy, and Transformers and torchtitan are optional extras that
#: only their integrations (`maskc.integrations.transformers`, `.torchtitan`) import.
FORBIDDEN_PACKAGES = {
    "runtime": set(OPTIONAL),
    "artifact": {"torch", "numpy", "lark", "jinja2", "cutlass", "matplotlib", "networkx"},
    "api": {"transformers", "torchtitan", "triton"},
}


def _modules() -> dict[str, Path]:
    """Every module of maskc by dotted name."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "maskc" and parts[0] in ("runtime", "templates"):
                continue  # not where these packages live
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def layer_of(module: str) -> str:
    if module in BASE:
        return "base"
    if module in API:
        return "api"
    return module.split(".")[1]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(path: Path, module: str) -> list[str]:
    """Every dotted name `path` imports outside `if TYPE_CHECKING:` (`from a import b` gives both
    a and a.b: b may be a module), relative imports resolved against `module`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _resolve(name: str) -> str | None:
    """The maskc module an imported name lives in (the longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the maskc modules it imports."""
    return {
        module: {target for name in _imported_names(path, module) if (target := _resolve(name)) and target != module}
        for module, path in MODULES.items()
    }


def third_party_imports(module: str) -> set[str]:
    return {name.split(".")[0] for name in _imported_names(MODULES[module], module) if not name.startswith("maskc")}


def layer_edges() -> dict[tuple[str, str], set[str]]:
    """(layer, layer it imports) -> the modules importing across that edge."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, targets in import_graph().items():
        for target in targets:
            if layer_of(module) != layer_of(target):
                edges[layer_of(module), layer_of(target)].add(f"{module} -> {target}")
    return edges


def reached_from(layer: str) -> set[str]:
    """The modules of `layer` and every maskc module they import, directly or not."""
    graph = import_graph()
    reached, todo = set(), [m for m in MODULES if layer_of(m) == layer]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    return reached


def _cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """One cycle of the directed graph `edges`, or None."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_has_a_layer():
    assert {layer_of(m) for m in MODULES} == set(ALLOWED)


def test_no_import_cycle_between_layers():
    cycle = _cycle(set(layer_edges()))
    assert cycle is None, "import cycle between layers: " + " -> ".join(cycle or [])


def test_each_layer_imports_only_the_layers_below_it():
    wrong = {edge: sorted(modules) for edge, modules in layer_edges().items() if edge[1] not in ALLOWED[edge[0]]}
    assert not wrong, "\n".join(f"{a} may not import {b}: {', '.join(ms)}" for (a, b), ms in sorted(wrong.items()))


def test_the_allowed_layers_are_one_way():
    assert _cycle({(a, b) for a, below in ALLOWED.items() for b in below}) is None


@pytest.mark.parametrize("layer", sorted(FORBIDDEN_PACKAGES))
def test_layers_stay_free_of_heavy_packages(layer):
    """Directly or through the maskc layers it reaches."""
    found = {m: sorted(third_party_imports(m) & FORBIDDEN_PACKAGES[layer]) for m in sorted(reached_from(layer))}
    assert not any(found.values()), {m: p for m, p in found.items() if p}


def test_the_runtime_never_reaches_the_compiler_or_the_frontend():
    assert not {layer_of(m) for m in reached_from("runtime")} & {"codegen", "frontend", "api"}


def test_the_graph_sees_imports_inside_functions_and_not_type_checking_blocks(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import maskc.codegen\n"
        "def f():\n    from maskc.ir import schedule\n"
        "from . import errors\n"
    )
    (tmp_path / "m.py").write_text(source)
    names = _imported_names(tmp_path / "m.py", "maskc.runtime.m")
    assert "maskc.ir.schedule" in names and "maskc.runtime.errors" in names
    assert not any(n.startswith("maskc.codegen") for n in names)
