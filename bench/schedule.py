"""Time the forward and backward tile schedules of 1M-token masks (they run whenever the mask changes).

Run: `python bench/schedule.py [--runs 20]`; appends host rows to bench/results (or --out; see
bench/README.md) and prints them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import sample_doc_lengths  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402

from maskc.ir import Mask  # noqa: E402
from maskc.ir.schedule import build_backward_schedule, build_schedule  # noqa: E402

TOTAL = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args()
    run = Run.start("schedule", cpu_device(), args.out)
    cu = np.r_[0, np.cumsum(sample_doc_lengths(TOTAL, 4000))]
    masks = {
        "full": Mask.from_cu_seqlens([0, TOTAL]),
        "causal": Mask.from_cu_seqlens([0, TOTAL], causal=True),
        "varlen causal": Mask.from_cu_seqlens(cu, causal=True),
        "varlen sliding window 1024": Mask.sliding_window(cu, 1024),
        "sliding window 1024 + 64 global": Mask.sliding_window([0, TOTAL], 1024).with_global_tokens(64),
    }
    print(f"{'mask (1M tokens, 128x128 tiles)':34} {'fwd median ms':>14} {'bwd median ms':>14} {'items':>6} {'fwd runs':>9} {'lines':>7}")
    for name, mask in masks.items():
        # The backward's as the runtime builds it on an H100/H200 (132 CTAs) for 64:8 heads,
        # its items dealt to the CTAs (and split by query head where that balances them) included.
        times = {build_schedule: [], build_backward_schedule: []}
        params = {build_schedule: (128, 128), build_backward_schedule: (64, 128, 8, 132, 8)}
        for _ in range(args.runs):
            for build in times:
                fresh = Mask.from_arrays(mask.q_ranges, mask.k_ranges, mask.types, *mask.shape)
                start = time.perf_counter()
                build(fresh, *params[build])
                times[build].append((time.perf_counter() - start) * 1e3)
        fwd = build_schedule(mask, 128, 128)
        median = {build: statistics.median(times[build]) for build in times}
        print(f"{name:34} {median[build_schedule]:14.2f} {median[build_backward_schedule]:14.2f} {fwd.num_work:6} {len(fwd.ranges):9} {len(fwd.lines):7}")
        run.write("host", step=f"forward tile schedule, {name} (1M tokens, 128x128 tiles)", ms=median[build_schedule])
        run.write(
            "host",
            step=f"backward tile schedule and item deal, {name} (1M tokens, 64x128 tiles, 64:8 heads, 132 CTAs)",
            ms=median[build_backward_schedule],
        )


if __name__ == "__main__":
    main()
