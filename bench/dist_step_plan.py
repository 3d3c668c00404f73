"""Planning one training step's new mask for context parallelism, on one CPU core, as a
DataLoader worker would (issue 59, ask 3: within 20 ms for cp 8-64 at 128k-1M tokens).

Per case (packed varlen causal documents from the real length histogram, `common.pack_documents`,
at cp ranks x tokens), three parts of one rank's planning, each timed from a fresh mask:
`plan` is `maskc.dist.make_plan` (chunk dispatch, communication tables, stages: the same on
every rank), `local` is that rank's stage masks (`execute.local_mask` of each kernel call) and
`sched` their forward and backward tile schedules for an H100 (`maskc.prepare`, 64:8 heads of
128, bf16), which are what the rank's kernels need besides the plan. `step` is their sum, the
host time of one step's new mask on one rank. The process is pinned to one core
(os.sched_setaffinity) and torch to one thread.

Run: `python bench/dist_step_plan.py [--cp 8,16,32,64] [--tokens 131072,262144,524288,1048576]
[--runs 5]`; appends `host` rows (one per part and case) to bench/results (or --out; see bench/README.md) and prints them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import pack_documents  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402

import maskc  # noqa: E402
from maskc.dist import make_plan  # noqa: E402
from maskc.dist.local import kernel_calls, local_mask  # noqa: E402
from maskc.ir import Mask  # noqa: E402
from maskc.runtime import call_plan  # noqa: E402
from maskc.runtime.call_plan import HeadDim  # noqa: E402

TARGET = call_plan.make_target((9, 0), 132, torch.bfloat16, 64, 8, HeadDim(128, 128), False, False, False, None, False)
RANK = 0


def one_step(lengths: np.ndarray, cp: int) -> dict[str, float]:
    """ms of each part of planning a fresh mask of these documents on rank RANK of cp ranks."""
    t0 = time.perf_counter()
    mask = Mask.from_cu_seqlens(np.concatenate([[0], np.cumsum(lengths)]), causal=True)
    plan = make_plan(mask, cp)
    t1 = time.perf_counter()
    masks = [local_mask(plan, RANK, *sources) for sources in kernel_calls(plan)]
    t2 = time.perf_counter()
    for m in masks:
        maskc.prepare(m, TARGET)
    t3 = time.perf_counter()
    return {"plan": (t1 - t0) * 1e3, "local": (t2 - t1) * 1e3, "sched": (t3 - t2) * 1e3, "step": (t3 - t0) * 1e3,
            "calls": len(masks), "chunk": plan.chunk_size}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", default="8,16,32,64")
    parser.add_argument("--tokens", default="131072,262144,524288,1048576")
    parser.add_argument("--runs", type=int, default=5, help="fresh masks timed per case (the median is printed)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    run = Run.start("dist_step_plan", cpu_device(), args.out)
    print(f"{'tokens':>8} {'cp':>3} {'docs':>5} {'chunk':>5} {'calls':>5} {'plan ms':>8} {'local ms':>8} {'sched ms':>8} {'step ms':>8}")
    for tokens in map(int, args.tokens.split(",")):
        for cp in map(int, args.cp.split(",")):
            # Another packing per run: every step's mask is new (no cache on any Mask).
            steps = [one_step(pack_documents(tokens, seed=tokens + run_index), cp) for run_index in range(args.runs + 1)][1:]
            median = {k: float(np.median([s[k] for s in steps])) for k in steps[0]}
            docs = len(pack_documents(tokens, seed=tokens + 1))
            print(f"{tokens:>8} {cp:>3} {docs:>5} {median['chunk']:>5.0f} {median['calls']:>5.0f} {median['plan']:>8.1f} "
                  f"{median['local']:>8.1f} {median['sched']:>8.1f} {median['step']:>8.1f}")  # fmt: skip
            for part in ("plan", "local", "sched", "step"):
                run.write("host", step=f"dist step plan {part}: varlen_causal {tokens} tokens, {docs} docs, cp {cp}, rank {RANK}",
                          ms=median[part], min_ms=min(s[part] for s in steps))  # fmt: skip


if __name__ == "__main__":
    main()
