"""Masks planned ahead of time: `prepare` runs the host work a new mask needs (the GQA choice,
the backward kernel choice, the schedules) where it costs the training step nothing, in a
DataLoader worker, and returns it as plain tensors (`PreparedMask`) that `maskc.attention`
takes as its mask.

A prepared plan only fills the mask's memo (`maskc.runtime.call_plan` caches its decisions and
host schedules there under keys of plain values): a plan made for another GPU or shape is
never used, since the call looks its own keys up, and planning then happens in the call. A
plan is checked and signed where it is made, and its signature verified before any of it
joins the memo (`maskc.runtime.plan_records`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from maskc.artifact.kernel_families import HeadDim
from maskc.errors import MaskcError
from maskc.ir import Mask
from maskc.runtime import call_plan, plan_records, signing


@dataclass(frozen=True)
class PreparedMask:
    """A mask (`Mask.table`) and its plan for one `Target` (`plan`, int32, empty when planned
    for no GPU): tensors that cross a DataLoader's worker boundary (and pin with
    `pin_memory=True`). `maskc.attention` and `maskc.dist.make_plan` take it as their mask.

    Saved with `save` (or inside anything `torch.save` writes), it loads with `load` (or
    `torch.load(..., weights_only=True)` inside `torch.serialization.safe_globals([PreparedMask])`):
    tensors and this class only, so loading runs no code from the file; a plan not signed by
    this user's key is then ignored (`maskc.runtime.signing`)."""

    table: torch.Tensor
    plan: torch.Tensor

    def __post_init__(self) -> None:
        for name, ndim in (("table", 2), ("plan", 1)):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int32 or value.ndim != ndim \
                    or value.device.type != "cpu":  # fmt: skip
                what = f"{value.dtype} tensor {tuple(value.shape)} on {value.device}" if isinstance(value, torch.Tensor) \
                    else type(value).__name__  # fmt: skip
                raise MaskcError(f"PreparedMask.{name} is a {ndim}-D int32 CPU tensor (maskc.prepare), got a {what}")
        if self.table.shape[1:] != (5,) or self.table.shape[0] < 1:
            raise MaskcError(f"PreparedMask.table is a mask table [N + 1, 5] (Mask.table), got {tuple(self.table.shape)}")

    def pin_memory(self) -> PreparedMask:
        """Pinned copies, with the plan verified now (`maskc.runtime.plan_records.decode`): a
        DataLoader with `pin_memory=True` calls this in its pin-memory thread, beside the step."""
        pinned = PreparedMask(self.table.pin_memory(), self.plan.pin_memory())
        plan_records.decode(pinned.plan, pinned.table)
        return pinned

    def __reduce__(self) -> tuple:
        """The tensors alone: a table carries its Mask as an attribute (`maskc.runtime.masks`),
        which plain pickle (unlike a DataLoader's queues) would write out too, memo and all."""
        return PreparedMask, (self.table.detach(), self.plan.detach())

    def save(self, f: str | Path | IO[bytes]) -> None:
        """Write the mask and its plan to `f` (`torch.save`), for `load`."""
        torch.save(self, f)

    @classmethod
    def load(cls, f: str | Path | IO[bytes]) -> PreparedMask:
        """A PreparedMask that `save` wrote, read as tensors only (no code runs); a MaskcError for
        a file that holds anything else."""
        try:
            with torch.serialization.safe_globals([cls]):
                loaded = torch.load(f, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError) as exc:
            raise MaskcError(f"{f} is not a saved PreparedMask: {str(exc).splitlines()[0]}") from None
        if not isinstance(loaded, cls):
            raise MaskcError(f"{f} holds a {type(loaded).__name__}, not a saved PreparedMask")
        return loaded


def target_for(device: torch.device | str, *, num_heads_q: int, num_heads_kv: int, head_dim: int,
               head_dim_v: int | None = None, dtype: torch.dtype = torch.bfloat16, pack_gqa: bool | None = None,
               deterministic: bool = False, sm_margin: int = 0, portable: bool | None = None) -> call_plan.Target:  # fmt: skip
    """What to prepare masks for: the calls on `device` (a GPU) with these heads, head dims (v's
    where it differs from q and k's) and options (`maskc.attention`'s). Ask it in the training
    process; it is plain data that pickles to DataLoader workers, which never touch the GPU."""
    call_plan.check_options(pack_gqa, deterministic, portable)
    device = torch.device(device)
    if device.type != "cuda":
        raise MaskcError(f"masks are planned for a GPU; {device} runs the reference path, which needs no plan")
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        raise MaskcError(f"target_for({str(device)!r}) asks for a GPU this process does not see "
                         f"({torch.cuda.device_count()} visible): ask for the target where training runs")  # fmt: skip
    capability, num_sms = call_plan.device_info(device)
    signing.plan_key()  # here, before DataLoader workers start, so that they sign with this process's key
    head_dims = HeadDim(head_dim, head_dim if head_dim_v is None else head_dim_v)
    return call_plan.make_target(capability, num_sms, dtype, num_heads_q, num_heads_kv, head_dims, False, False, False,
                                 pack_gqa, deterministic, sm_margin, portable, call_plan.portable_next_opted_in())  # fmt: skip


def prepare(mask: Mask, target: call_plan.Target | None, *, backward: bool = True) -> PreparedMask:
    """`mask` with its plan for `target` (`target_for`; None: no plan, for CPU runs): the
    forward's and, with `backward`, the backward's. The kernels' tile shapes come from the
    kernel family table, as compiled kernels' do."""
    if not isinstance(mask, Mask):
        raise TypeError(f"prepare takes a maskc Mask, got {type(mask).__name__}")
    if target is None:
        return PreparedMask(mask.table, torch.zeros(0, dtype=torch.int32))
    if not isinstance(target, call_plan.Target):
        raise TypeError(f"prepare takes a target made by maskc.target_for(device, ...) or None, got {target!r:.60}")
    forward, _ = call_plan.forward_requests(mask, target)
    call_plan.forward_schedule(mask, call_plan.launch_shape_of(target, forward), target.num_sms)
    if backward:
        request, _ = call_plan.backward_requests(mask, target)
        call_plan.backward_schedule(mask, call_plan.launch_shape_of(target, request), target.num_sms)
    return PreparedMask(mask.table, plan_records.encode(mask.table, mask.memo))
