"""`maskc.attention`: masked attention on the GPU through compiled maskc kernels.

Kernels come from artifact directories (`maskc.runtime.register_artifact`) or, where the
compiler is installed, are compiled on first use into the content-addressed cache
(`maskc.runtime.registry`). Everything the mask decides (GQA strategy, kernels, schedules)
comes from `maskc.runtime.plan.plan_launches`, which torch.compile runs once per compilation,
treating the result as constant: a compiled graph is specialised to its mask (guarded on
`Mask.__eq__` or identity, depending on the torch release), so a new mask means a new
compilation. The launches themselves are torch custom ops (`maskc.runtime.ops`).
"""

from __future__ import annotations

import torch

from maskc.artifact.families import HEAD_DIMS
from maskc.errors import MaskcError
from maskc.ir import Mask
from maskc.reference import AttentionMeta, check_attention_args
from maskc.runtime import ops
from maskc.runtime.plan import TORCH_DTYPES, plan_launches


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
        if name != "sink" and x.dtype not in TORCH_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; maskc kernels take bfloat16 or float16")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    scale = check_attention_args(q, k, v, mask, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    if q.shape[2] not in HEAD_DIMS:
        raise MaskcError(f"head_dim {q.shape[2]} is not supported; supported head dims: {HEAD_DIMS}")
    return scale


def _check_device(name: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        raise ValueError(f"maskc.attention runs on CUDA tensors; {name} is on {x.device} (use maskc.reference_attention on CPU)")


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
    fwd, bwd = plan_launches(mask, q.device, q.dtype, hq, k.shape[1], d, softcap > 0, sink is not None, return_max_logits,
                             pack_gqa, needs_grad, bool(deterministic), 0, portable)  # fmt: skip
    inputs = (q, k, v, sink, fwd.schedule, fwd.launch, scale, float(softcap), return_max_logits, bwd.schedule, bwd.launch)
    if torch.compiler.is_compiling():
        out, lse, row_max = torch.ops.maskc.attn_fwd(*inputs)
    elif needs_grad:
        out, lse, row_max = ops.EagerAttention.apply(*inputs)
    else:
        out, lse, row_max = ops.attn_fwd_impl(*inputs)
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
    fwd, _ = plan_launches(mask, q.device, q.dtype, hq, k.shape[1], d, softcap > 0, sink is not None, return_max_logits, None,
                           False, False, sm_margin)  # fmt: skip
    out, lse, row_max = ops.attn_fwd_impl(q, k, v, sink, fwd.schedule, fwd.launch, scale, float(softcap), return_max_logits,
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
    _, bwd = plan_launches(mask, q.device, q.dtype, hq, k.shape[1], d, softcap > 0, sink is not None, False, None, True, False,
                           sm_margin)  # fmt: skip
    call = ops.Call.of(bwd.schedule, bwd.launch, scale, float(softcap))
    return ops.run_backward(q, k, v, out, lse, sink, dout.contiguous(), dlse, call, dq_accum)
