"""The mask language: loading, syntax and semantic errors, value errors, params, semantics,
and the vectorised lowering checked against a naive loop-by-loop reading."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maskc.errors import MaskError, MaskParamError, MaskSemanticError, MaskSyntaxError
from maskc.frontend import load
from maskc.frontend.params import DocList, Param, Range, SeqLens

ROOT = Path(__file__).resolve().parent.parent


def family(src: str, name: str | None = None):
    families = load(src)
    return families[name] if name else next(iter(families.values()))


def spans(lens: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lens:
        out.append((start, start + n))
        start += n
    return out


# Loading.

TWO = """\
# two families
mask b_first(n: int = 4):
    seqlen(n)
    full(q=0:n, k=0:n)

mask a_second(docs: seqlens = [2, 3], w: int = 1 + 1):
    seqlen(docs.end)
    for d in docs:
        band(q=d, k=d, left=w)
"""


def test_load_text_path_and_str_path(tmp_path):
    path = tmp_path / "two.mask"
    path.write_text(TWO)
    for source in (TWO, path, str(path)):
        families = load(source)
        assert list(families) == ["b_first", "a_second"]
    assert families["a_second"].params == (Param("docs", "seqlens", (2, 3)), Param("w", "int", 2))
    assert families["a_second"].defaults == {"docs": (2, 3), "w": 2}
    assert families["b_first"].origin == f"{path}:2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        families["b_first"].params[0].name = "m"  # type: ignore[misc]


def test_missing_mask_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="mask file not found: .*nope.mask"):
        load(str(tmp_path / "nope.mask"))
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope.txt")


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.mask"
    path.write_text("mask m(n: int = 4):\n    seqlen(n)\n    full(q=0:n, k=0:n\n")
    with pytest.raises(MaskSyntaxError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}:")
    assert e.value.source == str(path)


def test_source_without_trailing_newline_or_with_comments_and_blank_lines():
    src = "\n\n# header\nmask m(n: int = 3):  # trailing\n\n    # inside\n    seqlen(n)   \n\n    causal(q=0:n, k=0:n)"
    assert torch.equal(family(src).lower().to_dense(), torch.ones(3, 3, dtype=torch.bool).tril())


def test_multiline_arguments_and_trailing_commas():
    src = "mask m(\n    n: int = 3,\n    m: int = 2,\n):\n    seqlen(\n        q=n,\n        k=m,\n    )\n    full(q=0:n, k=0:m,)\n"
    mask = family(src).lower()
    assert (mask.seqlen_q, mask.seqlen_k) == (3, 2)


@pytest.mark.slow
def test_frontend_import_does_not_pull_lark():
    code = (
        "import sys\n"
        "import maskc.frontend, maskc.frontend.params, maskc.frontend.mask_family, maskc.frontend.python_front\n"
        "import maskc.frontend.lower, maskc.frontend.check, maskc.frontend.emit\n"
        "assert 'lark' not in sys.modules, 'lark imported'\n"
        "maskc.frontend.load('mask m(n: int = 2):\\n    seqlen(n)\\n')\n"
        "assert 'lark' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# Syntax errors: (source, line, column, text in the message).

SYNTAX_ERRORS = [
    ("mask m(n: int = 8):\n    seqlen(n)\n    for d in range(n)\n        full(q=d:d, k=d:d)\n", 3, 22, "expected ':'"),
    ("mask m(n: int = 8)\n    seqlen(n)\n", 1, 19, "unexpected end of line; expected ':'"),
    ("mask m(n: int = 8):\nseqlen(n)\n", 2, 1, "expected an indented block"),
    ("mask m(n: int = 8):\n    seqlen(n)\n      full(q=0:n, k=0:n)\n", 3, 7, "unexpected indent"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    if n > 2:\n        seqlen(n)\n      seqlen(n)\n", 5, 7, "unindent does not match"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    full(q=0:n, k=0:n @ 2)\n", 3, 23, "unexpected character '@'"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    x = \n", 3, 9, "expected an expression"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    full(q=0:n, k=)\n", 3, 19, "unexpected ')'; expected an expression"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    full(q=0:n k=0:n)\n", 3, 16, "unexpected 'k'; expected one of: '(', ')', ','"),
    ("mask (n: int = 8):\n    seqlen(n)\n", 1, 6, "unexpected '('; expected a name"),
    ("mask m(n: int = 8):\n", 1, 20, "unexpected end of file; expected an indented block"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    5 + 3\n", 3, 5, "unexpected '5'"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    x = [1, 2]\n", 3, 9, "unexpected '['"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    x = (0:n)\n", 3, 11, "unexpected ':'"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    x = n / 2\n", 3, 11, "use '//' for integer division"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    x = 1.5\n", 3, 9, "1.5 is not an integer"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    full(q=0:n, 0:n)\n", 3, 17, "positional argument after a keyword argument"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    assert n > 1, 'single'\n", 3, 19, "unexpected character"),
    ("mask m(n: int = 8):\n    seqlen(n)\n    for x in 0:n:\n        seqlen(x)\n", 3, 16, "unexpected 'n'; expected a new line"),
]


@pytest.mark.parametrize("src,line,col,text", SYNTAX_ERRORS)
def test_syntax_errors(src, line, col, text):
    with pytest.raises(MaskSyntaxError) as e:
        load(src)
    assert (e.value.line, e.value.column) == (line, col), str(e.value)
    assert str(e.value).startswith(f"<string>:{line}:{col}: ")
    assert text in str(e.value)


# Semantic errors (checked at load time, before any parameter value is known).

H = "mask m(n: int = 8, docs: seqlens = [3, 5]):\n    seqlen(n)\n"

SEMANTIC_ERRORS = [
    (H + "    full(q=0:nn, k=0:n)\n", 3, 14, "unknown name 'nn'; did you mean 'n'?"),
    (H + "    fulll(q=0:n, k=0:n)\n", 3, 5, "unknown function 'fulll'; did you mean 'full'?"),
    (H + "    full(q=0:n)\n", 3, 5, "full() is missing 'k'"),
    (H + "    full(q=0:n, k=0:n, j=3)\n", 3, 24, "full() has no parameter 'j'; its parameters are q, k"),
    (H + "    full(q=0:n, q=0:n)\n", 3, 17, "full() got two values for 'q'"),
    (H + "    full(0:n, 0:n, 0:n)\n", 3, 5, "full() takes at most 2 arguments (3 given)"),
    (H + "    full(q=n, k=0:n)\n", 3, 12, "full() argument 'q' must be a range, got an int"),
    (H + "    for x in n:\n        seqlen(x)\n", 3, 14, "cannot iterate over an int"),
    (H + "    for d in docs:\n        c = d.count\n", 4, 15, "range has no attribute .count; a range has .start, .end, .len"),
    (H + "    c = docs.size\n", 3, 14, "document list has no attribute .size"),
    (H + "    c = n.start\n", 3, 11, "int has no attribute .start"),
    (H + "    seqlen(n)\n", 3, 5, "seqlen() is called twice (first at line 2)"),
    ("mask m(n: int = 8):\n    full(q=0:n, k=0:n)\n", 1, 6, "mask 'm' never calls seqlen"),
    ("mask m(docs: seqlens = [1]):\n    for d in docs:\n        seqlen(d.len)\n", 3, 9, "seqlen() must be at the top level"),
    ("mask m(n: int = 1):\n    if n > 0:\n        seqlen(n)\n", 3, 9, "seqlen() must be at the top level"),
    (H + "mask m(n: int = 4):\n    seqlen(n)\n", 3, 6, "mask 'm' is defined twice (first at line 1)"),
    ("mask m(n: int = 8, n: int = 3):\n    seqlen(n)\n", 1, 20, "duplicate param 'n' in mask 'm'"),
    ("mask m(n: float = 8):\n    seqlen(n)\n", 1, 8, "unknown type 'float'; expected one of: int, seqlens, cu_seqlens"),
    ("mask m(n: int = [8]):\n    seqlen(n)\n", 1, 17, "default of int param 'n' must be an int"),
    ("mask m(docs: seqlens = 8):\n    seqlen(docs.end)\n", 1, 24, "must be a list literal"),
    ("mask m(docs: seqlens = [3, -1]):\n    seqlen(docs.end)\n", 1, 24, "document lengths must be >= 0"),
    ("mask m(docs: cu_seqlens = [1, 3]):\n    seqlen(docs.end)\n", 1, 27, "cu_seqlens must start at 0"),
    ("mask m(n: int = 4, k: int = n):\n    seqlen(n)\n", 1, 29, "unknown name 'n' (parameter defaults must be constants)"),
    (H + "    x = min(n)\n", 3, 9, "min() takes at least 2 arguments (1 given)"),
    (H + "    x = max(n, b=2)\n", 3, 16, "max() takes no keyword arguments"),
    (H + "    for i in range(1, 2, 3, 4):\n        seqlen(i)\n", 3, 14, "range() takes 1 to 3 arguments (4 given)"),
    (H + "    if n:\n        seqlen(n)\n", 3, 8, "condition must be a bool, got an int"),
    (H + "    assert n, \"msg\"\n", 3, 12, "assert condition must be a bool"),
    (H + "    assert n > 1, \"a\x00b\"\n", 3, 5, "is not a valid string: source code string cannot contain null bytes"),
    (H + "    x = docs + 1\n", 3, 14, "unsupported operand types for +: document list and int"),
    (H + "    x = -docs\n", 3, 10, "operand of unary - must be an int"),
    (H + "    x = not n\n", 3, 13, "operand of not must be a bool"),
    (H + "    x = n < 3 and n\n", 3, 19, "operand of and must be a bool"),
    (H + "    x = docs < 3\n", 3, 9, "compared value must be an int, got a document list"),
    (H + "    x = full(q=0:n, k=0:n)\n", 3, 9, "full() emits slices and has no value"),
    (H + "    chunks(0:n, 2)\n", 3, 5, "chunks() returns a value that is not used"),
    (H + "    min(1, 2)\n", 3, 5, "min() returns a value that is not used; assign it"),
    (H + "    x = chunks(0:n, docs)\n", 3, 21, "chunks() argument 'size' must be an int"),
    (H + "    for d in docs:\n        n = 3\n", 4, 9, "cannot assign 'n' here"),
    (H + "    if n > 1:\n        n = 3\n", 4, 9, "cannot assign 'n' here"),
    (H + "    for n in docs:\n        full(q=n, k=n)\n", 3, 5, "loop variable 'n' shadows an existing variable"),
    (H + "    for d in docs:\n        y = d.start\n    x = y\n", 5, 9, "unknown name 'y'"),
    (H + "    if n > 1:\n        y = 1\n    else:\n        y = 2\n    x = y\n", 7, 9, "unknown name 'y'"),
    (H + "    x = n[0]\n", 3, 9, "the indexed value must be a document list, got an int"),
    (H + "    x = docs[0:1]\n    y = x[docs]\n", 4, 11, "index must be an int, got a document list"),
    (H + "    r = 0:n\n    x = r[1:]\n", 4, 9, "the sliced value must be a document list, got a range"),
    (H + "    x = 1:docs\n", 3, 11, "range end must be an int"),
]


@pytest.mark.parametrize("src,line,col,text", SEMANTIC_ERRORS)
def test_semantic_errors(src, line, col, text):
    with pytest.raises(MaskSyntaxError) as e:
        load(src)
    assert (e.value.line, e.value.column) == (line, col), str(e.value)
    assert str(e.value).startswith(f"<string>:{line}:{col}: ")
    assert text in str(e.value), str(e.value)


def test_semantic_errors_are_their_own_class():
    with pytest.raises(MaskSemanticError):
        load(H + "    x = nope\n")
    with pytest.raises(MaskSemanticError, match="no mask definitions"):
        load("# only a comment\n")


# Errors that depend on values: reported at lowering, at the offending statement.

P = "mask m(n: int = 8, docs: seqlens = [3, 5], w: int = 2):\n    seqlen(n)\n"

VALUE_ERRORS = [
    (P + "    full(q=w:1, k=0:n)\n", {"w": 5}, "<string>:3:12: in mask 'm': range 5:1 is reversed (start > end)"),
    (P + "    full(q=0:n, k=0:n + w)\n", {"w": 1}, "<string>:3:5: in mask 'm': full(): k range 0:9 ends past seqlen k=8"),
    (P + "    causal(q=n - 9:n, k=0:n)\n", {}, "<string>:3:5: in mask 'm': causal(): q range -1:8 starts before 0"),
    (P + "    for d in docs:\n        for b in chunks(d, w):\n            full(q=b, k=b)\n", {"w": 0},
     "<string>:4:18: in mask 'm': chunks(): chunk size must be positive, got 0"),
    (P + "    for d in docs:\n        for b in chunks(d, w):\n            full(q=b, k=b)\n", {"w": -4},
     "<string>:4:18: in mask 'm': chunks(): chunk size must be positive, got -4"),
    (P + "    assert w > 0, \"w must be positive\"\n", {"w": -1}, "<string>:3:5: in mask 'm': assertion failed: w must be positive"),
    (P + "    for d in docs:\n        assert d.len < 5\n", {}, "<string>:4:9: in mask 'm': assertion failed"),
    (P + "    x = docs[w]\n", {"w": 2}, "<string>:3:14: in mask 'm': index 2 out of range for a list of 2 documents"),
    (P + "    x = docs[w]\n", {"w": -3}, "index -3 out of range"),
    (P + "    x = n // w\n", {"w": 0}, "<string>:3:11: in mask 'm': integer division by zero"),
    (P + "    x = n % w\n", {"w": 0}, "modulo by zero"),
    (P + "    band(q=0:n, k=0:n, left=w)\n", {"w": -3}, "<string>:3:5: in mask 'm': band(): left must be >= 0, got -3"),
    (P + "    band(q=0:n, k=0:n, right=w)\n", {"w": -1}, "band(): right must be >= 0, got -1"),
    (P + "    prefix_lm(seq=0:n, prefix=w)\n", {"w": -3}, "prefix_lm(): prefix must be >= 0, got -3"),
    (P + "    for i in range(0, n, w):\n        full(q=i:i + 1, k=i:i + 1)\n", {"w": 0}, "<string>:3:14: in mask 'm': range() step must not be 0"),
    ("mask m(n: int = 8):\n    seqlen(n)\n", {"n": -1}, "<string>:2:5: in mask 'm': seqlen(): q must be >= 0, got -1"),
    (P + "    for d in docs:\n        full(q=d, k=d.start:d.end + 1)\n", {"docs": [3, 4, 1]},
     "<string>:4:9: in mask 'm': full(): k range 7:9 ends past seqlen k=8"),
]


@pytest.mark.parametrize("src,params,text", VALUE_ERRORS)
def test_value_errors_at_lowering(src, params, text):
    fam = family(src)
    with pytest.raises(MaskError) as e:
        fam.lower(**params)
    assert text in str(e.value)


def test_value_errors_only_where_rows_exist():
    """A statement in an untaken branch or an empty loop never raises."""
    src = P + "    if w > 100:\n        full(q=5:1, k=0:n)\n    for i in range(0):\n        x = n // 0\n"
    assert len(family(src).lower()) == 0


# Params.

PARAM_SRC = "mask m(n: int = 8, docs: seqlens = [3, 5], cu: cu_seqlens = [0, 4]):\n    seqlen(n)\n"


@pytest.mark.parametrize(
    "params,text",
    [
        ({"nn": 3}, "mask 'm': unknown param 'nn'; expected params: n: int = 8, docs: seqlens = [3, 5], cu: cu_seqlens = [0, 4]"),
        ({"n": 1.5}, "param 'n' (int): expected an int, got float 1.5"),
        ({"n": 8.0}, "expected an int"),
        ({"n": True}, "expected an int, got bool"),
        ({"n": "8"}, "expected an int"),
        ({"n": torch.tensor(2.0)}, "expected an int"),
        ({"docs": [1, 2.0]}, "param 'docs' (seqlens): seqlens must hold ints, got float 2.0"),
        ({"docs": [1, True]}, "must hold ints, got bool"),
        ({"docs": [[1, 2]]}, "seqlens must be 1-D"),
        ({"docs": np.ones((2, 2), dtype=np.int64)}, "must be 1-D, got shape (2, 2)"),
        ({"docs": [1, -2]}, "document lengths must be >= 0, got -2 at index 1"),
        ({"docs": np.array([1.0])}, "must hold ints, got dtype float64"),
        ({"docs": torch.tensor([True])}, "must hold ints, got dtype bool"),
        ({"docs": "abc"}, "must be a list, tuple, numpy array or CPU tensor of ints"),
        ({"docs": 5}, "must be a list, tuple, numpy array or CPU tensor of ints"),
        ({"cu": [0, 5, 4]}, "param 'cu' (cu_seqlens): cu_seqlens must be non-decreasing, got 4 after 5 at index 2"),
        ({"cu": [2, 5]}, "cu_seqlens must start at 0"),
        ({"cu": []}, "cu_seqlens must start at 0"),
    ],
)
def test_param_errors(params, text):
    with pytest.raises(MaskParamError) as e:
        family(PARAM_SRC).lower(**params)
    assert text in str(e.value)


def test_missing_param_without_default():
    fam = family("mask m(docs: seqlens, n: int = 2):\n    seqlen(n)\n")
    expected = r"mask 'm': missing param 'docs' \(no default\); expected params: docs: seqlens, n: int = 2"
    with pytest.raises(MaskParamError, match=expected):
        fam.lower()
    assert fam.defaults == {"n": 2}


@pytest.mark.parametrize(
    "docs",
    [[3, 0, 5], (3, 0, 5), np.array([3, 0, 5], dtype=np.int32), torch.tensor([3, 0, 5]), np.array([3, 0, 5], dtype=np.uint16)],
    ids=["list", "tuple", "numpy-int32", "torch", "numpy-uint16"],
)
def test_list_params_accept_many_containers(docs):
    src = """\
mask m(docs: seqlens = [1], cu: cu_seqlens = [0, 1]):
    seqlen(docs.end)
    for d in docs:
        causal(q=d, k=d)
"""
    fam = family(src)
    cu = np.concatenate([[0], np.cumsum(np.asarray(docs, dtype=np.int64))])
    cu_like = torch.tensor(cu) if isinstance(docs, torch.Tensor) else cu
    assert fam.lower(docs=docs) == fam.lower(docs=[3, 0, 5])
    assert fam.lower(docs=docs, cu=cu_like).seqlen_q == 8
    assert fam.lower(docs=docs, cu=np.int64(0) + cu).seqlen_q == 8


def test_int_params_accept_numpy_and_tensor_scalars():
    fam = family("mask m(n: int = 1):\n    seqlen(n)\n    full(q=0:n, k=0:n)\n")
    assert fam.lower(n=np.int32(5)).seqlen_q == 5
    assert fam.lower(n=torch.tensor(6)).seqlen_q == 6


def test_seqlens_and_cu_seqlens_describe_the_same_documents():
    src = """\
mask a(docs: seqlens = [1]):
    seqlen(docs.end)
    for d in docs:
        causal(q=d, k=d)

mask b(docs: cu_seqlens = [0, 1]):
    seqlen(docs.end)
    for d in docs:
        causal(q=d, k=d)
"""
    fams = load(src)
    assert fams["a"].lower(docs=[4, 0, 2]) == fams["b"].lower(docs=[0, 4, 4, 6])


def test_doclist_value_type():
    docs = SeqLens(np.array([0, 3, 3, 8]))
    assert (docs.start, docs.end, docs.len, docs.count, len(docs)) == (0, 8, 8, 3, 3)
    assert list(docs) == [Range(0, 3), Range(3, 3), Range(3, 8)]
    assert docs[-1] == (3, 8) and docs[-1].len == 5
    sub = docs[1:]
    assert isinstance(sub, DocList) and (sub.start, sub.end, sub.count) == (3, 8, 2)
    assert docs[5:].count == 0 and docs[5:].start == 8
    assert docs.starts.tolist() == [0, 3, 3] and docs.ends.tolist() == [3, 3, 8] and docs.lens.tolist() == [3, 0, 5]
    with pytest.raises(ValueError):
        docs.bounds[0] = 1
    with pytest.raises(IndexError):
        docs[3]


# Semantics of the language.


def k_end(src_body: str, **params) -> int:
    """Value of an int expression, read back through a one-slice mask: full(q=0:1, k=0:500+E)."""
    src = (
        "mask m(a: int = 0, b: int = 1, docs: seqlens = [2, 3, 4]):\n"
        f"    seqlen(1000)\n    full(q=0:1, k=0:500 + {src_body})\n"
    )
    return int(family(src).lower(**params).k_ranges[0, 1]) - 500


@pytest.mark.parametrize("a", [-7, -3, 0, 4, 9])
@pytest.mark.parametrize("b", [-4, -1, 2, 5])
def test_arithmetic_matches_python(a, b):
    assert k_end("a // b", a=a, b=b) == a // b
    assert k_end("a % b", a=a, b=b) == a % b
    assert k_end("-a * b - (a - b) + min(a, b, 3) - max(a, b)", a=a, b=b) == -a * b - (a - b) + min(a, b, 3) - max(a, b)


def test_attributes_and_indexing():
    assert k_end("docs.start + docs.end * 10 + docs.len * 100 + docs.count * 1000 - 3900") == 0 + 90 + 900 + 3000 - 3900
    assert k_end("docs[-1].start") == 5
    assert k_end("docs[1:].start * 10 + docs[1:].count") == 22
    assert k_end("docs[:-1].end") == 5
    assert k_end("docs[a:b].count", a=-2, b=100) == 2
    assert k_end("docs[a:b].count + docs[a:b].start", a=2, b=1) == 0 + 5


def test_conditions_short_circuit_and_chain():
    src = """\
mask m(docs: seqlens = [2, 1, 0, 3, 1]):
    seqlen(docs.end)
    for i in range(docs.count + 1):
        if i < docs.count and docs[i].len > 1:
            d = docs[i]
            full(q=d, k=d)
        elif i >= docs.count or docs[i].len == 0:
            x = docs[i % docs.count]
        elif not 0 < i <= 2:
            d = docs[i]
            causal(q=d, k=d.start - 1:d.end)
        else:
            assert 1 < i + 1 == 2 != 3, "only i == 1 gets here"
            d = docs[i]
            inv_causal(q=d, k=0:d.end)
"""
    mask = family(src).lower()
    want = torch.zeros(7, 7, dtype=torch.bool)
    want[0:2, 0:2] = True
    want[2, 0:3] = True  # inv_causal is top-left aligned: its single query sees keys 0..2
    want[3:6, 3:6] = True
    want[6, 5:7] = True  # causal is bottom-right aligned: its single query sees both keys
    assert torch.equal(mask.to_dense(), want)


def test_range_steps_and_rebinding_at_one_level():
    src = """\
mask m(n: int = 10, s: int = 3):
    seqlen(n)
    x = n - 1
    x = x - 1
    for t in range(x, -1, -s):
        full(q=t:t + 1, k=t:t + 1)
    for t in range(1, n, s):
        causal(q=t:t + 1, k=0:t + 1)
"""
    dense = family(src).lower().to_dense()
    rows = set(range(8, -1, -3)) | set(range(1, 10, 3))
    want = torch.zeros(10, 10, dtype=torch.bool)
    for t in rows:
        want[t, t] = True
    for t in range(1, 10, 3):
        want[t, : t + 1] = True
    assert torch.equal(dense, want)


def test_sibling_loops_reuse_names():
    src = """\
mask m(docs: seqlens = [2, 3]):
    seqlen(docs.end)
    for d in docs:
        x = d
        full(q=x, k=x)
    for d in docs:
        x = d.start:d.start + 1
        causal(q=x, k=x)
"""
    assert family(src).lower().area() == 4 + 9


def test_empty_docs_and_empty_ranges_emit_nothing():
    src = """\
mask m(docs: seqlens = [1]):
    seqlen(docs.end)
    for d in docs:
        full(q=d, k=d)
    full(q=0:0, k=0:docs.end)
"""
    fam = family(src)
    assert len(fam.lower(docs=[])) == 0
    assert len(fam.lower(docs=[0, 0, 2])) == 1


def test_seqlen_with_separate_q_and_k():
    src = "mask m(n: int = 3):\n    seqlen(q=n, k=2 * n)\n    full(q=0:n, k=n:2 * n)\n"
    mask = family(src).lower()
    assert (mask.seqlen_q, mask.seqlen_k, mask.area()) == (3, 6, 9)


# Vectorised lowering against a naive reading.

MIX = """\
mask mix(docs: seqlens = [5, 3, 8], block: int = 3, w: int = 2, p: int = 2, lo: int = 0, hi: int = 9):
    seqlen(docs.end)
    for i in range(docs.count):
        d = docs[i]
        if d.len == 0:
            assert d.start == d.end, "empty"
        elif i % 3 == 0 and d.len > block:
            for b in chunks(d, block):
                full(q=b, k=d.start:b.end)
        elif i % 3 == 1 or d.len <= 2:
            band(q=d, k=d, left=w, right=min(w, 1))
        else:
            prefix_lm(seq=d, prefix=p)
        if i + 1 < docs.count and docs[i + 1].len > 2:
            nxt = docs[i + 1]
            full(q=d, k=nxt.start:nxt.start + 1)
    for d in docs[lo:hi]:
        for t in range(d.start, d.end, 2):
            causal(q=t:t + 1, k=max(d.start, t - 1):t + 1)
    for j in range(docs.count):
        first = docs[j].start:docs[j].start + min(docs[j].len, 1)
        for e in docs[j + 1:j + 3]:
            full(q=e.start:e.start + min(e.len, 1), k=first)
"""


def naive_mix(docs, block, w, p, lo, hi) -> torch.Tensor:
    """The MIX family read one iteration at a time with plain Python."""
    sp = spans(docs)
    n = sum(docs)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, (s, e) in enumerate(sp):
        length = e - s
        if length == 0:
            pass
        elif i % 3 == 0 and length > block:
            for bs in range(s, e, block):
                be = min(bs + block, e)
                m[bs:be, s:be] = True
        elif i % 3 == 1 or length <= 2:
            right = min(w, 1)
            for a in range(s, e):
                for b in range(s, e):
                    if a - w <= b <= a + right:
                        m[a, b] = True
        else:
            pe = min(s + p, e)
            m[s:pe, s:pe] = True
            for a in range(pe, e):
                m[a, s : a + 1] = True
        if i + 1 < len(sp) and sp[i + 1][1] - sp[i + 1][0] > 2:
            m[s:e, sp[i + 1][0]] = True
    for s, e in sp[lo:hi]:
        for t in range(s, e, 2):
            m[t, max(s, t - 1) : t + 1] = True
    for j, (s, e) in enumerate(sp):
        for s2, e2 in sp[j + 1 : j + 3]:
            m[s2 : s2 + min(e2 - s2, 1), s : s + min(e - s, 1)] = True
    return m


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.integers(0, 12), max_size=8),
    block=st.integers(1, 5),
    w=st.integers(0, 4),
    p=st.integers(0, 6),
    lo=st.integers(-9, 9),
    hi=st.integers(-9, 9),
)
def test_vectorised_matches_naive(docs, block, w, p, lo, hi):
    mask = family(MIX).lower(docs=docs, block=block, w=w, p=p, lo=lo, hi=hi)
    assert torch.equal(mask.to_dense(), naive_mix(docs, block, w, p, lo, hi))


def test_lowering_is_fast_for_a_million_tokens():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 1000, 4000)
    lens = lens * (1 << 20) // lens.sum()
    lens[-1] += (1 << 20) - lens.sum()
    fam = load(ROOT / "examples" / "varlen_block_causal.mask")["varlen_block_causal"]
    fam.lower(docs=lens, block=2048)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        mask = fam.lower(docs=lens, block=2048)
        times.append(time.perf_counter() - t0)
    assert mask.seqlen_q == 1 << 20 and len(mask) > 3000
    assert sorted(times)[3] < 0.05, times


def test_error_messages_carry_locations_everywhere():
    """Every MaskSyntaxError's message starts with its own source:line:col."""
    for src, *_ in SYNTAX_ERRORS + SEMANTIC_ERRORS:
        with pytest.raises(MaskSyntaxError) as e:
            load(src)
        assert re.match(rf"{re.escape(e.value.source)}:{e.value.line}:{e.value.column}: ", str(e.value))
