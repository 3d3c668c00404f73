"""The dispatch solver: valid balanced assignments, bounds against brute force, padding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import masks

from maskc.dist.assign import ALGORITHMS, imbalance, lower_bound, pad, padded_length, rank_areas, solve
from maskc.dist.pieces import chunk_areas
from maskc.errors import MaskError, MaskParamError
from maskc.ir import Mask


@st.composite
def problems(draw, max_cp: int = 64, max_k: int = 8) -> tuple[np.ndarray, int]:
    """Area vectors of cp * k chunks: wide ranges, and narrow ones full of ties and zeros."""
    cp = draw(st.integers(1, max_cp))
    k = draw(st.integers(0, max_k))
    top = draw(st.sampled_from([0, 3, 1000, 10**12]))
    return np.array(draw(st.lists(st.integers(0, top), min_size=cp * k, max_size=cp * k)), dtype=np.int64), cp


def max_load(areas: np.ndarray, rank: np.ndarray, cp: int) -> int:
    return int(rank_areas(areas, rank, cp).max(initial=0))


def optimum(areas: np.ndarray, cp: int) -> int:
    """Best largest rank area over every equal-count assignment: each permutation, cut into blocks of k."""
    perms = np.array(list(itertools.permutations(range(areas.size))), dtype=np.int64)
    return int(areas[perms].reshape(len(perms), cp, -1).sum(-1).max(-1).min())


@pytest.mark.slow
@given(problems())
@settings(max_examples=300, deadline=None)
def test_every_algorithm_gives_a_balanced_deterministic_assignment(problem: tuple[np.ndarray, int]) -> None:
    areas, cp = problem
    k = areas.size // cp
    before = areas.copy()
    loads = {}
    for algorithm in ALGORITHMS:
        rank = solve(areas, cp, algorithm)
        assert rank.dtype == np.int64 and rank.shape == areas.shape
        assert np.bincount(rank, minlength=cp).tolist() == [k] * cp  # every chunk once, k per rank
        assert np.array_equal(solve(areas.tolist(), cp, algorithm), rank)  # deterministic
        loads[algorithm] = max_load(areas, rank, cp)
    assert np.array_equal(areas, before)
    assert np.array_equal(solve(areas, cp, "contiguous"), np.arange(areas.size) // max(k, 1))
    bound = lower_bound(areas, cp)
    assert bound <= loads["swap"] <= loads["greedy"]
    assert bound <= loads["local"] <= loads["contiguous"]


@given(problems(max_cp=8, max_k=8).filter(lambda p: 0 < p[0].size <= 8))
@settings(max_examples=150, deadline=None)
def test_bounds_hold_against_brute_force(problem: tuple[np.ndarray, int]) -> None:
    areas, cp = problem
    best = optimum(areas, cp)
    assert lower_bound(areas, cp) <= best
    for algorithm in ALGORITHMS:
        assert max_load(areas, solve(areas, cp, algorithm), cp) >= best


@pytest.mark.slow
def test_swap_often_reaches_the_optimum_on_tiny_cases() -> None:
    rng = np.random.default_rng(0)
    cases = [(cp, n) for n in (4, 6, 8) for cp in (2, n // 2) if n % cp == 0]
    hits = {"greedy": 0, "swap": 0}
    trials = 0
    for _ in range(60):
        for cp, n in cases:
            areas = rng.integers(0, 100, n)
            best = optimum(areas, cp)
            trials += 1
            for algorithm in hits:
                hits[algorithm] += max_load(areas, solve(areas, cp, algorithm), cp) == best
    print(f"optimum reached on {trials} tiny cases: " + ", ".join(f"{a} {h / trials:.0%}" for a, h in hits.items()))
    assert hits["swap"] > hits["greedy"]
    assert hits["swap"] >= 0.9 * trials


def test_swap_fixes_what_the_greedy_gets_wrong() -> None:
    areas = np.array([8, 7, 6, 5, 4, 0])
    # Greedy: 8 | 7, 6 | 5, 4 | 0 in area order gives {8, 5, 4} = 17 and {7, 6, 0} = 13.
    assert sorted(rank_areas(areas, solve(areas, 2, "greedy"), 2).tolist()) == [13, 17]
    assert rank_areas(areas, solve(areas, 2, "swap"), 2).tolist() == [15, 15]
    assert lower_bound(areas, 2) == 15


def test_local_keeps_a_balanced_contiguous_layout_and_repairs_a_skewed_one() -> None:
    flat = np.full(16, 5)
    assert np.array_equal(solve(flat, 4, "local"), solve(flat, 4, "contiguous"))
    skewed = np.arange(16) ** 2  # causal-like: late chunks are heavy
    local, contiguous = solve(skewed, 4, "local"), solve(skewed, 4, "contiguous")
    assert imbalance(skewed, local, 4) < 1.05 < imbalance(skewed, contiguous, 4)


def test_lower_bound_and_imbalance_values() -> None:
    assert lower_bound([10, 0, 0, 0], 2) == 10  # the big chunk's rank
    assert lower_bound([5, 5, 5, 5, 1, 1], 2) == 11  # the mean, rounded up
    assert lower_bound([], 4) == 0
    assert imbalance([4, 2, 1, 1], [0, 0, 1, 1], 2) == pytest.approx(6 / 4)
    assert imbalance([0, 0], [0, 1], 2) == 1.0
    assert rank_areas([10**15, 10**15 + 1], [1, 1], 2).tolist() == [0, 2 * 10**15 + 1]


@pytest.mark.parametrize(
    ("areas", "cp", "message"),
    [
        (np.zeros((2, 2), dtype=np.int64), 2, "1-D"),
        ([1.0, 2.0], 2, "integers"),
        ([True, False], 2, "integers"),
        ([1, -1], 2, "non-negative, chunk 1 has -1"),
        ([1, 2], 0, "cp_size must be a positive int"),
        ([1, 2], True, "cp_size must be a positive int"),
        ([1, 2, 3], 2, r"3 chunks do not split evenly over cp_size 2; pad the mask to padded_length"),
    ],
)
def test_bad_areas_and_cp_size(areas: object, cp: object, message: str) -> None:
    with pytest.raises(MaskParamError, match=message):
        solve(areas, cp)
    with pytest.raises(MaskParamError, match=message):
        lower_bound(areas, cp)


def test_bad_algorithm_and_assignment() -> None:
    with pytest.raises(MaskParamError, match="unknown dispatch algorithm 'best'; expected one of contiguous, greedy"):
        solve([1, 2], 2, "best")
    with pytest.raises(MaskParamError, match="rank_of_chunk must be 2 ints"):
        imbalance([1, 2], [0], 2)
    with pytest.raises(MaskParamError, match="rank_of_chunk must be 2 ints"):
        imbalance([1, 2], [0.0, 1.0], 2)
    with pytest.raises(MaskParamError, match=r"ranks outside \[0, 2\)"):
        imbalance([1, 2], [0, 2], 2)


def test_padded_length() -> None:
    assert [padded_length(n, 4, 2) for n in (0, 1, 8, 9, 16)] == [0, 8, 8, 16, 16]
    assert padded_length(1_000_000, 2048, 64) == 1 << 20
    with pytest.raises(MaskParamError, match="seqlen must be a non-negative int"):
        padded_length(-1, 4, 2)
    with pytest.raises(MaskParamError, match="chunk_size must be a positive int"):
        padded_length(8, 0, 2)
    with pytest.raises(MaskParamError, match="cp_size must be a positive int"):
        padded_length(8, 4, 2.0)


@given(masks(max_len=30, max_slices=5), st.sampled_from([1, 3, 4, 8]), st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_padding_attends_to_nothing(mask: Mask, chunk_size: int, cp: int) -> None:
    n = max(mask.shape)
    square = Mask.from_arrays(mask.q_ranges, mask.k_ranges, mask.types, n, n)
    length = padded_length(n, chunk_size, cp)
    padded = pad(square, length)
    assert padded.shape == (length, length) and length % (chunk_size * cp) == 0 and length >= n
    dense = padded.to_dense()
    assert torch.equal(dense[:n, :n], square.to_dense())
    assert not dense[n:].any() and not dense[:, n:].any()
    areas = chunk_areas(padded, chunk_size, length // chunk_size)
    assert int(areas.sum()) == square.area()
    assert not areas[-(-n // chunk_size) :].any()  # chunks of padding only do no work
    assert np.bincount(solve(areas, cp), minlength=cp).tolist() == [length // chunk_size // cp] * cp


def test_bad_padding() -> None:
    mask = Mask.from_cu_seqlens([0, 10], causal=True)
    with pytest.raises(MaskError, match=r"square mask .* got \(10, 12\)"):
        pad(Mask.from_arrays(mask.q_ranges, mask.k_ranges, mask.types, 10, 12), 16)
    with pytest.raises(MaskParamError, match="padded length must be an int >= the mask's 10 tokens, got 8"):
        pad(mask, 8)
    with pytest.raises(MaskParamError, match="padded length must be an int"):
        pad(mask, 16.0)
    with pytest.raises(MaskError, match="expected a Mask"):
        pad("causal", 16)
