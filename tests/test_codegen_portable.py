"""The portable kernels (warp MMA, cp.async, ldmatrix): variant rules, rendering, and compiling
the forward and backward for every supported arch on a machine with no GPU (skipped without the
CUTLASS DSL)."""

from __future__ import annotations

import ast
import re

import pytest

from conftest import compile_variants
from maskc.artifact.families import ARCH_NAMES, native_family
from maskc.artifact.variant import KernelVariant
from maskc.codegen.render import render, template_name
from maskc.errors import VariantError


def variant(**overrides) -> KernelVariant:
    fields = dict(arch="sm_80", direction="fwd", head_dim=128, dtype="bf16", num_heads_q=8, num_heads_kv=2, tile_m=64,
                  tile_n=64, num_stages=2, portable=True)  # fmt: skip
    fields.update(overrides)
    return KernelVariant(**fields)


def backward(**overrides) -> KernelVariant:
    return variant(direction="bwd", num_stages=1, **overrides)


# ---- variants --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"portable": False}, "arch sm_80 has only the portable kernel (portable=True)"),
        ({"arch": "sm_120a", "portable": False}, "arch sm_120a has only the portable kernel"),
        ({"direction": "bwd"}, "portable backward tiles 64 x 64 with 2 stage(s) are not supported"),
        ({"direction": "bwd", "num_stages": 1, "unmasked": True}, "the portable backward has no unmasked variant"),
        ({"direction": "bwd", "num_stages": 1, "has_sink": True}, "the portable backward has no sink variant"),
        ({"num_heads_q": 8, "num_heads_kv": 2, "pack_gqa": True}, "the portable forward has no pack_gqa variant"),
        ({"tile_m": 128}, "portable forward tile_m 128 is not supported; supported: 64"),
        ({"tile_n": 96}, "portable forward tile_n 96 is not supported; supported: 64, 128"),
        ({"num_stages": 3}, "portable forward num_stages 3 is not supported; supported: 2"),
        ({"deterministic": True}, "deterministic is a backward option"),
        ({"portable": 1}, "portable must be a bool"),
        ({"arch": "sm_86", "tile_n": 128, "head_dim": 128}, "more than the 100352 a CTA has on sm_86"),
    ],
)
def test_bad_portable_variants_raise_clear_errors(overrides, message):
    with pytest.raises(VariantError, match=re.escape(message)):
        variant(**overrides)


def test_every_arch_has_the_portable_kernel_and_sm90a_its_own_too():
    assert {a for a in ARCH_NAMES if native_family(a) is not None} == {"sm_90a", "sm_100a"}
    for arch in ARCH_NAMES:
        v = variant(arch=arch)
        assert template_name(v) == "attn_fwd_sm80.py.jinja"
        assert v.key().startswith(f"attn_fwd_{arch.replace('_', '').rstrip('a')}_portable_d128_bf16_h8x2_t64x64s2")
    native = KernelVariant("sm_90a", "fwd", 128, "bf16", 8, 2, 128, 128, 2)
    assert template_name(native) == "attn_fwd_sm90.py.jinja" and native.key() != variant(arch="sm_90a").key()


# ---- rendering -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kernel, features",
    [
        ("fwd", {}),
        ("fwd", {"has_softcap": True, "has_sink": True, "has_max_logits": True}),
        ("bwd", {}),
        ("bwd", {"has_softcap": True}),
    ],
)
def test_rendered_source_is_readable_python_without_hopper_instructions(kernel, features):
    source = render(variant(**features) if kernel == "fwd" else backward(**features))
    tree = ast.parse(source)
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    # The shared macros (schedule, line mask, softmax, row statistics, preprocess) and the portable pieces.
    shared = {"load_line_bounds", "line_mask_bits", "gemm_rs", "gemm_ss", "load_rows", "store_tile", "make_row_copy",
              "transposed_view"}  # fmt: skip
    own = {"decode_item", "online_softmax", "finalize_rows", "store_row_stats", "walk_block", "attn_fwd_kernel", "attn_fwd"}
    if kernel == "bwd":
        own = {"attn_bwd_prep_kernel", "red_add_f32", "bwd_step", "attn_bwd_kernel", "attn_bwd"}
    assert shared | own <= names
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert {"MmaF16BF16Op", "LdMatrix8x8x16bOp", "CopyG2SOp"} <= used
    assert not used & {"warpgroup", "setmaxregister_increase", "make_tiled_tma_atom", "PipelineTmaAsync", "StMatrix8x8x16bOp"}
    assert "\n\n\n\n" not in source and "{{" not in source and "{%" not in source
    assert max(len(line) for line in source.splitlines()) <= 130
    assert ("tanh" in source) == bool(features)


def test_entry_signatures_are_the_abis():
    """The portable entries take the same arguments, in the same order, as the SM90 ones."""
    for make in (variant, backward):
        v = make()
        native = KernelVariant(**{**v.to_dict(), "arch": "sm_90a", "portable": False, "tile_n": 128,
                                  "tile_m": 64 if v.direction == "bwd" else 128, "num_stages": 2})  # fmt: skip
        args = [
            [a.arg for a in next(n for n in ast.parse(render(x)).body if getattr(n, "name", "") == f"attn_{x.direction}").args.args]
            for x in (v, native)
        ]
        assert args[0] == args[1] and len(args[0]) >= 16


# ---- compiling (CUTLASS DSL, no GPU) ------------------------------------------------------------

COMPILED = {arch: variant(arch=arch) for arch in ARCH_NAMES}
COMPILED["sm_80_d64_fp16_features"] = variant(
    head_dim=64, dtype="fp16", num_heads_kv=8, tile_n=128, has_softcap=True, has_sink=True, has_max_logits=True
)
COMPILED.update({f"{arch}_bwd": backward(arch=arch) for arch in ("sm_80", "sm_90a", "sm_120a")})
COMPILED["sm_90a_bwd_deterministic"] = backward(arch="sm_90a", deterministic=True)
COMPILED["sm_86_bwd_d64_fp16_softcap"] = backward(arch="sm_86", head_dim=64, dtype="fp16", num_heads_kv=8, has_softcap=True)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "portable_objects", COMPILED)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiles_for_every_arch_with_warp_mma_cp_async_and_ldmatrix(compiled, name):
    obj = compiled[name]
    assert obj.object_path.read_bytes()[:4] == b"\x7fELF"
    ptx = obj.ptx_text
    arch = COMPILED[name].arch
    assert f".target {arch}" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert "cp.async.cg.shared.global" in ptx
    for hopper in ("wgmma", "cp.async.bulk", "setmaxnreg", "mbarrier.try_wait"):
        assert hopper not in ptx
    assert ("tanh.approx" in ptx) == COMPILED[name].has_softcap
    # The backward: its preprocess kernel first, dQ by L2 reductions (no other atomics).
    backward_kernel = COMPILED[name].direction == "bwd"
    assert (".entry kernel_cutlass_attn_bwd_prep_kernel" in ptx) == backward_kernel
    assert ("red.global.add.f32" in ptx) == backward_kernel and "atom.global" not in ptx
    # Deterministic: each q block's semaphore, waited on with acquire and counted with release.
    deterministic = COMPILED[name].deterministic
    assert ("ld.global.acquire.gpu" in ptx and "red.release.gpu.global.add.s32" in ptx) == deterministic


def test_exported_headers_match_the_abis(compiled):
    from abi_check import assert_header_matches_abi
    from maskc.artifact.abi import BACKWARD_ABI, FORWARD_ABI

    assert_header_matches_abi(compiled["sm_80"].header_path.read_text(), FORWARD_ABI)
    assert_header_matches_abi(compiled["sm_80_bwd"].header_path.read_text(), BACKWARD_ABI)
