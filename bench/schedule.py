"""Time the forward tile schedule of 1M-token masks (the pass runs every training step)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from maskc.ir import Mask
from maskc.ir.schedule import build_schedule

from common import sample_doc_lengths

TOTAL = 1 << 20


def main() -> None:
    cu = np.r_[0, np.cumsum(sample_doc_lengths(TOTAL, 4000))]
    masks = {
        "full": Mask.from_cu_seqlens([0, TOTAL]),
        "causal": Mask.from_cu_seqlens([0, TOTAL], causal=True),
        "varlen causal": Mask.from_cu_seqlens(cu, causal=True),
        "varlen sliding window 1024": Mask.sliding_window(cu, 1024),
        "sliding window 1024 + 64 global": Mask.sliding_window([0, TOTAL], 1024).with_global_tokens(64),
    }
    print(f"{'mask (1M tokens, 128x128 tiles)':34} {'median ms':>10} {'min ms':>8} {'items':>6} {'runs':>7} {'lines':>7}")
    for name, mask in masks.items():
        times = []
        for _ in range(20):
            fresh = Mask.from_arrays(mask.q_ranges, mask.k_ranges, mask.types, *mask.shape)
            start = time.perf_counter()
            s = build_schedule(fresh, 128, 128)
            times.append((time.perf_counter() - start) * 1e3)
        print(f"{name:34} {statistics.median(times):10.2f} {min(times):8.2f} {s.num_work:6} {len(s.ranges):7} {len(s.lines):7}")


if __name__ == "__main__":
    main()
