"""Running a plan over torch.distributed: every process holds its chunks of the sequence.

`dispatch` / `undispatch` move a sequence-first tensor between its global layout (the same on
every rank) and this rank's local rows (its chunks, ascending). `attention` runs the plan's
stage pipeline: the rank attends its queries to its own keys (the local stage) and to the
remote key/value rows of each stage (GroupCast: one all-to-all-v per stage with that stage's
split sizes, issued ahead so it runs behind the compute), and merges the partial outputs by
their lse. When communication is small the plan fuses the local stage with the first remote
stage (`StagePlan.fuse_local`): one kernel call over both once its keys arrive, no merge. In
the backward each stage's partial dK/dV of the received rows go back to their owners, which
add them to their own (GroupReduce: the transposed all-to-all-v and a scatter-add), while the
next stage computes. Local compute is maskc's kernels on CUDA and the
reference attention elsewhere (gloo on CPUs), through their functional forward / backward.
The ranks check each other: the first use of a plan on a group compares every rank's digest of
it (`_agreed`), and every collective waits at most `TIMEOUT` seconds, then fails naming
its plan step and the ranks that did not arrive (`_Pending`).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from maskc.dist.local import PreparedPlan, _memo, installed, kernel_calls, key_positions, local_mask, plan_digest, stage_tables
from maskc.dist.plan import Plan
from maskc.errors import MaskcError
from maskc.ir.mask import Mask
from maskc.reference import AttentionMeta, reference_backward, reference_forward
from maskc.runtime.api import attention_backward, attention_forward


def key_order(plan: Plan, rank: int, sources: tuple[int | None, ...], device: torch.device) -> torch.Tensor | None:
    """`key_positions` on `device`, copied once."""
    key = ("key_order", rank, sources, device)
    if key not in _memo(plan):
        order = key_positions(plan, rank, sources)
        _memo(plan)[key] = None if order is None else order.to(device)
    return _memo(plan)[key]


# ---- process group helpers --------------------------------------------------------------------


def _timeout_from_env() -> float:
    text = os.environ.get("MASKC_DIST_TIMEOUT", "300")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise MaskcError(f"MASKC_DIST_TIMEOUT must be a number of seconds >= 0 (0: no limit of maskc's), got {text!r}")
    return seconds


TIMEOUT: float = _timeout_from_env()
"""Seconds every maskc collective may take before it raises a MaskcError that names its plan step
and the ranks that did not arrive (learning those takes up to as long again, at most
`_WORD_WAIT`): $MASKC_DIST_TIMEOUT, 300 by default; assign it to change it (read at every
wait). Keep it below the process group's timeout, past which NCCL's watchdog ends the process
with its own message. 0: no limit of maskc's, the process group's timeout applies (NCCL's waits
then only order the streams, where a limit blocks the CPU until the transfer lands)."""

_WORD_WAIT = 30.0
"""The most seconds a rank whose collective failed waits for the other ranks' word: inside the
minute NCCL's watchdog leaves the process after a failed collective before it ends it (torch 2.11,
the default TORCH_NCCL_ASYNC_ERROR_HANDLING), so the MaskcError is out first."""


def _resolve(group: Any) -> Any:
    """The process group object itself (None: the default group)."""
    return dist.group.WORLD if group is None else group


def _ranks(ranks: list[int], verb: tuple[str, str]) -> str:
    """'rank 1 holds' or 'ranks 0, 2 hold' (verb: singular, plural)."""
    return f"rank {ranks[0]} {verb[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} {verb[1]}"


@dataclass(frozen=True)
class _Pending:
    """A maskc collective in flight, with the plan step it serves (for the error message)."""

    step: str
    work: Any
    group: Any

    def wait(self) -> None:
        """Wait at most TIMEOUT seconds. torch's `work.wait(timeout)` is the limit gloo and NCCL
        both honour: NCCL blocks the CPU until the work completes or the time passes, then
        aborts the group's communicators and raises here (its watchdog still ends the process
        about a minute later); a zero timedelta is torch's "no limit". Any failure becomes a
        MaskcError naming the step and where the other ranks are (`_whereabouts`)."""
        try:
            self.work.wait(timeout=timedelta(seconds=TIMEOUT))
        except RuntimeError as exc:
            limit = f"{TIMEOUT:g} s for each collective" if TIMEOUT else "0: the process group's timeout applies"
            raise MaskcError(
                f"maskc.dist {self.step}: the collective failed on rank {dist.get_rank(self.group)} "
                f"({str(exc).strip().splitlines()[0]}); {_whereabouts(self.step, self.group)}. Do all ranks call the "
                f"same maskc.dist functions with the same plan? (MASKC_DIST_TIMEOUT: {limit})"
            ) from exc


def _collective(step: str, fn: Any, *args: Any, group: Any, **kwargs: Any) -> _Pending:
    """Issue a collective asynchronously; `.wait()` on the result ends it. Every maskc collective
    goes through here, so that every one of them has a limit and a message naming its step."""
    return _Pending(step, fn(*args, group=group, async_op=True, **kwargs), group)


def _whereabouts(step: str, group: Any) -> str:
    """Where the other ranks are, in words, once `step` failed on this rank. Learnt only now,
    through the default store (TCP, whatever the backend), so the healthy path pays nothing:
    each rank whose collective fails posts its step, then reads the others' posts for up to
    TIMEOUT (a rank that reached the same collective fails within TIMEOUT of this one; the
    store's timeout when TIMEOUT is 0), at most _WORD_WAIT. No post: the rank did not arrive;
    another step: it is elsewhere. A group is unusable after a failed collective, so one post
    per group and rank."""
    group = _resolve(group)
    keys = [f"maskc/failed/{group.group_name}/{r}" for r in range(dist.get_world_size(group))]
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[dist.get_rank(group)], step)
        try:
            store.wait(keys, timedelta(seconds=min(TIMEOUT or store.timeout.total_seconds(), _WORD_WAIT)))
        except RuntimeError:
            pass  # the ranks that never post are the ones to name
        posts = [store.get(key).decode() if store.check([key]) else None for key in keys]
    except RuntimeError as exc:
        return f"which ranks arrived is unknown (the store failed: {str(exc).strip().splitlines()[0]})"
    elsewhere: dict[str | None, list[int]] = {}
    for rank, post in enumerate(posts):
        if post != step:
            elsewhere.setdefault(post, []).append(rank)
    if not elsewhere:
        return "every rank reached it"
    return ", ".join(_ranks(ranks, ("did not arrive", "did not arrive")) if post is None else
                     f"{_ranks(ranks, ('is', 'are'))} at {post!r}" for post, ranks in elsewhere.items())  # fmt: skip


def _agreed(plan: Plan | PreparedPlan, group: Any) -> tuple[Plan, int]:
    """The plan and this rank in `group`, once every rank of it is known to hold the plan, or
    nothing lines up. A PreparedPlan's parts join the plan's memo first (`installed`), and it
    must be this rank's.
    dispatch, undispatch and attention call it before anything else, so their backwards (the
    plan drives those collectives too) find it done. The first time for a (plan, group) the
    ranks all-gather their digests (on the device torch's object collectives use on the group):
    every rank sees every digest, so on a disagreement all of them raise and none waits in a
    later collective. The groups that agreed are kept per plan in a weak set, by the group
    object itself: not its id() (reused once a group is freed), nor its ranks and name (a
    world destroyed and initialised again has the same ones, maybe other processes behind
    them); a group leaves the set when it is freed."""
    if not dist.is_available() or not dist.is_initialized():
        raise MaskcError("maskc.dist needs an initialised torch.distributed process group (init_process_group)")
    plan, prepared_for = installed(plan)
    group = _resolve(group)
    agreed = _memo(plan).setdefault("agreed_groups", weakref.WeakSet())
    if group not in agreed:
        world = dist.get_world_size(group)
        device = torch.device(dist.distributed_c10d._get_object_coll_device(group))
        mine = torch.tensor([plan_digest(plan)], dtype=torch.int64, device=device)
        digests = [torch.empty_like(mine) for _ in range(world)]
        _collective("plan check", dist.all_gather, digests, mine, group=group).wait()
        holders: dict[int, list[int]] = {}
        for rank, digest in enumerate(digests):
            holders.setdefault(int(digest.item()), []).append(rank)
        if len(holders) > 1:
            held = ", ".join(f"{_ranks(ranks, ('holds', 'hold'))} plan {d:016x}" for d, ranks in holders.items())
            raise MaskcError(f"ranks hold different maskc plans: {held}: build the plan identically on every rank")
        if world != plan.cp_size:
            raise MaskcError(f"the plan is for {plan.cp_size} ranks but the process group has {world}")
        agreed.add(group)
    rank = dist.get_rank(group)
    if prepared_for is not None and prepared_for != rank:
        raise MaskcError(f"the prepared plan is rank {prepared_for}'s and this is rank {rank} of the group: prepare each "
                         "rank's plan for that rank (maskc.dist.prepare_plan)")  # fmt: skip
    return plan, rank


def _rows(plan: Plan, which: str, rank: int, device: torch.device, stage: int | None = None) -> torch.Tensor:
    """A row index of the plan's communication tables on `device`, built and copied once:
    `which` is "local" (`comm.local_rows`), "gather" (`gather_index`: the rows a rank sends in
    a stage's GroupCast), "scatter" (`scatter_index`: where the rows of its GroupReduce add up)
    or "global" (every rank's local rows, rank after rank)."""
    key = ("rows", which, rank, device, stage)
    cached = _memo(plan).get(key)
    if cached is None:
        comm = plan.comm if stage is None else stage_tables(plan, stage)
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


def _gather_global(x_local: torch.Tensor, plan: Plan, group: Any, step: str) -> torch.Tensor:
    """Every rank's local rows put back in global order, on every rank (padding removed)."""
    parts = [torch.empty_like(x_local) for _ in range(plan.cp_size)]
    _collective(step, dist.all_gather, parts, x_local.contiguous(), group=group).wait()
    full = x_local.new_empty(plan.padded_length, *x_local.shape[1:])
    full[_rows(plan, "global", -1, x_local.device)] = torch.cat(parts)
    return full[: plan.seqlen]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: Plan, group: Any, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.group = plan, group
        return _take_local(x, plan, rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return _gather_global(grad, ctx.plan, ctx.group, "dispatch backward"), None, None, None


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_local: torch.Tensor, plan: Plan, group: Any, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.rank = plan, rank
        return _gather_global(x_local, plan, group, "undispatch")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return _take_local(grad, ctx.plan, ctx.rank), None, None, None


def dispatch(x: torch.Tensor, plan: Plan | PreparedPlan, group: Any = None) -> torch.Tensor:
    """This rank's part of a global sequence-first tensor (the same on every rank), in the plan's
    local layout. Its gradient is gathered back: every rank gets the full gradient of `x`."""
    plan, rank = _agreed(plan, group)
    return _Dispatch.apply(x, plan, group, rank)


def undispatch(x_local: torch.Tensor, plan: Plan | PreparedPlan, group: Any = None) -> torch.Tensor:
    """The global tensor from every rank's local part, on every rank. Its backward takes this
    rank's part of the gradient every rank holds in full."""
    plan, rank = _agreed(plan, group)
    if x_local.shape[0] != plan.padded_length // plan.cp_size:
        raise MaskcError(f"expected this rank's {plan.padded_length // plan.cp_size} rows, got shape {tuple(x_local.shape)}")
    return _Undispatch.apply(x_local, plan, group, rank)


# ---- attention ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Options:
    """What every stage's attention call shares."""

    plan: Plan
    rank: int
    group: Any
    softmax_scale: float | None
    softcap: float
    return_max_logits: bool
    sm_margin: int

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, sink: torch.Tensor | None) -> tuple:
        """(out, lse, max_logits or None) of one stage: maskc's kernels on CUDA, else the reference."""
        kw = dict(softmax_scale=self.softmax_scale, softcap=self.softcap, sink=sink, return_max_logits=self.return_max_logits)
        if q.is_cuda:
            return attention_forward(q, k, v, mask, sm_margin=self.sm_margin, **kw)
        return reference_forward(q, k, v, mask, **kw)

    def backward(self, q, k, v, out, lse, dout, dlse, mask, sink, dq_accum: torch.Tensor) -> tuple:
        """(dk, dv, dsink or None) of one stage against the merged `out` and `lse`; its dQ is
        added to the float32 `dq_accum`."""
        kw = dict(softmax_scale=self.softmax_scale, softcap=self.softcap, sink=sink)
        if q.is_cuda:
            _, dk, dv, dsink = attention_backward(q, k, v, out, lse, dout, dlse, mask, sm_margin=self.sm_margin,
                                                  dq_accum=dq_accum, **kw)  # fmt: skip
        else:
            dq, dk, dv, dsink = reference_backward(q, k, v, out, lse, dout, dlse, mask, **kw)
            dq_accum += dq
        return dk, dv, dsink


def _start(step: str, out: torch.Tensor, send: torch.Tensor, out_counts: np.ndarray, in_counts: np.ndarray,
           group: Any) -> _Pending:  # fmt: skip
    """An all-to-all-v issued asynchronously: NCCL runs it beside the next kernels, gloo in its
    own thread; the call that needs it waits for it."""
    return _collective(step, dist.all_to_all_single, out, send, out_counts.tolist(), in_counts.tolist(), group=group)


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over every call's keys from each call's output and lse: lse = logsumexp of
    their lse, out = sum of exp(lse_i - lse) * out_i, added up in float32 at least in one
    buffer (each part read once: a merge pass is a cost of every extra stage call). Rows no
    call reaches keep lse = -inf and out = 0."""
    if len(outs) == 1:
        return outs[0], lses[0]
    stacked = torch.stack(lses)
    lse = torch.logsumexp(stacked, dim=0)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(stacked - safe).unsqueeze(-1)
    wide = torch.promote_types(outs[0].dtype, torch.float32)
    out = outs[0] * weights[0].to(wide)
    for part, weight in zip(outs[1:], weights[1:]):
        out.addcmul_(part, weight.to(wide))
    return out.to(outs[0].dtype), lse


class _StagedAttention(torch.autograd.Function):
    """The stage pipeline. Forward: every stage's keys are requested up front (one
    all-to-all-v each, in stage order) and waited for only when the call that uses them runs,
    so the later stages' transfers run behind the earlier calls; the partial outputs merge by
    their lse. Backward: each remote-only call runs first and its dK/dV go back to their owners
    (GroupReduce) while the next call computes; the local call runs last (and, fused, sends
    stage 0's dK/dV back after it). The calls' dQ add up in one float32 buffer and the received
    dK/dV in float32 before the cast."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None, opt: _Options
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        plan, rank, hkv = opt.plan, opt.rank, k.shape[1]
        own, fused = k.shape[0], plan.stages.fuse_local
        recv = [int(stage_tables(plan, i).recv_counts[rank].sum()) for i in range(plan.stages.num_stages)]
        # K and V side by side (one collective moves both). Fused, the own rows head the buffer
        # stage 0's keys land in, so the fused call's keys are in place with no concatenation.
        if fused:
            joined = k.new_empty(own + recv[0], 2 * hkv, k.shape[2])
            kv = joined[:own]
            kv[:, :hkv], kv[:, hkv:] = k, v
            landing = [joined[own:]]
        else:
            kv = torch.cat([k, v], dim=1)
            landing = []
        landing += [kv.new_empty(rows, *kv.shape[1:]) for rows in recv[len(landing) :]]
        fetches = []
        for i, buf in enumerate(landing):
            comm = stage_tables(plan, i)
            send = kv.index_select(0, _rows(plan, "gather", rank, kv.device, i))
            fetches.append(_start(f"stage {i + 1}/{plan.stages.num_stages} keys", buf, send, comm.recv_counts[rank],
                                  comm.send_counts[rank], opt.group))  # fmt: skip

        parts, keys_values = [], []
        for sources in kernel_calls(plan):
            if sources == (None,):
                keys, values = k, v  # own keys: ascending already
            else:
                for stage in sources:
                    if stage is not None:
                        fetches[stage].wait()
                buf = joined if None in sources else landing[sources[0]]
                order = key_order(plan, rank, sources, kv.device)
                if order is None:
                    keys, values = buf[:, :hkv].contiguous(), buf[:, hkv:].contiguous()
                else:  # gathered in ascending global position, straight into K and V
                    keys, values = buf[order, :hkv], buf[order, hkv:]
            keys_values += [keys, values]
            if keys.shape[0]:
                local = None in sources
                parts.append(opt.forward(q, keys, values, local_mask(plan, rank, *sources), sink if local else None))
        out, lse = _merge([p[0] for p in parts], [p[1] for p in parts])
        max_logits = torch.stack([p[2] for p in parts]).amax(dim=0) if opt.return_max_logits else lse.new_empty(0)
        ctx.save_for_backward(q, sink, out, lse, *keys_values)
        ctx.opt = opt
        ctx.mark_non_differentiable(max_logits)
        return out, lse, max_logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None, _dmax: Any) -> tuple:  # type: ignore[override]
        q, sink, out, lse, *keys_values = ctx.saved_tensors
        opt = ctx.opt
        plan, rank = opt.plan, opt.rank
        hkv, kv_dtype, local_rows = keys_values[0].shape[1], keys_values[0].dtype, q.shape[0]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        calls = kernel_calls(plan)
        reduces, own, dsink = [], None, None
        for c in [*range(1, len(calls)), 0]:
            sources, keys, values = calls[c], keys_values[2 * c], keys_values[2 * c + 1]
            if keys.shape[0]:
                local = None in sources
                dk, dv, dsink_c = opt.backward(q, keys, values, out, lse, dout, dlse, local_mask(plan, rank, *sources),
                                               sink if local else None, dq)  # fmt: skip
                dsink = dsink_c if local else dsink
                order = key_order(plan, rank, sources, dk.device)
                if order is None:
                    partial = torch.cat([dk, dv], dim=1)
                else:  # back to the sources' buffer order
                    partial = dk.new_empty(dk.shape[0], 2 * hkv, dk.shape[2])
                    partial[order, :hkv], partial[order, hkv:] = dk, dv
            else:
                partial = keys.new_empty(0, 2 * hkv, keys.shape[2])
            start = 0
            for s in sources:
                rows = local_rows if s is None else int(stage_tables(plan, s).recv_counts[rank].sum())
                piece, start = partial[start : start + rows], start + rows
                if s is None:
                    own = piece
                    continue
                comm = stage_tables(plan, s)
                back = piece.new_empty(int(comm.send_counts[rank].sum()), *piece.shape[1:])
                step = f"stage {s + 1}/{plan.stages.num_stages} dK/dV (backward)"
                reduces.append((s, back, _start(step, back, piece, comm.reduce_recv_counts[rank],
                                                comm.reduce_send_counts[rank], opt.group)))  # fmt: skip
        dkv = own.to(torch.promote_types(own.dtype, torch.float32))
        for s, back, work in reduces:
            work.wait()
            dkv.index_add_(0, _rows(plan, "scatter", rank, dkv.device, s), back.to(dkv.dtype))
        dkv = dkv.to(kv_dtype)
        return dq.to(q.dtype), dkv[:, :hkv], dkv[:, hkv:], dsink, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan | PreparedPlan,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    group: Any = None,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, AttentionMeta]:
    """Exact masked attention of this rank's queries (local layout, from `dispatch`) over the
    whole sequence: local q [L, Hq, D], k / v [L, Hkv, D] with L = the plan's rows per rank.
    Returns this rank's output and meta (lse of its rows; max_logits reduced over all ranks).
    The keys come in the plan's stages (`_StagedAttention`); a PreparedPlan (`prepare_plan`)
    brings the rank's call masks and schedules planned ahead, so the call plans nothing. On CUDA the kernels can leave
    `sm_margin` SMs to the transfers running beside them. It defaults to 0: the transfers are
    issued before the kernels they overlap, so NCCL holds its SMs first; on 4 H200s (one
    unfused stage) leaving 8 SMs moved the forward by -2% to +3% and cost the backward 2.5-5%
    on four of the five benchmark masks (it gained 4.6% on the fifth). The sinks' gradient on
    each rank is its rows' share: sum it over ranks like any replicated parameter's (DDP does)."""
    plan, rank = _agreed(plan, group)
    rows = plan.padded_length // plan.cp_size
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != rows:
            raise MaskcError(f"{name} must be this rank's [{rows}, heads, head_dim] rows (from maskc.dist.dispatch)")
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise MaskcError(f"sm_margin must be a non-negative int (SMs left to NCCL), got {sm_margin!r}")
    opt = _Options(plan, rank, group, softmax_scale, float(softcap), return_max_logits, int(sm_margin))
    out, lse, max_logits = _StagedAttention.apply(q, k, v, sink, opt)
    if not return_max_logits:
        return out, AttentionMeta(lse=lse, max_logits=None)
    max_logits = max_logits.clone()
    _collective("max_logits", dist.all_reduce, max_logits, op=dist.ReduceOp.MAX, group=group).wait()
    return out, AttentionMeta(lse=lse, max_logits=max_logits)
