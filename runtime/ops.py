"""The attention as the torch.library custom ops `maskc::attn_fwd` and `maskc::attn_bwd` (fake
implementations for tracing, autograd through `register_autograd`), so `maskc.attention` runs
inside `torch.compile(fullgraph=True)`.

The mask reaches the ops as data: its table (`Mask.table`) or position ids (`PositionMask`),
a prepared plan (`maskc.prepare`) and a batch's padding mask are tensor arguments, and only
the call's options are constants. A compiled graph is therefore specialised to shapes and
options, never to a mask: each call plans its
mask inside the op (`maskc.runtime.call_plan`, cached on the mask, which is found again from its
table by every layer and by the backward: `maskc.runtime.masks`). On CUDA the ops launch
maskc's kernels; on the CPU they compute the reference attention (`maskc.reference`), so a
model runs, and can be tested, anywhere. Eager calls run the same implementations without the
dispatcher (`EagerAttention`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NamedTuple

import torch

import maskc.reference as reference
from maskc.artifact.abi import PACE_COUNTERS
from maskc.artifact.kernel_families import HeadDim, backward_warpgroups
from maskc.ir import Mask
from maskc.runtime import call_plan, masks
from maskc.runtime.call_plan import Launch, Target, schedule_views


@dataclass(frozen=True)
class Options:
    """The call's options as the ops take them: one int list, constant in a compiled graph."""

    pack_gqa: bool | None
    deterministic: bool
    portable: bool | None
    positions: tuple[int, int, int] | None = None
    """`PositionMask.options()` when the mask tensor holds position ids; None for a table."""
    portable_next: bool = field(default_factory=call_plan.portable_next_opted_in)
    """$MASKC_PORTABLE_NEXT when the call began: its forward and backward run one family."""

    def encode(self) -> list[int]:
        positions = [1, *self.positions] if self.positions is not None else [0, 0, -1, -1]
        return [_tristate(self.pack_gqa), int(self.deterministic), _tristate(self.portable), *positions, int(self.portable_next)]

    @classmethod
    def decode(cls, values: Sequence[int]) -> Options:
        pack_gqa, deterministic, portable, by_positions, *positions, portable_next = values
        return cls(None if pack_gqa < 0 else bool(pack_gqa), bool(deterministic), None if portable < 0 else bool(portable),
                   tuple(positions) if by_positions else None, bool(portable_next))  # fmt: skip


def _tristate(value: bool | None) -> int:
    return -1 if value is None else int(value)


def call_target(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, has_softcap: bool, has_sink: bool,
                return_max_logits: bool, options: Options, sm_margin: int = 0) -> Target:  # fmt: skip
    """The `Target` of a call on q's GPU with these shapes and options."""
    capability, num_sms = call_plan.device_info(q.device)
    *_, hq, d = q.shape
    return call_plan.make_target(capability, num_sms, q.dtype, hq, k.shape[-2], HeadDim(d, v.shape[-1]), has_softcap, has_sink,
                                 return_max_logits, options.pack_gqa, options.deterministic, sm_margin, options.portable,
                                 options.portable_next)  # fmt: skip


def packed_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] or [B, S, H, D] as [T, H, D] (a view: the kernels read the packed batch);
    x itself where it is [T, H, D] already (a view costs a microsecond or two of host time)."""
    return x if x.dim() == 3 else x.view(-1, *x.shape[-2:])


def _like(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """x viewed as `shape`, or x itself where it has that shape."""
    return x if x.shape == shape else x.view(shape)


def _call_mask(mask: torch.Tensor, prepared: torch.Tensor | None, padding: torch.Tensor | None, q: torch.Tensor,
               k: torch.Tensor, options: Options) -> Mask:  # fmt: skip
    """The mask over the call's rows, from its table or its position ids (`maskc.runtime.masks`)."""
    if options.positions is not None:
        base = masks.positions_mask(mask, bool(options.positions[0]), *options.positions[1:])
    else:
        base = masks.mask_of(mask, prepared)
    return masks.call_mask(base, q.shape, k.shape, padding)


def _forward_outputs(q: torch.Tensor, v: torch.Tensor, return_max_logits: bool,
                     lse_log2_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """out (q's rows and heads, v's head dim), lse and row_max (q's shape without head_dim;
    row_max empty unless asked for: op outputs never alias), and the backward's lse_log2, head
    by head `lse_log2_rows` rows (empty for none)."""
    rows = q.shape[:-1]
    out = q.new_empty(*rows, v.shape[-1])
    lse = q.new_empty(rows, dtype=torch.float32)
    row_max = q.new_empty(rows if return_max_logits else (0,), dtype=torch.float32)
    lse_log2 = q.new_empty(q.shape[-2] * lse_log2_rows, dtype=torch.float32)
    return out, lse, row_max, lse_log2


def lse_log2_rows(q: torch.Tensor, target: Target) -> int:
    """The rows a head of the backward's lse_log2 has for q ([T, H, D] or [B, S, H, D]): the
    call's rows rounded up to whole q blocks of `target`'s backward."""
    tile = target.tiles("bwd").tile_m
    return -(-(q.numel() // (q.shape[-2] * q.shape[-1])) // tile) * tile


def _stream(device: torch.device) -> int:
    """The current stream of `device`, without a Stream object."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def _run(launch: Launch, tensors: dict, scale: float, softcap: float, stream: int) -> None:
    scalars = {"softmax_scale": scale, "softcap": softcap, "num_ctas": launch.num_ctas}
    launch.kernel.kernel(tensors, schedule_views(launch.schedule, launch.rows), scalars, stream)


def forward_cuda(q, k, v, sink, launch: Launch, scale: float, softcap: float, return_max_logits: bool,
                 lse_log2_rows: int = 0):  # fmt: skip
    """out, lse, row_max and lse_log2 (`_forward_outputs`) from the forward kernel, for q [T, H, D]."""
    out, lse, row_max, lse_log2 = _forward_outputs(q, v, return_max_logits, lse_log2_rows)
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "lse_log2": lse_log2,
               "row_max": row_max if return_max_logits else lse}  # fmt: skip
    tensors["sink"] = sink if sink is not None else lse  # read only by kernels with sinks
    _run(launch, tensors, scale, softcap, _stream(q.device))
    return out, lse, row_max, lse_log2


def backward_cuda(q, k, v, out, lse, sink, dout, dlse, launch: Launch, scale: float, softcap: float,
                  dq_accum: torch.Tensor | None = None, lse_log2: torch.Tensor | None = None):  # fmt: skip
    """dq, dk, dv, dsink from the backward kernels for q [T, H, D]; dsink from its closed form
    (the sinks join the softmax with no value: d sink = -sum over rows of P_sink * (rowsum(dO * O)
    - dlse)). With `dq_accum` (float32, like q; the launch planned with `grid_queries`) the
    kernel adds dQ into it and dq is that buffer, uncast. `lse_log2`: the forward's
    (`forward_cuda`), used instead of lse (None where there is none); lse is then needed only
    with sinks."""
    entry = launch.kernel
    tq, hq, d = q.shape
    padded = -(-tq // entry.tile_m) * entry.tile_m
    if lse_log2 is not None and lse_log2.numel() != hq * padded:
        raise ValueError(f"lse_log2 has {lse_log2.numel()} rows where this backward takes {hq * padded}")
    accumulate = dq_accum is not None
    # The kernel adds whole 8-row groups of dQ (the ABI's Tq8): pad the buffer when Tq is not a multiple.
    rows8 = -(-tq // 8) * 8
    dq_rows = dq_accum if accumulate and rows8 == tq else torch.zeros(rows8, hq, d, dtype=torch.float32, device=q.device)
    if accumulate and dq_rows is not dq_accum:
        dq_rows[:tq] = dq_accum
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # The preprocess kernel fills the statistics (head-major, padded to whole q blocks): lse_log2
    # from lse, or only its padding where the forward wrote the rest.
    delta = torch.empty(hq, padded, dtype=torch.float32, device=q.device)
    no_rows = _no_rows(q.device, hq)
    # Autograd hands over broadcast gradients (that of lse.sum() has stride 0): the kernels read dense rows.
    tensors = {"q": q, "k": k, "v": v, "out": out, "dout": dout.contiguous(),
               "lse": lse if lse_log2 is None else no_rows, "dlse": dlse.contiguous() if dlse is not None else no_rows,
               "lse_log2": torch.empty_like(delta).view(-1) if lse_log2 is None else lse_log2,
               "delta": delta.view(-1), "dq_accum": dq_rows, "dk": dk, "dv": dv}  # fmt: skip
    unused = _unused(q.device)
    stream = _stream(q.device)
    warpgroups = backward_warpgroups(entry.tile_n)
    if entry.deterministic:  # one counter per (head, q block, consumer warpgroup)
        semaphores = hq * padded // entry.tile_m * warpgroups
        tensors["dq_semaphore"] = torch.zeros(semaphores, dtype=torch.int32, device=q.device)
    else:
        tensors.update(dq_semaphore=unused, work_blocks=unused, block_rank=unused)
    tensors["dkv_accum"], tensors["dkv_count"] = _split_sums(launch.slots, entry.tile_n * (d + v.shape[-1]),
                                                             warpgroups, q.device, stream)  # fmt: skip
    _run(launch, tensors, scale, softcap, stream)
    dsink = None
    if sink is not None:  # delta as [Tq, 1, Hq]
        dsink = -(torch.exp(sink[None] - lse[:, None, :]) * delta[:, :tq].t()[:, None, :]).sum(dim=0)
    # The statistics and split sums are dead once the kernels are queued: freed before the dQ
    # cast, whose temporary then fits in their memory instead of raising the peak.
    tensors.clear()
    del delta
    if not accumulate:
        dq = dq_rows if rows8 == tq else dq_rows[:tq]
        dq = cast_in_place(dq, q.dtype) if dq_rows.nbytes >= IN_PLACE_CAST_BYTES else dq.to(q.dtype)
        return dq, dk, dv, dsink
    if dq_rows is not dq_accum:
        dq_accum.copy_(dq_rows[:tq])
    return dq_accum, dk, dv, dsink


class _Workspace(NamedTuple):
    """A stream's zeroed buffer of split sums and counters, and the views of it the last call
    took (by sums and size: the layers of a step share one schedule): handed out again while
    calls ask for the same, since making them costs a backward 10-15 us of host time
    (`docs/design/host-time.md`). One entry at most: a new mask every step asks for others."""

    buffer: torch.Tensor
    views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


#: Per (device, stream): the zeroed workspace of the split items' sums and counters. The
#: kernels leave it zeroed (each item's last piece clears its slot), so a backward costs no fill
#: and no allocation unless it needs more than the largest before it; launches on one stream
#: never overlap, and each stream has its own. The SPLIT_WORKSPACE_STREAMS streams used last
#: keep theirs (a program that makes new streams must not pile workspaces up); an evicted one
#: goes back to the allocator, which reuses it only on its own stream, after its kernels.
_SPLIT_WORKSPACES: OrderedDict[tuple[torch.device, int], _Workspace] = OrderedDict()
SPLIT_WORKSPACE_STREAMS = 4


def _split_sums(slots: int, sums_per_slot: int, counters_per_slot: int, device: torch.device, stream: int):
    """Split items' fp32 dK / dV sums and the counters (the CTAs' pace, then the pieces'),
    zero: views of the stream's workspace (a fresh buffer while a CUDA graph is captured, whose
    replays must not share memory with eager launches)."""
    sums = slots * sums_per_slot
    size = sums + PACE_COUNTERS + slots * counters_per_slot
    if torch.cuda.is_current_stream_capturing():
        return _views(torch.zeros(size, dtype=torch.float32, device=device), sums, size)
    key = (device, stream)
    workspace = _SPLIT_WORKSPACES.get(key)
    if workspace is None or workspace.buffer.numel() < size:
        workspace = _SPLIT_WORKSPACES[key] = _Workspace(torch.zeros(size, dtype=torch.float32, device=device), {})
    _SPLIT_WORKSPACES.move_to_end(key)
    while len(_SPLIT_WORKSPACES) > SPLIT_WORKSPACE_STREAMS:
        _SPLIT_WORKSPACES.popitem(last=False)
    views = workspace.views.get((sums, size))
    if views is None:
        workspace.views.clear()
        views = workspace.views[(sums, size)] = _views(workspace.buffer, sums, size)
    return views


def _views(buffer: torch.Tensor, sums: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums (the first `sums` floats) and the counters (int32, up to `size`) of a workspace."""
    return buffer[:sums], buffer[sums:size].view(torch.int32)


#: From this many bytes of float32 dQ on, backward_cuda casts it over the accumulator's own memory
#: (cast_in_place): the backward's memory peak drops by the gradient's size for a few more
#: launches, a trade worth it only where the kernels run long enough to hide them.
IN_PLACE_CAST_BYTES = 64 * 2**20
#: cast_in_place's first 1/IN_PLACE_HEAD of the elements goes through a temporary: 2 D / 128
#: bytes a query row and head, no more than the 4 of delta, which is freed before the cast, up
#: to head dim 256 (so the cast never raises the peak above the kernels').
IN_PLACE_HEAD = 128


def cast_in_place(accum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`accum` (contiguous float32) cast to the 16-bit `dtype`, written over the front half of its
    own memory, so no second buffer of the gradient's size exists beside the accumulator; the
    result is a view of accum's storage (which lives as long as it does). Element i lands on
    bytes [2i, 2i + 2), inside float32 element i / 2: chunk [s, e) with e <= 2s overwrites only
    elements earlier chunks have read (kernels run in stream order), so after the first
    1/IN_PLACE_HEAD, which goes through a temporary, the chunks double."""
    flat = accum.view(-1)
    n = flat.numel()
    out = flat.view(dtype)
    head = max(1, n // IN_PLACE_HEAD)
    first = flat[:head].to(dtype)
    start = head
    while start < n:
        end = min(2 * start, n)
        out[start:end].copy_(flat[start:end])
        start = end
    out[:head].copy_(first)
    return out[:n].view(accum.shape)


@cache
def _no_rows(device: torch.device, heads: int) -> torch.Tensor:
    """A float32 [0, heads] on `device`: what the backward kernels take for an lse or a dlse
    they are not to read (made once: an allocation costs host time in every call)."""
    return torch.empty(0, heads, dtype=torch.float32, device=device)


@cache
def _unused(device: torch.device) -> torch.Tensor:
    """Zeros standing in, on `device`, for the arrays a backward never touches: the ordering
    arrays of a kernel that is not deterministic, the split sums of a schedule with no split
    item (one 16-byte aligned vector: what the ABI asks of each). Made once: an allocation and
    a fill cost host time in every call."""
    return torch.zeros(4, dtype=torch.int32, device=device)


def _config(mask: Mask, scale: float, softcap: float, return_max_logits: bool = False) -> reference._Config:
    return reference._Config(mask, scale, softcap, reference.BLOCK_Q, reference.BLOCK_K, return_max_logits)


def attn_fwd_cuda(q, k, v, sink, mask, prepared, padding, softmax_scale, softcap, return_max_logits, for_backward,
                  options):  # fmt: skip
    """out, lse and row_max ([0] unless return_max_logits), shaped like q, and with
    `for_backward` the backward's lse_log2 (else [0])."""
    decoded = Options.decode(options)
    call_mask = _call_mask(mask, prepared, padding, q, k, decoded)
    target = call_target(q, k, v, softcap > 0, sink is not None, return_max_logits, decoded)
    launch = call_plan.plan_forward(call_mask, target, q.device)
    # lse_log2_rows takes the backward's tile: a head dim without a backward fails here, before the forward runs.
    out, lse, row_max, lse_log2 = forward_cuda(packed_rows(q), packed_rows(k), packed_rows(v), sink, launch,
                                               softmax_scale, softcap, return_max_logits,
                                               lse_log2_rows(q, target) if for_backward else 0)  # fmt: skip
    if q.dim() == 3:
        return out, lse, row_max, lse_log2
    rows = q.shape[:-1]
    return out.view(*rows, v.shape[-1]), lse.view(rows), row_max.view(rows) if return_max_logits else row_max, lse_log2


def attn_fwd_cpu(q, k, v, sink, mask, prepared, padding, softmax_scale, softcap, return_max_logits, for_backward,
                 options):  # fmt: skip
    """The forward on the CPU: the reference attention's tiles (no lse_log2: its backward takes lse)."""
    cfg = _config(_call_mask(mask, prepared, padding, q, k, Options.decode(options)), softmax_scale, softcap,
                  return_max_logits)  # fmt: skip
    out, lse, max_logits = reference._forward(packed_rows(q), packed_rows(k), packed_rows(v), sink, cfg)
    rows = q.shape[:-1]
    row_max = max_logits.expand(rows).contiguous() if return_max_logits else lse.new_empty(0)
    return out.view(*rows, v.shape[-1]), lse.view(rows), row_max, lse.new_empty(0)


def attn_bwd_cuda(q, k, v, out, lse, lse_log2, sink, dout, dlse, mask, prepared, padding, softmax_scale, softcap,
                  options):  # fmt: skip
    """dq, dk, dv and dsink (empty without sinks: ops return tensors), shaped like their inputs."""
    decoded = Options.decode(options)
    call_mask = _call_mask(mask, prepared, padding, q, k, decoded)
    launch = call_plan.plan_backward(call_mask, call_target(q, k, v, softcap > 0, False, False, decoded), q.device)
    flat = [packed_rows(x) for x in (q, k, v, out)]
    lse_rows = None if lse is None else lse.reshape(-1, lse.shape[-1])
    dlse_rows = None if dlse is None else dlse.reshape(-1, dlse.shape[-1])
    dq, dk, dv, dsink = backward_cuda(*flat, lse_rows, sink, packed_rows(dout.contiguous()), dlse_rows, launch,
                                      softmax_scale, softcap, lse_log2=lse_log2)  # fmt: skip
    dsink = dsink if dsink is not None else q.new_empty(0, dtype=torch.float32)
    return _like(dq, q.shape), _like(dk, k.shape), _like(dv, v.shape), dsink


def attn_bwd_cpu(q, k, v, out, lse, lse_log2, sink, dout, dlse, mask, prepared, padding, softmax_scale, softcap,
                 options):  # fmt: skip
    """The backward on the CPU: the reference attention's, recomputing its tiles (from lse: the
    CPU forward makes no lse_log2)."""
    cfg = _config(_call_mask(mask, prepared, padding, q, k, Options.decode(options)), softmax_scale, softcap)
    lse_rows = lse.reshape(-1, lse.shape[-1])
    dlse_rows = torch.zeros_like(lse_rows) if dlse is None else dlse.reshape(-1, dlse.shape[-1])
    flat = [packed_rows(x) for x in (q, k, v, out)]
    dq, dk, dv, dsink = reference._backward(*flat, lse_rows, sink, packed_rows(dout), dlse_rows, cfg)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dsink if dsink is not None else lse.new_empty(0)


def attn_fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    mask: torch.Tensor,
    prepared: torch.Tensor | None,
    padding: torch.Tensor | None,
    softmax_scale: float,
    softcap: float,
    return_max_logits: bool,
    for_backward: bool,
    options: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, lse and row_max of masked attention: q [T, Hq, D] or [B, S, Hq, D], k, v alike;
    `mask` a `Mask.table` over the call's rows (over one row of a batch, or all of them),
    `prepared` its plan (`maskc.prepare`), `padding` a batch's [B, S] attention mask (true on
    real tokens), `options` the encoded `Options`. With `for_backward`, on the GPU, also lse in
    the backward's layout (`lse_log2_rows`), which the backward keeps instead of lse: a caller
    that drops lse does not hold it through the backward; else [0]."""
    impl = attn_fwd_cuda if q.device.type == "cuda" else attn_fwd_cpu
    return impl(q, k, v, sink, mask, prepared, padding, softmax_scale, softcap, return_max_logits, for_backward, options)


#: The ops' library. They are declared with `torch.library.Library` rather than
#: `torch.library.custom_op`, whose Python layers around the kernel (an autograd kernel on every
#: op, output alias checks, a dynamo guard) cost a compiled forward + backward about 45 us more
#: (`docs/design/host-time.md`); `test_the_ops_pass_torch_library_opcheck` checks their schemas,
#: fake implementations and autograd against the kernels.
_LIB = torch.library.Library("maskc", "DEF")


def _define(name: str, impl: Callable) -> None:
    """Declare maskc::`name` with the schema of `impl`'s signature and run `impl` on CPU and CUDA."""
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=()))
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, impl, key)


_define("attn_fwd", attn_fwd_impl)


@torch.library.register_fake("maskc::attn_fwd", lib=_LIB)
def _attn_fwd_fake(q, k, v, sink, mask, prepared, padding, softmax_scale, softcap, return_max_logits, for_backward,
                   options):  # fmt: skip
    rows = 0
    if for_backward and q.device.type == "cuda":
        target = call_target(q, k, v, softcap > 0, sink is not None, return_max_logits, Options.decode(options))
        rows = lse_log2_rows(q, target)
    return _forward_outputs(q, v, return_max_logits, rows)


def attn_bwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    lse_log2: torch.Tensor | None,
    sink: torch.Tensor | None,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    mask: torch.Tensor,
    prepared: torch.Tensor | None,
    padding: torch.Tensor | None,
    softmax_scale: float,
    softcap: float,
    options: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and dsink (empty without sinks: ops return tensors) of `attn_fwd_impl`, from
    its lse or its lse_log2 (lse is needed with sinks, and on the CPU)."""
    impl = attn_bwd_cuda if q.device.type == "cuda" else attn_bwd_cpu
    return impl(q, k, v, out, lse, lse_log2, sink, dout, dlse, mask, prepared, padding, softmax_scale, softcap, options)


_define("attn_bwd", attn_bwd_impl)


@torch.library.register_fake("maskc::attn_bwd", lib=_LIB)
def _attn_bwd_fake(q, k, v, out, lse, lse_log2, sink, dout, dlse, mask, prepared, padding, softmax_scale, softcap,
                   options):  # fmt: skip
    dsink = torch.empty_like(sink) if sink is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Saves q, k, v, out, the forward's lse_log2 where it made one (else lse; lse too with
    sinks, whose gradient needs it), the sinks and the mask's tensors; the kernel recomputes the
    rest. Gradients that do not exist stay None (no zeros for lse's gradient: a fill per call,
    and a kernel that would read them)."""
    q, k, v, sink, mask, prepared, padding, scale, softcap, _, _, options = inputs
    out, lse, row_max, lse_log2 = output
    has_log2 = lse_log2.numel() > 0
    keep_lse = lse if sink is not None or not has_log2 else None
    ctx.save_for_backward(q, k, v, out, keep_lse, lse_log2 if has_log2 else None, sink, mask, prepared, padding)
    ctx.scalars = (scale, softcap, options)
    ctx.mark_non_differentiable(row_max, lse_log2)
    ctx.set_materialize_grads(False)


def _attn_fwd_backward(
    ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None, _drow_max: Any, _dlse_log2: Any,
    attn_bwd: Callable = torch.ops.maskc.attn_bwd,
) -> tuple:  # fmt: skip
    q, k, v, out, lse, lse_log2, sink, mask, prepared, padding = ctx.saved_tensors
    if dout is None:  # only lse reached the loss
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = attn_bwd(q, k, v, out, lse, lse_log2, sink, dout, dlse, mask, prepared, padding, *ctx.scalars)
    return (dq, dk, dv, dsink if sink is not None else None) + (None,) * 8


torch.library.register_autograd("maskc::attn_fwd", _attn_fwd_backward, setup_context=_setup_context, lib=_LIB)


class EagerAttention(torch.autograd.Function):
    """Eager mode: the ops' own implementations and autograd wiring, minus the dispatcher and
    torch.library's autograd layer, which add about 95 us to a forward + backward through the
    ops (`bench/host_python.py`'s CPU); torch.compile traces the ops instead."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        output = attn_fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor, *_: Any) -> tuple:  # type: ignore[override]
        return _attn_fwd_backward(ctx, dout, dlse, None, None, attn_bwd=attn_bwd_impl)
