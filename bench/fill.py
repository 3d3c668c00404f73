"""What whole tiles allow on the benchmark masks: of the elements in the tiles a mask touches,
the share it keeps, for the SM90 kernels' tiles at every head dim (the forward's tile and GQA
strategy as maskc chooses them, 16 tokens a tile under PackGQA at 64:8 heads; the backward's),
at 64:8 heads or those `--heads` names.
A kernel computes whole tiles, so its TFLOP/s on a mask, counted on the kept elements, is at
most that share of its speed on full tiles: where the share is near 92%, reaching 92% of the
full mask's TFLOP/s asks partial blocks to cost no more than full ones.

The kernels' k blocks (forward), k tiles and q blocks (backward) start at each document
(`maskc.ir.schedule.document_tiles`), and so do the forward's q tiles but under PackGQA.

Runs anywhere, in seconds: `python bench/fill.py [--seqlens 16384,65536] [--heads 64:64]`. It
prints a table and writes no rows: the shares follow from the schedules, nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from kernel import HKV, HQ, MASKS, build_masks, parse_heads  # noqa: E402

from maskc.artifact.kernel_families import HEAD_DIMS, HeadDim  # noqa: E402
from maskc.ir import Mask  # noqa: E402
from maskc.ir.schedule import Schedule, build_forward_schedule, transposed_schedule  # noqa: E402
from maskc.runtime import call_plan  # noqa: E402

#: The GPU the kernels are planned for: an H100 / H200 (sm_90a, 132 SMs).
CAPABILITY, NUM_SMS = (9, 0), 132


def kept_share(mask: Mask, schedule: Schedule) -> float:
    """The share of the elements of `schedule`'s blocks that `mask` keeps."""
    return mask.area() / (int(schedule.blocks_per_item().sum()) * schedule.tile_m * schedule.tile_n)


def target(head_dim: HeadDim, heads: tuple[int, int] = (HQ, HKV)) -> call_plan.Target:
    """The calls the table is for: bf16 `heads` of `head_dim`, no options."""
    return call_plan.make_target(CAPABILITY, NUM_SMS, torch.bfloat16, *heads, head_dim, False, False, False, None, False)


def schedule(mask: Mask, target: call_plan.Target, request: dict) -> Schedule:
    """The schedule of the kernel the runtime picks for `request` (`call_plan.forward_requests` or
    `call_plan.backward_requests`), with its launch shape (tokens a tile under PackGQA) and its tiles
    per document."""
    shape = call_plan.launch_shape_of(target, request)
    if request["direction"] == "bwd":
        return transposed_schedule(mask, shape.tile_m, shape.tile_n, key_documents=shape.document_tiles,
                                   query_documents=shape.document_tiles)  # fmt: skip
    return build_forward_schedule(mask, shape.tile_m, shape.tile_n, shape.document_tiles, shape.document_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="16384,65536", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=parse_heads, default=[(HQ, HKV)],
                        help="HQ:HKV of the calls (default 64:8; one pair)")  # fmt: skip
    args = parser.parse_args()
    if len(args.heads) != 1:
        parser.error("--heads takes one HQ:HKV pair")
    targets = {d: target(d, args.heads[0]) for d in HEAD_DIMS}
    print("| seqlen | mask | " + " | ".join(f"d={d} fwd / bwd" for d in targets) + " |")
    print("|---:|---|" + "---|" * len(targets))
    for seqlen in map(int, args.seqlens.split(",")):
        masks, _ = build_masks(seqlen)
        for name in MASKS:
            mask = masks[name]
            cells = []
            for t in targets.values():
                fwd, bwd = (kept_share(mask, schedule(mask, t, requests(mask, t)[0]))
                            for requests in (call_plan.forward_requests, call_plan.backward_requests))  # fmt: skip
                cells.append(f"{fwd:.3f} / {bwd:.3f}")
            print(f"| {seqlen} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
