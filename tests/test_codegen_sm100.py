"""The SM100 (Blackwell) forward and backward: variant rules, rendering, and compiling them for
sm_100a on a machine with no GPU, with the PTX checked for tcgen05 MMAs, tensor-memory
allocation and TMA loads (skipped without the CUTLASS DSL). No Blackwell GPU was available, so
the kernels are experimental: the manifest says so."""

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
from maskc.ir.strategy import Tiles, select_tiles


def variant(**overrides) -> KernelVariant:
    fields = dict(arch="sm_100a", direction="fwd", head_dim=128, dtype="bf16", num_heads_q=8, num_heads_kv=2, tile_m=128,
                  tile_n=128, num_stages=3)  # fmt: skip
    fields.update(overrides)
    return KernelVariant(**fields)


def backward(**overrides) -> KernelVariant:
    return variant(**{"direction": "bwd", "num_stages": 2, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"pack_gqa": True}, "the sm_100a fwd has no pack_gqa variant yet"),
        ({"direction": "bwd", "tile_m": 64}, "sm_100a bwd tiles 64 x 128 with 3 stage(s) are not supported; supported: "
                                             "128 x 128, 2 stages"),
        ({"direction": "bwd", "num_stages": 2, "has_sink": True}, "the sm_100a backward has no sink / max_logits / unmasked"),
        ({"direction": "bwd", "num_stages": 2, "unmasked": True}, "the sm_100a backward has no sink / max_logits / unmasked"),
        ({"tile_n": 64}, "sm_100a fwd tiles 128 x 64 with 3 stage(s) are not supported; supported: 128 x 128, 3 stages"),
        ({"num_stages": 4}, "supported: 128 x 128, 3 stages"),
        ({"head_dim": 64}, "supported: 128 x 128, 4 stages"),
        ({"deterministic": True}, "deterministic is a backward option"),
    ],
)
def test_bad_sm100_variants_raise_clear_errors(overrides, message):
    with pytest.raises(VariantError, match=re.escape(message)):
        variant(**overrides)


def test_sm100_is_native_and_experimental_in_both_directions():
    assert "sm_100a" in NATIVE_ARCHS and EXPERIMENTAL_ARCHS == ("sm_100a",)
    v = variant()
    assert v.experimental and template_name(v) == "attn_fwd_sm100.py.jinja"
    assert v.key().startswith("attn_fwd_sm100_d128_bf16_h8x2_t128x128s3_")
    assert v.smem_bytes() == (128 + 3 * 128) * 128 * 2  # Q and three K/V stages; P lives in TMEM
    b = backward(deterministic=True)
    assert b.experimental and template_name(b) == "attn_bwd_sm100.py.jinja"
    assert b.smem_bytes() == (2 * 128 * 128 + 2 * 2 * 128 * 128 + 128 * 128) * 2  # K, V, two (Q, dO) stages, dS^T
    portable = KernelVariant("sm_100a", "fwd", 128, "bf16", 8, 2, 64, 64, 2, portable=True)
    hopper = KernelVariant("sm_90a", "fwd", 128, "bf16", 8, 2, 128, 128, 2)
    assert not portable.experimental and not hopper.experimental
    assert variant_record(v, "x.o", "attn_fwd")["experimental"] is True
    assert variant_record(hopper, "x.o", "attn_fwd")["experimental"] is False
    assert select_tiles("sm_100a", 64) == select_tiles("sm_100a", 64, "fwd") and select_tiles("sm_100a", 64).num_stages == 4
    assert select_tiles("sm_100a", 64, "bwd") == select_tiles("sm_100a", 128, "bwd") == Tiles(128, 128, 2)
    with pytest.raises(MaskcError, match="no kernel of its own for arch 'sm_80'"):
        select_tiles("sm_80", 128, "bwd")


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
    assert not used & {"warpgroup", "LdMatrix8x8x16bOp", "CopyG2SOp"}
    assert "EXPERIMENTAL" in source and "\n\n\n\n" not in source and "{{" not in source and "{%" not in source
    assert max(len(line) for line in source.splitlines()) <= 130
    assert ("tanh" in source) == bool(features)


@pytest.mark.parametrize("features", [{}, {"has_softcap": True, "deterministic": True}])
def test_rendered_backward_uses_tcgen05_tmem_and_the_shared_macros(features):
    source = render(backward(**features))
    tree = ast.parse(source)
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    shared = {"load_line_bounds", "line_mask_bits", "apply_line_mask", "store_o_zero", "red_add_v4_f32",
              "attn_bwd_prep_kernel", "launch_bwd_prep", "make_umma", "tmem_tensor", "row_copy", "load_stage"}  # fmt: skip
    own = {"loader", "issue_scores", "issue_dp_dv", "finish_block", "mma_warp", "compute_block", "compute_warps",
           "dq_warps", "attn_bwd_kernel", "attn_bwd"}  # fmt: skip
    assert shared | own <= names
    assert {"softcap_with_grad", "load_acquire"} <= names  # traced only where used: tanh and acquire in the PTX tests
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert {"TmemAllocator", "Ld32x32bOp", "St32x32bOp", "PipelineTmaUmma", "PipelineUmmaAsync", "PipelineAsyncUmma"} <= used
    assert not used & {"warpgroup", "LdMatrix8x8x16bOp", "CopyG2SOp"}
    assert "EXPERIMENTAL" in source and "\n\n\n\n" not in source and "{{" not in source and "{%" not in source
    assert max(len(line) for line in source.splitlines()) <= 130


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_entry_signature_is_the_abi_of_its_direction(direction):
    hopper = KernelVariant("sm_90a", direction, 128, "bf16", 8, 2, 128 if direction == "fwd" else 64, 128, 2)
    own = variant() if direction == "fwd" else backward()
    args = [
        [a.arg for a in next(n for n in ast.parse(render(x)).body if getattr(n, "name", "") == f"attn_{direction}").args.args]
        for x in (own, hopper)
    ]
    assert args[0] == args[1]


COMPILED = {
    "d128_bf16": variant(),
    "d64_fp16_features": variant(head_dim=64, dtype="fp16", num_heads_kv=8, num_stages=4, has_softcap=True,
                                 has_sink=True, has_max_logits=True),  # fmt: skip
    "bwd_d128_bf16": backward(),
    "bwd_d64_fp16_features": backward(head_dim=64, dtype="fp16", num_heads_kv=8, has_softcap=True, deterministic=True),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "sm100_objects", COMPILED)


def sm100_ptx(obj, v: KernelVariant) -> str:
    """The PTX of a compiled SM100 kernel, after the checks both directions share: an ELF object
    for sm_100a, one tensor-memory allocation and free, 32x32b TMEM loads and stores with their
    waits, commits, 3-D TMA loads, no older MMA or copy, tanh exactly with softcap."""
    assert obj.object_path.read_bytes()[:4] == b"\x7fELF"
    ptx = obj.ptx_text
    assert ".target sm_100a" in ptx
    assert ptx.count("tcgen05.alloc.cta_group::1") == 1 and ptx.count("tcgen05.dealloc.cta_group::1") == 1
    assert "tcgen05.relinquish_alloc_permit" in ptx
    assert "tcgen05.ld.sync.aligned.32x32b" in ptx and "tcgen05.st.sync.aligned.32x32b" in ptx
    assert "tcgen05.commit" in ptx and "tcgen05.wait::ld" in ptx and "tcgen05.wait::st" in ptx
    assert "cp.async.bulk.tensor.3d" in ptx
    for older in ("wgmma", "mma.sync", "ldmatrix", "cp.async.cg"):
        assert older not in ptx
    assert ("tanh.approx" in ptx) == v.has_softcap
    return ptx


MMA_FROM_TMEM = r"tcgen05\.mma\.cta_group::1\.kind::f16\S* \[%r\d+\], \[%r\d+\]"  # A read from TMEM


@pytest.mark.parametrize("name", [name for name in sorted(COMPILED) if not name.startswith("bwd")])
def test_compiles_for_sm100a_with_tcgen05_mma_tensor_memory_and_tma(compiled, name):
    v = COMPILED[name]
    ptx = sm100_ptx(compiled[name], v)
    # S = Q K^T (HEAD_DIM / 16 k steps) and O += P V (TILE_N / 16), each issued at two places.
    assert ptx.count("tcgen05.mma.cta_group::1.kind::f16") == 2 * (v.head_dim // 16 + v.tile_n // 16)
    assert re.search(MMA_FROM_TMEM, ptx)  # P read from TMEM
    assert "shfl.sync.bfly" not in ptx  # a TMEM row is one thread's: the softmax reduces no row across threads


@pytest.mark.parametrize("name", [name for name in sorted(COMPILED) if name.startswith("bwd")])
def test_backward_compiles_for_sm100a_with_tcgen05_mma_tensor_memory_and_tma(compiled, name):
    v = COMPILED[name]
    ptx = sm100_ptx(compiled[name], v)
    # S^T and dP^T (HEAD_DIM / 16 k steps each), dV (TILE_Q / 16, P^T read from TMEM), then dQ
    # (TILE_K / 16) and dK (TILE_Q / 16) at two places: inside the block walk and after it.
    steps = 2 * v.head_dim // 16 + v.tile_m // 16 + 2 * (v.tile_n // 16 + v.tile_m // 16)
    assert ptx.count("tcgen05.mma.cta_group::1.kind::f16") == steps
    assert len(re.findall(MMA_FROM_TMEM, ptx)) == v.tile_m // 16  # dV's P^T
    assert ptx.count("red.global.add.v4.f32") == v.head_dim // 4  # a dQ row by 16-byte L2 reductions
    assert ("ld.global.acquire.gpu" in ptx) == v.deterministic  # the dQ semaphore


def test_an_artifact_marks_the_sm100_kernels_experimental(tmp_path, monkeypatch):
    pytest.importorskip("cutlass.cute")
    from maskc.codegen import write_artifact
    from maskc.codegen.cache import cached_kernel

    monkeypatch.setenv("MASKC_CACHE", str(tmp_path / "cache"))
    write_artifact(tmp_path / "out", [], kernels=[cached_kernel(variant()), cached_kernel(backward())])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    records = sorted((r["fields"]["direction"], r["fields"]["arch"], r["experimental"]) for r in manifest["variants"])
    assert records == [("bwd", "sm_100a", True), ("fwd", "sm_100a", True)]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_operand_layouts_agree_with_their_transposed_views(head_dim):
    """The SM100 backward reads each shared-memory tile as two tcgen05 operands (K and K^T, Q and
    Q^T, dO and dO^T, dS^T and dS), and the compute warps write dS^T by (key, query): every view
    must put each element at the same swizzled address."""
    pytest.importorskip("cutlass.cute")
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
    tiles = select_tiles("sm_100a", head_dim, "bwd")
    keys, queries = tiles.tile_n, tiles.tile_m
    found = []

    def umma(m, n, a, b):
        return sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, a, b, Float32, tcgen05.CtaGroup.ONE, (m, n))

    def offsets(layout, rows, cols, transposed):
        """Offset of (row, col) in an operand layout ((mn atom, k atom), mn rest, k rest, stage)."""
        shape = layout.outer.shape
        atom_mn, atom_k = cute.size(shape[0][0]), cute.size(shape[0][1])
        table = {}
        for r in range(rows):
            for c in range(cols):
                mn, k = (c, r) if transposed else (r, c)
                table[r, c] = cute.crd2idx(((mn % atom_mn, k % atom_k), mn // atom_mn, k // atom_k, 0), layout.outer)
        return str(layout.inner), table

    @cute.jit
    def check():
        kq = umma(keys, queries, k_major, k_major)
        dk = umma(keys, head_dim, k_major, mn_major)
        dq = umma(queries, head_dim, mn_major, mn_major)
        kq_t, dkv_t, dq_t = (keys, queries, head_dim), (keys, head_dim, queries), (queries, head_dim, keys)
        k_tile = sm100_utils.make_smem_layout_a(kq, kq_t, BFloat16, 1)
        q_tile = sm100_utils.make_smem_layout_b(kq, kq_t, BFloat16, 2)
        found.append(offsets(k_tile, keys, head_dim, False) == offsets(
            sm100_utils.make_smem_layout_b(dq, dq_t, BFloat16, 1), keys, head_dim, True))
        found.append(offsets(q_tile, queries, head_dim, False) == offsets(
            sm100_utils.make_smem_layout_b(dk, dkv_t, BFloat16, 2), queries, head_dim, True))
        ds_t = sm100_utils.make_smem_layout_a(dk, dkv_t, BFloat16, 1)
        found.append(offsets(ds_t, keys, queries, False) == offsets(
            sm100_utils.make_smem_layout_a(dq, dq_t, BFloat16, 1), keys, queries, True))
        atom = sm100_utils.get_smem_layout_atom_ab(k_major, BFloat16, (keys, queries))
        rows = cute.tile_to_shape(sm100_utils.make_smem_layout_atom(atom, BFloat16), (keys, queries), order=(0, 1))
        table = {(r, c): cute.crd2idx((r, c), rows.outer) for r in range(keys) for c in range(queries)}
        found.append(offsets(ds_t, keys, queries, False) == (str(rows.inner), table))

    cute.compile(check)
    assert found == [True] * 4
