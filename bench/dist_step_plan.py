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

With `--overlap`, planning moves to where a training loop would do it: a DataLoader with one
worker (pinned to another core) plans batch i + 1 (`maskc.dist.PlanningCollate`, the same
three parts) while the main process runs step i, simulated by sleeping (or, with `--busy`,
spinning) for `--step-ms` (100 by default: less than the attention alone of a 32-layer model in
every case, 32 times the plan's modelled forward + backward on the cost model's H200s, which
the table shows as "attn ms"). Per step it
times the main process's wait for the batch (`next(loader)`: the plan not ready yet, and
unpickling it) and what is left in the step (`installed`: the calls' masks found, their plans'
signatures checked); medians over the steps after the first (the pipeline filling).

Run: `python bench/dist_step_plan.py [--cp 8,16,32,64] [--tokens 131072,262144,524288,1048576]
[--runs 5] [--overlap [--steps 8] [--step-ms MS] [--busy]]`; appends `host` rows (one per part
and case) to bench/results (or --out; see bench/README.md) and prints them.
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
from maskc.dist import PlanningCollate, make_plan  # noqa: E402
from maskc.dist.local import installed, kernel_calls, local_mask  # noqa: E402
from maskc.ir import Mask  # noqa: E402
from maskc.runtime import call_plan  # noqa: E402
from maskc.runtime.call_plan import HeadDim  # noqa: E402

TARGET = call_plan.make_target((9, 0), 132, torch.bfloat16, 64, 8, HeadDim(128, 128), False, False, False, None, False)
RANK = 0
LAYERS = 32  # "attn ms": this many layers' attention, forward and backward, as the cost model has it


def documents_mask(lengths: np.ndarray) -> Mask:
    return Mask.from_cu_seqlens(np.concatenate([[0], np.cumsum(lengths)]), causal=True)


def one_step(lengths: np.ndarray, cp: int) -> dict[str, float]:
    """ms of each part of planning a fresh mask of these documents on rank RANK of cp ranks."""
    t0 = time.perf_counter()
    plan = make_plan(documents_mask(lengths), cp)
    t1 = time.perf_counter()
    masks = [local_mask(plan, RANK, *sources) for sources in kernel_calls(plan)]
    t2 = time.perf_counter()
    for m in masks:
        maskc.prepare(m, TARGET)
    t3 = time.perf_counter()
    return {"plan": (t1 - t0) * 1e3, "local": (t2 - t1) * 1e3, "sched": (t3 - t2) * 1e3, "step": (t3 - t0) * 1e3,
            "calls": len(masks), "chunk": plan.chunk_size}  # fmt: skip


class Packings(torch.utils.data.Dataset):
    """Step i's documents: another packing of `tokens` every step (the one-core runs' seeds)."""

    def __init__(self, tokens: int, steps: int) -> None:
        self.tokens, self.steps = tokens, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"lengths": torch.from_numpy(pack_documents(self.tokens, seed=self.tokens + i))}


def batch_mask(batch: dict[str, torch.Tensor]) -> Mask:
    return documents_mask(batch["lengths"][0].numpy())


def pin_worker(worker_id: int) -> None:
    """The loader's worker on the last core, the main process on the first (a core each where there are two)."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0) | WORKER_CORES)})
    torch.set_num_threads(1)


WORKER_CORES: set[int] = set()


def overlapped(tokens: int, cp: int, steps: int, step_ms: float, busy: bool) -> dict[str, list[float]]:
    """Per step after the first: ms the main process waited for its batch, ms left in the step
    (installing the prepared plan), and the modelled attention ms of a LAYERS-layer model."""
    loader = torch.utils.data.DataLoader(Packings(tokens, steps + 1), batch_size=1, num_workers=1, prefetch_factor=1,
                                         collate_fn=PlanningCollate(batch_mask, cp, RANK, TARGET), worker_init_fn=pin_worker)  # fmt: skip
    out: dict[str, list[float]] = {"wait": [], "in step": [], "attn": []}
    batches = iter(loader)
    for i in range(steps + 1):
        t0 = time.perf_counter()
        prepared = next(batches)["cp_plan"]
        t1 = time.perf_counter()
        installed(prepared)
        t2 = time.perf_counter()
        end = t2 + step_ms / 1e3
        if busy:
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(step_ms / 1e3)
        if i:  # the first batch waits for the worker to start and plan it
            out["wait"].append((t1 - t0) * 1e3)
            out["in step"].append((t2 - t1) * 1e3)
            out["attn"].append(LAYERS * (prepared.plan.stages.time_fwd + prepared.plan.stages.time_bwd) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", default="8,16,32,64")
    parser.add_argument("--tokens", default="131072,262144,524288,1048576")
    parser.add_argument("--runs", type=int, default=5, help="fresh masks timed per case (the median is printed)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    parser.add_argument("--overlap", action="store_true", help="plan in a DataLoader worker beside a simulated step")
    parser.add_argument("--steps", type=int, default=8, help="--overlap: steps timed per case (after one to fill the pipeline)")
    parser.add_argument("--step-ms", type=float, default=100.0, help="--overlap: the simulated step's ms (default 100)")
    parser.add_argument("--busy", action="store_true", help="--overlap: spin through the step instead of sleeping")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    WORKER_CORES.add(cores[-1])
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    run = Run.start("dist_step_plan", cpu_device(), args.out)
    if args.overlap:
        run_overlapped(run, args)
        return
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



def run_overlapped(run: Run, args: argparse.Namespace) -> None:
    """The --overlap mode: one row per case of the main process's wait and of what is left in the step."""
    how = "spinning" if args.busy else "sleeping"
    step = f"{args.step_ms:g} ms"
    print(f"planning in a DataLoader worker (one core) beside a step of {step} ({how}); median ms over {args.steps} steps (max)")
    print(f"{'tokens':>8} {'cp':>3} {'docs':>5} {'attn ms':>9} {'wait ms':>14} {'in step ms':>14}")
    for tokens in map(int, args.tokens.split(",")):
        for cp in map(int, args.cp.split(",")):
            times = overlapped(tokens, cp, args.steps, args.step_ms, args.busy)
            docs = len(pack_documents(tokens, seed=tokens + 1))
            wait, left, attn = (np.asarray(times[k]) for k in ("wait", "in step", "attn"))
            print(f"{tokens:>8} {cp:>3} {docs:>5} {np.median(attn):>9.0f} {f'{np.median(wait):.2f} ({wait.max():.2f})':>14} "
                  f"{f'{np.median(left):.2f} ({left.max():.2f})':>14}")  # fmt: skip
            case = f"varlen_causal {tokens} tokens, {docs} docs, cp {cp}, rank {RANK}, planned in a DataLoader worker beside a step of {step} ({how})"
            run.write("host", step=f"dist step plan overlapped, the step's wait for its plan: {case}",
                      ms=float(np.median(wait)), min_ms=float(wait.min()))  # fmt: skip
            run.write("host", step=f"dist step plan overlapped, left in the step (installing the plan): {case}",
                      ms=float(np.median(left)), min_ms=float(left.min()))  # fmt: skip


if __name__ == "__main__":
    main()
