"""Overlap stages: each rank's remote key/value rows fetched in stages that hide behind compute.

A rank attends its queries to its own keys (the local call, no communication) and to the remote
keys of stage 1, 2, ..., one kernel call per stage (maskc.dist.execute). Forward: every stage's
all-to-all-v is issued up front and runs while the local call and the earlier stages compute;
the partial outputs merge by lse. Backward: the received keys are kept from the forward (no
fetch); stages 1..n compute first, each stage's dK/dV going back to their owners in an
all-to-all-v while the next call runs, and the local call comes last. With `fuse_local` the
local keys and stage 1's keys go into one call: stage 1's fetch is no longer hidden, but one
call (its launch and its merge pass) is saved, which wins when communication is small. More
stages hide more communication but pay one collective latency and one call overhead each;
`plan_stages` models every count, fused and not, and keeps the least forward + backward time.

The model, per direction, is a DAG of tasks with durations whose longest path is the time:
- compute_i: one kernel call per rank (i = 0 the local call), its pairs x FLOPs per pair /
  throughput, plus `CostModel.call_overhead` for every call beyond the local one (launch and a
  pass over the rank's output); fused, stage 1's pairs run in the local call and compute_1
  lasts nothing. Per rank the calls form a chain in the runtime's order: forward
  0 -> 1 -> ... -> n; backward 1 -> ... -> n -> 0, fused 2 -> ... -> n -> 0 -> 1;
- fetch_i (forward) and reduce_i (backward): one collective, so one task shared by all ranks,
  lasting latency + max over ranks of max(rows sent, rows received) * bytes per row / bandwidth
  (links are full duplex); a stage no rank moves a row in is skipped and costs nothing. The
  collectives of a direction run one after another on one stream: fetch_1 -> ... -> fetch_n,
  reduces in the order their computes run;
- fetch_i -> compute_i on every rank (fused, fetch_1 -> compute_0 too); compute_i of every
  rank -> reduce_i (the collective starts when the slowest rank has its partials).
Since ranks meet only at the shared collectives, the DAG is kept folded: a compute node holds
one duration per rank, and `StagePlan.dag` unfolds it into one node per rank and stage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Literal

import numpy as np

from maskc.dist.pieces import Pieces
from maskc.errors import MaskError, MaskParamError
from maskc.ir.slices import expand_spans
from maskc.lazy import optional_imports

with optional_imports("maskc.dist (attention over many GPUs)"):
    import networkx as nx

Direction = Literal["fwd", "bwd"]
DIRECTIONS: tuple[Direction, ...] = ("fwd", "bwd")


@dataclass(frozen=True)
class CostModel:
    """Throughputs of one GPU and its links, and the attention problem's shape.

    Defaults: an H200-class GPU (dense attention at 550 TFLOP/s forward, 450 backward, bf16)
    on NVLink (220 GB/s per direction per rank for an all-to-all, measured by bench/dist.py on
    4 H200s; 20 us per collective), and 64 query heads, 8 key/value heads of dimension 128 in
    2-byte elements. The backward does `bwd_work` (2.5) times the forward's FLOPs: scores
    recomputed, then dV, dP, dQ and dK. Every kernel call beyond a rank's first costs `launch`
    (20 us: launch, schedule upload) and a pass over the rank's output (`call_overhead`) at
    `memory_bandwidth`: 1 TB/s, what one more call cost on 4 H200s (the unfused against the
    fused single stage, varlen masks, 16k rows per rank; the torch merge ops, the second
    grid's tail). Calibrate by timing one attention kernel, the same work in two calls and one
    all-to-all and setting the throughputs (`bandwidth` in bytes/s per direction per rank,
    `latency` in s per collective, `launch` in s per call, `memory_bandwidth` in bytes/s).
    """

    num_heads_q: int = 64
    num_heads_kv: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    fwd_flops: float = 550e12
    bwd_flops: float = 450e12
    bwd_work: float = 2.5
    bandwidth: float = 220e9
    latency: float = 20e-6
    launch: float = 20e-6
    memory_bandwidth: float = 1.0e12

    def __post_init__(self) -> None:
        for name in ("num_heads_q", "num_heads_kv", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MaskParamError(f"CostModel.{name} must be a positive int, got {value!r}")
        for name in ("fwd_flops", "bwd_flops", "bwd_work", "bandwidth", "latency", "launch", "memory_bandwidth"):
            value = getattr(self, name)
            least = "non-negative" if name in ("latency", "launch") else "positive"
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

    def call_overhead(self, rows: int, direction: Direction) -> float:
        """Seconds one more kernel call costs a rank of `rows` query rows beyond its pairs: `launch`
        and one memory-bound pass over the rank's output. Forward, the call's part merges into
        the running float32 output (read and write float32, read the part: 8 + dtype_bytes per
        element); backward, the preprocess reads O and dO again for every call (2 x dtype_bytes)."""
        per_element = 8 + self.dtype_bytes if _check_direction(direction) == "fwd" else 2 * self.dtype_bytes
        return self.launch + rows * self.num_heads_q * self.head_dim * per_element / self.memory_bandwidth


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
    stage i. `rows_per_rank` is a rank's query rows (what a call's overhead passes over);
    `fuse_local` runs stage 1's keys in the local call. `scan` lists (num_stages, fuse_local,
    forward s, backward s) for every variant evaluated.
    """

    num_stages: int
    ranges: np.ndarray
    offsets: np.ndarray
    pairs: np.ndarray
    stage_rows: np.ndarray
    cost: CostModel
    rows_per_rank: int
    fuse_local: bool
    scan: tuple[tuple[int, bool, float, float], ...] = field(default=())

    def __post_init__(self) -> None:
        n = self.num_stages
        _check_count(n, "num_stages")
        rows = self.rows_per_rank
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 0:
            raise MaskParamError(f"rows_per_rank must be a non-negative int, got {rows!r}")
        object.__setattr__(self, "rows_per_rank", int(rows))
        object.__setattr__(self, "fuse_local", _check_flag(self.fuse_local, "fuse_local"))
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
        scan = tuple((int(k), _check_flag(u, "a scan entry's fuse_local"), float(f), float(b)) for k, u, f, b in self.scan)
        object.__setattr__(self, "scan", scan)

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
        """Seconds of each rank's kernel calls: the local call (column 0) and stage i's (column i).
        Fused, stage 1's pairs run in the local call and column 1 is 0. A stage call with work
        adds `CostModel.call_overhead`: extra calls are what more stages pay beyond latency."""
        time = self.cost.compute_time(self.pairs, _check_direction(direction))
        if self.fuse_local:
            time[:, 0] += time[:, 1]
            time[:, 1] = 0.0
        overhead = self.cost.call_overhead(self.rows_per_rank, direction)
        time[:, 1:] += np.where(time[:, 1:] > 0, overhead, 0.0)
        return time

    def comm_time(self) -> np.ndarray:
        """Seconds of each stage's collective (its forward fetch; its backward reduce lasts the same)."""
        return self.cost.comm_time(self.stage_rows)

    @cached_property
    def time_fwd(self) -> float:
        return _critical_time("fwd", self.compute_time("fwd"), self.comm_time(), self.fuse_local)

    @cached_property
    def time_bwd(self) -> float:
        return _critical_time("bwd", self.compute_time("bwd"), self.comm_time(), self.fuse_local)

    @property
    def time(self) -> float:
        return self.time_fwd + self.time_bwd

    def dag(self, direction: Direction) -> nx.DiGraph:
        """The task DAG, one node per rank and call: ("compute", rank, i) with i = 0 the local
        call, and the shared collectives, ("fetch", i) forward and ("reduce", i) backward for
        i = 1..n; node attribute "duration" in seconds. Its critical path is the modelled time."""
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
        return _folded_dag(_check_direction(direction), self.compute_time(direction), self.comm_time(), self.fuse_local)

    def to_dict(self) -> dict:
        return {
            "num_stages": self.num_stages,
            "ranges": self.ranges.tolist(),
            "offsets": self.offsets.tolist(),
            "pairs": self.pairs.tolist(),
            "stage_rows": self.stage_rows.tolist(),
            "cost": asdict(self.cost),
            "rows_per_rank": self.rows_per_rank,
            "fuse_local": self.fuse_local,
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
                rows_per_rank=data["rows_per_rank"],
                fuse_local=data["fuse_local"],
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
    fuse_local: bool | None = None,
) -> StagePlan:
    """Split every rank's remote keys into stages: `num_stages` of them, or the count in
    1..max_stages, with stage 1 fused into the local call or not (`fuse_local`, or both tried),
    whichever has the least modelled forward + backward time (ties, within rounding, go to
    fewer stages, then to unfused). `remote[r]` holds the key ranges rank r needs beyond its
    own chunks (it may hold more, never fewer); `chunk_size` is the one `pieces` were cut with."""
    problem = _Problem.of(pieces, rank_of_chunk, cp_size, remote, chunk_size)
    if num_stages is not None:
        _check_count(num_stages, "num_stages")
        counts = [num_stages]
    else:
        _check_count(max_stages, "max_stages")
        counts = list(range(1, max_stages + 1))
    fuses = [False, True] if fuse_local is None else [_check_flag(fuse_local, "fuse_local")]
    splits = [problem.plan(n, cost) for n in counts]
    plans = [replace(split, fuse_local=fuse) for split in splits for fuse in fuses]
    scan = tuple((p.num_stages, p.fuse_local, p.time_fwd, p.time_bwd) for p in plans)
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
        """The unfused plan of `num_stages` stages (the split does not depend on fusing)."""
        seg, offsets = _split(self.remote, self.remote_counts, num_stages)
        slot = np.repeat(np.arange(self.cp_size * num_stages), np.diff(offsets))
        seg_rank, seg_stage = slot // num_stages, slot % num_stages
        rows_per_rank = self.rank_of_chunk.size // self.cp_size * self.chunk_size
        return StagePlan(
            num_stages, seg, offsets, self._pairs(seg, seg_rank, seg_stage + 1, num_stages + 1),
            self._stage_rows(seg, seg_rank, seg_stage, num_stages), cost, rows_per_rank, False,
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


def _call_order(direction: Direction, num_stages: int, fuse_local: bool) -> list[int]:
    """The order a rank runs its calls in (0: the local call), as the runtime does: forward the
    local call first, the stages as their keys arrive; backward the stages first (each stage's
    reduce runs behind the next call) and the local call last. Fused, stage 1 runs inside the
    local call, so the backward puts it right after (its reduce follows the fused call)."""
    stages = list(range(1, num_stages + 1))
    if direction == "fwd":
        return [0, *stages]
    return [*stages[1:], 0, 1] if fuse_local else [*stages, 0]


def _folded_dag(direction: Direction, compute: np.ndarray, comm: np.ndarray, fuse_local: bool) -> nx.DiGraph:
    """The task DAG with ranks folded: ("compute", i) holds one duration per rank
    (per_rank=True), the collectives one duration for all. The collectives of a direction share
    one stream: forward the fetches in stage order, backward the reduces in call order."""
    order = _call_order(direction, comm.size, fuse_local)
    computes = [("compute", i) for i in order]
    if direction == "fwd":
        stream = [("fetch", i) for i in range(1, comm.size + 1)]
    else:
        stream = [("reduce", i) for i in order if i]
    g = nx.DiGraph()
    g.add_nodes_from((v, {"duration": compute[:, v[1]], "per_rank": True}) for v in computes)
    g.add_nodes_from((v, {"duration": float(comm[v[1] - 1]), "per_rank": False}) for v in stream)
    nx.add_path(g, computes)
    nx.add_path(g, stream)
    if direction == "fwd":
        g.add_edges_from((v, ("compute", v[1])) for v in stream)
        if fuse_local:
            g.add_edge(("fetch", 1), ("compute", 0))
    else:
        g.add_edges_from((("compute", v[1]), v) for v in stream)
    return g


def _critical_time(direction: Direction, compute: np.ndarray, comm: np.ndarray, fuse_local: bool) -> float:
    """The critical path of `_folded_dag`'s DAG by its recurrence, without building it (the
    stage scan evaluates 16 variants per plan; networkx took half of planning a step): a
    rank's call starts when its previous call and the collective it waits for (forward, its
    fetch; fused, the local call waits for fetch_1) have ended, a collective when the previous
    one and, backward, its stage's call on the slowest rank have. The same additions and
    maxima as a topological walk of the DAG, so the same float."""
    n = comm.size
    finish = np.zeros(compute.shape[0])  # each rank's previous call
    stream = 0.0  # the previous collective
    if direction == "fwd":
        fetched = [0.0] * (n + 1)
        for i in range(1, n + 1):
            stream = fetched[i] = stream + float(comm[i - 1])
        for i in _call_order(direction, n, fuse_local):
            wait = fetched[i] if i else (fetched[1] if fuse_local else 0.0)
            finish = np.maximum(finish, wait) + compute[:, i]
    else:
        for i in _call_order(direction, n, fuse_local):
            finish = finish + compute[:, i]
            if i:
                stream = max(stream, float(finish.max())) + float(comm[i - 1])
    return max(float(finish.max(initial=0.0)), stream)


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


def _check_flag(value: object, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise MaskParamError(f"{what} must be a bool, got {value!r}")
    return bool(value)


def _check_direction(direction: str) -> Direction:
    if direction not in DIRECTIONS:
        raise MaskParamError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    return direction
