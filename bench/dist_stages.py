"""Plan the overlap stages of a 1M-token varlen causal mask over 64 ranks: the modelled times of
1..8 stages, each with the local call apart and fused with stage 1, with the default cost
model, and how long planning takes.

Run: `python bench/dist_stages.py`; appends stages rows (and a host row for the planning time)
to bench/results (or --out; see bench/README.md) and prints them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import sample_doc_lengths, timed  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402

from maskc.dist.comm import remote_keys  # noqa: E402
from maskc.dist.pieces import cut  # noqa: E402
from maskc.dist.stages import CostModel, plan_stages  # noqa: E402
from maskc.ir import Mask  # noqa: E402

TOTAL = 1 << 20
CP = 64
CHUNK = 2048
MASK = "varlen causal, 4,000 documents, zigzag dispatch"


def zigzag(num_chunks: int, cp_size: int) -> np.ndarray:
    """Chunks dealt 0..cp-1 then cp-1..0, round after round: equal counts, causal work balanced."""
    position = np.arange(num_chunks) % cp_size
    return np.where(np.arange(num_chunks) // cp_size % 2 == 0, position, cp_size - 1 - position)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args()
    run = Run.start("dist_stages", cpu_device(), args.out)
    cu = np.r_[0, np.cumsum(sample_doc_lengths(TOTAL, 4000))]
    pieces = cut(Mask.from_cu_seqlens(cu, causal=True), CHUNK)
    rank_of_chunk = zigzag(TOTAL // CHUNK, CP)
    remote = remote_keys(pieces, CHUNK, rank_of_chunk, CP)
    cost = CostModel()
    ms, _, plan = timed(lambda: plan_stages(pieces, rank_of_chunk, CP, remote, cost, chunk_size=CHUNK), args.runs)
    rows = np.array([int((r[:, 1] - r[:, 0]).sum()) for r in remote])
    print(f"1M varlen causal (4000 docs), cp {CP}, chunk {CHUNK}, zigzag: remote rows {rows.sum():,} in all, "
          f"{rows.max():,} on the busiest rank; default CostModel")
    print(f"{'stages':>6} {'fused':>5} {'fwd ms':>8} {'bwd ms':>8} {'total ms':>9}")
    for n, fused, fwd, bwd in plan.scan:
        chosen = (n, fused) == (plan.num_stages, plan.fuse_local)
        print(f"{n:>6} {'yes' if fused else 'no':>5} {fwd * 1e3:8.3f} {bwd * 1e3:8.3f} {(fwd + bwd) * 1e3:9.3f}{'  <- chosen' if chosen else ''}")
        run.write(
            "stages", mask=MASK, gpus=CP, tokens=TOTAL, chunk=CHUNK, stages=int(n), fused=bool(fused),
            model_fwd_ms=fwd * 1e3, model_bwd_ms=bwd * 1e3, chosen=chosen,
        )
    one = plan_stages(pieces, rank_of_chunk, CP, remote, cost, 1, chunk_size=CHUNK, fuse_local=True)
    busiest = {d: one.compute_time(d).max() * 1e3 for d in ("fwd", "bwd")}
    overhead = {d: cost.call_overhead(one.rows_per_rank, d) * 1e3 for d in ("fwd", "bwd")}
    print(f"compute of the busiest rank: fwd {busiest['fwd']:.3f} ms, bwd {busiest['bwd']:.3f} ms; "
          f"one-stage fetch {one.comm_time()[0] * 1e3:.3f} ms; an extra call fwd {overhead['fwd']:.3f} ms, "
          f"bwd {overhead['bwd']:.3f} ms")
    print(f"planning 1..8 stages, fused and not: {ms:.1f} ms median of {args.runs}")
    run.write("host", step=f"overlap stages of a plan, 1..8 stages fused and not ({MASK}, cp {CP}, chunks of {CHUNK})", ms=ms)


if __name__ == "__main__":
    main()
