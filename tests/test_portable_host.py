"""The portable kernels' index arithmetic, run on the CPU: the CUTLASS DSL runs `@cute.jit`
host code on CPU tensors, so the rendered module's own functions (its tiled MMAs, accumulator
views, row copies and shared-memory layouts) run here on every thread index of a CTA, with no
GPU. Skipped without the DSL."""

from __future__ import annotations

import pytest
import torch

from maskc.artifact.variant import KernelVariant, variant_for
from maskc.codegen.compile import _import_source
from maskc.codegen.render import render

pytestmark = pytest.mark.slow
cute = pytest.importorskip("cutlass.cute")
cutlass = pytest.importorskip("cutlass")
from cutlass.cute.runtime import from_dlpack  # noqa: E402


def backward(head_dim: int, portable_next: bool = True, direction: str = "bwd", arch: str = "sm_80") -> KernelVariant:
    return variant_for({"arch": arch, "direction": direction, "head_dim": head_dim, "dtype": "bf16", "num_heads_q": 8,
                        "num_heads_kv": 2, "portable": True, "portable_next": portable_next})  # fmt: skip


def rendered(v: KernelVariant, tmp_path):
    path = tmp_path / f"{v.key()}.py"
    path.write_text(render(v))
    return _import_source(path, f"maskc_host_{v.key()}")


@pytest.mark.parametrize("head_dim, portable_next, arch", [(128, True, "sm_80"), (64, True, "sm_80"), (96, True, "sm_80"),
                                                         (256, True, "sm_80"), (128, True, "sm_86"), (96, True, "sm_86"),
                                                         (128, False, "sm_80"), (64, False, "sm_80")])  # fmt: skip
def test_the_dq_warp_grid_adds_every_dq_element_once(head_dim, portable_next, arch, tmp_path):
    """dQ^T = K^T dS^T over the head dims in DQ_ROWS-row products by the DQ_WARPS_M x DQ_WARPS_N
    warp grid: over every thread and product, each (head dim, query) of a q block's dQ once (the
    next d=128's 4 x 2 grid holds two 16-row extents a warp, d=96's 2 x 4 three; on sm_86, d=128's
    q blocks have 32 queries and d=96's four warps take three 32-row products; d=256's four warps
    of 16 head dims take four 64-row products against 32 queries)."""
    k = rendered(backward(head_dim, portable_next, arch=arch), tmp_path)

    @cute.jit
    def cover(count: cute.Tensor):
        tiled_mma_dq = k.make_tiled_mma(k.DQ_WARPS_M, k.DQ_WARPS_N)
        for tidx in cutlass.range(k.NUM_THREADS, unroll=1):
            tQcQ = tiled_mma_dq.get_slice(tidx).partition_C(cute.make_identity_tensor((k.DQ_ROWS, k.TILE_Q)))
            for h in cutlass.range_constexpr(k.HEAD_DIM // k.DQ_ROWS):
                for e in cutlass.range_constexpr(cute.size(tQcQ)):
                    d, q = tQcQ[e]
                    count[h * k.DQ_ROWS + d, q] = count[h * k.DQ_ROWS + d, q] + 1

    count = torch.zeros(head_dim, k.TILE_Q, dtype=torch.int32)
    cover(from_dlpack(count))
    assert bool((count == 1).all()), f"dQ elements added {int(count.min())} to {int(count.max())} times"


@pytest.mark.parametrize("direction, head_dim, arch", [("bwd", 128, "sm_80"), ("bwd", 96, "sm_80"), ("bwd", 64, "sm_80"),
                                                      ("bwd", 256, "sm_80"), ("bwd", 128, "sm_86"), ("fwd", 128, "sm_80"),
                                                      ("fwd", 256, "sm_80")])  # fmt: skip
def test_each_thread_holds_the_rows_and_columns_the_line_masks_assume(direction, head_dim, arch, tmp_path):
    """S^T of the backward's k tile (NUM_WARPS warps of 16 keys) and S of the forward's q tile
    (four warps of 32 query rows up to d=128, 16 at d=256): every element held by one thread,
    in its ROWS_PER_THREAD rows, columns in pairs every MASK_STRIDE from its first (the pattern
    common/mask.jinja reads the lines with)."""
    k = rendered(backward(head_dim, direction=direction, arch=arch), tmp_path)
    shape = (k.TILE_K, k.TILE_Q) if direction == "bwd" else (k.TILE_M, k.TILE_N)

    @cute.jit
    def owners(owner: cute.Tensor, pattern: cute.Tensor):
        tiled_mma = k.make_tiled_mma()
        for tidx in cutlass.range(k.NUM_THREADS, unroll=1):
            tScS = k.acc_rows_cols(tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor(shape)))
            for i in cutlass.range_constexpr(k.ROWS_PER_THREAD):
                for c in cutlass.range_constexpr(k.COLS_PER_THREAD):
                    key, query = tScS[i, c]
                    owner[key, query] = owner[key, query] + 1
                    expected = tScS[0, 0][1] + (c // k.MASK_GROUP) * k.MASK_STRIDE + c % k.MASK_GROUP
                    if key != tScS[i, 0][0] or query != expected:
                        pattern[0] = pattern[0] + 1

    owner = torch.zeros(*shape, dtype=torch.int32)
    pattern = torch.zeros(1, dtype=torch.int32)
    owners(from_dlpack(owner), from_dlpack(pattern))
    assert k.NUM_WARPS * 16 * k.ROWS_PER_THREAD // 2 == shape[0] and bool((owner == 1).all())
    assert int(pattern[0]) == 0


@pytest.mark.parametrize("head_dim", [128, 96])
def test_row_copies_fill_the_later_stage_of_a_swizzled_tile_and_zero_its_tail(head_dim, tmp_path):
    """The (Q, dO) row copies of a q block that the sequence ends inside: rows before the end
    land in the second stage of the two-stage swizzled tile, the others are zero, and the first
    stage (the step being computed) is untouched. At d=96 in 32-column segments (4 threads a
    row) into 32-column swizzle atoms."""
    k = rendered(backward(head_dim), tmp_path)
    seqlen = 2 * k.TILE_Q - 23  # q block 1 ends 23 rows early

    @cute.jit
    def copy_block(src: cute.Tensor, buffer: cute.Tensor, out: cute.Tensor):
        copy = k.make_row_copy(cute.nvgpu.CopyUniversalOp(), k.NUM_THREADS)
        sQ = cute.make_tensor(buffer.iterator, k.make_smem_layout(k.TILE_Q, k.HEAD_DIM, k.NUM_STAGES))
        blk = (k.TILE_Q, k.HEAD_DIM)
        coords = cute.local_tile(cute.make_identity_tensor(src.shape), blk, (1, 0))
        for tidx in cutlass.range(k.NUM_THREADS, unroll=1):
            k.load_rows(copy, tidx, cute.local_tile(src, blk, (1, 0)), coords, sQ[None, None, 1], src.shape[0])
        for r in cutlass.range(k.TILE_Q, unroll=1):
            for c in cutlass.range(k.HEAD_DIM, unroll=1):
                for s in cutlass.range_constexpr(k.NUM_STAGES):
                    out[s, r, c] = sQ[r, c, s]

    src = (torch.arange(seqlen * k.HEAD_DIM) % 251 + 1).view(seqlen, k.HEAD_DIM).to(torch.bfloat16)
    buffer = torch.full((k.NUM_STAGES * k.TILE_Q * k.HEAD_DIM,), -1.0, dtype=torch.bfloat16)
    out = torch.zeros(k.NUM_STAGES, k.TILE_Q, k.HEAD_DIM, dtype=torch.bfloat16)
    copy_block(from_dlpack(src, assumed_align=16), from_dlpack(buffer, assumed_align=16), from_dlpack(out))
    rows = seqlen - k.TILE_Q
    assert torch.equal(out[1, :rows], src[k.TILE_Q:]) and bool((out[1, rows:] == 0).all())
    assert bool((out[0] == -1).all())


@pytest.mark.parametrize("head_dim, heads", [(128, (8, 2)), (256, (64, 8)), (96, (16, 1))])
def test_pack_gqa_loads_each_packed_row_from_its_token_and_query_head(head_dim, heads, tmp_path):
    """The PackGQA forward's Q tile of K/V head h: packed row p = token * G + g is query head
    h * G + g of that token (head_rows' packed view through the row copies), rows past the
    sequence are zero; tile_rows gives each thread's rows those tokens and query heads."""
    hq, hkv = heads
    v = variant_for({"arch": "sm_80", "direction": "fwd", "head_dim": head_dim, "dtype": "bf16", "num_heads_q": hq,
                     "num_heads_kv": hkv, "portable": True, "portable_next": True, "pack_gqa": True})  # fmt: skip
    k = rendered(v, tmp_path)
    g, seqlen, head_kv = hq // hkv, 3 * k.TILE_M // (hq // hkv) - 1, hkv - 1
    m_tile = 2  # the last tile: it ends one token early

    @cute.jit
    def load_tile(mQ: cute.Tensor, buffer: cute.Tensor, out: cute.Tensor, rows_seen: cute.Tensor):
        copy = k.make_row_copy(cute.nvgpu.CopyUniversalOp(), k.NUM_THREADS)
        sQ = cute.make_tensor(buffer.iterator, k.make_smem_layout(k.TILE_M, k.HEAD_DIM, 1))[None, None, 0]
        rows_view, rows_end = k.head_rows(mQ, head_kv)
        blk = (k.TILE_M, k.HEAD_DIM)
        coords = cute.local_tile(cute.make_identity_tensor((rows_end, k.HEAD_DIM)), blk, (m_tile, 0))
        tiled_mma = k.make_tiled_mma()
        rows = cute.make_rmem_tensor(k.ROWS_PER_THREAD, cutlass.Int32)
        row_heads = cute.make_rmem_tensor(k.ROWS_PER_THREAD, cutlass.Int32)
        for tidx in cutlass.range(k.NUM_THREADS, unroll=1):
            k.load_rows(copy, tidx, cute.local_tile(rows_view, blk, (m_tile, 0)), coords, sQ, rows_end)
            tScS = k.acc_rows_cols(tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((k.TILE_M, k.TILE_N))))
            k.tile_rows(rows, row_heads, m_tile * k.TILE_M, tScS, head_kv)
            for i in cutlass.range_constexpr(k.ROWS_PER_THREAD):
                rows_seen[tScS[i, 0][0], 0] = rows[i]
                rows_seen[tScS[i, 0][0], 1] = row_heads[i]
        for r in cutlass.range(k.TILE_M, unroll=1):
            for c in cutlass.range(k.HEAD_DIM, unroll=1):
                out[r, c] = sQ[r, c]

    q = (torch.arange(seqlen * hq * head_dim) % 251 + 1).view(seqlen, hq, head_dim).to(torch.bfloat16)
    buffer = torch.full((k.TILE_M * head_dim,), -1.0, dtype=torch.bfloat16)
    out = torch.zeros(k.TILE_M, head_dim, dtype=torch.bfloat16)
    rows_seen = torch.full((k.TILE_M, 2), -1, dtype=torch.int32)
    load_tile(from_dlpack(q, assumed_align=16), from_dlpack(buffer, assumed_align=16), from_dlpack(out), from_dlpack(rows_seen))
    packed = m_tile * k.TILE_M + torch.arange(k.TILE_M)
    tokens, q_heads = packed // g, head_kv * g + packed % g
    inside = tokens < seqlen
    assert bool(inside.any()) and not bool(inside.all())
    assert torch.equal(out[inside], q[tokens[inside], q_heads[inside]]) and bool((out[~inside] == 0).all())
    assert torch.equal(rows_seen[:, 0], tokens.int()) and torch.equal(rows_seen[:, 1], q_heads.int())
