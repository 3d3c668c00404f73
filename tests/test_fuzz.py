"""Property-based fuzzing of everything a user or a downloaded file feeds maskc: mask
programs (random, generated and mutated), the Python API that builds masks, batches of masks
with padding (against dense attention), prepared plans and artifact manifests. Each input either works (and a mask that lowers is exact against its dense form)
or raises maskc's own error; any other exception is a bug. Bounded so that CI stays fast."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import maskc
from maskc.artifact.kernel_families import HeadDim
from maskc.artifact.manifest import write_manifest
from maskc.codegen import LoweredMask, write_artifact
from maskc.errors import ArtifactError, MaskcError, MaskError
from maskc.frontend import load
from maskc.ir import AttnSlice, Mask
from maskc.runtime import call_plan, load_artifact, open_manifest, plan_records, register_artifact, signing

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


# ---- batches: q [B, S, H, D], one mask a row or a stacked one, padding -------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """float64 attention of one row over a dense [S, S] mask, GQA by repeating K/V heads; a query
    that sees no key gives 0."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", weights, v)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Mask], bool, list[tuple[int, int]] | None, torch.dtype]:
    """Per batch row a mask of random documents (causal or not), shared or stacked, and maybe a
    run of real tokens per row as an attention_mask of some dtype."""
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    shared = draw(st.booleans())

    def row() -> Mask:
        cuts = sorted(draw(st.lists(st.integers(0, s), max_size=4)))
        return Mask.from_cu_seqlens([0, *cuts, s], causal=draw(st.booleans()))

    rows = [row()] * b if shared else [row() for _ in range(b)]
    runs = None
    if draw(st.booleans()):
        runs = [tuple(sorted(draw(st.tuples(st.integers(0, s), st.integers(0, s))))) for _ in range(b)]
    return rows, shared, runs, draw(st.sampled_from([torch.bool, torch.int64, torch.float32]))


@FUZZ
@given(batches(), st.sampled_from([(2, 1), (4, 2), (2, 2)]))
def test_random_batches_match_dense_attention(batch: tuple, heads: tuple[int, int]) -> None:
    rows, shared, runs, dtype = batch
    b, s = len(rows), rows[0].seqlen_q
    g = torch.Generator().manual_seed(b * 1000 + s)
    q, k, v = (torch.randn(b, s, h, 16, generator=g) for h in (heads[0], heads[1], heads[1]))
    real = torch.ones(b, s, dtype=torch.bool)
    if runs is not None:
        real = torch.tensor([[a <= i < e for i in range(s)] for a, e in runs]).reshape(b, s)
    padding = None if runs is None else real.to(dtype)
    out, meta = maskc.attention(q, k, v, rows[0] if shared else Mask.stack(rows), attention_mask=padding)
    for i, mask in enumerate(rows):
        allowed = mask.to_dense() & real[i][:, None] & real[i][None, :]
        torch.testing.assert_close(out[i].double(), dense_attention(q[i], k[i], v[i], allowed), atol=1e-5, rtol=1e-5)
        assert torch.isneginf(meta.lse[i][~allowed.any(1)]).all()


@FUZZ
@given(st.integers(1, 3), st.integers(1, 12), st.sampled_from([2.0, -1.0, 0.5, -torch.inf, torch.nan, 1e-9]), st.data())
def test_padding_values_other_than_zero_and_one_are_refused(b: int, s: int, value: float, data: st.DataObject) -> None:
    padding = torch.ones(b, s)
    padding[data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, s - 1))] = value
    q = torch.randn(b, s, 2, 16)
    with pytest.raises(MaskError, match="1 \\(or True\\) on real tokens and 0 \\(or False\\) on padding"):
        maskc.attention(q, q, q, Mask.from_cu_seqlens([0, s]), attention_mask=padding)


# ---- prepared plans ------------------------------------------------------------------------------

PLAN_TARGETS = [
    call_plan.make_target((9, 0), 132, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, deterministic)
    for deterministic in (False, True)
] + [
    call_plan.make_target((9, 0), 132, torch.bfloat16, 64, 1, HeadDim(64, 64), False, False, False, True, False),
    call_plan.make_target((8, 0), 108, torch.bfloat16, 4, 4, HeadDim(64, 64), False, False, False, None, False),
    call_plan.make_target((10, 0), 148, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, False, 0, False),
]
"""Planning targets: SM90 (GQA, deterministic, MQA with PackGQA), portable, SM100 (experimental)."""


@st.composite
def prepared_masks(draw: st.DrawFn) -> tuple[Mask, call_plan.Target]:
    total = draw(st.integers(1, 3000))
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=6)))
    return Mask.from_cu_seqlens([0, *cuts, total], causal=draw(st.booleans())), draw(st.sampled_from(PLAN_TARGETS))


def plan_entries(data: torch.Tensor, table: torch.Tensor) -> dict | None:
    """The entries decoding takes from a plan, or None where it takes none: refused (a
    MaskcError), ignored (with a PerformanceWarning) or empty (a plan for no GPU, as a plan cut
    to nothing is); any other exception propagates."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            entries = dict(plan_records.decode(data, table))
        except MaskcError:
            return None
    assert not (entries and caught), "a plan that warns is ignored"
    return entries or None


def corrupt(words: np.ndarray, data: st.DataObject) -> np.ndarray:
    """The plan's words with a random corruption: bits flipped, words overwritten (with edge
    values), cut short, extended or swapped."""
    words = words.copy()
    kind = data.draw(st.sampled_from(["flip", "set", "cut", "append", "swap"]))
    at = data.draw(st.integers(0, words.size - 1))
    if kind == "flip":
        words.view(np.uint32)[at] ^= np.uint32(1 << data.draw(st.integers(0, 31)))
    elif kind == "set":
        words[at] = data.draw(st.sampled_from([0, 1, -1, 2, 7, 2**30, 2**31 - 1, -(2**31)]) | st.integers(-50, 50))
    elif kind == "cut":
        words = words[:at]
    elif kind == "append":
        words = np.r_[words, data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=8))]
    else:
        other = data.draw(st.integers(0, words.size - 1))
        words[[at, other]] = words[[other, at]]
    return words.astype(np.int32)


@FUZZ
@given(prepared_masks(), st.booleans(), st.data())
def test_corrupted_plans_are_refused_ignored_or_the_honest_plan(case: tuple, resign: bool, data: st.DataObject) -> None:
    """A corruption of a plan is refused or ignored, else it changed nothing; one signed again
    (what only a holder of the key can make) is refused or taken, never anything but a
    MaskcError."""
    mask, target = case
    honest_data = maskc.prepare(Mask.from_table(mask.table), target).plan
    honest = plan_entries(honest_data.clone(), mask.table)
    assert honest, "an honest plan is taken"
    words = corrupt(honest_data.numpy(), data)
    if resign and words.size >= 10:
        mac = signing.signature(signing.plan_key(), words[:6].tobytes(), mask.table.numpy().tobytes(), words[10:].tobytes())
        words[6:10] = np.frombuffer(mac, np.int32)
    got = plan_entries(torch.from_numpy(words), mask.table)
    if got is not None and not resign:
        assert got.keys() == honest.keys()
        for key, value in got.items():
            theirs = honest[key]
            assert (torch.equal(value.flat, theirs.flat) and value[1:] == theirs[1:]) if isinstance(value, call_plan.HostSchedule) \
                else value == theirs  # fmt: skip


@FUZZ
@given(prepared_masks(), st.data())
def test_a_schedule_corrupted_before_it_is_signed_is_refused_or_still_fits(case: tuple, data: st.DataObject) -> None:
    """The checks that run before a plan is signed (`maskc.runtime.schedule_checks`) refuse a
    schedule with a MaskcError, or sign one whose every index fits: never another exception."""
    mask, target = case
    fresh = Mask.from_table(mask.table)
    maskc.prepare(fresh, target)
    hosts = [v for k, v in fresh.memo.items() if isinstance(v, call_plan.HostSchedule) and k[0] in plan_records._SCHEDULES]
    host = data.draw(st.sampled_from(hosts))
    words = corrupt(host.flat.numpy(), data)
    assume(words.size == host.flat.numel())  # the arrays keep their lengths; their values are anything
    host.flat.numpy()[:] = words
    try:
        signed = plan_records.encode(fresh.table, fresh.memo)
    except MaskcError:
        return
    assert plan_entries(signed, fresh.table)


@st.composite
def irregular_masks(draw: st.DrawFn) -> Mask:
    """Documents with a window, a prefix, global tokens or one mask a row: what the schedules'
    checks must accept whenever the planner made them."""
    total = draw(st.integers(1, 20000))
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=8)))
    cu = [0, *cuts, total]
    kind = draw(st.sampled_from(["window", "prefix", "global", "stack", "block"]))
    if kind == "window":
        return Mask.sliding_window(cu, draw(st.integers(0, 3000)), draw(st.integers(0, 300)))
    if kind == "prefix":
        return Mask.from_cu_seqlens(cu, causal=True, prefix=draw(st.integers(0, 500)))
    if kind == "global":
        return Mask.from_cu_seqlens(cu, causal=True).with_global_tokens(min(total, draw(st.integers(0, 200))))
    if kind == "stack":
        return Mask.stack([Mask.from_cu_seqlens(cu, causal=draw(st.booleans()))] * draw(st.integers(1, 3)))
    block = draw(st.integers(1, 2048))
    return load(ROOT / "examples" / "varlen_block_causal.mask")["varlen_block_causal"].lower(docs=np.diff(cu).tolist(), block=block)


@FUZZ
@given(irregular_masks(), st.sampled_from(PLAN_TARGETS))
def test_every_plan_the_planner_makes_passes_its_checks(mask: Mask, target: call_plan.Target) -> None:
    fresh = Mask.from_table(mask.table)
    taken = dict(plan_records.decode(maskc.prepare(fresh, target).plan, mask.table))
    assert taken and all(key in fresh.memo for key in taken)
