"""A rank's share of a plan: the mask of each of its kernel calls, the tables of each stage's
GroupCast, the order of each call's keys. The runtime derives them from a plan once and keeps
them while the plan lives; `prepare_plan` derives them ahead of the step, in a DataLoader
worker, with the tile schedules of the rank's kernels (`maskc.prepare`), and ships them as a
`PreparedPlan` that `maskc.dist.attention`, `dispatch` and `undispatch` take in place of the
plan: the step then plans nothing.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from maskc.dist.comm import CommTables, comm_tables_for
from maskc.dist.plan import Plan, make_plan
from maskc.dist.stages import CostModel
from maskc.errors import MaskcError
from maskc.ir.mask import Mask
from maskc.ir.slices import RowLines, expand_spans
from maskc.runtime import call_plan
from maskc.runtime.masks import as_mask
from maskc.runtime.prepared import PreparedMask, prepare

_PER_PLAN: weakref.WeakKeyDictionary[Plan, dict[Any, Any]] = weakref.WeakKeyDictionary()
"""What the runtime derives from a plan once (local masks, row indices on a device, checked
groups), kept as long as the plan lives."""


def _memo(plan: Plan) -> dict[Any, Any]:
    return _PER_PLAN.setdefault(plan, {})


def kernel_calls(plan: Plan) -> list[tuple[int | None, ...]]:
    """The forward's kernel calls in order, each as its key sources (see local_mask): the local
    call first, with stage 0's keys when the plan fuses them (StagePlan.fuse_local), then one
    call per remaining stage."""
    fused = plan.stages.fuse_local
    return [(None, 0) if fused else (None,)] + [(i,) for i in range(1 if fused else 0, plan.stages.num_stages)]


def stage_tables(plan: Plan, stage: int) -> CommTables:
    """The GroupCast tables of remote stage `stage` (0-based, `plan.stages`): rank r receives
    `plan.stages.stage_ranges(r, stage)`; built once per plan and stage."""
    key = ("stage_tables", stage)
    cached = _memo(plan).get(key)
    if cached is None:
        ranges = [plan.stages.stage_ranges(r, stage) for r in range(plan.cp_size)]
        cached = _memo(plan)[key] = comm_tables_for(ranges, plan.chunk_size, plan.rank_of_chunk, plan.cp_size)
    return cached


def local_mask(plan: Plan, rank: int, *sources: int | None) -> Mask:
    """The mask of `rank`'s queries (its local rows) against the keys of one kernel call, in
    local coordinates: the keys of `sources`, each None (its own keys) or a remote stage i (the
    keys it receives in stage i), in ascending global position (`key_positions`); by default
    its own keys. Built once per plan, rank and sources."""
    sources = sources or (None,)
    key = ("local_mask", rank, sources)
    cached = _memo(plan).get(key)
    if cached is not None:
        return cached
    cs = plan.chunk_size
    own = plan.chunks_of(rank)
    ranges = np.concatenate(
        [np.stack([own * cs, (own + 1) * cs], axis=1) if s is None else stage_tables(plan, s).recv(rank).reshape(-1, 2)
         for s in sources]  # fmt: skip
    )
    ranges = ranges[np.argsort(ranges[:, 0], kind="stable")]
    begin, end = ranges[:, 0], ranges[:, 1]
    lengths = end - begin
    offsets = np.cumsum(lengths) - lengths  # where each key range starts in the call's keys

    pieces = plan.pieces.take(np.flatnonzero(plan.rank_of_chunk[plan.pieces.chunk] == rank))
    first = np.searchsorted(end, pieces.key_begin(), side="right")
    last = np.searchsorted(begin, pieces.key_end(), side="left") - 1
    piece, rng = expand_spans(first, last)
    clipped, source = pieces.take(piece).clipped(begin[rng], end[rng])
    rng = rng[source]
    local_chunk = np.full(plan.num_chunks, -1, dtype=np.int64)
    local_chunk[own] = np.arange(own.size)
    dr = local_chunk[clipped.chunk] * cs - clipped.chunk * cs  # global row -> local row
    dc = offsets[rng] - begin[rng]  # global key -> position in the call's keys
    lines = RowLines(
        clipped.r0 + dr,
        clipped.r1 + dr,
        clipped.lo_a + dc - clipped.lo_s * dr,
        clipped.lo_s,
        clipped.hi_a + dc - clipped.hi_s * dr,
        clipped.hi_s,
    )
    q, k, t = lines.to_slices()
    mask = Mask.from_arrays(q, k, t, own.size * cs, int(lengths.sum()))
    _memo(plan)[key] = mask
    return mask


def key_positions(plan: Plan, rank: int, sources: tuple[int | None, ...]) -> torch.Tensor | None:
    """A call's keys in ascending global position, as rows (int64, CPU) of its sources' buffers
    laid end to end (own keys, then each stage's in receive order); None when they already are.
    A document's keys then sit together whichever rank held them, as in one GPU's sequence, so
    the kernel meets the same runs (and no more partial blocks) than without context
    parallelism. Built once per plan, rank and sources."""
    key = ("key_order", rank, sources)
    if key not in _memo(plan):
        rows = np.concatenate([plan.comm.local_rows(rank) if s is None else stage_tables(plan, s).recv_rows(rank) for s in sources])
        order = np.argsort(rows, kind="stable")
        _memo(plan)[key] = None if np.array_equal(order, np.arange(order.size)) else torch.from_numpy(order)
    return _memo(plan)[key]


def plan_digest(plan: Plan) -> int:
    """A 63-bit digest of the plan's JSON: equal on every rank that holds the same plan."""
    memo = _memo(plan)
    if "digest" not in memo:
        memo["digest"] = int.from_bytes(hashlib.sha256(plan.to_json().encode()).digest()[:8], "little") >> 1
    return memo["digest"]


# ---- planning ahead ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PreparedPlan:
    """One rank's planning of a mask, done ahead: the plan (the same on every rank), and for
    `rank` the mask of each kernel call (`kernel_calls` order) with its kernels' schedules as
    tensors (`PreparedMask`), each call's key order as runs of consecutive buffer rows ([R, 2]
    begin, end; None where the keys are in order already: a few hundred runs where the order
    has hundreds of thousands of rows), each stage's GroupCast tables and the plan's digest (what the ranks
    compare). It pickles across a DataLoader's worker boundary; with `pin_memory=True` the
    DataLoader's pin-memory thread checks the schedules' signatures beside the step."""

    plan: Plan
    rank: int
    calls: tuple[PreparedMask, ...]
    key_runs: tuple[np.ndarray | None, ...]
    stage_tables: tuple[CommTables, ...]
    digest: int

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan):
            raise MaskcError(f"PreparedPlan.plan is a maskc.dist.Plan, got {type(self.plan).__name__}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.plan.cp_size:
            raise MaskcError(f"PreparedPlan.rank is a rank of the plan's {self.plan.cp_size}, got {self.rank!r}")
        count, stages = len(kernel_calls(self.plan)), self.plan.stages.num_stages
        for name, value, n, kind in (("calls", self.calls, count, PreparedMask), ("stage_tables", self.stage_tables, stages, CommTables)):
            if not isinstance(value, tuple) or len(value) != n or not all(isinstance(v, kind) for v in value):
                raise MaskcError(f"PreparedPlan.{name} is a tuple of {n} {kind.__name__} (maskc.dist.prepare_plan)")
        if not isinstance(self.key_runs, tuple) or len(self.key_runs) != count or not all(
            o is None or (isinstance(o, np.ndarray) and o.dtype == np.int64 and o.ndim == 2 and o.shape[1] == 2)
            for o in self.key_runs
        ):
            raise MaskcError(f"PreparedPlan.key_runs is a tuple of {count} int64 [R, 2] arrays or None (maskc.dist.prepare_plan)")

    def __reduce__(self) -> tuple:
        """Numpy arrays and plain values only, so that it crosses a DataLoader's queue in one
        message: each torch tensor would cross as shared memory of its own, a file descriptor
        passed per tensor (at 128k tokens the step waited 7-13 ms for them where it now waits
        2-5), and the plan's Mask would bring its caches along."""
        plan = {f.name: getattr(self.plan, f.name) for f in fields(Plan) if f.name != "mask"}
        mask = (self.plan.mask.q_ranges, self.plan.mask.k_ranges, self.plan.mask.types, *self.plan.mask.shape)
        calls = tuple((c.table.numpy(), c.plan.numpy()) for c in self.calls)
        return _unpickle_prepared, (mask, plan, self.rank, calls, self.key_runs, self.stage_tables, self.digest)

    def pin_memory(self) -> PreparedPlan:
        """Pinned copies of its calls' tensors, their schedules' signatures checked now
        (`PreparedMask.pin_memory`): what a DataLoader with `pin_memory=True` calls in its
        pin-memory thread."""
        return PreparedPlan(self.plan, self.rank, tuple(c.pin_memory() for c in self.calls), self.key_runs, self.stage_tables,
                            self.digest)  # fmt: skip


def _unpickle_prepared(
    mask: tuple, plan: dict[str, Any], rank: int, calls: tuple, runs: tuple, tables: tuple[CommTables, ...], digest: int
) -> PreparedPlan:
    """A PreparedPlan from `PreparedPlan.__reduce__`'s parts."""
    masks = tuple(PreparedMask(torch.from_numpy(table), torch.from_numpy(records)) for table, records in calls)
    return PreparedPlan(Plan(Mask.from_arrays(*mask), **plan), rank, masks, runs, tables, digest)


def _runs(order: torch.Tensor | None) -> np.ndarray | None:
    """An index as [R, 2] runs of consecutive values (begin, end), which `installed` expands again."""
    if order is None:
        return None
    values = order.numpy()
    first = np.flatnonzero(np.diff(values, prepend=values[:1] - 2) != 1)
    last = np.r_[first[1:], values.size] - 1
    return np.stack([values[first], values[last] + 1], axis=1)


def prepare_plan(
    mask: Mask | PreparedMask,
    cp_size: int,
    rank: int,
    target: call_plan.Target | None,
    *,
    chunk_size: int | None = None,
    algorithm: str = "swap",
    num_stages: int | None = None,
    cost: CostModel | None = None,
    fuse_local: bool | None = None,
    backward: bool = True,
) -> PreparedPlan:
    """`make_plan(mask, cp_size, ...)` and everything `rank` derives from it to run it, with
    its kernels' schedules for `target` (`maskc.target_for`; None: none, for CPU runs), the
    backward's too with `backward`: the host work of a new mask under context parallelism, for
    a DataLoader worker of each rank to do ahead of the step."""
    plan = make_plan(mask, cp_size, chunk_size, algorithm=algorithm, num_stages=num_stages, cost=cost, fuse_local=fuse_local)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < plan.cp_size:
        raise MaskcError(f"rank must be an int in [0, {plan.cp_size}), got {rank!r}")
    rank = int(rank)
    calls = kernel_calls(plan)
    return PreparedPlan(
        plan,
        rank,
        tuple(prepare(local_mask(plan, rank, *sources), target, backward=backward) for sources in calls),
        tuple(_runs(key_positions(plan, rank, sources)) for sources in calls),
        tuple(stage_tables(plan, i) for i in range(plan.stages.num_stages)),
        plan_digest(plan),
    )


def installed(plan: Plan | PreparedPlan) -> tuple[Plan, int | None]:
    """The plan of a Plan or PreparedPlan, and the rank it was prepared for (None for a Plan).
    A PreparedPlan's parts join its plan's memo the first time, where the runtime looks them up
    (its schedules join each call mask's memo, `maskc.runtime.masks.mask_of`)."""
    if isinstance(plan, Plan):
        return plan, None
    if not isinstance(plan, PreparedPlan):
        raise MaskcError(f"expected a maskc.dist Plan or PreparedPlan, got {type(plan).__name__}")
    memo = _memo(plan.plan)
    if ("installed", plan.rank) not in memo:
        memo.setdefault("digest", plan.digest)
        for i, tables in enumerate(plan.stage_tables):
            memo.setdefault(("stage_tables", i), tables)
        for sources, call, runs in zip(kernel_calls(plan.plan), plan.calls, plan.key_runs):
            memo.setdefault(("local_mask", plan.rank, sources), as_mask(call))
            memo.setdefault(("key_order", plan.rank, sources), None if runs is None else torch.from_numpy(expand_spans(runs[:, 0], runs[:, 1] - 1)[1]))
        memo[("installed", plan.rank)] = True
    return plan.plan, plan.rank


@dataclass(frozen=True)
class PlanningCollate:
    """A DataLoader `collate_fn` that plans each batch for one rank where the batch is made, in
    the loader's worker: the batch of `collate` (a dict), with `prepare_plan(mask_of(batch),
    cp_size, rank, target)` under `key`. With `num_workers` >= 1 the workers plan the next
    batches while the training step runs; `mask_of` and `collate` must pickle (module-level
    functions) where the loader's workers are spawned."""

    mask_of: Callable[[dict[str, Any]], Mask]
    cp_size: int
    rank: int
    target: call_plan.Target | None
    collate: Callable[[list[Any]], dict[str, Any]] = default_collate
    key: str = "cp_plan"

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        batch = self.collate(samples)
        if not isinstance(batch, dict):
            raise MaskcError(f"PlanningCollate's collate must make a dict batch (the plan joins it as {self.key!r}), "
                             f"got {type(batch).__name__}")  # fmt: skip
        return {**batch, self.key: prepare_plan(self.mask_of(batch), self.cp_size, self.rank, self.target)}
