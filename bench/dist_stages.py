"""Plan the overlap stages of a 1M-token varlen causal mask over 64 ranks: the modelled times of
1..8 stages, each with the local call apart and fused with stage 1, with the default cost
model, and how long planning takes."""

from __future__ import annotations

import numpy as np

from maskc.dist.comm import remote_keys
from maskc.dist.pieces import cut
from maskc.dist.stages import CostModel, plan_stages
from maskc.ir import Mask

from common import sample_doc_lengths, timed

TOTAL = 1 << 20
CP = 64
CHUNK = 2048


def zigzag(num_chunks: int, cp_size: int) -> np.ndarray:
    """Chunks dealt 0..cp-1 then cp-1..0, round after round: equal counts, causal work balanced."""
    position = np.arange(num_chunks) % cp_size
    return np.where(np.arange(num_chunks) // cp_size % 2 == 0, position, cp_size - 1 - position)


def main() -> None:
    cu = np.r_[0, np.cumsum(sample_doc_lengths(TOTAL, 4000))]
    pieces = cut(Mask.from_cu_seqlens(cu, causal=True), CHUNK)
    rank_of_chunk = zigzag(TOTAL // CHUNK, CP)
    remote = remote_keys(pieces, CHUNK, rank_of_chunk, CP)
    cost = CostModel()
    ms, _, plan = timed(lambda: plan_stages(pieces, rank_of_chunk, CP, remote, cost, chunk_size=CHUNK), 20)
    rows = np.array([int((r[:, 1] - r[:, 0]).sum()) for r in remote])
    print(f"1M varlen causal (4000 docs), cp {CP}, chunk {CHUNK}, zigzag: remote rows {rows.sum():,} in all, "
          f"{rows.max():,} on the busiest rank; default CostModel")
    print(f"{'stages':>6} {'fused':>5} {'fwd ms':>8} {'bwd ms':>8} {'total ms':>9}")
    for n, fused, fwd, bwd in plan.scan:
        mark = "  <- chosen" if (n, fused) == (plan.num_stages, plan.fuse_local) else ""
        print(f"{n:>6} {'yes' if fused else 'no':>5} {fwd * 1e3:8.3f} {bwd * 1e3:8.3f} {(fwd + bwd) * 1e3:9.3f}{mark}")
    one = plan_stages(pieces, rank_of_chunk, CP, remote, cost, 1, chunk_size=CHUNK, fuse_local=True)
    busiest = {d: one.compute_time(d).max() * 1e3 for d in ("fwd", "bwd")}
    overhead = {d: cost.call_overhead(one.rows_per_rank, d) * 1e3 for d in ("fwd", "bwd")}
    print(f"compute of the busiest rank: fwd {busiest['fwd']:.3f} ms, bwd {busiest['bwd']:.3f} ms; "
          f"one-stage fetch {one.comm_time()[0] * 1e3:.3f} ms; an extra call fwd {overhead['fwd']:.3f} ms, "
          f"bwd {overhead['bwd']:.3f} ms")
    print(f"planning 1..8 stages, fused and not: {ms:.1f} ms median of 20")


if __name__ == "__main__":
    main()
