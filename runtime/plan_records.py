"""A prepared plan as one int32 tensor (`PreparedMask.plan`): the entries of a mask's memo that
`maskc.prepare` computed (the forward's GQA and tile choice, the backward kernel's, the host
schedules), signed, and taken back into a mask's memo only once every entry is checked.

A plan is a header, then records `[length, name, key length, *key, kind, *value]`; a schedule's
value is `[slots, num_ctas, arrays, *rows, *flat]`. The header holds the record format, which
key signed the plan (`maskc.runtime.signing`), a digest of the mask's table, and the signature
of all of it with the table. What a call does with a plan:

- made by another release's planner (another format), or signed with another key: ignored,
  with a PerformanceWarning; the call plans itself (slower, never wrong);
- made for another mask, or corrupted (its signature, or an entry, wrong): a MaskcError;
- else its entries join the mask's memo: each decision one the call could make itself, each
  schedule in bounds for the mask and the key's tiles (`maskc.runtime.schedule_checks`).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any

import numpy as np
import torch

from maskc.errors import MaskcError, PerformanceWarning
from maskc.ir import Mask
from maskc.ir.schedule import build_backward_schedule, build_deterministic_backward_schedule, build_forward_schedule
from maskc.runtime import plan, signing
from maskc.runtime.schedule_checks import ScheduleError, check_schedule

FORMAT = 2
"""The record layout and the meaning of its schedules; a plan of another format is ignored."""
_MAGIC = 0x6C706B6D  # b"mkpl"
_HEADER = 10
"""[magic, format, key id (2), table digest (2), signature (4)]."""

_SCHEDULES = {build_forward_schedule.__name__: (7, 5), build_backward_schedule.__name__: (9, 8),
              build_deterministic_backward_schedule.__name__: (11, 6)}  # fmt: skip
"""Per schedule builder: its arrays (`plan.SCHEDULE_ARGS`) and its memo key's parameters."""
_NAMES = ("forward", "partial", *_SCHEDULES)
"""The first element of every memo key a plan carries (the others are ints and bools)."""
_BOOL, _SCHEDULE, _INT = 0, 1, 2
_KINDS = {"forward": _INT, "partial": _BOOL, **dict.fromkeys(_SCHEDULES, _SCHEDULE)}


def encode(table: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    """The memo entries a plan carries, signed with this user's key, as one int32 tensor."""
    records: list[np.ndarray] = []
    for key, value in memo.items():
        if not (isinstance(key, tuple) and key and key[0] in _NAMES and all(isinstance(x, int) for x in key[1:])):
            continue
        if isinstance(value, plan.HostSchedule):
            body = [_SCHEDULE, value.slots, value.num_ctas, len(value.rows), *value.rows]
            tail = value.flat.numpy()
        else:
            body, tail = [_KINDS[key[0]], int(value)], np.zeros(0, np.int32)
        head = [_NAMES.index(key[0]), len(key) - 1, *key[1:], *body]
        records.append(np.r_[len(head) + tail.size + 1, head, tail].astype(np.int32))
    body = np.concatenate(records or [np.zeros(0, np.int32)]).astype(np.int32)
    key = signing.plan_key()
    header = np.r_[_MAGIC, FORMAT, _words(signing.key_id(key)), _words(_table_digest(table))].astype(np.int32)
    mac = signing.signature(key, header.tobytes(), table.numpy().tobytes(), body.tobytes())
    return torch.from_numpy(np.r_[header, _words(mac), body].astype(np.int32))


def decode(data: torch.Tensor, mask: Mask) -> list[tuple[tuple, Any]]:
    """The (key, value) memo entries of a plan for `mask`, each checked (none for an empty plan,
    or one to ignore: see the module docstring)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.int32 or data.ndim != 1 or data.device.type != "cpu":
        what = f"{data.dtype} tensor {tuple(data.shape)} on {data.device}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise MaskcError(f"a prepared plan is a 1-D int32 CPU tensor (maskc.prepare), got a {what}")
    if data.numel() == 0:
        return []
    values = data.numpy()
    if values.size < _HEADER or values[0] != _MAGIC:
        raise _corrupted("it has no plan header")
    if values[1] != FORMAT:
        return _ignored(f"it was made by another release of maskc (plan format {values[1]}, this one reads {FORMAT})")
    if values[4:6].tobytes() != _table_digest(mask.table):
        raise MaskcError("this prepared plan was made for another mask: prepare each mask with maskc.prepare")
    key = signing.plan_key()
    if values[2:4].tobytes() != signing.key_id(key):
        return _ignored(f"it was signed with another plan key than this process's (set ${signing.KEY_ENV} alike "
                        "where plans are made and used)")  # fmt: skip
    body = values[_HEADER:]
    if values[6:10].tobytes() != signing.signature(key, values[:6].tobytes(), mask.table.numpy().tobytes(), body.tobytes()):
        raise _corrupted("its signature does not match its contents")
    try:
        return _entries(data[_HEADER:], mask)
    except ScheduleError as exc:
        raise _corrupted(f"a schedule is unfit to launch: {exc}") from None


def _entries(data: torch.Tensor, mask: Mask) -> list[tuple[tuple, Any]]:
    values, entries, at = data.numpy(), {}, 0
    while at < values.size:
        length, name, key_length = (int(x) for x in values[at : at + 3]) if at + 3 <= values.size else (0, -1, 0)
        end, body = at + length, at + 3 + max(key_length, 0)
        if not (0 <= name < len(_NAMES) and key_length >= 0 and body + 2 <= end <= values.size):
            raise _corrupted(f"its record at {at} is malformed")
        key = (_NAMES[name], *values[at + 3 : body].tolist())
        if values[body] != _KINDS[key[0]] or key in entries:
            raise _corrupted(f"its record at {at} ({key[0]}) is of the wrong kind or repeated")
        entries[key] = _schedule(key, data[body + 1 : end], mask) if key[0] in _SCHEDULES else _decision(key, values[body + 1 : end])
        at = end
    return list(entries.items())


def _decision(key: tuple, value: np.ndarray) -> int | bool:
    """A forward choice (`plan.forward_requests`: 2 * tall + PackGQA, among the choices its key
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


def _schedule(key: tuple, value: torch.Tensor, mask: Mask) -> plan.HostSchedule:
    """A schedule record's HostSchedule, a copy (so later writes to the plan change nothing), checked."""
    arrays, params = _SCHEDULES[key[0]]
    slots, num_ctas, count = (int(x) for x in value[:3]) if value.numel() >= 3 else (-1, 0, 0)
    rows = tuple(value[3 : 3 + arrays].tolist())
    sizes = [r * math.prod(a.shape[1:]) for r, a in zip(rows, plan.SCHEDULE_ARGS)]
    if len(key) - 1 != params or count != arrays or slots < 0 or len(rows) != arrays or min(rows) < 1 \
            or value.numel() != 3 + arrays + sum(sizes):  # fmt: skip
        raise _corrupted(f"its {key[0]} record is malformed")
    host = plan.HostSchedule(value[3 + arrays :].clone(), rows, slots, num_ctas)
    check_schedule(key[0], key[1:], host, mask.shape)
    return host


def _table_digest(table: torch.Tensor) -> bytes:
    return hashlib.blake2b(table.numpy().tobytes(), digest_size=8).digest()


def _words(digest: bytes) -> np.ndarray:
    return np.frombuffer(digest, np.int32)


def _corrupted(why: str) -> MaskcError:
    return MaskcError(f"a prepared plan is corrupted ({why}): make it again with maskc.prepare")


def _ignored(why: str) -> list:
    warnings.warn(f"a prepared plan is ignored, so the call plans its mask itself: {why}", PerformanceWarning, stacklevel=2)
    return []
