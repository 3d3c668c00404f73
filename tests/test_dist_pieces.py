"""The mask cut into chunk pieces: areas and key spans against the dense mask."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import masks

from maskc.dist.pieces import chunk_areas, cut
from maskc.errors import MaskError, MaskParamError
from maskc.ir import Mask


@given(masks(max_len=40, max_slices=6), st.sampled_from([1, 3, 7, 16]))
@settings(max_examples=200, deadline=None)
def test_pieces_match_the_dense_mask(mask: Mask, chunk_size: int) -> None:
    dense = mask.to_dense()
    num_chunks = -(-mask.seqlen_q // chunk_size)
    areas = chunk_areas(mask, chunk_size, num_chunks)
    assert areas.tolist() == [int(dense[c * chunk_size : (c + 1) * chunk_size].sum()) for c in range(num_chunks)]
    pieces = cut(mask, chunk_size)
    covered = np.zeros(tuple(dense.shape), dtype=np.int64)
    for p in range(len(pieces)):
        r0, r1, c = int(pieces.r0[p]), int(pieces.r1[p]), int(pieces.chunk[p])
        assert c * chunk_size <= r0 < r1 <= (c + 1) * chunk_size
        for r in range(r0, r1):
            lo = pieces.lo_a[p] + pieces.lo_s[p] * r
            hi = pieces.hi_a[p] + pieces.hi_s[p] * r
            assert lo <= hi  # no empty row
            covered[r, lo : hi + 1] += 1
        # One interval holds every key the piece's rows need, and each of them is needed.
        needed = np.zeros(dense.shape[1], dtype=bool)
        for r in range(r0, r1):
            needed[pieces.lo_a[p] + pieces.lo_s[p] * r : pieces.hi_a[p] + pieces.hi_s[p] * r + 1] = True
        assert np.flatnonzero(needed).tolist() == list(range(pieces.key_begin()[p], pieces.key_end()[p]))
        assert pieces.areas()[p] == sum(
            pieces.hi_a[p] + pieces.hi_s[p] * r - pieces.lo_a[p] - pieces.lo_s[p] * r + 1 for r in range(r0, r1)
        )
    assert np.array_equal(covered, dense.numpy().astype(np.int64))  # disjoint and exact


def test_bad_chunk_size_and_too_few_chunks() -> None:
    mask = Mask.from_cu_seqlens([0, 100], causal=True)
    with pytest.raises(MaskParamError, match="chunk_size must be a positive int"):
        cut(mask, 0)
    with pytest.raises(MaskError, match="rows past 2 chunks"):
        chunk_areas(mask, 32, 2)


@given(masks(max_len=40, max_slices=6), st.sampled_from([1, 3, 16]), st.data())
@settings(max_examples=150, deadline=None)
def test_clipping_to_key_ranges_matches_the_dense_mask(mask: Mask, chunk_size: int, data: st.DataObject) -> None:
    pieces = cut(mask, chunk_size)
    n = len(pieces)
    k0 = np.array(data.draw(st.lists(st.integers(0, mask.seqlen_k), min_size=n, max_size=n)), dtype=np.int64)
    width = np.array(data.draw(st.lists(st.integers(0, mask.seqlen_k), min_size=n, max_size=n)), dtype=np.int64)
    k1 = k0 + width
    clipped, source = pieces.clipped(k0, k1)
    expected = np.zeros((mask.seqlen_q, mask.seqlen_k + 41), dtype=np.int64)
    for p in range(n):
        for r in range(int(pieces.r0[p]), int(pieces.r1[p])):
            lo = max(pieces.lo_a[p] + pieces.lo_s[p] * r, k0[p])
            hi = min(pieces.hi_a[p] + pieces.hi_s[p] * r, k1[p] - 1)
            if lo <= hi:
                expected[r, lo : hi + 1] += 1
    got = np.zeros_like(expected)
    for c in range(len(clipped)):
        assert clipped.chunk[c] == pieces.chunk[source[c]]
        for r in range(int(clipped.r0[c]), int(clipped.r1[c])):
            lo, hi = clipped.lo_a[c] + clipped.lo_s[c] * r, clipped.hi_a[c] + clipped.hi_s[c] * r
            assert lo <= hi  # no empty row survives
            got[r, lo : hi + 1] += 1
    assert np.array_equal(got, expected)
    assert clipped.areas().sum() == pieces.areas_within(k0, k1).sum()
