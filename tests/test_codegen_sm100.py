"""The SM100 (Blackwell) forward: variant rules, rendering, and compiling it for sm_100a on a
machine with no GPU, with the PTX checked for tcgen05 MMAs, tensor-memory allocation and TMA
loads (skipped without the CUTLASS DSL). No Blackwell GPU was available, so the kernel is
experimental: the manifest says so."""

from __future__ import annotations

import ast
import json
import re

import pytest

from conftest import compile_variants
from maskc.codegen.cache import variant_record
from maskc.codegen.render import render, template_name
from maskc.codegen.variant import EXPERIMENTAL_ARCHS, NATIVE_ARCHS, KernelVariant, VariantError
from maskc.errors import MaskcError
from maskc.ir.strategy import select_tiles


def variant(**overrides) -> KernelVariant:
    fields = dict(arch="sm_100a", direction="fwd", head_dim=128, dtype="bf16", num_heads_q=8, num_heads_kv=2, tile_m=128,
                  tile_n=128, num_stages=3)  # fmt: skip
    fields.update(overrides)
    return KernelVariant(**fields)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"direction": "bwd", "tile_m": 64}, "sm_100a has no backward kernel of its own yet; its backward is the portable one"),
        ({"pack_gqa": True}, "the sm_100a forward has no pack_gqa variant yet"),
        ({"tile_n": 64}, "sm_100a fwd tiles 128 x 64 with 3 stage(s) are not supported; supported: 128 x 128, 3 stages"),
        ({"num_stages": 4}, "supported: 128 x 128, 3 stages"),
        ({"head_dim": 64}, "supported: 128 x 128, 4 stages"),
        ({"deterministic": True}, "deterministic is a backward option"),
    ],
)
def test_bad_sm100_variants_raise_clear_errors(overrides, message):
    with pytest.raises(VariantError, match=re.escape(message)):
        variant(**overrides)


def test_sm100_is_native_and_experimental_and_has_a_forward_only():
    assert "sm_100a" in NATIVE_ARCHS and EXPERIMENTAL_ARCHS == ("sm_100a",)
    v = variant()
    assert v.experimental and template_name(v) == "attn_fwd_sm100.py.jinja"
    assert v.key().startswith("attn_fwd_sm100_d128_bf16_h8x2_t128x128s3_")
    assert v.smem_bytes() == (128 + 3 * 128) * 128 * 2  # Q and three K/V stages; P lives in TMEM
    portable = KernelVariant("sm_100a", "fwd", 128, "bf16", 8, 2, 64, 64, 2, portable=True)
    hopper = KernelVariant("sm_90a", "fwd", 128, "bf16", 8, 2, 128, 128, 2)
    assert not portable.experimental and not hopper.experimental
    assert variant_record(v, "x.o", "attn_fwd")["experimental"] is True
    assert variant_record(hopper, "x.o", "attn_fwd")["experimental"] is False
    assert select_tiles("sm_100a", 64) == select_tiles("sm_100a", 64, "fwd") and select_tiles("sm_100a", 64).num_stages == 4
    with pytest.raises(MaskcError, match="no kernel of its own for arch 'sm_100a' and direction bwd"):
        select_tiles("sm_100a", 128, "bwd")


@pytest.mark.parametrize("features", [{}, {"has_softcap": True, "has_sink": True, "has_max_logits": True}])
def test_rendered_source_uses_tcgen05_tmem_and_the_shared_macros(features):
    source = render(variant(**features))
    tree = ast.parse(source)
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    shared = {"decode_item", "block_range", "load_line_bounds", "line_mask_bits", "apply_line_mask", "online_softmax",
              "finalize_rows", "store_row_stats", "store_o_zero", "make_row_copy"}  # fmt: skip
    own = {"make_umma", "tmem_tensor", "row_copy", "loader", "mma_warp", "softmax_block", "softmax_warps",
           "attn_fwd_kernel", "attn_fwd"}  # fmt: skip
    assert shared | own <= names
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert {"TmemAllocator", "Ld32x32bOp", "St32x32bOp", "PipelineTmaUmma", "PipelineUmmaAsync", "PipelineAsyncUmma"} <= used
    assert not used & {"warpgroup", "LdMatrix8x8x16bOp", "CopyG2SOp", "warp_reduction_max"}
    assert "EXPERIMENTAL" in source and "\n\n\n\n" not in source and "{{" not in source and "{%" not in source
    assert max(len(line) for line in source.splitlines()) <= 130
    assert ("tanh" in source) == bool(features)


def test_entry_signature_is_the_forward_abi():
    hopper = KernelVariant("sm_90a", "fwd", 128, "bf16", 8, 2, 128, 128, 2)
    args = [
        [a.arg for a in next(n for n in ast.parse(render(x)).body if getattr(n, "name", "") == "attn_fwd").args.args]
        for x in (variant(), hopper)
    ]
    assert args[0] == args[1]


COMPILED = {
    "d128_bf16": variant(),
    "d64_fp16_features": variant(head_dim=64, dtype="fp16", num_heads_kv=8, num_stages=4, has_softcap=True,
                                 has_sink=True, has_max_logits=True),  # fmt: skip
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "sm100_objects", COMPILED)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiles_for_sm100a_with_tcgen05_mma_tensor_memory_and_tma(compiled, name):
    obj = compiled[name]
    v = COMPILED[name]
    assert obj.object_path.read_bytes()[:4] == b"\x7fELF"
    ptx = obj.ptx_text
    assert ".target sm_100a" in ptx
    # S = Q K^T (HEAD_DIM / 16 k steps) and O += P V (TILE_N / 16), each issued at two places.
    assert ptx.count("tcgen05.mma.cta_group::1.kind::f16") == 2 * (v.head_dim // 16 + v.tile_n // 16)
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::f16\S* \[%r\d+\], \[%r\d+\]", ptx)  # P read from TMEM
    assert ptx.count("tcgen05.alloc.cta_group::1") == 1 and ptx.count("tcgen05.dealloc.cta_group::1") == 1
    assert "tcgen05.relinquish_alloc_permit" in ptx
    assert "tcgen05.ld.sync.aligned.32x32b" in ptx and "tcgen05.st.sync.aligned.32x32b" in ptx
    assert "tcgen05.commit" in ptx and "tcgen05.wait::ld" in ptx and "tcgen05.wait::st" in ptx
    assert "cp.async.bulk.tensor.3d" in ptx  # Q, K and V by TMA
    for older in ("wgmma", "mma.sync", "ldmatrix", "cp.async.cg"):
        assert older not in ptx
    assert ("tanh.approx" in ptx) == v.has_softcap


def test_an_artifact_marks_the_sm100_forward_experimental(tmp_path, monkeypatch):
    pytest.importorskip("cutlass.cute")
    from maskc.codegen import write_artifact
    from maskc.codegen.cache import cached_kernel

    monkeypatch.setenv("MASKC_CACHE", str(tmp_path / "cache"))
    write_artifact(tmp_path / "out", [], kernels=[cached_kernel(variant())])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [(r["fields"]["arch"], r["experimental"]) for r in manifest["variants"]] == [("sm_100a", True)]
