"""Planning one call on one GPU: everything its mask and its `Target` (GPU, shapes, options)
decide: the kernel family, the GQA strategy, the kernels, their schedules and grid sizes. The
decisions and host schedules are cached in the mask's memo under keys of plain values, so
`maskc.prepare` can compute them ahead of time (in a DataLoader worker) and hand them over; the
kernels and device copies are found per process and device. (A context-parallel plan over many
GPUs is `maskc.dist.plan`'s `Plan`.)"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from maskc.artifact.abi import BACKWARD_ABI, TensorArg
from maskc.artifact.kernel_families import (
    ARCHS,
    DTYPES,
    PORTABLE,
    PORTABLE_NEXT,
    PORTABLE_NEXT_ENV,
    HeadDim,
    KernelFamily,
    Tiles,
    arch_of_capability,
    check_head_dim,
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
    build_forward_schedule,
)
from maskc.ir.strategy import select_forward
from maskc.runtime import registry

#: The kernels' input dtypes, by torch dtype.
TORCH_DTYPES = {getattr(torch, d.torch): d.name for d in DTYPES}

_ARGS = {a.name: a for a in BACKWARD_ABI if isinstance(a, TensorArg)}
SCHEDULE_ARGS = tuple(_ARGS[name] for name in ("work_tile", "work_ranges", "ranges", "work_lines", "lines",
                                               "key_bounds", "query_bounds", "items", "cta_items", "work_blocks",
                                               "block_rank"))  # fmt: skip
"""A schedule's tensors in `Schedule.arrays()` order (the forward's has the first seven, the
backward's nine, the deterministic backward's all eleven); every dim but the first has a fixed
extent."""

@cache
def device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, multiprocessor count) of a GPU, asked once per process."""
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


@dataclass(frozen=True)
class Target:
    """Everything but the mask that plans a call: the GPU (its arch, and the SMs the persistent
    grids may use), the kernel family, and the request fields of the call's kernels. Plain
    values, so it crosses to a DataLoader worker (`maskc.prepare`)."""

    arch: str
    num_sms: int
    portable: bool
    base: tuple[tuple[str, Any], ...]
    """arch, head dim, dtype, head counts, softcap and family: the fields both directions' kernels share."""
    has_sink: bool
    has_max_logits: bool
    pack_gqa: bool | None
    deterministic: bool
    portable_next: bool = False
    """The portable kernels are the experimental next ones (`portable_next_opted_in`)."""

    @property
    def family(self) -> KernelFamily:
        return family_of(self.arch, self.portable, self.portable_next)

    def tiles(self, direction: str) -> Tiles:
        """The tile shape of the family's `direction` kernel for the call's head dims; an error
        naming the head dims it has where it has none (a backward of a forward-only head dim)."""
        return _target_tiles(self, direction)

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self.base)


@cache
def _target_tiles(target: Target, direction: str) -> Tiles:
    """`Target.tiles`, once per target (an eager call with gradients asks for the backward's)."""
    head_dim = HeadDim.of(target.fields)
    check_head_dim(target.family, direction, head_dim, target.arch)
    return target.family.kernel(direction).arch_tiles(target.arch)[head_dim]


def check_options(pack_gqa: object, deterministic: object, portable: object) -> None:
    """The flags of a user's call or target: True or False (pack_gqa and portable also None,
    maskc's choice), so that a string or a number is an error rather than truthy."""
    for name, value, may_be_none in (("pack_gqa", pack_gqa, True), ("deterministic", deterministic, False),
                                     ("portable", portable, True)):  # fmt: skip
        if not isinstance(value, bool) and not (may_be_none and value is None):
            raise TypeError(f"{name} must be {'None, ' if may_be_none else ''}True or False, got {value!r}")


def portable_next_opted_in() -> bool:
    """Whether this process runs the experimental next portable kernels wherever it runs portable
    ones: $MASKC_PORTABLE_NEXT is 1 (unset or 0: the verified ones)."""
    value = os.environ.get(PORTABLE_NEXT_ENV, "0")
    if value not in ("0", "1"):
        raise MaskcError(f"{PORTABLE_NEXT_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


@lru_cache(maxsize=256)
def make_target(capability: tuple[int, int], num_sms: int, dtype: torch.dtype, num_heads_q: int, num_heads_kv: int,
                head_dim: HeadDim, has_softcap: bool, has_sink: bool, return_max_logits: bool, pack_gqa: bool | None,
                deterministic: bool, sm_margin: int = 0, portable: bool | None = None,
                portable_next: bool = False) -> Target:  # fmt: skip
    """The target of a call on a GPU of `capability` with `num_sms` SMs, validated: every
    error a call's options can cause is raised here, before any kernel is looked for.
    `portable_next`: the experimental next portable kernels wherever portable ones run."""
    if not 0 <= sm_margin < num_sms:
        raise MaskcError(f"sm_margin must be in [0, {num_sms}) on this GPU, got {sm_margin}")
    arch = arch_of_capability(capability)
    if arch is None:
        raise MaskcError(
            f"no maskc kernel for compute capability {capability}; supported: {sorted(a.capability for a in ARCHS)}"
        )
    family = _family(arch.name, portable)
    if family is PORTABLE and portable_next:
        family = PORTABLE_NEXT
    if head_dim not in family.head_dims:
        raise MaskcError(
            f"head_dim {head_dim} is not supported on {arch.name}; supported head dims: {', '.join(map(str, family.head_dims))}"
            + (f"; the experimental next portable kernels have {', '.join(map(str, PORTABLE_NEXT.head_dims))} "
               f"({PORTABLE_NEXT_ENV}=1)" if family is PORTABLE and head_dim in PORTABLE_NEXT.head_dims else "")
        )  # fmt: skip
    if pack_gqa and not family.has("fwd", "pack_gqa"):
        raise MaskcError(
            f"the {family.title} kernel (the one used on {arch.name}) has no PackGQA yet"
            + (f"; on {arch.name} pass portable=None" if default_family(arch.name).has("fwd", "pack_gqa") else "")
            + (f"; the experimental next portable kernels have it ({PORTABLE_NEXT_ENV}=1)" if family is PORTABLE else "")
        )
    if pack_gqa and not pack_gqa_supported(num_heads_q, num_heads_kv):
        raise MaskcError(f"pack_gqa needs Hq / Hkv a power of two in [2, 64]; got {num_heads_q} / {num_heads_kv}")
    base = {"arch": arch.name, "head_dim": head_dim.qk, "head_dim_v": head_dim.v, "dtype": TORCH_DTYPES[dtype],
            "num_heads_q": num_heads_q, "num_heads_kv": num_heads_kv, "has_softcap": has_softcap,
            "portable": family.portable, **({"portable_next": True} if family is PORTABLE_NEXT else {})}  # fmt: skip
    return Target(arch.name, num_sms - sm_margin, family.portable, tuple(base.items()), has_sink, return_max_logits,
                  None if pack_gqa is None else bool(pack_gqa), deterministic, family is PORTABLE_NEXT)  # fmt: skip


def memoized(mask: Mask, key: tuple, compute: Callable[[], Any]) -> Any:
    """`compute()` once per mask and key: a Mask never changes. The keys of the decisions and
    host schedules hold only str, int and bool, so a prepared mask carries them (`maskc.prepare`)."""
    value = mask.memo.get(key)
    if value is None:
        value = mask.memo[key] = compute()
    return value


def forward_requests(mask: Mask, target: Target) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The forward kernel's request, and the one of a kernel that serves the call too, where
    maskc chose (maskc.ir.strategy): with the tall tile, the other tile and the same GQA
    strategy; else the other GQA strategy."""
    request = {**target.fields, "direction": "fwd", "has_sink": target.has_sink, "has_max_logits": target.has_max_logits}
    hq, hkv = request["num_heads_q"], request["num_heads_kv"]
    tiles, tall = target.tiles("fwd"), tall_tiles(target)
    if target.pack_gqa is not None or not target.family.has("fwd", "pack_gqa"):
        packs: tuple[bool, ...] = (bool(target.pack_gqa),)
    else:
        packs = (False, True) if pack_gqa_supported(hq, hkv) else (False,)
    if tall is None and len(packs) == 1:
        return {**request, "pack_gqa": packs[0]}, None
    shapes = ((tiles.tile_m, tiles.tile_n), None if tall is None else (tall.tile_m, tall.tile_n))
    # Plain ints (a prepared mask carries the decision): the tall tile (0 x 0: none), the
    # strategies allowed (bit 0 plain, bit 1 PackGQA), and the choice as 2 * tall + PackGQA.
    key = ("forward", hq, hkv, *shapes[0], *(shapes[1] or (0, 0)), sum(1 << p for p in packs), target.num_sms)
    documents = target.family.document_tiles
    choice = memoized(mask, key, lambda: _choice_code(*select_forward(mask, hq, hkv, *shapes, target.num_sms, packs=packs,
                                                                      keep=True, documents=documents)))  # fmt: skip
    is_tall, packed = bool(choice >> 1), bool(choice & 1)
    chosen = {**request, "pack_gqa": packed, **({"tall": True} if is_tall else {})}
    if is_tall:
        return chosen, {**request, "pack_gqa": packed}
    return chosen, ({**request, "pack_gqa": not packed} if len(packs) == 2 else None)


def _choice_code(tall: bool, pack_gqa: bool) -> int:
    return 2 * tall + pack_gqa


@cache
def tall_tiles(target: Target) -> Tiles | None:
    """The tall forward tile of the target's head dims, None where the family has none."""
    return target.family.forward.tall_tiles.get(HeadDim.of(target.fields))


def launch_shape_of(target: Target, request: dict[str, Any]) -> registry.LaunchShape:
    """The launch shape of `request`'s kernel with the family table's tiles (those it is
    compiled with): what a plan made ahead of the kernels (`maskc.prepare`) builds schedules for."""
    tiles = tall_tiles(target) if request.get("tall", False) else target.tiles(request["direction"])
    return registry.launch_shape({**request, "tile_m": tiles.tile_m, "tile_n": tiles.tile_n, "num_stages": tiles.num_stages})


def backward_requests(mask: Mask, target: Target, grid_queries: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The backward kernel's request: without line masks where the mask's backward schedule has
    no partial block (a full mask at any length: the masked kernel spills registers in its block
    loop), then with the masked kernel as the one that serves the call too; else masked.
    `grid_queries`: the schedule's q blocks on the grid (`backward_schedule`)."""
    request = {**target.fields, "direction": "bwd", "has_sink": False, "has_max_logits": False, "pack_gqa": False,
               "deterministic": target.deterministic}  # fmt: skip
    if not target.family.has("bwd", "unmasked"):
        return request, None
    tiles = target.tiles("bwd")
    # The transposed schedule it looks at is kept for the backward schedule (built from it).
    documents = target.family.document_tiles
    partial = memoized(mask, ("partial", tiles.tile_m, tiles.tile_n, documents, grid_queries),
                    lambda: backward_has_partial_blocks(mask, tiles.tile_m, tiles.tile_n, keep=True, documents=documents,
                                                        heaviest_first=not target.deterministic,
                                                        grid_queries=grid_queries))  # fmt: skip
    return (request, None) if partial else ({**request, "unmasked": True}, request)


def backward_kernel(mask: Mask, target: Target, grid_queries: bool = False) -> registry.Entry:
    """The backward kernel of a call (`backward_requests`): registered, or from the kernel source."""
    return registry.find_kernel(*backward_requests(mask, target, grid_queries))


class HostSchedule(NamedTuple):
    """A schedule as one int32 CPU tensor holding its arrays back to back (one copy, one op
    argument), the row count of each, its split slots (a backward's) and its grid size."""

    flat: torch.Tensor
    rows: tuple[int, ...]
    slots: int
    num_ctas: int


def _host_schedule(mask: Mask, build: Callable, num_ctas: int, *params: int) -> HostSchedule:
    """`build(mask, *params)` flattened; an empty array gets a zero row (never read) so it has an address."""

    def compute() -> HostSchedule:
        schedule = build(mask, *params)
        arrays = [a if len(a) else np.zeros((1, *a.shape[1:]), np.int32) for a in schedule.arrays()]
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]))
        return HostSchedule(flat, tuple(a.shape[0] for a in arrays), getattr(schedule, "num_slots", 0), num_ctas)

    return memoized(mask, (build.__name__, num_ctas, *params), compute)


def forward_schedule(mask: Mask, shape: registry.LaunchShape, num_sms: int) -> HostSchedule:
    """One CTA per work item, up to the CTAs the SMs hold at once; k blocks and q tiles per
    document where the kernel takes them."""
    tiles = -(-mask.shape[0] // shape.tile_m)
    num_ctas = min(num_sms * shape.ctas_per_sm, max(1, tiles * shape.items_per_tile))
    return _host_schedule(mask, build_forward_schedule, num_ctas, shape.tile_m, shape.tile_n, shape.document_tiles,
                          shape.document_rows)  # fmt: skip


def backward_schedule(mask: Mask, shape: registry.LaunchShape, num_sms: int, grid_queries: bool = False) -> HostSchedule:
    """The backward schedule deals its (k tile, K/V head) items, or their pieces, to the CTAs
    itself; k tiles, and q blocks unless `grid_queries`, per document where the kernel takes
    them (the deterministic kernel's q blocks on the grid)."""
    tiles = -(-mask.shape[1] // shape.tile_n)
    num_ctas = min(num_sms * shape.ctas_per_sm, max(1, tiles * shape.items_per_tile * shape.pieces))
    params = (shape.tile_m, shape.tile_n, shape.items_per_tile, num_ctas)
    if shape.deterministic:
        return _host_schedule(mask, build_deterministic_backward_schedule, num_ctas, *params, shape.document_tiles)
    return _host_schedule(mask, build_backward_schedule, num_ctas, *params, shape.pieces, shape.document_tiles,
                          grid_queries)  # fmt: skip


def schedule_views(flat: torch.Tensor, rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """The schedule's tensors by ABI name, cut back out of its flat tensor (once per tensor:
    views cost host time on every call otherwise); they live as an attribute of the tensor,
    so they go with it."""
    views = getattr(flat, "_maskc_views", None)
    if views is None:
        parts = flat.split([r * math.prod(a.shape[1:]) for r, a in zip(rows, SCHEDULE_ARGS)])
        views = flat._maskc_views = {a.name: p.view(r, *a.shape[1:]) for a, p, r in zip(SCHEDULE_ARGS, parts, rows)}
    return views


class Launch(NamedTuple):
    """One kernel launch: the kernel, its schedule on the launch's device and grid size."""

    kernel: registry.Entry
    schedule: torch.Tensor
    rows: tuple[int, ...]
    slots: int
    num_ctas: int


def _launch(mask: Mask, kernel: registry.Entry, host: HostSchedule, device: torch.device) -> Launch:
    """The launch of `kernel` with its schedule copied to `device` once per mask. The copy goes
    through pinned memory, asynchronously: a copy from pageable memory would wait for the GPU
    to finish everything queued before it, so the host could never run a step ahead."""
    key = ("device", host.flat.data_ptr(), device)
    schedule = mask.memo.get(key)
    if schedule is None:
        flat = host.flat
        if device.type == "cuda" and not flat.is_pinned():
            flat = torch.empty_like(flat, pin_memory=True).copy_(flat)
        schedule = mask.memo[key] = flat.to(device, non_blocking=True)
    return Launch(kernel, schedule, host.rows, host.slots, host.num_ctas)


def plan_forward(mask: Mask, target: Target, device: torch.device) -> Launch:
    """The forward launch of a call: its kernel (registered or compiled) and schedule."""

    def compute() -> Launch:
        kernel = registry.find_kernel(*forward_requests(mask, target))
        return _launch(mask, kernel, forward_schedule(mask, kernel.shape, target.num_sms), device)

    return _launch_of(mask, "forward", target, device, compute)


def plan_backward(mask: Mask, target: Target, device: torch.device, grid_queries: bool = False) -> Launch:
    """The backward launch of a call; `grid_queries`, q blocks on the grid, for a dQ buffer the
    caller owns (`backward_schedule`, `ops.backward_cuda`)."""

    def compute() -> Launch:
        kernel = backward_kernel(mask, target, grid_queries)
        return _launch(mask, kernel, backward_schedule(mask, kernel.shape, target.num_sms, grid_queries), device)

    return _launch_of(mask, ("backward", grid_queries), target, device, compute)


def _launch_of(mask: Mask, direction: str | tuple, target: Target, device: torch.device,
               compute: Callable[[], Launch]) -> Launch:  # fmt: skip
    """A call's launch, found in one lookup from the second call with the mask on (every layer,
    every step with the same mask). The key counts the loaded kernels, so registering artifacts
    later plans anew; it holds a Target, so a prepared plan never carries it."""
    return memoized(mask, (direction, target, device, len(registry.LOADED)), compute)


def _family(arch: str, portable: bool | None) -> KernelFamily:
    """The kernels a call runs: the GPU's own where maskc has verified ones, else the portable
    ones (`portable` None); the portable ones (True); the GPU's own, also experimental ones (False)."""
    if portable is None:
        return default_family(arch)
    if not portable and native_family(arch) is None:
        raise MaskcError(f"{arch} has only the portable kernel; pass portable=None or True")
    return family_of(arch, portable)
