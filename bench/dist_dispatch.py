"""Dispatch solver speed and balance: 1M tokens, cp 64, chunks of 2048.

The plan is rebuilt whenever document boundaries change (every batch), so chunk areas plus the
solver must stay far below a step (target: under 50 ms). Per mask: the median time of
`chunk_areas` and of each algorithm, the imbalance (largest over mean rank area; the lower
bound over the mean is the best any algorithm could reach) and the key/value rows the plan's
communication tables move (`maskc.dist.comm`). Run: `python bench/dist_dispatch.py [--runs 30]`;
appends plan rows (and host rows for the chunk areas) to bench/results (or --out; see
bench/README.md) and prints them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import pack_documents, sample_doc_lengths, timed  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402

from maskc.dist.assign import ALGORITHMS, imbalance, lower_bound, pad, padded_length, solve  # noqa: E402
from maskc.dist.comm import build_comm_tables  # noqa: E402
from maskc.dist.pieces import chunk_areas  # noqa: E402
from maskc.frontend import load  # noqa: E402
from maskc.ir import Mask  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--cp", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args()
    run = Run.start("dist_dispatch", cpu_device(), args.out)

    total = args.tokens
    family = load(ROOT / "examples" / "varlen_block_causal.mask")["varlen_block_causal"]
    masks = {
        "full": Mask.from_cu_seqlens([0, total]),
        "causal": Mask.from_cu_seqlens([0, total], causal=True),
        "varlen block causal (packed)": family.lower(docs=pack_documents(total), block=2048),
        "varlen block causal (4000 docs)": family.lower(docs=sample_doc_lengths(total, 4000), block=2048),
        "sliding window 4096": Mask.sliding_window([0, total], 4096),
    }
    length = padded_length(total, args.chunk, args.cp)
    num_chunks = length // args.chunk
    print(f"{total} tokens padded to {length}, cp {args.cp}, {num_chunks} chunks of {args.chunk}, median of {args.runs} runs")
    print(f"{'mask':32} {'algorithm':11} {'ms':>7} {'imbalance':>10} {'K/V rows moved':>15}")
    for name, mask in masks.items():
        padded = pad(mask, length)
        ms, _, areas = timed(lambda: chunk_areas(padded, args.chunk, num_chunks), args.runs)
        bound = lower_bound(areas, args.cp) * args.cp / max(int(areas.sum()), 1)
        print(f"{name:32} {'areas':11} {ms:7.2f} {'bound ' + format(bound, '.4f'):>10}")
        run.write("host", step=f"chunk areas, {name} ({total:,} tokens, {num_chunks} chunks of {args.chunk})", ms=ms)
        for algorithm in ALGORITHMS:
            ms, _, rank = timed(lambda: solve(areas, args.cp, algorithm), args.runs)
            moved = int(build_comm_tables(padded, args.chunk, rank, args.cp).comm_rows_total)
            balance = float(imbalance(areas, rank, args.cp))
            print(f"{'':32} {algorithm:11} {ms:7.2f} {balance:10.4f} {moved:15,}")
            run.write(
                "plan", mask=name, gpus=args.cp, tokens=total, algorithm=algorithm, chunk=args.chunk,
                imbalance=balance, bound=float(bound), rows_moved=moved, solve_ms=ms,
            )


if __name__ == "__main__":
    main()
