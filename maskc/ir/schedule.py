"""Sparse tile scheduling: for every q tile, the k blocks it needs, full or partial.

The kernels read a schedule as flat int32 arrays (the forward ABI):

- `work_tile [W]`: the q tile of each work item, heaviest first (a persistent grid takes
  items in order, so the longest ones start first);
- `work_ranges [W+1]` / `ranges [R, 4]`: per item, runs `(n_begin, n_end, partial, key)` of
  k blocks, `key` the first column of block n_begin; a full run (partial=0) has every element
  allowed and in range, so the kernel skips all masking there; a partial run is 1, or 2 where
  it holds a block off the grid (block n not at column n * tile_n: blocks per document; the
  kernel masks it from its own first column) or shorter than the tile before the last column
  (its box past its end cleared).
  Outside runs marked 2 a run's blocks follow each other at tile_n columns. Runs of one item
  never overlap;
- `work_lines [W+1]` / `lines [L, 6]`: per item, the row lines `(r0, r1, lo_a, lo_s, hi_a,
  hi_s)` of the merged, disjoint slices (`merge_ranges`) crossing its rows: element (r, c)
  of a partial block is allowed iff some line has r0 <= r < r1 and lo_a + lo_s*r <= c <= hi_a + hi_s*r;
- `key_bounds [NK+1]` / `query_bounds [NQ+1]`: k block n is keys [key_bounds[n],
  key_bounds[n + 1]), q tile m queries [query_bounds[m], query_bounds[m + 1]) (the grid, or
  tiles per document).

Every q tile is a work item, also one with no k block, so the kernel writes every output
row. Runs instead of per-block lists keep a 1M-token full mask at one run per tile.
Everything is vectorised: a 1M-token mask schedules in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskc.errors import MaskError
from maskc.ir.items import ITEM_OVERHEAD_BLOCKS, ItemLists, deal, section_order, slots_used, split, whole
from maskc.ir.mask import Mask
from maskc.ir.merge import merge_ranges
from maskc.ir.slices import RowLines, expand_spans, ragged_expand


@dataclass(frozen=True, eq=False)
class Schedule:
    """A forward tile schedule (see the module docstring for the arrays' meaning)."""

    tile_m: int
    tile_n: int
    seqlen_q: int
    seqlen_k: int
    work_tile: np.ndarray
    work_ranges: np.ndarray
    ranges: np.ndarray
    work_lines: np.ndarray
    lines: np.ndarray
    row_starts: np.ndarray
    col_starts: np.ndarray
    """First row of each q tile and first column of each k block (`tile_starts`): multiples of
    the tile on the grid; with tiles per document, a tile ends where the next begins and may be
    shorter than the tile, its box reaching into the next one's rows or columns."""

    @property
    def num_work(self) -> int:
        return int(self.work_tile.shape[0])

    def blocks_per_item(self) -> np.ndarray:
        """Number of k blocks of each work item (its cost, up to masking)."""
        item = np.repeat(np.arange(self.num_work), np.diff(self.work_ranges))
        lengths = self.ranges[:, 1] - self.ranges[:, 0]
        return np.bincount(item, weights=lengths, minlength=self.num_work).astype(np.int64)

    def partial_share(self) -> float:
        """The share of its k blocks that are partial."""
        lengths = self.ranges[:, 1] - self.ranges[:, 0]
        total = int(lengths.sum())
        return float(lengths[self.ranges[:, 2] != 0].sum()) / total if total else 0.0

    def key_bounds(self) -> np.ndarray:
        """The kernels' `key_bounds`: k block n is keys [key_bounds[n], key_bounds[n + 1])."""
        return np.append(self.col_starts, self.seqlen_k).astype(np.int32)

    def query_bounds(self) -> np.ndarray:
        """The kernels' `query_bounds`: q tile m is queries [query_bounds[m], query_bounds[m + 1])."""
        return np.append(self.row_starts, self.seqlen_q).astype(np.int32)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The kernel arguments, in ABI order."""
        return (self.work_tile, self.work_ranges, self.ranges, self.work_lines, self.lines, self.key_bounds(),
                self.query_bounds())  # fmt: skip


def _as32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int32)


def _lexsort2(minor: np.ndarray, major: np.ndarray) -> np.ndarray:
    """`np.lexsort((minor, major))` of integer keys, `major` >= 0: one stable argsort of the
    key major * span + minor, which keeps the same order and ties (several times faster than
    lexsort's two passes); lexsort itself where that key could overflow."""
    if major.size == 0:
        return np.zeros(0, np.int64)
    low = int(minor.min())
    span = int(minor.max()) - low + 1
    if (int(major.max()) + 1) * span >= 1 << 62:
        return np.lexsort((minor, major))
    return np.argsort(major.astype(np.int64) * span + (minor - low), kind="stable")


def _rows32(order: np.ndarray, *columns: np.ndarray) -> np.ndarray:
    """The int32 table whose columns are `columns` taken at `order` (as `_as32` of their
    stack, without the int64 table between)."""
    out = np.empty((order.size, len(columns)), np.int32)
    for j, column in enumerate(columns):
        out[:, j] = column[order]
    return out


def _merge_runs(tile: np.ndarray, begin: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Union of [begin, end) runs within each tile: overlapping or touching runs fuse."""
    order = _lexsort2(begin, tile)
    tile, begin, end = tile[order], begin[order], end[order]
    if tile.size == 0:
        return tile, begin, end
    span = int(end.max()) + 1
    # Running maximum of run ends within a tile (tiles are sorted, so offset them apart).
    reach = np.maximum.accumulate(end + tile * span) - tile * span
    starts = np.r_[True, (tile[1:] != tile[:-1]) | (begin[1:] > reach[:-1])]
    first = np.flatnonzero(starts)
    return tile[first], begin[first], np.maximum.reduceat(end, first)


def _fuse_side_by_side(tile: np.ndarray, ln: RowLines) -> tuple[np.ndarray, RowLines]:
    """Lines cut to one tile's rows (`ln.r0`, `ln.r1` the cut), where two over the same rows
    meet side by side on every row (one's hi + 1 is the other's lo; lines allow a key on every
    row they span), fused into one. A mask made of row bands (varlen block causal: each band of
    queries sees the keys up to its end) transposes into lines that split a key's queries at
    every band; unfused, each block on a band edge would count as partial and be masked line
    by line."""
    if tile.size == 0:
        return tile, ln
    order = np.lexsort((ln.lo_a + ln.lo_s * ln.r0, ln.r1, ln.r0, tile))
    tile, ln = tile[order], ln.take(order)
    linked = (
        (tile[1:] == tile[:-1])
        & (ln.r0[1:] == ln.r0[:-1])
        & (ln.r1[1:] == ln.r1[:-1])
        & (ln.lo_s[1:] == ln.hi_s[:-1])
        & (ln.lo_a[1:] == ln.hi_a[:-1] + 1)
    )
    first = np.flatnonzero(np.r_[True, ~linked])
    last = np.r_[first[1:], tile.size] - 1
    fused = RowLines(ln.r0[first], ln.r1[first], ln.lo_a[first], ln.lo_s[first], ln.hi_a[last], ln.hi_s[last])
    return tile[first], fused


_KEPT = "kept schedule"
"""The first element of the memo keys of schedules a decision built (the GQA strategy, the
backward kernel's) and kept for the build that comes next (`keep_schedule`)."""


def keep_schedule(mask: Mask, schedule: Schedule, *key: object) -> None:
    """Keep `schedule`, built for a decision, in `mask.memo` for the next build of the same
    schedule (`key`: what it is built from) to take instead of building it again."""
    mask.memo[(_KEPT, *key)] = schedule


def _kept(mask: Mask, *key: object) -> Schedule | None:
    """The schedule `keep_schedule` kept under `key`, handed over once (None if there is none)."""
    return mask.memo.pop((_KEPT, *key), None)


def grid_starts(length: int, tile: int) -> np.ndarray:
    """The fixed grid's tile starts over [0, length): 0, tile, 2 tile, ..."""
    return np.arange(0, length, tile, dtype=np.int64)


def tile_ends(starts: np.ndarray, length: int) -> np.ndarray:
    """Where each tile of a partition of [0, length) ends: at the next one's start."""
    return np.append(starts[1:], length)[: starts.size]


def tile_starts(boundaries: np.ndarray, length: int, tile: int) -> np.ndarray:
    """Starts of a partition of [0, length) into tiles of at most `tile`: from each boundary
    (and 0) tiles of `tile` until the next boundary, where a shorter tile ends."""
    bounds = np.unique(np.r_[0, np.asarray(boundaries, dtype=np.int64)])
    bounds = bounds[bounds < length]
    ends = tile_ends(bounds, length)
    owner, local = ragged_expand(-(-(ends - bounds) // tile))
    return bounds[owner] + local * tile


def document_starts(mask: Mask) -> tuple[np.ndarray, np.ndarray]:
    """Where the mask splits into documents: the pairs (query row, key column) such that every
    slice lies wholly before both or wholly after both (packed documents' starts, in q and in
    k), as two arrays; 0 first."""
    q, k = mask.q_ranges, mask.k_ranges
    keep = (q[:, 1] > q[:, 0]) & (k[:, 1] > k[:, 0])
    order = np.argsort(q[keep, 0], kind="stable")
    q, k = q[keep][order], k[keep][order]
    if q.shape[0] == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64)
    # A split before slice i: every earlier slice ends (in q and in k) where the later ones start.
    q_reach, k_reach = np.maximum.accumulate(q[:, 1]), np.maximum.accumulate(k[:, 1])
    k_floor = np.minimum.accumulate(k[::-1, 0])[::-1]
    i = np.flatnonzero((q_reach[:-1] <= q[1:, 0]) & (k_reach[:-1] <= k_floor[1:])) + 1
    return np.r_[0, q[i, 0]].astype(np.int64), np.r_[0, k_floor[i]].astype(np.int64)


def document_tiles(mask: Mask, tile_m: int, tile_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tile starts (`tile_starts`) of q tiles and k blocks that start at each document
    (`document_starts`); the grid for a mask of one document."""
    q_starts, k_starts = document_starts(mask)
    sq, sk = mask.shape
    return tile_starts(q_starts, sq, tile_m), tile_starts(k_starts, sk, tile_n)


def _owners(starts: np.ndarray, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tiles of `starts` holding positions `first` and `last` (inclusive)."""
    return np.searchsorted(starts, first, side="right") - 1, np.searchsorted(starts, last, side="right") - 1


def _checked_starts(starts: np.ndarray, length: int, tile: int, what: str) -> np.ndarray:
    """`starts` as int64 if they partition [0, length) into tiles of at most `tile`."""
    starts = np.asarray(starts)
    if starts.ndim != 1 or not (starts.size == 0 or np.issubdtype(starts.dtype, np.integer)):
        raise MaskError(f"{what} tile starts must be a 1-D integer array")
    starts = starts.astype(np.int64)
    if starts.size == 0 and length == 0:
        return starts
    gaps = tile_ends(starts, length) - starts
    if starts.size == 0 or starts[0] != 0 or (gaps <= 0).any() or (gaps > tile).any():
        raise MaskError(f"{what} tile starts must rise from 0 in steps of 1 to {tile} and end within {length}")
    return starts


def _split_at_short(tile: np.ndarray, begin: np.ndarray, end: np.ndarray,
                    short: np.ndarray) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:  # fmt: skip
    """Full runs [begin, end) of `tile` with the `short` blocks (sorted) taken out: the full
    pieces left, and each short block as a one-block run (partial)."""
    lo, hi = np.searchsorted(short, begin), np.searchsorted(short, end)
    owner, local = ragged_expand(hi - lo)
    singles = (tile[owner], short[lo[owner] + local], short[lo[owner] + local] + 1)
    owner, local = ragged_expand(hi - lo + 1)
    cut = lo[owner] + local  # the short block a piece ends at (or the run's end), and after which the next starts
    piece_begin = np.where(local == 0, begin[owner], short[np.maximum(cut - 1, 0)] + 1)
    piece_end = np.where(cut < hi[owner], short[np.minimum(cut, short.size - 1)], end[owner])
    keep = piece_end > piece_begin
    return (tile[owner][keep], piece_begin[keep], piece_end[keep]), singles


def build_schedule(
    mask: Mask, tile_m: int, tile_n: int, *, heaviest_first: bool = True, free_past_end: bool = False,
    row_starts: np.ndarray | None = None, col_starts: np.ndarray | None = None, whole_rows: bool = False,
) -> Schedule:  # fmt: skip
    """The forward schedule of `mask` for (tile_m x tile_n) tiles; work items heaviest first, or
    in tile order (`heaviest_first=False`). With `free_past_end` the columns past the last one
    need no mask (the backward's queries past Tq: their P is 0), so a block a line covers up to
    the last column is full.

    `row_starts` / `col_starts` (`tile_starts`; default the grid) partition the rows into q
    tiles and the columns into k blocks; a tile's own rows and a block's own columns end where
    the next begin. A kernel computes whole boxes (tile_m x tile_n from the starts), so a block
    shorter than tile_n is always partial (its box holds the next block's columns, which its
    masking must clear). Rows past a tile's own are the kernel's to ignore (the forward stores
    only a tile's own rows); with `whole_rows` (the backward's k tiles, whose rows are keys that
    would add to dQ) a short tile's blocks are partial too."""
    if tile_m <= 0 or tile_n <= 0:
        raise MaskError(f"tile shape must be positive, got {tile_m} x {tile_n}")
    sq, sk = mask.shape
    rs = grid_starts(sq, tile_m) if row_starts is None else _checked_starts(row_starts, sq, tile_m, "row")
    cs = grid_starts(sk, tile_n) if col_starts is None else _checked_starts(col_starts, sk, tile_n, "column")
    row_ends, col_ends = tile_ends(rs, sq), tile_ends(cs, sk)
    merged = merge_ranges(mask)
    lines = RowLines.of(merged.q_ranges, merged.k_ranges, merged.types)
    num_tiles = rs.size

    # (line, q tile) pairs: the line cut to its rows [a, b) inside the tile's own rows.
    pair_line, pair_tile = expand_spans(*_owners(rs, lines.r0, lines.r1 - 1))
    ln = lines.take(pair_line)
    a = np.maximum(ln.r0, rs[pair_tile])
    b = np.minimum(ln.r1, row_ends[pair_tile])
    pair_tile, ln = _fuse_side_by_side(pair_tile, RowLines(a, b, ln.lo_a, ln.lo_s, ln.hi_a, ln.hi_s))
    a, b = ln.r0, ln.r1
    lo_first, lo_last = ln.lo_a + ln.lo_s * a, ln.lo_a + ln.lo_s * (b - 1)
    hi_first, hi_last = ln.hi_a + ln.hi_s * a, ln.hi_a + ln.hi_s * (b - 1)

    # Blocks the line touches, and among them the ones it covers entirely: it spans all own
    # rows of the tile and every column of the block's box (so the box is in range and holds
    # no other block's columns: past the last column only with free_past_end).
    touch_begin, touch_last = _owners(cs, lo_first, hi_last)
    touch_end = touch_last + 1
    all_rows = (a == rs[pair_tile]) & (b == row_ends[pair_tile])
    if whole_rows:
        all_rows &= (row_ends[pair_tile] - rs[pair_tile] == tile_m) | (row_ends[pair_tile] == sq)
    whole = (col_ends - cs == tile_n) | (free_past_end & (col_ends == sk))
    full_begin = np.searchsorted(cs, lo_last, side="left")
    full_end = np.searchsorted(col_ends, hi_first + 1, side="right")
    if free_past_end:
        full_end = np.where(hi_first + 1 >= sk, cs.size, full_end)
    has_full = all_rows & (full_end > full_begin)
    full_begin = np.where(has_full, full_begin, touch_begin)
    full_end = np.where(has_full, full_end, touch_begin)

    # Partial runs on either side of the full run; a block several lines touch stays partial
    # once (runs merge). A fully covered block is touched by no other line: lines are disjoint.
    p_tile = np.r_[pair_tile, pair_tile]
    p_begin = np.r_[touch_begin, full_end]
    p_end = np.r_[full_begin, touch_end]
    full = (pair_tile[has_full], full_begin[has_full], full_end[has_full])
    if not whole.all():
        full, short = _split_at_short(*full, np.flatnonzero(~whole))
        p_tile, p_begin, p_end = np.r_[p_tile, short[0]], np.r_[p_begin, short[1]], np.r_[p_end, short[2]]
    keep = p_end > p_begin
    part = _merge_runs(p_tile[keep], p_begin[keep], p_end[keep])
    # A partial run holding a block off the grid, or short before the last column, is marked 2.
    # Off the grid: block n not at column n * tile_n, where the kernels' line slots count it
    # (a document's block on a multiple of tile_n is off it after a document that was not).
    grid_cols = np.arange(cs.size, dtype=np.int64) * tile_n
    off_grid = np.r_[0, np.cumsum((cs != grid_cols) | ((col_ends - cs < tile_n) & (col_ends != sk)))]
    part_flag = 1 + (off_grid[part[2]] > off_grid[part[1]]).astype(np.int64)

    run_tile = np.r_[part[0], full[0]]
    run_begin = np.r_[part[1], full[1]]
    run_end = np.r_[part[2], full[2]]
    run_partial = np.r_[part_flag, np.zeros(full[0].size, np.int64)]

    # Heaviest tiles first; ties keep tile order.
    if heaviest_first:
        weight = np.bincount(run_tile, weights=run_end - run_begin, minlength=num_tiles)
        work_tile = np.argsort(-weight, kind="stable")
    else:
        work_tile = np.arange(num_tiles)
    rank = np.empty(num_tiles, np.int64)
    rank[work_tile] = np.arange(num_tiles)

    order = _lexsort2(run_begin, rank[run_tile])
    ranges = _rows32(order, run_begin, run_end, run_partial, cs[run_begin])
    work_ranges = np.r_[0, np.cumsum(np.bincount(rank[run_tile], minlength=num_tiles))]

    line_order = _lexsort2(lo_first, rank[pair_tile])
    line_table = _rows32(line_order, ln.r0, ln.r1, ln.lo_a, ln.lo_s, ln.hi_a, ln.hi_s)
    work_lines = np.r_[0, np.cumsum(np.bincount(rank[pair_tile], minlength=num_tiles))]

    return Schedule(
        tile_m=tile_m,
        tile_n=tile_n,
        seqlen_q=sq,
        seqlen_k=sk,
        work_tile=_as32(work_tile),
        work_ranges=_as32(work_ranges),
        ranges=_as32(ranges.reshape(-1, 4)),
        work_lines=_as32(work_lines),
        lines=_as32(line_table.reshape(-1, 6)),
        row_starts=_as32(rs),
        col_starts=_as32(cs),
    )


def build_forward_schedule(
    mask: Mask, tile_m: int, tile_n: int, documents: bool = False, query_documents: bool = False
) -> Schedule:
    """The schedule of a forward kernel (heaviest first) whose k blocks start at each document
    with `documents`, and its q tiles too with `query_documents` (`document_tiles`); the one the
    forward strategy pass built and kept, if it did (`maskc.ir.strategy.select_forward`)."""
    kept = _kept(mask, *forward_key(tile_m, tile_n, documents, query_documents))
    if kept is not None:
        return kept
    if not documents:
        return build_schedule(mask, tile_m, tile_n)
    q_starts, k_starts = document_starts(mask)
    sq, sk = mask.shape
    rows = tile_starts(q_starts, sq, tile_m) if query_documents else None
    return build_schedule(mask, tile_m, tile_n, row_starts=rows, col_starts=tile_starts(k_starts, sk, tile_n))


def forward_key(tile_m: int, tile_n: int, documents: bool, query_documents: bool) -> tuple:
    """The key under which a forward schedule built for a decision is kept (`keep_schedule`)."""
    return ("forward", tile_m, tile_n, documents, query_documents)


@dataclass(frozen=True, eq=False)
class BackwardSchedule(Schedule):
    """A transposed schedule (work items are k tiles, runs are q blocks) plus the persistent
    CTAs' item lists (`maskc.ir.items`): `items [I, 6]` (work, K/V head, walk flags, first
    query head and how many, split slot) CTA by CTA and `cta_items [G+1]`, their CSR offsets;
    the launch uses G CTAs and `num_slots` fp32 dK / dV slots for the split items."""

    items: np.ndarray
    cta_items: np.ndarray

    @property
    def num_slots(self) -> int:
        return slots_used(self.items)

    def key_bounds(self) -> np.ndarray:
        """k tile n is keys [key_bounds[n], key_bounds[n + 1]) (the transposed schedule's rows)."""
        return np.append(self.row_starts, self.seqlen_q).astype(np.int32)

    def query_bounds(self) -> np.ndarray:
        """The kernels' `query_bounds`: q block m is queries [query_bounds[m], query_bounds[m +
        1]) (the transposed schedule's columns)."""
        return np.append(self.col_starts, self.seqlen_k).astype(np.int32)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (*super().arrays(), self.items, self.cta_items)


def _last_blocks(s: Schedule) -> np.ndarray:
    """End of each work item's last run (-1 for an item with none)."""
    ends = np.full(s.num_work, -1, np.int64)
    has = np.diff(s.work_ranges) > 0
    ends[has] = s.ranges[s.work_ranges[1:][has] - 1, 1]
    return ends


def _with_items(s: Schedule, lists: ItemLists) -> dict:
    return {**{f: getattr(s, f) for f in Schedule.__dataclass_fields__}, "items": lists.items, "cta_items": lists.cta_items}


def _item_cost(s: Schedule) -> np.ndarray:
    return s.blocks_per_item() + ITEM_OVERHEAD_BLOCKS


def transposed_schedule(
    mask: Mask, tile_m: int, tile_n: int, *, heaviest_first: bool = True, keep: bool = False,
    key_documents: bool = False, query_documents: bool = False,
) -> Schedule:  # fmt: skip
    """The schedule the backward schedules start from: the forward schedule of
    `mask.transpose()`, its work items the k tiles of `tile_n` keys (heaviest first, or in tile
    order), its runs q blocks of `tile_m` queries (queries past the last need no mask; keys
    past a tile's own, which would add to dQ, masked: `whole_rows`); with `key_documents` the
    k tiles, with `query_documents` the q blocks per document (`document_tiles`); the kernels
    mask a partial block over its whole box by the lines alone, which hold one document's
    queries where the k tiles are per document. The one kept by an earlier call with `keep`,
    if there is one."""
    key = ("transposed", tile_m, tile_n, heaviest_first, key_documents, query_documents)
    s = _kept(mask, *key)
    if s is None:
        q_blocks, k_tiles = document_tiles(mask, tile_m, tile_n) if key_documents or query_documents else (None, None)
        s = build_schedule(mask.transpose(), tile_n, tile_m, heaviest_first=heaviest_first, free_past_end=True,
                           whole_rows=True, row_starts=k_tiles if key_documents else None,
                           col_starts=q_blocks if query_documents else None)  # fmt: skip
    if keep:
        keep_schedule(mask, s, *key)
    return s


def backward_has_partial_blocks(
    mask: Mask, tile_m: int, tile_n: int, *, heaviest_first: bool = False, keep: bool = False, documents: bool = False,
    grid_queries: bool = False,
) -> bool:  # fmt: skip
    """Whether the backward schedule of `mask` (q blocks of tile_m, k tiles of tile_n, per
    document with `documents` and `grid_queries` as the builder below takes them) has a
    partial block; the backward kernel without line masks serves only masks with none. Found
    from the `transposed_schedule` in either order (the order of the work items changes no
    run); with `keep`, kept for the backward schedule built next: `heaviest_first` for
    `build_backward_schedule`, in tile order for `build_deterministic_backward_schedule`."""
    s = transposed_schedule(mask, tile_m, tile_n, heaviest_first=heaviest_first, keep=keep, key_documents=documents,
                            query_documents=documents and heaviest_first and not grid_queries)  # fmt: skip
    return bool(s.ranges[:, 2].any())


def build_backward_schedule(
    mask: Mask, tile_m: int, tile_n: int, num_heads_kv: int, num_ctas: int, qheads_per_kvhead: int = 1,
    documents: bool = False, grid_queries: bool = False,
) -> BackwardSchedule:  # fmt: skip
    """The transposed schedule the backward kernels read: for every k tile of `tile_n` keys,
    runs of q blocks of `tile_m` queries, full or partial, with the lines of `mask.transpose()`
    (rows are keys, columns queries). It is the forward schedule of the transposed mask, so one
    scheduler and one line mask serve both directions. Its items (k tile, K/V head) go to
    `num_ctas` CTAs in sync groups (`maskc.ir.items.sync_group_order`), split by query head
    where one item alone would outlast the others' deal and at the end where that balances the
    CTAs, or in a coarse deal all of them (`maskc.ir.items.split`). With `documents` its k
    tiles start at each document (`document_tiles`), and so do its q blocks unless
    `grid_queries` (what `attention_backward` plans for a dQ buffer the caller owns)."""
    s = transposed_schedule(mask, tile_m, tile_n, key_documents=documents, query_documents=documents and not grid_queries)
    cost = _item_cost(s)
    items, row_cost, owner = split(_last_blocks(s), cost, num_heads_kv, qheads_per_kvhead, num_ctas)
    return BackwardSchedule(**_with_items(s, deal(items, row_cost, num_ctas, owner)))


@dataclass(frozen=True, eq=False)
class DeterministicBackwardSchedule(BackwardSchedule):
    """A backward schedule in k tile order plus the order of the dQ additions: the k tiles
    touching a q block add their dQ in ascending tile order, so dQ is bitwise reproducible.

    - `work_blocks [W+1]`: per item, CSR offsets of its (run, q block) pairs in run order;
    - `block_rank [B]`: for each pair, how many lower k tiles touch the same q block (the
      kernel waits until that many additions to the block have landed before adding its own).
    """

    work_blocks: np.ndarray
    block_rank: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (*super().arrays(), self.work_blocks, self.block_rank)


def build_deterministic_backward_schedule(
    mask: Mask, tile_m: int, tile_n: int, num_heads_kv: int, num_ctas: int, documents: bool = False
) -> DeterministicBackwardSchedule:
    """`build_backward_schedule` with items in k tile order (`maskc.ir.items.section_order`:
    a CTA then only ever waits for lower items, which are done or running: no deadlock) and
    the dQ ranks. With `documents` its k tiles start at each document; its q blocks stay on the
    grid, which the kernel's semaphores (one per q block and head) count."""
    s = transposed_schedule(mask, tile_m, tile_n, heaviest_first=False, key_documents=documents)
    work_blocks, rank = dq_order(s.work_tile, s.work_ranges, s.ranges)
    items = whole(section_order(_last_blocks(s), num_heads_kv))
    lists = deal(items, _item_cost(s)[items[:, 0]], num_ctas)
    return DeterministicBackwardSchedule(**_with_items(s, lists), work_blocks=work_blocks, block_rank=rank)


def dq_order(work_tile: np.ndarray, work_ranges: np.ndarray, ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`work_blocks` and `block_rank` (`DeterministicBackwardSchedule`) of a transposed schedule's
    work items and runs."""
    lengths = (ranges[:, 1] - ranges[:, 0]).astype(np.int64)
    run_work = np.repeat(np.arange(work_tile.size), np.diff(work_ranges))
    _, q_block = expand_spans(ranges[:, 0].astype(np.int64), ranges[:, 1].astype(np.int64) - 1)
    k_tile = np.repeat(work_tile[run_work], lengths)
    order = _lexsort2(k_tile, q_block)  # by q block, then k tile
    sorted_block = q_block[order]
    group_start = np.r_[0, np.flatnonzero(sorted_block[1:] != sorted_block[:-1]) + 1]
    first_of_group = np.repeat(group_start, np.diff(np.r_[group_start, sorted_block.size]))
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size) - first_of_group
    work_blocks = np.r_[0, np.cumsum(np.bincount(run_work, weights=lengths, minlength=work_tile.size))]
    return _as32(work_blocks), _as32(rank)
