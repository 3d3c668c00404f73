"""Shared test helpers: facts about a generated kernel read from its source and its PTX."""

from __future__ import annotations

import ast
import re


def module_constants(source: str) -> dict[str, object]:
    """The generated module's constants that plain Python values determine (NAME = 64,
    NAME = OTHER // 4, NAME = A if FLAG else B), evaluated in order; others (DSL types) left out."""
    values: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<constant>", "eval"), {}, dict(values))
            except (NameError, AttributeError):
                continue
    return values


def entry_params(ptx: str, kernel: str) -> int:
    """How many parameters the PTX entry of `kernel` (e.g. attn_fwd_kernel) takes."""
    match = re.search(rf"\.entry kernel_cutlass_{kernel}_\w*\((.*?)\)", ptx, flags=re.S)
    assert match, f"no entry for {kernel}"
    return match.group(1).count(".param")


def used_before_defined(source: str) -> list[tuple[str, str]]:
    """(definition, name) pairs where a top-level definition of the module uses a module-level
    name that is only defined further down: the generated source should read top to bottom."""
    tree = ast.parse(source)
    defined: dict[str, int] = {}
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.setdefault(node.name, i)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    defined.setdefault(target.id, i)
    late = []
    for i, node in enumerate(tree.body):
        for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}:
            if defined.get(name, -1) > i:
                late.append((getattr(node, "name", f"statement {i}"), name))
    return late
