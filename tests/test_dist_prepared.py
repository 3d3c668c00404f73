"""Planning a mask for context parallelism ahead of the step (maskc.dist.prepare_plan): what a
PreparedPlan holds (against planning afresh), what it refuses, and over gloo (2 processes,
each with a DataLoader whose worker plans the batches) the outputs and gradients of planning in
the step, with no planning left in the step."""

from __future__ import annotations

import contextlib
import pickle
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_dist_execute import _init_gloo, run_ranks

import maskc
import maskc.dist.local as local
import maskc.dist.plan as plan_module
from maskc.artifact.kernel_families import HeadDim
from maskc.dist import PlanningCollate, PreparedPlan, make_plan, prepare_plan
from maskc.dist.comm import CommTables
from maskc.dist.local import installed, kernel_calls, key_positions, local_mask, plan_digest, stage_tables
from maskc.dist.pieces import Pieces
from maskc.errors import MaskcError
from maskc.ir import Mask
from maskc.runtime import call_plan

TARGET = call_plan.make_target((9, 0), 132, torch.bfloat16, 64, 8, HeadDim(128, 128), False, False, False, None, False)
MASK = Mask.from_cu_seqlens([0, 700, 1500, 1501, 4096], causal=True)


@pytest.mark.parametrize("fuse_local", [False, True])
def test_a_prepared_plan_holds_what_the_rank_would_derive_with_its_schedules(fuse_local: bool) -> None:
    """After a pickle round trip (a DataLoader's worker boundary) each rank's prepared plan is
    the plan, and the runtime finds in its memo the masks, key orders and stage tables it would
    build, the masks with the forward and backward schedules planning them would give."""
    fresh = make_plan(MASK, 4, 64, num_stages=3, fuse_local=fuse_local)
    for rank in range(4):
        prepared = pickle.loads(pickle.dumps(prepare_plan(MASK, 4, rank, TARGET, chunk_size=64, num_stages=3,
                                                          fuse_local=fuse_local)))  # fmt: skip
        plan, prepared_for = installed(prepared)
        assert plan is prepared.plan and prepared_for == rank
        assert plan.to_json() == fresh.to_json() and plan_digest(plan) == plan_digest(fresh)
        for i in range(plan.stages.num_stages):
            assert stage_tables(plan, i) is prepared.stage_tables[i]
            assert stage_tables(plan, i).to_dict() == stage_tables(fresh, i).to_dict()
        for sources in kernel_calls(fresh):
            got, want = local_mask(plan, rank, *sources), local_mask(fresh, rank, *sources)
            assert torch.equal(got.table, want.table)
            got_order, want_order = key_positions(plan, rank, sources), key_positions(fresh, rank, sources)
            assert (got_order is None) == (want_order is None)
            assert got_order is None or torch.equal(got_order, want_order)
            maskc.prepare(want, TARGET)  # planning the call in the step fills its memo
            schedules = [key for key, value in want.memo.items() if isinstance(value, call_plan.HostSchedule)]
            assert len(schedules) >= 2  # forward and backward
            for key in schedules:
                assert torch.equal(got.memo[key].flat, want.memo[key].flat), key


def test_bad_prepared_plans_are_refused() -> None:
    prepared = prepare_plan(MASK, 2, 1, None, chunk_size=64, num_stages=2)
    for rank in (2, -1, True, 0.0):
        with pytest.raises(MaskcError, match=r"rank must be an int in \[0, 2\)"):
            prepare_plan(MASK, 2, rank, None)
    with pytest.raises(MaskcError, match="rank of the plan's 2"):
        replace(prepared, rank=5)
    with pytest.raises(MaskcError, match="calls is a tuple of 2 PreparedMask"):
        replace(prepared, calls=prepared.calls[:1])
    with pytest.raises(MaskcError, match="stage_tables is a tuple of 2 CommTables"):
        replace(prepared, stage_tables=(None, None))
    with pytest.raises(MaskcError, match=r"key_runs is a tuple of 2 int64 \[R, 2\] arrays"):
        replace(prepared, key_runs=(None, np.zeros(3, np.int64)))
    with pytest.raises(MaskcError, match="expected a maskc.dist Plan or PreparedPlan, got str"):
        installed("plan")
    with pytest.raises(MaskcError, match="must make a dict batch"):
        PlanningCollate(lambda batch: MASK, 2, 0, None, collate=lambda samples: samples)([1, 2])


# ---- gloo, a DataLoader worker planning each rank's batches ----------------------------------------

SEQ, HQ, HKV, D, STEPS = 300, 4, 2, 16, 3


class Documents(torch.utils.data.Dataset):
    """Item i: another packing of SEQ tokens into documents (cu_seqlens) every step."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        cuts = np.sort(np.random.default_rng(i).choice(np.arange(1, SEQ), 4, replace=False))
        return {"cu_seqlens": torch.tensor([0, *cuts.tolist(), SEQ])}


def documents_mask(batch: dict[str, torch.Tensor]) -> Mask:
    return Mask.from_cu_seqlens(batch["cu_seqlens"][0].tolist(), causal=True)


@contextlib.contextmanager
def planning_calls() -> Iterator[Counter]:
    """Counts the calls of everything that plans: a plan's derivation (make_plan), the pieces
    cut to a call's keys (local masks), a stage's tables, a call's key order, the plan's digest."""
    counts: Counter = Counter()
    patched = [(plan_module, "_derive"), (Pieces, "clipped"), (local, "comm_tables_for"), (CommTables, "recv_rows"),
               (plan_module.Plan, "to_json")]  # fmt: skip
    originals = [getattr(owner, name) for owner, name in patched]

    def counting(name: str, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for (owner, name), fn in zip(patched, originals):
        setattr(owner, name, counting(name, fn))
    try:
        yield counts
    finally:
        for (owner, name), fn in zip(patched, originals):
            setattr(owner, name, fn)


def _step(plan: maskc.dist.Plan | PreparedPlan, step: int) -> list[torch.Tensor]:
    """One step's attention over the ranks, forward and backward: the output and dq, dk, dv."""
    gen = torch.Generator().manual_seed(step)  # the same global inputs on every rank
    q, k, v = (torch.randn(SEQ, h, D, dtype=torch.float64, generator=gen).requires_grad_() for h in (HQ, HKV, HKV))
    dout = torch.randn(SEQ, HQ, D, dtype=torch.float64, generator=gen)
    out, _ = maskc.dist.attention(*(maskc.dist.dispatch(x, plan) for x in (q, k, v)), plan)
    full = maskc.dist.undispatch(out, plan)
    (full * dout).sum().backward()
    return [full.detach(), q.grad, k.grad, v.grad]


def _loader_worker(rank: int, world: int, port: int, errors: mp.Queue) -> None:
    try:
        _init_gloo(rank, world, port)
        collate = PlanningCollate(documents_mask, world, rank, None)
        loader = torch.utils.data.DataLoader(Documents(), batch_size=1, num_workers=1, collate_fn=collate,
                                             multiprocessing_context="spawn")  # fmt: skip
        steps = 0
        for step, batch in enumerate(loader):
            prepared = batch["cp_plan"]
            assert isinstance(prepared, PreparedPlan) and prepared.rank == rank
            with planning_calls() as in_step:
                ahead = _step(prepared, step)
            assert not in_step, in_step
            with planning_calls() as in_step:
                inline = _step(make_plan(documents_mask(batch), world), step)
            assert in_step["_derive"] == 1 and in_step["clipped"] >= 1, in_step  # the probe sees planning
            for got, want in zip(ahead, inline):
                assert torch.equal(got, want)
            steps += 1
        assert steps == STEPS
        # Another rank's prepared plan is refused on every rank, after the ranks agree on the plan.
        other = prepare_plan(documents_mask(batch), world, world - 1 - rank, None)
        with pytest.raises(MaskcError, match=f"the prepared plan is rank {world - 1 - rank}'s and this is rank {rank}"):
            maskc.dist.dispatch(torch.zeros(SEQ), other)
        dist.destroy_process_group()  # a gloo group left to the process's exit can abort it
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.slow
def test_a_dataloader_worker_plans_and_the_step_plans_nothing() -> None:
    run_ranks(_loader_worker, 2, timeout=300)
