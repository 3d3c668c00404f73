"""Communication tables of context parallelism: which key/value rows move from which rank to which.

Chunk c holds query rows and key rows [c*chunk_size, (c+1)*chunk_size) and lives on rank
`rank_of_chunk[c]`; a rank's local rows are its chunks in ascending order, concatenated. Its
queries need the union of their pieces' key intervals; the rows of that union it does not own
arrive in one remote buffer, grouped by source rank and in global row order. The forward moves
them with a GroupCast (each local row range of a source goes to a set of ranks), written as one
all-to-all-v: split sizes and a gather index into the source's local rows. The backward's
GroupReduce is its transpose: partial dK/dV of the remote buffer flow back to their owners,
which scatter-add them through the same index. Nothing moves that no query uses, and nothing
a query uses is missing (tests/test_dist_comm.py proves both against dense masks).

Everything is kept as ranges and built with numpy sorts and cumulative sums, never a loop over
rows or pieces, so a 1M-token mask on 64 ranks builds in milliseconds; row indices are
expanded only on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import numpy as np

from maskc.dist.pieces import Pieces, cut
from maskc.errors import MaskError, MaskParamError
from maskc.ir.mask import Mask
from maskc.ir.slices import expand_spans

JSON_FORMAT = "maskc.comm/1"


# ---- range helpers ------------------------------------------------------------------------


def _union(group: np.ndarray, begin: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group, the union of half-open ranges as (group, begin, end) sorted by group then begin,
    disjoint, adjacent ones merged. Groups are shifted apart by more than any end, so one sort
    and one running maximum merge them all without ever joining two groups."""
    keep = begin < end
    if not keep.any():
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    span = int(end[keep].max()) + 1
    b = group[keep] * span + begin[keep]
    e = group[keep] * span + end[keep]
    order = np.argsort(b, kind="stable")
    b, e = b[order], e[order]
    reach = np.maximum.accumulate(e)
    first = np.flatnonzero(np.r_[True, b[1:] > reach[:-1]])
    out_b = b[first]
    out_e = reach[np.r_[first[1:], b.size] - 1]
    out_g = out_b // span
    return out_g, out_b - out_g * span, out_e - out_g * span


def _expand(ranges: np.ndarray) -> np.ndarray:
    """The rows of [R, 2] half-open ranges, concatenated in range order."""
    return expand_spans(ranges[:, 0], ranges[:, 1] - 1)[1]


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _per_rank(group: np.ndarray, begin: np.ndarray, end: np.ndarray, cp_size: int) -> list[np.ndarray]:
    ranges = np.stack([begin, end], axis=1).reshape(-1, 2)
    return np.split(ranges, np.searchsorted(group, np.arange(1, cp_size)))


# ---- validation ---------------------------------------------------------------------------


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise MaskParamError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def _assignment(rank_of_chunk: Any, cp_size: Any) -> tuple[np.ndarray, int]:
    """The assignment as int64, checked: ranks in [0, cp_size), every rank the same number of chunks."""
    cp = _positive_int(cp_size, "cp_size")
    roc = np.asarray(rank_of_chunk)
    if roc.ndim != 1:
        raise MaskParamError(f"rank_of_chunk must be 1-D, got shape {roc.shape}")
    if roc.size and (roc.dtype == bool or not np.issubdtype(roc.dtype, np.integer)):
        raise MaskParamError(f"rank_of_chunk must be integers, got dtype {roc.dtype}")
    roc = roc.astype(np.int64)
    if roc.size and (roc.min() < 0 or roc.max() >= cp):
        outside = np.unique(roc[(roc < 0) | (roc >= cp)])[:8].tolist()
        raise MaskParamError(f"rank_of_chunk holds ranks outside [0, {cp}): {outside}")
    if roc.size % cp:
        raise MaskParamError(f"{roc.size} chunks cannot be dealt equally to {cp} ranks")
    counts = np.bincount(roc, minlength=cp)
    bad = np.flatnonzero(counts != roc.size // cp)
    if bad.size:
        raise MaskParamError(
            f"every rank must own {roc.size // cp} chunks; rank {int(bad[0])} owns {int(counts[bad[0]])}"
        )
    return roc, cp


def _check_pieces(pieces: Pieces, roc: np.ndarray) -> None:
    if len(pieces) and int(pieces.chunk.max()) >= roc.size:
        raise MaskParamError(
            f"the pieces reach chunk {int(pieces.chunk.max())} but rank_of_chunk has {roc.size} entries"
        )


# ---- key ranges per rank ------------------------------------------------------------------


def _needed(pieces: Pieces, roc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _union(roc[pieces.chunk], pieces.key_begin(), pieces.key_end())


def _by_chunk(
    dst: np.ndarray, begin: np.ndarray, end: np.ndarray, chunk_size: int, roc: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(destination, source, begin, end): the key ranges cut at chunk boundaries, each with the
    rank owning its chunk, in input order."""
    run, chunk = expand_spans(begin // chunk_size, (end - 1) // chunk_size)
    lo = np.maximum(begin[run], chunk * chunk_size)
    hi = np.minimum(end[run], (chunk + 1) * chunk_size)
    return dst[run], roc[chunk], lo, hi


def _remote(pieces: Pieces, chunk_size: int, roc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(destination, source, begin, end) of the needed keys a rank does not own, each range inside
    one chunk's rows, sorted by destination then begin."""
    dst, src, lo, hi = _by_chunk(*_needed(pieces, roc), chunk_size, roc)
    far = src != dst
    return dst[far], src[far], lo[far], hi[far]


def needed_keys(pieces: Pieces, rank_of_chunk: np.ndarray, cp_size: int) -> list[np.ndarray]:
    """Per rank, the [R, 2] key ranges its queries need (the union of its pieces' key intervals):
    sorted, disjoint, adjacent ones merged."""
    roc, cp = _assignment(rank_of_chunk, cp_size)
    _check_pieces(pieces, roc)
    return _per_rank(*_needed(pieces, roc), cp)


def remote_keys(pieces: Pieces, chunk_size: int, rank_of_chunk: np.ndarray, cp_size: int) -> list[np.ndarray]:
    """Per rank, the needed key ranges minus the rank's own rows: what it must receive."""
    chunk_size = _positive_int(chunk_size, "chunk_size")
    roc, cp = _assignment(rank_of_chunk, cp_size)
    _check_pieces(pieces, roc)
    dst, _, begin, end = _remote(pieces, chunk_size, roc)
    return _per_rank(*_union(dst, begin, end), cp)


# ---- the tables ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CommTables:
    """The forward GroupCast and the backward GroupReduce of one mask, chunking and assignment.

    - `recv_*`: per destination rank r, rows recv_ptr[r]:recv_ptr[r+1] list the global key ranges of
      its remote buffer in buffer order (source rank ascending, then global row ascending); each
      range lies in the rows of one source, `recv_src`.
    - `gather_*`: per (source s, destination r), rows gather_ptr[s*cp+r]:gather_ptr[s*cp+r+1] list
      the LOCAL row ranges of s that r receives, ascending: s's all-to-all-v send buffer is these
      in destination order.
    - `cast_*`: per source s, rows cast_ptr[s]:cast_ptr[s+1] split the local rows s sends into
      maximal ranges of one destination set, `cast_dst[cast_dst_ptr[i]:cast_dst_ptr[i+1]]`
      (ascending): the GroupCast view of the same send buffer.
    """

    cp_size: int
    chunk_size: int
    rank_of_chunk: np.ndarray
    recv_ptr: np.ndarray
    recv_src: np.ndarray
    recv_ranges: np.ndarray
    gather_ptr: np.ndarray
    gather_ranges: np.ndarray
    cast_ptr: np.ndarray
    cast_ranges: np.ndarray
    cast_dst_ptr: np.ndarray
    cast_dst: np.ndarray

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (np.ndarray, list)):
                arr = np.array(value, dtype=np.int64)
                if f.name.endswith("_ranges"):
                    arr = arr.reshape(-1, 2)
                object.__setattr__(self, f.name, _readonly(arr))
        cp = _positive_int(self.cp_size, "cp_size")
        _positive_int(self.chunk_size, "chunk_size")
        _assignment(self.rank_of_chunk, cp)
        shapes = {
            "recv_ptr": (cp + 1,),
            "recv_src": (self.recv_ranges.shape[0],),
            "gather_ptr": (cp * cp + 1,),
            "cast_ptr": (cp + 1,),
            "cast_dst_ptr": (self.cast_ranges.shape[0] + 1,),
        }
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise MaskParamError(f"CommTables.{name} must have shape {shape}, got {getattr(self, name).shape}")
        ends = {
            "recv_ptr": self.recv_ranges,
            "gather_ptr": self.gather_ranges,
            "cast_ptr": self.cast_ranges,
            "cast_dst_ptr": self.cast_dst,
        }
        for name, rows in ends.items():
            if int(getattr(self, name)[-1]) != rows.shape[0]:
                raise MaskParamError(f"CommTables.{name} must end at {rows.shape[0]}")

    # ---- shapes -----------------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return int(self.rank_of_chunk.size)

    @property
    def rows_per_rank(self) -> int:
        return self.num_chunks // self.cp_size * self.chunk_size

    def local_rows(self, rank: int) -> np.ndarray:
        """Global row of each local row of `rank` (its chunks ascending, concatenated)."""
        chunks = np.flatnonzero(self.rank_of_chunk == self._rank(rank))
        return _expand(np.stack([chunks, chunks + 1], axis=1) * self.chunk_size)

    # ---- forward: GroupCast as all-to-all-v -------------------------------------------------

    @cached_property
    def send_counts(self) -> np.ndarray:
        """[cp, cp] int64: rows rank s sends to rank r in the forward (recv counts are its transpose)."""
        rows = np.r_[0, np.cumsum(self.gather_ranges[:, 1] - self.gather_ranges[:, 0])]
        counts = rows[self.gather_ptr[1:]] - rows[self.gather_ptr[:-1]]
        return _readonly(counts.reshape(self.cp_size, self.cp_size))

    @property
    def recv_counts(self) -> np.ndarray:
        """[cp, cp] int64: rows rank r receives from rank s, at [r, s]."""
        return self.send_counts.T

    def recv(self, rank: int) -> np.ndarray:
        """[R, 2] global key ranges of `rank`'s remote buffer, in buffer order."""
        r = self._rank(rank)
        return self.recv_ranges[self.recv_ptr[r] : self.recv_ptr[r + 1]]

    def recv_rows(self, rank: int) -> np.ndarray:
        """Global key row of each row of `rank`'s remote buffer."""
        return _expand(self.recv(rank))

    def gather(self, src: int, dst: int) -> np.ndarray:
        """[R, 2] local row ranges of `src` that `dst` receives, ascending."""
        s, r = self._rank(src), self._rank(dst)
        return self.gather_ranges[self.gather_ptr[s * self.cp_size + r] : self.gather_ptr[s * self.cp_size + r + 1]]

    def gather_index(self, src: int) -> np.ndarray:
        """Local rows of `src` forming its send buffer: destination ascending, then row ascending."""
        s = self._rank(src)
        return _expand(self.gather_ranges[self.gather_ptr[s * self.cp_size] : self.gather_ptr[(s + 1) * self.cp_size]])

    def cast_segments(self, src: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """`src`'s GroupCast: (local begin, local end, destination ranks) per segment, ascending."""
        s = self._rank(src)
        out = []
        for i in range(int(self.cast_ptr[s]), int(self.cast_ptr[s + 1])):
            dsts = self.cast_dst[self.cast_dst_ptr[i] : self.cast_dst_ptr[i + 1]]
            out.append((int(self.cast_ranges[i, 0]), int(self.cast_ranges[i, 1]), tuple(dsts.tolist())))
        return out

    # ---- backward: GroupReduce, the transpose -----------------------------------------------

    @property
    def reduce_send_counts(self) -> np.ndarray:
        """[cp, cp]: partial dK/dV rows rank r sends back to owner s, at [r, s] (its remote buffer, split by source)."""
        return self.send_counts.T

    @property
    def reduce_recv_counts(self) -> np.ndarray:
        """[cp, cp]: rows owner s receives from rank r, at [s, r]; they arrive in gather order."""
        return self.send_counts

    def scatter_index(self, owner: int) -> np.ndarray:
        """Local rows of `owner` into which its received partial dK/dV rows are added (index_add_):
        the gather index, since rank r returns its buffer rows in the order it received them."""
        return self.gather_index(owner)

    # ---- totals and baselines -----------------------------------------------------------------

    @property
    def recv_rows_per_rank(self) -> np.ndarray:
        """[cp]: rows each rank receives in the forward (and sends back in the backward)."""
        return self.send_counts.sum(axis=0)

    @property
    def comm_rows_total(self) -> int:
        return int(self.send_counts.sum())

    @property
    def allgather_rows_total(self) -> int:
        """All-gather baseline: every rank receives every other rank's rows, cp*(cp-1)*rows_per_rank."""
        return self.cp_size * self.allgather_recv_rows_per_rank

    @property
    def ring_hops(self) -> np.ndarray:
        """[cp]: hops of rank s's block in ring attention (s -> s+1 -> ...) until it reaches the farthest
        rank in ring order that needs any of its rows; 0 when no other rank needs it."""
        ranks = np.arange(self.cp_size)
        distance = (ranks[None, :] - ranks[:, None]) % self.cp_size
        return (distance * (self.send_counts > 0)).max(axis=1, initial=0)

    @property
    def ring_p2p_recv_rows_per_rank(self) -> np.ndarray:
        """[cp]: rows rank r receives in the ring P2P baseline: the full block of every rank s whose
        `ring_hops` reach r (the block passes r on its way, needed there or not)."""
        ranks = np.arange(self.cp_size)
        distance = (ranks[None, :] - ranks[:, None]) % self.cp_size  # [s, r]: hops from s to r
        reached = (distance > 0) & (distance <= self.ring_hops[:, None])
        return reached.sum(axis=0).astype(np.int64) * self.rows_per_rank

    @property
    def ring_p2p_rows_total(self) -> int:
        """Ring P2P baseline: every block moves its full rows_per_rank on each of its `ring_hops`."""
        return int(self.ring_p2p_recv_rows_per_rank.sum())

    @property
    def allgather_recv_rows_per_rank(self) -> int:
        """Rows every rank receives in the all-gather baseline: all other ranks' rows."""
        return (self.cp_size - 1) * self.rows_per_rank

    # ---- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: ints and lists of ints (ranges as [begin, end] pairs)."""
        out: dict[str, Any] = {"format": JSON_FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.tolist() if isinstance(value, np.ndarray) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommTables:
        if data.get("format") != JSON_FORMAT:
            raise MaskParamError(f"expected format {JSON_FORMAT!r}, got {data.get('format')!r}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise MaskParamError(f"CommTables dict lacks {missing}")
        return cls(**{n: data[n] for n in names})

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.cp_size:
            raise MaskParamError(f"rank must be an int in [0, {self.cp_size}), got {rank!r}")
        return int(rank)


def _cast(
    src: np.ndarray, dst: np.ndarray, begin: np.ndarray, end: np.ndarray, rows_per_rank: int
) -> tuple[np.ndarray, ...]:
    """GroupCast segments from the gather ranges (sorted by source, destination, begin): each
    source's local rows cut at every range boundary, each interval with the destinations covering
    it. The intervals are already maximal: the ranges of one (source, destination) are merged, so
    at every boundary some destination joins or leaves. Returns (segment source, begin, end,
    destination count, destinations in segment order)."""
    span = rows_per_rank + 1  # sources apart by an uncovered gap
    x_b, x_e = src * span + begin, src * span + end
    bp = np.unique(np.r_[x_b, x_e])
    first = np.searchsorted(bp, x_b)
    run, iv = expand_spans(first, np.searchsorted(bp, x_e) - 1)
    order = np.argsort(iv, kind="stable")  # ranges come by destination: each set stays ascending
    count = np.bincount(iv, minlength=bp.size)
    seg = np.flatnonzero(count)
    seg_src = bp[seg] // span
    return seg_src, bp[seg] - seg_src * span, bp[seg + 1] - seg_src * span, count[seg], dst[run][order]


def build_comm_tables(
    mask: Mask, chunk_size: int, rank_of_chunk: np.ndarray, cp_size: int, *, pieces: Pieces | None = None
) -> CommTables:
    """The communication tables of a square `mask` of len(rank_of_chunk) * chunk_size rows;
    `pieces` is `cut(mask, chunk_size)` where the caller has it (cutting is the dear part)."""
    if not isinstance(mask, Mask):
        raise MaskError(f"expected a Mask, got {type(mask).__name__}")
    if mask.seqlen_q != mask.seqlen_k:
        raise MaskError(f"context parallelism needs a square mask, got {mask.seqlen_q} x {mask.seqlen_k}")
    chunk_size = _positive_int(chunk_size, "chunk_size")
    roc, cp = _assignment(rank_of_chunk, cp_size)
    if roc.size * chunk_size != mask.seqlen_q:
        raise MaskParamError(
            f"rank_of_chunk has {roc.size} chunks of {chunk_size} rows, but the mask has {mask.seqlen_q} rows"
        )
    pieces = cut(mask, chunk_size) if pieces is None else pieces
    _check_pieces(pieces, roc)
    return _tables(*_remote(pieces, chunk_size, roc), chunk_size, roc, cp)


def comm_tables_for(ranges: list[np.ndarray], chunk_size: int, rank_of_chunk: np.ndarray, cp_size: int) -> CommTables:
    """The tables that bring rank r the global key ranges `ranges[r]` ([R, 2], none of them its
    own rows): one stage of a staged GroupCast gets its own tables this way."""
    chunk_size = _positive_int(chunk_size, "chunk_size")
    roc, cp = _assignment(rank_of_chunk, cp_size)
    if len(ranges) != cp:
        raise MaskParamError(f"expected key ranges for {cp} ranks, got {len(ranges)}")
    dst = np.concatenate([np.full(len(r), i, np.int64) for i, r in enumerate(ranges)])
    both = np.concatenate([np.asarray(r, np.int64).reshape(-1, 2) for r in ranges])
    begin, end = both[:, 0], both[:, 1]
    if np.any(end <= begin) or (begin.size and (begin.min() < 0 or end.max() > roc.size * chunk_size)):
        raise MaskParamError(f"key ranges must be non-empty and within [0, {roc.size * chunk_size})")
    dst, src, lo, hi = _by_chunk(dst, begin, end, chunk_size, roc)
    if np.any(src == dst):
        raise MaskParamError("a rank cannot receive its own rows")
    return _tables(dst, src, lo, hi, chunk_size, roc, cp)


def _tables(
    dst: np.ndarray, src: np.ndarray, begin: np.ndarray, end: np.ndarray, chunk_size: int, roc: np.ndarray, cp: int
) -> CommTables:
    """The tables of the remote key ranges (destination, source, begin, end), each range inside
    one chunk's rows."""
    rows_per_rank = roc.size // cp * chunk_size
    # Rank-local chunk slot: chunks of a rank in ascending order.
    order = np.argsort(roc, kind="stable")
    slot = np.empty_like(roc)
    slot[order] = np.arange(roc.size) - np.repeat(np.arange(cp) * (roc.size // cp), roc.size // cp)

    group, r_b, r_e = _union(dst * cp + src, begin, end)
    r_dst, r_src = group // cp, group % cp
    # A range inside one source's rows spans chunks of that source that are consecutive in its
    # local order too, so it maps to one local range.
    chunk = r_b // chunk_size
    l_b = slot[chunk] * chunk_size + r_b - chunk * chunk_size
    pair, g_b, g_e = _union(r_src * cp + r_dst, l_b, l_b + r_e - r_b)
    c_src, c_b, c_e, c_count, c_dst = _cast(pair // cp, pair % cp, g_b, g_e, rows_per_rank)
    return CommTables(
        cp_size=cp,
        chunk_size=chunk_size,
        rank_of_chunk=roc,
        recv_ptr=np.searchsorted(r_dst, np.arange(cp + 1)),
        recv_src=r_src,
        recv_ranges=np.stack([r_b, r_e], axis=1),
        gather_ptr=np.searchsorted(pair, np.arange(cp * cp + 1)),
        gather_ranges=np.stack([g_b, g_e], axis=1),
        cast_ptr=np.searchsorted(c_src, np.arange(cp + 1)),
        cast_ranges=np.stack([c_b, c_e], axis=1),
        cast_dst_ptr=np.r_[0, np.cumsum(c_count)],
        cast_dst=c_dst,
    )
