"""The forward strategy pass: per mask, plain kernels or PackGQA, and where the kernel family has
a tall tile for the head dim, which tile, by comparing the estimated times of the schedules.
(The tile shapes it compares are the kernel families', maskc/artifact/kernel_families.py.)
"""

from __future__ import annotations

import numpy as np

from maskc.artifact.kernel_families import pack_gqa_supported
from maskc.ir.mask import Mask
from maskc.ir.schedule import Schedule, build_forward_schedule, forward_key, keep_schedule

#: Cost model of one work item, in units of one full (TILE_M x TILE_N) k block: a partial
#: block also pays its line mask, and every item pays its Q load, pipeline fill and epilogue.
PARTIAL_BLOCK_COST = 1.25
ITEM_OVERHEAD_BLOCKS = 1.5
#: PackGQA is chosen only when its estimated time is below this fraction of the plain kernel's.
PACK_GQA_MARGIN = 0.9
#: Estimates this close count as a tie (then partial blocks decide, see select_pack_gqa).
PACK_GQA_TIE = 1.02
#: SMs of the GPU the estimate assumes when the caller does not say (H100 / H200 SXM).
DEFAULT_NUM_SMS = 132
#: A tall forward tile against the family's own for the head dim (d=128: 192x128, three
#: consumer warpgroups with P through shared memory, against 128x128), measured on an H100
#: (16k tokens, 64:8 heads, bf16, tile-shapes.md): 6-7% faster on full blocks, while its
#: partial blocks cost about 1.75 full ones (three warpgroups keep no line slots in
#: registers) against 1.25. It is taken where its estimate is below TALL_MARGIN of the other's.
TALL_BLOCK_SPEEDUP = 1.07
TALL_PARTIAL_BLOCK_COST = 1.75
TALL_MARGIN = 0.97
#: The tall tile is not estimated (its schedule not built) where this share of the other
#: tile's blocks or more is partial: its own share is at least as large (taller tiles cross
#: more edges), and at 0.1 its blocks alone already cost 0.98 of the other's.
TALL_MAX_PARTIAL = 0.1


def estimated_time(
    schedule: Schedule, items_per_tile: int, num_sms: int, partial_block_cost: float = PARTIAL_BLOCK_COST
) -> float:
    """Estimated kernel time (in k-block steps of one CTA) of a schedule whose q tiles each
    make `items_per_tile` work items (one per query head, or one per K/V head with PackGQA):
    the larger of the even spread over the SMs and the heaviest item. Every item's block
    costs the same MMA work (a TILE_M x TILE_N block) either way; what changes is how many
    blocks the tiles touch and how many items there are."""
    if schedule.num_work == 0:
        return 0.0
    ranges = schedule.ranges
    lengths = (ranges[:, 1] - ranges[:, 0]).astype(np.float64)
    weights = lengths * np.where(ranges[:, 2] != 0, partial_block_cost, 1.0)
    item = np.repeat(np.arange(schedule.num_work), np.diff(schedule.work_ranges))
    cost = np.bincount(item, weights=weights, minlength=schedule.num_work) + ITEM_OVERHEAD_BLOCKS
    return max(float(cost.sum()) * items_per_tile / num_sms, float(cost.max()))


def _gqa_choice(
    mask: Mask,
    num_heads_q: int,
    num_heads_kv: int,
    tile_m: int,
    tile_n: int,
    num_sms: int,
    partial_block_cost: float,
    packs: tuple[bool, ...] = (False, True),
    documents: bool = False,
) -> tuple[bool, Schedule, float]:
    """select_pack_gqa's decision for a (tile_m x tile_n) kernel among the GQA strategies
    `packs` (PackGQA or not), with the schedule it takes and that schedule's estimated time;
    `documents`: the kernels' k blocks, and the plain kernel's q tiles, start at each document."""
    g = num_heads_q // num_heads_kv

    def schedule(rows: int, packed: bool) -> Schedule:
        return build_forward_schedule(mask, rows, tile_n, documents, documents and not packed)

    if packs == (True,):
        packed_schedule = schedule(tile_m // g, True)
        return True, packed_schedule, estimated_time(packed_schedule, num_heads_kv, num_sms, partial_block_cost)
    plain_schedule = schedule(tile_m, False)
    plain = estimated_time(plain_schedule, num_heads_q, num_sms, partial_block_cost)
    if True not in packs or not pack_gqa_supported(num_heads_q, num_heads_kv) or tile_m % g:
        return False, plain_schedule, plain
    packed_schedule = schedule(tile_m // g, True)
    packed = estimated_time(packed_schedule, num_heads_kv, num_sms, partial_block_cost)
    if packed < PACK_GQA_MARGIN * plain:
        chosen = True
    else:
        # A tie in blocks: measured on an H200, PackGQA wins when the mask has partial blocks
        # (causal diagonals, document edges: 16k causal +7%, 8 causal documents +10% at 64:8)
        # and loses on all-full masks (16k full -4% at 64:8, -9% at 8:1).
        has_partial = bool((plain_schedule.ranges[:, 2] != 0).any())
        chosen = packed <= PACK_GQA_TIE * plain and has_partial
    return (True, packed_schedule, packed) if chosen else (False, plain_schedule, plain)


def select_pack_gqa(
    mask: Mask,
    num_heads_q: int,
    num_heads_kv: int,
    tile_m: int,
    tile_n: int,
    num_sms: int = DEFAULT_NUM_SMS,
    *,
    keep: bool = False,
) -> bool:
    """The GQA strategy pass: True when PackGQA (G query heads of one K/V head share an M tile
    of TILE_M / G tokens) is estimated to be faster than one query head per tile.

    It pays off when tiles of TILE_M tokens would be mostly empty or repeat K/V loads for
    little work: short query sequences (decode-like, Tq well under TILE_M, or too few tiles x
    heads to fill the SMs) and masks whose rows are short documents (a TILE_M-token tile
    spans several documents and computes their off-diagonal blocks). Decided by comparing
    `estimated_time` of the two schedules (the runtime caches the answer in mask.memo). With
    `keep`, the schedule of the strategy chosen, which is the forward's, is kept in mask.memo
    for the forward's `build_schedule` (the runtime's) to take instead of building it again.
    """
    if not pack_gqa_supported(num_heads_q, num_heads_kv):
        return False
    return select_forward(mask, num_heads_q, num_heads_kv, (tile_m, tile_n), None, num_sms, keep=keep)[1]


def select_forward(
    mask: Mask,
    num_heads_q: int,
    num_heads_kv: int,
    tiles: tuple[int, int],
    tall: tuple[int, int] | None,
    num_sms: int = DEFAULT_NUM_SMS,
    *,
    packs: tuple[bool, ...] = (False, True),
    keep: bool = False,
    documents: bool = False,
) -> tuple[bool, bool]:
    """The forward's tile shape and GQA strategy for `mask`: (tall, pack_gqa). The family's
    (tile_m, tile_n) `tiles` take the GQA strategy select_pack_gqa would among `packs` (one
    where the caller fixed it), its `tall` shape (None: it has none) the same strategy; the
    tall shape is chosen where its estimated time, in query-key elements at its block speed,
    is below TALL_MARGIN of the other's: masks made of long items of full blocks (full,
    causal), not those with many partial blocks (windows, short documents; from
    TALL_MAX_PARTIAL on it is not estimated). `keep` as in select_pack_gqa; `documents`: the
    kernels' k blocks, and the plain kernels' q tiles, start at each document (the family's
    `document_tiles`)."""
    packed, schedule, time = _gqa_choice(
        mask, num_heads_q, num_heads_kv, *tiles, num_sms, PARTIAL_BLOCK_COST, packs, documents
    )
    chosen = (False, packed, schedule)
    if tall is not None and schedule.partial_share() < TALL_MAX_PARTIAL:
        _, tall_schedule, tall_time = _gqa_choice(
            mask, num_heads_q, num_heads_kv, *tall, num_sms, TALL_PARTIAL_BLOCK_COST, (packed,), documents
        )
        if tall_time * tall[0] * tall[1] / TALL_BLOCK_SPEEDUP < TALL_MARGIN * time * tiles[0] * tiles[1]:
            chosen = (True, packed, tall_schedule)
    if keep:  # for the runtime's build_forward_schedule to take
        s = chosen[2]
        keep_schedule(mask, s, *forward_key(s.tile_m, s.tile_n, documents, documents and not packed))
    return chosen[0], chosen[1]
