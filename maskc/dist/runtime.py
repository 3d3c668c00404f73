"""Running a plan over torch.distributed: every process holds its chunks of the sequence.

`dispatch` / `undispatch` move a sequence-first tensor between its global layout (the same on
every rank) and this rank's local rows (its chunks, ascending). `attention` fetches exactly the
remote key/value rows the rank's queries need (GroupCast: one all-to-all-v with the plan's
split sizes), attends over [local keys ; received keys] under the rank's local mask, and in the
backward sends the partial dK/dV of the received rows back to their owners, which add them to
their own (GroupReduce: the transposed all-to-all-v and a scatter-add). Both directions are
autograd functions, so the attention itself is whatever `maskc.attention` (CUDA) or
`maskc.reference_attention` (elsewhere, e.g. gloo on CPUs) computes, gradients included.
Communication runs in one stage here; the plan's overlap stages are for the CUDA pipeline.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from maskc.dist.pieces import cut
from maskc.dist.plan import Plan
from maskc.errors import MaskcError
from maskc.ir.mask import Mask
from maskc.ir.slices import RowLines, expand_spans
from maskc.reference import AttentionMeta, reference_attention
from maskc.runtime import attention as kernel_attention


_PER_PLAN: weakref.WeakKeyDictionary[Plan, dict[Any, Any]] = weakref.WeakKeyDictionary()
"""What the runtime derives from a plan once (local masks, row indices on a device, checked
groups), kept as long as the plan lives."""


def _memo(plan: Plan) -> dict[Any, Any]:
    return _PER_PLAN.setdefault(plan, {})


def local_mask(plan: Plan, rank: int) -> Mask:
    """The mask of `rank`'s queries (its local rows) against [its local keys ; the keys it
    receives, in buffer order], in those local coordinates; built once per plan and rank."""
    key = ("local_mask", rank)
    cached = _memo(plan).get(key)
    if cached is not None:
        return cached
    cs = plan.chunk_size
    own = plan.chunks_of(rank)
    local_rows = own.size * cs
    recv = plan.comm.recv(rank)
    ranges = np.concatenate([np.stack([own * cs, (own + 1) * cs], axis=1), recv.reshape(-1, 2)])
    lengths = ranges[:, 1] - ranges[:, 0]
    offsets = np.cumsum(lengths) - lengths  # where each key range starts in [local ; received]
    order = np.argsort(ranges[:, 0], kind="stable")
    begin, end = ranges[order, 0], ranges[order, 1]

    pieces = cut(plan.mask, cs)
    pieces = pieces.take(np.flatnonzero(plan.rank_of_chunk[pieces.chunk] == rank))
    first = np.searchsorted(end, pieces.key_begin(), side="right")
    last = np.searchsorted(begin, pieces.key_end(), side="left") - 1
    piece, j = expand_spans(first, last)
    rng = order[j]
    clipped, source = pieces.take(piece).clipped(ranges[rng, 0], ranges[rng, 1])
    rng = rng[source]
    local_chunk = np.full(plan.num_chunks, -1, dtype=np.int64)
    local_chunk[own] = np.arange(own.size)
    dr = local_chunk[clipped.chunk] * cs - clipped.chunk * cs  # global row -> local row
    dc = offsets[rng] - ranges[rng, 0]  # global key -> position in [local ; received]
    lines = RowLines(
        clipped.r0 + dr,
        clipped.r1 + dr,
        clipped.lo_a + dc - clipped.lo_s * dr,
        clipped.lo_s,
        clipped.hi_a + dc - clipped.hi_s * dr,
        clipped.hi_s,
    )
    q, k, t = lines.to_slices()
    mask = Mask.from_arrays(q, k, t, local_rows, local_rows + int(lengths[own.size :].sum()))
    _memo(plan)[key] = mask
    return mask


# ---- process group helpers --------------------------------------------------------------------


def _rank(plan: Plan, group: Any) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise MaskcError("maskc.dist needs an initialised torch.distributed process group (init_process_group)")
    world = dist.get_world_size(group)
    if world != plan.cp_size:
        raise MaskcError(f"the plan is for {plan.cp_size} ranks but the process group has {world}")
    return dist.get_rank(group)


def _collective(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a collective; a rank that never joins surfaces as a clear error once the process
    group's timeout (init_process_group(timeout=...)) passes, not as a bare backend trace."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        text = str(exc)
        if "imeout" in text or "timed out" in text.lower():
            raise MaskcError(
                f"maskc.dist {what}: not every rank joined before the process group's timeout; do all ranks call "
                f"the same maskc.dist functions with the same plan? ({text.splitlines()[0]})"
            ) from exc
        raise


def plan_digest(plan: Plan) -> int:
    """A 63-bit digest of the plan's JSON: equal on every rank that holds the same plan."""
    return int.from_bytes(hashlib.sha256(plan.to_json().encode()).digest()[:8], "little") >> 1


def _check_same_plan(plan: Plan, group: Any, device: torch.device) -> None:
    """Once per (plan, group): every rank must hold the same plan, or nothing lines up."""
    seen = _memo(plan).setdefault("checked_groups", set())
    if id(group) in seen:
        return
    mine = torch.tensor([plan_digest(plan)], dtype=torch.int64, device=device)
    digests = [torch.empty_like(mine) for _ in range(plan.cp_size)]
    _collective("plan check", dist.all_gather, digests, mine, group=group)
    values = [int(d.item()) for d in digests]
    if len(set(values)) != 1:
        raise MaskcError(f"ranks hold different maskc plans (digests {values}): build the plan identically on every rank")
    seen.add(id(group))


def _rows(plan: Plan, which: str, rank: int, device: torch.device) -> torch.Tensor:
    """A row index of the plan's communication tables on `device`, built and copied once:
    `which` is "local" (`comm.local_rows`), "gather" (`comm.gather_index`), "scatter"
    (`comm.scatter_index`) or "global" (every rank's local rows, rank after rank)."""
    key = ("rows", which, rank, device)
    cached = _memo(plan).get(key)
    if cached is None:
        comm = plan.comm
        rows = {
            "local": lambda: comm.local_rows(rank),
            "gather": lambda: comm.gather_index(rank),
            "scatter": lambda: comm.scatter_index(rank),
            "global": lambda: np.concatenate([comm.local_rows(r) for r in range(plan.cp_size)]),
        }[which]()
        cached = _memo(plan)[key] = torch.from_numpy(rows).to(device)
    return cached


# ---- dispatch / undispatch ---------------------------------------------------------------------


def _take_local(x: torch.Tensor, plan: Plan, rank: int) -> torch.Tensor:
    """This rank's rows of a global tensor (padded with zeros to the plan's length)."""
    if x.shape[0] != plan.seqlen:
        raise MaskcError(f"expected a sequence-first tensor of {plan.seqlen} rows, got shape {tuple(x.shape)}")
    padded = torch.cat([x, x.new_zeros(plan.padded_length - plan.seqlen, *x.shape[1:])]) if plan.padded_length > plan.seqlen else x
    return padded.index_select(0, _rows(plan, "local", rank, x.device))


def _gather_global(x_local: torch.Tensor, plan: Plan, group: Any) -> torch.Tensor:
    """Every rank's local rows put back in global order, on every rank (padding removed)."""
    parts = [torch.empty_like(x_local) for _ in range(plan.cp_size)]
    _collective("all_gather", dist.all_gather, parts, x_local.contiguous(), group=group)
    full = x_local.new_empty(plan.padded_length, *x_local.shape[1:])
    full[_rows(plan, "global", -1, x_local.device)] = torch.cat(parts)
    return full[: plan.seqlen]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: Plan, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.group = plan, group
        return _take_local(x, plan, _rank(plan, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return _gather_global(grad, ctx.plan, ctx.group), None, None


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_local: torch.Tensor, plan: Plan, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.rank = plan, _rank(plan, group)
        return _gather_global(x_local, plan, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return _take_local(grad, ctx.plan, ctx.rank), None, None


def dispatch(x: torch.Tensor, plan: Plan, group: Any = None) -> torch.Tensor:
    """This rank's part of a global sequence-first tensor (the same on every rank), in the plan's
    local layout. Its gradient is gathered back: every rank gets the full gradient of `x`."""
    return _Dispatch.apply(x, plan, group)


def undispatch(x_local: torch.Tensor, plan: Plan, group: Any = None) -> torch.Tensor:
    """The global tensor from every rank's local part, on every rank. Its backward takes this
    rank's part of the gradient every rank holds in full."""
    if x_local.shape[0] != plan.padded_length // plan.cp_size:
        raise MaskcError(f"expected this rank's {plan.padded_length // plan.cp_size} rows, got shape {tuple(x_local.shape)}")
    return _Undispatch.apply(x_local, plan, group)


# ---- attention ---------------------------------------------------------------------------------


class _GroupCast(torch.autograd.Function):
    """Forward: the remote key/value rows this rank needs (one all-to-all-v). Backward (GroupReduce):
    the gradients of those rows go back to their owners and are added to their local rows."""

    @staticmethod
    def forward(ctx: Any, x_local: torch.Tensor, plan: Plan, rank: int, group: Any) -> torch.Tensor:  # type: ignore[override]
        comm = plan.comm
        ctx.plan, ctx.rank, ctx.group, ctx.shape = plan, rank, group, x_local.shape
        send = x_local.index_select(0, _rows(plan, "gather", rank, x_local.device))
        out = x_local.new_empty(int(comm.recv_counts[rank].sum()), *x_local.shape[1:])
        _collective("GroupCast", dist.all_to_all_single, out, send, comm.recv_counts[rank].tolist(),
                    comm.send_counts[rank].tolist(), group=group)  # fmt: skip
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        comm, rank = ctx.plan.comm, ctx.rank
        back = grad.new_empty(int(comm.send_counts[rank].sum()), *grad.shape[1:])
        _collective("GroupReduce", dist.all_to_all_single, back, grad.contiguous(), comm.reduce_recv_counts[rank].tolist(),
                    comm.reduce_send_counts[rank].tolist(), group=ctx.group)  # fmt: skip
        local = grad.new_zeros(ctx.shape).index_add_(0, _rows(ctx.plan, "scatter", rank, grad.device), back)
        return local, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    group: Any = None,
) -> tuple[torch.Tensor, AttentionMeta]:
    """Exact masked attention of this rank's queries (local layout, from `dispatch`) over the
    whole sequence: local q [L, Hq, D], k / v [L, Hkv, D] with L = the plan's rows per rank.
    Returns this rank's output and meta (lse of its rows; max_logits reduced over all ranks).
    The sinks' gradient on each rank is its rows' share: sum it over ranks like any replicated
    parameter's (DDP does)."""
    rank = _rank(plan, group)
    rows = plan.padded_length // plan.cp_size
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != rows:
            raise MaskcError(f"{name} must be this rank's [{rows}, heads, head_dim] rows (from maskc.dist.dispatch)")
    _check_same_plan(plan, group, q.device)
    heads_kv = k.shape[1]
    kv = torch.cat([k, v], dim=1)  # one collective for both
    received = _GroupCast.apply(kv, plan, rank, group)
    k_all = torch.cat([k, received[:, :heads_kv]])
    v_all = torch.cat([v, received[:, heads_kv:]])
    attend = kernel_attention if q.is_cuda else reference_attention
    out, meta = attend(q, k_all, v_all, local_mask(plan, rank), softmax_scale=softmax_scale, softcap=softcap,
                       sink=sink, return_max_logits=return_max_logits)  # fmt: skip
    if return_max_logits:
        max_logits = meta.max_logits.detach().clone()
        _collective("max_logits", dist.all_reduce, max_logits, op=dist.ReduceOp.MAX, group=group)
        meta = AttentionMeta(lse=meta.lse, max_logits=max_logits)
    return out, meta
