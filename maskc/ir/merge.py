"""Range merging: fewer, larger slices covering exactly the same pairs.

`Mask.normalize` already fuses slices that share rows. What it leaves apart are slices on
consecutive rows that continue the same key lines — a causal mask written block by block,
a band split per chunk. Here such chains become one slice each: fewer slices mean fewer
mask lines per tile for the kernels and smaller schedules. Vectorised: one sort and a scan.
"""

from __future__ import annotations

import numpy as np

from maskc.ir.mask import Mask
from maskc.ir.slices import RowLines


def merge_ranges(mask: Mask) -> Mask:
    """An equivalent mask with no two slices that one slice could replace along their rows."""
    norm = mask.normalize()
    lines = RowLines.of(norm.q_ranges, norm.k_ranges, norm.types)
    if len(norm) < 2:
        return norm
    order = np.lexsort((lines.r0, lines.hi_s, lines.hi_a, lines.lo_s, lines.lo_a))
    ln = lines.take(order)
    same_lines = (
        (ln.lo_a[1:] == ln.lo_a[:-1])
        & (ln.lo_s[1:] == ln.lo_s[:-1])
        & (ln.hi_a[1:] == ln.hi_a[:-1])
        & (ln.hi_s[1:] == ln.hi_s[:-1])
    )
    starts = np.r_[True, ~(same_lines & (ln.r0[1:] == ln.r1[:-1]))]
    first = np.flatnonzero(starts)
    last = np.r_[first[1:], len(order)] - 1
    merged = ln.take(first)
    merged = RowLines(merged.r0, ln.r1[last], merged.lo_a, merged.lo_s, merged.hi_a, merged.hi_s)
    q, k, t = merged.to_slices()
    keep = np.lexsort((k[:, 0], q[:, 0]))
    return Mask.from_arrays(q[keep], k[keep], t[keep], *mask.shape)
