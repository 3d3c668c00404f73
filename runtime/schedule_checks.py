"""Checks of a schedule before a prepared plan carries it out of the process that planned it
(`maskc.runtime.plan_records` signs only what passes): every index a kernel follows stays inside
the tensors it indexes, every tile is computed once, every (k tile, K/V head) of a backward is
owned once, a split item's pieces add up to its query heads (else the fp32 slots they add into
would stay dirty for the next call), and a deterministic backward waits only for additions
that come (else it would wait forever). Whether its runs and lines are the mask's is the
planner's to get right: a schedule cannot show it.

The arrays are those of `maskc.ir.schedule` (its docstring says what each holds), flattened by
`maskc.runtime.call_plan`; an empty array is stored as one zero row.
"""

from __future__ import annotations

import numpy as np

from maskc.ir.items import ASCENDING, HEADS_INNER
from maskc.ir.schedule import dq_order, grid_starts
from maskc.ir.slices import ragged_expand
from maskc.runtime.call_plan import HostSchedule, schedule_views


class ScheduleError(ValueError):
    """A schedule that its kernel must not be launched with; the message says why."""


def check_schedule(builder: str, params: tuple[int, ...], host: HostSchedule, shape: tuple[int, int]) -> None:
    """Raise ScheduleError unless `host` is a well-formed schedule of `builder` (a name in
    `maskc.ir.schedule`) with the memo key's `params` (`maskc.runtime.call_plan._host_schedule`) for a
    mask of `shape`."""
    a = {name: view.numpy() for name, view in schedule_views(host.flat, host.rows).items()}
    num_ctas, tile_m, tile_n = params[:3]
    _require(host.num_ctas == num_ctas >= 1, f"its grid has {host.num_ctas} CTAs, its key {num_ctas}")
    sq, sk = shape
    if builder == "build_forward_schedule":
        rows, cols = (a["query_bounds"], sq, tile_m, params[4]), (a["key_bounds"], sk, tile_n, params[3])
    else:
        documents = bool(params[-2] if builder == "build_backward_schedule" else params[-1])
        per_document_queries = builder == "build_backward_schedule" and documents and not params[-1]
        rows, cols = (a["key_bounds"], sk, tile_n, documents), (a["query_bounds"], sq, tile_m, per_document_queries)
    num_tiles, num_cols = _bounds(*rows, "work tiles"), _bounds(*cols, "run blocks")
    work = a["work_tile"][: _count(a["work_tile"], a["work_ranges"].size - 1, "work_tile")]
    _require(_once(work, num_tiles), "its work items are not each tile once")
    ranges = _csr(a["work_ranges"], a["ranges"], "ranges")
    _runs(ranges, a["work_ranges"], cols[0], num_cols)
    lines = _csr(a["work_lines"], a["lines"], "lines")
    _require(((0 <= lines[:, 0]) & (lines[:, 0] <= lines[:, 1]) & (lines[:, 1] <= rows[1])).all(), "a line's rows are out of range")
    if builder == "build_forward_schedule":
        return
    pieces = params[5] if builder == "build_backward_schedule" else 1
    _items(a["items"], a["cta_items"], num_ctas, work.size, params[3], pieces, host.slots)
    if builder == "build_deterministic_backward_schedule":
        blocks, rank = dq_order(work, a["work_ranges"], ranges)
        _require(np.array_equal(a["work_blocks"], blocks), "its work_blocks are not its runs' blocks")
        _require(np.array_equal(a["block_rank"][: _count(a["block_rank"], rank.size, "block_rank")], rank),
                 "its dQ ranks are not those of its runs")  # fmt: skip


def _require(ok: bool | np.bool_, why: str) -> None:
    if not ok:
        raise ScheduleError(why)


def _count(array: np.ndarray, count: int, name: str) -> int:
    """`count`, the rows `array` holds (one zero row where it holds none)."""
    _require(len(array) == count or (count == 0 and len(array) == 1 and not array.any()),
             f"{name} has {len(array)} rows, not {count}")  # fmt: skip
    return count


def _bounds(bounds: np.ndarray, length: int, tile: int, per_document: bool, what: str) -> int:
    """The tiles of `bounds` (tile starts, then `length`): from 0 to `length` in steps of at
    most `tile`, the grid unless the kernel takes tiles per document."""
    steps = np.diff(bounds)
    ok = bounds.size >= 1 and bounds[0] == 0 and bounds[-1] == length and ((steps > 0) & (steps <= tile)).all()
    if ok and not per_document:
        ok = np.array_equal(bounds[:-1], grid_starts(length, tile))
    _require(ok, f"its {what} do not cover 0..{length} in tiles of at most {tile}")
    return bounds.size - 1


def _csr(offsets: np.ndarray, rows: np.ndarray, name: str) -> np.ndarray:
    """The rows of `rows` that the CSR `offsets` (0, rising, to the count) cover."""
    steps = np.diff(offsets)
    _require(offsets.size >= 1 and offsets[0] == 0 and (steps >= 0).all(), f"its offsets into {name} do not rise from 0")
    return rows[: _count(rows, int(offsets[-1]), name)]


def _runs(ranges: np.ndarray, offsets: np.ndarray, bounds: np.ndarray, num_cols: int) -> None:
    """Runs (begin, end, partial, first column) of blocks inside the grid, in order within each
    work item and apart from each other."""
    begin, end = ranges[:, 0], ranges[:, 1]
    _require(((0 <= begin) & (begin < end) & (end <= num_cols)).all(), "a run's blocks are out of range")
    _require(((0 <= ranges[:, 2]) & (ranges[:, 2] <= 2)).all(), "a run has an unknown mask kind")
    _require(np.array_equal(ranges[:, 3], bounds[begin]), "a run's first column is not its first block's")
    same_item = np.ones(len(ranges), bool)
    starts = offsets[1:-1]
    same_item[starts[starts < len(ranges)]] = False
    _require((begin[1:] >= end[:-1])[same_item[1:]].all(), "an item's runs overlap or are out of order")


def _items(items: np.ndarray, offsets: np.ndarray, num_ctas: int, num_work: int, num_heads_kv: int, pieces: int,
           slots: int) -> None:  # fmt: skip
    """Items (work, K/V head, flags, first query head, count, slot) dealt to `num_ctas` CTAs:
    each (work, K/V head) owned once, by a whole item or by pieces of `pieces` query heads that
    cover them once through one slot of `slots`."""
    _require(offsets.size == num_ctas + 1, f"its items are dealt to {offsets.size - 1} CTAs, not {num_ctas}")
    items = _csr(offsets, items, "items").astype(np.int64)
    work, head, flags, first, count, slot = items.T
    _require(((0 <= work) & (work < num_work) & (0 <= head) & (head < num_heads_kv)).all(), "an item is out of range")
    _require(((flags & ~(HEADS_INNER | ASCENDING)) == 0).all(), "an item has unknown flags")
    whole = count == -1
    _require(((first == 0) & (slot == -1))[whole].all(), "a whole item has query heads or a slot")
    piece = ~whole
    _require(((1 <= count) & (0 <= first) & (first + count <= pieces) & (0 <= slot) & (slot < slots))[piece].all(),
             "a split item's query heads or slot are out of range")  # fmt: skip
    owner = work * num_heads_kv + head
    if piece.any():
        s, f, c, o = slot[piece], first[piece], count[piece], owner[piece]
        _require(slots == int(s.max()) + 1, f"its items use {int(s.max()) + 1} slots, not {slots}")
        slot_owner = np.zeros(slots, np.int64)
        slot_owner[s] = o
        _require(np.array_equal(slot_owner[s], o), "a slot's pieces belong to different items")
        parent, local = ragged_expand(c)
        _require(_once(s[parent] * pieces + f[parent] + local, slots * pieces), "a split item's pieces miss or repeat query heads")
        owner = np.r_[owner[whole], slot_owner]
    else:
        _require(slots == 0, f"its whole items use no slot, but it has {slots}")
    _require(_once(owner, num_work * num_heads_kv), "its items do not own each tile once")


def _once(values: np.ndarray, count: int) -> bool:
    """Whether `values` are each of 0..count-1 once."""
    if values.size != count or not ((0 <= values) & (values < count)).all():
        return False
    return bool((np.bincount(values, minlength=count) == 1).all())
