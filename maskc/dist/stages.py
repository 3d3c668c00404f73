"""Overlap stages: each rank's remote key/value rows fetched in stages that hide behind compute.

A rank first attends its queries to its own keys (the local stage, no communication), then to
the remote keys of stage 1, 2, ... Stage i's keys arrive in an all-to-all-v that runs while
stage i-1 computes; in the backward each stage's dK/dV partials go back to their owners in a
second all-to-all-v that runs while the next stage computes (MagiAttention's schedule). More
stages hide more communication but pay one collective latency each; `plan_stages` models both
and keeps the count with the least modelled forward + backward time.

The model, per direction, is a DAG of tasks with durations whose longest path is the time:
- compute: area * FLOPs per pair / throughput, one stream per rank:
  local -> compute_1 -> ... -> compute_n;
- fetch_i (and reduce_i): one collective, so one task shared by all ranks, lasting
  latency + max over ranks of max(rows sent, rows received) * bytes per row / bandwidth
  (links are full duplex); a stage no rank moves a row in is skipped and costs nothing;
- fetch_i -> compute_i on every rank; in the backward compute_i of every rank -> reduce_i
  (the collective starts when the slowest rank has its partials).
Fetches and reduces share one communication stream, in the order fetch_1, fetch_2, reduce_1,
fetch_3, reduce_2, ..., fetch_n, reduce_n-1, reduce_n: MagiAttention issues them on separate
process groups, but both move bytes over the same NVLink ports in both directions, so running
them side by side would not move bytes faster; serialising them keeps the link honest, and
the order puts the next stage's keys ahead of the previous stage's gradients (compute waits
on keys; only the last reduce is on the way out anyway).
Since ranks meet only at the shared collectives, the DAG is kept folded: a compute node holds
one duration per rank, and `StagePlan.dag` unfolds it into one node per rank and stage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property, reduce
from typing import Literal

import networkx as nx
import numpy as np

from maskc.dist.pieces import Pieces
from maskc.errors import MaskError, MaskParamError
from maskc.ir.slices import expand_spans

Direction = Literal["fwd", "bwd"]
DIRECTIONS: tuple[Direction, ...] = ("fwd", "bwd")


@dataclass(frozen=True)
class CostModel:
    """Throughputs of one GPU and its links, and the attention problem's shape.

    Defaults: an H200-class GPU (dense attention at 550 TFLOP/s forward, 450 backward, bf16)
    on NVLink (150 GB/s per direction per rank for an all-to-all, 20 us per collective), and
    64 query heads, 8 key/value heads of dimension 128 in 2-byte elements. The backward does
    `bwd_work` (2.5) times the forward's FLOPs: scores recomputed, then dV, dP, dQ and dK.
    Calibrate by timing one attention kernel and one all-to-all and setting the throughputs
    (`bandwidth` in bytes/s per direction per rank, `latency` in s per collective).
    """

    num_heads_q: int = 64
    num_heads_kv: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    fwd_flops: float = 550e12
    bwd_flops: float = 450e12
    bwd_work: float = 2.5
    bandwidth: float = 150e9
    latency: float = 20e-6

    def __post_init__(self) -> None:
        for name in ("num_heads_q", "num_heads_kv", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MaskParamError(f"CostModel.{name} must be a positive int, got {value!r}")
        for name in ("fwd_flops", "bwd_flops", "bwd_work", "bandwidth", "latency"):
            value = getattr(self, name)
            least = "non-negative" if name == "latency" else "positive"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or (
                value == 0 and least == "positive"
            ):
                raise MaskParamError(f"CostModel.{name} must be a {least} number, got {value!r}")

    @property
    def flops_per_pair(self) -> float:
        """Forward FLOPs of one allowed (query, key) pair: QK^T and PV, 2 * head_dim each, per query head."""
        return 4.0 * self.num_heads_q * self.head_dim

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one key row's K and V (and, backward, of its dK and dV)."""
        return 2 * self.num_heads_kv * self.head_dim * self.dtype_bytes

    def compute_time(self, pairs: np.ndarray, direction: Direction) -> np.ndarray:
        """Seconds to compute `pairs` allowed pairs."""
        if _check_direction(direction) == "fwd":
            return np.asarray(pairs, dtype=np.float64) * (self.flops_per_pair / self.fwd_flops)
        return np.asarray(pairs, dtype=np.float64) * (self.flops_per_pair * self.bwd_work / self.bwd_flops)

    def comm_time(self, rows: np.ndarray) -> np.ndarray:
        """Seconds of an all-to-all-v whose busiest rank sends or receives `rows` key rows (0: skipped)."""
        rows = np.asarray(rows, dtype=np.float64)
        return np.where(rows > 0, self.latency + rows * (self.bytes_per_row / self.bandwidth), 0.0)


def split_stages(remote: np.ndarray, num_stages: int) -> list[np.ndarray]:
    """A rank's remote key ranges ([R, 2], sorted, disjoint) cut into `num_stages` consecutive
    groups of nearly equal rows: stage i takes rows [floor(i*T/n), floor((i+1)*T/n)) of the T
    remote rows in key order, so counts differ by at most one and a stage is empty only when
    T < n. Ranges split where a stage boundary falls inside them."""
    _check_count(num_stages, "num_stages")
    ranges = _check_ranges(remote, "remote")
    seg, offsets = _split(ranges, np.array([len(ranges)]), num_stages)
    return [seg[offsets[i] : offsets[i + 1]] for i in range(num_stages)]


@dataclass(frozen=True, eq=False)
class StagePlan:
    """The chosen stage split and what the model says of it.

    `ranges[offsets[r*n + i] : offsets[r*n + i + 1]]` are the key ranges rank r fetches in
    stage i (0-based; n = num_stages); `pairs[r, 0]` is rank r's local work, `pairs[r, i + 1]`
    its work against stage i; `stage_rows[i]` is the busiest rank's rows sent or received in
    stage i. `scan` lists (num_stages, forward s, backward s) for every count evaluated.
    """

    num_stages: int
    ranges: np.ndarray
    offsets: np.ndarray
    pairs: np.ndarray
    stage_rows: np.ndarray
    cost: CostModel
    scan: tuple[tuple[int, float, float], ...] = field(default=())

    def __post_init__(self) -> None:
        n = self.num_stages
        _check_count(n, "num_stages")
        for name in ("ranges", "offsets", "pairs", "stage_rows"):
            arr = np.array(getattr(self, name), dtype=np.int64)
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        cp = self.pairs.shape[0] if self.pairs.ndim == 2 else 0
        if (
            cp == 0
            or self.pairs.shape != (cp, n + 1)
            or self.stage_rows.shape != (n,)
            or self.offsets.shape != (cp * n + 1,)
            or self.ranges.shape != (int(self.offsets[-1]), 2)
            or self.offsets[0] != 0
            or np.any(np.diff(self.offsets) < 0)
        ):
            raise MaskError(
                f"inconsistent StagePlan: {n} stages, pairs {self.pairs.shape}, stage_rows {self.stage_rows.shape}, "
                f"offsets {self.offsets.shape}, ranges {self.ranges.shape}"
            )
        object.__setattr__(self, "scan", tuple((int(k), float(f), float(b)) for k, f, b in self.scan))

    @property
    def cp_size(self) -> int:
        return int(self.pairs.shape[0])

    def stage_ranges(self, rank: int, stage: int) -> np.ndarray:
        """Key ranges [R, 2] that `rank` fetches in `stage` (0-based)."""
        if not (0 <= rank < self.cp_size and 0 <= stage < self.num_stages):
            raise MaskParamError(
                f"no rank {rank} stage {stage} in a plan of {self.cp_size} ranks, {self.num_stages} stages"
            )
        i = rank * self.num_stages + stage
        return self.ranges[self.offsets[i] : self.offsets[i + 1]]

    def compute_time(self, direction: Direction) -> np.ndarray:
        """Seconds of each rank's local work (column 0) and stage work (columns 1..n)."""
        return self.cost.compute_time(self.pairs, _check_direction(direction))

    def comm_time(self) -> np.ndarray:
        """Seconds of each stage's collective (a fetch; in the backward its reduce lasts the same)."""
        return self.cost.comm_time(self.stage_rows)

    @cached_property
    def time_fwd(self) -> float:
        return _longest_path(self._folded("fwd"))

    @cached_property
    def time_bwd(self) -> float:
        return _longest_path(self._folded("bwd"))

    @property
    def time(self) -> float:
        return self.time_fwd + self.time_bwd

    def dag(self, direction: Direction) -> nx.DiGraph:
        """The task DAG, one node per rank and stage: ("compute", rank, i) with i = 0 the local
        stage, and the shared collectives ("fetch", i), ("reduce", i) for i = 1..n; node
        attribute "duration" in seconds. Its critical path is the modelled time."""
        folded = self._folded(direction)
        out = nx.DiGraph()

        def names(v: tuple) -> list[tuple]:
            return [(v[0], r, v[1]) for r in range(self.cp_size)] if folded.nodes[v]["per_rank"] else [v]

        for v, data in folded.nodes(data=True):
            durations = np.broadcast_to(data["duration"], (len(names(v)),))
            out.add_nodes_from((name, {"duration": float(d)}) for name, d in zip(names(v), durations))
        for u, v in folded.edges:
            if folded.nodes[u]["per_rank"] and folded.nodes[v]["per_rank"]:
                out.add_edges_from(zip(names(u), names(v)))
            else:
                out.add_edges_from((a, b) for a in names(u) for b in names(v))
        return out

    def _folded(self, direction: Direction) -> nx.DiGraph:
        return _folded_dag(_check_direction(direction), self.compute_time(direction), self.comm_time())

    def to_dict(self) -> dict:
        return {
            "num_stages": self.num_stages,
            "ranges": self.ranges.tolist(),
            "offsets": self.offsets.tolist(),
            "pairs": self.pairs.tolist(),
            "stage_rows": self.stage_rows.tolist(),
            "cost": asdict(self.cost),
            "scan": [list(row) for row in self.scan],
        }

    @classmethod
    def from_dict(cls, data: dict) -> StagePlan:
        try:
            return cls(
                num_stages=data["num_stages"],
                ranges=np.array(data["ranges"], dtype=np.int64).reshape(-1, 2),
                offsets=data["offsets"],
                pairs=data["pairs"],
                stage_rows=data["stage_rows"],
                cost=CostModel(**data["cost"]),
                scan=tuple(tuple(row) for row in data["scan"]),
            )
        except (MaskError, MaskParamError):
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise MaskError(f"not a StagePlan dict: {e!r}") from e


def critical_path(dag: nx.DiGraph) -> tuple[float, list]:
    """The longest path of a task DAG weighted by node "duration": (seconds, nodes)."""
    end = object()
    weighted = nx.DiGraph()
    weighted.add_nodes_from(dag)
    weighted.add_weighted_edges_from((u, v, dag.nodes[u]["duration"]) for u, v in dag.edges)
    weighted.add_weighted_edges_from((v, end, dag.nodes[v]["duration"]) for v in dag)
    path = nx.dag_longest_path(weighted)
    return float(nx.path_weight(weighted, path, "weight")), path[:-1]


def plan_stages(
    pieces: Pieces,
    rank_of_chunk: np.ndarray,
    cp_size: int,
    remote: list[np.ndarray],
    cost: CostModel,
    num_stages: int | None = None,
    max_stages: int = 8,
    *,
    chunk_size: int,
) -> StagePlan:
    """Split every rank's remote keys into stages: `num_stages` of them, or the count in
    1..max_stages with the least modelled forward + backward time (ties, within rounding, go to
    fewer stages). `remote[r]` holds the key ranges rank r needs beyond its own chunks (it may
    hold more, never fewer); `chunk_size` is the one `pieces` were cut with."""
    problem = _Problem.of(pieces, rank_of_chunk, cp_size, remote, chunk_size)
    if num_stages is not None:
        _check_count(num_stages, "num_stages")
        counts = [num_stages]
    else:
        _check_count(max_stages, "max_stages")
        counts = list(range(1, max_stages + 1))
    plans = [problem.plan(n, cost) for n in counts]
    scan = tuple((p.num_stages, p.time_fwd, p.time_bwd) for p in plans)
    best = min(p.time for p in plans)
    chosen = next(p for p in plans if p.time <= best * (1 + 1e-9))
    return replace(chosen, scan=scan)


@dataclass(frozen=True, eq=False)
class _Problem:
    """What every stage count shares, validated once: pieces with their ranks, every rank's own
    chunks and remote ranges (concatenated in rank order), in keys shifted apart by rank."""

    pieces: Pieces
    piece_begin: np.ndarray
    piece_end: np.ndarray
    rank_area: np.ndarray
    rank_of_chunk: np.ndarray
    chunk_size: int
    remote: np.ndarray
    remote_counts: np.ndarray

    @staticmethod
    def of(
        pieces: Pieces, rank_of_chunk: np.ndarray, cp_size: int, remote: list[np.ndarray], chunk_size: int
    ) -> _Problem:
        _check_count(cp_size, "cp_size")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0:
            raise MaskError(f"chunk_size must be a positive int, got {chunk_size!r}")
        owners = np.asarray(rank_of_chunk)
        if owners.ndim != 1 or owners.size == 0 or owners.dtype.kind not in "iu":
            raise MaskError(f"rank_of_chunk must be a non-empty 1-D int array, got {owners.dtype} {owners.shape}")
        owners = owners.astype(np.int64)
        if owners.min() < 0 or owners.max() >= cp_size:
            raise MaskError(f"rank_of_chunk names ranks outside [0, {cp_size})")
        per_rank = np.bincount(owners, minlength=cp_size)
        if np.any(per_rank != per_rank[0]):
            raise MaskError(f"ranks must own equal chunk counts, got {per_rank.tolist()}")
        span = owners.size * chunk_size
        if len(pieces) and (int(pieces.chunk.max()) >= owners.size or int(pieces.key_end().max()) > span):
            raise MaskError(f"the pieces reach past the {owners.size} chunks of {chunk_size} rows")
        if len(remote) != cp_size:
            raise MaskError(f"need remote ranges for each of {cp_size} ranks, got {len(remote)}")
        ranges = [_check_ranges(r, f"remote[{i}]") for i, r in enumerate(remote)]
        flat = np.concatenate(ranges) if ranges else np.zeros((0, 2), dtype=np.int64)
        counts = np.array([len(r) for r in ranges], dtype=np.int64)
        if flat.size and int(flat[:, 1].max()) > span:
            raise MaskError(f"remote ranges reach past the {owners.size} chunks of {chunk_size} rows")
        index, chunk, _ = _chunk_parts(flat, chunk_size)
        receiver = np.repeat(np.arange(cp_size), counts)[index]
        own = np.flatnonzero(owners[chunk] == receiver)
        if own.size:
            rank = int(receiver[own[0]])
            raise MaskError(f"remote[{rank}] holds rows of chunk {int(chunk[own[0]])}, which rank {rank} owns")
        piece_rank = owners[pieces.chunk]
        return _Problem(
            pieces=pieces,
            piece_begin=pieces.key_begin() + piece_rank * span,
            piece_end=pieces.key_end() + piece_rank * span,
            rank_area=np.bincount(piece_rank, weights=pieces.areas(), minlength=cp_size).round().astype(np.int64),
            rank_of_chunk=owners,
            chunk_size=int(chunk_size),
            remote=flat,
            remote_counts=counts,
        )

    @property
    def cp_size(self) -> int:
        return int(self.remote_counts.size)

    def plan(self, num_stages: int, cost: CostModel) -> StagePlan:
        seg, offsets = _split(self.remote, self.remote_counts, num_stages)
        slot = np.repeat(np.arange(self.cp_size * num_stages), np.diff(offsets))
        seg_rank, seg_stage = slot // num_stages, slot % num_stages
        return StagePlan(
            num_stages, seg, offsets, self._pairs(seg, seg_rank, seg_stage + 1, num_stages + 1),
            self._stage_rows(seg, seg_rank, seg_stage, num_stages), cost,
        )

    def _pairs(self, seg: np.ndarray, seg_rank: np.ndarray, seg_slot: np.ndarray, num_slots: int) -> np.ndarray:
        """[cp, num_slots] allowed pairs of each rank's queries against its own chunks (slot 0)
        and each slot's key ranges: every piece meets the ranges of its rank its keys overlap."""
        num_chunks = self.rank_of_chunk.size
        span = num_chunks * self.chunk_size
        own_begin = np.arange(num_chunks, dtype=np.int64) * self.chunk_size
        keys = np.concatenate([np.stack([own_begin, own_begin + self.chunk_size], axis=1), seg])
        rank = np.concatenate([self.rank_of_chunk, seg_rank])
        slot = np.concatenate([np.zeros(num_chunks, dtype=np.int64), seg_slot])
        order = np.argsort(keys[:, 0] + rank * span, kind="stable")
        keys, rank, slot = keys[order], rank[order], slot[order]
        first = np.searchsorted(keys[:, 1] + rank * span, self.piece_begin, side="right")
        last = np.searchsorted(keys[:, 0] + rank * span, self.piece_end, side="left") - 1
        piece, hit = expand_spans(first, last)
        work = self.pieces.take(piece).areas_within(keys[hit, 0], keys[hit, 1])
        pairs = np.bincount(rank[hit] * num_slots + slot[hit], weights=work, minlength=self.cp_size * num_slots)
        pairs = pairs.round().astype(np.int64).reshape(self.cp_size, num_slots)
        short = np.flatnonzero(pairs.sum(axis=1) != self.rank_area)
        if short.size:
            raise MaskError(f"remote[{int(short[0])}] misses keys that rank {int(short[0])}'s queries attend to")
        return pairs

    def _stage_rows(self, seg: np.ndarray, seg_rank: np.ndarray, seg_stage: np.ndarray, num_stages: int) -> np.ndarray:
        """Per stage, the most rows any rank sends (rows of its chunks others fetch) or receives."""
        size = self.cp_size * num_stages
        received = np.bincount(seg_rank * num_stages + seg_stage, weights=seg[:, 1] - seg[:, 0], minlength=size)
        index, chunk, rows = _chunk_parts(seg, self.chunk_size)
        sent = np.bincount(self.rank_of_chunk[chunk] * num_stages + seg_stage[index], weights=rows, minlength=size)
        busiest = np.maximum(received, sent).reshape(self.cp_size, num_stages).max(axis=0)
        return busiest.round().astype(np.int64)


def _split(ranges: np.ndarray, counts: np.ndarray, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage split of several ranks at once: `ranges` holds rank 0's ranges, then rank 1's, ...
    (counts[r] of rank r). Rows are numbered through all ranks in order; every rank's rows are
    cut at floor(i*T/n) of its own T, and ranges at the cuts inside them. Returns the pieces
    [S, 2], ordered by rank, stage, key, and offsets [len(counts)*n + 1] of (rank, stage)."""
    n = num_stages
    cum = np.r_[0, np.cumsum(ranges[:, 1] - ranges[:, 0])]
    rank_end = np.cumsum(counts)
    totals = cum[rank_end] - cum[rank_end - counts]
    cuts = (cum[rank_end - counts][:, None] + np.arange(n + 1) * totals[:, None] // n).ravel()
    bounds = np.union1d(cum, cuts)
    u0, u1 = bounds[:-1], bounds[1:]
    j = np.searchsorted(cum, u0, side="right") - 1
    # The last cut at or before u0 names the (rank, stage) it starts: equal cuts are empty stages.
    f = np.searchsorted(cuts, u0, side="right") - 1
    slot = f // (n + 1) * n + f % (n + 1)
    start = ranges[j, 0] + u0 - cum[j]
    seg = np.stack([start, start + u1 - u0], axis=1)
    return seg, np.r_[0, np.cumsum(np.bincount(slot, minlength=counts.size * n))]


def _chunk_parts(ranges: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges cut at chunk boundaries: each part's range index, chunk and row count."""
    index, chunk = expand_spans(ranges[:, 0] // chunk_size, (ranges[:, 1] - 1) // chunk_size)
    lo = np.maximum(ranges[index, 0], chunk * chunk_size)
    hi = np.minimum(ranges[index, 1], (chunk + 1) * chunk_size)
    return index, chunk, hi - lo


def _comm_stream(direction: Direction, num_stages: int) -> list[tuple[str, int]]:
    """The collectives in stream order: fetch_1, fetch_2, reduce_1, fetch_3, reduce_2, ..."""
    order = [("fetch", 1)]
    for i in range(1, num_stages + 1):
        order += [("fetch", i + 1)] if i < num_stages else []
        order += [("reduce", i)] if direction == "bwd" else []
    return order


def _folded_dag(direction: Direction, compute: np.ndarray, comm: np.ndarray) -> nx.DiGraph:
    """The task DAG with ranks folded: ("compute", i) holds one duration per rank
    (per_rank=True), the collectives one duration for all."""
    n = comm.size
    g = nx.DiGraph()
    computes = [("compute", i) for i in range(n + 1)]
    g.add_nodes_from((v, {"duration": compute[:, i], "per_rank": True}) for i, v in enumerate(computes))
    stream = _comm_stream(direction, n)
    g.add_nodes_from((v, {"duration": float(comm[v[1] - 1]), "per_rank": False}) for v in stream)
    nx.add_path(g, computes)
    nx.add_path(g, stream)
    g.add_edges_from((("fetch", i), ("compute", i)) for i in range(1, n + 1))
    if direction == "bwd":
        g.add_edges_from((("compute", i), ("reduce", i)) for i in range(1, n + 1))
    return g


def _longest_path(folded: nx.DiGraph) -> float:
    """The critical path of the unfolded DAG, on the folded one: a per-rank task starts when its
    rank's predecessors end (shared ones end at once on every rank), a shared task when the
    last rank's predecessors end."""
    finish: dict = {}
    for v in nx.topological_sort(folded):
        data = folded.nodes[v]
        ends = [finish[u] for u in folded.predecessors(v)]
        if data["per_rank"]:
            start = reduce(np.maximum, ends, np.zeros_like(data["duration"]))
        else:
            start = max((float(np.max(e)) for e in ends), default=0.0)
        finish[v] = start + data["duration"]
    return max((float(np.max(e)) for e in finish.values()), default=0.0)


def _check_ranges(value: object, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.dtype.kind not in "iu":
        raise MaskError(f"{what} must be an int array of [begin, end) rows, shape [R, 2], got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    if arr[0, 0] < 0 or np.any(arr[:, 1] <= arr[:, 0]) or np.any(arr[1:, 0] < arr[:-1, 1]):
        raise MaskError(f"{what} must be non-empty, sorted, disjoint ranges of rows >= 0, got {arr.tolist()}")
    return arr


def _check_count(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise MaskParamError(f"{what} must be a positive int, got {value!r}")


def _check_direction(direction: str) -> Direction:
    if direction not in DIRECTIONS:
        raise MaskParamError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    return direction
