"""Input beyond what maskc supports (maskc.limits) is refused with one clear error, before any
large allocation; within the limits every number is exact."""

from __future__ import annotations

import pytest

import maskc
from maskc.dist.plan import make_plan
from maskc.errors import MaskError, MaskParamError, MaskSyntaxError
from maskc.frontend import load
from maskc.ir import AttnSlice, Mask
from maskc.limits import MAX_CP, MAX_NESTING, MAX_ROWS, MAX_TOKENS

WHOLE = "mask m(n: int = 4):\n    seqlen(n)\n    full(q=0:n, k=0:n)\n"
DOCS = "mask m(docs: seqlens = [4]):\n    seqlen(docs.end)\n"


def lower(source: str, **params: object) -> Mask:
    return load(source)["m"].lower(**params)


def test_areas_are_exact_up_to_the_longest_sequence() -> None:
    """int64 would wrap past 2^63; within MAX_TOKENS every area fits, and is checked against Python ints."""
    n = MAX_TOKENS
    assert Mask.from_cu_seqlens([0, n]).area() == n * n
    assert Mask.from_cu_seqlens([0, n], causal=True).area() == n * (n + 1) // 2
    assert Mask([AttnSlice((0, n // 2), (0, n), "causal")], n, n).area() == (2 * n - n // 2 + 1) * (n // 2) // 2
    assert Mask.from_cu_seqlens([0, n]).density() == 1.0
    assert AttnSlice((0, n), (0, n), "bi_causal").area() == n


@pytest.mark.parametrize("length", [MAX_TOKENS + 1, 2**32, 10**12])
def test_longer_sequences_are_refused(length: int) -> None:
    with pytest.raises(MaskError, match="more than maskc supports: at most 2,147,483,647 tokens"):
        Mask.from_cu_seqlens([0, length], causal=True)
    with pytest.raises(MaskError, match="ends past 2,147,483,647 tokens"):
        AttnSlice((0, length), (0, 1))
    with pytest.raises(MaskError, match="q tokens: .* is more than maskc supports"):
        lower(WHOLE, n=length)


@pytest.mark.slow
def test_a_mask_of_too_many_slices_is_refused() -> None:
    with pytest.raises(MaskError, match="documents in cu_seqlens_q: 16,777,217 is more than maskc supports"):
        Mask.from_cu_seqlens(range(MAX_ROWS + 2))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "params", "message"),
    [
        (WHOLE.replace("full(", "x = 99999999999999999999999\n    full("), {}, r"<string>:3:9: .*integer 99999999999999999999999 is outside"),
        (WHOLE.replace("full(", "x = n * n * n\n    full("), {"n": 2**31 - 1}, r"<string>:3:15: .*result of '\*' is outside"),
        (WHOLE.replace("full(", "x = n + 4611686018427387903\n    full("), {"n": 2}, r"result of '\+' is outside"),
        (WHOLE, {"n": 10**30}, "param 'n' .*is outside the integers maskc computes with"),
        (DOCS, {"docs": [10**12]}, "tokens in a document: 1,000,000,000,000 is more than maskc supports"),
        (DOCS, {"docs": [2**30, 2**30, 2**30]}, "tokens in all documents: 3,221,225,472 is more than"),
        (DOCS, {"docs": [2**63 - 1, 2]}, "tokens in a document"),
        (DOCS, {"docs": [1] * (MAX_ROWS + 1)}, "seqlens values: 16,777,217 is more than maskc supports"),
        (DOCS.replace("(docs.end)", "(docs.end)\n    for d in docs:\n        for b in chunks(d, 1):\n            full(q=b, k=b)"),
         {"docs": [MAX_TOKENS]}, r"<string>:4:18: .*chunks\(\): iterations: 2,147,483,647 is more than maskc supports"),
        (WHOLE.replace("full(q=0:n, k=0:n)", "for i in range(n * n):\n        full(q=0:1, k=0:1)"), {"n": 10**6},
         r"<string>:3:14: .*iterations: 1,000,000,000,000 is more than maskc supports"),
    ],
)  # fmt: skip
def test_oversized_or_overflowing_programs_are_one_clear_error(source: str, params: dict, message: str) -> None:
    with pytest.raises(maskc.MaskcError, match=message):
        lower(source, **params)


@pytest.mark.slow
def test_the_slices_a_program_emits_are_bounded() -> None:
    """The loop is within the limit; the slices its three statements emit are not."""
    body = "".join(f"        full(q=i:i+1, k={j}:{j + 1})\n" for j in range(3))
    source = f"mask m(n: int = 4):\n    seqlen(n)\n    for i in range(n):\n{body}"
    with pytest.raises(MaskError, match=r"<string>:6:9: .*full\(\): slices of the mask: 18,000,000 is more than maskc supports"):
        lower(source, n=6_000_000)


@pytest.mark.parametrize(
    "expression",
    ["(1 + " * 3000 + "n" + ")" * 3000, "-" * 3000 + "n", "n" + " + 1" * 3000, "(" * 150 + "n" + " + 1)" * 150],
    ids=["nested", "negations", "long sum", "just past the limit"],
)
def test_deeply_nested_programs_are_one_clear_error(expression: str) -> None:
    source = WHOLE.replace("full(", f"x = {expression}\n    full(")
    with pytest.raises(MaskSyntaxError, match=rf"<string>:3:\d+: nested too deeply: more than {MAX_NESTING} levels"):
        lower(source)
    assert lower(WHOLE.replace("full(", "x = " + "(" * 40 + "n" + " + 1)" * 40 + "\n    full(")).area() == 16


def test_plans_beyond_the_supported_size_are_refused() -> None:
    mask = Mask.from_cu_seqlens([0, 1 << 20], causal=True)
    with pytest.raises(MaskParamError, match="context-parallel ranks: 100,000 is more than maskc supports"):
        make_plan(mask, 100_000)
    with pytest.raises(MaskParamError, match="chunks of 1 tokens: 16,777,217 is more than"):
        make_plan(Mask.from_cu_seqlens([0, MAX_ROWS + 1]), 8, chunk_size=1)
    assert make_plan(Mask.from_cu_seqlens([0, 4096], causal=True), MAX_CP // 1024).cp_size == 4
