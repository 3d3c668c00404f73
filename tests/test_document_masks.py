"""Masks from what a data loader already has: one document id per token, or Hugging Face's
position ids that restart at 0 per document, with prefix keys, cross-attention and padding;
checked against a dense reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_mask_ops import is_normal

from maskc.errors import MaskError
from maskc.ir import Mask


def _places(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's index in its document and its document's length (tokens of one id, padding too)."""
    place, length = np.zeros(ids.size, np.int64), np.zeros(ids.size, np.int64)
    for d in set(ids.tolist()):
        tokens = np.flatnonzero(ids == d)
        place[tokens], length[tokens] = np.arange(tokens.size), tokens.size
    return place, length


def _reference(
    ids: np.ndarray,
    causal: bool,
    window: tuple[int, int] | None,
    prefix: int = 0,
    key_ids: np.ndarray | None = None,
) -> torch.Tensor:
    """Query i sees key j of its own document (same id >= 0) where, with i' and j' their places
    in it and diagonal d = i' + Lk - Lq: j' <= d when causal, d - left <= j' <= d + right in a
    window; or else j' < prefix."""
    key_ids = ids if key_ids is None else key_ids
    (i, lq), (j, lk) = _places(ids), _places(key_ids)
    i, lq, j, lk = i[:, None], lq[:, None], j[None, :], lk[None, :]
    diag = i + lk - lq
    allowed = np.ones((ids.size, key_ids.size), bool)
    if causal:
        allowed &= j <= diag
    if window is not None:
        allowed &= (j >= diag - window[0]) & (j <= diag + window[1])
    same = (ids[:, None] == key_ids[None, :]) & (ids[:, None] >= 0)
    return torch.from_numpy(same & (allowed | (j < prefix)))


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


def _padded_row(rng: np.random.Generator, lengths: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Documents of `ids` and `lengths` with runs of padding (-1) before, between and after some."""
    parts = []
    for d, n in zip(ids.tolist(), lengths.tolist()):
        if rng.random() < 0.3:
            parts.append(np.full(rng.integers(1, 5), -1))
        parts.append(np.full(n, d))
    if rng.random() < 0.5:
        parts.append(np.full(rng.integers(1, 5), -1))
    return np.concatenate(parts)


PREFIX_CASES = [(c, w, p) for c, w in CASES for p in (1, 4, 100)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("causal,window,prefix", PREFIX_CASES)
def test_prefix_keys_and_padding_give_the_dense_mask(seed: int, causal: bool, window, prefix: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = _documents(seed)
    ids = _padded_row(rng, lengths, rng.permutation(lengths.size) * 3)
    expected = _reference(ids, causal, window, prefix)
    mask = Mask.from_document_ids(ids, causal=causal, window=window, prefix=prefix)
    assert torch.equal(mask.to_dense(), expected)
    assert mask.normalize() is mask and is_normal(mask)  # built normalised: schedules do not redo it
    # The same row as positions and an attention mask; padding positions are anything.
    real = ids >= 0
    positions = np.where(real, _places(ids)[0], rng.integers(-3, 5, ids.size))
    attention_mask = torch.from_numpy(real)[None]  # bools, [1, S]
    mask = Mask.from_position_ids(positions, causal=causal, window=window, prefix=prefix, attention_mask=attention_mask)
    assert torch.equal(mask.to_dense(), expected)
    assert torch.equal(Mask.from_position_ids(positions, causal=causal, window=window, prefix=prefix,
                                              attention_mask=real.astype(np.int64)).to_dense(), expected)  # fmt: skip
    if not (~real).any():
        cu = np.r_[0, np.cumsum(lengths)]
        assert torch.equal(Mask.from_cu_seqlens(cu, causal=causal, prefix=prefix).to_dense(), _reference(ids, causal, None, prefix))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal,window", CASES)
@pytest.mark.parametrize("prefix", (0, 3))
def test_key_document_ids_give_cross_attention(seed: int, causal: bool, window, prefix: int) -> None:
    """Key documents of other lengths, in another order, some missing on either side, padded."""
    rng = np.random.default_rng(seed)
    lengths = _documents(seed)
    q_ids = _padded_row(rng, lengths, np.arange(lengths.size))
    k_docs = rng.permutation(lengths.size + 3)[: rng.integers(0, lengths.size + 3)]  # ids past the queries' too
    k_ids = _padded_row(rng, rng.integers(1, 50, k_docs.size), k_docs) if k_docs.size else np.array([-1])
    mask = Mask.from_document_ids(q_ids, causal=causal, window=window, prefix=prefix, key_document_ids=k_ids)
    assert mask.shape == (q_ids.size, k_ids.size)
    assert torch.equal(mask.to_dense(), _reference(q_ids, causal, window, prefix, k_ids))
    assert mask.normalize() is mask and is_normal(mask)  # built normalised: schedules do not redo it


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prefix", (0, 2))
def test_cu_seqlens_k_gives_cross_attention_in_windows_too(seed: int, prefix: int) -> None:
    rng = np.random.default_rng(seed)
    lq, lk = rng.integers(0, 30, 8), rng.integers(0, 30, 8)
    cu_q, cu_k = np.r_[0, np.cumsum(lq)], np.r_[0, np.cumsum(lk)]
    q_ids, k_ids = np.repeat(np.arange(8), lq), np.repeat(np.arange(8), lk)
    for causal in (False, True):
        mask = Mask.from_cu_seqlens(cu_q, cu_k, causal=causal, prefix=prefix)
        assert torch.equal(mask.to_dense(), _reference(q_ids, causal, None, prefix, k_ids))
    for left, right in ((0, 0), (5, 0), (3, 9)):
        mask = Mask.sliding_window(cu_q, left, right, cu_seqlens_k=cu_k, prefix=prefix)
        assert torch.equal(mask.to_dense(), _reference(q_ids, False, (left, right), prefix, k_ids))
        assert mask.normalize() is mask and is_normal(mask)


def test_a_causal_prefix_is_a_prefix_lm_and_a_full_one_changes_nothing() -> None:
    """The first 3 tokens see each other, the rest are causal: two disjoint slices."""
    lm = Mask.from_cu_seqlens([0, 8], causal=True, prefix=3)
    assert [(s.q, s.k, s.type) for s in lm.slices] == [((0, 8), (0, 3), "full"), ((3, 8), (3, 8), "causal")]
    assert Mask.from_cu_seqlens([0, 5, 9], prefix=2) == Mask.from_cu_seqlens([0, 5, 9])
    assert Mask.from_cu_seqlens([0, 5, 9], causal=True, prefix=0) == Mask.from_cu_seqlens([0, 5, 9], causal=True)


def test_padding_ends_a_document_and_the_next_token_begins_one() -> None:
    """Left padding, then a continuation chunk (positions 5, 6) and a document cut by padding."""
    positions = [1, 1, 5, 6, 0, 1, 1, 2]
    attention_mask = [0, 0, 1, 1, 1, 1, 0, 1]
    mask = Mask.from_position_ids(positions, causal=True, attention_mask=attention_mask)
    assert torch.equal(mask.to_dense(), _reference(np.array([-1, -1, 0, 0, 1, 1, -1, 2]), True, None))
    assert Mask.from_document_ids([-1, -1, -1], causal=True).area() == 0
    assert Mask.from_position_ids([0, 1], causal=False, attention_mask=[False, False]).area() == 0


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
        (lambda: Mask.from_document_ids([0, 0, -1, 0], causal=True), "document 0 is split: it runs from token 0 and again from token 3"),
        (lambda: Mask.from_document_ids([0, 1], causal=True, key_document_ids=[1, 0, 1]),
         "key_document_ids: document 1 is split: it runs from token 0 and again from token 2"),
        (lambda: Mask.from_document_ids([0, 1], causal=True, key_document_ids=[[0, 1], [0, 1]]),
         r"key_document_ids must hold one value per token of one packed row"),
        (lambda: Mask.from_document_ids([0, 1], causal=True, prefix=-1), "prefix must be >= 0, got -1"),
        (lambda: Mask.from_cu_seqlens([0, 4], prefix=True), "prefix must be an int, got True"),
        (lambda: Mask.from_position_ids([0, 1], causal=True, attention_mask=[1, 0, 1]), "attention_mask has 3 tokens but position_ids 2"),
        (lambda: Mask.from_position_ids([0, 1], causal=True, attention_mask=[1, 2]), "attention_mask must be 0 or 1 per token, got 2 at token 1"),
        (lambda: Mask.from_position_ids([0, 1], causal=True, attention_mask=[1.0, 0.0]), "attention_mask must be bools or integers, got dtype float64"),
        (lambda: Mask.from_position_ids([0, -1, 0], causal=True, attention_mask=[1, 1, 0]), "position_ids must be >= 0, got -1 at token 1"),
        (lambda: Mask.sliding_window([0, 4, 8], 2, cu_seqlens_k=[0, 8]), "cu_seqlens and cu_seqlens_k hold 3 and 2 boundaries"),
        (lambda: Mask.sliding_window([0, 4], 2, cu_seqlens_k=[0, 5, 3]), "cu_seqlens_k must be non-decreasing"),
        (lambda: Mask.from_position_ids(np.array([0, 2**63], np.uint64), causal=True),
         "position_ids holds 9,223,372,036,854,775,808, more than any token count or position can be"),
        (lambda: Mask.from_cu_seqlens(torch.tensor([0, 4], device="meta")), "cu_seqlens_q is on the meta device"),
        (lambda: Mask.from_position_ids(torch.zeros(4, dtype=torch.long, device="meta"), causal=True),
         "position_ids is on the meta device"),
        (lambda: Mask.from_table(torch.zeros(1, 5, dtype=torch.int32, device="meta")), "a mask table is on the meta device"),
    ],
)
def test_bad_input_is_a_mask_error_naming_the_problem(build, message: str) -> None:
    with pytest.raises(MaskError, match=message):
        build()
