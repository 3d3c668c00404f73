"""The Python front: `@maskc.mask` families equal their DSL twins and fail at import."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import maskc
from maskc.errors import MaskError, MaskParamError
from maskc.frontend import MaskFamily, load
from maskc.frontend.params import Param

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def dsl(file: str, name: str) -> MaskFamily:
    return load(EXAMPLES / file)[name]


@maskc.mask
def block_causal(b: maskc.Builder, docs: maskc.SeqLens = (30, 15, 40), block: int = 8) -> None:
    b.seqlen(docs.end)
    blocks = b.chunks((docs.starts, docs.ends), block)
    b.full(q=blocks, k=(docs.starts[blocks.owner], blocks.ends))


@maskc.mask
def block_causal_loops(b: maskc.Builder, docs: maskc.CuSeqLens = (0, 30, 45, 85), block: int = 8) -> None:
    b.seqlen(docs.end)
    for d in docs:
        for blk in b.chunks(d, block):
            b.full(q=blk, k=(d.start, blk.end))


@maskc.mask
def shared_question(b: maskc.Builder, docs: maskc.SeqLens = (6, 3, 4)) -> None:
    b.seqlen(docs.end)
    question = docs[0]
    b.causal(q=question, k=question)
    answers = docs[1:]
    b.full(q=(answers.starts, answers.ends), k=question)
    b.causal(q=(answers.starts, answers.ends), k=(answers.starts, answers.ends))


@maskc.mask
def prefix_lm(b: maskc.Builder, docs: maskc.SeqLens = (7, 2, 5), prefix: int = 3) -> None:
    b.seqlen(docs.end)
    b.prefix_lm(seq=(docs.starts, docs.ends), prefix=prefix)


@maskc.mask
def global_sliding_window(b: maskc.Builder, n: int = 20, globals: int = 3, window: int = 2) -> None:
    b.seqlen(n)
    g = min(globals, n)
    b.full(q=range(n), k=(0, g))
    b.full(q=(0, g), k=range(0, n))
    b.band(q=(0, n), k=(0, n), left=window, right=window)


@maskc.mask(example={"rows": 3, "cols": 5})
def primitives(b: maskc.Builder, rows: int = 512, cols: int = 1024) -> None:
    b.seqlen(4 * rows, cols)
    for i, kind in enumerate((b.full, b.causal, b.inv_causal, b.bi_causal)):
        kind(q=(i * rows, (i + 1) * rows), k=(0, cols))


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.integers(0, 20), max_size=7), block=st.integers(1, 9))
def test_block_causal_equals_dsl(docs, block):
    reference = dsl("varlen_block_causal.mask", "varlen_block_causal").lower(docs=docs, block=block)
    cu = np.concatenate([[0], np.cumsum(np.asarray(docs, dtype=np.int64))])
    assert block_causal.lower(docs=docs, block=block).equivalent(reference)
    assert block_causal_loops.lower(docs=cu, block=block).equivalent(reference)
    assert block_causal.lower(docs=docs, block=block) == reference


@pytest.mark.parametrize(
    "fam,file,name,params",
    [
        (shared_question, "shared_question.mask", "shared_question", [{"docs": [4, 3, 5, 2]}, {"docs": [6]}]),
        (prefix_lm, "prefix_lm.mask", "prefix_lm", [{"docs": [7, 2, 5], "prefix": 3}, {"docs": [4, 0, 6], "prefix": 9}]),
        (
            global_sliding_window,
            "global_sliding_window.mask",
            "global_sliding_window",
            [{"n": 12, "globals": 2, "window": 1}, {"n": 5, "globals": 9, "window": 3}],
        ),
        (primitives, "primitives.mask", "primitives", [{"rows": 3, "cols": 5}, {"rows": 5, "cols": 3}]),
    ],
    ids=lambda x: x.name if isinstance(x, MaskFamily) else None,
)
def test_sugar_families_equal_dsl(fam, file, name, params):
    twin = dsl(file, name)
    for p in params:
        assert fam.lower(**p).equivalent(twin.lower(**p)), p
        assert torch.equal(fam.lower(**p).to_dense(), twin.lower(**p).to_dense())


def test_family_interface():
    assert isinstance(block_causal, MaskFamily)
    assert block_causal.name == "block_causal"
    assert block_causal.params == (Param("docs", "seqlens", (30, 15, 40)), Param("block", "int", 8))
    assert block_causal_loops.params[0] == Param("docs", "cu_seqlens", (0, 30, 45, 85))
    assert block_causal.defaults == {"docs": (30, 15, 40), "block": 8}
    assert block_causal.origin.startswith(__file__)
    assert block_causal.lower().seqlen_q == 85
    with pytest.raises(MaskParamError, match="mask 'block_causal': unknown param 'blk'; expected params: docs: seqlens"):
        block_causal.lower(blk=3)


def test_builder_accepts_ranges_in_many_forms():
    @maskc.mask
    def forms(b: maskc.Builder, docs: maskc.SeqLens = (2, 3)) -> None:
        b.seqlen(docs.end)
        first, second = docs
        b.full(q=first, k=first)
        b.causal(q=range(second.start, second.end), k=(np.int64(second.start), second.end))
        b.full(q=(np.array([0, 2]), np.array([1, 3])), k=(0, 1))

    want = torch.zeros(5, 5, dtype=torch.bool)
    want[0:2, 0:2] = True
    want[2:5, 2:5] = torch.ones(3, 3, dtype=torch.bool).tril()
    want[0, 0] = want[2, 0] = True
    assert torch.equal(forms.lower().to_dense(), want)


def test_import_time_failure_names_mask_and_call_site():
    with pytest.raises(MaskError) as e:

        @maskc.mask
        def broken(b: maskc.Builder, n: int = 8) -> None:
            b.seqlen(n)
            b.full(q=(5, 3), k=(0, n))

    text = str(e.value)
    assert "@maskc.mask 'broken'" in text and "failed to lower with its example params" in text
    assert f"{__file__}:" in text and "full(): q range 5:3 is reversed" in text


def test_import_time_failure_uses_the_example():
    with pytest.raises(MaskError, match=r"k range 0:12 ends past seqlen k=10"):

        @maskc.mask(example={"n": 10, "extra": 2})
        def too_long(b: maskc.Builder, n: int = 4, extra: int = 0) -> None:
            b.seqlen(n)
            b.full(q=(0, n), k=(0, n + extra))


@pytest.mark.parametrize(
    "body,error,text",
    [
        (lambda b, n: None, MaskError, "never called seqlen()"),
        (lambda b, n: (b.seqlen(n), b.seqlen(n)), MaskError, "seqlen() called twice"),
        (lambda b, n: (b.seqlen(n), b.full(q=(0, 1.5), k=(0, 1))), MaskError, "q end must be an int"),
        (lambda b, n: (b.seqlen(n), b.full(q=range(0, n, 2), k=(0, 1))), MaskError, "must be a contiguous range"),
        (lambda b, n: (b.seqlen(n), b.full(q=7, k=(0, 1))), MaskError, "q must be a (start, end) pair"),
        (lambda b, n: (b.seqlen(n), b.band(q=(0, n), k=(0, n), left=-1)), MaskError, "band(): left must be >= 0"),
        (lambda b, n: (b.seqlen(n), b.chunks((0, n), 0)), MaskError, "chunks(): chunk size must be positive, got 0"),
        (lambda b, n: (b.seqlen(n), b.prefix_lm(seq=(0, n), prefix=-2)), MaskError, "prefix must be >= 0"),
        (lambda b, n: b.seqlen(n, True), MaskError, "k: expected an int"),
    ],
)
def test_builder_errors(body, error, text):
    def make():
        def fn(b: maskc.Builder, n: int = 4) -> None:
            body(b, n)

        return maskc.mask(fn)

    with pytest.raises(error) as e:
        make()
    assert text in str(e.value)
    assert "@maskc.mask 'fn'" in str(e.value)


def test_doclist_is_not_a_range():
    with pytest.raises(MaskError, match=r"q is a document list; pass one document, or \(docs.starts, docs.ends\)"):

        @maskc.mask
        def whole(b: maskc.Builder, docs: maskc.SeqLens = (2, 2)) -> None:
            b.seqlen(docs.end)
            b.full(q=docs, k=docs)


def test_signature_errors():
    expected = "parameter 'n' must be a named parameter annotated int, maskc.SeqLens or maskc.CuSeqLens"
    with pytest.raises(MaskError, match=expected):

        @maskc.mask
        def float_param(b: maskc.Builder, n: float = 1.0) -> None:
            b.seqlen(1)

    with pytest.raises(MaskError, match="the first parameter must take the Builder"):

        @maskc.mask
        def no_builder(*, n: int = 1) -> None:
            pass

    with pytest.raises(MaskParamError, match=r"default of 'docs' \(seqlens\): document lengths must be >= 0"):

        @maskc.mask
        def bad_default(b: maskc.Builder, docs: maskc.SeqLens = (3, -1)) -> None:
            b.seqlen(docs.end)

    with pytest.raises(MaskParamError, match="missing param 'n' \\(no default\\)"):

        @maskc.mask
        def no_default(b: maskc.Builder, n: int) -> None:
            b.seqlen(n)

    with pytest.raises(MaskParamError, match="unknown param 'm'"):

        @maskc.mask(example={"m": 3})
        def wrong_example(b: maskc.Builder, n: int = 2) -> None:
            b.seqlen(n)


def test_user_exceptions_are_wrapped_with_the_mask_name():
    with pytest.raises(MaskError, match="@maskc.mask 'divides' .* ZeroDivisionError: integer division or modulo by zero") as e:

        @maskc.mask
        def divides(b: maskc.Builder, n: int = 2) -> None:
            b.seqlen(n // 0)

    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_later_lowering_errors_name_the_call_site():
    @maskc.mask
    def window(b: maskc.Builder, n: int = 8, w: int = 2) -> None:
        b.seqlen(n)
        b.band(q=(0, n), k=(0, n), left=w)

    with pytest.raises(MaskError, match=rf"{re.escape(__file__)}:\d+: in mask 'window': band\(\): left must be >= 0, got -1"):
        window.lower(w=-1)
