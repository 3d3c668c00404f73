"""Rewrite a union of slices as an equivalent set of non-overlapping slices.

Slices whose row spans overlap no other slice are already disjoint and are only trimmed
(vectorised). Each group of row-overlapping slices is resolved exactly by a sweep: cut the
group's rows wherever the relative order of two interval ends can change, so that inside a
band the union on every row is the same set of intervals, each bounded by one of the input
lines; then merge vertically adjacent pieces that continue the same lines.
"""

from __future__ import annotations

import numpy as np

from maskc.ir.slices import RowLines

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


def normalize_arrays(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray) -> Arrays:
    """Non-overlapping slices, sorted by (q start, k start), covering exactly the same pairs."""
    lines = RowLines.of(q_ranges, k_ranges, types)
    lines = lines.take(np.flatnonzero(lines.nonempty()))
    lines = lines.take(np.argsort(lines.r0, kind="stable"))
    n = lines.r0.shape[0]
    if n == 0:
        empty = np.zeros((0, 2), np.int64)
        return empty, empty.copy(), np.zeros(0, np.int64)
    reach = np.maximum.accumulate(lines.r1)
    group = np.concatenate([[0], np.cumsum(lines.r0[1:] >= reach[:-1])])
    sizes = np.bincount(group)
    parts = [lines.take(np.flatnonzero(sizes[group] == 1))]
    for g in np.flatnonzero(sizes > 1):
        parts.append(_union_of_group(lines.take(np.flatnonzero(group == g))))
    merged = RowLines.join(parts)
    q, k, t = merged.to_slices()
    order = np.lexsort((k[:, 0], q[:, 0]))
    return q[order], k[order], t[order]


def _band_cuts(lines: RowLines) -> np.ndarray:
    """Rows where some pair of interval ends (lo, or hi + 1) may change relative order."""
    a = np.concatenate([lines.lo_a, lines.hi_a + 1])
    s = np.concatenate([lines.lo_s, lines.hi_s])
    r0 = np.tile(lines.r0, 2)
    r1 = np.tile(lines.r1, 2)
    ds = s[:, None] - s[None, :]
    da = a[None, :] - a[:, None]
    lo = np.maximum(r0[:, None], r0[None, :])
    hi = np.minimum(r1[:, None], r1[None, :])
    crossing = (ds != 0) & (lo < hi)
    # Lines of slopes differing by one meet at one row: isolate that row.
    at = da[crossing] * ds[crossing]
    cuts = np.concatenate([lines.r0, lines.r1, at, at + 1])
    return np.unique(np.clip(cuts, lines.r0.min(), lines.r1.max()))


def _union_of_group(lines: RowLines) -> RowLines:
    cuts = _band_cuts(lines)
    pieces: list[list[int]] = []
    # Pieces of the previous band, by their (lo, hi) on its last row and extended one row down.
    by_last: dict[tuple[int, int], int] = {}
    by_next: dict[tuple[int, int], int] = {}
    for c0, c1 in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        active = np.flatnonzero((lines.r0 <= c0) & (lines.r1 > c0))
        band: list[int] = []
        lo = lines.lo_a[active] + lines.lo_s[active] * c0
        hi = lines.hi_a[active] + lines.hi_s[active] * c0
        order = np.lexsort((-hi, lo))
        run: list[int] = []
        top = 0
        for pos in order.tolist():
            if run and lo[pos] <= top + 1:
                if hi[pos] > top:
                    run[1], top = int(active[pos]), int(hi[pos])
                continue
            if run:
                band.append(_place(pieces, by_last, by_next, lines, c0, c1, *run))
            run, top = [int(active[pos]), int(active[pos])], int(hi[pos])
        if run:
            band.append(_place(pieces, by_last, by_next, lines, c0, c1, *run))
        by_last = {(_at(pieces[i], 2, c1 - 1), _at(pieces[i], 4, c1 - 1)): i for i in band}
        by_next = {(_at(pieces[i], 2, c1), _at(pieces[i], 4, c1)): i for i in band}
    table = np.array(pieces, dtype=np.int64).reshape(-1, 6)
    return RowLines(*(table[:, i] for i in range(6)))


def _at(piece: list[int], line: int, row: int) -> int:
    """Value on `row` of a piece's lo line (line=2) or hi line (line=4)."""
    return piece[line] + piece[line + 1] * row


def _place(
    pieces: list[list[int]],
    by_last: dict[tuple[int, int], int],
    by_next: dict[tuple[int, int], int],
    lines: RowLines,
    c0: int,
    c1: int,
    lo_idx: int,
    hi_idx: int,
) -> int:
    """Add rows [c0, c1) bounded by the given lines; extend the piece just above when one pair of lines covers both."""
    new = [c0, c1, int(lines.lo_a[lo_idx]), int(lines.lo_s[lo_idx]), int(lines.hi_a[hi_idx]), int(lines.hi_s[hi_idx])]
    above = by_next.get((_at(new, 2, c0), _at(new, 4, c0)))
    if above is not None and all(_at(pieces[above], f, c1 - 1) == _at(new, f, c1 - 1) for f in (2, 4)):
        pieces[above][1] = c1
        return above
    above = by_last.get((_at(new, 2, c0 - 1), _at(new, 4, c0 - 1)))
    if above is not None:
        old = pieces[above]
        if all(_at(old, f, old[0]) == _at(new, f, old[0]) for f in (2, 4)):
            pieces[above] = [old[0], c1, *new[2:]]
            return above
    pieces.append(new)
    return len(pieces) - 1
