"""Slice emission shared by both fronts: primitives, the band/prefix-LM sugar, chunking.

Every emitting call hands whole numpy arrays of ranges to a `SliceBuffer`, which checks
them (naming the call site it is given), drops empty slices and builds the Mask at the end,
so the DSL and the Python front produce identical IR through one code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskc.errors import MaskError
from maskc.ir import TYPE_IDS, Mask, band_slices
from maskc.ir.slices import ragged_expand
from maskc.limits import MAX_ROWS, MAX_TOKENS, check_count

RangeArrays = tuple[np.ndarray, np.ndarray]


def split_chunks(
    starts: np.ndarray, ends: np.ndarray, size: np.ndarray, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive sub-ranges of `size` tokens of each range (the last one shorter): (parent, starts, ends)."""
    arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (starts, ends, size)))
    starts, ends, size = (np.atleast_1d(x) for x in arrays)
    bad = size <= 0
    if bad.any():
        raise MaskError(f"{where}: chunk size must be positive, got {int(size[bad][0])}")
    _check_ranges(where, "chunked", starts, ends)
    parent, local = ragged_expand(check_rows(-((starts - ends) // size), where))
    cstarts = starts[parent] + local * size[parent]
    return parent, cstarts, np.minimum(cstarts + size[parent], ends[parent])


def check_rows(counts: np.ndarray, where: str) -> np.ndarray:
    """`counts` (elements per row of a loop, chunks per range), refused before anything is
    expanded where their total passes MAX_ROWS; each is checked before the sum, which cannot
    overflow then."""
    largest = int(counts.max(initial=0))
    total = largest if largest > MAX_ROWS else int(counts.sum())
    check_count(total, MAX_ROWS, f"{where}: iterations", MaskError)
    return counts


@dataclass
class SliceBuffer:
    """Collects the sequence lengths and the emitted slices as arrays, each batch tagged with its
    call site for later errors."""

    _batches: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    _count: int = 0
    seqlen: tuple[int, int] | None = None
    seqlen_site: str = ""

    def declare_seqlen(self, q: int, k: int, where: str) -> None:
        """Fix the mask's size; once per mask."""
        if self.seqlen is not None:
            raise MaskError(f"{where}: seqlen() called twice (first at {self.seqlen_site})")
        self.seqlen, self.seqlen_site = (q, k), where

    def add(self, kind: str, q: RangeArrays, k: RangeArrays, where: str) -> None:
        """Emit one primitive slice per row of the (broadcast) q and k range arrays."""
        qs, qe, ks, ke = _ranges(q, k)
        _check_ranges(where, "q", qs, qe)
        _check_ranges(where, "k", ks, ke)
        self._append(where, qs, qe, ks, ke, np.full(qs.shape, TYPE_IDS[kind], dtype=np.int64))

    def band(self, q: RangeArrays, k: RangeArrays, left: np.ndarray, right: np.ndarray, where: str) -> None:
        """A window of `left` keys before and `right` after the bottom-right aligned diagonal."""
        qs, qe, ks, ke = _ranges(q, k)
        _check_ranges(where, "q", qs, qe)
        _check_ranges(where, "k", ks, ke)
        left, right = np.broadcast_to(left, qs.shape), np.broadcast_to(right, qs.shape)
        for name, size in (("left", left), ("right", right)):
            if (size < 0).any():
                raise MaskError(f"{where}: {name} must be >= 0, got {int(size[size < 0][0])}")
        keep = (qs < qe) & (ks < ke)
        if not keep.all():
            qs, qe, ks, ke, left, right = (x[keep] for x in (qs, qe, ks, ke, left, right))
        if qs.size:
            q_ranges, k_ranges, types = band_slices(qs, qe, ks, ke, left, right)
            self._append(where, q_ranges[:, 0], q_ranges[:, 1], k_ranges[:, 0], k_ranges[:, 1], types)

    def prefix_lm(self, seq: RangeArrays, prefix: np.ndarray, where: str) -> None:
        """The first `prefix` tokens of each range see each other; the rest are causal over the range."""
        s, e = (np.asarray(x, dtype=np.int64) for x in seq)
        s, e, prefix = np.broadcast_arrays(s, e, np.asarray(prefix, dtype=np.int64))
        _check_ranges(where, "seq", s, e)
        if (prefix < 0).any():
            raise MaskError(f"{where}: prefix must be >= 0, got {int(prefix[prefix < 0][0])}")
        p = np.minimum(s + prefix, e)
        self.add("full", (s, p), (s, p), where)
        self.add("causal", (p, e), (s, e), where)

    def build(self) -> Mask:
        """Check every batch against the declared sequence lengths and build the Mask."""
        assert self.seqlen is not None, "the fronts make sure seqlen() was called"
        (seqlen_q, seqlen_k), where = self.seqlen, self.seqlen_site
        for name, value in (("q", seqlen_q), ("k", seqlen_k)):
            if value < 0:
                raise MaskError(f"{where}: {name} must be >= 0, got {value}")
            check_count(value, MAX_TOKENS, f"{where}: {name} tokens")
        for site, qs, qe, ks, ke, _ in self._batches:
            for side, s, e, limit in (("q", qs, qe, seqlen_q), ("k", ks, ke, seqlen_k)):
                bad = e > limit
                if bad.any():
                    i = int(np.argmax(bad))
                    raise MaskError(f"{site}: {side} range {s[i]}:{e[i]} ends past seqlen {side}={limit}")
        if self._batches:
            qs, qe, ks, ke, types = (np.concatenate(cols) for cols in list(zip(*self._batches))[1:])
        else:
            qs = qe = ks = ke = types = np.zeros(0, dtype=np.int64)
        return Mask.from_arrays(np.stack([qs, qe], 1), np.stack([ks, ke], 1), types, seqlen_q, seqlen_k)

    def _append(
        self, where: str, qs: np.ndarray, qe: np.ndarray, ks: np.ndarray, ke: np.ndarray, types: np.ndarray
    ) -> None:
        keep = (qs < qe) & (ks < ke)
        if not keep.all():
            qs, qe, ks, ke, types = (x[keep] for x in (qs, qe, ks, ke, types))
        if qs.size:
            self._count += qs.size
            check_count(self._count, MAX_ROWS, f"{where}: slices of the mask")
            self._batches.append((where, qs, qe, ks, ke, types))


def _ranges(q: RangeArrays, k: RangeArrays) -> tuple[np.ndarray, ...]:
    arrays = (np.asarray(x, dtype=np.int64) for x in (*q, *k))
    return tuple(np.atleast_1d(x) for x in np.broadcast_arrays(*arrays))


def _check_ranges(where: str, what: str, starts: np.ndarray, ends: np.ndarray) -> None:
    bad = (starts > ends) | (starts < 0)
    if bad.any():
        i = int(np.argmax(bad))
        s, e = int(starts[i]), int(ends[i])
        problem = "starts before 0" if s < 0 else "is reversed (start > end)"
        raise MaskError(f"{where}: {what} range {s}:{e} {problem}")
