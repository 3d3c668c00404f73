"""Mask.crop and Mask.stack against dense masks built slice by slice from DESIGN.md's rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import dense_of, masks

from maskc.errors import MaskError
from maskc.ir import AttnSlice, Mask, slice_areas


def is_normal(mask: Mask) -> bool:
    """Whether no slice is empty and no two share a pair (their areas add up to the dense count)."""
    areas = slice_areas(mask.q_ranges[:, 1] - mask.q_ranges[:, 0], mask.k_ranges[:, 1] - mask.k_ranges[:, 0], mask.types)
    return bool((areas > 0).all()) and int(areas.sum()) == int(mask.to_dense().sum())


@st.composite
def crops(draw) -> tuple[Mask, tuple[int, int], tuple[int, int]]:
    """A mask of overlapping slices of all four types and a crop inside its shape (maybe empty)."""
    mask = draw(masks(max_slices=8))
    q0 = draw(st.integers(0, mask.seqlen_q))
    k0 = draw(st.integers(0, mask.seqlen_k))
    return mask, (q0, draw(st.integers(q0, mask.seqlen_q))), (k0, draw(st.integers(k0, mask.seqlen_k)))


@given(crops())
@settings(max_examples=400, deadline=None)
def test_crop_keeps_exactly_the_pairs_inside_both_ranges(case) -> None:
    mask, (q0, q1), (k0, k1) = case
    expected = torch.zeros(mask.shape, dtype=torch.bool)
    expected[q0:q1, k0:k1] = dense_of(list(mask.slices), *mask.shape)[q0:q1, k0:k1]
    cropped = mask.crop((q0, q1), (k0, k1))
    assert cropped.shape == mask.shape
    assert torch.equal(cropped.to_dense(), expected)
    assert cropped.area() == int(expected.sum())
    assert len(cropped) <= 3 * len(mask.normalize())
    assert cropped.normalize() is cropped and is_normal(cropped)


def test_crop_of_every_pair_is_the_mask_and_of_nothing_is_empty() -> None:
    mask = Mask.sliding_window([0, 10, 30], left=4, right=2)
    assert mask.crop((0, 30), (0, 30)).equivalent(mask)
    assert len(mask.crop((5, 5), (0, 30))) == len(mask.crop((0, 30), (7, 7))) == 0
    assert len(mask.crop((0, 10), (10, 30))) == 0  # the other document's keys


def test_cropping_a_padded_row_is_the_row_without_its_padding() -> None:
    """A causal row of documents of 5 and 4 tokens whose last 2 tokens are padding."""
    padded = Mask.from_cu_seqlens([0, 5, 9], causal=True).crop((0, 7), (0, 7))
    assert padded.equivalent(Mask.from_arrays([[0, 5], [5, 7]], [[0, 5], [5, 7]], [1, 1], 9, 9))
    dense = padded.to_dense()
    assert not dense[7:].any() and not dense[:, 7:].any()


@pytest.mark.parametrize(
    "q_range,k_range,message",
    [
        ((0, 9), (0, 8), r"crop q range ends at 9, past seqlen_q=8"),
        ((0, 8), (2, 12), r"crop k range ends at 12, past seqlen_k=8"),
        ((5, 3), (0, 8), r"crop q range \(5, 3\) is reversed"),
        ((0, 8), (-1, 4), r"crop k range \(-1, 4\) is negative"),
        ((0, 8, 1), (0, 8), r"crop q range must be a \(start, end\) pair"),
        ((0, 8), (0, 2.5), r"crop k range must hold integers"),
        ((True, 8), (0, 8), r"crop q range must hold integers"),
    ],
)
def test_crop_refuses_ranges_outside_the_mask(q_range, k_range, message: str) -> None:
    with pytest.raises(MaskError, match=message):
        Mask.from_cu_seqlens([0, 8], causal=True).crop(q_range, k_range)


@given(st.lists(masks(max_len=12, max_slices=4), min_size=1, max_size=4))
@settings(max_examples=200, deadline=None)
def test_stack_puts_masks_on_the_diagonal(parts: list[Mask]) -> None:
    stacked = Mask.stack(parts)
    expected = torch.zeros(sum(m.seqlen_q for m in parts), sum(m.seqlen_k for m in parts), dtype=torch.bool)
    q0 = k0 = 0
    for m in parts:
        expected[q0 : q0 + m.seqlen_q, k0 : k0 + m.seqlen_k] = dense_of(list(m.slices), *m.shape)
        q0, k0 = q0 + m.seqlen_q, k0 + m.seqlen_k
    assert stacked.shape == tuple(expected.shape)
    assert torch.equal(stacked.to_dense(), expected)
    assert len(stacked) == sum(len(m) for m in parts)


def test_stack_of_one_mask_is_that_mask() -> None:
    mask = Mask([AttnSlice(q=(1, 4), k=(0, 6), type="bi_causal")], 5, 7)
    assert Mask.stack([mask]) == mask
    assert Mask.stack((mask, mask)).slices[1] == AttnSlice(q=(6, 9), k=(7, 13), type="bi_causal")


@pytest.mark.parametrize(
    "masks_,message",
    [
        ([], "needs at least one mask, got none"),
        ([Mask.from_cu_seqlens([0, 4]), "mask"], "item 1 is a str, not a Mask"),
        (Mask.from_cu_seqlens([0, 4]), "takes a sequence of masks, got Mask"),
        (3, "takes a sequence of masks, got int"),
    ],
)
def test_stack_refuses_what_is_not_a_list_of_masks(masks_, message: str) -> None:
    with pytest.raises(MaskError, match=message):
        Mask.stack(masks_)


def test_stack_refuses_a_batch_longer_than_the_kernels_index() -> None:
    huge = Mask.from_cu_seqlens([0, 2**30])
    with pytest.raises(MaskError, match="seqlen_q = 3,221,225,472 is more than maskc supports"):
        Mask.stack([huge] * 3)
