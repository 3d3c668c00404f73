"""The tile schedule covers exactly the mask: decoded back to a dense mask it is equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import masks

from maskc.errors import MaskError
from maskc.ir import AttnSlice, Mask
from maskc.ir.items import ASCENDING, HEADS_INNER, section_order
from maskc.ir.schedule import (
    BackwardSchedule,
    Schedule,
    _lexsort2,
    _rows32,
    backward_has_partial_blocks,
    build_backward_schedule,
    build_deterministic_backward_schedule,
    build_forward_schedule,
    build_schedule,
    document_starts,
    document_tiles,
)
from maskc.ir.strategy import select_forward, select_pack_gqa


def decode(s: Schedule, free_past_end: bool = False, whole_rows: bool = False, boxes: bool = False) -> torch.Tensor:
    """Dense mask the kernel would compute from the schedule, checking its invariants. A kernel
    computes a block's whole box (tile_m x tile_n from the tile's and the block's starts): a full
    block unmasked, so its box must hold no other block's columns and lie in range (past the
    last column only with `free_past_end`), and with `whole_rows` no other tile's rows; a partial
    block masked by the lines and cleared past its own columns; with `boxes` (the backward
    kernels) by the lines alone, over its whole box. Each element at most once."""
    sq, sk = s.seqlen_q, s.seqlen_k
    rs, cs = s.row_starts.tolist(), s.col_starts.tolist()
    row_end, col_end = rs[1:] + [sq], cs[1:] + [sk]
    count = torch.zeros(sq, sk, dtype=torch.int32)
    assert sorted(s.work_tile.tolist()) == list(range(len(rs)))
    assert s.work_ranges[0] == 0 and s.work_ranges[-1] == len(s.ranges)
    assert s.work_lines[0] == 0 and s.work_lines[-1] == len(s.lines)
    rows_idx = torch.arange(sq)[:, None]
    cols_idx = torch.arange(sk)[None, :]
    for w, m in enumerate(s.work_tile.tolist()):
        r0, r1 = rs[m], row_end[m]
        lines = s.lines[s.work_lines[w] : s.work_lines[w + 1]]
        assert all(r0 <= a and b <= r1 for a, b in lines[:, :2].tolist()), "lines are cut to the tile's own rows"
        seen: set[int] = set()
        for n_begin, n_end, partial, key in s.ranges[s.work_ranges[w] : s.work_ranges[w + 1]].tolist():
            assert n_begin < n_end and key == cs[n_begin]
            # Blocks follow each other at tile_n columns, except in runs marked 2; a run marked 1
            # is on the grid, block n at column n * tile_n (the kernels' line slots count it there).
            assert partial == 2 or cs[n_begin:n_end] == list(range(key, key + (n_end - n_begin) * s.tile_n, s.tile_n))
            assert partial != 1 or key == n_begin * s.tile_n, "a run marked 1 off the grid"
            for n in range(n_begin, n_end):
                assert n not in seen, f"block {n} of tile {m} scheduled twice"
                seen.add(n)
                c0, c1 = cs[n], col_end[n]
                assert c0 < sk
                if not partial:
                    box_end = cs[n] + s.tile_n
                    assert box_end == c1 or (box_end > sk == c1 and free_past_end), "a full block's box is its own"
                    assert not whole_rows or r1 - r0 == s.tile_m or r1 == sq, "a full block's rows are its tile's own"
                    count[r0:r1, c0:c1] += 1
                    continue
                if boxes:  # the box, unclipped
                    c1 = min(c0 + s.tile_n, sk)
                block = torch.zeros(r1 - r0, c1 - c0, dtype=torch.bool)
                for lr0, lr1, lo_a, lo_s, hi_a, hi_s in lines.tolist():
                    r = rows_idx[r0:r1]
                    c = cols_idx[:, c0:c1]
                    block |= (r >= lr0) & (r < lr1) & (c >= lo_a + lo_s * r) & (c <= hi_a + hi_s * r)
                assert block.any(), "a partial block must hold an allowed element"
                count[r0:r1, c0:c1] += block
    assert count.numel() == 0 or int(count.max()) <= 1, "an element computed twice"
    return count.bool()


@st.composite
def partitions(draw, length: int, tile: int) -> np.ndarray:
    """Tile starts over [0, length): steps of 1 to `tile`."""
    starts, at = [], 0
    while at < length:
        starts.append(at)
        at += draw(st.integers(1, tile))
    return np.array(starts, dtype=np.int64)


@given(masks(max_len=40, max_slices=6), st.sampled_from([1, 3, 8, 16]), st.sampled_from([1, 4, 8, 64]))
@settings(max_examples=300, deadline=None)
def test_schedule_covers_exactly_the_mask(mask: Mask, tile_m: int, tile_n: int) -> None:
    s = build_schedule(mask, tile_m, tile_n)
    assert torch.equal(decode(s), mask.to_dense())
    weights = s.blocks_per_item()
    assert (np.diff(weights) <= 0).all(), "heaviest work first"


@given(st.data(), masks(max_len=40, max_slices=6), st.sampled_from([1, 3, 8, 16]), st.sampled_from([1, 4, 8, 64]),
       st.booleans())  # fmt: skip
@settings(max_examples=300, deadline=None)
def test_schedule_on_any_partition_covers_exactly_the_mask(data, mask: Mask, tile_m: int, tile_n: int, backward: bool) -> None:
    # Tiles of any length up to the tile: short blocks are masked past their own columns, and
    # with whole_rows (the backward's k tiles) short tiles have no full block.
    rows = data.draw(partitions(mask.seqlen_q, tile_m))
    cols = data.draw(partitions(mask.seqlen_k, tile_n))
    s = build_schedule(mask, tile_m, tile_n, row_starts=rows, col_starts=cols, free_past_end=backward, whole_rows=backward)
    assert torch.equal(decode(s, free_past_end=backward, whole_rows=backward), mask.to_dense())
    assert (s.row_starts == rows).all() and (s.col_starts == cols).all()
    # Partial runs holding a block off the grid (block n not at column n * tile_n), or short
    # before the last column, are marked 2.
    ends = [*cols[1:].tolist(), mask.seqlen_k]
    odd = [c != n * tile_n or (e - c < tile_n and e != mask.seqlen_k) for n, (c, e) in enumerate(zip(cols.tolist(), ends))]
    for n_begin, n_end, partial, _ in s.ranges.tolist():
        assert partial == (0 if partial == 0 else 1 + any(odd[n_begin:n_end]))


def test_tiles_start_at_each_document() -> None:
    docs = Mask.from_cu_seqlens([0, 100, 400, 450])
    rows, cols = document_tiles(docs, 64, 128)
    assert cols.tolist() == [0, 100, 228, 356, 400] and rows.tolist() == [0, 64, 100, 164, 228, 292, 356, 400]
    s = build_schedule(docs, 64, 128, row_starts=rows, col_starts=cols)
    assert torch.equal(decode(s), docs.to_dense())
    # Only each document's own blocks: no tile holds two documents' tokens.
    assert s.blocks_per_item().sum() == 2 * 1 + 5 * 3 + 1 * 1
    assert build_schedule(docs, 64, 128).blocks_per_item().sum() > s.blocks_per_item().sum()


def test_the_backward_q_blocks_start_at_each_document() -> None:
    """The backward's q blocks start at each document, and its kernel masks a partial block over
    its whole box by the lines alone: a document's last block reaches into the next document's
    queries, which no line of its k tiles holds."""
    docs = Mask.from_cu_seqlens([0, 100, 400, 450], causal=True)
    s = build_backward_schedule(docs, 64, 128, 1, 4, documents=True)
    assert s.query_bounds().tolist() == [0, 64, 100, 164, 228, 292, 356, 400, 450]
    assert torch.equal(decode(s, free_past_end=True, whole_rows=True, boxes=True), docs.to_dense().T)
    # Over the grid's q blocks (straddling 100 and 400) the k tiles visit fewer blocks.
    grid = build_backward_schedule(docs, 64, 128, 1, 4)
    assert s.blocks_per_item().sum() < grid.blocks_per_item().sum()


def test_documents_split_where_every_slice_lies_before_or_after() -> None:
    # Documents of different q and k lengths (a causal_short_k per document) split in pairs.
    short_k = Mask([AttnSlice(q=(0, 50), k=(0, 30), type="causal"), AttnSlice(q=(50, 80), k=(30, 70), type="full")], 80, 70)
    assert [x.tolist() for x in document_starts(short_k)] == [[0, 50], [0, 30]]
    # Block causal inside the second document: its blocks reach back to its start, no split.
    block_causal = [AttnSlice(q=(96 + 64 * i, 96 + 64 * (i + 1)), k=(96, 96 + 64 * (i + 1)), type="full") for i in range(3)]
    mask = Mask([AttnSlice(q=(0, 96), k=(0, 96), type="causal"), *block_causal], 288, 288)
    assert [x.tolist() for x in document_starts(mask)] == [[0, 96], [0, 96]]
    # A sliding window (one band) and global keys that every query sees: one document.
    for one in (Mask.sliding_window([0, 288], 64), Mask.sliding_window([0, 288], 64).with_global_tokens(16)):
        assert [x.tolist() for x in document_starts(one)] == [[0], [0]]
    assert [x.tolist() for x in document_starts(Mask([], 8, 8))] == [[0], [0]]


@pytest.mark.parametrize(
    "starts, message",
    [([0, 64, 200], "steps of 1 to 128"), ([8, 100], "rise from 0"), ([0, 64, 64], "steps of 1 to 128"),
     ([0, 100, 300], "end within 300"), ([[0]], "1-D integer"), ([0.0, 64.0], "1-D integer")],
)  # fmt: skip
def test_bad_tile_starts(starts: list, message: str) -> None:
    with pytest.raises(MaskError, match=message):
        build_schedule(Mask.from_cu_seqlens([0, 300]), 128, 128, col_starts=np.array(starts))


def test_full_blocks_need_no_mask() -> None:
    s = build_schedule(Mask.from_cu_seqlens([0, 1024], causal=True), 128, 128)
    ranges = s.ranges
    assert ranges[ranges[:, 2] == 1].shape[0] == 8  # the diagonal blocks only
    assert (ranges[:, 1] - ranges[:, 0])[ranges[:, 2] == 0].sum() == 8 * 7 // 2
    assert s.work_tile[0] == 7 and s.work_tile[-1] == 0


def test_unaligned_sequence_ends_are_partial() -> None:
    s = build_schedule(Mask.from_cu_seqlens([0, 200]), 128, 128)
    # Block 1 (keys 128..199) runs past seqlen_k, so it is partial; the short last q tile
    # still has full blocks because all of its valid rows are covered.
    assert s.work_tile.tolist() == [0, 1]
    assert s.ranges.tolist() == [[0, 1, 0, 0], [1, 2, 1, 128], [0, 1, 0, 0], [1, 2, 1, 128]]


def test_rows_without_keys_still_get_a_work_item() -> None:
    mask = Mask([AttnSlice((0, 64), (0, 64))], 300, 64)
    s = build_schedule(mask, 128, 64)
    assert s.num_work == 3
    assert s.blocks_per_item().tolist() == [1, 0, 0]


def test_a_full_mask_is_one_run_per_tile() -> None:
    s = build_schedule(Mask.from_cu_seqlens([0, 1 << 20]), 128, 128)
    assert s.num_work == 8192 and len(s.ranges) == 8192
    assert (s.ranges[:, :2] == [0, 8192]).all()


def test_bad_tile_shape() -> None:
    with pytest.raises(MaskError, match="tile shape"):
        build_schedule(Mask([], 4, 4), 0, 128)


def piece_heads(pieces: np.ndarray) -> list[int]:
    """The query heads item rows (`maskc.ir.items.ItemLists`) of pieces walk, sorted."""
    return sorted(h for first, count in pieces[:, 3:5].tolist() for h in range(first, first + count))


def check_items(s: BackwardSchedule, num_heads_kv: int, num_ctas: int, qheads_per_kvhead: int = 1) -> None:
    """The CTAs' item lists hold every (work, K/V head) once, whole, or split into pieces that
    cover each query head once under one slot of its own; one walk flag per whole work; the
    second of a pair (ASCENDING) runs right after its partner on the same CTA, at the same
    query heads, both whole or both pieces."""
    assert s.cta_items.tolist() == sorted(s.cta_items.tolist()) and len(s.cta_items) == num_ctas + 1
    assert s.cta_items[0] == 0 and s.cta_items[-1] == len(s.items)
    whole = s.items[s.items[:, 5] < 0]
    pieces = s.items[s.items[:, 5] >= 0]
    assert (whole[:, 3] == 0).all() and (whole[:, 4] == -1).all()
    covered = [tuple(r) for r in whole[:, :2].tolist()]
    for slot in range(s.num_slots):
        mine = pieces[pieces[:, 5] == slot]
        assert piece_heads(mine) == list(range(qheads_per_kvhead)) and len({tuple(r) for r in mine[:, :2].tolist()}) == 1
        covered.append(tuple(mine[0, :2].tolist()))
    assert sorted(covered) == [(w, h) for w in range(s.num_work) for h in range(num_heads_kv)]
    flags = {}
    for w, _, flag in whole[:, :3].tolist():
        assert flags.setdefault(w, flag) == flag and flag in (0, HEADS_INNER, HEADS_INNER | ASCENDING)
    for i in np.flatnonzero(s.items[:, 2] & ASCENDING):
        partner, second = s.items[i - 1], s.items[i]
        assert i not in s.cta_items[:-1] and not partner[2] & ASCENDING
        assert (partner[[1, 3, 4]] == second[[1, 3, 4]]).all() and (partner[5] < 0) == (second[5] < 0)


@given(
    masks(max_len=40, max_slices=6), st.sampled_from([1, 3, 16]), st.sampled_from([1, 4, 8]), st.sampled_from([1, 3]),
    st.sampled_from([1, 5]), st.sampled_from([1, 4]), st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_backward_schedule_covers_exactly_the_transposed_mask(
    mask: Mask, tile_m: int, tile_n: int, num_heads_kv: int, num_ctas: int, qheads_per_kvhead: int, documents: bool
) -> None:
    s = build_backward_schedule(mask, tile_m, tile_n, num_heads_kv, num_ctas, qheads_per_kvhead, documents)
    assert (s.tile_m, s.tile_n) == (tile_n, tile_m)  # work items are k tiles, runs are q blocks
    assert torch.equal(decode(s, free_past_end=True, whole_rows=True, boxes=True), mask.to_dense().T)
    check_items(s, num_heads_kv, num_ctas, qheads_per_kvhead)
    # k tile n is keys [key_bounds[n], key_bounds[n + 1]), q block m queries [query_bounds[m],
    # query_bounds[m + 1]): per document, or on the grid.
    queries, keys = document_tiles(mask, tile_m, tile_n) if documents else (
        np.arange(0, mask.seqlen_q, tile_m), np.arange(0, mask.seqlen_k, tile_n))
    assert s.key_bounds().tolist() == [*keys.tolist(), mask.seqlen_k]
    assert s.query_bounds().tolist() == [*queries.tolist(), mask.seqlen_q]


@pytest.mark.parametrize("seqlen", [1, 80, 1000, 16384])
def test_backward_blocks_past_the_last_query_need_no_mask(seqlen: int) -> None:
    """Queries past Tq have P = 0 in the backward, so a block reaching past them is full: a full
    mask has no partial block at any length, whatever the q block size."""
    full = Mask.from_cu_seqlens([0, seqlen])
    for tile_m in (64, 80):
        s = build_backward_schedule(full, tile_m, 128, 1, 4)
        assert not s.ranges[:, 2].any()
    # The forward's columns past Tk are keys and stay masked.
    assert build_schedule(Mask.from_cu_seqlens([0, 1000]), 128, 128).ranges[:, 2].any()


def test_lines_side_by_side_in_a_tile_fuse_into_full_blocks() -> None:
    # Block causal in one document at 40..552, blocks of 128: band j of queries sees keys 40 ..
    # its end. Transposed, keys 192..255 (all in block 1) see queries 168..551 through three
    # bands' lines side by side; fused, only the blocks at 168 and 552 stay partial.
    bands = [AttnSlice((40 + 128 * j, min(40 + 128 * (j + 1), 552)), (40, min(40 + 128 * (j + 1), 552)), "full") for j in range(4)]
    s = build_schedule(Mask(bands, 552, 552).transpose(), 64, 64)
    w = int(np.flatnonzero(s.work_tile == 3)[0])
    runs = s.ranges[s.work_ranges[w] : s.work_ranges[w + 1], :3].tolist()
    assert runs == [[2, 3, 1], [3, 8, 0], [8, 9, 1]]
    assert s.work_lines[w + 1] - s.work_lines[w] == 1
    assert s.lines[s.work_lines[w]].tolist() == [192, 256, 168, 0, 551, 0]


def test_backward_schedule_of_causal_skips_blocks_above_the_diagonal() -> None:
    mask = Mask.from_cu_seqlens([0, 1024], causal=True)
    s = build_backward_schedule(mask, 128, 128, 1, 4)
    # k tile n is needed by q blocks n..7: the first key tile is the heaviest.
    assert s.work_tile[0] == 0 and s.blocks_per_item().tolist() == [8, 7, 6, 5, 4, 3, 2, 1]
    # Every tile ends at the last q block: one sync group, walked with the heads innermost, in
    # (longest, shortest) pairs whose second walks first to last: 8 + 1, 7 + 2, 6 + 3, 5 + 4 blocks,
    # one pair per CTA.
    assert s.work_tile[s.items[:, 0]].tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    assert s.items[:, 2].tolist() == [HEADS_INNER, HEADS_INNER | ASCENDING] * 4
    assert s.cta_items.tolist() == [0, 2, 4, 6, 8]
    # On one CTA pairs keep no CTA closer to another: the tiles walk in order.
    one = build_backward_schedule(mask, 128, 128, 1, 1)
    assert one.work_tile[one.items[:, 0]].tolist() == list(range(8)) and not (one.items[:, 2] & ASCENDING).any()


@given(masks(max_len=40, max_slices=6), st.sampled_from([1, 3, 16]), st.sampled_from([1, 4, 8]), st.sampled_from([1, 3]),
       st.booleans())  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_deterministic_backward_schedule_orders_dq_additions(mask: Mask, tile_m: int, tile_n: int, num_heads_kv: int,
                                                             documents: bool) -> None:  # fmt: skip
    s = build_deterministic_backward_schedule(mask, tile_m, tile_n, num_heads_kv, 4, documents)
    # The same blocks as the plain schedule, its q blocks on the grid (one semaphore each).
    assert torch.equal(decode(s, free_past_end=True, whole_rows=True, boxes=True), mask.to_dense().T)
    assert s.query_bounds().tolist() == [*range(0, mask.seqlen_q, tile_m), mask.seqlen_q]
    check_items(s, num_heads_kv, 4)
    assert s.work_tile.tolist() == sorted(s.work_tile.tolist())  # k tile order: waits go to earlier items
    # A CTA only waits for lower items: for each K/V head the k tiles come in ascending order,
    # and every CTA walks its items in that order.
    rank = {tuple(row): i for i, row in enumerate(section_order(np.zeros(s.num_work, np.int64), num_heads_kv)[:, :2].tolist())}
    for c in range(4):
        mine = [rank[w, h] for w, h in s.items[s.cta_items[c] : s.cta_items[c + 1], :2].tolist()]
        assert mine == sorted(mine)
    assert s.num_slots == 0  # never split: pieces would add dK / dV in no fixed order
    for h in range(num_heads_kv):
        assert [w for (w, hh), _ in sorted(rank.items(), key=lambda kv: kv[1]) if hh == h] == list(range(s.num_work))
    # Walk the pairs in kernel order: each (k tile, q block) has as rank the number of lower
    # k tiles adding to that q block; each item's pairs start at its work_blocks offset.
    seen: dict[int, list[int]] = {}
    pairs = []
    for w, tile in enumerate(s.work_tile.tolist()):
        assert s.work_blocks[w] == len(pairs)
        for r in range(s.work_ranges[w], s.work_ranges[w + 1]):
            for m in range(s.ranges[r, 0], s.ranges[r, 1]):
                pairs.append((tile, m))
                seen.setdefault(m, []).append(tile)
    assert s.work_blocks[-1] == len(pairs) == len(s.block_rank)
    for (tile, m), rank in zip(pairs, s.block_rank.tolist()):
        assert rank == sum(t < tile for t in seen[m])
    assert len(s.arrays()) == 11  # the kernel also gets the item lists, the k tiles' and q blocks' bounds, work_blocks and block_rank



def _same(a: Schedule, b: Schedule) -> bool:
    return all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a.arrays(), b.arrays(), strict=True))


def _kept(mask: Mask) -> list[tuple]:
    return [key for key in mask.memo if key[0] == "kept schedule"]


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("heads", [(64, 8), (8, 8)])
@pytest.mark.parametrize("mask", [Mask.from_cu_seqlens([0, 900, 1000, 5000], causal=True), Mask.from_cu_seqlens([0, 4096])])
def test_the_forward_build_takes_the_strategys_schedule_of_its_own_tiles(
    mask: Mask, heads: tuple[int, int], documents: bool
) -> None:
    """The forward strategy keeps the schedule it chose, built as the kernel's is: with
    `documents` k blocks per document, and the plain kernel's q tiles too (PackGQA's stay on the
    grid). The forward's build for those tiles takes it once (the arrays it would build anew,
    nothing left in the memo); a build for other tiles leaves it."""

    def fresh() -> Mask:
        return Mask.from_arrays(mask.q_ranges, mask.k_ranges, mask.types, *mask.shape)

    m = fresh()
    packed = select_forward(m, *heads, (128, 128), None, keep=True, documents=documents)[1]
    tile_m, rows = (128 // (heads[0] // heads[1]), False) if packed else (128, documents)
    build_forward_schedule(m, tile_m, 128, not documents, rows)
    assert len(_kept(m)) == 1
    s = build_forward_schedule(m, tile_m, 128, documents, rows)
    assert not _kept(m) and torch.equal(decode(s), mask.to_dense())
    assert _same(s, build_forward_schedule(fresh(), tile_m, 128, documents, rows))
    q_starts, k_starts = document_starts(mask)
    assert set(k_starts) <= set(s.col_starts) or not documents
    assert set(q_starts) <= set(s.row_starts) or not rows
    assert np.array_equal(s.row_starts, np.arange(0, 5000, tile_m)[: len(s.row_starts)]) or rows


@pytest.mark.parametrize("heads", [(64, 8), (8, 8), (16, 8)])
@pytest.mark.parametrize("mask", [Mask.from_cu_seqlens([0, 900, 1000, 5000], causal=True), Mask.from_cu_seqlens([0, 4096])])
def test_a_decision_hands_its_schedule_to_the_build_after_it(mask: Mask, heads: tuple[int, int]) -> None:
    """The GQA strategy and the backward kernel's choice keep the schedule they built for the
    build that comes next (maskc.runtime.call_plan), which takes it once: the same arrays as built
    anew, and nothing left in the memo."""

    def fresh() -> Mask:
        return Mask.from_arrays(mask.q_ranges, mask.k_ranges, mask.types, *mask.shape)

    m = fresh()
    tile_m = 128 // (heads[0] // heads[1]) if select_pack_gqa(m, *heads, 128, 128, keep=True) else 128
    assert len(_kept(m)) == (heads[0] != heads[1])
    built = build_forward_schedule(m, tile_m, 128)
    assert _same(built, build_forward_schedule(fresh(), tile_m, 128)) and not _kept(m)
    for deterministic, build, params in ((False, build_backward_schedule, (8, 132, 8)),
                                         (True, build_deterministic_backward_schedule, (8, 132))):  # fmt: skip
        m = fresh()
        partial = backward_has_partial_blocks(m, 64, 128, heaviest_first=not deterministic, keep=True)
        assert partial == backward_has_partial_blocks(fresh(), 64, 128) and len(_kept(m)) == 1
        assert _same(build(m, 64, 128, *params), build(fresh(), 64, 128, *params)) and not _kept(m)


@pytest.mark.parametrize("seed", range(12))
def test_the_combined_key_sort_is_lexsort(seed: int) -> None:
    """The schedules order their runs and lines by (tile rank, first column) with one stable
    argsort of a combined key: the same permutation as np.lexsort, ties in both keys included
    (few distinct values), negative minors (a line's first key) included; past what an int64 key
    holds it is lexsort itself."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    spread = 4 if seed % 2 else 1 << 20
    major, minor = rng.integers(0, spread, n), rng.integers(-spread, spread, n)
    assert (_lexsort2(minor, major) == np.lexsort((minor, major))).all()
    huge = np.array([1 << 40, 0, 1 << 40, 5])
    assert (_lexsort2(np.array([1 << 30, -(1 << 30), 0, 7]), huge) == np.lexsort((np.array([1 << 30, -(1 << 30), 0, 7]), huge))).all()
    columns = [rng.integers(-1000, 1000, n) for _ in range(3)]
    order = rng.permutation(n)
    expected = np.ascontiguousarray(np.stack([c[order] for c in columns], axis=1).reshape(-1, 3), dtype=np.int32)
    assert np.array_equal(_rows32(order, *columns), expected) and _rows32(order, *columns).dtype == np.int32
