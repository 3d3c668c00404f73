"""The kernel launches as the torch.library custom ops `maskc::attn_fwd` and `maskc::attn_bwd`
(fake implementations for tracing, autograd through `register_autograd`), so `maskc.attention`
runs inside `torch.compile(fullgraph=True)`. Op arguments are tensors and scalars only: a
kernel is its index in `registry.LOADED`, a schedule one int32 device tensor, both from the
plan (`maskc.runtime.plan`). Eager calls run the same implementations without the dispatcher
(`EagerAttention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from maskc.artifact.families import WARPGROUP_ROWS
from maskc.runtime import registry
from maskc.runtime.plan import schedule_views

@dataclass(frozen=True, eq=False)
class Call:
    """One kernel launch with its scalars, rebuilt inside an op from the op's arguments."""

    kernel: registry.Entry
    num_ctas: int
    slots: int
    schedule: dict[str, torch.Tensor]
    scale: float
    softcap: float
    return_max_logits: bool = False

    @classmethod
    def of(cls, schedule: torch.Tensor, launch: list[int], scale: float, softcap: float, **flags: bool) -> Call:
        kernel, num_ctas, slots, *rows = launch
        return cls(registry.loaded(kernel), num_ctas, slots, schedule_views(schedule, rows), scale, softcap, **flags)


def _launch(call: Call, tensors: dict, device: torch.device) -> None:
    scalars = {"softmax_scale": call.scale, "softcap": call.softcap, "num_ctas": call.num_ctas}
    call.kernel.kernel({**tensors, **call.schedule}, scalars, torch.cuda.current_stream(device).cuda_stream)


def _forward_outputs(q: torch.Tensor, return_max_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, lse and row_max of a forward; row_max is empty unless asked for (op outputs never alias)."""
    tq, hq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=q.device)
    row_max = torch.empty((tq, hq) if return_max_logits else (0,), dtype=torch.float32, device=q.device)
    return out, lse, row_max


def _forward(q, k, v, sink, call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, row_max = _forward_outputs(q, call.return_max_logits)
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "row_max": row_max if call.return_max_logits else lse}
    tensors["sink"] = sink if sink is not None else lse[:1]
    _launch(call, tensors, q.device)
    return out, lse, row_max


def run_backward(q, k, v, out, lse, sink, dout, dlse, call: Call, dq_accum: torch.Tensor | None = None):
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


def attn_fwd_impl(
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
    and `launch` as in `maskc.runtime.plan.LaunchArgs`. bwd_schedule and bwd_launch are the
    backward's (its kernel, deterministic or not, included), carried here because autograd sees
    only a forward op's inputs (bwd_launch is empty when no backward was planned)."""
    call = Call.of(schedule, launch, softmax_scale, softcap, return_max_logits=return_max_logits)
    return _forward(q, k, v, sink, call)


_attn_fwd = torch.library.custom_op("maskc::attn_fwd", attn_fwd_impl, mutates_args=(), device_types="cuda")


@_attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, sink, schedule, launch, softmax_scale, softcap, return_max_logits, bwd_schedule, bwd_launch):
    return _forward_outputs(q, return_max_logits)


def attn_bwd_impl(
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
    call = Call.of(schedule, launch, softmax_scale, softcap)
    dq, dk, dv, dsink = run_backward(q, k, v, out, lse, sink, dout, dlse, call)
    return dq, dk, dv, dsink if dsink is not None else lse.new_empty(0)


_attn_bwd = torch.library.custom_op("maskc::attn_bwd", attn_bwd_impl, mutates_args=(), device_types="cuda")


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


class EagerAttention(torch.autograd.Function):
    """Eager mode: the ops' own implementations and autograd wiring, minus the dispatcher, which
    costs a custom op 25-60 us of host time per call; torch.compile traces the ops instead."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        output = attn_fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor, drow_max: torch.Tensor) -> tuple:  # type: ignore[override]
        return _attn_fwd_backward(ctx, dout, dlse, drow_max, attn_bwd=attn_bwd_impl)
