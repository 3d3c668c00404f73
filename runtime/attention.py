"""`maskc.attention`: masked attention on the GPU through compiled maskc kernels.

Kernels come from artifact directories (`register_artifact`) or, when the compiler stack
is installed, are compiled on first use into the content-addressed cache (JIT). A kernel
is found by its *request* — arch, head dim, dtype, head counts, feature flags — the fields
a call determines; the tile shape it was built with comes from its manifest entry and
decides the schedule the runtime builds for it.

The kernel launches are the torch.library custom ops `maskc::attn_fwd` and `maskc::attn_bwd`
(fake implementations for tracing, autograd through `register_autograd`), so `maskc.attention`
runs inside `torch.compile(fullgraph=True)`. Op arguments are tensors and scalars only: a
kernel is its index in `_LOADED`, a schedule one int32 device tensor. Everything the
mask decides (GQA strategy, kernels, schedules) comes from `_plan`, which torch.compile runs
once per compilation, treating the result as constant: a compiled graph is specialised to its
mask (guarded on `Mask.__eq__` or identity, depending on the torch release), so a new mask
means a new compilation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.utils._pytree as pytree

from maskc.codegen.variant import (
    BACKWARD_EXTRAS_ARCHS,
    EXPERIMENTAL_ARCHS,
    NATIVE_ARCHS,
    PORTABLE_CTAS_PER_SM,
    WARPGROUP_ROWS,
)
from maskc.errors import ArtifactError, MaskcError, install_compiler_hint
from maskc.ir import Mask
from maskc.ir.schedule import (
    backward_has_partial_blocks,
    build_backward_schedule,
    build_deterministic_backward_schedule,
    build_schedule,
)
from maskc.ir.strategy import SUPPORTED_HEAD_DIMS, pack_gqa_supported, select_pack_gqa, select_tiles
from maskc.reference import AttentionMeta, check_attention_args
from maskc.runtime.abi import ABIS, BACKWARD_ABI, SCHEDULE_AND_LAUNCH, TensorArg, abi_to_json
from maskc.runtime.launch import (
    CuteRuntime,
    Kernel,
    find_runtime_library,
    installed_dsl_version,
    installed_library,
    runtime_at,
    runtime_of,
    shipped_library,
)
from maskc.runtime.manifest import Manifest, open_manifest

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
ARCHS = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90a", (10, 0): "sm_100a", (12, 0): "sm_120a"}
REQUEST_FIELDS = (
    "arch", "direction", "head_dim", "dtype", "num_heads_q", "num_heads_kv", "has_softcap", "has_sink", "has_max_logits",
    "pack_gqa", "deterministic", "unmasked", "portable",
)
_OPTIONAL_FIELDS = ("pack_gqa", "deterministic", "unmasked", "portable")  # False where a request or manifest leaves them out
SCHEDULE_ARGS = (
    *(a for a in SCHEDULE_AND_LAUNCH if isinstance(a, TensorArg)),
    *(next(a for a in BACKWARD_ABI if a.name == name) for name in ("items", "cta_items", "work_blocks", "block_rank")),
)
"""A schedule's tensors in `Schedule.arrays()` order (the forward's has the first five, the
backward's seven, the deterministic backward's all nine); every dim but the first has a fixed
extent."""

# A Mask is immutable and compares by value: torch.compile may hand it to `_plan` as a constant.
pytree.register_constant(Mask)


def _request_key(fields: dict[str, Any]) -> tuple:
    return tuple(fields.get(f, False) if f in _OPTIONAL_FIELDS else fields[f] for f in REQUEST_FIELDS)


class _Entry:
    """A registered kernel and the tile shape its schedule needs: tile_m is in query tokens
    (with PackGQA, the kernel's TILE_M packed rows hold TILE_M / G tokens), and items_per_tile
    the work items of each q tile (query heads, or K/V heads with PackGQA); a backward item may
    be split into `pieces` (one per query head of its K/V head); `ctas_per_sm` persistent CTAs
    share an SM. `index` is its place in `_LOADED`: what the custom ops take to name it."""

    def __init__(
        self,
        load: Callable[[], Kernel] | None,
        tile_m: int,
        tile_n: int,
        items_per_tile: int,
        deterministic: bool = False,
        pieces: int = 1,
        ctas_per_sm: int = 1,
    ):
        self._load, self._kernel = load, None
        self.tile_m, self.tile_n, self.items_per_tile = tile_m, tile_n, items_per_tile
        self.deterministic, self.pieces, self.ctas_per_sm = deterministic, pieces, ctas_per_sm
        self.index = len(_LOADED)
        _LOADED.append(self)

    @property
    def kernel(self) -> Kernel:
        """The kernel, its object loaded on first use: an artifact may hold kernels for GPUs
        other than this one (other archs), which are never loaded here."""
        if self._kernel is None:
            self._kernel = self._load()
        return self._kernel


def _entry(load: Callable[[], Kernel] | None, fields: dict[str, Any]) -> _Entry:
    hq, hkv = fields["num_heads_q"], fields["num_heads_kv"]
    portable = fields.get("portable", False)
    ctas_per_sm = PORTABLE_CTAS_PER_SM if portable else 1
    if fields["direction"] == "bwd":  # items are (k tile, kv head); tile_m is the q block
        deterministic = fields.get("deterministic", False)
        splits = fields["arch"] in BACKWARD_EXTRAS_ARCHS and not (deterministic or portable)
        pieces = hq // hkv if splits else 1
        # A deterministic CTA waits for lower items' CTAs: one per SM keeps them all resident.
        return _Entry(load, fields["tile_m"], fields["tile_n"], hkv, deterministic, pieces, 1 if deterministic else ctas_per_sm)
    if fields.get("pack_gqa", False):
        return _Entry(load, fields["tile_m"] // (hq // hkv), fields["tile_n"], hkv)
    return _Entry(load, fields["tile_m"], fields["tile_n"], hq, ctas_per_sm=ctas_per_sm)


def _pack_gqa(mask: Mask, request: dict[str, Any], num_sms: int) -> bool:
    """The GQA strategy for this call (maskc.ir.strategy.select_pack_gqa), cached in mask.memo."""
    hq, hkv = request["num_heads_q"], request["num_heads_kv"]
    if not pack_gqa_supported(hq, hkv):
        return False
    tiles = select_tiles(request["arch"], request["head_dim"])
    key = ("pack_gqa", hq, hkv, tiles.tile_m, tiles.tile_n, num_sms)
    cached = mask.memo.get(key)
    if cached is None:
        cached = mask.memo[key] = select_pack_gqa(mask, hq, hkv, tiles.tile_m, tiles.tile_n, num_sms)
    return cached


def _find_kernel(request: dict[str, Any], alternative: dict[str, Any] | None = None) -> _Entry:
    """A registered kernel for `request`; else a registered one for `alternative`, a kernel that
    serves the same call more slowly (registered artifacts win over compiling); else compile
    `request`."""
    entry = _KERNELS.get(_request_key(request))
    if entry is None and alternative is not None:
        entry = _KERNELS.get(_request_key(alternative))
    return entry or _jit(request)


def _backward_kernel(mask: Mask, request: dict[str, Any]) -> _Entry:
    """The backward kernel without line masks where the mask's backward schedule has no partial
    block (a full mask at any length): the masked kernel spills registers in its block loop. The
    masked kernel serves the other masks, and this one where only it is registered (where the
    arch's own backward has one: BACKWARD_EXTRAS_ARCHS)."""
    if request.get("portable", False) or request["arch"] not in BACKWARD_EXTRAS_ARCHS:
        return _find_kernel(request)
    tiles = select_tiles(request["arch"], request["head_dim"], "bwd")
    if backward_has_partial_blocks(mask, tiles.tile_m, tiles.tile_n):
        return _find_kernel(request)
    return _find_kernel({**request, "unmasked": True}, alternative=request)


_KERNELS: dict[tuple, _Entry] = {}
_LOADED: list[_Entry] = []


def register_artifact(directory: str | Path, sha256: str | None = None) -> list[str]:
    """Verify an artifact directory and make its kernels available to `maskc.attention`; the
    keys of its kernels. `sha256` pins the manifest's digest (`maskc verify DIR` prints it),
    and with it every file of the directory. Nothing is written to the directory, and the
    kernel objects and a runtime library it ships are used as the bytes that were verified."""
    manifest = open_manifest(directory, sha256)
    variants = manifest.body.get("variants", [])
    if not variants:
        return []
    for v in variants:
        abi = ABIS.get(v["fields"]["direction"])
        if abi is None or v["abi"] != abi_to_json(abi):
            raise ArtifactError(f"kernel {v['key']!r} in {directory} was built for another argument ABI: recompile")
    runtime = _runtime_for(manifest)
    for v in variants:
        load = partial(Kernel, runtime, manifest.files[v["object"]], v["function"], ABIS[v["fields"]["direction"]])
        _KERNELS[_request_key(v["fields"])] = _entry(load, v["fields"])
    return [v["key"] for v in variants]


def _runtime_for(manifest: Manifest) -> CuteRuntime:
    """The runtime library an artifact's objects run on. One it ships (hashed by its manifest) or
    one $MASKC_CUTE_RUNTIME names is the user's choice; the installed wheel's must be the DSL
    release recorded in the manifest, since objects run on the runtime of the release that built
    them."""
    shipped = shipped_library(manifest.files, manifest.directory)
    if shipped is not None:
        return runtime_of(shipped, str(manifest.directory))
    library = find_runtime_library()
    built, installed = manifest.body.get("toolchain", {}).get("nvidia-cutlass-dsl"), installed_dsl_version()
    if built is not None and library == installed_library() and installed != built:
        raise ArtifactError(
            f"kernels in {manifest.directory} were built with nvidia-cutlass-dsl {built}, but the runtime library found is "
            f"nvidia-cutlass-dsl {installed}'s: recompile, or ship the runtime with `maskc compile --bundle-runtime`"
        )
    return runtime_at(library)


def _jit(request: dict[str, Any]) -> _Entry:
    """Compile (or fetch from the cache) the kernel for `request`; needs the compiler stack."""
    try:
        from maskc.codegen.jit import compile_request
    except ImportError as exc:
        raise ArtifactError(
            f"no compiled maskc kernel for {request} and the compiler is not installed ({exc}); build one with "
            f"`maskc compile` and pass its directory to maskc.runtime.register_artifact, or {install_compiler_hint()}"
        ) from None
    register_artifact(compile_request(request))
    return _KERNELS[_request_key(request)]


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    sink: torch.Tensor | None,
    softmax_scale: float | None,
    softcap: float,
) -> float:
    """What the kernels need beyond the shared contract (CUDA, bf16/fp16, contiguous, a head
    dim with a kernel), then the contract itself; returns the effective softmax scale."""
    named = [("q", q), ("k", k), ("v", v)] + ([("sink", sink)] if sink is not None else [])
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _check_device(name, x)
        if name != "sink" and x.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; maskc kernels take bfloat16 or float16")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    scale = check_attention_args(q, k, v, mask, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    if q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise MaskcError(f"head_dim {q.shape[2]} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")
    return scale


def _check_device(name: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        raise ValueError(f"maskc.attention runs on CUDA tensors; {name} is on {x.device} (use maskc.reference_attention on CPU)")


def _schedule_tensors(mask: Mask, build: Callable, device: torch.device, *params: int) -> tuple[torch.Tensor, list[int], int]:
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


def _schedule_views(flat: torch.Tensor, rows: list[int]) -> dict[str, torch.Tensor]:
    """The schedule's tensors by ABI name, cut back out of its flat tensor (once per tensor:
    views cost host time on every call otherwise); they live as an attribute of the tensor,
    so they go with it."""
    views = getattr(flat, "_maskc_views", None)
    if views is None:
        parts = flat.split([r * math.prod(a.shape[1:]) for r, a in zip(rows, SCHEDULE_ARGS)])
        views = flat._maskc_views = {a.name: p.view(r, *a.shape[1:]) for a, p, r in zip(SCHEDULE_ARGS, parts, rows)}
    return views


class _LaunchArgs(NamedTuple):
    """One kernel launch as op arguments: its schedule (`_schedule_tensors`) and `launch`, the
    kernel's index in `_LOADED`, the grid size, the split slots and the row count of each
    schedule array.
    Few op arguments keep the dispatcher's per-call cost down."""

    schedule: torch.Tensor | None
    launch: list[int]


_NO_LAUNCH = _LaunchArgs(None, [])
"""The backward of a call that needs no gradient: nothing is planned or built for it."""


def _forward_launch(entry: _Entry, mask: Mask, num_sms: int, device: torch.device) -> _LaunchArgs:
    """One CTA per work item, up to the CTAs the SMs hold at once."""
    schedule, rows, _ = _schedule_tensors(mask, build_schedule, device, entry.tile_m, entry.tile_n)
    num_ctas = min(num_sms * entry.ctas_per_sm, max(1, rows[0] * entry.items_per_tile))
    return _LaunchArgs(schedule, [entry.index, num_ctas, 0, *rows])


def _backward_launch(entry: _Entry, mask: Mask, num_sms: int, device: torch.device) -> _LaunchArgs:
    """The backward schedule deals its (k tile, K/V head) items, or their pieces, to the CTAs itself."""
    num_ctas = min(num_sms * entry.ctas_per_sm, max(1, -(-mask.shape[1] // entry.tile_n) * entry.items_per_tile * entry.pieces))
    params = (entry.tile_m, entry.tile_n, entry.items_per_tile, num_ctas)
    if entry.deterministic:
        schedule, rows, slots = _schedule_tensors(mask, build_deterministic_backward_schedule, device, *params)
    else:
        schedule, rows, slots = _schedule_tensors(mask, build_backward_schedule, device, *params, entry.pieces)
    return _LaunchArgs(schedule, [entry.index, num_ctas, slots, *rows])


@torch.compiler.assume_constant_result
def _plan(
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
) -> tuple[_LaunchArgs, _LaunchArgs]:
    """The forward and backward launches of a call, which its mask, device, shapes and flags
    decide: GQA strategy, kernels (registered or compiled), schedules, all cached. It takes
    no tensor, so torch.compile runs it once per compilation and keeps the result as constants
    instead of tracing the numpy schedule passes. Eager calls find it in `mask.memo` (the key
    counts the loaded kernels, so registering artifacts later plans anew). `sm_margin` SMs are
    left free of the persistent grids (for communication kernels running alongside). `portable`
    None takes the GPU's own kernels where maskc has them, else the portable ones."""
    key = ("plan", device, dtype, num_heads_q, num_heads_kv, head_dim, has_softcap, has_sink, return_max_logits, pack_gqa,
           needs_grad, deterministic, sm_margin, portable, len(_LOADED))  # fmt: skip
    cached = mask.memo.get(key)
    if cached is not None:
        return cached
    capability, num_sms = _device_info(device)
    if not 0 <= sm_margin < num_sms:
        raise MaskcError(f"sm_margin must be in [0, {num_sms}) on this GPU, got {sm_margin}")
    num_sms -= sm_margin
    if capability not in ARCHS:
        raise MaskcError(f"no maskc kernel for compute capability {capability}; supported: {sorted(ARCHS)}")
    arch = ARCHS[capability]
    if portable is False and arch not in NATIVE_ARCHS:
        raise MaskcError(f"{arch} has only the portable kernel; pass portable=None or True")
    # An experimental arch's own kernels (compiled, never run here) only when asked for
    # (portable=False).
    experimental = arch in EXPERIMENTAL_ARCHS
    portable = portable or arch not in NATIVE_ARCHS or (experimental and portable is None)
    if portable and pack_gqa:
        raise MaskcError(
            f"the portable kernel (the one used on {arch}) has no PackGQA yet"
            + ("; on sm_90a pass portable=None" if arch in NATIVE_ARCHS and not experimental else "")
        )
    base = {"arch": arch, "head_dim": head_dim, "dtype": DTYPES[dtype], "num_heads_q": num_heads_q,
            "num_heads_kv": num_heads_kv, "has_softcap": has_softcap}  # fmt: skip
    request = {**base, "direction": "fwd", "has_sink": has_sink, "has_max_logits": return_max_logits}
    if portable:
        request.update(portable=True, pack_gqa=False)
        pack_gqa = False
    elif pack_gqa is None:
        request["pack_gqa"] = not experimental and _pack_gqa(mask, request, num_sms)
    else:
        if pack_gqa and not pack_gqa_supported(num_heads_q, num_heads_kv):
            raise MaskcError(f"pack_gqa needs Hq / Hkv a power of two in [2, 64]; got {num_heads_q} / {num_heads_kv}")
        request["pack_gqa"] = bool(pack_gqa)
    other_strategy = None if pack_gqa is not None or experimental else {**request, "pack_gqa": not request["pack_gqa"]}
    forward = _find_kernel(request, other_strategy)
    backward_launch = _NO_LAUNCH
    if needs_grad:
        backward = _backward_kernel(mask, {**base, "direction": "bwd", "has_sink": False, "has_max_logits": False,
                                           "pack_gqa": False, "deterministic": deterministic,
                                           "portable": portable})  # fmt: skip
        backward_launch = _backward_launch(backward, mask, num_sms, device)
    cached = mask.memo[key] = (_forward_launch(forward, mask, num_sms, device), backward_launch)
    return cached


@dataclass(frozen=True, eq=False)
class _Call:
    """One kernel launch with its scalars, rebuilt inside an op from the op's arguments."""

    kernel: _Entry
    num_ctas: int
    slots: int
    schedule: dict[str, torch.Tensor]
    scale: float
    softcap: float
    return_max_logits: bool = False

    @classmethod
    def of(cls, schedule: torch.Tensor, launch: list[int], scale: float, softcap: float, **flags: bool) -> _Call:
        kernel, num_ctas, slots, *rows = launch
        return cls(_LOADED[kernel], num_ctas, slots, _schedule_views(schedule, rows), scale, softcap, **flags)


def _launch(call: _Call, tensors: dict, device: torch.device) -> None:
    scalars = {"softmax_scale": call.scale, "softcap": call.softcap, "num_ctas": call.num_ctas}
    call.kernel.kernel({**tensors, **call.schedule}, scalars, torch.cuda.current_stream(device).cuda_stream)


def _forward_outputs(q: torch.Tensor, return_max_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, lse and row_max of a forward; row_max is empty unless asked for (op outputs never alias)."""
    tq, hq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=q.device)
    row_max = torch.empty((tq, hq) if return_max_logits else (0,), dtype=torch.float32, device=q.device)
    return out, lse, row_max


def _forward(q, k, v, sink, call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, row_max = _forward_outputs(q, call.return_max_logits)
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "row_max": row_max if call.return_max_logits else lse}
    tensors["sink"] = sink if sink is not None else lse[:1]
    _launch(call, tensors, q.device)
    return out, lse, row_max


def _backward(q, k, v, out, lse, sink, dout, dlse, call: _Call, dq_accum: torch.Tensor | None = None):
    """dq, dk, dv from the backward kernels; dsink from its closed form (the sinks join the
    softmax with no value: d sink = -sum over rows of P_sink * (rowsum(dO * O) - dlse)). With
    `dq_accum` (float32, like q) the kernel adds dQ into it and dq is that buffer, uncast."""
    entry = call.kernel
    tq, hq, d = q.shape
    padded = -(-tq // entry.tile_m) * entry.tile_m
    accumulate = dq_accum is not None
    # The kernel adds whole 8-row groups of dQ (the ABI's Tq8): pad the buffer when Tq is not a multiple.
    rows8 = -(-tq // 8) * 8
    dq_rows = dq_accum if accumulate and rows8 == tq else torch.zeros(rows8, hq, d, dtype=torch.float32, device=q.device)
    if accumulate and dq_rows is not dq_accum:
        dq_rows[:tq] = dq_accum
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # The preprocess kernel fills the statistics (head-major, padded to whole q blocks).
    delta = torch.empty(hq, padded, dtype=torch.float32, device=q.device)
    tensors = {"q": q, "k": k, "v": v, "out": out, "dout": dout.contiguous(), "lse": lse,
               "dlse": dlse if dlse is not None else lse[:0], "lse_log2": torch.empty_like(delta).view(-1),
               "delta": delta.view(-1), "dq_accum": dq_rows, "dk": dk, "dv": dv}  # fmt: skip
    if entry.deterministic:  # one counter per (head, q block, consumer warpgroup)
        semaphores = hq * padded // entry.tile_m * (entry.tile_n // WARPGROUP_ROWS)
        tensors["dq_semaphore"] = torch.zeros(semaphores, dtype=torch.int32, device=q.device)
    else:
        unused = torch.zeros(1, dtype=torch.int32, device=q.device)
        tensors.update(dq_semaphore=unused, work_blocks=unused, block_rank=unused)
    # Split items' fp32 dK / dV sums and piece counters in one zeroed buffer (never read, and
    # not filled, when nothing is split).
    sums, counts = max(call.slots, 1) * 2 * entry.tile_n * d, max(call.slots, 1) * (entry.tile_n // WARPGROUP_ROWS)
    split = (torch.zeros if call.slots else torch.empty)(sums + counts, dtype=torch.float32, device=q.device)
    tensors["dkv_accum"], tensors["dkv_count"] = split[:sums], split[sums:].view(torch.int32)
    _launch(call, tensors, q.device)
    dsink = None
    if sink is not None:
        delta_rows = delta[:, :tq].t()  # [Tq, Hq]
        dsink = -(torch.exp(sink[None] - lse[:, None, :]) * delta_rows[:, None, :]).sum(dim=0)
    if not accumulate:
        return dq_rows[:tq].to(q.dtype), dk, dv, dsink
    if dq_rows is not dq_accum:
        dq_accum.copy_(dq_rows[:tq])
    return dq_accum, dk, dv, dsink


def _attn_fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    schedule: torch.Tensor,
    launch: list[int],
    softmax_scale: float,
    softcap: float,
    return_max_logits: bool,
    bwd_schedule: torch.Tensor | None,
    bwd_launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, lse and row_max ([0] unless return_max_logits) from the forward kernel; `schedule`
    and `launch` as in `_LaunchArgs`. bwd_schedule and bwd_launch are the backward's (its
    kernel, deterministic or not, included), carried here because autograd sees only a forward
    op's inputs (bwd_launch is empty when no backward was planned)."""
    call = _Call.of(schedule, launch, softmax_scale, softcap, return_max_logits=return_max_logits)
    return _forward(q, k, v, sink, call)


_attn_fwd = torch.library.custom_op("maskc::attn_fwd", _attn_fwd_impl, mutates_args=(), device_types="cuda")


@_attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, sink, schedule, launch, softmax_scale, softcap, return_max_logits, bwd_schedule, bwd_launch):
    return _forward_outputs(q, return_max_logits)


def _attn_bwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sink: torch.Tensor | None,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    schedule: torch.Tensor,
    launch: list[int],
    softmax_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and dsink (empty without sinks: ops return tensors) from the backward kernel."""
    call = _Call.of(schedule, launch, softmax_scale, softcap)
    dq, dk, dv, dsink = _backward(q, k, v, out, lse, sink, dout, dlse, call)
    return dq, dk, dv, dsink if dsink is not None else lse.new_empty(0)


_attn_bwd = torch.library.custom_op("maskc::attn_bwd", _attn_bwd_impl, mutates_args=(), device_types="cuda")


@_attn_bwd.register_fake
def _attn_bwd_fake(q, k, v, out, lse, sink, dout, dlse, schedule, launch, softmax_scale, softcap):
    dsink = torch.empty_like(sink) if sink is not None else lse.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Saves q, k, v, out, lse, the sinks and the backward's launch; the kernel recomputes the rest."""
    q, k, v, sink, _, _, scale, softcap, _, bwd_schedule, bwd_launch = inputs
    out, lse, row_max = output
    ctx.save_for_backward(q, k, v, out, lse, sink, bwd_schedule)
    ctx.launch = (bwd_launch, scale, softcap)
    ctx.mark_non_differentiable(row_max)


def _attn_fwd_backward(
    ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None, _drow_max: Any, attn_bwd: Callable = torch.ops.maskc.attn_bwd
) -> tuple:
    q, k, v, out, lse, sink, schedule = ctx.saved_tensors
    launch, scale, softcap = ctx.launch
    dq, dk, dv, dsink = attn_bwd(q, k, v, out, lse, sink, dout, dlse, schedule, launch, scale, softcap)
    return (dq, dk, dv, dsink if sink is not None else None) + (None,) * 7


_attn_fwd.register_autograd(_attn_fwd_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager mode: the ops' own implementations and autograd wiring, minus the dispatcher, which
    costs a custom op 25-60 us of host time per call; torch.compile traces the ops instead."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        output = _attn_fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor, drow_max: torch.Tensor) -> tuple:  # type: ignore[override]
        return _attn_fwd_backward(ctx, dout, dlse, drow_max, attn_bwd=_attn_bwd_impl)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    portable: bool | None = None,
) -> tuple[torch.Tensor, AttentionMeta]:
    """Masked attention with maskc's kernels; the same contract as `maskc.reference_attention`,
    differentiable in q, k, v and sink (the gradient flows through lse too). Works inside
    torch.compile(fullgraph=True); build the Mask outside the compiled region.

    pack_gqa: the GQA strategy. None (default) lets maskc.ir.strategy.select_pack_gqa decide
    from the mask and the head counts (PackGQA packs the G = Hq / Hkv query heads of a K/V
    head into one M tile); True / False force it (True needs G a power of two in [2, 64]).
    deterministic: the backward adds each q block's dQ contributions in a fixed order, so the
    gradients are bitwise identical from run to run (a little slower).
    portable: the kernel family. None (default) takes the GPU's own kernels where maskc has
    verified ones (Hopper), else the portable ones (warp MMA: every GPU since Ampere); True
    forces the portable ones (no PackGQA yet); False asks for the GPU's own kernels, also the
    experimental Blackwell forward and backward (never run by maskc).
    """
    scale = _check_inputs(q, k, v, mask, sink, softmax_scale, softcap)
    _, hq, d = q.shape
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sink))
    fwd, bwd = _plan(mask, q.device, q.dtype, hq, k.shape[1], d, softcap > 0, sink is not None, return_max_logits,
                     pack_gqa, needs_grad, bool(deterministic), 0, portable)  # fmt: skip
    inputs = (q, k, v, sink, fwd.schedule, fwd.launch, scale, float(softcap), return_max_logits, bwd.schedule, bwd.launch)
    if torch.compiler.is_compiling():
        out, lse, row_max = torch.ops.maskc.attn_fwd(*inputs)
    elif needs_grad:
        out, lse, row_max = _EagerAttention.apply(*inputs)
    else:
        out, lse, row_max = _attn_fwd_impl(*inputs)
    max_logits = row_max.amax(dim=0) if return_max_logits else None
    return out, AttentionMeta(lse=lse, max_logits=max_logits)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, max_logits or None) of `attention`, with no autograd: for callers that run
    their own backward (`attention_backward`), like maskc.dist's stage pipeline. `sm_margin`
    SMs stay free for communication kernels that run alongside."""
    scale = _check_inputs(q, k, v, mask, sink, softmax_scale, softcap)
    _, hq, d = q.shape
    fwd, _ = _plan(mask, q.device, q.dtype, hq, k.shape[1], d, softcap > 0, sink is not None, return_max_logits, None,
                   False, False, sm_margin)  # fmt: skip
    out, lse, row_max = _attn_fwd_impl(q, k, v, sink, fwd.schedule, fwd.launch, scale, float(softcap), return_max_logits,
                                       None, [])  # fmt: skip
    return out, lse, row_max.amax(dim=0) if return_max_logits else None


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    sm_margin: int = 0,
    dq_accum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dsink or None) of attention over `mask` given the forward's `out` and `lse`,
    which may come from a larger softmax: with the lse of all keys and the merged output, the
    gradients of one part of the keys are exact (maskc.dist attends stage by stage). With
    `dq_accum` (float32, like q) dQ is added into it and returned uncast, so calls over the
    parts of the keys add up one dQ in float32."""
    scale = _check_inputs(q, k, v, mask, sink, softmax_scale, softcap)
    if dq_accum is not None and (dq_accum.shape != q.shape or dq_accum.dtype != torch.float32 or not dq_accum.is_contiguous()):
        raise MaskcError(f"dq_accum must be a contiguous float32 tensor of shape {tuple(q.shape)}")
    _, hq, d = q.shape
    _, bwd = _plan(mask, q.device, q.dtype, hq, k.shape[1], d, softcap > 0, sink is not None, False, None, True, False,
                   sm_margin)  # fmt: skip
    call = _Call.of(bwd.schedule, bwd.launch, scale, float(softcap))
    return _backward(q, k, v, out, lse, sink, dout.contiguous(), dlse, call, dq_accum)


@lru_cache(maxsize=None)
def _device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, multiprocessor count) of a GPU, asked once per process."""
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count
