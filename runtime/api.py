"""`maskc.attention`: masked attention through maskc's kernels on the GPU and the reference
attention on the CPU, behind the same custom ops (`maskc.runtime.ops`).

Kernels come from artifact directories (`maskc.runtime.register_artifact`) or, where the
compiler is installed, are compiled on first use into the content-addressed cache
(`maskc.runtime.registry`). The mask reaches the ops as tensors, so under torch.compile a new
mask every step compiles nothing; what it decides (GQA strategy, kernels, schedules) is
planned inside the op (`maskc.runtime.call_plan`), or ahead of time by `maskc.prepare`.
"""

from __future__ import annotations

import torch

from maskc.artifact.kernel_families import HEAD_DIMS, HeadDim
from maskc.errors import MaskcError, MaskError
from maskc.ir import Mask
from maskc.reference import AttentionMeta, check_attention_tensors, check_mask_lengths
from maskc.runtime import ops
from maskc.runtime.call_plan import TORCH_DTYPES, check_options, plan_backward, plan_forward
from maskc.runtime.masks import PositionMask
from maskc.runtime.ops import Options
from maskc.runtime.prepared import PreparedMask

_HEAD_DIM_PAIRS = frozenset((d.qk, d.v) for d in HEAD_DIMS)  # what a call checks its shapes against
_DTYPES = {
    "cuda": (tuple(TORCH_DTYPES), "bfloat16 or float16"),
    "cpu": ((torch.float32, *TORCH_DTYPES), "float32, bfloat16 or float16"),
}


def _mask_tensors(mask: Mask | PreparedMask | PositionMask) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """The tensors a mask reaches the ops as (its table, or its position ids, and a prepared plan
    if it has one), and the `Options.positions` of a PositionMask."""
    if isinstance(mask, PreparedMask):
        return mask.table, mask.plan, None
    if isinstance(mask, Mask):
        return mask.table, None, None
    if isinstance(mask, PositionMask):
        return mask.position_ids, None, mask.options()
    raise TypeError(f"mask must be a maskc Mask, PreparedMask (maskc.prepare) or PositionMask, got {type(mask).__name__}")


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    softmax_scale: float | None,
    softcap: float,
) -> float:
    """What the ops need beyond the shared contract (a layout of [T, H, D] or [B, S, H, D]
    tensors, contiguous; on the GPU bf16 or fp16 and a head dim with a kernel, on the CPU
    float32 too), then the contract itself; returns the effective softmax scale."""
    named = [("q", q), ("k", k), ("v", v)] + ([("sink", sink)] if sink is not None else [])
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if name != "sink" and x.ndim not in (3, 4):
            raise ValueError(f"{name} must be [seqlen, heads, head_dim] or [batch, seqlen, heads, head_dim], got {tuple(x.shape)}")
        if not (x.is_cuda or x.is_cpu):
            raise ValueError(f"maskc.attention runs on CUDA or CPU tensors; {name} is on {x.device}")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    if q.ndim == 4 or k.ndim == 4 or v.ndim == 4:
        if not q.ndim == k.ndim == v.ndim == 4 or not q.shape[0] == k.shape[0] == v.shape[0]:
            raise ValueError(
                f"batched q, k, v are [B, S, H, D] with one B; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        q, k, v = (ops.packed_rows(x) for x in (q, k, v))
    dtypes, names = _DTYPES["cuda" if q.is_cuda else "cpu"]
    if q.dtype not in dtypes:
        raise TypeError(f"q has dtype {q.dtype}; maskc.attention on {q.device.type.upper()} tensors takes {names}")
    scale = check_attention_tensors(q, k, v, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    if q.is_cuda and (q.shape[2], v.shape[2]) not in _HEAD_DIM_PAIRS:
        raise MaskcError(
            f"head_dim {HeadDim(q.shape[2], v.shape[2])} is not supported; supported head dims (q and k / v): "
            f"{', '.join(map(str, HEAD_DIMS))}"
        )
    return scale


def _check_padding(attention_mask: object) -> None:
    """What a padding mask must be before its values are read (in the op, once per content)."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a [B, S] tensor, got {type(attention_mask).__name__}")
    if attention_mask.device.type not in ("cpu", "cuda"):
        raise MaskError(f"attention_mask must be a CPU or CUDA tensor, got one on {attention_mask.device}")
    if attention_mask.is_complex():
        raise MaskError(f"attention_mask must be bools or 0 / 1 (1 on real tokens), got dtype {attention_mask.dtype}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | PreparedMask | PositionMask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    return_max_logits: bool = False,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    portable: bool | None = None,
) -> tuple[torch.Tensor, AttentionMeta]:
    """Masked attention; the same contract as `maskc.reference_attention`, differentiable in q,
    k, v and sink (the gradient flows through lse too). q [T, Hq, D] with k, v [Tk, Hkv, D] and
    a mask of (T, Tk); or a batch q [B, S, Hq, D] with k, v [B, Sk, Hkv, D] and a mask over one
    row (S, Sk), shared by every row, or over the whole batch (B * S, B * Sk; `Mask.stack`):
    one launch either way, and out, lse come back in q's layout. A `PositionMask` gives packed
    documents by their position ids, read inside the op (for masks that only exist inside a
    compiled model). A batch's `attention_mask` [B, S] (bool or 0/1, true on real tokens; one
    run per row: right or left padding) leaves the padding out: its queries attend nothing
    (out 0, lse -inf) and nothing attends it. CUDA tensors run maskc's kernels; CPU tensors
    (float32 too) the reference attention. Inside torch.compile(fullgraph=True) the mask is
    data: a new one every call compiles nothing.

    pack_gqa: the GQA strategy. None (default) lets maskc.ir.strategy.select_forward decide
    from the mask and the head counts, with the forward's tile where there are two (PackGQA
    packs the G = Hq / Hkv query heads of a K/V head into one M tile); True / False force it
    (True needs G a power of two in [2, 64]; the tile is still chosen per mask).
    deterministic: the backward adds each q block's dQ contributions in a fixed order, so the
    gradients are bitwise identical from run to run (a little slower).
    portable: the kernel family. None (default) takes the GPU's own kernels where maskc has
    verified ones (Hopper), else the portable ones (warp MMA: every GPU since Ampere); True
    forces the portable ones (no PackGQA yet); False asks for the GPU's own kernels, also the
    experimental Blackwell forward and backward (never run by maskc). With $MASKC_PORTABLE_NEXT=1
    in the environment the portable kernels are the experimental next ones (tested on an H100 only:
    a faster backward, PackGQA, head dims 96 and 256; docs/support.md).
    """
    table, prepared, positions = _mask_tensors(mask)
    scale = _check_inputs(q, k, v, sink, softmax_scale, softcap)
    check_options(pack_gqa, deterministic, portable)
    chosen = Options(pack_gqa, deterministic, portable, positions)
    if not isinstance(return_max_logits, bool):
        raise TypeError(f"return_max_logits must be True or False, got {return_max_logits!r}")
    options = chosen.encode()
    if attention_mask is not None:
        _check_padding(attention_mask)
    for_backward = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sink))
    inputs = (q, k, v, sink, table, prepared, attention_mask, scale, float(softcap), return_max_logits, for_backward, options)
    if torch.compiler.is_compiling():
        out, lse, row_max, _ = torch.ops.maskc.attn_fwd(*inputs)
    elif for_backward:
        out, lse, row_max, _ = ops.EagerAttention.apply(*inputs)
    else:
        out, lse, row_max, _ = ops.attn_fwd_impl(*inputs)
    max_logits = row_max.flatten(0, -2).amax(dim=0) if return_max_logits else None
    return out, AttentionMeta(lse=lse, max_logits=max_logits)


def _check_stage(q, k, v, mask: Mask, sink, softmax_scale, softcap) -> float:
    """The checks of `attention_forward` and `attention_backward`: [T, H, D] CUDA tensors."""
    if q.device.type != "cuda":
        raise ValueError(f"attention_forward and attention_backward run on CUDA tensors; q is on {q.device}")
    scale = _check_inputs(q, k, v, sink, softmax_scale, softcap)
    check_mask_lengths(q, k, mask)
    return scale


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
    """(out, lse, max_logits or None) of `attention` on the GPU, with no autograd: for callers
    that run their own backward (`attention_backward`), like maskc.dist's stage pipeline.
    `sm_margin` SMs stay free for communication kernels that run alongside."""
    scale = _check_stage(q, k, v, mask, sink, softmax_scale, softcap)
    options = Options(None, False, None)
    target = ops.call_target(q, k, v, softcap > 0, sink is not None, return_max_logits, options, sm_margin)
    launch = plan_forward(mask, target, q.device)
    out, lse, row_max, _ = ops.forward_cuda(q, k, v, sink, launch, scale, float(softcap), return_max_logits)
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
    scale = _check_stage(q, k, v, mask, sink, softmax_scale, softcap)
    if dq_accum is not None and (dq_accum.shape != q.shape or dq_accum.dtype != torch.float32 or not dq_accum.is_contiguous()):
        raise MaskcError(f"dq_accum must be a contiguous float32 tensor of shape {tuple(q.shape)}")
    target = ops.call_target(q, k, v, softcap > 0, sink is not None, False, Options(None, False, None), sm_margin)
    launch = plan_backward(mask, target, q.device, grid_queries=dq_accum is not None)
    return ops.backward_cuda(q, k, v, out, lse, sink, dout.contiguous(), dlse, launch, scale, float(softcap), dq_accum)
