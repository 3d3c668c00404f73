"""The kernel families table (maskc/artifact/kernel_families.py) is the one place the archs, head
dims, dtypes, tile shapes and options are written: variants validate against it, compiles take
their tiles from it, the command line offers what it lists, and the docs say what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from maskc.artifact.kernel_families import (
    ARCH_NAMES,
    DIRECTIONS,
    DTYPE_NAMES,
    FAMILIES,
    FLAGS,
    HEAD_DIMS,
    PORTABLE,
    SM90,
    HeadDim,
    Kernel,
    KernelFamily,
    Tiles,
    check_head_dim,
    default_family,
    native_family,
    select_tiles,
    with_support_table,
)
from maskc.artifact.variant import variant_for
from maskc.cli import build_parser
from maskc.codegen.render import template_name
from maskc.errors import VariantError

ROOT = Path(__file__).resolve().parents[1]


D128 = HeadDim(128, 128)


def _request(family, direction, head_dim=D128, dtype="bf16", **flags) -> dict:
    return {"arch": family.archs[0], "direction": direction, "head_dim": head_dim.qk, "head_dim_v": head_dim.v,
            "dtype": dtype, "num_heads_q": 8, "num_heads_kv": 2, **family.selector, **flags}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_variant_has_exactly_the_options_its_family_lists(family, direction) -> None:
    for head_dim in family.kernel(direction).head_dims:
        for dtype in family.dtypes:
            v = variant_for(_request(family, direction, head_dim, dtype))
            tiles = family.kernel(direction).tiles[head_dim]
            assert (v.tile_m, v.tile_n, v.num_stages) == (tiles.tile_m, tiles.tile_n, tiles.num_stages)
            assert v.family is family and template_name(v) == f"attn_{direction}_{family.templates}.py.jinja"
    for flag in FLAGS:
        if family.has(direction, flag):
            assert getattr(variant_for(_request(family, direction, **{flag: True})), flag)
        else:
            with pytest.raises(VariantError, match=f"no {FLAGS[flag]} variant|{flag} is a backward option"):
                variant_for(_request(family, direction, **{flag: True}))


def test_every_arch_has_the_portable_kernels_and_at_most_one_family_of_its_own() -> None:
    assert set(PORTABLE.archs) == set(ARCH_NAMES)
    for arch in ARCH_NAMES:
        own = [f for f in FAMILIES if not f.portable and arch in f.archs]
        assert len(own) <= 1 and native_family(arch) is (own[0] if own else None)
        assert default_family(arch) is (own[0] if own and not own[0].experimental else PORTABLE)
    with pytest.raises(VariantError, match="no kernel of its own for arch 'sm_86'"):
        select_tiles("sm_86", HeadDim(128, 128))
    with pytest.raises(VariantError, match="supported head dims: 64, 96, 128, 192/128, 192, 256"):
        select_tiles("sm_90a", HeadDim(80, 80))


def test_head_dims_a_kernel_lacks_are_named_with_the_ones_it_has() -> None:
    assert select_tiles("sm_90a", HeadDim(192, 128)).tile_n == 128
    with pytest.raises(VariantError, match="the portable backward has no kernel for head_dim 256; it supports 64, 128"):
        select_tiles("sm_90a", HeadDim(256, 256), "bwd", portable=True)
    with pytest.raises(VariantError, match="the portable forward has no kernel for head_dim 96; it supports 64, 128"):
        select_tiles("sm_90a", HeadDim(96, 96), portable=True)
    assert variant_for(_request(SM90, "bwd", HeadDim(192, 128))).bwd_query_rows  # 96 keys, 48 a warpgroup
    assert variant_for(_request(SM90, "bwd", HeadDim(256, 256))).tile_n == 64  # two warpgroups split its head dims
    assert [str(d) for d in (HeadDim.parse("192/128"), HeadDim.parse(" 96"))] == ["192/128", "96"]
    for text in ("", "x", "192/", "1.5"):
        with pytest.raises(ValueError, match="a head dim is an int or qk/v"):
            HeadDim.parse(text)


def test_the_command_line_offers_what_the_table_lists(capsys) -> None:
    compile_args = ["compile", "x.mask", "-o", "out"]
    args = build_parser().parse_args([*compile_args, "--arch", ",".join(ARCH_NAMES), "--head-dim",
                                      ",".join(map(str, HEAD_DIMS)), "--dtype", ",".join(DTYPE_NAMES)])  # fmt: skip
    assert (args.arch, args.head_dim, args.dtype) == (list(ARCH_NAMES), list(HEAD_DIMS), list(DTYPE_NAMES))
    for option, value in (("--arch", "sm_70"), ("--head-dim", "80"), ("--head-dim", "128/64"), ("--dtype", "fp32")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*compile_args, option, value])
        assert f"no kernels for {value}; choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compile", "--help"])
    help_text = capsys.readouterr().out
    assert all(arch in help_text for arch in ARCH_NAMES)


def test_docs_support_tables_are_generated_from_the_table() -> None:
    doc = (ROOT / "docs" / "support.md").read_text()
    assert doc == with_support_table(doc), "run: python -m maskc.artifact.kernel_families docs/support.md"


def test_the_readme_lists_the_archs_head_dims_and_dtypes_of_the_table() -> None:
    readme = (ROOT / "README.md").read_text()
    arch_line = next(line for line in readme.splitlines() if "(`--arch`:" in line)
    assert set(re.findall(r"`(sm_\d+a?)`", arch_line)) == set(ARCH_NAMES)
    head_dims = re.search(r"\(`--head-dim`: ([\d/, ]+)\)", readme)
    assert head_dims and tuple(HeadDim.parse(d) for d in head_dims.group(1).split(",")) == HEAD_DIMS
    dtypes = re.search(r"\(`--dtype`: ([\w, ]+)\)", readme)
    assert dtypes and tuple(d.strip() for d in dtypes.group(1).split(",")) == DTYPE_NAMES


def test_archs_with_99_kib_take_the_compact_shapes_and_name_the_head_dims_they_lack() -> None:
    """A kernel's compact tiles serve the archs with 99 KiB a CTA (sm_86, sm_89, sm_120a); a head
    dim they leave out has no kernel there, and the error says why and what there is."""
    kernel = Kernel(tiles={HeadDim(64, 64): Tiles(64, 128, 2), D128: Tiles(64, 128, 2)}, flags=frozenset(), choices=None,
                    summary="", compact_tiles={HeadDim(64, 64): Tiles(64, 64, 1)})  # fmt: skip
    family = KernelFamily("test", "test", ARCH_NAMES, "sm80", kernel, kernel)
    assert [a for a in ARCH_NAMES if kernel.arch_tiles(a) is kernel.compact_tiles] == ["sm_86", "sm_89", "sm_120a"]
    check_head_dim(family, "bwd", D128, "sm_80")
    with pytest.raises(VariantError, match=re.escape("the test backward has no kernel for head_dim 128 on sm_86 (its shapes "
                                                     "need more than the 99 KiB of shared memory a CTA has there); there it "
                                                     "supports 64")):  # fmt: skip
        check_head_dim(family, "bwd", D128, "sm_86")
