"""maskc.ir.items: the backward kernel's per-CTA item lists."""

from __future__ import annotations

import numpy as np
import pytest
from test_schedule import piece_heads

from maskc.ir import AttnSlice, Mask
from maskc.ir.items import (
    ASCENDING,
    COARSE_ITEMS_PER_CTA,
    HEADS_INNER,
    PIECE_OVERHEAD_STEPS,
    SECTION,
    SPLIT_GAIN,
    TAIL_ROUNDS,
    _free_times,
    _makespan,
    _pieces,
    _unit_costs,
    deal,
    heads_inner,
    section_order,
    split,
    split_heavy,
    split_tail,
    sync_group_order,
    whole,
)  # fmt: skip
from maskc.ir.schedule import build_backward_schedule


def test_heads_inner_only_where_tiles_share_their_last_block() -> None:
    assert heads_inner(np.array([7, 7, 3, 9, -1])).tolist() == [1, 1, 0, 0, 0]


def test_sync_groups_run_together_heaviest_item_first_ties_by_last_block() -> None:
    last = np.array([5, 9, 5, 2, 9])
    cost = np.array([3, 8, 1, 8, 2])
    order = sync_group_order(last, cost, num_heads_kv=2, num_ctas=8)
    # Groups: {3} (heaviest item 8, ends at 2), {1, 4} (8, ends at 9): ties by last block; then {0, 2} (3).
    # Inside a group head by head; no group fills the 8 CTAs, so none runs in pairs.
    assert order.tolist() == [
        [3, 0, 0], [3, 1, 0],
        [1, 0, 1], [4, 0, 1], [1, 1, 1], [4, 1, 1],
        [0, 0, 1], [2, 0, 1], [0, 1, 1], [2, 1, 1],
    ]  # fmt: skip


def test_a_run_of_one_tile_groups_goes_head_by_head() -> None:
    """A sliding window's tiles each end at their own q block: consecutive one-tile groups run
    as one, every tile of K/V head 0 before head 1, so the CTAs running together share one
    head's Q, dO and dQ rows; a group of several tiles keeps its own heads."""
    order = sync_group_order(np.array([10, 11, 5, 5, 12]), np.full(5, 3), num_heads_kv=2, num_ctas=8)
    assert order.tolist() == [
        [2, 0, HEADS_INNER], [3, 0, HEADS_INNER], [2, 1, HEADS_INNER], [3, 1, HEADS_INNER],
        [0, 0, 0], [1, 0, 0], [4, 0, 0], [0, 1, 0], [1, 1, 0], [4, 1, 0],
    ]  # fmt: skip


def test_a_group_of_even_lengths_pairs_its_longest_and_shortest_works() -> None:
    ramp = np.arange(12, 0, -1)  # a causal mask's k tiles: lengths 12 .. 1, each pair costs 13
    order = sync_group_order(np.full(12, 20), ramp, num_heads_kv=1, num_ctas=3)
    assert order[:, 0].tolist() == [0, 11, 1, 10, 2, 9, 3, 8, 4, 7, 5, 6]
    assert order[:, 2].tolist() == [HEADS_INNER, HEADS_INNER | ASCENDING] * 6


def test_a_group_of_lengths_in_steps_walks_in_order() -> None:
    """A context-parallel rank's local causal mask: whole chunks of keys see the same queries,
    so the lengths come in steps. Pairs of unequal cost would spread the CTAs over more q
    blocks than walking the works in order, a step at a time."""
    steps = np.array([8] * 4 + [7] + [6] * 7 + [5] + [4] * 7 + [3] + [2] * 7 + [1]) * 4
    order = sync_group_order(np.full(steps.size, 99), steps, num_heads_kv=1, num_ctas=3)
    assert order[:, 0].tolist() == list(range(steps.size))
    assert not (order[:, 2] & ASCENDING).any()


def test_groups_pair_only_when_they_fill_every_cta_and_their_lengths_differ() -> None:
    last = np.array([20] * 12 + [30, 30])
    cost = np.r_[np.arange(12, 0, -1), [9, 2]]
    # Group {0 .. 11} (a ramp, 12 items on 3 CTAs) pairs; group {12, 13} (costs 9 vs 2) has too few items.
    order = sync_group_order(last, cost, num_heads_kv=1, num_ctas=3)
    assert (order[:, 2] & ASCENDING).tolist() == [0, ASCENDING] * 6 + [0, 0]
    assert order[12:, 0].tolist() == [12, 13]
    # Equal lengths (within PAIR_SPREAD) never pair, however many items.
    even = sync_group_order(np.full(4, 3), np.array([4, 4, 3, 4]), num_heads_kv=8, num_ctas=2)
    assert not (even[:, 2] & ASCENDING).any()


def test_deal_keeps_a_pair_on_one_cta_and_counts_its_cost_once() -> None:
    order = np.array([[0, 0, 1], [1, 0, 3], [2, 0, 1], [3, 0, 1]])
    lists = deal(order, np.array([6, 4, 5, 5]), num_ctas=2)
    # The pair (0, 1) costs 10: CTA 0 takes it, CTA 1 takes 2 then 3 (free at 5 < 10).
    assert lists.cta_items.tolist() == [0, 2, 4] and lists.items[:, 0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="second of a pair"):
        deal(order[1:], np.array([6, 4, 5, 5]), num_ctas=2)


def test_section_order_keeps_k_tiles_ascending_per_head() -> None:
    order = section_order(np.arange(SECTION + 3), num_heads_kv=2)
    assert order[:SECTION, :2].tolist() == [[w, 0] for w in range(SECTION)]
    assert order[2 * SECTION : 2 * SECTION + 3, :2].tolist() == [[SECTION + w, 0] for w in range(3)]
    for h in (0, 1):
        assert order[order[:, 1] == h, 0].tolist() == list(range(SECTION + 3))


def test_deal_balances_by_cost_and_keeps_each_ctas_items_in_order() -> None:
    order = np.stack([np.arange(6), np.zeros(6, np.int64), np.zeros(6, np.int64)], axis=1)
    lists = deal(order, np.array([10, 1, 1, 1, 1, 6]), num_ctas=2)
    # CTA 0 takes the heavy item; CTA 1 the next four light ones, then the 6 (free at 4 < 10).
    assert lists.num_ctas == 2 and lists.cta_items.tolist() == [0, 1, 6]
    assert lists.items[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert lists.items.dtype == np.int32 and lists.items.shape == (6, 3)  # the rows as given


def test_deal_rejects_no_cta() -> None:
    with pytest.raises(ValueError, match="num_ctas"):
        deal(np.zeros((0, 3), np.int64), np.zeros(0), 0)


def test_documents_walk_heads_innermost_a_sliding_window_outermost() -> None:
    docs = build_backward_schedule(Mask.from_cu_seqlens([0, 512, 1024], causal=True), 64, 128, 2, 4)
    assert (docs.items[:, 2] & HEADS_INNER).tolist() == [1] * len(docs.items)
    window = build_backward_schedule(Mask.sliding_window([0, 2048], left=255), 64, 128, 2, 4)
    tiles = window.work_tile[window.items[:, 0]]
    # The window's tiles end at distinct q blocks but the last ones, which share the last block.
    assert window.items[tiles < 12, 2].tolist() == [0] * int((tiles < 12).sum())
    assert set((window.items[tiles >= 14, 2] & HEADS_INNER).tolist()) == {1}


def _heap_deal(costs: list[float], num_ctas: int) -> list[int]:
    """The one-at-a-time rule `deal` vectorises: each item to the CTA free first (lower on ties)."""
    import heapq

    heap = [(0.0, c) for c in range(num_ctas)]
    owner = []
    for cost in costs:
        free, cta = heapq.heappop(heap)
        owner.append(cta)
        heapq.heappush(heap, (free + cost, cta))
    return owner


@pytest.mark.parametrize("seed", range(20))
def test_deal_in_rounds_equals_one_item_at_a_time(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, num_ctas = int(rng.integers(0, 400)), int(rng.integers(1, 40))
    cost = rng.integers(1, 6 if seed % 2 else 300, size=n).astype(np.float64)  # many ties, or few
    order = np.stack([np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64)], axis=1)
    lists = deal(order, cost, num_ctas)
    owner = _heap_deal(cost.tolist(), num_ctas)
    for c in range(num_ctas):
        mine = lists.items[lists.cta_items[c] : lists.cta_items[c + 1], 0].tolist()
        assert mine == [i for i in range(n) if owner[i] == c]


def test_split_tail_cuts_the_last_items_into_one_piece_per_query_head() -> None:
    # 5 equal items on 4 CTAs: whole, the fifth runs alone after the first round (makespan 2x).
    items = whole(np.stack([np.arange(5), np.zeros(5, np.int64), np.zeros(5, np.int64)], axis=1))
    rows, cost, _ = split_tail(items, np.full(5, 40.0), qheads_per_kvhead=4, num_ctas=4)
    pieces = rows[rows[:, 5] >= 0]
    assert len(pieces) and (pieces[:, 4] == 1).all() and (rows[rows[:, 5] < 0, 4] == -1).all()
    # Every split item has each query head once, all under one slot.
    for slot in np.unique(pieces[:, 5]):
        mine = pieces[pieces[:, 5] == slot]
        assert sorted(mine[:, 3].tolist()) == [0, 1, 2, 3] and len(set(mine[:, 0].tolist())) == 1
    lists = deal(rows, cost, num_ctas=4)
    assert lists.num_slots == len(np.unique(pieces[:, 5])) and lists.items.shape == (len(rows), 6)
    row_cost = np.where(lists.items[:, 5] >= 0, cost.min(), 40.0)  # a piece: a quarter of the q blocks + overhead
    load = np.bincount(np.repeat(np.arange(4), np.diff(lists.cta_items)), weights=row_cost, minlength=4)
    assert cost.min() < 40 and load.max() < 80  # shorter than the whole items' two rounds


def test_split_tail_leaves_balanced_or_single_head_items_whole() -> None:
    items = whole(np.stack([np.arange(8), np.zeros(8, np.int64), np.zeros(8, np.int64)], axis=1))
    for qheads, num_ctas in ((4, 4), (1, 3)):  # 8 equal items on 4 CTAs are balanced; one query head cannot split
        rows, cost, _ = split_tail(items, np.full(8, 40.0), qheads_per_kvhead=qheads, num_ctas=num_ctas)
        assert rows is items and (rows[:, 3] == 0).all() and (rows[:, 4:] == -1).all()


def test_split_tail_takes_the_shortest_of_its_candidate_deals() -> None:
    """split_tail stops trying longer tails once their mean load reaches the best deal found;
    on random costs its pick is still the shortest of every candidate (each tail of
    TAIL_ROUNDS rounds of pieces, dealt whole), or no split where none gains SPLIT_GAIN."""
    rng = np.random.default_rng(0)
    qheads = 4
    for _ in range(40):
        n, num_ctas = int(rng.integers(10, 300)), int(rng.integers(2, 48))
        items = whole(np.stack([np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64)], axis=1))
        cost = rng.integers(3, 120, n).astype(np.float64)

        def makespan(rows: np.ndarray, row_cost: np.ndarray) -> float:
            return float(_free_times(_unit_costs(rows, row_cost)[1], num_ctas)[2].max())

        unsplit = makespan(items, cost)
        candidates = []
        for rounds in TAIL_ROUNDS:
            k = min(-(-rounds * num_ctas // qheads), n)
            pieces, piece_cost = _pieces(items[n - k :], cost[n - k :], qheads, 0)
            candidates.append(makespan(np.r_[items[: n - k], pieces], np.r_[cost[: n - k], piece_cost]))
        expected = min(candidates) if min(candidates) < unsplit * (1 - SPLIT_GAIN) else unsplit
        assert makespan(*split_tail(items, cost, qheads, num_ctas)[:2]) == expected


def _cta_loads(rows: np.ndarray, cost: np.ndarray, num_ctas: int) -> list[float]:
    """Each CTA's summed cost in the deal of `rows` (distinct rows, `cost` per row)."""
    lists = deal(rows, cost, num_ctas)
    cost_of = {tuple(r): c for r, c in zip(rows.tolist(), cost)}
    bounds = zip(lists.cta_items[:-1], lists.cta_items[1:])
    return [sum(cost_of[tuple(r)] for r in lists.items[a:b].tolist()) for a, b in bounds]


def test_split_heavy_cuts_the_items_no_deal_could_balance_and_split_tail_numbers_on() -> None:
    """Two items that each outweigh a CTA's fair share (global keys: every query sees them)
    become pieces at the front, in slots 0 and 1, as wide as balance allows (here two query
    heads each); the light items stay whole and in order, and pieces split_tail makes after
    them take the next slots."""
    n = 44
    items = whole(np.stack([np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64)], axis=1))
    cost = np.r_[400.0, 400.0, np.full(n - 2, 20.0)]  # fair share on 8 CTAs: 1640 / 8 = 205
    rows, row_cost = split_heavy(items, cost, qheads_per_kvhead=4, num_ctas=8)
    heavy = rows[:4]
    assert sorted(map(tuple, heavy[:, [0, 3, 4, 5]].tolist())) == [(w, h, 2, w) for w in (0, 1) for h in (0, 2)]
    assert (rows[4:] == items[2:]).all() and np.allclose(row_cost[:4], ((400 - 2) * 2 + PIECE_OVERHEAD_STEPS) / 4)
    assert max(_cta_loads(rows, row_cost, 8)) < max(_cta_loads(items, cost, 8)) / 1.5
    rows, row_cost, _ = split_tail(rows, row_cost, qheads_per_kvhead=4, num_ctas=8)
    tail_slots = set(rows[4:][rows[4:, 5] >= 0, 5].tolist())
    assert (rows[:4] == heavy).all() and tail_slots and min(tail_slots) == 2
    light, _ = split_heavy(items[2:], cost[2:], qheads_per_kvhead=4, num_ctas=8)
    assert (light == items[2:]).all()


def test_split_heavy_keeps_the_widest_pieces_that_balance_the_deal() -> None:
    """Two heavy items among 198 light ones: pieces of two query heads let the light items fill
    the CTAs to within SPLIT_GAIN of their mean load; one-head pieces would end a little
    sooner, but not SPLIT_GAIN sooner, so the wider pieces (fewer boundaries) stay."""
    n = 200
    items = whole(np.stack([np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64)], axis=1))
    cost = np.r_[400.0, 400.0, np.full(n - 2, 7.0)]
    rows, row_cost = split_heavy(items, cost, qheads_per_kvhead=4, num_ctas=8)
    assert (rows[:4, 4] == 2).all() and (rows[4:] == items[2:]).all()
    pieces, piece_cost = _pieces(items[:2], cost[:2], 4, 0, width=1)
    one_head = _makespan(np.r_[pieces, items[2:]], np.r_[piece_cost, cost[2:]], 8)
    assert one_head < _makespan(rows, row_cost, 8) < one_head / (1 - SPLIT_GAIN)


def test_the_k_tiles_every_query_sees_are_split_first() -> None:
    """Global keys (every query of 8k sees keys 0-255) beside a narrow window: their two k tiles
    per K/V head would each outlast a CTA's fair share, so the schedule cuts them into pieces
    that cover each query head once and leaves most of the window's tiles whole (without
    split_heavy the tail split cuts every item to reach them)."""
    n = 8192
    mask = Mask.sliding_window([0, n], left=128, right=128) | Mask([AttnSlice((0, n), (0, 256))], n, n)
    s = build_backward_schedule(mask, 64, 128, 2, 16, 4)
    tiles = s.work_tile[s.items[:, 0]]
    pieces = s.items[:, 5] >= 0
    assert set(tiles[tiles < 2].tolist()) == {0, 1} and pieces[tiles < 2].all()
    for tile in (0, 1):
        for head_kv in (0, 1):
            mine = s.items[(tiles == tile) & (s.items[:, 1] == head_kv)]
            assert piece_heads(mine) == [0, 1, 2, 3] and len(set(mine[:, 5].tolist())) == 1
    assert s.num_slots >= 4 and (~pieces[tiles >= 2]).mean() > 0.5


def test_a_coarse_deal_has_every_item_cut_into_pieces_of_a_few_query_heads() -> None:
    """Six equal items on four CTAs (fewer than COARSE_ITEMS_PER_CTA each): whole, two CTAs
    run two; cutting the last two still leaves each CTA a whole item and a quarter of their
    pieces. Cut into pieces of a few query heads, all of them, the deal ends sooner; each item's
    pieces share a slot and cover its query heads once, and all have one width."""
    last_block, cost = np.zeros(6, np.int64), np.full(6, 42.0)
    tail_rows, tail_cost, _ = split_tail(whole(sync_group_order(last_block, cost, 1, 4)), cost, 8, 4)
    rows, row_cost, _ = split(last_block, cost, num_heads_kv=1, qheads_per_kvhead=8, num_ctas=4)
    assert (rows[:, 5] >= 0).all() and len(set(rows[:, 4].tolist())) == 1 and 1 < rows[0, 4] < 8
    assert _makespan(rows, row_cost, 4) < _makespan(tail_rows, tail_cost, 4) * (1 - SPLIT_GAIN)
    for slot in range(6):
        mine = rows[rows[:, 5] == slot]
        assert piece_heads(mine) == list(range(8)) and set(mine[:, 0].tolist()) == {slot}
    # Nine on four is no coarse deal: the tail split balances it, every item is never cut.
    last_block, cost = np.zeros(9, np.int64), np.full(9, 42.0)
    rows, _, _ = split(last_block, cost, num_heads_kv=1, qheads_per_kvhead=8, num_ctas=4)
    assert 9 > COARSE_ITEMS_PER_CTA * 4 and (rows[:, 5] < 0).sum() == 8


def test_pieces_of_a_causal_mask_run_in_pairs() -> None:
    """Causal 8k, one K/V head of eight query heads on 132 CTAs: 64 k tiles of unequal lengths
    cannot fill the CTAs whole, so every one is cut; the pieces (items of more K/V heads) run in
    (longest, shortest) pairs like whole items of a longer sequence, each pair at one set of
    query heads."""
    n = 8192
    s = build_backward_schedule(Mask([AttnSlice((0, n), (0, n), "causal")], n, n), 64, 128, 1, 132, 8)
    assert (s.items[:, 5] >= 0).all() and (s.items[:, 4] > 1).all()
    second = np.flatnonzero(s.items[:, 2] & ASCENDING)
    assert second.size == len(s.items) // 2
    tiles = s.work_tile[s.items[:, 0]]
    assert (tiles[second - 1] + tiles[second] == n // 128 - 1).all()  # tile t with tile 63 - t
    assert (s.items[second - 1, 3:5] == s.items[second, 3:5]).all()


@pytest.mark.parametrize("seed", range(24))
def test_the_deal_split_hands_on_is_the_deal_of_its_rows(seed: int) -> None:
    """`split` (and `split_tail`) return the CTA of each unit from the deals that chose the rows
    (a tail candidate's: the common deal continued); `deal` takes it instead of dealing again, so
    it must be the one-at-a-time deal of those rows: random groups, costs and CTA counts, some
    balanced, some with heavy items, some coarse, some cut at the tail."""
    rng = np.random.default_rng(seed)
    n, num_ctas = int(rng.integers(1, 300)), int(rng.integers(1, 140))
    last_block = rng.integers(-1, max(2, n // int(rng.integers(1, 8))), n)
    cost = rng.integers(3, 6 if seed % 3 == 0 else 400, n).astype(np.float64)
    qheads = int(rng.choice([1, 2, 4, 8]))
    rows, row_cost, owner = split(last_block, cost, int(rng.integers(1, 4)), qheads, num_ctas)
    fresh, handed = deal(rows, row_cost, num_ctas), deal(rows, row_cost, num_ctas, owner)
    assert (fresh.items == handed.items).all() and (fresh.cta_items == handed.cta_items).all()
    order = sync_group_order(last_block, cost, 2, num_ctas)
    tail_rows, tail_cost, tail_owner = split_tail(whole(order), cost[order[:, 0]], qheads, num_ctas)
    assert (tail_owner == _free_times(_unit_costs(tail_rows, tail_cost)[1], num_ctas)[0]).all()
