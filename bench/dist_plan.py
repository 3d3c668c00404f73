"""Context-parallel plans for the seeds' masks: balance and communication per dispatch algorithm.

For full, causal, varlen full, varlen causal and varlen block causal masks at cp 8, 16, 32 and
64 with 8k tokens per rank (documents from the real length histogram, `common.pack_documents`),
prints per algorithm the imbalance (max / mean rank area), the largest rank area against the
lower bound, the K/V rows maskc's tables move against ring P2P and all-gather, the chosen
stage count and whether stage 1 is fused into the local call, the modelled forward and
backward time (the cost model's defaults: an H200 with NVLink), plus the planning time.
Run: `python bench/dist_plan.py [--cp 8,16,32,64] [--tokens-per-rank 8192] [--algorithms swap]`;
appends plan rows to bench/results (or --out; see bench/README.md) and prints them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import pack_documents  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402

from maskc.dist.assign import ALGORITHMS  # noqa: E402
from maskc.dist.plan import make_plan  # noqa: E402
from maskc.frontend import load  # noqa: E402
from maskc.ir import Mask  # noqa: E402

MASKS = ("full", "causal", "varlen_full", "varlen_causal", "varlen_block_causal")
BLOCK = 2048


def seed_mask(name: str, seqlen: int) -> Mask:
    """The example mask `name` at `seqlen` tokens (varlen ones over the real length histogram)."""
    params = {"full": {"n": seqlen}, "causal": {"n": seqlen}}.get(name)
    if params is None:
        params = {"docs": pack_documents(seqlen, seed=seqlen)}
        if name == "varlen_block_causal":
            params["block"] = BLOCK
    return load(ROOT / "examples" / f"{name}.mask")[name].lower(**params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", default="8,16,32,64")
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args()
    run = Run.start("dist_plan", cpu_device(), args.out)
    print(
        f"{'mask':20} {'cp':>3} {'algorithm':10} {'imbalance':>9} {'max/LB':>7} {'maskc rows':>12} "
        f"{'ring rows':>12} {'allgather rows':>14} {'stages':>6} {'fused':>5} {'fwd ms':>7} {'bwd ms':>7} {'plan ms':>8}"
    )
    for cp in map(int, args.cp.split(",")):
        seqlen = cp * args.tokens_per_rank
        for name in MASKS:
            mask = seed_mask(name, seqlen)
            for algorithm in args.algorithms.split(","):
                start = time.perf_counter()
                plan = make_plan(mask, cp, args.chunk_size, algorithm=algorithm)
                ms = (time.perf_counter() - start) * 1e3
                s = plan.summary()
                print(
                    f"{name:20} {cp:>3} {algorithm:10} {s['imbalance']:9.4f} {s['max_area'] / max(s['lower_bound'], 1):7.4f} "
                    f"{s['comm_rows_total']:12,} {s['ring_p2p_rows_total']:12,} {s['allgather_rows_total']:14,} "
                    f"{s['num_stages']:>6} {'yes' if s['fuse_local'] else 'no':>5} {s['modelled_forward_s'] * 1e3:7.2f} "
                    f"{s['modelled_backward_s'] * 1e3:7.2f} {ms:8.1f}",
                    flush=True,
                )
                run.write(
                    "plan", mask=name, gpus=cp, tokens=seqlen, algorithm=algorithm, chunk=s["chunk_size"],
                    imbalance=s["imbalance"], max_over_bound=s["max_area"] / max(s["lower_bound"], 1),
                    rows_moved=s["comm_rows_total"], ring_rows=s["ring_p2p_rows_total"], allgather_rows=s["allgather_rows_total"],
                    stages=s["num_stages"], fused=s["fuse_local"], model_fwd_ms=s["modelled_forward_s"] * 1e3,
                    model_bwd_ms=s["modelled_backward_s"] * 1e3, plan_ms=ms,
                )


if __name__ == "__main__":
    main()
