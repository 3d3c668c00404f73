"""Checks of a rendered kernel module as its reader sees it, and of the kernel entries in its PTX
(used by the codegen tests)."""

from __future__ import annotations

import ast
import re
from collections import Counter


def _bound_names(node: ast.AST) -> set[str]:
    """Names a top-level statement binds for itself: parameters, assignments, nested defs."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            names.add(sub.arg)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)) and sub is not node:
            names.add(sub.name)
    return names


def assert_reads_top_to_bottom(source: str, key: str) -> ast.Module:
    """The module is Python whose docstring names the variant, with no template syntax left, at
    most two blank lines in a row and lines of at most 130 characters; each top-level function or
    class is defined once, and before any top-level statement that uses it."""
    tree = ast.parse(source)
    assert key in (ast.get_docstring(tree) or "")
    assert "{{" not in source and "{%" not in source and "\n\n\n\n" not in source
    assert max(len(line) for line in source.splitlines()) <= 130
    defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not [name for name, count in Counter(defs).items() if count > 1]
    where = {}
    for i, node in enumerate(tree.body):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for name in [getattr(node, "name", None), *(t.id for t in targets if isinstance(t, ast.Name))]:
            if name:
                where.setdefault(name, i)
    late = []
    for i, node in enumerate(tree.body):
        own = _bound_names(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in own:
                if where.get(sub.id, -1) > i:
                    late.append((getattr(node, "name", i), sub.id))
    assert not late, f"used before their definition: {late}"
    return tree


def module_constants(source: str) -> dict[str, object]:
    """The module's constants that plain Python values determine (NAME = 64, NAME = OTHER // 4,
    NAME = A if FLAG else B), evaluated in order: the variant's static values and flags. Others
    (DSL types) are left out."""
    values: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<constant>", "eval"), {}, dict(values))
            except (NameError, AttributeError):
                continue
    return values


def entry_params(ptx: str, kernel: str) -> Counter:
    """How many parameters of each PTX type the entry of `kernel` (e.g. attn_fwd_kernel) takes:
    '.f32' for a scalar, '.align 8 .b8' for a global tensor (pointer and layout)."""
    match = re.search(rf"\.entry kernel_cutlass_{kernel}_\w*\((.*?)\)", ptx, re.S)
    assert match, f"no entry for {kernel}"
    lines = [line.strip() for line in match.group(1).split(",") if line.strip()]
    return Counter(re.match(r"\.param\s+(.*?)\s+\S+$", line).group(1) for line in lines)


def header_arg_kinds(header: str, symbol: str) -> list[str]:
    """The C types, in order, of the arguments of the wrapper an exported kernel header declares
    for `symbol` (attn_fwd, attn_bwd), with each tensor struct as 'tensor': what the runtime
    packs, by position."""
    match = re.search(rf"cute_dsl_{symbol}_wrapper\(\w+ \*module, (.*?)\)\s*\{{", header, re.S)
    assert match, f"no wrapper for {symbol}"
    kinds = [param.strip().rsplit(" ", 1)[0] for param in match.group(1).split(",")]
    return ["tensor" if re.fullmatch(rf"{symbol}_Tensor_\w+_t", kind) else kind for kind in kinds]


def abi_kinds(abi) -> list[str]:
    """The C types header_arg_kinds gives for the arguments of an ABI (maskc's argument specs)."""
    return [
        "tensor" if hasattr(arg, "shape") else {"float32": "float", "int32": "int32_t"}[arg.dtype]
        if hasattr(arg, "dtype") else "cudaStream_t"
        for arg in abi
    ]
