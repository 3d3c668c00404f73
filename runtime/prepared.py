"""Masks planned ahead of time: `prepare` runs the host work a new mask needs (the GQA choice,
the backward kernel choice, the schedules) where it costs the training step nothing, in a
DataLoader worker, and returns it as plain tensors (`PreparedMask`) that `maskc.attention`
takes as its mask.

A prepared plan only fills the mask's memo (`maskc.runtime.plan` caches its decisions and
host schedules there under keys of plain values): a plan made for another GPU or shape is
never used, since the call looks its own keys up, and planning then happens in the call.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from maskc.artifact.families import HeadDim
from maskc.errors import MaskcError
from maskc.ir import Mask
from maskc.ir.schedule import build_backward_schedule, build_deterministic_backward_schedule, build_forward_schedule
from maskc.runtime import plan

_NAMES = ("forward", "partial", build_forward_schedule.__name__, build_backward_schedule.__name__,
          build_deterministic_backward_schedule.__name__)  # fmt: skip
"""The first element of every memo key a plan carries (the others are ints and bools)."""
_BOOL, _SCHEDULE, _INT = 0, 1, 2


@dataclass(frozen=True)
class PreparedMask:
    """A mask (`Mask.table`) and its plan for one `Target` (`plan`, int32, empty when planned
    for no GPU): tensors that cross a DataLoader's worker boundary (and pin with
    `pin_memory=True`). `maskc.attention` and `maskc.dist.make_plan` take it as their mask."""

    table: torch.Tensor
    plan: torch.Tensor

    def pin_memory(self) -> PreparedMask:
        return PreparedMask(self.table.pin_memory(), self.plan.pin_memory())

    def __reduce__(self) -> tuple:
        """The tensors alone: a table carries its Mask as an attribute (`maskc.runtime.masks`),
        which plain pickle (unlike a DataLoader's queues) would write out too, memo and all."""
        return PreparedMask, (self.table.detach(), self.plan.detach())


def target_for(device: torch.device | str, *, num_heads_q: int, num_heads_kv: int, head_dim: int,
               head_dim_v: int | None = None, dtype: torch.dtype = torch.bfloat16, pack_gqa: bool | None = None,
               deterministic: bool = False, sm_margin: int = 0, portable: bool | None = None) -> plan.Target:  # fmt: skip
    """What to prepare masks for: the calls on `device` (a GPU) with these heads, head dims (v's
    where it differs from q and k's) and options (`maskc.attention`'s). Ask it in the training
    process; it is plain data that pickles to DataLoader workers, which never touch the GPU."""
    plan.check_options(pack_gqa, deterministic, portable)
    device = torch.device(device)
    if device.type != "cuda":
        raise MaskcError(f"masks are planned for a GPU; {device} runs the reference path, which needs no plan")
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        raise MaskcError(f"target_for({str(device)!r}) asks for a GPU this process does not see "
                         f"({torch.cuda.device_count()} visible): ask for the target where training runs")  # fmt: skip
    capability, num_sms = plan.device_info(device)
    head_dims = HeadDim(head_dim, head_dim if head_dim_v is None else head_dim_v)
    return plan.make_target(capability, num_sms, dtype, num_heads_q, num_heads_kv, head_dims, False, False, False,
                            pack_gqa, deterministic, sm_margin, portable)  # fmt: skip


def prepare(mask: Mask, target: plan.Target | None, *, backward: bool = True) -> PreparedMask:
    """`mask` with its plan for `target` (`target_for`; None: no plan, for CPU runs): the
    forward's and, with `backward`, the backward's. The kernels' tile shapes come from the
    kernel family table, as compiled kernels' do."""
    if not isinstance(mask, Mask):
        raise TypeError(f"prepare takes a maskc Mask, got {type(mask).__name__}")
    if target is None:
        return PreparedMask(mask.table, torch.zeros(0, dtype=torch.int32))
    forward, _ = plan.forward_requests(mask, target)
    plan.forward_schedule(mask, plan.launch_shape_of(target, forward), target.num_sms)
    if backward:
        request, _ = plan.backward_requests(mask, target)
        plan.backward_schedule(mask, plan.launch_shape_of(target, request), target.num_sms)
    return PreparedMask(mask.table, encode(mask.table, mask.memo))


def _digest(table: torch.Tensor) -> list[int]:
    """Two int32 of the table's blake2b digest: a plan is only ever used with its own mask."""
    return np.frombuffer(hashlib.blake2b(table.numpy().tobytes(), digest_size=8).digest(), np.int32).tolist()


def encode(table: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    """The memo entries a plan carries as one int32 tensor: the table's digest, then records
    `[length, name, key length, *key, kind, *value]`; a schedule's value is `[slots, num_ctas,
    arrays, *rows, *flat]`."""
    records: list[np.ndarray] = [np.array(_digest(table), np.int32)]
    for key, value in memo.items():
        if not (isinstance(key, tuple) and key and key[0] in _NAMES and all(isinstance(x, int) for x in key[1:])):
            continue
        if isinstance(value, plan.HostSchedule):
            body = [_SCHEDULE, value.slots, value.num_ctas, len(value.rows), *value.rows]
            tail = value.flat.numpy()
        else:
            body, tail = [_BOOL if isinstance(value, bool) else _INT, int(value)], np.zeros(0, np.int32)
        head = [_NAMES.index(key[0]), len(key) - 1, *key[1:], *body]
        records.append(np.r_[len(head) + tail.size + 1, head, tail].astype(np.int32))
    return torch.from_numpy(np.concatenate(records))


def decode(data: torch.Tensor, table: torch.Tensor) -> list[tuple[tuple, Any]]:
    """The (key, value) memo entries `encode` wrote for `table` (schedules are views of `data`);
    none for an empty plan."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.int32 or data.ndim != 1 or data.device.type != "cpu":
        what = f"{data.dtype} tensor {tuple(data.shape)} on {data.device}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise MaskcError(f"a prepared plan is a 1-D int32 CPU tensor (maskc.prepare), got a {what}")
    if data.numel() == 0:
        return []
    values = data.numpy()
    if values[:2].tolist() != _digest(table):
        raise MaskcError("this prepared plan was made for another mask: prepare each mask with maskc.prepare")
    entries, at = [], 2
    try:
        while at < values.size:
            length, name, key_length = (int(x) for x in values[at : at + 3])
            end = at + length
            if length < 5 or end > values.size:
                raise ValueError
            key = (_NAMES[name], *values[at + 3 : at + 3 + key_length].tolist())
            body = at + 3 + key_length
            if values[body] == _SCHEDULE:
                slots, num_ctas, arrays = (int(x) for x in values[body + 1 : body + 4])
                rows = tuple(values[body + 4 : body + 4 + arrays].tolist())
                flat = data[body + 4 + arrays : end]
                if flat.numel() != _schedule_size(rows):
                    raise ValueError
                entries.append((key, plan.HostSchedule(flat, rows, slots, num_ctas)))
            elif values[body] == _INT:
                entries.append((key, int(values[body + 1])))
            else:
                entries.append((key, bool(values[body + 1])))
            at = end
    except (ValueError, IndexError):
        raise MaskcError("a prepared plan is corrupted: make it with maskc.prepare") from None
    return entries


def _schedule_size(rows: tuple[int, ...]) -> int:
    return sum(r * math.prod(a.shape[1:]) for r, a in zip(rows, plan.SCHEDULE_ARGS))
