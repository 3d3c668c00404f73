"""Kernel strategy choices that depend on the problem: the tile shape, and PackGQA.

Measured on an H200 (heads 64:8, bf16, 8k-16k tokens): at d=128, 128x128 tiles with two
K/V stages (two consumer warpgroups) reach 600-690 TFLOP/s on full/causal masks, while
128x176 spills registers and drops to about 420; at d=64, 192x128 (three consumer
warpgroups) beats 128x128 by about 15% on full masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskc.errors import MaskcError
from maskc.ir.mask import Mask
from maskc.ir.schedule import Schedule, build_schedule

SUPPORTED_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class Tiles:
    tile_m: int
    tile_n: int
    num_stages: int


_SM90 = {64: Tiles(192, 128, 2), 128: Tiles(128, 128, 2)}
# Backward: k tiles of 128 keys (two consumer warpgroups, dK and dV in registers) against q
# blocks of 64 queries, two (Q, dO) stages.
_SM90_BACKWARD = Tiles(64, 128, 2)


# The SM100 kernels (experimental, never run: no Blackwell GPU here). Forward: 128 query rows
# (one TMEM lane each) against 128-key blocks; K and V share the stages (P lives in tensor
# memory). Backward: k tiles of 128 keys (TMEM lanes) against q blocks of 128 queries, two
# (Q, dO) stages; dK, dV, S^T, dP^T / dQ fill the 512 TMEM columns at d=128.
_SM100 = {64: Tiles(128, 128, 4), 128: Tiles(128, 128, 3)}
_SM100_BACKWARD = Tiles(128, 128, 2)


# The portable kernel (four warps of 16 rows): 64-key blocks at d=128 (S and O in registers
# side by side), 128 at d=64.
PORTABLE_TILE_M = 64
_PORTABLE = {64: Tiles(PORTABLE_TILE_M, 128, 2), 128: Tiles(PORTABLE_TILE_M, 64, 2)}
# Its backward: k tiles of 64 keys (four warps of 16, dK and dV in registers) against q blocks of
# 64 queries, one (Q, dO) stage.
PORTABLE_BACKWARD = Tiles(64, 64, 1)


def select_tiles(arch: str, head_dim: int, direction: str = "fwd", portable: bool = False) -> Tiles:
    """Tile shape of the `direction` kernel for `arch` and `head_dim` (backward: tile_m is the
    q block, tile_n the k tile), the arch's own kernel or the portable one."""
    if head_dim not in _SM90:
        raise MaskcError(f"head_dim {head_dim} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")
    if portable:
        return PORTABLE_BACKWARD if direction == "bwd" else _PORTABLE[head_dim]
    if arch == "sm_90a":
        return _SM90_BACKWARD if direction == "bwd" else _SM90[head_dim]
    if arch == "sm_100a":
        return _SM100_BACKWARD if direction == "bwd" else _SM100[head_dim]
    raise MaskcError(f"no kernel of its own for arch {arch!r} (sm_90a and sm_100a have them); use the portable kernel")


# ---- GQA strategy selection (PackGQA) ---------------------------------------------------------

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


def pack_gqa_supported(num_heads_q: int, num_heads_kv: int, warpgroup_rows: int = 64) -> bool:
    """Whether a PackGQA kernel exists for these heads: G = Hq / Hkv a power of two in [2, 64]."""
    if num_heads_kv <= 0 or num_heads_q % num_heads_kv:
        return False
    g = num_heads_q // num_heads_kv
    return 2 <= g <= warpgroup_rows and not g & (g - 1)


def estimated_time(schedule: Schedule, items_per_tile: int, num_sms: int) -> float:
    """Estimated kernel time (in k-block steps of one CTA) of a schedule whose q tiles each
    make `items_per_tile` work items (one per query head, or one per K/V head with PackGQA):
    the larger of the even spread over the SMs and the heaviest item. Every item's block
    costs the same MMA work (a TILE_M x TILE_N block) either way; what changes is how many
    blocks the tiles touch and how many items there are."""
    if schedule.num_work == 0:
        return 0.0
    ranges = schedule.ranges
    lengths = (ranges[:, 1] - ranges[:, 0]).astype(np.float64)
    weights = lengths * np.where(ranges[:, 2] != 0, PARTIAL_BLOCK_COST, 1.0)
    item = np.repeat(np.arange(schedule.num_work), np.diff(schedule.work_ranges))
    cost = np.bincount(item, weights=weights, minlength=schedule.num_work) + ITEM_OVERHEAD_BLOCKS
    return max(float(cost.sum()) * items_per_tile / num_sms, float(cost.max()))


def select_pack_gqa(
    mask: Mask, num_heads_q: int, num_heads_kv: int, tile_m: int, tile_n: int, num_sms: int = DEFAULT_NUM_SMS
) -> bool:
    """The GQA strategy pass: True when PackGQA (G query heads of one K/V head share an M tile
    of TILE_M / G tokens) is estimated to be faster than one query head per tile.

    It pays off when tiles of TILE_M tokens would be mostly empty or repeat K/V loads for
    little work: short query sequences (decode-like, Tq well under TILE_M, or too few tiles x
    heads to fill the SMs) and masks whose rows are short documents (a TILE_M-token tile
    spans several documents and computes their off-diagonal blocks). Decided by comparing
    `estimated_time` of the two schedules (the runtime caches the answer in mask.memo).
    """
    if not pack_gqa_supported(num_heads_q, num_heads_kv):
        return False
    g = num_heads_q // num_heads_kv
    if tile_m % g:
        return False
    plain_schedule = build_schedule(mask, tile_m, tile_n)
    plain = estimated_time(plain_schedule, num_heads_q, num_sms)
    packed = estimated_time(build_schedule(mask, tile_m // g, tile_n), num_heads_kv, num_sms)
    if packed < PACK_GQA_MARGIN * plain:
        return True
    # A tie in blocks: measured on an H200, PackGQA wins when the mask has partial blocks
    # (causal diagonals, document edges: 16k causal +7%, 8 causal documents +10% at 64:8)
    # and loses on all-full masks (16k full -4% at 64:8, -9% at 8:1).
    has_partial = bool((plain_schedule.ranges[:, 2] != 0).any())
    return packed <= PACK_GQA_TIE * plain and has_partial
