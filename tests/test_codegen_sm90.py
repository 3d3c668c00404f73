"""SM90 forward kernel codegen: variants, rendering, and ahead-of-time compilation (no GPU needed)."""

from __future__ import annotations

import ast
import re

import pytest
from conftest import compile_variants
from generated_source import assert_reads_top_to_bottom, entry_params, module_constants

from maskc.artifact.variant import KernelVariant, variant_for
from maskc.codegen.render import render
from maskc.errors import VariantError


def variant(**overrides) -> KernelVariant:
    fields = dict(
        arch="sm_90a",
        direction="fwd",
        head_dim=128,
        dtype="bf16",
        num_heads_q=64,
        num_heads_kv=8,
        tile_m=128,
        tile_n=128,
        num_stages=2,
        has_softcap=False,
        has_sink=False,
        has_max_logits=False,
    )
    fields.update(overrides)
    return KernelVariant(**fields)


COMPILED = {
    "d128_bf16_64x8_plain": variant(),
    "d64_fp16_8x8_softcap_sink_maxlogits": variant(
        head_dim=64,
        dtype="fp16",
        num_heads_q=8,
        num_heads_kv=8,
        tile_m=192,
        has_softcap=True,
        has_sink=True,
        has_max_logits=True,
    ),
    "d128_bf16_8x1_mqa": variant(num_heads_q=8, num_heads_kv=1),
    "d96_bf16_64x8_p_in_smem": variant(head_dim=96, tile_m=192),
    "d128_bf16_64x8_tall": variant(tile_m=192, tall=True),
    "d128_bf16_64x8_pack_gqa": variant(pack_gqa=True),
    "d64_fp16_8x1_pack_gqa_softcap_sink_maxlogits": variant(
        head_dim=64,
        dtype="fp16",
        num_heads_q=8,
        num_heads_kv=1,
        tile_m=192,
        has_softcap=True,
        has_sink=True,
        has_max_logits=True,
        pack_gqa=True,
    ),
}


# ---- variants --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"head_dim": 80}, "supported head dims: 64, 96, 128, 192/128, 192, 256"),
        ({"head_dim": 128, "head_dim_v": 64}, "supported head dims: 64, 96, 128, 192/128, 192, 256"),
        ({"head_dim": 256}, "tile_n 128 with head_dim 256 does not fit in registers"),
        ({"num_heads_q": 12, "num_heads_kv": 8}, "must be a multiple of num_heads_kv"),
        ({"dtype": "fp32"}, "dtype 'fp32' is not supported"),
        ({"arch": "sm_70"}, "arch 'sm_70' is not supported"),
        ({"arch": "sm_80"}, "arch sm_80 has only the portable kernel (portable=True)"),
        ({"direction": "sideways"}, "direction 'sideways' is not supported"),
        ({"tile_m": 64}, "SM90 forward tile_m 64 is not supported; supported: 128, 192"),
        ({"tile_n": 120}, "SM90 forward tile_n 120 is not supported; supported: multiples of 16 in [64, 192]"),
        ({"tile_m": 192, "head_dim": 128, "tile_n": 144}, "with head_dim 128 needs tile_n <= 128 (registers)"),
        ({"tile_m": 192, "head_dim": 96, "tile_n": 176}, "with head_dim 96 needs tile_n <= 160 (registers)"),
        ({"tile_m": 192, "head_dim": 64, "tile_n": 144}, "with head_dim <= 64 needs tile_n <= 128 (registers)"),
        ({"tile_m": 192, "head_dim": 192, "tile_n": 64}, "tile_m 192 (3 consumer warpgroups) needs head_dim <= 128, got 192"),
        ({"tall": True, "head_dim": 96}, "has no tall tile for head_dim 96; it has one for 128"),
        ({"tall": True, "direction": "bwd", "tile_m": 64}, "backward has no tall tile for head_dim 128"),
        ({"num_stages": 4}, "shared memory"),
        ({"num_heads_kv": 0}, "positive int"),
        ({"has_sink": 1}, "must be a bool"),
        ({"pack_gqa": True, "num_heads_q": 8, "num_heads_kv": 8}, "pack_gqa needs"),
        ({"pack_gqa": True, "num_heads_q": 12, "num_heads_kv": 4}, "power of two"),
        ({"pack_gqa": 1}, "must be a bool"),
    ],
)
def test_bad_variants_raise_clear_errors(overrides, message):
    with pytest.raises(VariantError, match=re.escape(message)):
        variant(**overrides)
    with pytest.raises(ValueError):  # VariantError is a ValueError too
        variant(**overrides)


def test_key_is_stable_and_a_c_identifier():
    a, b = variant(), variant()
    assert a.key() == b.key() and hash(a) == hash(b)
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", a.key())
    keys = {v.key() for v in COMPILED.values()} | {variant(has_sink=True).key(), variant(num_stages=1).key()}
    assert len(keys) == len(COMPILED) + 2
    assert "d128_bf16_h64x8_t128x128s2" in a.key()
    assert variant(has_softcap=True, has_max_logits=True).key().split("_")[-2] == "cm"


def _request(head_dim: int, dtype: str, hq: int, hkv: int, **flags: bool) -> dict:
    base = {"has_softcap": False, "has_sink": False, "has_max_logits": False}
    return {"arch": "sm_90a", "direction": "fwd", "head_dim": head_dim, "dtype": dtype,
            "num_heads_q": hq, "num_heads_kv": hkv, **base, **flags}


def test_selected_variants_are_valid():
    assert variant_for(_request(128, "bf16", 64, 8)).tile_m == 128
    v = variant_for(_request(64, "fp16", 8, 8, has_sink=True))
    assert (v.tile_m, v.num_mma_warpgroups, v.has_sink) == (192, 3, True)


def test_q_buffers_double_when_they_fit():
    assert variant().q_stages == 2
    assert variant(num_stages=3).q_stages == 1  # 3 K/V stages leave room for one Q tile only


def test_p_goes_through_shared_memory_where_registers_run_out():
    """Three consumer warpgroups have 160 registers a thread: O, S and P of 64 rows fit at head
    dim 64, not at 96, where P takes shared memory: at 192x144 it leaves room for one Q buffer."""
    d96, d64 = variant(head_dim=96, tile_m=192), variant(head_dim=64, tile_m=192)
    assert (d96.p_in_smem, d64.p_in_smem, variant().p_in_smem) == (True, False, False)
    assert d96.smem_bytes(1) == (192 * 96 + 2 * 128 * (96 + 96) + 192 * 128) * 2  # Q, K and V stages, P
    assert (d96.q_stages, variant(head_dim=96, tile_m=192, tile_n=144).q_stages) == (2, 1)


# ---- rendering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_rendered_source_is_readable_python(name):
    source = render(COMPILED[name])
    tree = ast.parse(source)
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"attn_fwd", "attn_fwd_kernel", "producer", "consumer", "apply_line_mask", "online_softmax"} <= names
    assert source == render(COMPILED[name])  # deterministic
    assert_reads_top_to_bottom(source, COMPILED[name].key())


def test_entry_signature_is_the_forward_abi():
    tree = ast.parse(render(variant()))
    entry = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "attn_fwd")
    assert [a.arg for a in entry.args.args] == [
        "mQ", "mK", "mV", "mO", "mLSE", "mLSE2", "mRowMax", "mSink", "mWorkTile", "mWorkRanges", "mRanges",
        "mWorkLines", "mLines", "mKeyBounds", "mQueryBounds", "softmax_scale", "softcap", "num_ctas", "stream",
    ]  # fmt: skip


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_module_constants_describe_the_variant(name):
    """The variant's shape and optional features reach the kernel as module constants, which its
    const_expr branches read: PackGQA packs PACK_G query heads per K/V head and repeats each work
    item over the K/V heads only."""
    v = COMPILED[name]
    c = module_constants(render(v))
    features = {"HAS_SOFTCAP": v.has_softcap, "HAS_SINK": v.has_sink, "HAS_MAX_LOGITS": v.has_max_logits,
                "PACK_GQA": v.pack_gqa, "DETERMINISTIC": False, "UNMASKED": False}  # fmt: skip
    assert {k: c[k] for k in features} == features
    shape = {"HEAD_DIM": v.head_dim, "TILE_M": v.tile_m, "TILE_N": v.tile_n, "NUM_STAGES": v.num_stages,
             "Q_STAGES": v.q_stages, "NUM_MMA_WG": v.num_mma_warpgroups, "NUM_THREADS": 128 * (v.num_mma_warpgroups + 1),
             "COLS_PER_THREAD": v.tile_n // 4, "MASK_SLOTS": 2 if v.num_mma_warpgroups == 2 else 0,
             "P_IN_SMEM": v.p_in_smem}  # fmt: skip
    assert {k: c[k] for k in shape} == shape
    assert c["PACK_G"] == (v.qheads_per_kvhead if v.pack_gqa else 1) and 2 ** c["PACK_G_LOG2"] == c["PACK_G"]
    assert c["ITEM_HEADS"] == (v.num_heads_kv if v.pack_gqa else v.num_heads_q)
    assert c["TILE_M"] // c["PACK_G"] == v.tile_tokens


# ---- compiling (CUTLASS DSL, no GPU) ------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "sm90_objects", COMPILED)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiles_and_exports(compiled, name):
    obj = compiled[name]
    assert obj.object_path.is_file() and obj.object_path.stat().st_size > 10_000
    assert obj.object_path.read_bytes()[:4] == b"\x7fELF"
    header = obj.header_path.read_text()
    assert "cute_dsl_attn_fwd_wrapper" in header and "float softmax_scale, float softcap, int32_t num_ctas" in header
    assert obj.source_path.read_text() == render(obj.variant)
    assert obj.seconds < 120


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_ptx_uses_wgmma_tma_and_setmaxnreg(compiled, name):
    ptx = compiled[name].ptx_text
    v = COMPILED[name]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert f"m64n{v.tile_n}k16" in ptx and f"m64n{v.head_dim}k16" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads (and the O store)
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "ex2.approx" in ptx
    assert ("tanh.approx" in ptx) == v.has_softcap
    assert ".local" not in ptx  # register tensors stay in registers (no local-memory arrays)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_the_kernel_takes_only_what_its_features_use(compiled, name):
    """A feature that is off reaches the kernel as None: no parameter, no code. PackGQA loads
    and stores Q and O as (query heads x tokens) boxes of a K/V head, 4-D TMA (3-D where there
    is one K/V head: its mode drops); other variants use 3-D TMA only."""
    ptx = compiled[name].ptx_text
    v = COMPILED[name]
    # Always 21: the lse the backward takes (its tensor and log2(scale)) and the k blocks' keys
    # (mKeyBounds: blocks per document) besides the rest; the q tiles' rows where they start at
    # each document (mQueryBounds: not under PackGQA).
    params = 21 + v.document_rows + v.has_sink + 2 * v.has_max_logits + 2 * v.has_softcap
    assert sum(entry_params(ptx, "attn_fwd_kernel").values()) == params
    assert ("cp.async.bulk.tensor.4d" in ptx) == (v.pack_gqa and v.num_heads_kv > 1)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_partial_and_full_blocks_take_separate_paths(compiled, name):
    """The line mask runs on partial blocks only: besides the first block (S alone) and the last
    P V, the block step is compiled twice, with and without the mask, so the kernel issues
    S = Q K^T (HEAD_DIM / 16 wgmma) and O += P V (TILE_N / 16) three times each."""
    v = COMPILED[name]
    assert compiled[name].ptx_text.count("wgmma.mma_async") == 3 * (v.head_dim // 16 + v.tile_n // 16)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_p_v_reads_p_where_the_variant_keeps_it(compiled, name):
    """O += P V takes P as registers (a {...} A operand after the accumulator) or, with P in
    shared memory, as a wgmma descriptor, like Q in S = Q K^T."""
    wgmmas = [line for line in compiled[name].ptx_text.splitlines() if "wgmma.mma_async.sync" in line]
    register_a = any(re.sub(r"^[^}]*\}, ", "", line).startswith("{") for line in wgmmas)
    assert register_a == (not COMPILED[name].p_in_smem)


def test_exported_structs_match_what_the_runtime_packs(compiled):
    from abi_check import assert_header_matches_abi

    from maskc.artifact.abi import FORWARD_ABI

    assert_header_matches_abi(compiled["d128_bf16_64x8_plain"].header_path.read_text(), FORWARD_ABI)
