"""Property-based fuzzing of everything a user or a downloaded file feeds maskc: mask
programs (random, generated and mutated), the Python API that builds masks, and artifact
manifests. Each input either works (and a mask that lowers is exact against its dense form)
or raises maskc's own error; any other exception is a bug. Bounded so that CI stays fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maskc.artifact.manifest import write_manifest
from maskc.codegen import LoweredMask, write_artifact
from maskc.errors import ArtifactError, MaskcError
from maskc.frontend import load
from maskc.ir import AttnSlice, Mask
from maskc.runtime import load_artifact, open_manifest, register_artifact

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [p.read_text() for p in sorted((ROOT / "examples").glob("*.mask"))]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DENSE_LIMIT = 300  # masks up to this many tokens per side are also checked against their dense form


def lower_all(source: str) -> list[Mask]:
    """Every family of `source`, lowered with its defaults, where lowering succeeds."""
    masks = []
    for family in load(source).values():
        try:
            masks.append(family.lower())
        except MaskcError:
            continue
    return masks


def check_exact(mask: Mask) -> None:
    """A mask that lowered is valid IR whose area is the count of its dense form."""
    if max(mask.shape) <= DENSE_LIMIT:
        dense = mask.to_dense()
        assert mask.area() == int(dense.sum())
        assert mask.normalize().to_dense().equal(dense)


def attempt(build: Callable[[], T]) -> T | None:
    """What `build` returns, or None where it raises maskc's own error (any other propagates)."""
    try:
        return build()
    except MaskcError:
        return None


# ---- mask programs -----------------------------------------------------------------------

SYMBOLS = list("():,.[]=+-*/%<>#\n ") + ["    ", "for ", " in ", "if ", "else:", "mask ", "seqlen", "full", "causal", "docs",
                                        "chunks", "range", "n", "1", "0", "-5", "999999999999999999999", "band", "and "]  # fmt: skip


@FUZZ
@given(st.lists(st.sampled_from(SYMBOLS), max_size=60).map("".join))
def test_random_text_parses_or_is_a_maskc_error(source: str) -> None:
    for mask in attempt(lambda: lower_all(source)) or []:
        check_exact(mask)


@st.composite
def mutated_examples(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(EXAMPLES))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["delete", "insert", "replace"]))
        piece = draw(st.sampled_from(SYMBOLS + ["\x00", "\xff", "\t", "é"]))
        if kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 8)) :]
        else:
            text = text[:at] + piece + text[at + (kind == "replace") :]
    return text


@FUZZ
@given(mutated_examples())
def test_mutated_examples_lower_or_are_a_maskc_error(source: str) -> None:
    for mask in attempt(lambda: lower_all(source)) or []:
        check_exact(mask)


INTS = st.integers(-3, 40) | st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**62, -(2**63), 10**30])
OPERATORS = ["+", "-", "*", "//", "%"]


@st.composite
def expressions(draw: st.DrawFn, depth: int = 0) -> str:
    if depth > 2 or draw(st.booleans()):
        return draw(st.sampled_from(["n", "d.len", "d.start", "d.end", "docs.end", "docs.count"]) | INTS.map(str))
    left, right = draw(expressions(depth + 1)), draw(expressions(depth + 1))
    return f"({left} {draw(st.sampled_from(OPERATORS))} {right})"


@st.composite
def programs(draw: st.DrawFn) -> tuple[str, dict]:
    """Well-formed programs over documents whose numbers are random: most fail at lowering."""
    prim = draw(st.sampled_from(["full", "causal", "inv_causal", "bi_causal"]))
    lines = [
        "mask m(n: int = 8, docs: seqlens = [3, 5]):",
        f"    seqlen({draw(st.sampled_from(['docs.end', 'n', 'docs.end + n']))})",
        "    for d in docs:",
        f"        for b in chunks(d, {draw(expressions())}):",
        f"            {prim}(q=b, k=d.start:b.end)",
        f"        band(q=d, k=d, left={draw(expressions())}, right={draw(st.integers(0, 3))})",
        f"        if {draw(expressions())} > {draw(expressions())}:",
        f"            prefix_lm(seq=d, prefix={draw(expressions())})",
    ]
    lengths = draw(st.lists(st.integers(0, 40) | st.sampled_from([2**31 - 1, 2**40, -1]), max_size=6))
    return "\n".join(lines) + "\n", {"n": draw(INTS), "docs": lengths}


@pytest.mark.slow
@FUZZ
@given(programs())
def test_generated_programs_lower_exactly_or_are_a_maskc_error(program: tuple[str, dict]) -> None:
    source, params = program
    family = load(source)["m"]
    mask = attempt(lambda: family.lower(**params))
    if mask is not None:
        check_exact(mask)


# ---- the Python API ------------------------------------------------------------------------

ANY = st.recursive(
    st.none() | st.booleans() | INTS | st.floats(allow_nan=True) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner),
    max_leaves=8,
)


@pytest.mark.slow
@FUZZ
@given(st.lists(INTS, max_size=6) | ANY, st.booleans())
def test_from_cu_seqlens_builds_exact_masks_or_raises_a_maskc_error(cu: Any, causal: bool) -> None:
    mask = attempt(lambda: Mask.from_cu_seqlens(cu, causal=causal))
    if mask is not None:
        check_exact(mask)


@FUZZ
@given(st.lists(st.tuples(ANY, ANY, ANY), max_size=4), ANY, ANY)
def test_slices_from_any_values_build_exact_masks_or_raise_a_maskc_error(rows: list, sq: Any, sk: Any) -> None:
    def build() -> Mask:
        return Mask([AttnSlice(q, k, t) for q, k, t in rows], sq, sk)

    mask = attempt(build)
    if mask is not None:
        check_exact(mask)


@FUZZ
@given(ANY, ANY, ANY, ANY, ANY)
def test_from_arrays_and_windows_accept_exact_masks_only(q: Any, k: Any, t: Any, sq: Any, left: Any) -> None:
    for build in (lambda: Mask.from_arrays(q, k, t, sq, sq), lambda: Mask.sliding_window(q, left)):
        mask = attempt(build)
        if mask is not None:
            check_exact(mask)


@FUZZ
@given(ANY, ANY, ANY, st.booleans())
def test_documents_crops_and_stacks_of_any_values_are_exact_or_a_maskc_error(ids: Any, other: Any, n: Any, causal: bool) -> None:
    docs = Mask.from_cu_seqlens([0, 3, 8], causal=causal)
    for build in (
        lambda: Mask.from_document_ids(ids, causal=causal, prefix=n, key_document_ids=other),
        lambda: Mask.from_position_ids(ids, causal=causal, window=n, attention_mask=other),
        lambda: Mask.sliding_window([0, 3, 8], 2, cu_seqlens_k=ids, prefix=n),
        lambda: docs.crop(ids, other),
        lambda: Mask.stack(ids),
    ):
        mask = attempt(build)
        if mask is not None:
            check_exact(mask)


# ---- artifact manifests ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz_artifact")
    write_artifact(out, [LoweredMask("docs", {"docs": [3, 5]}, Mask.from_cu_seqlens([0, 3, 8], causal=True))])
    return out


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4) | st.sampled_from(["docs.ir.json", "0" * 64]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["ir", "fields", "key", "x"]), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def corruptions(draw: st.DrawFn, body: dict) -> dict:
    """The manifest with a value somewhere replaced, or a key deleted."""
    body = json.loads(json.dumps(body))
    node: Any = body
    path = []
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append((node, key))
        node = node[key]
    if not path:
        key = draw(st.sampled_from(sorted(body)))
        path.append((body, key))
    parent, key = path[-1]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(JSON)
    return body


@settings(FUZZ, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupted_manifests_are_artifact_errors(manifest_dir: Path, data: st.DataObject) -> None:
    """Corrupt the manifest (rehashing its files, as a careless or malicious writer would):
    loading it succeeds or raises ArtifactError, never another exception."""
    original = json.loads((manifest_dir / "manifest.json").read_text())
    corrupted = data.draw(corruptions(original))
    try:
        (manifest_dir / "manifest.json").write_text(json.dumps(corrupted))
        for action in (open_manifest, load_artifact, register_artifact):
            try:
                action(manifest_dir)
            except ArtifactError:
                pass
    finally:
        write_manifest(manifest_dir, {k: v for k, v in original.items() if k != "format_version"})
    assert load_artifact(manifest_dir).masks["docs"] == Mask.from_cu_seqlens([0, 3, 8], causal=True)
