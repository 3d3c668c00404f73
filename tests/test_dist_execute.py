"""Running plans over torch.distributed: the local masks (no processes), gloo on CPUs with 2 and 4
processes against the single-process reference, forward and backward, and what the ranks check
of each other: the same plan (once per plan and group) and arrival within maskc's timeout."""

from __future__ import annotations

import os
import re
import socket
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import masks

import maskc
from maskc.dist import execute, make_plan
from maskc.dist.execute import key_order, local_mask, plan_digest, stage_tables
from maskc.ir import AttnSlice, Mask


@given(
    masks(max_len=40, max_slices=6), st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 5]),
    st.sampled_from([None, 1, 3]),
)
@settings(max_examples=80, deadline=None)
def test_stage_masks_are_the_global_mask_seen_from_each_rank(mask: Mask, cp: int, chunk: int, stages: int | None) -> None:
    """The local stage's mask and every remote stage's, over the keys each brings, are the global
    mask's, and so is a fused call's over its own keys and stage 0's, all in ascending global
    position (key_order puts a call's buffers in that order); the stages bring every remote key
    the rank needs once."""
    n = max(mask.shape)
    plan = make_plan(Mask(mask.slices, n, n), cp, chunk, num_stages=stages)
    dense = plan.mask.to_dense()
    for rank in range(cp):
        rows = torch.from_numpy(plan.comm.local_rows(rank))
        blocks = [(local_mask(plan, rank), plan.comm.local_rows(rank))]
        blocks += [(local_mask(plan, rank, i), stage_tables(plan, i).recv_rows(rank)) for i in range(plan.stages.num_stages)]
        # A fused call's keys: its own and stage 0's.
        blocks_fused = [(local_mask(plan, rank, None, 0), np.concatenate([blocks[0][1], blocks[1][1]]))]
        for stage_mask, keys in blocks + blocks_fused:  # keys in ascending global position
            assert torch.equal(stage_mask.to_dense(), dense[rows][:, torch.from_numpy(np.sort(keys))])
        order = key_order(plan, rank, (None, 0), torch.device("cpu"))
        keys = blocks_fused[0][1]
        assert np.array_equal(keys if order is None else keys[order.numpy()], np.sort(keys))
        remote = np.concatenate([keys for _, keys in blocks[1:]])
        assert sorted(remote.tolist()) == sorted(plan.comm.recv_rows(rank).tolist())


# ---- gloo, several processes ---------------------------------------------------------------------

SEQ, HQ, HKV, D = 300, 4, 2, 16
MASKS = {
    "varlen_causal": lambda: Mask.from_cu_seqlens([0, 37, 150, 151, 300], causal=True),
    "sliding_window_and_globals": lambda: Mask.sliding_window([0, SEQ], 20).with_global_tokens(7),
    "random": lambda: Mask(
        [AttnSlice((a, b), (c, e), t) for a, b, c, e, t in
         [(0, 120, 10, 200, "full"), (50, 300, 0, 300, "causal"), (200, 260, 100, 180, "inv_causal"),
          (120, 300, 140, 280, "bi_causal")]], SEQ, SEQ),  # fmt: skip
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, *args, timeout: float) -> None:
    """worker(rank, world, port, *args, errors) in one spawned process per rank; fails with
    every rank's traceback (put on `errors`) or exit code."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _init_gloo(rank: int, world: int, port: int, timeout: float = 60) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def _worker(rank: int, world: int, port: int, name: str, algorithm: str, stages: tuple, errors: mp.Queue) -> None:
    try:
        _init_gloo(rank, world, port)
        torch.manual_seed(0)  # the same global inputs on every rank
        mask = MASKS[name]()
        q, k, v = (torch.randn(SEQ, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV))
        sink = torch.randn(2, HQ, dtype=torch.float64)
        dout = torch.randn(SEQ, HQ, D, dtype=torch.float64)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
        ref, ref_meta = maskc.reference_attention(*leaves[:3], mask, sink=leaves[3], softcap=4.0, return_max_logits=True)
        (ref * dout).sum().backward()

        num_stages, fuse_local = stages
        plan = make_plan(mask, world, 16, algorithm=algorithm, num_stages=num_stages, fuse_local=fuse_local)
        ours = [x.clone().requires_grad_() for x in (q, k, v, sink)]
        local = [maskc.dist.dispatch(x, plan) for x in ours[:3]]
        out, meta = maskc.dist.attention(*local, plan, sink=ours[3], softcap=4.0, return_max_logits=True)
        full = maskc.dist.undispatch(out, plan)
        (full * dout).sum().backward()
        sink_grad = ours[3].grad.clone()
        dist.all_reduce(sink_grad)  # each rank holds its rows' share, as for any replicated parameter
        torch.testing.assert_close(full, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(maskc.dist.undispatch(meta.lse.unsqueeze(-1), plan).squeeze(-1), ref_meta.lse)
        torch.testing.assert_close(meta.max_logits, ref_meta.max_logits)
        for name_, ours_grad, ref_leaf in zip(("dq", "dk", "dv"), (x.grad for x in ours[:3]), leaves[:3]):
            torch.testing.assert_close(ours_grad, ref_leaf.grad, rtol=1e-9, atol=1e-9, msg=name_)
        torch.testing.assert_close(sink_grad, leaves[3].grad, rtol=1e-9, atol=1e-9)
        # dispatch / undispatch round trip, and a plan mismatch is refused.
        x = torch.randn(SEQ, 3, dtype=torch.float64)
        assert torch.equal(maskc.dist.undispatch(maskc.dist.dispatch(x, plan), plan), x)
        other = make_plan(mask, world, 16 if rank == 0 else 8, algorithm=algorithm, num_stages=num_stages,
                          fuse_local=fuse_local)
        assert (plan_digest(other) == plan_digest(plan)) == (rank == 0)
        with pytest.raises(maskc.MaskcError, match="different maskc plans"):
            maskc.dist.attention(*(maskc.dist.dispatch(x, other) for x in (q, k, v)), other)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name,algorithm,stages", [("varlen_causal", "swap", (2, True)), ("sliding_window_and_globals", "greedy", (None, None)),
                                                   ("random", "local", (3, False)), ("random", "swap", (1, True))])  # fmt: skip
def test_gloo_forward_and_backward_equal_the_reference(world: int, name: str, algorithm: str, stages: tuple) -> None:
    """The stage pipeline ((stage count, local fusion): 2 fused, 3 unfused, 1 fused (a single
    call), or the cost model's choice) gives the reference's output, lse, max_logits and
    gradients."""
    run_ranks(_worker, world, name, algorithm, stages, timeout=240)


def _disagreeing_worker(rank: int, world: int, port: int, errors: mp.Queue) -> None:
    """Rank 1 builds its plans with another chunk size: dispatch and undispatch raise on every
    rank, naming who holds which plan, so none is left waiting in a collective and the group
    still works."""
    try:
        _init_gloo(rank, world, port)
        torch.manual_seed(0)  # the same global input on every rank
        mask = MASKS["varlen_causal"]()
        x = torch.randn(SEQ, 3, dtype=torch.float64)
        named = r"different maskc plans: ranks 0, 2 hold plan [0-9a-f]{16}, rank 1 holds plan [0-9a-f]{16}: build the plan"
        plan = make_plan(mask, world, 8 if rank == 1 else 16)
        with pytest.raises(maskc.MaskcError, match=named):
            maskc.dist.dispatch(x, plan)
        local = torch.zeros(plan.padded_length // world, 3, dtype=torch.float64)
        with pytest.raises(maskc.MaskcError, match=named):
            maskc.dist.undispatch(local, plan)
        plan = make_plan(mask, world, 16)
        assert torch.equal(maskc.dist.undispatch(maskc.dist.dispatch(x, plan), plan), x)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.slow
def test_ranks_with_different_plans_all_raise_naming_them() -> None:
    run_ranks(_disagreeing_worker, 3, timeout=120)


def _counting_worker(rank: int, world: int, port: int, store: str, errors: mp.Queue) -> None:
    """Counts the collectives by step through a whole forward and backward of dispatch,
    attention and undispatch, then on another group, then on a world initialised anew (the
    same ranks and group name as the first)."""
    try:
        _init_gloo(rank, world, port)
        steps: list[str] = []
        issue = execute._collective

        def counting(step: str, *args, **kwargs):
            steps.append(step)
            return issue(step, *args, **kwargs)

        execute._collective = counting
        plan = make_plan(MASKS["random"](), world, 16, num_stages=2, fuse_local=False)
        q, k, v = (torch.randn(SEQ, h, D, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
        for _ in range(2):
            out, _ = maskc.dist.attention(*(maskc.dist.dispatch(x, plan) for x in (q, k, v)), plan)
            maskc.dist.undispatch(out, plan).sum().backward()
        assert steps.count("plan check") == 1, steps
        assert {"undispatch", "dispatch backward", "stage 1/2 keys", "stage 2/2 dK/dV (backward)"} <= set(steps), steps
        group = dist.new_group(list(range(world)))
        maskc.dist.undispatch(maskc.dist.dispatch(q, plan, group), plan, group)
        maskc.dist.dispatch(q, plan)
        assert steps.count("plan check") == 2, steps
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        maskc.dist.dispatch(q, plan)
        assert steps.count("plan check") == 3, steps
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.slow
def test_the_plan_check_runs_once_per_plan_and_group(tmp_path) -> None:
    run_ranks(_counting_worker, 2, str(tmp_path / "store"), timeout=120)


def _absent_worker(rank: int, port: int, rank1_does: str, timeouts: tuple, results: mp.Queue, release) -> None:
    """Rank 1 does `rank1_does` (nothing, the dispatches, or the forward) and then waits, outside
    any collective, for the test to let it go; rank 0 runs a forward and backward and must get
    the MaskcError, which it puts on `results`. They run on a group of their own, whose timeout
    can be short without hurrying the rendezvous, and wait 2 s for each other's word. A rank
    whose collective failed cannot tear its process group down cleanly, so both leave with
    os._exit."""
    maskc_timeout, group_timeout = timeouts
    _init_gloo(rank, 2, port)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=group_timeout))
    execute.TIMEOUT, execute._WORD_WAIT = maskc_timeout, 2.0
    plan = make_plan(MASKS["varlen_causal"](), 2, 16)
    q, k, v = (torch.randn(SEQ, h, D, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    try:
        if rank == 0 or rank1_does != "nothing":
            local = [maskc.dist.dispatch(x, plan, group) for x in (q, k, v)]
        if rank == 0 or rank1_does == "forward":
            out = maskc.dist.undispatch(maskc.dist.attention(*local, plan, group=group)[0], plan, group)
        if rank == 0:
            out.sum().backward()
            results.put("no error")
    except maskc.MaskcError as exc:
        results.put(str(exc))
    except BaseException:
        results.put(traceback.format_exc())
    if rank == 1:
        release.wait(60)
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("rank1_does,timeouts,step", [
    ("nothing", (2.0, 60), "plan check"),
    ("dispatch", (2.0, 60), r"stage 1/\d keys"),
    ("forward", (2.0, 60), r"stage \d/\d dK/dV \(backward\)"),
    ("nothing", (0, 2), "plan check"),
])  # fmt: skip
def test_a_rank_that_never_arrives_is_named_with_the_step(rank1_does: str, timeouts: tuple, step: str) -> None:
    """Rank 1 stops calling maskc.dist early: rank 0 raises within maskc's timeout (2 s; twice
    that with the wait for the other ranks' word), naming the plan step it was at and rank 1 as
    the rank that did not arrive; with maskc's timeout 0 the process group's (2 s) applies."""
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_absent_worker, args=(r, port, rank1_does, timeouts, results, release)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message = results.get(timeout=60)
    finally:
        release.set()
        for p in procs:
            p.join(timeout=30)
    assert re.match(rf"maskc\.dist {step}: the collective failed on rank 0 \(.+\); rank 1 did not arrive\. ", message), message


def test_attention_input_errors_name_the_problem(tmp_path) -> None:
    """One process: no process group, a plan for another world size, rows that are not this
    rank's and a bad sm_margin are refused with the reason."""
    mask = MASKS["varlen_causal"]()
    plan = make_plan(mask, 1, 16)
    q, k = torch.randn(SEQ, HQ, D, dtype=torch.float64), torch.randn(SEQ, HKV, D, dtype=torch.float64)
    with pytest.raises(maskc.MaskcError, match="initialised torch.distributed process group"):
        maskc.dist.attention(q, k, k, plan)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        local = [maskc.dist.dispatch(x, plan) for x in (q, k, k)]
        with pytest.raises(maskc.MaskcError, match="plan is for 2 ranks but the process group has 1"):
            maskc.dist.attention(*local, make_plan(mask, 2, 16))
        with pytest.raises(maskc.MaskcError, match="q must be this rank's"):
            maskc.dist.attention(local[0][:-1], *local[1:], plan)
        for bad in (-1, 2.0, True):
            with pytest.raises(maskc.MaskcError, match="sm_margin must be a non-negative int"):
                maskc.dist.attention(*local, plan, sm_margin=bad)
        out, _ = maskc.dist.attention(*local, plan)
        torch.testing.assert_close(maskc.dist.undispatch(out, plan), maskc.reference_attention(q, k, k, mask)[0])
    finally:
        dist.destroy_process_group()
