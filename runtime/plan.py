"""Planning a call: everything its mask, device, shapes and flags decide — the kernel family,
the GQA strategy, the kernels, their schedules on the device and grid sizes — computed once
and cached on the mask (`plan_launches`)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import torch
import torch.utils._pytree as pytree

from maskc.artifact.abi import BACKWARD_ABI, TensorArg
from maskc.artifact.families import (
    ARCHS,
    DTYPES,
    KernelFamily,
    arch_of_capability,
    default_family,
    family_of,
    native_family,
    pack_gqa_supported,
)
from maskc.errors import MaskcError
from maskc.ir import Mask
from maskc.ir.schedule import (
    backward_has_partial_blocks,
    build_backward_schedule,
    build_deterministic_backward_schedule,
    build_schedule,
)
from maskc.ir.strategy import select_pack_gqa
from maskc.runtime import registry

#: The kernels' input dtypes, by torch dtype.
TORCH_DTYPES = {getattr(torch, d.torch): d.name for d in DTYPES}

_ARGS = {a.name: a for a in BACKWARD_ABI if isinstance(a, TensorArg)}
SCHEDULE_ARGS = tuple(_ARGS[name] for name in ("work_tile", "work_ranges", "ranges", "work_lines", "lines", "items",
                                               "cta_items", "work_blocks", "block_rank"))  # fmt: skip
"""A schedule's tensors in `Schedule.arrays()` order (the forward's has the first five, the
backward's seven, the deterministic backward's all nine); every dim but the first has a fixed
extent."""

# A Mask is immutable and compares by value: torch.compile may hand it to `plan_launches` as a constant.
pytree.register_constant(Mask)


@lru_cache(maxsize=None)
def device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, multiprocessor count) of a GPU, asked once per process."""
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def _pack_gqa(mask: Mask, request: Mapping[str, Any], family: KernelFamily, num_sms: int) -> bool:
    """The GQA strategy for this call (maskc.ir.strategy.select_pack_gqa), cached in mask.memo."""
    hq, hkv = request["num_heads_q"], request["num_heads_kv"]
    if not pack_gqa_supported(hq, hkv):
        return False
    tiles = family.forward.tiles[request["head_dim"]]
    key = ("pack_gqa", hq, hkv, tiles.tile_m, tiles.tile_n, num_sms)
    cached = mask.memo.get(key)
    if cached is None:
        cached = mask.memo[key] = select_pack_gqa(mask, hq, hkv, tiles.tile_m, tiles.tile_n, num_sms)
    return cached


def backward_kernel(mask: Mask, request: Mapping[str, Any]) -> registry.Entry:
    """The backward kernel without line masks where the mask's backward schedule has no partial
    block (a full mask at any length): the masked kernel spills registers in its block loop. The
    masked kernel serves the other masks, and this one where only it is registered (where the
    family's backward has an unmasked variant at all)."""
    family = family_of(request["arch"], request.get("portable", False))
    if not family.has("bwd", "unmasked"):
        return registry.find_kernel(request)
    tiles = family.backward.tiles[request["head_dim"]]
    if backward_has_partial_blocks(mask, tiles.tile_m, tiles.tile_n):
        return registry.find_kernel(request)
    return registry.find_kernel({**request, "unmasked": True}, alternative=request)


def schedule_tensors(mask: Mask, build: Callable, device: torch.device, *params: int) -> tuple[torch.Tensor, list[int], int]:
    """The schedule `build(mask, *params)` on the device as one int32 tensor holding its arrays
    back to back (one copy, one op argument), the row count of each and its split slots (a
    backward's), built once per (mask, builder, params, device): masks are immutable. An empty
    array gets a zero row (never read) so it has an address."""
    key = (build.__name__, *params, device)
    cached = mask.memo.get(key)
    if cached is None:
        schedule = build(mask, *params)
        arrays = [a if len(a) else np.zeros((1, *a.shape[1:]), np.int32) for a in schedule.arrays()]
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays])).to(device)
        cached = mask.memo[key] = (flat, [a.shape[0] for a in arrays], getattr(schedule, "num_slots", 0))
    return cached


def schedule_views(flat: torch.Tensor, rows: list[int]) -> dict[str, torch.Tensor]:
    """The schedule's tensors by ABI name, cut back out of its flat tensor (once per tensor:
    views cost host time on every call otherwise); they live as an attribute of the tensor,
    so they go with it."""
    views = getattr(flat, "_maskc_views", None)
    if views is None:
        parts = flat.split([r * math.prod(a.shape[1:]) for r, a in zip(rows, SCHEDULE_ARGS)])
        views = flat._maskc_views = {a.name: p.view(r, *a.shape[1:]) for a, p, r in zip(SCHEDULE_ARGS, parts, rows)}
    return views


class LaunchArgs(NamedTuple):
    """One kernel launch as op arguments: its schedule (`schedule_tensors`) and `launch`, the
    kernel's index in `registry.LOADED`, the grid size, the split slots and the row count of
    each schedule array.
    Few op arguments keep the dispatcher's per-call cost down."""

    schedule: torch.Tensor | None
    launch: list[int]


NO_LAUNCH = LaunchArgs(None, [])
"""The backward of a call that needs no gradient: nothing is planned or built for it."""


def _forward_launch(entry: registry.Entry, mask: Mask, num_sms: int, device: torch.device) -> LaunchArgs:
    """One CTA per work item, up to the CTAs the SMs hold at once."""
    schedule, rows, _ = schedule_tensors(mask, build_schedule, device, entry.tile_m, entry.tile_n)
    num_ctas = min(num_sms * entry.ctas_per_sm, max(1, rows[0] * entry.items_per_tile))
    return LaunchArgs(schedule, [entry.index, num_ctas, 0, *rows])


def _backward_launch(entry: registry.Entry, mask: Mask, num_sms: int, device: torch.device) -> LaunchArgs:
    """The backward schedule deals its (k tile, K/V head) items, or their pieces, to the CTAs itself."""
    num_ctas = min(num_sms * entry.ctas_per_sm, max(1, -(-mask.shape[1] // entry.tile_n) * entry.items_per_tile * entry.pieces))
    params = (entry.tile_m, entry.tile_n, entry.items_per_tile, num_ctas)
    if entry.deterministic:
        schedule, rows, slots = schedule_tensors(mask, build_deterministic_backward_schedule, device, *params)
    else:
        schedule, rows, slots = schedule_tensors(mask, build_backward_schedule, device, *params, entry.pieces)
    return LaunchArgs(schedule, [entry.index, num_ctas, slots, *rows])


@torch.compiler.assume_constant_result
def plan_launches(
    mask: Mask,
    device: torch.device,
    dtype: torch.dtype,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    has_softcap: bool,
    has_sink: bool,
    return_max_logits: bool,
    pack_gqa: bool | None,
    needs_grad: bool,
    deterministic: bool,
    sm_margin: int = 0,
    portable: bool | None = None,
) -> tuple[LaunchArgs, LaunchArgs]:
    """The forward and backward launches of a call, which its mask, device, shapes and flags
    decide: GQA strategy, kernels (registered or compiled), schedules, all cached. It takes
    no tensor, so torch.compile runs it once per compilation and keeps the result as constants
    instead of tracing the numpy schedule passes. Eager calls find it in `mask.memo` (the key
    counts the loaded kernels, so registering artifacts later plans anew). `sm_margin` SMs are
    left free of the persistent grids (for communication kernels running alongside). `portable`
    None takes the GPU's own kernels where maskc has verified ones, else the portable ones."""
    key = ("plan", device, dtype, num_heads_q, num_heads_kv, head_dim, has_softcap, has_sink, return_max_logits, pack_gqa,
           needs_grad, deterministic, sm_margin, portable, len(registry.LOADED))  # fmt: skip
    cached = mask.memo.get(key)
    if cached is not None:
        return cached
    capability, num_sms = device_info(device)
    if not 0 <= sm_margin < num_sms:
        raise MaskcError(f"sm_margin must be in [0, {num_sms}) on this GPU, got {sm_margin}")
    num_sms -= sm_margin
    arch = arch_of_capability(capability)
    if arch is None:
        raise MaskcError(
            f"no maskc kernel for compute capability {capability}; supported: {sorted(a.capability for a in ARCHS)}"
        )
    family = _family(arch.name, portable)
    if head_dim not in family.head_dims:
        raise MaskcError(f"head_dim {head_dim} is not supported on {arch.name}; supported head dims: {family.head_dims}")
    if pack_gqa and not family.has("fwd", "pack_gqa"):
        raise MaskcError(
            f"the {family.title} kernel (the one used on {arch.name}) has no PackGQA yet"
            + (f"; on {arch.name} pass portable=None" if default_family(arch.name).has("fwd", "pack_gqa") else "")
        )
    base = {"arch": arch.name, "head_dim": head_dim, "dtype": TORCH_DTYPES[dtype], "num_heads_q": num_heads_q,
            "num_heads_kv": num_heads_kv, "has_softcap": has_softcap}  # fmt: skip
    request = {**base, "direction": "fwd", "has_sink": has_sink, "has_max_logits": return_max_logits}
    if family.portable:
        request["portable"] = True
    other_strategy = None
    if not family.has("fwd", "pack_gqa"):
        request["pack_gqa"] = False
    elif pack_gqa is None:
        request["pack_gqa"] = _pack_gqa(mask, request, family, num_sms)
        other_strategy = {**request, "pack_gqa": not request["pack_gqa"]}
    else:
        if pack_gqa and not pack_gqa_supported(num_heads_q, num_heads_kv):
            raise MaskcError(f"pack_gqa needs Hq / Hkv a power of two in [2, 64]; got {num_heads_q} / {num_heads_kv}")
        request["pack_gqa"] = bool(pack_gqa)
    forward = registry.find_kernel(request, other_strategy)
    backward_launch = NO_LAUNCH
    if needs_grad:
        backward = backward_kernel(mask, {**base, "direction": "bwd", "has_sink": False, "has_max_logits": False,
                                          "pack_gqa": False, "deterministic": deterministic,
                                          "portable": family.portable})  # fmt: skip
        backward_launch = _backward_launch(backward, mask, num_sms, device)
    cached = mask.memo[key] = (_forward_launch(forward, mask, num_sms, device), backward_launch)
    return cached


def _family(arch: str, portable: bool | None) -> KernelFamily:
    """The kernels a call runs: the GPU's own where maskc has verified ones, else the portable
    ones (`portable` None); the portable ones (True); the GPU's own, also experimental ones (False)."""
    if portable is None:
        return default_family(arch)
    if not portable and native_family(arch) is None:
        raise MaskcError(f"{arch} has only the portable kernel; pass portable=None or True")
    return family_of(arch, portable)
