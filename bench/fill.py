"""What whole tiles allow on the benchmark masks: of the elements in the tiles a mask touches,
the share it keeps, for the SM90 kernels' tiles at every head dim (the forward's tile and GQA
strategy as maskc chooses them, 16 tokens a tile under PackGQA at 64:8 heads; the backward's).
A kernel computes whole tiles, so its TFLOP/s on a mask, counted on the kept elements, is at
most that share of its speed on full tiles: where the share is near 92%, reaching 92% of the
full mask's TFLOP/s asks partial blocks to cost no more than full ones.

Runs anywhere, in seconds: `python bench/fill.py [--seqlens 16384,65536]`. It prints a table
and writes no rows: the shares follow from the schedules, nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel import HKV, HQ, MASKS, build_masks  # noqa: E402

from maskc.artifact.families import HEAD_DIMS, HeadDim, default_family  # noqa: E402
from maskc.ir import Mask  # noqa: E402
from maskc.ir.schedule import Schedule, build_schedule, transposed_schedule  # noqa: E402
from maskc.ir.strategy import select_forward  # noqa: E402

ARCH = "sm_90a"


def kept_share(mask: Mask, schedule: Schedule) -> float:
    """The share of the elements of `schedule`'s blocks that `mask` keeps."""
    return mask.area() / (int(schedule.blocks_per_item().sum()) * schedule.tile_m * schedule.tile_n)


def forward_schedule(mask: Mask, head_dim: HeadDim) -> Schedule:
    """The forward schedule of the tile and GQA strategy maskc picks for `mask` at `head_dim`."""
    kernel = default_family(ARCH).kernel("fwd")
    tiles, tall = kernel.tiles[head_dim], kernel.tall_tiles.get(head_dim)
    shapes = ((tiles.tile_m, tiles.tile_n), None if tall is None else (tall.tile_m, tall.tile_n))
    is_tall, packed = select_forward(mask, HQ, HKV, *shapes)
    tile_m, tile_n = shapes[1] if is_tall else shapes[0]
    return build_schedule(mask, tile_m // (HQ // HKV) if packed else tile_m, tile_n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="16384,65536", help="comma-separated sequence lengths")
    args = parser.parse_args()
    backward = default_family(ARCH).kernel("bwd")
    dims = [d for d in HEAD_DIMS if d in backward.tiles]
    print("| seqlen | mask | " + " | ".join(f"d={d} fwd / bwd" for d in dims) + " |")
    print("|---:|---|" + "---|" * len(dims))
    for seqlen in map(int, args.seqlens.split(",")):
        masks, _ = build_masks(seqlen)
        for name in MASKS:
            mask = masks[name]
            cells = []
            for d in dims:
                tiles = backward.tiles[d]
                bwd = kept_share(mask, transposed_schedule(mask, tiles.tile_m, tiles.tile_n))
                cells.append(f"{kept_share(mask, forward_schedule(mask, d)):.3f} / {bwd:.3f}")
            print(f"| {seqlen} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
