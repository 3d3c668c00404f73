"""Masks from what a data loader already has: one document id per token, or Hugging Face's
position ids that restart at 0 per document; checked against a dense reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskc.errors import MaskError
from maskc.ir import Mask


def _reference(ids: np.ndarray, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """Query i sees key j of its own document, j <= i when causal, i - left <= j <= i + right."""
    i, j = np.arange(ids.size)[:, None], np.arange(ids.size)[None, :]
    allowed = ids[:, None] == ids[None, :]
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= (j >= i - window[0]) & (j <= i + window[1])
    return torch.from_numpy(allowed)


def _documents(seed: int) -> np.ndarray:
    """Lengths of 1 to 40 documents, some of a single token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, rng.integers(1, 40))
    lengths[rng.random(lengths.size) < 0.2] = 1
    return lengths


CASES = [(False, None), (True, None), (True, (5, 0)), (False, (3, 7)), (False, (0, 0)), (True, (1000, 0))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal,window", CASES)
def test_document_ids_and_position_ids_give_the_dense_mask(seed: int, causal: bool, window) -> None:
    lengths = _documents(seed)
    ids = np.repeat(np.random.default_rng(seed).permutation(lengths.size) * 3, lengths)  # ids in any order
    positions = np.concatenate([np.arange(n) for n in lengths])
    expected = _reference(np.repeat(np.arange(lengths.size), lengths), causal, window)
    assert torch.equal(Mask.from_document_ids(ids, causal=causal, window=window).to_dense(), expected)
    assert torch.equal(Mask.from_position_ids(positions, causal=causal, window=window).to_dense(), expected)
    # As models pass them: a [1, S] int64 tensor.
    row = torch.from_numpy(positions)[None]
    assert torch.equal(Mask.from_position_ids(row, causal=causal, window=window).to_dense(), expected)


def test_the_first_token_begins_a_document_whatever_its_position() -> None:
    """A row that starts mid-document (a continuation chunk) and two documents after it."""
    mask = Mask.from_position_ids([5, 6, 7, 0, 1, 0], causal=True)
    assert torch.equal(mask.to_dense(), _reference(np.array([0, 0, 0, 1, 1, 2]), True, None))


def test_they_agree_with_cu_seqlens() -> None:
    lengths = np.array([300, 1, 517, 64])
    cu = np.r_[0, np.cumsum(lengths)]
    ids = np.repeat(np.arange(4), lengths)
    for causal in (False, True):
        assert Mask.from_document_ids(ids, causal=causal).equivalent(Mask.from_cu_seqlens(cu, causal=causal))
    assert Mask.from_document_ids(ids, causal=True, window=(64, 0)).equivalent(Mask.sliding_window(cu, 64))


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: Mask.from_document_ids([4, 4, 2, 2, 4], causal=True), "document 4 is split: it runs from token 0 and again from token 4"),
        (lambda: Mask.from_document_ids([[0, 0], [1, 1]], causal=True), r"one packed row, shape \[S\] or \[1, S\]; got shape \(2, 2\)"),
        (lambda: Mask.from_document_ids([], causal=True), r"got shape \(0,\)"),
        (lambda: Mask.from_document_ids([0.0, 1.0], causal=True), "must be integers"),
        (lambda: Mask.from_position_ids([0, 1, -1], causal=True), "position_ids must be >= 0, got -1 at token 2"),
        (lambda: Mask.from_position_ids([0, 1, 2], causal=True, window=(4, 1)), "window right must be 0, got 1"),
        (lambda: Mask.from_position_ids([0, 1, 2], causal=False, window=(4,)), r"window must be a pair \(left, right\)"),
        (lambda: Mask.from_position_ids([0, 1, 2], causal=False, window=(-1, 2)), "window left must be >= 0"),
        (lambda: Mask.from_position_ids([0, 1, 2], causal="yes"), "causal must be True or False"),
    ],
)
def test_bad_input_is_a_mask_error_naming_the_problem(build, message: str) -> None:
    with pytest.raises(MaskError, match=message):
        build()
