"""Which CTA of a persistent kernel runs which work item, and in what order.

The backward kernel's work items are (k tile, K/V head) pairs. Its CTAs walk lists made here
on the host (`ItemLists`): the items are put in a priority order, then dealt as a dynamic
scheduler would deal them, each to the CTA that is free first by an estimated cost. That
keeps the CTAs balanced whatever the order, so the order can serve memory locality.

The k tiles whose q blocks end at the same block form a sync group (one document of a
varlen mask, every tile of a causal one). The kernel walks an item's q blocks last to first,
so the tiles of a group meet each Q / dO block and each block of dQ rows at the same time if
they also take the query heads innermost (whatever their lengths); a tile alone in its
group (a sliding window) walks heads outermost instead, a step behind its neighbour of the
same length. Each item carries that choice (`HEADS_INNER` in its flags). A run of such tiles
goes one K/V head after the other, so the CTAs running together share one head's rows.

A group's tiles have unequal lengths (a causal tile reaches from its diagonal to the end), so
after its first item a CTA would start the next one while the others are midway, and the CTAs
would spread over every head's Q / dO. So the tiles of a group that fills every CTA and whose
lengths differ (`PAIR_SPREAD`) may run in pairs on one CTA: the longest walks last to first,
then the shortest first to last (`ASCENDING`). Where the lengths fall evenly (a causal mask)
every CTA of the group is then at one of two q blocks at any time, and the pairs cost the same,
so they end together and the next ones start in step. Where they come in steps (the local
mask of a context-parallel rank: whole chunks of keys see the same queries) the pairs' costs
differ and walking in order keeps the CTAs closer; the deal's model decides (`_places`: how
many (head, q block) places the CTAs walk at once, the rows the L2 must hold).

- `sync_group_order`: group by group, heaviest items first; a group's items (or a run of
  one-tile groups) run together, one K/V head after the other, in (longest, shortest) pairs
  where that pays.
- `section_order`: k tile order in sections (the deterministic kernel's, whose CTAs may only
  wait for lower items: for each K/V head the k tiles ascend).

Items are whole k tiles, so the last round of the deal leaves CTAs idle: 1024 equal items on
132 CTAs take 8 rounds where 7.76 would do (3%). `split_tail` cuts the items at the end of the
order into one piece per query head where that shortens the deal, `split_heavy` the items that
outweigh a CTA's share into pieces of a few query heads, and in a coarse deal (about an item
per CTA: one K/V head of many query heads) `split_every` cuts all of them, its pieces ordered
and paired as the items of more K/V heads would be. The pieces of an item add their dK / dV
into an fp32 slot, and the piece that counts the item's last query heads stores the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: An item's fixed cost (K/V load, dK / dV epilogue) in q blocks, for dealing.
ITEM_OVERHEAD_BLOCKS = 2
#: Work items (k tiles) per section of `section_order`.
SECTION = 16
#: Item flags (items[:, 2]): take the query heads innermost; walk the q blocks first to last (the
#: item runs right after the one before it on the same CTA: the two are a pair).
HEADS_INNER = 1
ASCENDING = 2
#: A sync group runs in pairs when its longest tile costs at least this many times its shortest
#: and its items fill every CTA (smaller groups do not spread the CTAs over many q blocks, and
#: pairs would only coarsen the dealing: measured on the H100, pairs everywhere cost varlen
#: masks up to 3%).
PAIR_SPREAD = 1.5


#: Times at which `_places` looks where the CTAs are.
PLACE_SAMPLES = 64

#: A split item's pieces are worth it when the deal's busiest CTA gets lighter by this fraction.
SPLIT_GAIN = 0.01
#: split_heavy cuts the units heavier than this share of a CTA's fair share of the deal.
HEAVY_SHARE = 1.0
#: A piece's fixed cost in steps (one q block of one query head): the K/V load and epilogue of
#: an item plus its fp32 dK / dV additions. A fixed time, so in q blocks (of every query head
#: of the K/V head, the unit of the costs here) it shrinks as the heads grow.
PIECE_OVERHEAD_STEPS = 12
#: `split_every` is tried where the whole items number at most this many per CTA: so coarse a
#: deal cannot balance itself (at 16k, one k tile of 64 query heads per CTA), and its slots (a
#: k tile's fp32 dK / dV each) stay few.
COARSE_ITEMS_PER_CTA = 2
#: split_tail's candidates: enough pieces for this many rounds of the CTAs.
TAIL_ROUNDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True, eq=False)
class ItemLists:
    """`items [I, 6]` int32 (work index into the schedule, K/V head, flags: HEADS_INNER,
    ASCENDING, the first of its query heads within the K/V head's, how many (-1: all of them),
    split slot (-1: the item owns its dK / dV; else the fp32 slot its pieces add into)),
    grouped by CTA, each CTA's in priority order; `cta_items [G+1]` CSR offsets of each CTA's
    items; `num_slots` the split slots used."""

    items: np.ndarray
    cta_items: np.ndarray

    @property
    def num_ctas(self) -> int:
        return int(self.cta_items.shape[0]) - 1

    @property
    def num_slots(self) -> int:
        return slots_used(self.items)


def slots_used(items: np.ndarray) -> int:
    """The split slots that item rows (see `ItemLists`) add into."""
    return int(items[:, 5].max()) + 1 if len(items) else 0


def heads_inner(last_block: np.ndarray) -> np.ndarray:
    """Per work: 1 where another work ends at the same q block (`last_block[w]`, -1: none)."""
    _, group_of, size = np.unique(last_block, return_inverse=True, return_counts=True)
    return (size[group_of] > 1).astype(np.int64)


def _groups_by_head(works: np.ndarray, sizes: np.ndarray, flags: np.ndarray, num_heads_kv: int) -> np.ndarray:
    """(work, head, flags) rows: `works` (with their `flags`, aligned) cut into consecutive
    groups of `sizes`, each group's works repeated for every K/V head, head-major inside the
    group."""
    group = np.repeat(np.arange(sizes.size), sizes)
    start = np.r_[0, np.cumsum(sizes)[:-1]]
    within = np.arange(works.size) - start[group]
    heads = np.arange(num_heads_kv)
    pos = (start[group] * num_heads_kv + within)[:, None] + heads[None, :] * sizes[group][:, None]
    out = np.empty((works.size * num_heads_kv, 3), np.int64)
    out[pos.ravel(), 0] = np.repeat(works, num_heads_kv)
    out[pos.ravel(), 1] = np.tile(heads, works.size)
    out[pos.ravel(), 2] = np.repeat(flags, num_heads_kv)
    return out


def _in_pairs(works: np.ndarray, sizes: np.ndarray, cost: np.ndarray, paired: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The works of each `paired` group (consecutive groups of `sizes`) reordered longest,
    shortest, second longest, second shortest, ...; and True where a work is the second of its
    pair. Other groups keep their order."""
    group = np.repeat(np.arange(sizes.size), sizes)
    start = np.r_[0, np.cumsum(sizes)[:-1]]
    by_cost = works[np.lexsort((-cost[works], group))]  # heaviest first inside each group
    within = np.arange(works.size) - start[group]
    rank = np.where(within % 2 == 0, within // 2, sizes[group] - 1 - within // 2)
    pair = paired[group]
    return np.where(pair, by_cost[start[group] + rank], works), pair & (within % 2 == 1)


def _places(rows: np.ndarray, group: np.ndarray, cost: np.ndarray, last_block: np.ndarray, num_ctas: int) -> np.ndarray:
    """Per group of rows (`group[i]` of row i, consecutive), how many distinct (K/V head, q
    block) places its CTAs walk at once, summed over PLACE_SAMPLES times of the deal of `rows`
    (work, head, flags): the Q / dO / dQ rows the L2 must hold for them. Time and position
    count in q blocks: an item walks down from its last block, or, if ASCENDING, up to it."""
    c = cost[rows[:, 0]].astype(np.float64)
    unit, unit_costs = _unit_costs(rows, c)
    owner, unit_start, _ = _free_times(unit_costs, num_ctas)
    before = np.cumsum(c) - c
    start = unit_start[unit] + before - before[np.searchsorted(unit, unit)]  # a pair's second after its first
    cta = owner[unit]
    makespan = float((unit_start + unit_costs).max())
    timeline = makespan + 1.0  # each CTA's rows on a timeline of its own, back to back
    key = cta * timeline + start
    rank = np.argsort(key, kind="stable")
    t = (np.arange(PLACE_SAMPLES) + 0.5) * makespan / PLACE_SAMPLES
    probe = (np.arange(num_ctas)[:, None] * timeline + t[None, :]).ravel()
    at = rank[np.maximum(np.searchsorted(key[rank], probe, side="right") - 1, 0)]
    elapsed = np.tile(t, num_ctas) - start[at]
    busy = (cta[at] == np.repeat(np.arange(num_ctas), t.size)) & (elapsed >= 0) & (elapsed < c[at])
    at, elapsed = at[busy], elapsed[busy]
    last = last_block[rows[at, 0]]
    position = np.where(rows[at, 2] & ASCENDING, last - c[at] + elapsed, last - elapsed).astype(np.int64)
    position -= position.min(initial=0)
    sample = np.tile(np.arange(t.size, dtype=np.int64), num_ctas)[busy]
    heads, blocks = int(rows[:, 1].max(initial=0)) + 1, int(position.max(initial=0)) + 1
    place = np.unique(((group[at] * t.size + sample) * heads + rows[at, 1]) * blocks + position)
    return np.bincount(place // (t.size * heads * blocks), minlength=int(group.max(initial=-1)) + 1)


def sync_group_order(last_block: np.ndarray, cost: np.ndarray, num_heads_kv: int, num_ctas: int) -> np.ndarray:
    """Items group by group, the group with the heaviest item first, ties by last block (so
    equal items start in step: a sliding window's tiles run in rounds, its light last tiles
    after them); inside a group, or a run of one-tile groups (else a window's CTAs would walk
    every head's rows at once), head by head, each head's works in (longest, shortest) pairs,
    the second of each ASCENDING, if the group's items fill `num_ctas` CTAs, its costs differ
    by PAIR_SPREAD and the pairs keep its CTAs at fewer places (`_places`, over a deal of the
    groups that could pair, in pairs against in order).
    `last_block[w]` is the end of work w's last run (-1: none), `cost[w]` its estimated cost."""
    groups, group_of = np.unique(last_block, return_inverse=True)
    heaviest = np.zeros(groups.size)
    np.maximum.at(heaviest, group_of, cost)
    rank = np.empty(groups.size, np.int64)
    rank[np.lexsort((groups, -heaviest))] = np.arange(groups.size)
    works = np.lexsort((np.arange(last_block.size), rank[group_of]))  # by group rank, stable
    sizes = np.bincount(rank[group_of], minlength=groups.size)
    lightest = np.full(groups.size, np.inf)
    np.minimum.at(lightest, group_of, cost)
    by_rank = np.argsort(rank)
    paired = (sizes * num_heads_kv >= num_ctas) & (heaviest[by_rank] >= PAIR_SPREAD * lightest[by_rank])
    candidates = np.flatnonzero(paired)
    if candidates.size:  # keep the pairs of the groups whose CTAs they keep at fewer places
        # The candidates alone, dealt back to back: pairs change only their walks, and the
        # other groups' many small items would cut the deal's rounds short (host time).
        size = sizes[candidates]
        start = np.r_[0, np.cumsum(sizes)[:-1]][candidates]
        mine = np.repeat(start - np.r_[0, np.cumsum(size)[:-1]], size) + np.arange(size.sum())
        group = np.repeat(np.arange(size.size), size * num_heads_kv)
        in_order = _groups_by_head(works[mine], size, np.zeros(mine.size, np.int64), num_heads_kv)
        works_paired, second = _in_pairs(works[mine], size, cost, np.ones(size.size, bool))
        in_pairs = _groups_by_head(works_paired, size, second * ASCENDING, num_heads_kv)
        fewer = _places(in_pairs, group, cost, last_block, num_ctas) < _places(in_order, group, cost, last_block, num_ctas)
        paired[candidates] = fewer
    works, second = _in_pairs(works, sizes, cost, paired)
    flags = heads_inner(last_block)[works] * HEADS_INNER + second * ASCENDING
    return _groups_by_head(works, _lone_runs_joined(sizes), flags, num_heads_kv)


def _lone_runs_joined(sizes: np.ndarray) -> np.ndarray:
    """Group sizes with each run of consecutive one-tile groups (a sliding window's tiles)
    joined into one group, so that the run goes one K/V head after the other."""
    lone = sizes == 1
    starts = ~lone | np.r_[True, ~lone[:-1]]
    return np.bincount(np.cumsum(starts) - 1, weights=sizes).astype(np.int64)


def section_order(last_block: np.ndarray, num_heads_kv: int) -> np.ndarray:
    """Items in sections of SECTION works in schedule order; inside a section head by head."""
    num_work = last_block.size
    sizes = np.diff(np.r_[np.arange(0, num_work, SECTION), num_work])
    return _groups_by_head(np.arange(num_work), sizes, heads_inner(last_block) * HEADS_INNER, num_heads_kv)


def whole(order: np.ndarray) -> np.ndarray:
    """(work, head, flags) rows as items that own their dK / dV: every query head, no slot."""
    return np.c_[order, np.zeros(len(order), np.int64), np.full((len(order), 2), -1, np.int64)]


def _units(order: np.ndarray) -> np.ndarray:
    """Per row, its unit of dealing: an ASCENDING row joins the row before it (a pair)."""
    return np.cumsum((order[:, 2] & ASCENDING) == 0) - 1


def _free_times(
    costs: np.ndarray, num_ctas: int, free: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy list scheduling of units of `costs`: each to the CTA that is free first (ties:
    the lower CTA), from CTAs free at `free` (default all at 0). The owner and start of each
    unit, and when each CTA is free at the end.

    Vectorised in rounds: with the CTAs sorted by free time, the next units go to them in that
    order for as long as no unit of the round would free its CTA before the next CTA's turn
    (then the round ends, exactly where the one-at-a-time rule would diverge)."""
    free = np.zeros(num_ctas) if free is None else free.copy()
    ctas = np.arange(num_ctas)
    owner = np.empty(costs.size, np.int64)
    start = np.empty(costs.size)
    i = 0
    while i < costs.size:
        by = np.lexsort((ctas, free))
        chunk = costs[i : i + num_ctas]
        starts = free[by[: chunk.size]]
        freed = np.minimum.accumulate(starts + chunk)
        late = np.flatnonzero(freed[:-1] <= starts[1:])
        n = int(late[0]) + 1 if late.size else chunk.size
        owner[i : i + n] = by[:n]
        start[i : i + n] = starts[:n]
        free[by[:n]] += chunk[:n]
        i += n
    return owner, start, free


def _unit_costs(items: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    unit = _units(items)
    return unit, (np.bincount(unit, weights=cost.astype(np.float64)) if len(items) else np.zeros(0))


def _pieces(
    rows: np.ndarray, cost: np.ndarray, qheads_per_kvhead: int, first_slot: int, width: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """`rows` (whole items) cut into pieces of `width` query heads (a divisor of
    qheads_per_kvhead), piece by piece (CTAs at the same query heads share their Q / dO), each
    item with its own slot from `first_slot` on; and their costs: a piece costs its share of the
    item's q blocks plus PIECE_OVERHEAD_STEPS."""
    parts = qheads_per_kvhead // width
    pieces = np.tile(rows, (parts, 1))
    pieces[:, 2] &= ~ASCENDING
    pieces[:, 3] = np.repeat(np.arange(parts) * width, len(rows))
    pieces[:, 4] = width
    pieces[:, 5] = np.tile(first_slot + np.arange(len(rows)), parts)
    return pieces, np.tile(_piece_cost(cost, width, qheads_per_kvhead), parts)


def split(
    last_block: np.ndarray, cost: np.ndarray, num_heads_kv: int, qheads_per_kvhead: int, num_ctas: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The items of `sync_group_order` (same arguments) split where that shortens the deal:
    the heavy ones and the tail (`split_heavy`, `split_tail`), or in a coarse deal every one
    (`split_every`) where that ends sooner by SPLIT_GAIN. Returns the rows, their costs and the
    CTA of each unit in their deal (for `deal`: the deal that chose them is not made again)."""
    order = sync_group_order(last_block, cost, num_heads_kv, num_ctas)
    rows, row_cost = split_heavy(whole(order), cost[order[:, 0]], qheads_per_kvhead, num_ctas)
    rows, row_cost, owner = split_tail(rows, row_cost, qheads_per_kvhead, num_ctas)
    if qheads_per_kvhead == 1 or len(order) > COARSE_ITEMS_PER_CTA * num_ctas:
        return rows, row_cost, owner
    every, every_cost = split_every(last_block, cost, num_heads_kv, qheads_per_kvhead, num_ctas)
    if _makespan(every, every_cost, num_ctas) < _makespan(rows, row_cost, num_ctas) * (1 - SPLIT_GAIN):
        return every, every_cost, _free_times(_unit_costs(every, every_cost)[1], num_ctas)[0]
    return rows, row_cost, owner


def split_heavy(items: np.ndarray, cost: np.ndarray, qheads_per_kvhead: int, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """`items` (rows of `whole`, in dealing order, `cost` per row) with every unit heavier than
    HEAVY_SHARE of a CTA's fair share of the deal cut into pieces of a few query heads, the
    pieces first (no deal ends before its heaviest unit does: the k tiles of global keys, which
    every query sees, would hold one CTA long after the others). Widths go widest first, and a
    narrower one is taken only where its deal ends SPLIT_GAIN sooner (each piece pays an item's
    boundary, and walks its q blocks' keep masks once for all its heads); none where no deal
    ends SPLIT_GAIN before the heaviest unit. Returns the rows and their costs."""
    if qheads_per_kvhead == 1 or not len(items):
        return items, cost
    unit, unit_costs = _unit_costs(items, cost)
    heavy = (unit_costs > HEAVY_SHARE * unit_costs.sum() / num_ctas)[unit]
    if not heavy.any():
        return items, cost
    # What a deal must end before: SPLIT_GAIN sooner than the best so far, at first the whole
    # items' (which end no sooner than their heaviest unit).
    best = (unit_costs.max() * (1 - SPLIT_GAIN), items, cost)
    for width in _widths(qheads_per_kvhead):
        pieces, piece_cost = _pieces(items[heavy], cost[heavy], qheads_per_kvhead, 0, width)
        rows, row_cost = np.r_[pieces, items[~heavy]], np.r_[piece_cost, cost[~heavy]]
        if row_cost.sum() / num_ctas >= best[0]:
            break  # no deal ends before its mean load, which grows as the pieces narrow
        if (makespan := _makespan(rows, row_cost, num_ctas)) < best[0]:
            best = (makespan * (1 - SPLIT_GAIN), rows, row_cost)
    return best[1], best[2]


def split_every(
    last_block: np.ndarray, cost: np.ndarray, num_heads_kv: int, qheads_per_kvhead: int, num_ctas: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every item cut into pieces of a few query heads: the pieces of a K/V head are the items
    of as many K/V heads of fewer query heads, so `sync_group_order` orders them (groups, and
    pairs where they pay), and each item's pieces share its slot. Widths go widest first, a
    narrower one taken only where its deal ends SPLIT_GAIN sooner (`split_heavy`). Returns the
    rows and their costs (`last_block`, `cost` per work as in `sync_group_order`)."""
    best: tuple[float, np.ndarray, np.ndarray] | None = None  # (what a deal must end before, rows, costs)
    for width in _widths(qheads_per_kvhead):
        parts = qheads_per_kvhead // width
        piece_cost = _piece_cost(cost, width, qheads_per_kvhead)
        if best is not None and piece_cost.sum() * num_heads_kv * parts / num_ctas >= best[0]:
            break  # no deal ends before its mean load, which grows as the pieces narrow
        order = sync_group_order(last_block, piece_cost, num_heads_kv * parts, num_ctas)
        head, part = np.divmod(order[:, 1], parts)
        rows = np.c_[order[:, 0], head, order[:, 2], part * width, np.full(len(order), width),
                     order[:, 0] * num_heads_kv + head]  # fmt: skip
        row_cost = piece_cost[rows[:, 0]]
        makespan = _makespan(rows, row_cost, num_ctas)
        if best is None or makespan < best[0]:
            best = (makespan * (1 - SPLIT_GAIN), rows, row_cost)
    assert best is not None, "split_every needs two query heads per K/V head at least"
    return best[1], best[2]


def _widths(qheads_per_kvhead: int) -> list[int]:
    """The widths of pieces: the divisors of qheads_per_kvhead below it, widest first."""
    return [w for w in range(qheads_per_kvhead // 2, 0, -1) if qheads_per_kvhead % w == 0]


def _piece_cost(cost: np.ndarray, width: int, qheads_per_kvhead: int) -> np.ndarray:
    """Per whole item's `cost`, one of its pieces of `width` query heads: its share of the q
    blocks plus PIECE_OVERHEAD_STEPS."""
    return ((cost - ITEM_OVERHEAD_BLOCKS) * width + PIECE_OVERHEAD_STEPS) / qheads_per_kvhead


def _makespan(items: np.ndarray, cost: np.ndarray, num_ctas: int) -> float:
    """When the last CTA of the deal of `items` (with `cost` per row) ends."""
    return float(_free_times(_unit_costs(items, cost)[1], num_ctas)[2].max())


def split_tail(
    items: np.ndarray, cost: np.ndarray, qheads_per_kvhead: int, num_ctas: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`items` (rows of `whole`, in dealing order, after any pieces of `split_heavy`; `cost` per
    row) with the whole units at the end cut into one piece per query head, as many units as
    shorten the deal's makespan most (by SPLIT_GAIN at least; else none). A piece costs its
    share of the item's q blocks plus PIECE_OVERHEAD_STEPS. The pieces run head by head (CTAs
    at one query head share its Q / dO), each split item with its own slot. Returns the rows,
    their costs and the CTA of each of their units in their deal (what `deal` gives them: a
    candidate's deal is the common one's continued, so it is the whole deal)."""
    unit, unit_costs = _unit_costs(items, cost)
    owner, _, free = _free_times(unit_costs, num_ctas)
    if qheads_per_kvhead == 1 or not len(items):
        return items, cost, owner
    makespan = float(free.max())
    if makespan * num_ctas <= unit_costs.sum() * (1 + SPLIT_GAIN):
        return items, cost, owner  # balanced already
    best = (makespan * (1 - SPLIT_GAIN), items, cost, owner)
    num_units = len(unit_costs)
    # Only whole items are cut: the pieces split_heavy made lead the order.
    cut = np.flatnonzero(items[:, 5] >= 0)
    whole_units = num_units - (int(unit[cut[-1]]) + 1 if cut.size else 0)
    # Candidates: enough pieces for TAIL_ROUNDS rounds of the CTAs. The deal of the units
    # before the longest tail is common to all of them.
    piece_counts = np.array(TAIL_ROUNDS) * num_ctas
    splits = np.unique(np.minimum(-(-piece_counts // qheads_per_kvhead), whole_units))
    splits = splits[splits > 0]
    if not splits.size:
        return items, cost, owner
    common = num_units - int(splits[-1])
    common_owner, _, free = _free_times(unit_costs[:common], num_ctas)
    busiest, placed = free.max(), free.sum()  # of the common deal, for the candidates' bound
    first_slot = slots_used(items)
    for k in splits:
        first = int(np.searchsorted(unit, num_units - k))
        pieces, piece_cost = _pieces(items[first:], cost[first:], qheads_per_kvhead, first_slot)
        tail_units = np.r_[unit_costs[common : num_units - k], piece_cost]
        # No deal ends before its mean load; each piece adds to the work, so from here on no
        # candidate can beat the best one (planning time: this spares half the deals).
        if max(busiest, (placed + tail_units.sum()) / num_ctas) >= best[0]:
            break
        tail_owner, _, tail_free = _free_times(tail_units, num_ctas, free)
        if (makespan := tail_free.max()) < best[0]:
            best = (makespan, np.r_[items[:first], pieces], np.r_[cost[:first], piece_cost], np.r_[common_owner, tail_owner])
    return best[1], best[2], best[3]


def deal(items: np.ndarray, cost: np.ndarray, num_ctas: int, owner: np.ndarray | None = None) -> ItemLists:
    """Greedy list scheduling: each unit of `items` (rows of `whole` or `split_tail`; an
    ASCENDING row joins the row before it: a pair) goes to the CTA that is free first, given
    the `cost` of its rows; ties go to the lower CTA. Each CTA keeps its items in their order
    (what the deterministic kernel's deadlock freedom needs). `owner`: each unit's CTA in that
    deal where it was made already (`split`'s), so it is not made again."""
    if num_ctas < 1:
        raise ValueError(f"num_ctas must be at least 1, got {num_ctas}")
    if len(items) and items[0, 2] & ASCENDING:
        raise ValueError("the first item cannot be the second of a pair (ASCENDING)")
    unit, unit_costs = _unit_costs(items, cost)
    owner = (_free_times(unit_costs, num_ctas)[0] if owner is None else owner)[unit]
    by_cta = np.argsort(owner, kind="stable")
    cta_items = np.r_[0, np.cumsum(np.bincount(owner, minlength=num_ctas))]
    return ItemLists(
        items=np.ascontiguousarray(items[by_cta], dtype=np.int32).reshape(-1, items.shape[1]),
        cta_items=np.ascontiguousarray(cta_items, dtype=np.int32),
    )
