"""SM90 backward kernel codegen: variants, rendering, and ahead-of-time compilation (no GPU needed)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from conftest import compile_variants
from generated_source import assert_reads_top_to_bottom, entry_params, module_constants

from maskc.artifact.kernel_families import backward_warpgroups
from maskc.artifact.variant import KernelVariant
from maskc.codegen.render import render
from maskc.errors import VariantError


def variant(**overrides) -> KernelVariant:
    fields = dict(
        arch="sm_90a",
        direction="bwd",
        head_dim=128,
        dtype="bf16",
        num_heads_q=8,
        num_heads_kv=2,
        tile_m=64,
        tile_n=128,
        num_stages=2,
        has_softcap=False,
    )
    fields.update(overrides)
    return KernelVariant(**fields)


def split_parts(v: KernelVariant) -> int:
    """The parts its warpgroups split a q block's queries and the head dims into: a 64-key tile's two."""
    return 1 if v.bwd_splits_keys else 2


def score_shape(v: KernelVariant) -> tuple[int, int]:
    """(M, N) of one warpgroup's S^T = K Q^T, or with queries on M (96-key tiles) of its S = Q K^T."""
    return (v.tile_m, v.bwd_key_block) if v.bwd_query_rows else (64, v.tile_m // split_parts(v))


COMPILED = {
    "d128_bf16_8x2": variant(),
    "d64_fp16_8x8_softcap": variant(head_dim=64, dtype="fp16", num_heads_kv=8, has_softcap=True, num_stages=4),
    "d128_bf16_8x2_deterministic": variant(deterministic=True),
    "d64_bf16_8x2_128q_deterministic": variant(head_dim=64, tile_m=128, deterministic=True),
    "d128_bf16_8x2_unmasked": variant(unmasked=True),
    "d96_bf16_8x2_one_dq_warpgroup": variant(head_dim=96),
    "d256_bf16_8x2": variant(head_dim=256, tile_n=64),
    "d192_bf16_8x2_query_rows": variant(head_dim=192, tile_n=96),
    "d192v128_fp16_8x8_softcap_deterministic": variant(
        head_dim=192, head_dim_v=128, tile_n=96, dtype="fp16", num_heads_kv=8, has_softcap=True, deterministic=True
    ),
}


# ---- variants --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tile_m": 192}, "SM90 backward tile_m 192 is not supported; supported: 64, 128"),
        ({"tile_m": 128}, "tile_m 128 needs tile_n 128 and head_dim <= 64 (S^T and dP^T of 128 queries in registers)"),
        ({"tile_m": 128, "head_dim": 64, "tile_n": 64}, "head_dim 64 with tile_n 64 takes tile_m 64"),
        ({"tile_n": 192}, "SM90 backward tile_n 192 is not supported; supported: 64, 96, 128"),
        ({"tile_n": 96}, "tile_n 96 needs tile_m 64 and a head dim above 128 up to 192"),
        ({"tile_n": 96, "head_dim": 256}, "head_dim 256 with tile_m 64 takes tile_n 64"),
        ({"has_sink": True}, "the SM90 backward has no sink variant"),
        ({"has_max_logits": True}, "the SM90 backward has no max_logits variant"),
        ({"pack_gqa": True}, "the SM90 backward has no pack_gqa variant"),
        ({"num_stages": 6}, "shared memory"),
        ({"num_stages": 3}, "SM90 backward num_stages 3 is not supported; supported: 1, 2, 4, 6, 8"),
        ({"head_dim": 80}, "supported head dims: 64, 96, 128, 192/128, 192, 256"),
        ({"head_dim": 256}, "tile_n 128 needs head_dim <= 128 (dK and dV in registers); head_dim 256 takes tile_n 64"),
        ({"head_dim": 256, "tile_n": 64, "num_stages": 4}, "shared memory"),
        # 40 bytes over: the split pieces' ranks and the stages' q block records, which a CTA needs too.
        ({"head_dim": 192, "tile_n": 64, "num_stages": 4}, "needs 231464 bytes of shared memory, more than the 231424"),
    ],
)
def test_bad_backward_variants_raise_clear_errors(overrides, message):
    with pytest.raises(VariantError, match=re.escape(message)):
        variant(**overrides)


def test_backward_variant_shape():
    v = variant()
    assert v.num_mma_warpgroups == 2  # 64 keys per consumer warpgroup
    # K, V; two (Q, dO) stages; two dS^T buffers; fp32 dQ staging, two stages of lse / delta, two
    # pieces' ranks, each stage's q block and flag
    assert v.smem_bytes() == (2 * 128 * 128 + 2 * 2 * 64 * 128 + 2 * 128 * 64) * 2 + (64 * 128 + 2 * 2 * 64 + 2 + 2 * 2) * 4
    assert v.key().startswith("attn_bwd_sm90_d128_bf16_h8x2_t64x128s2_")
    assert v.key() != variant(has_softcap=True).key()
    # Above d=128 two warpgroups share a 64-key tile, splitting its head dims; P^T joins each
    # dS^T buffer. At d=256 two Q stages fit only with one dO stage and dQ staged in halves.
    wide = variant(head_dim=256, tile_n=64)
    assert wide.num_mma_warpgroups == backward_warpgroups(64) == 2 and wide.bwd_staging == (1, 2)
    assert wide.smem_bytes() == (2 * 64 * 256 + 3 * 64 * 256 + 2 * 2 * 64 * 64) * 2 + (64 * 128 + 2 * 2 * 64 + 2 + 2 * 2) * 4
    narrow = variant(head_dim=256, tile_n=64, num_stages=1)
    assert narrow.bwd_staging == (1, 1) and variant().bwd_staging == (2, 1)
    assert narrow.smem_bytes() == (2 * 64 * 256 + 2 * 64 * 256 + 2 * 64 * 64) * 2 + (64 * 256 + 2 * 64 + 2 + 2) * 4
    # d=64's 128-query blocks: the warpgroups split dQ by rows, each staging 64 x 64.
    rows = variant(head_dim=64, tile_m=128)
    assert rows.bwd_dq_splits_rows and not v.bwd_dq_splits_rows and rows.bwd_staging == (2, 1)
    # d=96: warpgroup 0 alone computes dQ (halves would be 48 columns); the others split it.
    assert variant(head_dim=96).bwd_dq_warpgroups == 1 and v.bwd_dq_warpgroups == rows.bwd_dq_warpgroups == 2
    assert rows.smem_bytes() == (128 * 128 + 2 * 2 * 128 * 64 + 2 * 128 * 128) * 2 + (128 * 64 + 2 * 2 * 128 + 2 + 2 * 2) * 4
    mla = variant(head_dim=192, head_dim_v=128, tile_n=64)
    assert mla.smem_bytes() == (64 * 320 + 2 * 64 * 320 + 2 * 2 * 64 * 64) * 2 + (64 * 192 + 2 * 2 * 64 + 2 + 2 * 2) * 4
    # d=192's 96-key tiles: 48 keys a warpgroup with S's queries on M, one P^T and one dS^T
    # buffer; a second dO stage does not fit at 192 but does at 192/128.
    wide_keys = variant(head_dim=192, tile_n=96)
    assert wide_keys.bwd_query_rows and wide_keys.bwd_key_block == 48 and wide_keys.bwd_staging == (1, 1)
    assert not mla.bwd_query_rows and not v.bwd_query_rows and v.bwd_key_block == 64
    assert wide_keys.smem_bytes() == (96 * 384 + 64 * 3 * 192 + 2 * 96 * 64) * 2 + (64 * 192 + 2 * 2 * 64 + 2 + 2 * 2) * 4
    assert variant(head_dim=192, head_dim_v=128, tile_n=96).bwd_staging == (2, 1)
    assert variant(deterministic=True).key().startswith("attn_bwd_sm90_d128_bf16_h8x2_t64x128s2_d_")


def test_ctas_keep_pace_in_the_64_query_formulations_only():
    # Measured: the pace gains at d=96, 128 and 256 (64-query blocks, keys on M), not at d=64's
    # 128-query blocks nor in the query-rows formulation of 192 and 192/128.
    paced = [variant(head_dim=96), variant(), variant(head_dim=256, tile_n=64)]
    unpaced = [variant(head_dim=64, tile_m=128), variant(head_dim=192, tile_n=96),
               variant(head_dim=192, head_dim_v=128, tile_n=96), variant(deterministic=True)]  # fmt: skip
    assert all(v.bwd_paced for v in paced) and not any(v.bwd_paced for v in unpaced)


def test_deterministic_is_a_backward_option():
    with pytest.raises(VariantError, match="deterministic is a backward option"):
        variant(direction="fwd", tile_m=128, deterministic=True)


# ---- rendering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_rendered_source_is_readable_python(name):
    source = render(COMPILED[name])
    tree = ast.parse(source)
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"attn_bwd", "attn_bwd_kernel", "bwd_producer", "bwd_consumer", "bwd_block", "apply_line_mask"} <= names
    assert source == render(COMPILED[name])
    assert_reads_top_to_bottom(source, COMPILED[name].key())


def test_entry_signature_is_the_backward_abi():
    from maskc.artifact.abi import BACKWARD_ABI

    tree = ast.parse(render(variant()))
    entry = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "attn_bwd")
    params = [a.arg for a in entry.args.args]
    assert len(params) == len(BACKWARD_ABI)
    expected = [
        "mQ", "mK", "mV", "mO", "mdO", "mLSEf", "mdLSE", "mLSE", "mDelta", "mdQ", "mdK", "mdV", "mSemaphore",
        "mWorkBlocks", "mBlockRank", "mdKVAccum", "mdKVCount", "mQueryBounds", "mItems", "mCtaItems", "mWorkTile", "mWorkRanges",
        "mRanges", "mWorkLines", "mLines", "mKeyBounds",
        "softmax_scale", "softcap", "num_ctas", "stream",
    ]  # fmt: skip
    assert params == expected


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_module_constants_describe_the_variant(name):
    """The variant's shape and options reach the kernel as module constants, which its
    const_expr branches read."""
    v = COMPILED[name]
    c = module_constants(render(v))
    features = {"HAS_SOFTCAP": v.has_softcap, "HAS_SINK": False, "HAS_MAX_LOGITS": False, "PACK_GQA": False,
                "DETERMINISTIC": v.deterministic, "UNMASKED": v.unmasked}  # fmt: skip
    assert {k: c[k] for k in features} == features
    parts, rows_first = split_parts(v), v.bwd_query_rows
    # A thread's scores in the transposed frame (keys x queries): with S's queries on M its two
    # rows of S are its query columns.
    shape = {"HEAD_DIM": v.head_dim, "HEAD_DIM_V": v.head_dim_v, "TILE_Q": v.tile_m, "TILE_K": v.tile_n,
             "TILE_N": v.tile_m // parts, "NUM_STAGES": v.num_stages, "NUM_MMA_WG": v.num_mma_warpgroups,
             "DK_COLS": v.head_dim // parts, "DV_COLS": v.head_dim_v // parts,
             "WG_ROWS": v.bwd_key_block, "QUERY_ROWS": rows_first, "DS_STAGES": 1 if rows_first else 2,
             "ROWS_PER_THREAD": v.bwd_key_block // 4 if rows_first else 2,
             "COLS_PER_THREAD": 2 if rows_first else v.tile_m // parts // 4,
             "MASK_SLOTS": 2 if v.head_dim == 64 and v.tile_m == 64 else 0,
             "DO_STAGES": v.bwd_staging[0], "DQ_CHUNKS": v.bwd_staging[1]}  # fmt: skip
    assert {k: c[k] for k in shape} == shape
    # dQ = dS K: 128-query blocks split by rows (dV then waits for dS^T); at d=96 one warpgroup
    # computes all of it; else the warpgroups split the head-dim columns.
    rows, one = v.tile_m == 128, v.head_dim == 96
    dq = {"DQ_SPLITS_ROWS": rows, "DV_AFTER_DS": rows, "DQ_WARPGROUPS": 1 if one else 2,
          "DQ_ROWS": v.tile_m // (2 if rows else 1), "DQ_COLS": v.head_dim // (1 if rows or one else 2)}  # fmt: skip
    assert {k: c[k] for k in dq} == dq


def rendered_function(source: str, name: str, **names) -> Callable:
    """A top-level function of a rendered module run as plain Python on ints: its decorators
    dropped, cutlass.min / max / range_constexpr the builtins, const_expr the identity, the
    module's constants and `names` its other globals."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    scope = {"cutlass": SimpleNamespace(min=min, max=max, range_constexpr=range), "const_expr": lambda value: value,
             "Int32": int, **module_constants(source), **names}  # fmt: skip
    exec(compile(ast.Module(body=[node], type_ignores=[]), name, "exec"), scope)
    return scope[name]


@pytest.mark.parametrize("v, offsets, period", [
    (variant(), (0, 1), 8),  # a wgmma row: pairs of columns every 8
    (variant(head_dim=192, tile_n=96), (0, 8), 64),  # S with queries on M, transposed: rows r, r + 8 of 64
])  # fmt: skip
def test_line_masks_count_a_threads_columns_in_its_pattern(v, offsets, period):
    """elements_left_of(x) counts the thread's columns in [0, x) of its pattern continued over
    every block (negated below 0): the keep masks' element bounds."""
    left_of = rendered_function(render(v), "elements_left_of")
    pattern = [period * q + o for q in range(-256 // period, 256 // period) for o in offsets]
    for x in range(-200, 200):
        expected = sum(0 <= p < x for p in pattern) - sum(x <= p < 0 for p in pattern)
        assert left_of(x) == expected, x


def test_unmasked_is_a_backward_option():
    fields = {f: getattr(variant(), f) for f in ("arch", "head_dim", "dtype", "num_heads_q", "num_heads_kv")}
    with pytest.raises(VariantError, match="unmasked is a backward option"):
        KernelVariant(**fields, direction="fwd", tile_m=128, tile_n=128, num_stages=2, unmasked=True)
    assert variant(unmasked=True).key() != variant().key()


# ---- compiling (CUTLASS DSL, no GPU) ------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "sm90_bwd_objects", COMPILED)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiles_and_exports(compiled, name):
    obj = compiled[name]
    assert obj.function_prefix == "attn_bwd"
    assert obj.object_path.is_file() and obj.object_path.stat().st_size > 10_000
    assert obj.object_path.read_bytes()[:4] == b"\x7fELF"
    header = obj.header_path.read_text()
    assert "cute_dsl_attn_bwd_wrapper" in header and "float softmax_scale, float softcap, int32_t num_ctas" in header
    assert obj.source_path.read_text() == render(obj.variant)
    assert obj.seconds < 120


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_ptx_uses_wgmma_tma_reductions_and_setmaxnreg(compiled, name):
    ptx = compiled[name].ptx_text
    v = COMPILED[name]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    parts = split_parts(v)
    dk_cols, dv_cols = v.head_dim // parts, v.head_dim_v // parts
    dq_chunks = v.bwd_staging[1]
    # With one dQ warpgroup each warpgroup's loop is traced apart, the second without dQ.
    copies = 1 if v.bwd_dq_warpgroups == v.num_mma_warpgroups else 2
    assert f"m64n{score_shape(v)[1]}k16" in ptx  # S^T / dP^T (S / dP)
    if v.bwd_query_rows:  # dV^T, dK^T: 64-row tiles of head dims by the warpgroup's keys
        assert f"m64n{v.bwd_key_block}k16" in ptx and f"m64n{dk_cols}k16" not in ptx
    else:  # dV, dK
        assert f"m64n{dv_cols}k16" in ptx and f"m64n{dk_cols}k16" in ptx
    dq_cols = v.head_dim // (1 if v.bwd_dq_splits_rows or v.bwd_dq_warpgroups == 1 else 2)
    assert f"m64n{dq_cols // dq_chunks}k16" in ptx  # each warpgroup's part of dQ (in chunks): its rows, or half the columns
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)  # dQ += by TMA (rows in staging order)
    # dK and dV stored by TMA, never added (dk / dv are not zeroed), a document's short last k
    # tile's own rows 16 bytes a thread (its box reaches into the next tile's).
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", ptx)
    assert not re.search(r"cp\.reduce\.async\.bulk\.tensor\.3d", ptx)
    assert re.search(r"st\.global\.v4\.(b32|u32)", ptx)
    # No per-element atomics on dQ: only a split item's pieces add their dK / dV (a warpgroup's
    # (dk_cols + dv_cols) x key block values over its 128 threads, four values a reduction) and
    # count, and the last piece takes the sums back, leaving zeros (one exchange a value).
    values = (dk_cols + dv_cols) * v.bwd_key_block // 128
    # The dQ writer adds the rows of a view's last, partial 8-row group one value a lane at a
    # time: one reduction in a loop per view off row 0, warpgroup and chunk.
    tails = 0 if v.deterministic else 7 * v.bwd_dq_warpgroups * dq_chunks
    assert ptx.count("red.global.add.v4.f32") == copies * values // 4
    assert ptx.count("red.global") == ptx.count("red.global.add.v4.f32") + ptx.count("red.global.add.f32")
    assert ptx.count("red.global.add.f32") == tails
    assert ptx.count("atom.global") == ptx.count("atom.global.exch.b32") == copies * values
    # The pieces' counts, and with the CTAs' pace one count of the CTAs done (the producer's).
    assert ptx.count("atom.acq_rel.gpu.global.add.s32") == copies + v.bwd_paced
    # The pace: the producer counts its steps, waits on loads of the counter (bwd_paced).
    assert ("atom.relaxed.gpu.global.add.s32" in ptx) == ("nanosleep" in ptx) == v.bwd_paced
    assert "stmatrix" in ptx  # dS^T and the dK / dV staging
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    # One dQ warpgroup (d=96) takes 16 registers of the other's, each running its own loop.
    raised = sorted(set(re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)))
    assert raised == (["224", "256"] if v.bwd_dq_warpgroups == 1 else ["240"])
    assert "ex2.approx" in ptx
    # The preprocess kernel launched first: 16-byte loads of O and dO, rows summed by shuffles.
    assert ".entry kernel_cutlass_attn_bwd_prep_kernel" in ptx
    assert "ld.global.v4" in ptx and "shfl.sync.bfly" in ptx
    assert ("tanh.approx" in ptx) == v.has_softcap
    assert ("ld.global.acquire.gpu" in ptx and "red.release.gpu.global.add" in ptx) == v.deterministic
    # One block path, which runs the line mask on partial blocks only (none: unmasked): head_dim /
    # 16 wgmma for S^T and for dP^T, one per 16 queries for dV and for dK (for each 64 head dims
    # with queries on M), one per 16 keys for dQ per chunk.
    dkv_tiles = (v.head_dim + v.head_dim_v) // 64 if v.bwd_query_rows else 2
    products = v.head_dim // 16 + v.head_dim_v // 16 + dkv_tiles * (v.tile_m // 16)
    dq_products = v.tile_n // 16 * dq_chunks
    assert ptx.count("wgmma.mma_async") == copies * products + dq_products
    # Softcap's scale pair and the deterministic dQ's work blocks and block ranks (fields of the
    # schedule) are the optional arguments: off, they reach the kernel as None.
    # dq_accum reaches it through one TMA view (atom and tensor) per first row of a q block mod
    # 8, one where the q blocks stay on the grid (deterministic), and as itself (the rows the
    # views cannot reach); dk and dv as their TMA store atoms and tensors, and as themselves (a
    # short k tile's own rows).
    dq_views = 1 if v.deterministic else 8
    params = 37 + 2 * dq_views + 2 * v.has_softcap + 2 * v.deterministic
    assert sum(entry_params(ptx, "attn_bwd_kernel").values()) == params
    assert ".local" not in ptx  # register tensors stay in registers (no local-memory arrays)


def test_exported_structs_match_what_the_runtime_packs(compiled):
    from abi_check import assert_header_matches_abi

    from maskc.artifact.abi import BACKWARD_ABI

    assert_header_matches_abi(compiled["d128_bf16_8x2"].header_path.read_text(), BACKWARD_ABI)
