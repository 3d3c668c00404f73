"""The kernels' argument ABI is written once (maskc/artifact/abi.py): every kernel family's
rendered entry point takes exactly its arguments, named, annotated and commented from the spec,
and compile.py's fake arguments (what the object is compiled for) are what those annotations
declare, argument by argument. Inside, the schedule tensors travel as one Schedule. (The
exported headers against the ABI: each family's compile tests, through abi_check.py.)"""

from __future__ import annotations

import ast

import pytest

from maskc.artifact.abi import ENTRY_POINTS, STATIC_DIMS, StreamArg, TensorArg
from maskc.artifact.kernel_families import DIRECTIONS, FAMILIES, KernelFamily
from maskc.artifact.variant import KernelVariant, variant_for
from maskc.codegen.render import render

CASES = [(family, direction) for family in FAMILIES for direction in DIRECTIONS]
IDS = [f"{family.name}-{direction}" for family, direction in CASES]


def _variants(family: KernelFamily, direction: str) -> list[KernelVariant]:
    """The family's kernel without options, and with every option it has."""
    base = {"arch": family.archs[0], "direction": direction, "head_dim": 128, "dtype": "bf16", "num_heads_q": 8,
            "num_heads_kv": 2, **family.selector}  # fmt: skip
    flags = family.kernel(direction).flags
    return [variant_for(base), variant_for({**base, **dict.fromkeys(flags, True)})]


def _entry(source: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("family,direction", CASES, ids=IDS)
def test_the_entry_point_is_rendered_from_the_abi(family: KernelFamily, direction: str) -> None:
    entry_point = ENTRY_POINTS[direction]
    for v in _variants(family, direction):
        source = render(v)
        entry = _entry(source, entry_point.name)
        params = entry.args.args
        assert [p.arg for p in params] == [a.param for a in entry_point.args]
        assert [ast.unparse(p.annotation) for p in params] == [a.annotation for a in entry_point.args]
        lines = source.splitlines()
        for p, arg in zip(params, entry_point.args):
            comment = arg.comment(v)
            assert lines[p.lineno - 1] == f"    {arg.param}: {arg.annotation}," + (f"  # {comment}" if comment else "")


def test_comments_say_which_arguments_a_variant_leaves_unused() -> None:
    by_name = {a.name: a for a in ENTRY_POINTS["fwd"].args}
    plain, extras = _variants(FAMILIES[0], "fwd")
    assert by_name["row_max"].comment(plain) == "[Tq, Hq] fp32 (not used by this variant)"
    assert by_name["row_max"].comment(extras) == "[Tq, Hq] fp32: written"
    assert by_name["softcap"].comment(plain) == "not used by this variant"
    assert by_name["work_ranges"].comment(plain) == "[W+1] int32: CSR offsets into mRanges"


def test_argument_names_are_unique_and_parameters_too() -> None:
    for entry_point in ENTRY_POINTS.values():
        for attribute in ("name", "param"):
            values = [getattr(a, attribute) for a in entry_point.args]
            assert len(set(values)) == len(values), (entry_point.name, attribute)


@pytest.mark.parametrize("family,direction", CASES, ids=IDS)
def test_fake_arguments_are_what_the_signature_declares(family: KernelFamily, direction: str) -> None:
    pytest.importorskip("cutlass.cute", reason="fake arguments are CUTLASS DSL objects")
    import cutlass
    import cutlass.cute as cute

    from maskc.codegen.compile import fake_arguments

    declared = {"cute.Tensor": cute.Tensor, "Float32": cutlass.Float32, "Int32": cutlass.Int32}
    for v in _variants(family, direction):
        fakes = fake_arguments(v)
        args = ENTRY_POINTS[direction].args
        assert len(fakes) == len(args)
        static = {"Hq": v.num_heads_q, "Hkv": v.num_heads_kv, "D": v.head_dim, "Dv": v.head_dim_v}
        for fake, arg in zip(fakes, args):
            if isinstance(arg, StreamArg):
                assert "Stream" in type(fake).__name__, arg.name
                continue
            assert isinstance(fake, declared[arg.annotation]), arg.name
            if isinstance(arg, TensorArg):
                assert len(fake.shape) == len(arg.shape), arg.name
                for extent, dim in zip(fake.shape, arg.shape):
                    if isinstance(dim, int) or dim in STATIC_DIMS:
                        assert extent == static.get(dim, dim), (arg.name, dim)


@pytest.mark.parametrize("family,direction", CASES, ids=IDS)
def test_the_schedule_travels_as_one_value(family: KernelFamily, direction: str) -> None:
    """The entry point bundles its schedule tensors into one Schedule, whose fields are named as
    their ABI arguments; the kernel takes that value, and so does every function that reads it,
    none of them a schedule tensor of its own."""
    entry_point = ENTRY_POINTS[direction]
    abi_names = {a.name for ep in ENTRY_POINTS.values() for a in ep.args}
    params = {a.name: a.param for a in entry_point.args}
    for v in _variants(family, direction):
        tree = ast.parse(render(v))
        struct = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Schedule")
        fields = [n.target.id for n in struct.body if isinstance(n, ast.AnnAssign)]
        assert set(fields) <= abi_names
        tensors = {params[f] for f in fields if f in params}
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        entry = functions.pop(entry_point.name)
        bundled = [n for n in ast.walk(entry) if isinstance(n, ast.Call) and ast.unparse(n.func) == "Schedule"]
        assert len(bundled) == 1
        inside = {id(n) for n in ast.walk(bundled[0])}
        loose = [n.id for n in ast.walk(entry) if isinstance(n, ast.Name) and n.id in tensors and id(n) not in inside]
        assert not loose, loose
        assert "schedule" in {a.arg for a in functions[f"{entry_point.name}_kernel"].args.args}
        for function in functions.values():
            args = {a.arg: a for a in function.args.args}
            assert not tensors & args.keys(), function.name
            if any(isinstance(n, ast.Name) and n.id == "schedule" for n in ast.walk(function)):
                assert ast.unparse(args["schedule"].annotation) == "Schedule", function.name
