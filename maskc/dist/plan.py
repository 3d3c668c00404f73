"""The context-parallel plan: one object holding what every rank needs to run a mask.

`make_plan` pads the mask to whole chunks per rank, deals the chunks (`assign`), derives
the zero-redundant communication tables (`comm`) and the overlap stages (`stages`). A plan
is a value: its JSON holds its inputs (mask, chunk assignment, cost model, stage count, local
fusion) and its headline numbers, and `Plan.from_json` rebuilds the rest deterministically,
refusing a document whose numbers no longer match. `Plan.for_mask` re-derives tables and
stages for another mask on the same chunk assignment, so layers with different masks share
one dispatch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from maskc.dist.assign import ALGORITHMS, imbalance, lower_bound, pad, padded_length, solve
from maskc.dist.comm import CommTables, build_comm_tables, remote_keys
from maskc.dist.pieces import Pieces, areas_by_chunk, cut
from maskc.dist.stages import CostModel, StagePlan, plan_stages
from maskc.errors import MaskError, MaskParamError
from maskc.ir.mask import Mask
from maskc.limits import MAX_CP, MAX_ROWS, check_count
from maskc.runtime.masks import as_mask
from maskc.runtime.prepared import PreparedMask
from maskc.version import __version__

FORMAT = 2  # 2: the stage model with call overheads and local fusion
#: chunk_size=None picks the largest power of two in [MIN_CHUNK, MAX_CHUNK] that still gives
#: every rank CHUNKS_PER_RANK chunks: enough freedom to balance, few enough to plan fast.
MIN_CHUNK, MAX_CHUNK, CHUNKS_PER_RANK = 64, 2048, 8


def default_chunk_size(seqlen: int, cp_size: int) -> int:
    """The chunk size `make_plan` uses when none is given (see CHUNKS_PER_RANK)."""
    target = max(1, seqlen // (cp_size * CHUNKS_PER_RANK))
    size = 1 << max(0, target.bit_length() - 1)
    return int(min(MAX_CHUNK, max(MIN_CHUNK, size)))


@dataclass(frozen=True, eq=False)
class Plan:
    """A mask dealt over `cp_size` ranks in chunks of `chunk_size` rows (queries and keys).

    `mask` is the padded mask (`padded_length` square; rows past `seqlen` attend to nothing);
    rank r owns the chunks `chunks_of(r)` and holds their rows in ascending chunk order.
    `pieces` is the mask cut into chunks, kept for the ranks' local masks (cutting normalises
    the mask, the dearest part of it)."""

    mask: Mask
    seqlen: int
    cp_size: int
    chunk_size: int
    algorithm: str
    rank_of_chunk: np.ndarray
    chunk_area: np.ndarray
    comm: CommTables
    stages: StagePlan
    cost: CostModel
    pieces: Pieces = field(repr=False)

    @property
    def padded_length(self) -> int:
        return self.mask.seqlen_q

    @property
    def num_chunks(self) -> int:
        return int(self.rank_of_chunk.shape[0])

    def chunks_of(self, rank: int) -> np.ndarray:
        return np.flatnonzero(self.rank_of_chunk == rank)

    def rank_areas(self) -> np.ndarray:
        """Attention work (mask area) of each rank's queries."""
        return np.bincount(self.rank_of_chunk, weights=self.chunk_area, minlength=self.cp_size).astype(np.int64)

    def imbalance(self) -> float:
        return imbalance(self.chunk_area, self.rank_of_chunk, self.cp_size)

    def lower_bound(self) -> int:
        """No equal-count dispatch of these chunks has a smaller largest rank area."""
        return lower_bound(self.chunk_area, self.cp_size)

    def for_mask(self, mask: Mask) -> Plan:
        """The same chunk assignment (no token moves) with tables and stages for `mask`."""
        _check_plannable(mask)
        if mask.seqlen_q != self.seqlen:
            raise MaskError(f"the mask has {mask.seqlen_q} tokens; this plan is for {self.seqlen}")
        return _derive(pad(mask, self.padded_length), self.seqlen, self.cp_size, self.chunk_size, self.algorithm,
                       self.rank_of_chunk, self.cost, None, None, None)  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The headline numbers: balance, communication against the baselines, stages, modelled time."""
        areas = self.rank_areas()
        recv, ring = self.comm.recv_rows_per_rank, self.comm.ring_p2p_recv_rows_per_rank
        return {
            "seqlen": self.seqlen,
            "padded_length": self.padded_length,
            "cp_size": self.cp_size,
            "chunk_size": self.chunk_size,
            "algorithm": self.algorithm,
            "imbalance": self.imbalance(),
            "lower_bound": self.lower_bound(),
            "max_area": int(areas.max(initial=0)),
            "ranks": [
                {"rank": r, "chunks": self.chunks_of(r).tolist(), "area": int(areas[r]), "recv_rows": int(recv[r]),
                 "ring_p2p_recv_rows": int(ring[r]), "allgather_recv_rows": self.comm.allgather_recv_rows_per_rank}
                for r in range(self.cp_size)  # fmt: skip
            ],
            "comm_rows_total": int(self.comm.comm_rows_total),
            "ring_p2p_rows_total": int(self.comm.ring_p2p_rows_total),
            "allgather_rows_total": int(self.comm.allgather_rows_total),
            "num_stages": int(self.stages.num_stages),
            "fuse_local": bool(self.stages.fuse_local),
            "modelled_forward_s": float(self.stages.time_fwd),
            "modelled_backward_s": float(self.stages.time_bwd),
        }

    def to_json(self) -> str:
        """The plan's inputs and its summary, as one JSON object (see `Plan.from_json`)."""
        doc = {
            "format": FORMAT,
            "maskc": __version__,
            **self.summary(),
            "mask": json.loads(self.mask.to_json()),
            "rank_of_chunk": self.rank_of_chunk.tolist(),
            "cost": asdict(self.cost),
        }
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan written by `to_json`; a document that is not one, or whose numbers do
        not match what its inputs give, is refused."""
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT:
                raise MaskError(f"plan format {doc.get('format')!r} is not supported (expected {FORMAT})")
            plan = _derive(
                Mask.from_json(json.dumps(doc["mask"])),
                int(doc["seqlen"]),
                int(doc["cp_size"]),
                int(doc["chunk_size"]),
                str(doc["algorithm"]),
                np.asarray(doc["rank_of_chunk"], dtype=np.int64),
                CostModel(**doc["cost"]),
                int(doc["num_stages"]),
                doc["fuse_local"],
                None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MaskError(f"not a maskc plan: {type(exc).__name__}: {exc}") from None
        stored = {k: doc[k] for k in plan.summary()}
        if json.loads(json.dumps(plan.summary())) != stored:
            raise MaskError("the plan's recorded numbers do not match its inputs (edited, corrupted, or another maskc)")
        return plan


def make_plan(
    mask: Mask | PreparedMask,
    cp_size: int,
    chunk_size: int | None = None,
    *,
    algorithm: str = "swap",
    num_stages: int | None = None,
    cost: CostModel | None = None,
    fuse_local: bool | None = None,
) -> Plan:
    """Plan `mask` (square: self-attention) over `cp_size` ranks: pad to whole chunks per rank,
    deal the chunks with `algorithm` (see maskc.dist.assign.ALGORITHMS), derive the
    communication tables and the overlap stages (`num_stages` and `fuse_local`, each the cost
    model's best when None). A mask prepared for one GPU (`maskc.prepare`) plans as its mask."""
    mask = as_mask(mask)
    _check_plannable(mask)
    for name, value in (("cp_size", cp_size), ("chunk_size", chunk_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise MaskParamError(f"{name} must be a positive int, got {value!r}")
    if algorithm not in ALGORITHMS:
        raise MaskParamError(f"unknown dispatch algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    check_count(cp_size, MAX_CP, "context-parallel ranks", MaskParamError)
    chunk_size = int(chunk_size or default_chunk_size(mask.seqlen_q, cp_size))
    check_count(-(-mask.seqlen_q // chunk_size), MAX_ROWS, f"chunks of {chunk_size} tokens", MaskParamError)
    # At least one chunk per rank, so every rank has rows (padding) even for a tiny sequence.
    padded = pad(mask, max(padded_length(mask.seqlen_q, chunk_size, cp_size), chunk_size * cp_size))
    pieces = cut(padded, chunk_size)
    rank_of_chunk = solve(areas_by_chunk(pieces, padded.seqlen_q // chunk_size), cp_size, algorithm)
    cost = cost or CostModel()
    return _derive(padded, mask.seqlen_q, int(cp_size), chunk_size, algorithm, rank_of_chunk, cost, num_stages, fuse_local,
                   pieces)  # fmt: skip


def _derive(
    padded: Mask,
    seqlen: int,
    cp_size: int,
    chunk_size: int,
    algorithm: str,
    rank_of_chunk: np.ndarray,
    cost: CostModel,
    num_stages: int | None,
    fuse_local: bool | None,
    pieces: Pieces | None,
) -> Plan:
    """Everything that follows from a padded mask and a chunk assignment (and its `pieces`, when
    already cut)."""
    num_chunks = padded.seqlen_q // chunk_size
    if padded.seqlen_q % (chunk_size * cp_size):
        raise MaskError(f"padded length {padded.seqlen_q} is not a multiple of chunk_size x cp_size")
    if rank_of_chunk.shape != (num_chunks,) or not np.array_equal(
        np.bincount(rank_of_chunk, minlength=cp_size), np.full(cp_size, num_chunks // cp_size)
    ):
        raise MaskError(f"the chunk assignment must give each of {cp_size} ranks {num_chunks // cp_size} of {num_chunks} chunks")
    pieces = cut(padded, chunk_size) if pieces is None else pieces
    comm = build_comm_tables(padded, chunk_size, rank_of_chunk, cp_size, pieces=pieces)
    remote = remote_keys(pieces, chunk_size, rank_of_chunk, cp_size)
    stages = plan_stages(pieces, rank_of_chunk, cp_size, remote, cost, num_stages=num_stages, chunk_size=chunk_size,
                         fuse_local=fuse_local)  # fmt: skip
    areas = areas_by_chunk(pieces, num_chunks)
    return Plan(padded, seqlen, cp_size, chunk_size, algorithm, rank_of_chunk, areas, comm, stages, cost, pieces)


def unplannable(mask: Mask) -> str | None:
    """Why context parallelism cannot take `mask`, or None when it can."""
    if mask.seqlen_q != mask.seqlen_k:
        return (
            f"context parallelism deals queries and keys together: the mask must be square, got {mask.seqlen_q} x {mask.seqlen_k}"
        )
    return None


def _check_plannable(mask: Mask) -> None:
    if not isinstance(mask, Mask):
        raise TypeError(f"expected a maskc.Mask, got {type(mask).__name__}")
    reason = unplannable(mask)
    if reason is not None:
        raise MaskError(reason)
