"""AttnSlice, the unit of the IR, and the vectorised geometry every pass shares.

A slice covers, on each of its rows, one contiguous interval of keys whose ends move by
0 or 1 column per row. That "row-line" form (`RowLines`) is what normalisation, dense
materialisation and area computations work on, so the four mask types are defined once,
here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np

from maskc.errors import MaskError
from maskc.limits import MAX_TOKENS

AttnType = Literal["full", "causal", "inv_causal", "bi_causal"]
TYPE_NAMES: tuple[str, ...] = ("full", "causal", "inv_causal", "bi_causal")
TYPE_IDS: dict[str, int] = {name: i for i, name in enumerate(TYPE_NAMES)}
FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = range(4)


def type_id(t: str | int) -> int:
    """Type id of a type name or id, with a clear error for anything else."""
    if isinstance(t, str):
        if t not in TYPE_IDS:
            raise MaskError(f"unknown slice type {t!r}; expected one of {', '.join(TYPE_NAMES)}")
        return TYPE_IDS[t]
    if isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= int(t) < len(TYPE_NAMES):
        return int(t)
    raise MaskError(f"unknown slice type {t!r}; expected a name ({', '.join(TYPE_NAMES)}) or an id 0..3")


def _range_pair(value: object, what: str) -> tuple[int, int]:
    try:
        start, end = value  # type: ignore[misc]
    except (TypeError, ValueError):
        raise MaskError(f"{what} range must be a (start, end) pair, got {value!r}") from None
    for x in (start, end):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise MaskError(f"{what} range must hold integers, got {value!r}")
    start, end = int(start), int(end)
    if start < 0 or end < 0:
        raise MaskError(f"{what} range ({start}, {end}) is negative")
    if start > end:
        raise MaskError(f"{what} range ({start}, {end}) is reversed (start > end)")
    if end > MAX_TOKENS:
        raise MaskError(f"{what} range ({start}, {end}) ends past {MAX_TOKENS:,} tokens, the longest sequence maskc supports")
    return start, end


@dataclass(frozen=True)
class AttnSlice:
    """Queries q=[qs, qe) attend keys k=[ks, ke) with one of four shapes (see DESIGN.md)."""

    q: tuple[int, int]
    k: tuple[int, int]
    type: AttnType = "full"

    def __post_init__(self) -> None:
        object.__setattr__(self, "q", _range_pair(self.q, "q"))
        object.__setattr__(self, "k", _range_pair(self.k, "k"))
        object.__setattr__(self, "type", TYPE_NAMES[type_id(self.type)])

    @property
    def type_id(self) -> int:
        return TYPE_IDS[self.type]

    def area(self) -> int:
        """Exact number of (query, key) pairs this slice allows."""
        lq = np.array([self.q[1] - self.q[0]])
        lk = np.array([self.k[1] - self.k[0]])
        return int(slice_areas(lq, lk, np.array([self.type_id]))[0])


def slice_areas(lq: np.ndarray, lk: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Per-slice areas (int64) from lengths and type ids, the closed forms of the mask
    semantics; exact for lengths up to MAX_TOKENS (every product stays below 2**63)."""
    lq = lq.astype(np.int64)
    lk = lk.astype(np.int64)
    tri = np.where(lk > lq, (2 * lk - lq + 1) * lq // 2, (1 + lk) * lk // 2)
    tri = np.where(lq == 0, 0, tri)
    band = np.maximum(0, lk - lq + 1) * lq
    band = np.where(lk == 0, 0, band)
    return np.select([types == FULL, types == BI_CAUSAL], [lq * lk, band], tri)


@dataclass(frozen=True)
class RowLines:
    """Slices as row spans [r0, r1) whose key interval on row r is [lo_a + lo_s*r, hi_a + hi_s*r].

    Rows of a slice that allow no key are trimmed away (r0 == r1 when the slice is empty);
    all coordinates are global. Slopes are 0 or 1.
    """

    r0: np.ndarray
    r1: np.ndarray
    lo_a: np.ndarray
    lo_s: np.ndarray
    hi_a: np.ndarray
    hi_s: np.ndarray

    @staticmethod
    def of(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray) -> RowLines:
        q_ranges = np.asarray(q_ranges, dtype=np.int64).reshape(-1, 2)
        k_ranges = np.asarray(k_ranges, dtype=np.int64).reshape(-1, 2)
        types = np.asarray(types, dtype=np.int64).reshape(-1)
        qs, qe = q_ranges[:, 0], q_ranges[:, 1]
        ks, ke = k_ranges[:, 0], k_ranges[:, 1]
        lk = ke - ks
        lo_moves = (types == INV_CAUSAL) | (types == BI_CAUSAL)
        hi_moves = (types == CAUSAL) | (types == BI_CAUSAL)
        lo_s = lo_moves.astype(np.int64)
        hi_s = hi_moves.astype(np.int64)
        lo_a = np.where(lo_moves, ks - qs, ks)
        hi_a = np.where(hi_moves, ke - qe, ke - 1)
        # Trim rows that allow no key: causal loses top rows, inv_causal bottom rows.
        r0 = np.where(types == CAUSAL, np.maximum(qs, qe - lk), qs)
        r1 = np.where(types == INV_CAUSAL, np.minimum(qe, qs + lk), qe)
        empty = (lk <= 0) | ((types == BI_CAUSAL) & (lk < qe - qs)) | (r1 <= r0)
        r1 = np.where(empty, r0, r1)
        return RowLines(r0, r1, lo_a, lo_s, hi_a, hi_s)

    def nonempty(self) -> np.ndarray:
        return self.r1 > self.r0

    @staticmethod
    def join(parts: Sequence[RowLines]) -> RowLines:
        """The lines of every part, in order."""
        return RowLines(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(RowLines)))

    def take(self, index: np.ndarray) -> RowLines:
        return RowLines(*(x[index] for x in (self.r0, self.r1, self.lo_a, self.lo_s, self.hi_a, self.hi_s)))

    def transposed(self) -> RowLines:
        """The same pairs with rows and keys swapped (of non-empty lines), at most 3 pieces each.

        Key column c of a line is covered by rows [max(r0, c - hi_a), min(r1 - 1, c - lo_a)]
        (the max only when the hi end moves, the min only when the lo end does); the columns
        split where either bound stops being clipped, and every column in between is covered.
        """
        c0 = self.lo_a + self.lo_s * self.r0
        c1 = self.hi_a + self.hi_s * (self.r1 - 1) + 1
        # First column whose row range starts after r0 (hi end moving), and first whose row
        # range ends at r1 - 1 (lo end moving); outside [c0, c1) when that never happens.
        s1 = np.where(self.hi_s == 1, self.r0 + self.hi_a + 1, c1)
        s2 = np.where(self.lo_s == 1, self.r1 + self.lo_a, c0)
        cuts = np.sort(np.stack([np.clip(s1, c0, c1), np.clip(s2, c0, c1)]), axis=0)
        starts = np.concatenate([c0, cuts[0], cuts[1]])
        ends = np.concatenate([cuts[0], cuts[1], c1])
        r0, r1 = np.tile(self.r0, 3), np.tile(self.r1, 3)
        lo_moves = (np.tile(self.hi_s, 3) == 1) & (starts >= np.tile(s1, 3))
        hi_moves = (np.tile(self.lo_s, 3) == 1) & (starts < np.tile(s2, 3))
        lines = RowLines(
            starts,
            ends,
            np.where(lo_moves, -np.tile(self.hi_a, 3), r0),
            lo_moves.astype(np.int64),
            np.where(hi_moves, -np.tile(self.lo_a, 3), r1 - 1),
            hi_moves.astype(np.int64),
        )
        return lines.take(np.flatnonzero(lines.nonempty()))

    def cropped(self, q0, q1, k0, k1) -> tuple[RowLines, np.ndarray]:
        """The same pairs restricted to rows [q0, q1) and keys [k0, k1) (ints, or one bound per
        line), at most 3 pieces per line, with the index of the line each piece comes from.

        A moving lo end is held at k0 on the rows before k0 - lo_a, a moving hi end at k1 - 1
        from row k1 - hi_a on; cut there, both ends are again lines in each piece, and the rows
        where lo > hi (a prefix or a suffix of the piece) are trimmed away.
        """
        k0, k1 = np.broadcast_to(k0, self.r0.shape), np.broadcast_to(k1, self.r0.shape)
        r0 = np.maximum(self.r0, q0)
        r1 = np.maximum(np.minimum(self.r1, q1), r0)
        s1 = np.where(self.lo_s == 1, k0 - self.lo_a, r0)
        s2 = np.where(self.hi_s == 1, k1 - self.hi_a, r1)
        cuts = np.sort(np.stack([np.clip(s1, r0, r1), np.clip(s2, r0, r1)]), axis=0)
        # Piece p of line i at 3 * i + p, so each line's pieces stay together, in line order.
        starts = np.stack([r0, cuts[0], cuts[1]], 1).ravel()
        ends = np.stack([cuts[0], cuts[1], r1], 1).ravel()
        lo_a, lo_s, hi_a, hi_s, k0, k1, s1, s2 = (
            np.repeat(x, 3) for x in (self.lo_a, self.lo_s, self.hi_a, self.hi_s, k0, k1, s1, s2)
        )
        lo_moves = (lo_s == 1) & (starts >= s1)
        hi_moves = (hi_s == 1) & (starts < s2)
        lo_a = np.where(lo_moves, lo_a, np.maximum(lo_a + lo_s * starts, k0))
        hi_a = np.where(hi_moves, hi_a, np.minimum(hi_a + hi_s * starts, k1 - 1))
        # hi - lo on row r is width + slope * r.
        width, slope = hi_a - lo_a, hi_moves.astype(np.int64) - lo_moves
        starts = np.where(slope == 1, np.maximum(starts, -width), starts)
        ends = np.where(slope == -1, np.minimum(ends, width + 1), np.where((slope == 0) & (width < 0), starts, ends))
        lines = RowLines(starts, ends, lo_a, lo_moves.astype(np.int64), hi_a, hi_moves.astype(np.int64))
        kept = np.flatnonzero(lines.nonempty())
        return lines.take(kept), kept // 3

    def to_slices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slices (q_ranges, k_ranges, types) exactly covering these (non-empty) row lines.

        A one-row span is always written as a full slice: its slopes carry no meaning.
        """
        single = (self.r1 - self.r0) == 1
        lo_s = np.where(single, 0, self.lo_s)
        hi_s = np.where(single, 0, self.hi_s)
        first_lo = self.lo_a + self.lo_s * self.r0
        last_hi = self.hi_a + self.hi_s * (self.r1 - 1)
        types = np.select(
            [(lo_s == 0) & (hi_s == 0), (lo_s == 0) & (hi_s == 1), (lo_s == 1) & (hi_s == 0)],
            [FULL, CAUSAL, INV_CAUSAL],
            BI_CAUSAL,
        )
        q_ranges = np.stack([self.r0, self.r1], axis=1)
        k_ranges = np.stack([first_lo, last_hi + 1], axis=1)
        return q_ranges, k_ranges, types.astype(np.int64)


def ragged_expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For per-parent element counts, each child's parent index and its index within the parent."""
    counts = np.asarray(counts, dtype=np.int64)
    parent = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    offsets = np.cumsum(counts) - counts
    local = np.arange(parent.size, dtype=np.int64) - offsets[parent]
    return parent, local


def expand_spans(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For inclusive integer spans [first, last], each element's span index and value (vectorised)."""
    owner, local = ragged_expand(np.maximum(last - first + 1, 0))
    return owner, first[owner] + local


def band_lines(qs, qe, ks, ke, left, right) -> tuple[RowLines, np.ndarray]:
    """Bands as at most three row lines each, with the index of each line's band.

    Row i of a band over q=[qs, qe), k=[ks, ke) has its diagonal at local key
    i + (Lk - Lq) (bottom-right aligned, like causal) and allows keys from `left` before to
    `right` after the diagonal, clipped to the key range. Rows clipped only on the left form
    a causal slice, rows clipped only on the right an inv_causal one, rows clipped on both a
    full one and unclipped rows a bi_causal one; since both window ends move one key per row,
    at most three of these four groups are non-empty. Each band's lines stay together, in
    band order.
    """
    qs, qe, ks, ke, left, right = (np.asarray(x, dtype=np.int64) for x in (qs, qe, ks, ke, left, right))
    qs, qe, ks, ke, left, right = np.broadcast_arrays(qs, qe, ks, ke, left, right)
    if np.any(left < 0) or np.any(right < 0):
        raise MaskError("band window sizes (left, right) must be >= 0")
    # Global window of row r: [r + off - left, r + off + right] with off = ke - qe.
    off = ke - qe
    # Rows whose window reaches the key range at all.
    row_lo = np.maximum(qs, ks - off - right)
    row_hi = np.minimum(qe, ke - off + left)
    # First row whose window starts inside the range, first row whose window ends past it.
    left_free = np.clip(ks - off + left, row_lo, row_hi)
    right_clip = np.clip(ke - off - right, row_lo, row_hi)
    a, b = np.minimum(left_free, right_clip), np.maximum(left_free, right_clip)
    middle_is_full = right_clip < left_free
    zeros, ones = np.zeros_like(qs), np.ones_like(qs)

    def pieces(*columns: np.ndarray) -> np.ndarray:
        """Piece p of band i at 3 * i + p."""
        return np.stack(columns, 1).ravel()

    lines = RowLines(
        pieces(row_lo, a, b),
        pieces(a, b, row_hi),
        pieces(ks, np.where(middle_is_full, ks, off - left), off - left),
        pieces(zeros, np.where(middle_is_full, 0, 1), ones),
        pieces(off + right, np.where(middle_is_full, ke - 1, off + right), ke - 1),
        pieces(ones, np.where(middle_is_full, 0, 1), zeros),
    )
    kept = np.flatnonzero(lines.nonempty() & np.repeat(ks < ke, 3))
    return lines.take(kept), kept // 3


def band_slices(qs, qe, ks, ke, left, right) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decompose bands into at most three slices each (causal, bi_causal/full, inv_causal), in
    band order; see `band_lines`."""
    return band_lines(qs, qe, ks, ke, left, right)[0].to_slices()
