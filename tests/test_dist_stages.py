"""Overlap stages: piece areas against key ranges, the stage split, and the modelled schedule,
all against brute force over dense masks and against hand computations."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import masks

from maskc.dist.pieces import cut
from maskc.dist.stages import DIRECTIONS, CostModel, StagePlan, critical_path, plan_stages, split_stages
from maskc.errors import MaskError, MaskParamError
from maskc.ir import Mask

# Every unit 1: a pair costs 1 s forward and backward, a row 5 s on the wire, 1 s per collective,
# and an extra kernel call nothing.
UNIT = CostModel(1, 1, 1, 5, fwd_flops=4, bwd_flops=10, bwd_work=2.5, bandwidth=2, latency=1, launch=0,
                 memory_bandwidth=math.inf)  # fmt: skip
# UNIT with a call overhead: 1 s of launch and 1 byte per 1/8 s of HBM; with the tiny problem's
# 8 rows per rank (one head of one element), a call adds 1 + 8 * 13 / 8 = 14 s forward (merge:
# 8 + 5 bytes per element) and 1 + 8 * 10 / 8 = 11 s backward (preprocess: 2 x 5 bytes).
CALLS = replace(UNIT, launch=1, memory_bandwidth=8)


def runs(flags: np.ndarray) -> np.ndarray:
    """The [begin, end) runs of True in a bool vector, as [R, 2]."""
    edges = np.diff(np.r_[0, flags.astype(np.int8), 0])
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1)


def rows_of(ranges: np.ndarray) -> list[int]:
    return [k for a, b in ranges.tolist() for k in range(a, b)]


@st.composite
def problems(draw) -> tuple[Mask, int, np.ndarray, int]:
    """A mask, a chunk size, and chunks dealt equally (at random) to cp ranks."""
    mask = draw(masks(max_len=40, max_slices=6))
    chunk_size = draw(st.sampled_from([1, 3, 5, 8]))
    cp = draw(st.integers(1, 4))
    per_rank = max(1, -(-max(mask.seqlen_q, mask.seqlen_k) // (chunk_size * cp)))
    rank_of_chunk = np.array(draw(st.permutations(np.repeat(np.arange(cp), per_rank).tolist())), dtype=np.int64)
    return mask, chunk_size, rank_of_chunk, cp


def query_rows(rank_of_chunk: np.ndarray, rank: int, chunk_size: int, span: int) -> np.ndarray:
    return np.flatnonzero(rank_of_chunk[np.arange(span) // chunk_size] == rank)


def dense_remote(dense: np.ndarray, rank_of_chunk: np.ndarray, cp: int, chunk_size: int) -> list[np.ndarray]:
    """Keys the rank's query rows attend to, minus its own rows, from the dense mask."""
    span = rank_of_chunk.size * chunk_size
    out = []
    for r in range(cp):
        own = query_rows(rank_of_chunk, r, chunk_size, span)
        needed = np.zeros(span, dtype=bool)
        needed[: dense.shape[1]] = dense[own[own < dense.shape[0]]].any(axis=0)
        needed[own] = False
        out.append(runs(needed))
    return out


def padded(mask: Mask, span: int) -> np.ndarray:
    dense = np.zeros((span, span), dtype=bool)
    dense[: mask.seqlen_q, : mask.seqlen_k] = mask.to_dense().numpy()
    return dense


# ---- Pieces.areas_within ------------------------------------------------------------------


def line_pairs(pieces, p: int, k0: int, k1: int) -> int:
    """Pairs of piece p with key in [k0, k1), row by row and key by key."""
    return sum(
        1
        for r in range(pieces.r0[p], pieces.r1[p])
        for k in range(pieces.lo_a[p] + pieces.lo_s[p] * r, pieces.hi_a[p] + pieces.hi_s[p] * r + 1)
        if k0 <= k < k1
    )


@given(masks(max_len=40, max_slices=6), st.sampled_from([1, 3, 7, 16]), st.data())
@settings(max_examples=200, deadline=None)
def test_areas_within_matches_brute_force(mask: Mask, chunk_size: int, data: st.DataObject) -> None:
    pieces = cut(mask, chunk_size)
    n = len(pieces)
    bounds = st.lists(st.integers(-3, 45), min_size=n, max_size=n)
    k0, k1 = np.array(data.draw(bounds), dtype=np.int64), np.array(data.draw(bounds), dtype=np.int64)
    lo, hi = data.draw(st.integers(-3, 45)), data.draw(st.integers(-3, 45))
    assert pieces.areas_within(k0, k1).tolist() == [line_pairs(pieces, p, k0[p], k1[p]) for p in range(n)]
    assert pieces.areas_within(lo, hi).tolist() == [line_pairs(pieces, p, lo, hi) for p in range(n)]
    assert pieces.areas_within(lo, hi).dtype == np.int64
    assert np.array_equal(pieces.areas_within(-(10**9), 10**9), pieces.areas())
    # The pieces tile the mask, so their pairs within [lo, hi) are the dense mask's columns.
    assert int(pieces.areas_within(lo, hi).sum()) == int(mask.to_dense()[:, max(lo, 0) : max(hi, 0)].sum())


# ---- split_stages ---------------------------------------------------------------------------


@st.composite
def remote_ranges(draw) -> np.ndarray:
    cuts = sorted(set(draw(st.lists(st.integers(0, 60), max_size=12))))
    pairs = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


@given(remote_ranges(), st.integers(1, 9))
@settings(max_examples=300, deadline=None)
def test_split_stages_covers_the_rows_in_order_and_balanced(remote: np.ndarray, n: int) -> None:
    stages = split_stages(remote, n)
    assert len(stages) == n
    assert sum((rows_of(s) for s in stages), []) == rows_of(remote)
    counts = [len(rows_of(s)) for s in stages]
    total = len(rows_of(remote))
    assert counts == [(i + 1) * total // n - i * total // n for i in range(n)]
    assert max(counts) - min(counts) <= 1
    assert (0 in counts) == (total < n)
    for s in stages:
        assert s.dtype == np.int64 and s.shape == (len(s), 2)
        assert np.all(s[:, 1] > s[:, 0])
        # Each piece lies inside one remote range; a stage cuts no range it need not.
        assert all(any(a <= x and y <= b for a, b in remote.tolist()) for x, y in s.tolist())
        assert len(s) <= len(remote)


def test_split_stages_cuts_ranges_at_equal_row_counts() -> None:
    stages = split_stages(np.array([[0, 4], [10, 13], [20, 30]]), 3)
    # 17 rows: stages of 5, 6, 6 (cuts at rows 5 and 11).
    assert [s.tolist() for s in stages] == [[[0, 4], [10, 11]], [[11, 13], [20, 24]], [[24, 30]]]
    assert [s.tolist() for s in split_stages(np.array([[5, 7]]), 3)] == [[], [[5, 6]], [[6, 7]]]
    assert [s.shape for s in split_stages(np.zeros((0, 2), dtype=np.int64), 2)] == [(0, 2), (0, 2)]


@pytest.mark.parametrize(
    "remote, message",
    [
        (np.array([[3, 5], [4, 8]]), "sorted, disjoint"),
        (np.array([[6, 8], [0, 2]]), "sorted, disjoint"),
        (np.array([[2, 2]]), "non-empty"),
        (np.array([[-1, 2]]), "rows >= 0"),
        (np.array([[0.0, 2.0]]), "int array"),
        (np.array([0, 2, 4]), r"shape \[R, 2\]"),
    ],
)
def test_split_stages_rejects_bad_ranges(remote: np.ndarray, message: str) -> None:
    with pytest.raises(MaskError, match=message):
        split_stages(remote, 2)


def test_split_stages_rejects_bad_counts() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(MaskParamError, match="num_stages must be a positive int"):
            split_stages(np.array([[0, 4]]), bad)


# ---- the plan against brute force ---------------------------------------------------------


def longest_path_by_hand(dag: nx.DiGraph) -> float:
    finish: dict = {}
    for v in nx.topological_sort(dag):
        finish[v] = dag.nodes[v]["duration"] + max((finish[u] for u in dag.predecessors(v)), default=0.0)
    return max(finish.values(), default=0.0)


@given(problems(), st.integers(1, 5), st.sampled_from([UNIT, CALLS, CostModel()]), st.booleans())
@settings(max_examples=150, deadline=None)
def test_plan_matches_brute_force(problem: tuple, n: int, cost: CostModel, fuse: bool) -> None:
    mask, chunk_size, rank_of_chunk, cp = problem
    span = rank_of_chunk.size * chunk_size
    dense = padded(mask, span)
    remote = dense_remote(dense, rank_of_chunk, cp, chunk_size)
    plan = plan_stages(cut(mask, chunk_size), rank_of_chunk, cp, remote, cost, n, chunk_size=chunk_size, fuse_local=fuse)
    assert plan.num_stages == n and plan.cp_size == cp and plan.fuse_local is fuse
    assert [(k, u) for k, u, _, _ in plan.scan] == [(n, fuse)]
    assert plan.rows_per_rank == span // cp
    owner = rank_of_chunk[np.arange(span) // chunk_size]
    busiest = np.zeros(n, dtype=np.int64)
    for r in range(cp):
        rows = query_rows(rank_of_chunk, r, chunk_size, span)
        assert plan.pairs[r, 0] == dense[np.ix_(rows, rows)].sum()
        stages = [plan.stage_ranges(r, i) for i in range(n)]
        assert [s.tolist() for s in stages] == [s.tolist() for s in split_stages(remote[r], n)]
        for i, s in enumerate(stages):
            keys = rows_of(s)
            assert plan.pairs[r, i + 1] == dense[np.ix_(rows, keys)].sum()
            busiest[i] = max(busiest[i], len(keys))
    for i in range(n):
        for o in range(cp):  # rows of rank o's chunks that any rank fetches in stage i
            sent = sum(int((owner[rows_of(plan.stage_ranges(r, i))] == o).sum()) for r in range(cp))
            busiest[i] = max(busiest[i], sent)
    assert plan.stage_rows.tolist() == busiest.tolist()
    assert plan.pairs.sum() == dense.sum()

    # Calls: the local one (with stage 1's keys when fused) and one per other stage with work.
    calls = plan.pairs[:, 1:] > 0
    calls[:, 0] &= not fuse
    for direction, time in (("fwd", plan.time_fwd), ("bwd", plan.time_bwd)):
        durations = plan.compute_time(direction)
        assert durations.shape == (cp, n + 1)
        pure = cost.compute_time(plan.pairs.sum(axis=1), direction)
        overhead = cost.call_overhead(plan.rows_per_rank, direction)
        assert durations.sum(axis=1) == pytest.approx(pure + calls.sum(axis=1) * overhead, rel=1e-12, abs=1e-15)
        assert (durations[:, 1:] > 0).tolist() == calls.tolist()

        dag = plan.dag(direction)
        assert nx.is_directed_acyclic_graph(dag)
        # Every rank's calls in the runtime's order; forward the local call first, backward last
        # (fused: stage 1 right after it, at no cost).
        order = [0, *range(1, n + 1)] if direction == "fwd" else [*range(2, n + 1), 0, 1] if fuse else [*range(1, n + 1), 0]
        assert all(dag.has_edge(("compute", r, a), ("compute", r, b)) for r in range(cp) for a, b in zip(order, order[1:]))
        assert all(dag.nodes["compute", r, i]["duration"] == durations[r, i] for r in range(cp) for i in range(n + 1))
        assert dag.number_of_nodes() == cp * (n + 1) + n
        if direction == "fwd":
            stream = [("fetch", i) for i in range(1, n + 1)]
            assert not any(v[0] == "reduce" for v in dag)
            assert all(dag.has_edge(("fetch", i), ("compute", r, i)) for r in range(cp) for i in range(1, n + 1))
            assert all(dag.has_edge(("fetch", 1), ("compute", r, 0)) == fuse for r in range(cp))
            # Compute chains, fetch -> compute on every rank, the fetch stream (and fetch_1 -> local).
            assert dag.number_of_edges() == cp * n + cp * n + n - 1 + (cp if fuse else 0)
        else:
            stream = [("reduce", i) for i in order if i]
            assert not any(v[0] == "fetch" for v in dag)  # the keys stay from the forward
            assert all(dag.has_edge(("compute", r, i), ("reduce", i)) for r in range(cp) for i in range(1, n + 1))
            assert dag.number_of_edges() == cp * n + cp * n + n - 1
        assert all(dag.has_edge(u, v) for u, v in zip(stream, stream[1:]))
        assert all(dag.nodes[v]["duration"] == plan.comm_time()[v[1] - 1] for v in stream)
        length, path = critical_path(dag)
        assert length == pytest.approx(time, rel=1e-12, abs=1e-15)
        assert longest_path_by_hand(dag) == pytest.approx(time, rel=1e-12, abs=1e-15)
        assert sum(dag.nodes[v]["duration"] for v in path) == pytest.approx(length)
        assert all(dag.has_edge(u, v) for u, v in zip(path, path[1:]))


@given(
    st.integers(1, 6), st.integers(1, 8), st.booleans(), st.integers(0, 2**32 - 1),
    st.floats(1e-7, 1e-3), st.floats(0, 1e-4), st.floats(1e9, 1e13),
)
@settings(max_examples=200, deadline=None)
def test_modelled_times_are_the_dags_longest_paths_exactly(
    cp: int, n: int, fuse: bool, seed: int, latency: float, launch: float, bandwidth: float
) -> None:
    """time_fwd / time_bwd (a recurrence) are the very floats a walk of the unfolded task DAG
    gives, for random work, rows (empty stages too) and costs: the stage scan compares them to
    1e-9, so the recurrence must not round differently."""
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, 10**9, size=(cp, n + 1)) * rng.integers(0, 2, size=(cp, n + 1))
    stage_rows = rng.integers(0, 10**5, size=n) * rng.integers(0, 2, size=n)
    cost = CostModel(latency=latency, launch=launch, bandwidth=bandwidth, memory_bandwidth=bandwidth * 3)
    plan = StagePlan(n, np.zeros((0, 2), np.int64), np.zeros(cp * n + 1, np.int64), pairs, stage_rows, cost,
                     int(rng.integers(1, 10**5)), fuse)  # fmt: skip
    assert plan.time_fwd == longest_path_by_hand(plan.dag("fwd"))
    assert plan.time_bwd == longest_path_by_hand(plan.dag("bwd"))


@pytest.mark.parametrize("fuse", [False, True])
def test_stream_orders(fuse: bool) -> None:
    plan = tiny_plan(3, fuse_local=fuse)
    fwd, bwd = plan.dag("fwd"), plan.dag("bwd")
    assert all(fwd.has_edge(("fetch", i), ("fetch", i + 1)) for i in (1, 2))
    local = {("compute", r, 0) for r in (0, 1)}
    assert {v for v in fwd if fwd.in_degree(v) == 0} == {("fetch", 1)} | (set() if fuse else local)
    calls = [2, 3, 0, 1] if fuse else [1, 2, 3, 0]
    reduces = [("reduce", i) for i in calls if i]
    assert all(bwd.has_edge(u, v) for u, v in zip(reduces, reduces[1:]))
    assert all(bwd.has_edge(("compute", r, a), ("compute", r, b)) for r in (0, 1) for a, b in zip(calls, calls[1:]))
    assert {v for v in bwd if bwd.in_degree(v) == 0} == {("compute", r, calls[0]) for r in (0, 1)}
    # Fused, the last call is stage 1's (the fused one's tail) and its reduce ends the backward.
    assert {v for v in bwd if bwd.out_degree(v) == 0} == {reduces[-1]} | (set() if fuse else local)


# ---- hand computations -------------------------------------------------------------------


def tiny_problem() -> tuple:
    """16 causal tokens in chunks of 4 dealt 0, 1, 1, 0: rank 0 owns rows 0-3 and 12-15 and
    fetches keys [4, 12); rank 1 owns rows 4-11 and fetches keys [0, 4)."""
    mask = Mask.from_cu_seqlens([0, 16], causal=True)
    rank_of_chunk = np.array([0, 1, 1, 0])
    remote = [np.array([[4, 12]]), np.array([[0, 4]])]
    return cut(mask, 4), rank_of_chunk, 2, remote


def tiny_plan(n: int | None, cost: CostModel = UNIT, max_stages: int = 8, fuse_local: bool | None = None) -> StagePlan:
    pieces, rank_of_chunk, cp, remote = tiny_problem()
    return plan_stages(pieces, rank_of_chunk, cp, remote, cost, n, max_stages, chunk_size=4, fuse_local=fuse_local)


def test_one_and_two_stages_by_hand() -> None:
    one = tiny_plan(1, fuse_local=False)
    # Local: rank 0 has 10 + 16 + 10 pairs, rank 1 36; remote 4 rows x 8 keys and 8 rows x 4 keys.
    assert one.pairs.tolist() == [[36, 32], [36, 32]] and one.rows_per_rank == 8
    # Rank 0 receives 8 rows (and sends 4), rank 1 the reverse: 1 s + 8 rows * 5 s.
    assert one.stage_rows.tolist() == [8] and one.comm_time().tolist() == [41.0]
    assert one.time_fwd == 41 + 32  # the fetch outlasts the local 36 s
    # Backward: stage 1 (0-32), then the local call (32-68) while the reduce runs (32-73).
    assert one.time_bwd == 32 + 41

    two = tiny_plan(2, fuse_local=False)
    assert [two.stage_ranges(0, i).tolist() for i in (0, 1)] == [[[4, 8]], [[8, 12]]]
    assert [two.stage_ranges(1, i).tolist() for i in (0, 1)] == [[[0, 2]], [[2, 4]]]
    assert two.pairs.tolist() == [[36, 16, 16], [36, 16, 16]]
    assert two.comm_time().tolist() == [21.0, 21.0]
    # fetch 1: 0-21, fetch 2: 21-42; compute: local 0-36, stage 1 36-52, stage 2 52-68.
    assert two.time_fwd == 68
    # Backward: stage 1 0-16, stage 2 16-32, local 32-68; reduce 1 16-37, reduce 2 37-58.
    assert two.time_bwd == 68

    chosen = tiny_plan(None, max_stages=2)
    assert (chosen.num_stages, chosen.fuse_local) == (2, False)
    assert chosen.scan == ((1, False, 73.0, 73.0), (1, True, 109.0, 109.0), (2, False, 68.0, 68.0), (2, True, 89.0, 89.0))
    assert chosen.time == 136


def test_fused_local_by_hand() -> None:
    one = tiny_plan(1, fuse_local=True)
    # Stage 1's 32 pairs run in the local call: one 68 s call, nothing in stage 1's column.
    assert one.compute_time("fwd").tolist() == [[68.0, 0.0]] * 2 == one.compute_time("bwd").tolist()
    assert one.time_fwd == 41 + 68  # the fetch first, then the fused call
    assert one.time_bwd == 68 + 41  # the fused call, then the reduce of stage 1's dK/dV
    assert one.time == one.scan[0][2] + one.scan[0][3] and one.scan == ((1, True, 109.0, 109.0),)

    two = tiny_plan(2, fuse_local=True)
    assert two.compute_time("fwd").tolist() == [[52.0, 0.0, 16.0]] * 2
    # fetch 1 0-21 then the fused call 21-73; fetch 2 21-42, stage 2 73-89.
    assert two.time_fwd == 89
    # Backward: stage 2 0-16, fused call 16-68; reduce 2 16-37, reduce 1 after the fused call 68-89.
    assert two.time_bwd == 89
    assert [v for v in nx.topological_sort(two.dag("bwd")) if v[0] == "reduce"] == [("reduce", 2), ("reduce", 1)]


def test_call_overhead_by_hand() -> None:
    assert (CALLS.call_overhead(8, "fwd"), CALLS.call_overhead(8, "bwd")) == (14.0, 11.0)
    assert CALLS.call_overhead(0, "fwd") == 1.0  # the launch alone
    one, two = tiny_plan(1, CALLS, fuse_local=False), tiny_plan(2, CALLS, fuse_local=False)
    assert one.compute_time("fwd").tolist() == [[36.0, 32.0 + 14]] * 2
    assert one.compute_time("bwd").tolist() == [[36.0, 32.0 + 11]] * 2
    # Forward: fetch 0-41, stage 1 41-87. Backward: stage 1 0-43, local 43-79, reduce 43-84.
    assert (one.time_fwd, one.time_bwd) == (87, 84)
    assert two.compute_time("fwd").tolist() == [[36.0, 30.0, 30.0]] * 2
    # Forward: local 0-36, stage 1 36-66, stage 2 66-96. Backward: stage 1 0-27, stage 2 27-54,
    # local 54-90; reduce 1 27-48, reduce 2 54-75.
    assert (two.time_fwd, two.time_bwd) == (96, 90)
    # Fused, one stage makes one call: no overhead, the same 109 s as without it.
    fused_one = tiny_plan(1, CALLS, fuse_local=True)
    assert (fused_one.time_fwd, fused_one.time_bwd) == (109, 109)
    fused = tiny_plan(2, CALLS, fuse_local=True)
    assert fused.compute_time("bwd").tolist() == [[52.0, 0.0, 27.0]] * 2
    assert (fused.time_fwd, fused.time_bwd) == (103, 100)
    # The second stage's call costs more than the overlap it buys: one stage now wins.
    chosen = tiny_plan(None, CALLS, max_stages=2)
    assert (chosen.num_stages, chosen.fuse_local, chosen.time) == (1, False, 171)
    assert [(n, u, f + b) for n, u, f, b in chosen.scan] == [(1, False, 171), (1, True, 218), (2, False, 186), (2, True, 203)]


def test_defaults_describe_an_h200_and_a_64_head_gqa_model() -> None:
    cost = CostModel()
    assert cost.flops_per_pair == 4 * 64 * 128
    assert cost.bytes_per_row == 2 * 8 * 128 * 2
    assert cost.compute_time(np.array([1e12]), "fwd")[0] == pytest.approx(1e12 * 4 * 64 * 128 / 550e12)
    assert cost.compute_time(np.array([1e12]), "bwd")[0] == pytest.approx(2.5 * 1e12 * 4 * 64 * 128 / 450e12)
    assert cost.comm_time(np.array([0, 1000])).tolist() == pytest.approx([0.0, 20e-6 + 1000 * 4096 / 220e9])
    # An extra call: 20 us, and a pass over 16k rows of 64 x 128 elements at 1 TB/s: merging a
    # bf16 part into a float32 output (10 bytes per element) forward, O and dO (4 bytes) backward.
    assert cost.call_overhead(16384, "fwd") == pytest.approx(20e-6 + 16384 * 64 * 128 * 10 / 1e12)
    assert cost.call_overhead(16384, "bwd") == pytest.approx(20e-6 + 16384 * 64 * 128 * 4 / 1e12)
    assert CostModel(dtype_bytes=4).call_overhead(1000, "fwd") == pytest.approx(20e-6 + 1000 * 64 * 128 * 12 / 1e12)


# ---- limits of the model -------------------------------------------------------------------


def varlen_problem(cp: int = 4, chunk_size: int = 64) -> tuple:
    mask = Mask.from_cu_seqlens([0, 300, 1000, 1150, 2050, 4000, 4096], causal=True)
    num_chunks = 4096 // chunk_size
    position = np.arange(num_chunks) % cp
    rank_of_chunk = np.where(np.arange(num_chunks) // cp % 2 == 0, position, cp - 1 - position)
    remote = dense_remote(mask.to_dense().numpy(), rank_of_chunk, cp, chunk_size)
    return cut(mask, chunk_size), rank_of_chunk, cp, remote, chunk_size


def full_problem() -> tuple:
    """4096 tokens of full attention over 4 ranks in chunks of 256 dealt in order: each rank
    has 1024 x 1024 local pairs (62 us forward at the defaults, more than a call's overhead) and
    fetches the other 3072 keys."""
    mask = Mask.from_cu_seqlens([0, 4096])
    rank_of_chunk = np.repeat(np.arange(4), 4)
    remote = dense_remote(mask.to_dense().numpy(), rank_of_chunk, 4, 256)
    return cut(mask, 256), rank_of_chunk, 4, remote, 256


def test_infinite_bandwidth_and_free_calls_make_time_the_compute() -> None:
    pieces, rank_of_chunk, cp, remote, chunk_size = varlen_problem()
    free = CostModel(bandwidth=math.inf, latency=0.0, launch=0.0, memory_bandwidth=math.inf)
    plan = plan_stages(pieces, rank_of_chunk, cp, remote, free, chunk_size=chunk_size)
    assert [(n, u) for n, u, _, _ in plan.scan] == [(n, u) for n in range(1, 9) for u in (False, True)]
    assert (plan.num_stages, plan.fuse_local) == (1, False)  # all tie; fewer stages, then unfused, win
    for k, direction in ((2, "fwd"), (3, "bwd")):
        compute = free.compute_time(plan.pairs.sum(axis=1), direction).max()
        assert [entry[k] for entry in plan.scan] == pytest.approx([compute] * 16, rel=1e-12)


@pytest.mark.parametrize("problem", [varlen_problem, full_problem])
def test_small_communication_fuses_the_local_call(problem) -> None:
    pieces, rank_of_chunk, cp, remote, chunk_size = problem()
    # A free link: one fused call is the compute alone; every other variant makes more calls.
    free = CostModel(bandwidth=math.inf, latency=0.0)
    plan = plan_stages(pieces, rank_of_chunk, cp, remote, free, chunk_size=chunk_size)
    assert (plan.num_stages, plan.fuse_local) == (1, True)
    for direction, time in (("fwd", plan.time_fwd), ("bwd", plan.time_bwd)):
        assert time == pytest.approx(free.compute_time(plan.pairs.sum(axis=1), direction).max(), rel=1e-12)
    assert all(f + b > plan.time * (1 + 1e-6) for n, u, f, b in plan.scan if (n, u) != (1, True))
    # Nearly free (1 us per collective, a huge link): the fetch it exposes costs less than a call.
    tiny = CostModel(bandwidth=1e15, latency=1e-6)
    plan = plan_stages(pieces, rank_of_chunk, cp, remote, tiny, chunk_size=chunk_size)
    assert (plan.num_stages, plan.fuse_local) == (1, True)


def test_huge_communication_keeps_the_local_call_apart() -> None:
    pieces, rank_of_chunk, cp, remote, chunk_size = full_problem()
    slow = CostModel(bandwidth=1e3, memory_bandwidth=3e12)  # a call costs less than the small local work
    plan = plan_stages(pieces, rank_of_chunk, cp, remote, slow, chunk_size=chunk_size)
    assert not plan.fuse_local
    # At one stage the fused call waits for all keys; the unfused local call hides behind them,
    # so fusing costs the local call's time less the call overhead it saves, in each direction.
    one = {u: (f, b) for n, u, f, b in plan.scan if n == 1}
    pairs = plan_stages(pieces, rank_of_chunk, cp, remote, slow, 1, chunk_size=chunk_size).pairs
    for k, direction in enumerate(DIRECTIONS):
        pure = slow.compute_time(pairs, direction)
        expected = pure.sum(axis=1).max() - (pure[:, 1] + slow.call_overhead(1024, direction)).max()
        assert expected > 1e-5 and one[True][k] - one[False][k] == pytest.approx(expected, rel=1e-6)


def test_huge_communication_makes_time_the_communication() -> None:
    pieces, rank_of_chunk, cp, remote, chunk_size = varlen_problem()
    slow = CostModel(bandwidth=1e3)
    for n in (1, 3, 8):
        for fuse in (False, True):
            plan = plan_stages(pieces, rank_of_chunk, cp, remote, slow, n, chunk_size=chunk_size, fuse_local=fuse)
            comm = plan.comm_time().sum()
            assert comm > 1e3 * plan.compute_time("bwd").sum()
            assert comm <= plan.time_fwd <= comm * (1 + 1e-3)
            assert comm <= plan.time_bwd <= comm * (1 + 1e-3)  # reduces only: the keys stay from the forward


@pytest.mark.parametrize("fuse", [False, None])
def test_call_overhead_means_fewer_stages(fuse: bool | None) -> None:
    pieces, rank_of_chunk, cp, remote, chunk_size = varlen_problem()
    free_calls = CostModel(launch=0.0, memory_bandwidth=math.inf)
    plan = plan_stages(pieces, rank_of_chunk, cp, remote, CostModel(), chunk_size=chunk_size, fuse_local=fuse)
    free = plan_stages(pieces, rank_of_chunk, cp, remote, free_calls, chunk_size=chunk_size, fuse_local=fuse)
    assert plan.num_stages < free.num_stages
    # Calls for free, the stages hide communication: more stages, less time, up to a point.
    total = {(n, u): f + b for n, u, f, b in free.scan}
    assert free.time == pytest.approx(min(total.values()), rel=1e-9) and free.time < total[1, False]


def test_no_remote_traffic_picks_one_stage() -> None:
    # Documents aligned to chunks, each chunk on its own: nobody needs another rank's keys.
    mask = Mask.from_cu_seqlens([0, 8, 16, 24, 32], causal=True)
    rank_of_chunk = np.array([0, 1, 1, 0])
    remote = [np.zeros((0, 2), dtype=np.int64)] * 2
    plan = plan_stages(cut(mask, 8), rank_of_chunk, 2, remote, CostModel(), chunk_size=8)
    assert (plan.num_stages, plan.fuse_local) == (1, False) and len(plan.scan) == 16
    assert plan.stage_rows.tolist() == [0] and plan.comm_time().tolist() == [0.0]
    assert plan.pairs.tolist() == [[72, 0], [72, 0]]
    assert plan.time_fwd == pytest.approx(plan.compute_time("fwd")[:, 0].max())
    assert len({(f, b) for _, _, f, b in plan.scan}) == 1  # stages without work make no calls


# ---- round trip and bad inputs ---------------------------------------------------------------


@pytest.mark.parametrize("fuse", [False, True])
def test_to_dict_round_trips_through_json(fuse: bool) -> None:
    cost = CostModel(num_heads_q=32, bandwidth=1e9, launch=3e-6, memory_bandwidth=1e12)
    plan = tiny_plan(None, cost, fuse_local=fuse)
    data = json.loads(json.dumps(plan.to_dict()))
    assert (data["rows_per_rank"], data["fuse_local"]) == (8, fuse)
    assert data["cost"]["launch"] == 3e-6 and data["cost"]["memory_bandwidth"] == 1e12
    back = StagePlan.from_dict(data)
    for name in ("ranges", "offsets", "pairs", "stage_rows"):
        assert np.array_equal(getattr(back, name), getattr(plan, name))
    assert (back.num_stages, back.cost, back.scan) == (plan.num_stages, plan.cost, plan.scan)
    assert (back.rows_per_rank, back.fuse_local) == (8, fuse)
    assert all(isinstance(u, bool) and u is fuse for _, u, _, _ in back.scan)
    assert (back.time_fwd, back.time_bwd) == (plan.time_fwd, plan.time_bwd)
    assert back.to_dict() == plan.to_dict()
    assert not back.ranges.flags.writeable
    # The fields are read: with a second call, more rows cost more, and the other fusion other calls.
    two = tiny_plan(2, cost, fuse_local=fuse)
    assert StagePlan.from_dict({**two.to_dict(), "rows_per_rank": 8000}).time > two.time
    other = StagePlan.from_dict({**two.to_dict(), "fuse_local": not fuse}).compute_time("fwd")
    assert (other[:, 1] == 0).tolist() == [not fuse] * 2 and (two.compute_time("fwd")[:, 1] == 0).tolist() == [fuse] * 2


def test_from_dict_rejects_broken_plans() -> None:
    data = tiny_plan(2).to_dict()
    with pytest.raises(MaskError, match="not a StagePlan dict"):
        StagePlan.from_dict({k: v for k, v in data.items() if k != "pairs"})
    with pytest.raises(MaskError, match="inconsistent StagePlan"):
        StagePlan.from_dict({**data, "num_stages": 3})
    with pytest.raises(MaskError, match="inconsistent StagePlan"):
        StagePlan.from_dict({**data, "offsets": data["offsets"][::-1]})
    with pytest.raises(MaskParamError, match="bandwidth"):
        StagePlan.from_dict({**data, "cost": {**data["cost"], "bandwidth": -1.0}})
    for key in ("rows_per_rank", "fuse_local"):
        with pytest.raises(MaskError, match="not a StagePlan dict"):
            StagePlan.from_dict({k: v for k, v in data.items() if k != key})
    with pytest.raises(MaskError, match="not a StagePlan dict"):  # a scan of the older model
        StagePlan.from_dict({**data, "scan": [[2, 68.0, 94.0]]})
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(MaskParamError, match="rows_per_rank must be a non-negative int"):
            StagePlan.from_dict({**data, "rows_per_rank": bad})
    for bad in (1, "true", None):
        with pytest.raises(MaskParamError, match="fuse_local must be a bool"):
            StagePlan.from_dict({**data, "fuse_local": bad})
    with pytest.raises(MaskParamError, match="scan entry's fuse_local must be a bool"):
        StagePlan.from_dict({**data, "scan": [[2, 0, 68.0, 68.0]]})


def test_plan_stages_rejects_bad_inputs() -> None:
    pieces, rank_of_chunk, cp, remote = tiny_problem()

    def plan(**kw):
        args = dict(pieces=pieces, rank_of_chunk=rank_of_chunk, cp_size=cp, remote=remote, cost=UNIT, chunk_size=4)
        return plan_stages(**{**args, **kw})

    with pytest.raises(MaskError, match="equal chunk counts"):
        plan(rank_of_chunk=np.array([0, 0, 0, 1]))
    with pytest.raises(MaskError, match="outside"):
        plan(rank_of_chunk=np.array([0, 1, 2, 0]))
    with pytest.raises(MaskError, match="each of 2 ranks"):
        plan(remote=remote[:1])
    with pytest.raises(MaskError, match="misses keys that rank 0"):
        plan(remote=[np.array([[4, 11]]), remote[1]])
    with pytest.raises(MaskError, match=r"remote\[1\] holds rows of chunk 1, which rank 1 owns"):
        plan(remote=[remote[0], np.array([[0, 5]])])
    with pytest.raises(MaskError, match="reach past"):
        plan(remote=[np.array([[4, 12], [16, 20]]), remote[1]])
    with pytest.raises(MaskError, match="pieces reach past"):
        plan(chunk_size=2)
    with pytest.raises(MaskError, match="chunk_size"):
        plan(chunk_size=0)
    with pytest.raises(MaskParamError, match="max_stages"):
        plan(max_stages=0)
    with pytest.raises(MaskParamError, match="num_stages"):
        plan(num_stages=0)
    with pytest.raises(MaskParamError, match="cp_size"):
        plan(cp_size=0)
    with pytest.raises(MaskParamError, match="direction"):
        tiny_plan(1).dag("sideways")
    with pytest.raises(MaskParamError, match="no rank 2 stage 0"):
        tiny_plan(1).stage_ranges(2, 0)
    with pytest.raises(MaskParamError, match="head_dim"):
        CostModel(head_dim=0)
    with pytest.raises(MaskParamError, match="latency"):
        CostModel(latency=-1e-6)
    with pytest.raises(MaskParamError, match="fuse_local must be a bool"):
        plan(fuse_local="yes")
    with pytest.raises(MaskParamError, match="CostModel.launch must be a non-negative number"):
        CostModel(launch=-1e-6)
    for bad in (0.0, -1.0, math.nan, "3e12", True):
        with pytest.raises(MaskParamError, match="CostModel.memory_bandwidth must be a positive number"):
            CostModel(memory_bandwidth=bad)
    assert CostModel(launch=0.0).call_overhead(0, "bwd") == 0.0
    with pytest.raises(MaskParamError, match="direction"):
        CostModel().call_overhead(8, "up")
