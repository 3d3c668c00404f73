"""Prepared plans (`maskc.prepare`) as data from outside the step: checked and signed where they
are made, verified before any of them joins a mask's memo, and loadable from a file without
running code from it. A plan that is corrupted, edited, made for another mask or by another key
is a clear error or is ignored (the call plans itself): never a wrong kernel, an out-of-range
tile or a poisoned cache."""

from __future__ import annotations

import math
import os
import pickle
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import maskc
from maskc.artifact.kernel_families import HeadDim
from maskc.errors import PerformanceWarning
from maskc.ir import Mask
from maskc.runtime import call_plan, masks, plan_records, signing
from maskc.runtime.prepared import PreparedMask

#: An sm_90a target with 8:2 heads, d=128 (tall forward tile, PackGQA, split backward items).
TARGET = call_plan.make_target((9, 0), 132, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, False)
DETERMINISTIC = call_plan.make_target((9, 0), 132, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, True)
PORTABLE = call_plan.make_target((8, 0), 108, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, False)
CAUSAL = Mask.from_cu_seqlens([0, 300, 1000, 1500], causal=True)


def entries(mask: Mask, target: call_plan.Target = TARGET) -> tuple[torch.Tensor, dict]:
    """A fresh copy of `mask` prepared for `target`: its plan, and the memo entries it carries."""
    data = maskc.prepare(Mask.from_table(mask.table), target).plan
    return data, dict(plan_records.decode(data.clone(), mask.table))


def decode(data: torch.Tensor, mask: Mask) -> dict:
    """What a call takes from `data` for `mask` (a copy of `data`: decoding keeps what it took on the tensor)."""
    return dict(plan_records.decode(data.clone(), mask.table))


def resigned(values: np.ndarray, table: torch.Tensor) -> torch.Tensor:
    """A plan's words with a valid signature made for them: what only a holder of the key can
    make, so what the checks behind the signature must stop."""
    values = values.astype(np.int32).copy()
    mac = signing.signature(signing.plan_key(), values[:6].tobytes(), table.numpy().tobytes(), values[10:].tobytes())
    values[6:10] = np.frombuffer(mac, np.int32)
    return torch.from_numpy(values)


def records(data: torch.Tensor) -> list[tuple[int, str, int]]:
    """(offset, name, key length) of each record of a plan."""
    values, at, found = data.numpy(), 10, []
    while at < values.size:
        found.append((at, plan_records._NAMES[values[at + 1]], int(values[at + 2])))
        at += int(values[at])
    return found


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, call_plan.HostSchedule):
            if not (torch.equal(x.flat, y.flat) and x[1:] == y[1:]):
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


@pytest.mark.parametrize("target", [TARGET, DETERMINISTIC, PORTABLE], ids=["sm90", "deterministic", "portable"])
@pytest.mark.parametrize("mask", [CAUSAL, Mask.from_cu_seqlens([0, 8192]), Mask.from_cu_seqlens([0, 0, 40, 41])],
                         ids=["varlen_causal", "full_tall", "tiny"])  # fmt: skip
def test_a_plan_carries_the_memo_entries_it_was_made_from(mask: Mask, target: call_plan.Target) -> None:
    fresh = Mask.from_table(mask.table)
    data = maskc.prepare(fresh, target).plan
    carried = decode(data, mask)
    assert carried and {k[0] for k in carried} >= {"build_forward_schedule"}
    assert same(carried, {k: fresh.memo[k] for k in carried})


def test_every_bit_flip_is_an_error_or_ignored_never_another_plan() -> None:
    """Random single bit flips anywhere, and every bit of the header: the plan is refused
    (MaskcError) or ignored with a PerformanceWarning, and a plan that is used is the honest one."""
    data, _ = entries(CAUSAL)
    rng = np.random.default_rng(0)
    bits = [*range(10 * 32), *rng.integers(10 * 32, data.numel() * 32, 400).tolist()]
    outcomes = {"error": 0, "ignored": 0}
    for bit in bits:
        flipped = data.clone()
        flipped.view(torch.uint32)[bit // 32] ^= 1 << (bit % 32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = decode(flipped, CAUSAL)
            except maskc.MaskcError:
                outcomes["error"] += 1
                continue
        assert got == {} and [w.category for w in caught] == [PerformanceWarning], f"bit {bit}"
        outcomes["ignored"] += 1
    assert outcomes == {"error": len(bits) - 3 * 32, "ignored": 3 * 32}  # ignored: a flip in the format or the key id


def test_a_flipped_partial_record_is_refused() -> None:
    """The backward's partial-blocks record of a causal mask, flipped to 'none': it would pick the
    kernel without line masks (wrong gradients)."""
    data, _ = entries(CAUSAL)
    (at, _, key_length), = [r for r in records(data) if r[1] == "partial"]
    flipped = data.clone()
    flipped[at + 3 + key_length + 1] ^= 1
    with pytest.raises(maskc.MaskcError, match="signature does not match"):
        decode(flipped, CAUSAL)


def _planned(mask: Mask, target: call_plan.Target, builder: str) -> tuple[Mask, dict[str, np.ndarray]]:
    """A fresh copy of `mask` planned for `target`, and the arrays of its `builder` schedule (views
    into the memo's schedule, to edit before the plan is made from the memo)."""
    fresh = Mask.from_table(mask.table)
    maskc.prepare(fresh, target)
    (host,) = [v for k, v in fresh.memo.items() if isinstance(v, call_plan.HostSchedule) and k[0] == builder]
    return fresh, {name: view.numpy() for name, view in call_plan.schedule_views(host.flat, host.rows).items()}


def _refused_at_encode(mask: Mask, why: str) -> None:
    with pytest.raises(maskc.MaskcError, match=f"own checks refuse \\(.*{why}"):
        plan_records.encode(mask.table, mask.memo)


@pytest.mark.parametrize(
    "builder,array,at,value,why",
    [
        ("build_forward_schedule", "work_tile", (0,), 2**30, "each tile once"),
        ("build_forward_schedule", "ranges", (0, 1), 2**30, "blocks are out of range"),
        ("build_forward_schedule", "ranges", (0, 2), 7, "unknown mask kind"),
        ("build_forward_schedule", "ranges", (0, 3), 5, "first column"),
        ("build_forward_schedule", "work_ranges", (1,), -3, "offsets into ranges"),
        ("build_forward_schedule", "lines", (0, 1), 2**30, "line's rows"),
        ("build_forward_schedule", "query_bounds", (1,), 2**30, "work tiles do not cover"),
        ("build_backward_schedule", "items", (0, 0), 2**30, "item is out of range"),
        ("build_backward_schedule", "items", (0, 1), 5, "item is out of range"),
        ("build_backward_schedule", "items", (0, 4), 10**6, "query heads or slot"),
        ("build_backward_schedule", "cta_items", (1,), 10**6, "offsets into items"),
        ("build_backward_schedule", "key_bounds", (1,), 7, "do not cover"),
    ],
)
def test_a_schedule_out_of_bounds_is_never_signed(builder: str, array: str, at: tuple, value: int, why: str) -> None:
    """Where a plan is made, before it is signed: no entry a kernel follows may leave its tensors."""
    mask, arrays = _planned(CAUSAL, TARGET, builder)
    arrays[array][at] = value
    _refused_at_encode(mask, why)


def test_a_split_items_pieces_must_cover_its_query_heads() -> None:
    """A piece that adds into a slot must be met by the pieces that complete it: else the slot is
    never stored and stays dirty for the next call."""
    mask, arrays = _planned(Mask.from_cu_seqlens([0, 2048]), TARGET, "build_backward_schedule")  # every item split
    rows = arrays["items"]
    pieces = np.flatnonzero(rows[:, 5] == np.bincount(rows[rows[:, 5] >= 0, 5]).argmax())
    assert len(pieces) >= 2
    rows[pieces[0], 3] = rows[pieces[1], 3]  # one piece's query heads twice, another's never
    _refused_at_encode(mask, "miss or repeat query heads")


def test_a_deterministic_schedules_ranks_are_its_own() -> None:
    """A dQ rank too high would make the deterministic backward wait forever."""
    mask, arrays = _planned(CAUSAL, DETERMINISTIC, "build_deterministic_backward_schedule")
    arrays["block_rank"][0] += 1
    _refused_at_encode(mask, "dQ ranks")


def test_a_signed_plan_is_taken_as_checked_where_it_was_made() -> None:
    """The step checks the signature only: what a holder of the key signs is taken (the trust
    model: the key is the user's, like their home directory)."""
    data, honest = entries(CAUSAL)
    _, starts = _schedule_words(data, "build_forward_schedule")
    values = data.numpy().copy()
    values[starts["lines"] + 2] += 1  # a line's first key: a wrong mask, in bounds
    taken = decode(resigned(values, CAUSAL.table), CAUSAL)
    assert taken.keys() == honest.keys() and not same(taken, honest)


def _schedule_words(data: torch.Tensor, builder: str) -> tuple[int, dict[str, int]]:
    """Where each array of a plan's schedule record starts in the plan, by ABI name."""
    (at, _, key_length), = [r for r in records(data) if r[1] == builder]
    value = at + 3 + key_length + 1
    arrays = int(data[value + 2])
    rows = data[value + 3 : value + 3 + arrays].tolist()
    starts, offset = {}, value + 3 + arrays
    for arg, r in zip(call_plan.SCHEDULE_ARGS, rows):
        starts[arg.name] = offset
        offset += r * math.prod(arg.shape[1:])
    return at, starts


@pytest.mark.parametrize("edit,why", [
    (lambda v, at: v.__setitem__(at + 1, -1), "malformed"),  # a name index of -1
    (lambda v, at: v.__setitem__(at + 2, 10**6), "malformed"),  # a key length past the record
    (lambda v, at: v.__setitem__(at, 2), "malformed"),  # a record length too short
    (lambda v, at: v.__setitem__(at + 3 + int(v[at + 2]) + 1, 9), "choice 9"),  # an unknown choice code
    (lambda v, at: v.__setitem__(at + 3 + int(v[at + 2]), 1), "wrong kind"),  # a choice recorded as a schedule
])  # fmt: skip
def test_a_signed_record_that_is_malformed_is_refused(edit, why: str) -> None:
    data, _ = entries(CAUSAL)
    (at, _, _), = [r for r in records(data) if r[1] == "forward"]
    values = data.numpy().copy()
    edit(values, at)
    with pytest.raises(maskc.MaskcError, match=why):
        decode(resigned(values, CAUSAL.table), CAUSAL)


def test_a_forward_choice_must_be_one_the_call_allows() -> None:
    """PackGQA chosen for a call that forbids it (pack_gqa=False) is refused, not run."""
    plain = call_plan.make_target((9, 0), 132, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, False, False)
    mask = Mask.from_cu_seqlens([0, 8192])  # tall tile or not: a choice is recorded
    data, honest = entries(mask, plain)
    (at, _, key_length), = [r for r in records(data) if r[1] == "forward"]
    values = data.numpy().copy()
    values[at + 3 + key_length + 1] |= 1
    with pytest.raises(maskc.MaskcError, match="not one its key allows"):
        decode(resigned(values, mask.table), mask)


def test_a_refused_plan_leaves_the_memo_alone_and_an_honest_one_is_then_used() -> None:
    table = CAUSAL.table.clone()
    data, honest = entries(CAUSAL)
    tampered = data.clone()
    tampered[-1] ^= 1
    with pytest.raises(maskc.MaskcError, match="corrupted"):
        masks.mask_of(table, tampered)
    mask = masks.mask_of(table)  # the content-cached Mask the tampered plan would have seeded
    assert not any(isinstance(k, tuple) and k and k[0] in plan_records._NAMES for k in mask.memo)
    assert masks.mask_of(table, data) is mask and same({k: mask.memo[k] for k in honest}, honest)


def test_writes_to_a_plan_after_it_is_taken_change_nothing() -> None:
    table = Mask.from_cu_seqlens([0, 1200, 1400], causal=True).table
    data = maskc.prepare(Mask.from_table(table), TARGET).plan
    mask = masks.mask_of(table.clone(), data)
    kept = {k: v.flat.clone() for k, v in mask.memo.items() if isinstance(v, call_plan.HostSchedule)}
    data.numpy()[10:] = 0
    assert kept and all(torch.equal(mask.memo[k].flat, v) for k, v in kept.items())


def test_a_plan_signed_with_another_key_or_format_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    data, _ = entries(CAUSAL)
    monkeypatch.setenv(signing.KEY_ENV, "ab" * 32)
    signing.plan_key.cache_clear()
    try:
        with pytest.warns(PerformanceWarning, match="another plan key"):
            assert decode(data, CAUSAL) == {}
        stale = data.clone()
        stale[1] = plan_records.FORMAT - 1
        with pytest.warns(PerformanceWarning, match="another release of maskc"):
            assert decode(stale, CAUSAL) == {}
    finally:
        monkeypatch.undo()
        signing.plan_key.cache_clear()


def test_the_key_file_is_made_once_private_and_shared(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(signing.KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    signing.plan_key.cache_clear()
    try:
        key = signing.plan_key()
        path = tmp_path / "maskc" / "plan-key"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and bytes.fromhex(path.read_text()) == key
        signing.plan_key.cache_clear()
        assert signing.plan_key() == key  # read, not made again
        assert [p.name for p in path.parent.iterdir()] == ["plan-key"]  # no temporary file left
        path.write_text("not hex\n")
        signing.plan_key.cache_clear()
        with pytest.raises(maskc.MaskcError, match="plan key in .*plan-key must be 64 hex digits"):
            signing.plan_key()
    finally:
        signing.plan_key.cache_clear()


def test_without_a_key_file_a_process_key_is_shared_with_its_children(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.delenv(signing.KEY_ENV)
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocked))  # a file where the directory would be
    signing.plan_key.cache_clear()
    try:
        key = signing.plan_key()
        assert bytes.fromhex(os.environ[signing.KEY_ENV]) == key
    finally:
        monkeypatch.undo()
        signing.plan_key.cache_clear()


def test_a_prepared_mask_is_tensors_of_the_right_kind() -> None:
    data = maskc.prepare(CAUSAL, None).plan
    with pytest.raises(maskc.MaskcError, match="PreparedMask.table is a 2-D int32 CPU tensor.*got a str"):
        PreparedMask("table", data)
    with pytest.raises(maskc.MaskcError, match="PreparedMask.plan is a 1-D int32 CPU tensor"):
        PreparedMask(CAUSAL.table, data.float())
    with pytest.raises(maskc.MaskcError, match=r"mask table \[N \+ 1, 5\]"):
        PreparedMask(torch.zeros(3, 4, dtype=torch.int32), data)
    with pytest.raises(TypeError, match="maskc.target_for.*got 'cuda'"):
        maskc.prepare(CAUSAL, "cuda")


def test_a_saved_prepared_mask_loads_as_tensors_only(tmp_path: Path) -> None:
    ready = maskc.prepare(Mask.from_table(CAUSAL.table), TARGET)
    ready.save(tmp_path / "plan.pt")
    loaded = PreparedMask.load(tmp_path / "plan.pt")
    assert torch.equal(loaded.table, ready.table) and torch.equal(loaded.plan, ready.plan)
    torch.save({"step": 3, "mask": ready}, tmp_path / "batch.pt")
    with torch.serialization.safe_globals([PreparedMask]):
        batch = torch.load(tmp_path / "batch.pt", weights_only=True)
    assert torch.equal(batch["mask"].plan, ready.plan)
    assert same(decode(loaded.plan, CAUSAL), decode(ready.plan, CAUSAL))


class _Payload:
    """A pickle that runs code when loaded, as any pickle can."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "ran"))


def test_loading_a_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    torch.save(_Payload(marker), tmp_path / "evil_torch.pt")
    torch.save({"not": "a mask"}, tmp_path / "dict.pt")
    for name in ("evil.pt", "evil_torch.pt"):
        with pytest.raises(maskc.MaskcError, match="is not a saved PreparedMask"):
            PreparedMask.load(tmp_path / name)
    with pytest.raises(maskc.MaskcError, match="holds a dict, not a saved PreparedMask"):
        PreparedMask.load(tmp_path / "dict.pt")
    assert not marker.exists()


class _Masks(torch.utils.data.Dataset):
    """What a training DataLoader's workers do: build each step's mask and prepare it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> PreparedMask:
        return maskc.prepare(Mask.from_cu_seqlens([0, 100 + 50 * i, 900], causal=True), TARGET)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_plans_from_dataloader_workers_are_taken(context: str) -> None:
    loader = torch.utils.data.DataLoader(_Masks(), batch_size=None, num_workers=2, multiprocessing_context=context)
    for i, ready in enumerate(loader):
        mask = Mask.from_cu_seqlens([0, 100 + 50 * i, 900], causal=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            taken = dict(plan_records.decode(ready.plan, ready.table))
        maskc.prepare(mask, TARGET)
        assert taken and same(taken, {k: mask.memo[k] for k in taken})


def test_a_pinned_plan_is_verified_in_the_pin_memory_thread_not_in_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DataLoader with pin_memory=True pins each batch in its own thread: the plan's signature
    is checked there, so the step only hands the entries to the memo."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", torch.Tensor.clone)  # no accelerator on this machine
    signed = []
    signature = signing.signature
    monkeypatch.setattr(signing, "signature", lambda *a: signed.append(1) or signature(*a))
    ready = maskc.prepare(Mask.from_table(CAUSAL.table), TARGET)
    signed.clear()
    pinned = ready.pin_memory()
    assert signed == [1]
    mask = masks.mask_of(pinned.table, pinned.plan)
    assert signed == [1] and any(isinstance(v, call_plan.HostSchedule) for v in mask.memo.values())
