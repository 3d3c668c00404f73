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
from generated_source import (
    abi_kinds,
    assert_reads_top_to_bottom,
    entry_params,
    header_arg_kinds,
    module_constants,
)

from maskc.artifact.kernel_families import FAMILIES, HeadDim, Tiles, native_family, select_tiles
from maskc.artifact.variant import KernelVariant
from maskc.codegen.cache import variant_record
from maskc.codegen.render import render, template_name
from maskc.errors import MaskcError, VariantError


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
        ({"pack_gqa": True}, "the SM100 forward has no pack_gqa variant"),
        ({"direction": "bwd", "tile_m": 64}, "SM100 backward tiles 64 x 128 with 3 stage(s) are not supported; supported: "
                                             "128 x 128, 2 stages"),
        ({"direction": "bwd", "num_stages": 2, "has_sink": True}, "the SM100 backward has no sink variant"),
        ({"direction": "bwd", "num_stages": 2, "unmasked": True}, "the SM100 backward has no unmasked variant"),
        ({"tile_n": 64}, "SM100 forward tiles 128 x 64 with 3 stage(s) are not supported; supported: 128 x 128, 3 stages"),
        ({"num_stages": 4}, "supported: 128 x 128, 3 stages"),
        ({"head_dim": 64}, "supported: 128 x 128, 4 stages"),
        ({"deterministic": True}, "deterministic is a backward option"),
    ],
)
def test_bad_sm100_variants_raise_clear_errors(overrides, message):
    with pytest.raises(VariantError, match=re.escape(message)):
        variant(**overrides)


def test_sm100_is_native_and_experimental_in_both_directions():
    assert native_family("sm_100a") is not None
    assert [a for f in FAMILIES if f.experimental and not f.portable for a in f.archs] == ["sm_100a"]
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
    d64, d128 = HeadDim(64, 64), HeadDim(128, 128)
    assert select_tiles("sm_100a", d64) == select_tiles("sm_100a", d64, "fwd") and select_tiles("sm_100a", d64).num_stages == 4
    assert select_tiles("sm_100a", d64, "bwd") == select_tiles("sm_100a", d128, "bwd") == Tiles(128, 128, 2)
    with pytest.raises(MaskcError, match="no kernel of its own for arch 'sm_80'"):
        select_tiles("sm_80", d128, "bwd")


@pytest.mark.parametrize(
    "direction, features",
    [
        ("fwd", {}),
        ("fwd", {"has_softcap": True, "has_sink": True, "has_max_logits": True}),
        ("bwd", {}),
        ("bwd", {"has_softcap": True, "deterministic": True}),
    ],
)
def test_rendered_source_reads_top_to_bottom_with_the_variant_as_module_constants(direction, features):
    """The variant's shape, its threads (TMEM-owning warps, one MMA warp, one TMA warp) and its
    optional features are module constants, which the kernel code branches on at compile time
    (const_expr); the docstring says the kernel is experimental."""
    v = variant(**features) if direction == "fwd" else backward(**features)
    source = render(v)
    tree = assert_reads_top_to_bottom(source, v.key())
    assert "EXPERIMENTAL" in ast.get_docstring(tree)
    constants = module_constants(source)
    shape = {"HEAD_DIM": 128, "NUM_HEADS_Q": 8, "NUM_HEADS_KV": 2, "NUM_STAGES": v.num_stages, "TMEM_COLS": 512}
    if direction == "fwd":
        shape.update(TILE_M=128, TILE_N=128, NUM_THREADS=192, SOFTMAX_THREADS=128, MMA_WARP=4, LOAD_WARP=5)
    else:
        shape.update(TILE_Q=128, TILE_K=128, NUM_THREADS=448, COMPUTE_THREADS=256, REDUCE_THREADS=128, MMA_WARP=12,
                     LOAD_WARP=13)  # fmt: skip
    assert {name: constants[name] for name in shape} == shape
    assert 32 * (max(constants["MMA_WARP"], constants["LOAD_WARP"]) + 1) == constants["NUM_THREADS"]
    flags = {"HAS_SOFTCAP": v.has_softcap, "HAS_SINK": v.has_sink, "HAS_MAX_LOGITS": v.has_max_logits,
             "PACK_GQA": v.pack_gqa, "DETERMINISTIC": v.deterministic, "UNMASKED": v.unmasked}  # fmt: skip
    assert {name: constants[name] for name in flags} == flags


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
    waits, 3-D TMA loads, the pipelines' mbarriers (TMA byte counts, MMA commits, waits), no
    older MMA or copy, tanh exactly with softcap."""
    assert obj.object_path.read_bytes()[:4] == b"\x7fELF"
    ptx = obj.ptx_text
    assert ".target sm_100a" in ptx
    assert ptx.count("tcgen05.alloc.cta_group::1") == 1 and ptx.count("tcgen05.dealloc.cta_group::1") == 1
    assert "tcgen05.relinquish_alloc_permit" in ptx
    assert "tcgen05.ld.sync.aligned.32x32b" in ptx and "tcgen05.st.sync.aligned.32x32b" in ptx
    assert "tcgen05.commit" in ptx and "tcgen05.wait::ld" in ptx and "tcgen05.wait::st" in ptx
    assert "cp.async.bulk.tensor.3d" in ptx
    assert "mbarrier.arrive.expect_tx.shared.b64" in ptx and "mbarrier.try_wait.parity.shared.b64" in ptx
    assert "tcgen05.commit.cta_group::1.mbarrier::arrive::one" in ptx
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
    assert "shfl.sync.bfly" not in ptx  # one TMEM row per thread: no row reduction across threads
    # The kernel takes the arguments of its variant's features only (the others are None).
    params = entry_params(ptx, "attn_fwd_kernel")
    # Global tensors: O, the LSE, the backward's lse_log2 and the five schedule tensors (Q, K, V
    # come as TMA atoms); the row max, the sinks. Scalars: the exponent's scale and lse_log2's
    # offset; the max logits' scale, the softcap's two.
    assert params[".align 8 .b8"] == 8 + v.has_max_logits + v.has_sink
    assert params[".f32"] == 2 + v.has_max_logits + 2 * v.has_softcap


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
    # Global tensors: lse, delta, dQ, dK, dV, the items, their CSR and the five schedule tensors;
    # the semaphores, work blocks and block ranks of the deterministic dQ. Scalars: the two
    # scales; the softcap's two.
    params = entry_params(ptx, "attn_bwd_kernel")
    assert params[".align 8 .b8"] == 12 + 3 * v.deterministic
    assert params[".f32"] == 2 + 2 * v.has_softcap


def test_exported_headers_match_the_abis(compiled):
    """The exported functions take the ABI's arguments, in its order, with its tensor extents."""
    from abi_check import assert_header_matches_abi

    from maskc.artifact.abi import BACKWARD_ABI, FORWARD_ABI

    for name, abi in (("d128_bf16", FORWARD_ABI), ("bwd_d128_bf16", BACKWARD_ABI)):
        header = compiled[name].header_path.read_text()
        assert_header_matches_abi(header, abi)
        assert header_arg_kinds(header, f"attn_{COMPILED[name].direction}") == abi_kinds(abi)


@pytest.mark.slow
def test_an_artifact_marks_the_sm100_kernels_experimental(tmp_path, monkeypatch):
    pytest.importorskip("cutlass.cute")
    from maskc.codegen import write_artifact
    from maskc.codegen.cache import cached_kernel

    monkeypatch.setenv("MASKC_CACHE", str(tmp_path / "cache"))
    write_artifact(tmp_path / "out", [], kernels=[cached_kernel(variant()), cached_kernel(backward())])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    records = sorted((r["fields"]["direction"], r["fields"]["arch"], r["experimental"]) for r in manifest["variants"])
    assert records == [("bwd", "sm_100a", True), ("fwd", "sm_100a", True)]


@pytest.mark.slow
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
    tiles = select_tiles("sm_100a", HeadDim(head_dim, head_dim), "bwd")
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
