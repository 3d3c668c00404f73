"""The AttnSlice IR against dense masks built element by element from DESIGN.md's rules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maskc.errors import MaskError
from maskc.ir import TYPE_NAMES, AttnSlice, Mask, band_slices


def allowed(t: str, i: int, j: int, lq: int, lk: int) -> bool:
    """DESIGN.md's table, literally."""
    if t == "full":
        return True
    if t == "causal":
        return j <= i + (lk - lq)
    if t == "inv_causal":
        return j >= i
    return i <= j <= i + (lk - lq)


def dense_of(slices: list[AttnSlice], sq: int, sk: int) -> torch.Tensor:
    out = torch.zeros(sq, sk, dtype=torch.bool)
    for s in slices:
        lq, lk = s.q[1] - s.q[0], s.k[1] - s.k[0]
        for i in range(lq):
            for j in range(lk):
                if allowed(s.type, i, j, lq, lk):
                    out[s.q[0] + i, s.k[0] + j] = True
    return out


@st.composite
def masks(draw, max_len: int = 24, max_slices: int = 6) -> Mask:
    sq = draw(st.integers(0, max_len))
    sk = draw(st.integers(0, max_len))
    slices = []
    for _ in range(draw(st.integers(0, max_slices))):
        qs = draw(st.integers(0, sq))
        qe = draw(st.integers(qs, sq))
        ks = draw(st.integers(0, sk))
        ke = draw(st.integers(ks, sk))
        slices.append(AttnSlice(q=(qs, qe), k=(ks, ke), type=draw(st.sampled_from(TYPE_NAMES))))
    return Mask(slices, sq, sk)


@given(masks())
@settings(max_examples=300, deadline=None)
def test_dense_area_and_normalize_match_elementwise_semantics(mask: Mask) -> None:
    expected = dense_of(list(mask.slices), mask.seqlen_q, mask.seqlen_k)
    assert torch.equal(mask.to_dense(), expected)
    assert mask.area() == int(expected.sum())
    norm = mask.normalize()
    assert torch.equal(norm.to_dense(), expected)
    # Non-overlapping and without empty slices: per-slice areas add up to the union.
    assert all(s.area() > 0 for s in norm.slices)
    assert sum(s.area() for s in norm.slices) == int(expected.sum())
    assert len(norm) <= max(len(mask), 1) * 8
    assert mask.equivalent(norm)


@given(masks())
@settings(max_examples=100, deadline=None)
def test_slice_area_closed_form(mask: Mask) -> None:
    for s in mask.slices:
        assert s.area() == int(dense_of([s], mask.seqlen_q, mask.seqlen_k).sum())


@given(masks())
@settings(max_examples=100, deadline=None)
def test_tensor_and_json_round_trip(mask: Mask) -> None:
    q, k, t = mask.to_tensors()
    assert q.dtype == k.dtype == t.dtype == torch.int32
    assert q.shape == (len(mask), 2) and t.shape == (len(mask),)
    assert Mask.from_tensors(q, k, t, mask.seqlen_q, mask.seqlen_k) == mask
    assert Mask.from_json(mask.to_json()) == mask


@given(masks(), st.integers(0, 24), st.integers(0, 24))
@settings(max_examples=100, deadline=None)
def test_dense_rows_is_a_window_of_dense(mask: Mask, a: int, b: int) -> None:
    q0, q1 = sorted((min(a, mask.seqlen_q), min(b, mask.seqlen_q)))
    assert torch.equal(mask.dense_rows(q0, q1), mask.to_dense()[q0:q1])


def band_dense(lq: int, lk: int, left: int, right: int) -> torch.Tensor:
    out = torch.zeros(lq, lk, dtype=torch.bool)
    for i in range(lq):
        diag = i + lk - lq
        for j in range(lk):
            out[i, j] = diag - left <= j <= diag + right
    return out


@given(st.integers(0, 20), st.integers(0, 20), st.integers(0, 25), st.integers(0, 25))
@settings(max_examples=300, deadline=None)
def test_band_is_at_most_three_slices(lq: int, lk: int, left: int, right: int) -> None:
    q, k, t = band_slices([3], [3 + lq], [1], [1 + lk], left, right)
    assert len(t) <= 3
    mask = Mask.from_arrays(q, k, t, 3 + lq, 1 + lk)
    assert torch.equal(mask.to_dense()[3:, 1:], band_dense(lq, lk, left, right))
    assert not mask.to_dense()[:3].any() and not mask.to_dense()[:, :1].any()


def test_band_vectorised_over_many_bands_keeps_order() -> None:
    cu = np.array([0, 5, 9, 30])
    q, k, t = band_slices(cu[:-1], cu[1:], cu[:-1], cu[1:], 3, 0)
    assert (np.diff(q[:, 0]) >= 0).all()
    assert Mask.from_arrays(q, k, t, 30, 30).equivalent(Mask.sliding_window(cu, 3))


def test_causal_band_is_causal_plus_bi_causal() -> None:
    mask = Mask.sliding_window([0, 100], left=10)
    assert [s.type for s in mask.slices] == ["causal", "bi_causal"]
    assert mask.area() == 11 * 100 - 55


def test_from_cu_seqlens() -> None:
    cu = [0, 3, 3, 7]
    full = Mask.from_cu_seqlens(cu)
    causal = Mask.from_cu_seqlens(cu, causal=True)
    expected = torch.zeros(7, 7, dtype=torch.bool)
    expected[:3, :3] = True
    expected[3:, 3:] = True
    assert torch.equal(full.to_dense(), expected)
    assert torch.equal(causal.to_dense(), expected & torch.ones(7, 7, dtype=torch.bool).tril())
    assert len(full) == 2  # the empty document yields no slice
    cross = Mask.from_cu_seqlens([0, 2, 5], [0, 4, 6], causal=True)
    assert cross.shape == (5, 6)
    assert cross.slices[0] == AttnSlice(q=(0, 2), k=(0, 4), type="causal")


def test_from_magi_accepts_ids_and_names() -> None:
    mask = Mask.from_magi([[0, 4], [4, 8]], [[0, 4], [0, 8]], [1, "full"])
    assert mask.shape == (8, 8)
    assert [s.type for s in mask.slices] == ["causal", "full"]
    with pytest.raises(MaskError, match="differ in length"):
        Mask.from_magi([[0, 4]], [[0, 4]], [0, 1])


def test_global_tokens() -> None:
    mask = Mask.sliding_window([0, 12], left=2).with_global_tokens(2)
    dense = mask.to_dense()
    assert dense[:2].all() and dense[:, :2].all()
    assert dense[11, 9:].all() and not dense[11, 2:9].any()
    with pytest.raises(MaskError, match="do not fit"):
        Mask.sliding_window([0, 4], left=1).with_global_tokens(5)


def test_overlapping_masks_count_area_once() -> None:
    causal = AttnSlice(q=(0, 64), k=(0, 64), type="causal")
    mask = Mask([causal, causal, AttnSlice(q=(0, 64), k=(0, 64))], 64, 64)
    assert mask.area() == 64 * 64
    assert mask.normalize().slices == (AttnSlice(q=(0, 64), k=(0, 64)),)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(q=(3, 1), k=(0, 1)), "reversed"),
        (dict(q=(-1, 1), k=(0, 1)), "negative"),
        (dict(q=(0, 1), k=(0, 1), type="diagonal"), "unknown slice type 'diagonal'"),
        (dict(q=(0, 1.5), k=(0, 1)), "integers"),
        (dict(q=(0, 1, 2), k=(0, 1)), r"\(start, end\) pair"),
    ],
)
def test_slice_validation(args: dict, message: str) -> None:
    with pytest.raises(MaskError, match=message):
        AttnSlice(**args)


def test_mask_validation_names_the_slice() -> None:
    with pytest.raises(MaskError, match=r"slice 1 has a q range past seqlen_q=4"):
        Mask([AttnSlice((0, 4), (0, 4)), AttnSlice((2, 5), (0, 4))], 4, 4)
    with pytest.raises(MaskError, match=r"slice 0 has a k range past seqlen_k=3"):
        Mask([AttnSlice((0, 4), (0, 4))], 4, 3)
    with pytest.raises(MaskError, match="reversed"):
        Mask.from_arrays([[0, 2]], [[3, 1]], [0], 4, 4)
    with pytest.raises(MaskError, match="unknown type id"):
        Mask.from_arrays([[0, 2]], [[0, 1]], [7], 4, 4)
    with pytest.raises(MaskError, match="shapes"):
        Mask.from_arrays([[0, 2, 3]], [[0, 1]], [0], 4, 4)
    with pytest.raises(MaskError, match="integers"):
        Mask.from_arrays([[0.0, 2.0]], [[0, 1]], [0], 4, 4)
    with pytest.raises(MaskError, match="seqlen_q must be >= 0"):
        Mask([], -1, 4)
    with pytest.raises(MaskError, match="starting at 0"):
        Mask.from_cu_seqlens([1, 4])
    with pytest.raises(MaskError, match="non-decreasing"):
        Mask.from_cu_seqlens([0, 4, 2])
    with pytest.raises(MaskError, match="malformed mask JSON"):
        Mask.from_json(json.dumps({"format": "maskc.mask/1", "seqlen_q": 4}))
    with pytest.raises(MaskError, match="not a maskc mask"):
        Mask.from_json("{}")


def test_mask_is_immutable() -> None:
    mask = Mask([AttnSlice((0, 4), (0, 4))], 4, 4)
    with pytest.raises(ValueError):
        mask.q_ranges[0, 0] = 1


def test_normalize_large_disjoint_mask_is_fast_path() -> None:
    cu = np.cumsum(np.r_[0, np.full(4000, 256)])
    mask = Mask.from_cu_seqlens(cu, causal=True)
    assert mask.area() == 4000 * 256 * 257 // 2
    assert len(mask.normalize()) == 4000


@given(masks(max_len=30, max_slices=8))
@settings(max_examples=200, deadline=None)
def test_merge_ranges_is_equivalent_and_never_larger(mask: Mask) -> None:
    from maskc.ir.merge import merge_ranges

    merged = merge_ranges(mask)
    assert torch.equal(merged.to_dense(), mask.to_dense())
    assert len(merged) <= len(mask.normalize())
    assert sum(s.area() for s in merged.slices) == mask.area()  # still disjoint


def test_merge_ranges_fuses_chains_written_block_by_block() -> None:
    from maskc.ir.merge import merge_ranges

    blocks = [AttnSlice((b, b + 16), (0, b + 16), "causal") for b in range(0, 128, 16)]
    assert merge_ranges(Mask(blocks, 128, 128)).slices == (AttnSlice((0, 128), (0, 128), "causal"),)
    band = Mask.sliding_window([0, 64], left=8)
    pieces = [AttnSlice((q0, q0 + 8), (max(0, q0 - 8), q0 + 8), "bi_causal") for q0 in range(8, 64, 8)]
    split = Mask([band.slices[0], *pieces], 64, 64)
    assert len(merge_ranges(split)) == 2


@given(masks())
@settings(max_examples=300, deadline=None)
def test_transpose_is_the_dense_transpose(mask: Mask) -> None:
    t = mask.transpose()
    assert t.shape == (mask.seqlen_k, mask.seqlen_q)
    assert torch.equal(t.to_dense(), mask.to_dense().T)
    assert len(t) <= 3 * len(mask.normalize())  # at most 3 pieces per normalised slice
    assert t.transpose().equivalent(mask)
