"""A prepared plan as one int32 tensor (`PreparedMask.plan`): the entries of a mask's memo that
`maskc.prepare` computed (the forward's GQA and tile choice, the backward kernel's, the host
schedules), checked and then signed where they are made, and taken back into a mask's memo
where the signature holds.

A plan is a header, then records `[length, name, key length, *key, kind, *value]`; a schedule's
value is `[slots, num_ctas, arrays, *rows, *flat]`. The header holds the record format, which
key signed the plan (`maskc.runtime.signing`), a digest of the mask's table, and the signature
of all of it with the table.

Where a plan is made, before it is signed, each decision must be one the call could make and
each schedule must fit the mask and its key's tiles (`maskc.runtime.schedule_checks`: no index
out of range, no wait that cannot end). So the signature vouches for the checks too, and the
step, which pays for every millisecond, only checks the signature (half a millisecond at 128k
tokens; a DataLoader with `pin_memory=True` checks it in its pin-memory thread instead,
`PreparedMask.pin_memory`). What a call does with a plan:

- made by another release's planner (another format), or signed with another key: ignored,
  with a PerformanceWarning; the call plans itself (slower, never wrong);
- made for another mask, or corrupted (its signature, or a record, wrong): a MaskcError;
- else its entries join the mask's memo (copies: later writes to the plan change nothing).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any

import numpy as np
import torch

from maskc.errors import MaskcError, PerformanceWarning
from maskc.ir.schedule import build_backward_schedule, build_deterministic_backward_schedule, build_forward_schedule
from maskc.runtime import call_plan, signing
from maskc.runtime.schedule_checks import ScheduleError, check_schedule

FORMAT = 2
"""The record layout and the meaning of its schedules; a plan of another format is ignored."""
_MAGIC = 0x6C706B6D  # b"mkpl"
_HEADER = 10
"""[magic, format, key id (2), table digest (2), signature (4)]."""

_SCHEDULES = {build_forward_schedule.__name__: (7, 5), build_backward_schedule.__name__: (9, 8),
              build_deterministic_backward_schedule.__name__: (11, 6)}  # fmt: skip
"""Per schedule builder: its arrays (`call_plan.SCHEDULE_ARGS`) and its memo key's parameters."""
_NAMES = ("forward", "partial", *_SCHEDULES)
"""The first element of every memo key a plan carries (the others are ints and bools)."""
_BOOL, _SCHEDULE, _INT = 0, 1, 2
_KINDS = {"forward": _INT, "partial": _BOOL, **dict.fromkeys(_SCHEDULES, _SCHEDULE)}


def encode(table: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    """The memo entries a plan carries, checked, then signed with this user's key, as one int32
    tensor."""
    records: list[np.ndarray] = []
    for key, value in memo.items():
        if not (isinstance(key, tuple) and key and key[0] in _NAMES and all(isinstance(x, int) for x in key[1:])):
            continue
        if isinstance(value, call_plan.HostSchedule):
            body = [_SCHEDULE, value.slots, value.num_ctas, len(value.rows), *value.rows]
            tail = value.flat.numpy()
        else:
            body, tail = [_KINDS[key[0]], int(value)], np.zeros(0, np.int32)
        head = [_NAMES.index(key[0]), len(key) - 1, *key[1:], *body]
        records.append(np.r_[len(head) + tail.size + 1, head, tail].astype(np.int32))
    body = np.concatenate(records or [np.zeros(0, np.int32)]).astype(np.int32)
    try:  # what is signed, as a call will read it
        for key, value in _entries(body).items():
            if key[0] in _SCHEDULES:
                check_schedule(key[0], key[1:], value, _shape(table))
    except ScheduleError as exc:
        raise MaskcError(f"maskc.prepare made a schedule its own checks refuse ({exc}): a maskc bug, please report it") from None
    key = signing.plan_key()
    header = np.r_[_MAGIC, FORMAT, _words(signing.key_id(key)), _words(_table_digest(table))].astype(np.int32)
    mac = signing.signature(key, header.tobytes(), table.numpy().tobytes(), body.tobytes())
    return torch.from_numpy(np.r_[header, _words(mac), body].astype(np.int32))


def decode(data: torch.Tensor, table: torch.Tensor) -> list[tuple[tuple, Any]]:
    """The (key, value) memo entries of a plan for the mask `table` holds (none for an empty
    plan, or one to ignore: see the module docstring); kept on `data` for the next call with
    the same table (`PreparedMask.pin_memory` decodes ahead of the step)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.int32 or data.ndim != 1 or data.device.type != "cpu":
        what = f"{data.dtype} tensor {tuple(data.shape)} on {data.device}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise MaskcError(f"a prepared plan is a 1-D int32 CPU tensor (maskc.prepare), got a {what}")
    rows = table.numpy().tobytes()
    kept = getattr(data, "_maskc_entries", None)
    if kept is not None and kept[0] == rows:
        return kept[1]
    entries = _verified(data, table, rows)
    data._maskc_entries = (rows, entries)
    return entries


def _verified(data: torch.Tensor, table: torch.Tensor, rows: bytes) -> list[tuple[tuple, Any]]:
    if data.numel() == 0:
        return []
    values = data.numpy()
    if values.size < _HEADER or values[0] != _MAGIC:
        raise _corrupted("it has no plan header")
    if values[1] != FORMAT:
        return _ignored(f"it was made by another release of maskc (plan format {values[1]}, this one reads {FORMAT})")
    if values[4:6].tobytes() != _table_digest(table):
        raise MaskcError("this prepared plan was made for another mask: prepare each mask with maskc.prepare")
    key = signing.plan_key()
    if values[2:4].tobytes() != signing.key_id(key):
        return _ignored(f"it was signed with another plan key than this process's (set ${signing.KEY_ENV} alike "
                        "where plans are made and used)")  # fmt: skip
    body = values[_HEADER:]
    if values[6:10].tobytes() != signing.signature(key, values[:6].tobytes(), rows, body.tobytes()):
        raise _corrupted("its signature does not match its contents")
    return list(_entries(body).items())


def _entries(values: np.ndarray) -> dict[tuple, Any]:
    """The records of a plan's body, each well formed."""
    entries, at = {}, 0
    while at < values.size:
        length, name, key_length = (int(x) for x in values[at : at + 3]) if at + 3 <= values.size else (0, -1, 0)
        end, body = at + length, at + 3 + max(key_length, 0)
        if not (0 <= name < len(_NAMES) and key_length >= 0 and body + 2 <= end <= values.size):
            raise _corrupted(f"its record at {at} is malformed")
        key = (_NAMES[name], *values[at + 3 : body].tolist())
        if values[body] != _KINDS[key[0]] or key in entries:
            raise _corrupted(f"its record at {at} ({key[0]}) is of the wrong kind or repeated")
        if key[0] in _SCHEDULES:
            entries[key] = _schedule(key, values[body + 1 : end])
        else:
            entries[key] = _decision(key, values[body + 1 : end])
        at = end
    return entries


def _decision(key: tuple, value: np.ndarray) -> int | bool:
    """A forward choice (`call_plan.forward_requests`: 2 * tall + PackGQA, among the choices its key
    allows) or the backward's partial-blocks flag."""
    if value.size != 1:
        raise _corrupted(f"its {key[0]} record is malformed")
    code = int(value[0])
    if key[0] == "partial":
        if len(key) != 5 or code not in (0, 1):
            raise _corrupted("its partial-blocks record is malformed")
        return bool(code)
    if len(key) != 9:
        raise _corrupted("its forward record is malformed")
    tall_tile, packs = key[5:7] != (0, 0), key[7]
    if not (0 <= code <= 3 and (tall_tile or code < 2) and packs & (1 << (code & 1))):
        raise _corrupted(f"its forward choice {code} is not one its key allows")
    return code


def _schedule(key: tuple, value: np.ndarray) -> call_plan.HostSchedule:
    """A schedule record's HostSchedule, a copy of the plan's words."""
    arrays, params = _SCHEDULES[key[0]]
    slots, num_ctas, count = (int(x) for x in value[:3]) if value.size >= 3 else (-1, 0, 0)
    rows = tuple(value[3 : 3 + arrays].tolist())
    sizes = [r * math.prod(a.shape[1:]) for r, a in zip(rows, call_plan.SCHEDULE_ARGS)]
    if len(key) - 1 != params or count != arrays or slots < 0 or len(rows) != arrays or min(rows) < 1 \
            or value.size != 3 + arrays + sum(sizes):  # fmt: skip
        raise _corrupted(f"its {key[0]} record is malformed")
    return call_plan.HostSchedule(torch.from_numpy(value[3 + arrays :].copy()), rows, slots, num_ctas)


def _shape(table: torch.Tensor) -> tuple[int, int]:
    """(seqlen_q, seqlen_k) of a mask table (`Mask.table`)."""
    return int(table[0, 0]), int(table[0, 1])


def _table_digest(table: torch.Tensor) -> bytes:
    return hashlib.blake2b(table.numpy().tobytes(), digest_size=8).digest()


def _words(digest: bytes) -> np.ndarray:
    return np.frombuffer(digest, np.int32)


def _corrupted(why: str) -> MaskcError:
    return MaskcError(f"a prepared plan is corrupted ({why}): make it again with maskc.prepare")


def _ignored(why: str) -> list:
    warnings.warn(f"a prepared plan is ignored, so the call plans its mask itself: {why}", PerformanceWarning, stacklevel=2)
    return []
