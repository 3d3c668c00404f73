"""Every shipped example lowers with its defaults and, at small sizes, equals a dense mask
built here directly from the example's description (index arithmetic, never the IR)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from maskc.frontend import load

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def bounds(lens: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lens:
        out.append((start, start + n))
        start += n
    return out


def from_rule(sq: int, sk: int, allowed) -> torch.Tensor:
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            m[i, j] = bool(allowed(i, j))
    return m


def per_doc(lens: list[int], allowed) -> torch.Tensor:
    """Block-diagonal mask; `allowed(i, j, s, e)` decides inside the document [s, e)."""
    n = sum(lens)
    m = torch.zeros(n, n, dtype=torch.bool)
    for s, e in bounds(lens):
        for i in range(s, e):
            for j in range(s, e):
                m[i, j] = bool(allowed(i, j, s, e))
    return m


def exp_full(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool)


def exp_causal(n: int) -> torch.Tensor:
    return from_rule(n, n, lambda i, j: j <= i)


def exp_varlen_full(docs: list[int]) -> torch.Tensor:
    return per_doc(docs, lambda i, j, s, e: True)


def exp_varlen_causal(docs: list[int]) -> torch.Tensor:
    return per_doc(docs, lambda i, j, s, e: j <= i)


def exp_sliding_window_causal(n: int, window: int) -> torch.Tensor:
    return from_rule(n, n, lambda i, j: i - window <= j <= i)


def exp_varlen_sliding_window_causal(docs: list[int], window: int) -> torch.Tensor:
    return per_doc(docs, lambda i, j, s, e: i - window <= j <= i)


def exp_varlen_block_causal(docs: list[int], block: int) -> torch.Tensor:
    def allowed(i, j, s, e):
        block_end = min(s + ((i - s) // block + 1) * block, e)
        return j < block_end

    return per_doc(docs, allowed)


def exp_prefix_lm(docs: list[int], prefix: int) -> torch.Tensor:
    def allowed(i, j, s, e):
        in_prefix = i - s < prefix
        return j - s < prefix if in_prefix else j <= i

    return per_doc(docs, allowed)


def exp_global_sliding_window(n: int, globals: int, window: int) -> torch.Tensor:
    return from_rule(n, n, lambda i, j: i < globals or j < globals or abs(i - j) <= window)


def exp_shared_question(docs: list[int]) -> torch.Tensor:
    n = sum(docs)
    spans = bounds(docs)
    qs, qe = spans[0]
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(qs, qe):
        for j in range(qs, i + 1):
            m[i, j] = True
    for s, e in spans[1:]:
        for i in range(s, e):
            for j in range(qs, qe):
                m[i, j] = True
            for j in range(s, i + 1):
                m[i, j] = True
    return m


def exp_primitives(rows: int, cols: int) -> torch.Tensor:
    off = cols - rows
    rules = [
        lambda i, j: True,
        lambda i, j: j <= i + off,
        lambda i, j: j >= i,
        lambda i, j: i <= j <= i + off,
    ]
    return from_rule(4 * rows, cols, lambda r, j: rules[r // rows](r % rows, j))


def exp_varlen_inv_causal(docs: list[int]) -> torch.Tensor:
    return per_doc(docs, lambda i, j, s, e: j >= i)


# (file, family, expected-builder, list of small parameter sets)
CASES = [
    ("full.mask", "full", exp_full, [{"n": 1}, {"n": 7}, {"n": 0}]),
    ("causal.mask", "causal", exp_causal, [{"n": 1}, {"n": 9}]),
    ("varlen_full.mask", "varlen_full", exp_varlen_full, [{"docs": [3, 1, 4]}, {"docs": [0, 5, 0, 2]}, {"docs": []}]),
    ("varlen_causal.mask", "varlen_causal", exp_varlen_causal, [{"docs": [3, 1, 4]}, {"docs": [6, 0, 2]}]),
    (
        "sliding_window_causal.mask",
        "sliding_window_causal",
        exp_sliding_window_causal,
        [{"n": 10, "window": 3}, {"n": 5, "window": 0}, {"n": 6, "window": 20}],
    ),
    (
        "sliding_window_causal.mask",
        "varlen_sliding_window_causal",
        exp_varlen_sliding_window_causal,
        [{"docs": [7, 2, 5], "window": 2}, {"docs": [4, 4], "window": 0}],
    ),
    (
        "varlen_block_causal.mask",
        "varlen_block_causal",
        exp_varlen_block_causal,
        [{"docs": [7, 2, 5], "block": 3}, {"docs": [4, 0, 9], "block": 1}, {"docs": [5, 6], "block": 100}],
    ),
    (
        "prefix_lm.mask",
        "prefix_lm",
        exp_prefix_lm,
        [{"docs": [7, 2, 5], "prefix": 3}, {"docs": [4, 6], "prefix": 0}, {"docs": [3, 8], "prefix": 5}],
    ),
    (
        "global_sliding_window.mask",
        "global_sliding_window",
        exp_global_sliding_window,
        [{"n": 12, "globals": 2, "window": 1}, {"n": 5, "globals": 9, "window": 1}, {"n": 9, "globals": 0, "window": 2}],
    ),
    (
        "shared_question.mask",
        "shared_question",
        exp_shared_question,
        [{"docs": [4, 3, 5, 2]}, {"docs": [6]}, {"docs": [3, 0, 4]}],
    ),
    (
        "primitives.mask",
        "primitives",
        exp_primitives,
        [{"rows": 3, "cols": 5}, {"rows": 4, "cols": 4}, {"rows": 5, "cols": 3}],
    ),
    ("primitives.mask", "varlen_inv_causal", exp_varlen_inv_causal, [{"docs": [3, 5, 1]}]),
]


def family(file: str, name: str):
    return load(EXAMPLES / file)[name]


@pytest.mark.parametrize("file,name,expected,param_sets", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_example_matches_dense(file, name, expected, param_sets):
    fam = family(file, name)
    for params in param_sets:
        mask = fam.lower(**params)
        want = expected(**params)
        assert mask.to_dense().shape == want.shape, params
        assert torch.equal(mask.to_dense(), want), params


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.mask")), ids=lambda p: p.name)
def test_example_lowers_with_defaults(path):
    families = load(path)
    assert families
    for fam in families.values():
        assert all(p.default is not None for p in fam.params), f"{fam.name}: every param needs a default"
        mask = fam.lower()
        assert mask.seqlen_q > 0 and mask.area() > 0


def test_every_example_family_is_covered():
    shipped = {(p.name, n) for p in EXAMPLES.glob("*.mask") for n in load(p)}
    assert shipped == {(c[0], c[1]) for c in CASES}


def test_required_example_files_exist():
    required = {
        "full", "causal", "varlen_full", "varlen_causal", "sliding_window_causal", "varlen_block_causal",
        "prefix_lm", "global_sliding_window", "shared_question", "primitives",
    }
    assert required <= {p.stem for p in EXAMPLES.glob("*.mask")}


def test_defaults_match_dense_at_small_defaults():
    fam = family("varlen_block_causal.mask", "varlen_block_causal")
    assert fam.defaults == {"docs": (3000, 1500, 4000), "block": 1024}
    mask = fam.lower(docs=[30, 15, 40], block=10)
    assert torch.equal(mask.to_dense(), exp_varlen_block_causal([30, 15, 40], 10))


def test_python_example_matches_dsl():
    module = runpy.run_path(str(EXAMPLES / "python_mask.py"))
    dsl = family("varlen_block_causal.mask", "varlen_block_causal")
    for params in ({"docs": [7, 2, 5], "block": 3}, {"docs": [9, 0, 4], "block": 2}):
        want = exp_varlen_block_causal(**params)
        for fam in (module["varlen_block_causal"], module["varlen_block_causal_loops"], dsl):
            assert torch.equal(fam.lower(**params).to_dense(), want)
