"""Dispatch: which rank owns which chunk.

Every rank gets the same number of chunks (the rest of the model is token-parallel, so token
counts must match) and a chunk's queries and keys stay together; within that, the solver
minimises the largest per-rank mask area, since the slowest rank sets the step time.
Chunk areas come from `maskc.dist.pieces.chunk_areas`; a sequence that is not a multiple of
chunk_size * cp_size is padded first, with padded tokens that attend to nothing.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from maskc.errors import MaskError, MaskParamError
from maskc.ir.mask import Mask

ALGORITHMS = ("contiguous", "greedy", "swap", "local")


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise MaskParamError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def padded_length(seqlen: int, chunk_size: int, cp_size: int) -> int:
    """Smallest multiple of chunk_size * cp_size that holds `seqlen` tokens."""
    if isinstance(seqlen, bool) or not isinstance(seqlen, (int, np.integer)) or seqlen < 0:
        raise MaskParamError(f"seqlen must be a non-negative int, got {seqlen!r}")
    step = _positive_int(chunk_size, "chunk_size") * _positive_int(cp_size, "cp_size")
    return -(-int(seqlen) // step) * step


def pad(mask: Mask, length: int) -> Mask:
    """The same slices in a length x length mask: padded tokens attend to nothing and nothing attends to them."""
    if not isinstance(mask, Mask):
        raise MaskError(f"expected a Mask, got {type(mask).__name__}")
    if mask.seqlen_q != mask.seqlen_k:
        raise MaskError(f"context parallelism needs a square mask (queries and keys share chunks), got {mask.shape}")
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < mask.seqlen_q:
        raise MaskParamError(f"padded length must be an int >= the mask's {mask.seqlen_q} tokens, got {length!r}")
    return Mask.from_arrays(mask.q_ranges, mask.k_ranges, mask.types, int(length), int(length))


def _check_areas(areas: Any, cp_size: Any) -> tuple[np.ndarray, int]:
    arr = np.asarray(areas)
    if arr.ndim != 1:
        raise MaskParamError(f"areas must be 1-D (one per chunk), got shape {arr.shape}")
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise MaskParamError(f"areas must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        raise MaskParamError(f"areas must be non-negative, chunk {int(arr.argmin())} has {int(arr.min())}")
    cp = _positive_int(cp_size, "cp_size")
    if arr.size % cp:
        raise MaskParamError(
            f"{arr.size} chunks do not split evenly over cp_size {cp}; "
            f"pad the mask to padded_length(seqlen, chunk_size, {cp}) tokens first"
        )
    return arr.astype(np.int64, copy=False), cp


def _check_assignment(rank_of_chunk: Any, num_chunks: int, cp_size: int) -> np.ndarray:
    rank = np.asarray(rank_of_chunk)
    if rank.shape != (num_chunks,) or (rank.size and (rank.dtype == bool or not np.issubdtype(rank.dtype, np.integer))):
        raise MaskParamError(f"rank_of_chunk must be {num_chunks} ints, got shape {rank.shape} dtype {rank.dtype}")
    if rank.size and (int(rank.min()) < 0 or int(rank.max()) >= cp_size):
        raise MaskParamError(f"rank_of_chunk holds ranks outside [0, {cp_size})")
    return rank.astype(np.int64, copy=False)


def rank_areas(areas: Any, rank_of_chunk: Any, cp_size: int) -> np.ndarray:
    """Summed mask area of each rank's chunks (exact int64)."""
    arr, cp = _check_areas(areas, cp_size)
    rank = _check_assignment(rank_of_chunk, arr.size, cp)
    loads = np.zeros(cp, dtype=np.int64)
    np.add.at(loads, rank, arr)
    return loads


def imbalance(areas: Any, rank_of_chunk: Any, cp_size: int) -> float:
    """Largest over mean per-rank area: how much longer the slowest rank runs than a perfect split (1.0 is perfect)."""
    loads = rank_areas(areas, rank_of_chunk, cp_size)
    total = int(loads.sum())
    return 1.0 if total == 0 else float(loads.max()) * loads.size / total


def lower_bound(areas: Any, cp_size: int) -> int:
    """No assignment with equal chunk counts has a smaller largest rank area than this: the mean,
    and the rank holding the largest chunk, which also holds k - 1 chunks at least as big as the smallest."""
    arr, cp = _check_areas(areas, cp_size)
    if arr.size == 0:
        return 0
    k = arr.size // cp
    return max(-(-int(arr.sum()) // cp), int(arr.max()) + (k - 1) * int(arr.min()))


def _contiguous(areas: np.ndarray, cp: int) -> np.ndarray:
    return np.repeat(np.arange(cp, dtype=np.int64), areas.size // cp)


def _greedy(areas: np.ndarray, cp: int) -> np.ndarray:
    """The seeds' (MagiAttention's) min-heap: biggest chunk first, to the least loaded rank with room."""
    k = areas.size // cp
    rank = np.empty(areas.size, dtype=np.int64)
    room = [k] * cp
    heap = [(0, r) for r in range(cp)]
    for c in np.argsort(-areas, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        rank[c] = r
        room[r] -= 1
        if room[r]:
            heapq.heappush(heap, (load + int(areas[c]), r))
    return rank


def _improve_by_swaps(areas: np.ndarray, rank: np.ndarray, cp: int, max_steps: int) -> np.ndarray:
    """Exchange a chunk of the most loaded rank m with a chunk of another rank j while that lowers
    the pair's maximum below load[m], taking the exchange that lowers it most. Each step shrinks
    the loads sorted in descending order lexicographically, so the largest load never grows.

    For a chunk b on rank j the best partner a on m moves d = a - b close to (load[m] - load[j]) / 2,
    so one searchsorted of all other chunks into m's sorted chunks finds every best exchange."""
    rank = rank.copy()
    loads = np.zeros(cp, dtype=np.int64)
    np.add.at(loads, rank, areas)
    floor = lower_bound(areas, cp)
    for _ in range(max_steps):
        m = int(loads.argmax())
        if loads[m] <= floor:
            break
        mine = np.flatnonzero(rank == m)
        order = np.argsort(areas[mine], kind="stable")
        mine_sorted = areas[mine][order]
        others = np.flatnonzero(rank != m)
        b = areas[others]
        load_j = loads[rank[others]]
        gap = loads[m] - load_j
        pos = np.searchsorted(2 * mine_sorted, 2 * b + gap)
        cand = np.stack([np.maximum(pos - 1, 0), np.minimum(pos, mine_sorted.size - 1)])
        d = mine_sorted[cand] - b
        new_max = np.maximum(loads[m] - d, load_j + d)  # below loads[m] only when 0 < d < gap
        best = int(new_max.argmin())
        which, i = divmod(best, others.size)
        if new_max[which, i] >= loads[m]:
            break
        a_chunk, b_chunk = mine[order[cand[which, i]]], others[i]
        j = int(rank[b_chunk])
        loads[m] -= d[which, i]
        loads[j] += d[which, i]
        rank[a_chunk], rank[b_chunk] = j, m
    return rank


def solve(areas: Any, cp_size: int, algorithm: str = "swap") -> np.ndarray:
    """rank_of_chunk (int64): `len(areas) // cp_size` chunks per rank; deterministic, so every
    rank computes the same plan on its own. Algorithms:

    - "contiguous": rank r holds chunks [r*k, (r+1)*k); no balancing, the fewest remote keys.
    - "greedy": the seeds' min-heap, the baseline.
    - "swap": greedy, then exchanges that lower the most loaded rank; never worse than greedy.
    - "local": contiguous, then the same exchanges: chunks that need not move stay beside their
      neighbours (fewer remote keys for document and window masks), for a balance near swap's
      that is not guaranteed to match greedy's.
    """
    if algorithm not in ALGORITHMS:
        raise MaskParamError(f"unknown dispatch algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    arr, cp = _check_areas(areas, cp_size)
    start = _greedy(arr, cp) if algorithm in ("greedy", "swap") else _contiguous(arr, cp)
    if algorithm in ("contiguous", "greedy"):
        return start
    return _improve_by_swaps(arr, start, cp, max_steps=2 * arr.size)
