"""Regenerate docs/performance.md from the rows in bench/results (see bench/README.md).

`python bench/report.py` rewrites the page; `--check` only says whether it is up to date (exit
status 1 if not); `--plots` also redraws its figures under docs/img (needs matplotlib). The page
is a function of the rows alone, byte for byte, so a test can check it; the figures are redrawn
on request only, and carry the id of the run they show, which the test checks too.

For every implementation and configuration the page shows the newest measurement: the tables
of every run that holds one, newest first, each with the baselines measured in that run.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from record import HOST_IMPLS, HOST_PASSES, RESULTS, ROOT, key, read_results

DOC = ROOT / "docs" / "performance.md"
IMG = ROOT / "docs" / "img"
#: The implementations the page shows, with their column titles; other rows (forced plans,
#: SM-margin sweeps) stay in the results for the design notes.
KERNEL_IMPLS = {
    "maskc": "maskc",
    "maskc_det": "maskc deterministic",
    "maskc_portable": "maskc portable",
    "fa4": "FA4",
    "sdpa_cudnn": "cuDNN",
    "sdpa_flash": "SDPA flash",
    "flex": "FlexAttention",
    "flex_fa4": "Flex on FA4",
    "fa4_mask_mod": "FA4 mask_mod",
}
DIST_IMPLS = {"maskc": "maskc", "torch_ring": "PyTorch ring CP", "flex_allgather": "all-gather + FlexAttention"}
#: The implementations of the training steps (Transformers' attn_implementation names).
TRAIN_IMPLS = {"maskc": "maskc", "flash_attention_4": "FA4", "flash_attention_2": "FA2", "flex_attention": "FlexAttention",
               "sdpa": "SDPA"}  # fmt: skip
KERNEL_PLOT = "kernel.png"
DIST_PLOT = "dist_scaling.png"
PLOT_SEQLENS = (16384, 65536)
#: The head dim of the kernel figure (the page's settings), in a run that measured several.
PLOT_HEAD_DIM = 128
#: The settings' dtype and heads (query:kv): tables of others name them in their heading.
DTYPE, HEADS = "bf16", "64:8"
DASH = "—"
#: The directions' names in prose.
DIRECTION_NAMES = {"fwd": "forward", "bwd": "backward"}

INTRO = """\
# How fast maskc is

Throughput of maskc's attention kernels beside FlashAttention-4 (FA4), cuDNN and
FlashAttention-2 (both through PyTorch's SDPA) and FlexAttention, and of its context
parallelism beside PyTorch's, with the host time maskc spends each time the mask changes.
Every library in a table was measured in the same run on the same device. A run on one GPU
differs from the next by about 3%, so compare numbers within one table.

This page is generated from the rows in `bench/results/` by `python bench/report.py`; every
benchmark appends its rows there (`bench/README.md`). For each implementation and
configuration it shows the newest measurement: each table is one run, newest first, and an
older run keeps its table while it holds the newest figure of something (a library the newer
runs did not measure, say).

**Settings** (those of MagiAttention's benchmarks): one sequence of 1k to 64k tokens, 64 query
heads and 8 key/value heads (GQA), head dim 128 unless a table names another (192/128: q and k
192, v 128), bf16. Variable-length ("varlen") masks pack documents whose lengths are drawn from
a real long-context corpus (`bench/data/`), each at most a quarter of the sequence;
block-causal blocks are 1024 tokens; in the sliding window each query sees the 1024 keys up to
itself. Two masks no other library has a kernel for: the shared question (an eighth of the
sequence is a question every answer sees; the answers, packed documents, are causal and never
see each other) and global + window (256 global tokens that see and are seen by all, and a
window of 512 keys on each side of every query). TFLOP/s count the mask's exact area: forward
`2 * area * Hq * (D_qk + D_v)` (`4 * area * Hq * D` when they are equal), backward 2.5 times that. A dash: the library has no kernel for
that mask, or the run did not measure it; "failed": the library has no kernel for that head
dim or direction (the row's error says which).

## Reproducing

Compile the kernels (on any machine), then run the benchmarks on the GPU machine:

```bash
maskc compile examples/full.mask -o kernels --head-dim 128 --heads 64:8 --dtype bf16 --bundle-runtime
python3 bench/kernel.py --artifacts kernels --seqlens 16384,65536 --backward
torchrun --nproc-per-node 4 bench/dist.py --artifacts kernels
python3 bench/report.py --plots
```

`maskc compile` with `--deterministic` or `--portable` adds those kernels, which
`bench/kernel.py --deterministic` / `--portable` measure; `python3 bench/step.py` times a
compiled training step with a new mask every step. `bench/lower.py`,
`bench/schedule.py`, `bench/step_host.py`, `bench/dist_plan.py`, `bench/dist_dispatch.py` and
`bench/dist_stages.py` measure the host side on any machine. Each script's `--help` says what it
measures.
"""


ONE_GPU = """\
## One GPU

`bench/kernel.py`: maskc's kernels for Hopper (`maskc`; `maskc deterministic` with
`deterministic=True`) and the portable kernels every NVIDIA GPU since Ampere runs (`maskc
portable`, measured with `portable=True` on the same GPU), beside the libraries that express
each mask natively, and the libraries that take any mask as a `mask_mod` over block-sparse
tiles: FlexAttention under `torch.compile` on its Triton backend and on FA4's
(`kernel_options={"BACKEND": "FLASH"}`), and FA4's own `mask_mod` with the same block-sparse
tiles. Every library's output and gradients are checked against maskc's on the same inputs
before it is timed (a library that computes other attention records that instead of a time).
The backward is `out.backward` timed alone. `maskc / FA4` is maskc's TFLOP/s over FA4's on the
same line (forward / backward), `maskc / flexible` over the fastest flexible-mask library's,
`maskc / full` over maskc's own on the full mask of the same length: below 1 in the first, FA4
is the faster there ("Short of the targets" below lists every line below its target and what
holds maskc back); the last says what a mask's shape costs. A table of another dtype (fp16) or head count (64:64, MHA; 64:1, MQA) than the
settings' names it in its heading; fp16 runs the bf16 kernels' code with the other element
type, and measures as bf16 does.
"""

SEVERAL_GPUS = """\
## Several GPUs: context parallelism

`bench/dist.py`: `maskc.dist.attention` with one process per GPU (NCCL) and 16k tokens per GPU,
the masks above over all the GPUs' tokens, beside PyTorch's ring context parallelism
(`context_parallel` over SDPA, full and causal only) and every rank all-gathering the keys and
values before FlexAttention. Per-GPU TFLOP/s: the whole mask's FLOPs over the GPUs, in the
slowest rank's median time.
"""

TRAIN = """\
## Training steps in Hugging Face Transformers

`bench/train_step.py`: training steps (forward with labels, backward, fused AdamW) of a
Llama-style model through Transformers' `attn_implementation`, on one packed row of documents
with real lengths, each implementation given the documents the way it takes them: maskc, FA4 and
FA2 the `position_ids` alone, FlexAttention a document BlockMask, SDPA a dense boolean S x S
mask. Each cell: tokens per second, ms per step (median) and peak memory (weights, gradients and
optimizer states included); "failed": the implementation could not run the row
(out of memory, not installed) or its first forward differed from maskc's (the row's error says
which).
"""

#: maskc's target on an irregular mask (every mask but STANDARD_MASKS), and on any mask no peer
#: has a kernel for: this share of its own TFLOP/s on the full mask of the same length.
OWN_FULL_TARGET = 0.92
#: The masks every attention library has; the others are irregular.
STANDARD_MASKS = ("full", "causal")
#: The libraries whose kernels maskc's are held against, mask by mask: the faster of those that
#: ran the mask sets the target (FA4 has every benchmark mask but three, SDPA cuDNN full and causal).
PEERS = ("fa4", "sdpa_cudnn")
#: The libraries that take any mask (as a mask_mod over block-sparse tiles): on an irregular
#: mask, maskc's target is FLEXIBLE_TARGET times the fastest of those that ran it.
FLEXIBLE_PEERS = ("flex", "flex_fa4", "fa4_mask_mod")
FLEXIBLE_TARGET = 1.15
#: What a ratio is held against (`ratios`): a peer's name, OWN_FULL or FLEXIBLE.
OWN_FULL, FLEXIBLE = "full", "flexible"
#: The sequence lengths the speed and memory targets are set at (the seeds' 16k and 64k).
TARGET_SEQLENS = (16384, 65536)

SHORT = """\
## Short of the targets

maskc's targets: at least the TFLOP/s of the faster of FA4 and cuDNN on every mask either has
a kernel for; on every mask but full and causal, and on any mask neither has, at least 92% of
its own full-mask TFLOP/s at the same length; on every mask but full and causal, at least 1.15
times the fastest flexible-mask library (FlexAttention on either backend, FA4's mask_mod); no
more peak memory for a forward + backward, and no more host time per call, than the lowest
of the other libraries in the same run; at 16k and 64k tokens. What falls short in the newest
measurement of each head dim, mask and length beside FA4 or cuDNN (the runs named), and in
the newest host-time run (maskc's figure over the target's, named by the faster library):
"""

LIMITS = """\
What holds these back, as measured so far:

- The backward against FA4: its block loop's warps wait longer than FA4's (warp-state sampling
  on full 16k at d=128: 11.6 cycles per issued instruction against 10.7, the excess on
  shared-memory and fixed-latency dependencies), and at 64k it moves more DRAM traffic than
  FA4: its items (a k tile and all eight query heads of a K/V head) run thousands of steps,
  over which the CTAs drift apart until L2 no longer holds the rows they walk. At d=256 the
  CTAs keep pace with each other (at 64k +10-18%, and 2-10% more since within 32 steps
  rather than 128 of the mean); at d=96 and 128 that gains 0-2% (d=96 full 64k 8%), at d=64
  and 192 nothing, and d=192's causal backward reads twice FA4's DRAM bytes at 16k, its (long,
  short) item pairs meeting each q block twice a round (`docs/design/backward-order.md`,
  `docs/design/fa4-comparison.md`, `docs/design/backward-dq.md`).
- The varlen masks: the backward's k tiles and q blocks and the forward's k blocks start at
  each document, as FA4's tiles do (varlen full at d=128 16k: 0.89 of FA4's backward before
  the k tiles, 0.97 since; the q blocks +1-7% more, most at d=64; the forward +1.5-3% at
  d=128), and so do the forward's q tiles but under PackGQA, whose 16-token tiles straddle
  few documents (`docs/design/document-tiles.md`).
- The backward at d=256 on varlen full at 16k: 64-key tiles with the head dims split between
  the warpgroups, P^T and dS^T through shared memory, dO in one stage and dQ staged in halves
  to fit; Nsight Compute (before its k tiles started at each document) put its 7% more cycles
  than FA4's on the fixed grid's partial tiles (2% more tensor work), L2 (84% hits against
  98%) and 1.5% between the busiest SM and the mean. At d=192 and 192/128 the backward has FA4's formulation (96-key tiles, S with the
  queries on the wgmma M axis); there causal and the varlen masks still trail FA4 by 4-18%:
  the (long, short) item pairs read twice FA4's DRAM bytes on causal (above), each block waits
  at two barriers of both warpgroups around its one dS^T buffer (a second buffer, or a second
  dO stage, cost more than it saved), and the masked kernel costs about 1% on full blocks
  (`docs/design/head-dims.md`, `docs/design/backward-order.md`).
- Masks with many partial blocks against the full mask: each partial block computes and
  applies its keep masks (an item's lines past the registers' slots come from global memory
  inside the block loop), and a window leaves every q tile few blocks to spread its prologue
  and epilogue over (`docs/design/backward-order.md`): in the runs that measured both at
  d=128, FA4's own sliding window runs at 0.66-0.79 of its full mask, maskc's at 0.74-0.77
  at 64:8. Whole tiles also bound these masks: of
  the elements in the tiles a mask touches (the forward's chosen tile, 16 tokens a tile under
  PackGQA; the backward's) it keeps 91-96% for global + window, 93-97% for the shared question
  and 98-99% for varlen block causal at 16k, 98-99% for both at 64k; the full mask 99-100%
  (`bench/fill.py`). Where that share is near 92%, the target asks partial blocks to cost no
  more than full ones.
- Packed documents at 16k, beyond what the tiles keep: a document's q tiles walk few k blocks,
  so each tile's fixed costs (its Q load, the first and last blocks' waits, the output's store)
  weigh more, and every library pays that. In the runs above at 16k and d=128, FA4's own varlen
  full runs at 0.91 / 0.95 of its full mask (forward / backward) and its varlen causal at 0.82
  / 0.80 (maskc's tiles keep 99% and 96% of these masks' elements); maskc's varlen block
  causal (99% kept) runs at 0.88 / 0.89, beside its varlen full at 0.90 / 0.93. At 64k, where
  documents hold more tiles, the same masks run at 0.95-1.01 of the full mask.
- Other head counts (`docs/design/head-counts.md`): with one query head a K/V head (64:64) the
  forward has no heads to pack; its q tiles start at each document (varlen full 0.81 of FA4's
  forward before, 0.94 since; varlen block causal 0.77 of the full mask's before, 0.84 since);
  its backward writes dK and dV instead of adding them into zeroed buffers, which took 1-8%
  off the short masks' backward (`docs/design/document-tiles.md`); what keeps the rest below
  FA4 is not measured (MHA's varlen causal backward moves by up to 20% from run to run; its
  items, one query head's k tile each, are short, and the deal prices their boundaries per query
  head walked, 8 times lower than 64:8's: dealt with a boundary of fixed time its busiest CTA
  would carry 1-5% less on the short masks, by the model); with one K/V head (64:1) a 16k mask has about one backward item per CTA, so the deal cuts
  every item into pieces of 8 or 32 query heads, dealt and paired as the items of more K/V
  heads would be (backward 0.90-0.96 of FA4, varlen causal from 0.59 with one-head pieces;
  what holds the rest is not measured).
- Memory: the peak holds the backward's float32 dQ accumulator. The forward writes the lse
  its backward loads, which keeps it instead of lse, so where q and v have one head dim maskc's
  peak is FlexAttention's. At 192/128 the accumulator's 192 float32 columns add 128 bytes per
  query row and head over FlexAttention's peak (`docs/design/backward-dq.md`).
- Host time: maskc's autograd node, buffers and launches run in Python, cuDNN's in C++, and each
  of maskc's launches encodes its TMA descriptors anew. No piece is large: a profile
  (`bench/host_profile.py`) spreads a forward + backward over the launches (17%), the autograd
  engine (15%), allocations and fills (16%) and a dozen pieces of 2-9%; reaching cuDNN needs
  them in C++ together (`docs/design/host-time.md`). Measured with no GPU
  (`bench/host_python.py`), maskc's own Python is about 15 us of a forward (30 with gradients)
  and 85 of a backward, on top of the 57 autograd costs any Python op for a forward + backward.
"""

HOST = """\
## Host time

What maskc does on the CPU: each `maskc.attention` call, and each time the mask changes
(lowering it, its tile schedules, a context-parallel plan; `bench/step_host.py`: all a new mask
costs a training step, planned in the op or ahead of time by `maskc.prepare`). Medians unless
the step says otherwise; the newest measurement of each step. `bench/step.py` times what that
host work costs a compiled training step on the GPU (wall time per step, steps back to back):
the same masks planned before, new in every step, or prepared ahead.
"""

PLANS = """\
## Context-parallel plans

How `maskc.dist.make_plan` splits a mask over many ranks, computed on the CPU: the balance (the
largest rank's mask area over the mean), the key/value rows its tables move beside ring P2P
and all-gather on the same dispatch, the overlap stages its cost model picks and the times the
model predicts (an H200-class GPU on NVLink); then the model's times of every stage count for
one mask. These are modelled, not measured on GPUs; only the planning times are measured.
"""
PLAN_FIELDS = ("mask", "gpus", "tokens", "chunk", "algorithm", "imbalance", "bound", "max_over_bound", "rows_moved",
               "ring_rows", "allgather_rows", "stages", "fused", "model_fwd_ms", "model_bwd_ms", "plan_ms", "solve_ms")
STAGES_FIELDS = ("mask", "gpus", "tokens", "chunk", "stages", "fused", "model_fwd_ms", "model_bwd_ms", "chosen")


#: The start time in a run's name (`Run.start`: `<date>T<hhmmss>Z-<commit>`).
RUN_TIME = re.compile(r"\d{4}-\d\d-\d\dT(\d{6})Z-")


def run_order(rows: Sequence[dict]) -> dict[str, tuple[str, str, int]]:
    """Each run's place in time: its date, the start time its name records (older names have
    none and come first), then where its first row comes in the files. The files are read kind
    by kind, so by position alone a run with host rows would come before one of the same day
    without them."""
    order: dict[str, tuple[str, str, int]] = {}
    for index, row in enumerate(rows):
        if row["run"] not in order:
            started = RUN_TIME.match(row["run"])
            order[row["run"]] = (row["date"], started.group(1) if started else "", index)
    return order


def latest(rows: Sequence[dict], kind: str) -> dict[tuple, dict]:
    """The newest measurement (not an error) of each configuration of `kind`."""
    order = run_order(rows)
    newest: dict[tuple, dict] = {}
    for row in sorted((r for r in rows if r["kind"] == kind and "error" not in r), key=lambda r: order[r["run"]]):
        newest[key(row)] = row
    return newest


def current_runs(rows: Sequence[dict], kind: str, impls: Iterable[str] | None = None) -> list[str]:
    """The runs holding the newest measurement of some configuration of `kind` (of one of
    `impls`), newest first."""
    order = run_order(rows)
    held = {row["run"] for row in latest(rows, kind).values() if impls is None or row["impl"] in impls}
    return sorted(held, key=lambda run: order[run], reverse=True)


def of_run(rows: Sequence[dict], run: str, kind: str) -> list[dict]:
    return [row for row in rows if row["run"] == run and row["kind"] == kind]


def markdown_table(header: Sequence[str], lines: Iterable[Sequence[str]], right: Iterable[int]) -> list[str]:
    """A markdown table whose columns `right` (numbers) are right-aligned."""
    right = set(right)
    align = ["---:" if i in right else "---" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|", *("| " + " | ".join(line) + " |" for line in lines)]


def tokens(n: int) -> str:
    """16384 -> '16k' (sequence lengths in the tables)."""
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def number(value: float) -> str:
    """A measured time or ratio with about three significant digits, never in exponent form."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def direction_cell(rows: Sequence[dict], directions: Sequence[str]) -> str:
    """'fwd / bwd' TFLOP/s of one implementation on one configuration, for the `directions`
    its table has: a dash for one it lacks (a run cut short), one dash where it has none."""
    by_direction = {row["direction"]: row for row in rows}
    if not by_direction:
        return DASH
    parts = []
    for direction in directions:
        row = by_direction.get(direction)
        parts.append(DASH if row is None else "failed" if "error" in row else f"{row['tflops']:.0f}")
    return " / ".join(parts)


def ratio_cell(ours: Sequence[dict], theirs: Sequence[dict], directions: Sequence[str]) -> str:
    """`ours`' TFLOP/s over `theirs`' for the `directions` of the table, 'fwd / bwd'; a dash
    where either lacks a direction (or failed it), one dash where either has none."""
    mine = {row["direction"]: row["tflops"] for row in ours if "error" not in row}
    other = {row["direction"]: row["tflops"] for row in theirs if "error" not in row}
    if not mine or not other:
        return DASH
    return " / ".join(f"{mine[d] / other[d]:.2f}" if d in mine and d in other else DASH for d in directions)


def fastest(line: Sequence[dict], impls: Sequence[str]) -> list[dict]:
    """Per direction, the row of the fastest of `impls` on a line (those that ran it)."""
    best: dict[str, dict] = {}
    for row in line:
        if row["impl"] in impls and "error" not in row and row["tflops"] > best.get(row["direction"], {"tflops": 0})["tflops"]:
            best[row["direction"]] = row
    return list(best.values())


def ratio_columns(kernel: Sequence[dict]) -> dict[str, Callable[[list[dict], Sequence[str]], str]]:
    """The columns that say where maskc stands: its TFLOP/s over FA4's on the same line, and
    over its own on the full mask of the same length (each where the run measured both)."""
    def impl_rows(line: list[dict], impl: str) -> list[dict]:
        return [row for row in line if row["impl"] == impl]

    columns: dict[str, Callable[[list[dict], Sequence[str]], str]] = {}
    impls = {row["impl"] for row in kernel}
    if {"maskc", "fa4"} <= impls:
        columns["maskc / FA4"] = lambda line, dirs: ratio_cell(impl_rows(line, "maskc"), impl_rows(line, "fa4"), dirs)
    if "maskc" in impls and impls.intersection(FLEXIBLE_PEERS):
        columns["maskc / flexible"] = lambda line, dirs: ratio_cell(impl_rows(line, "maskc"), fastest(line, FLEXIBLE_PEERS), dirs)
    full: dict[int, list[dict]] = defaultdict(list)
    for row in kernel:
        if row["impl"] == "maskc" and row["mask"] == "full":
            full[row["seqlen"]].append(row)
    if full and any(row["mask"] != "full" for row in kernel):
        columns["maskc / full"] = lambda line, dirs: ratio_cell(impl_rows(line, "maskc"), full.get(line[0]["seqlen"], []),
                                                               dirs)  # fmt: skip
    return columns


def attention_table(
    rows: Sequence[dict], size: str, impls: dict[str, str],
    extra: dict[str, Callable[[list[dict], Sequence[str]], str]] | None = None,
) -> list[str]:
    """TFLOP/s, forward / backward: a line per (`size`, mask), `size` being seqlen or gpus; after
    the `extra` columns (each computed from a line's rows and the table's directions), a column
    per implementation in `impls` that the rows hold."""
    mask_order = list(dict.fromkeys(row["mask"] for row in rows))
    directions = [d for d in ("fwd", "bwd") if any(row["direction"] == d for row in rows)]
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        cells[(row[size], mask_order.index(row["mask"]))][row["impl"]].append(row)
    columns = [impl for impl in impls if any(row["impl"] == impl for row in rows)]
    extra = extra or {}
    header = [{"seqlen": "seqlen", "gpus": "GPUs"}[size], "mask", *extra, *(impls[c] for c in columns)]
    lines = []
    for line in sorted(cells):
        by_impl = cells[line]
        label = tokens(line[0]) if size == "seqlen" else str(line[0])
        everything = [row for group in by_impl.values() for row in group]
        lines.append([label, mask_order[line[1]].replace("_", " "), *(f(everything, directions) for f in extra.values()),
                      *(direction_cell(by_impl.get(c, []), directions) for c in columns)])
    return markdown_table(header, lines, {0, *range(2 + len(extra), len(header))})


def peaks(memory: Sequence[dict]) -> dict[int, dict[str, list[float]]]:
    """The measured peaks (MiB, one per mask) of memory rows: {seqlen: {impl: sorted peaks}}."""
    by_seqlen: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in memory:
        if "error" not in row:
            by_seqlen[row["seqlen"]][row["impl"]].append(row["peak_mib"])
    return {seqlen: {impl: sorted(values) for impl, values in by_impl.items()} for seqlen, by_impl in sorted(by_seqlen.items())}


def mib(value: float) -> str:
    """A peak in MiB to two decimals, whole where it is: a shortfall of 0.25 MiB must not read as
    a peak equal to the peer's."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def memory_table(rows: Sequence[dict]) -> list[str]:
    """Peak MiB of one forward + backward: a line per sequence length, the range over masks."""
    columns = [impl for impl in KERNEL_IMPLS if any(row["impl"] == impl for row in rows)]
    lines = []
    for seqlen, by_impl in peaks(rows).items():
        cells = []
        for impl in columns:
            values = by_impl.get(impl)
            low, high = (f"{values[0]:.0f}", f"{values[-1]:.0f}") if values else (DASH, DASH)
            cells.append(low if low == high else f"{low}-{high}")
        lines.append([tokens(seqlen), *cells])
    return markdown_table(["seqlen", *(KERNEL_IMPLS[c] for c in columns)], lines, range(len(columns) + 1))


def kernel_tables(rows: Sequence[dict], impls: dict[str, str] = KERNEL_IMPLS) -> list[str]:
    """The TFLOP/s table of one run's kernel rows, and its memory table if it measured memory;
    where the run measured another head dim, dtype or head count than the settings' (or
    several), those tables for each under its own heading."""
    kernel = [row for row in rows if row["kind"] == "kernel" and row["impl"] in impls]
    memory = [row for row in rows if row["kind"] == "memory" and row["impl"] in impls]
    shapes = list(dict.fromkeys(map(shape, [*kernel, *memory])))
    if shapes in ([], [(PLOT_HEAD_DIM, DTYPE, HEADS)]):
        return head_dim_tables(kernel, memory, impls)
    lines = []
    for config in shapes:
        mine = ([row for row in group if shape(row) == config] for group in (kernel, memory))
        lines += ["", f"#### {shape_title(config)}", "", *head_dim_tables(*mine, impls)]
    return lines[1:]


def shape(row: dict) -> tuple[int | str, str, str]:
    """What a kernel or memory row's tables are kept apart by: its head dim, dtype and heads."""
    return row["head_dim"], row["dtype"], row["heads"]


def shape_order(config: tuple[int | str, str, str]) -> tuple:
    """Head dims ascending (192/128 after 192), each with the settings' dtype and heads first."""
    head_dim, dtype, heads = config
    return tuple(map(int, str(head_dim).split("/"))), dtype != DTYPE, dtype, heads != HEADS, heads


def shape_title(config: tuple[int | str, str, str]) -> str:
    """'Head dim 128', 'Head dim 192/128 (q and k 192, v 128)'; the dtype and heads named where
    they are not the settings' ('Head dim 128, fp16', 'Head dim 128, 64:64 heads')."""
    head_dim, dtype, heads = config
    if isinstance(head_dim, int):
        title = f"Head dim {head_dim}"
    else:
        qk, v = head_dim.split("/")
        title = f"Head dim {head_dim} (q and k {qk}, v {v})"
    return "".join((title, "" if dtype == DTYPE else f", {dtype}", "" if heads == HEADS else f", {heads} heads"))


def head_dim_tables(kernel: list[dict], memory: list[dict], impls: dict[str, str]) -> list[str]:
    """The TFLOP/s table of one head dim's kernel rows, and the memory table of its memory rows if any."""
    directions = " / ".join(name for d, name in DIRECTION_NAMES.items() if any(row["direction"] == d for row in kernel))
    lines = [f"TFLOP/s, {directions}:", "", *attention_table(kernel, "seqlen", impls, ratio_columns(kernel))]
    if memory:
        lines += ["", "Peak memory of one forward + backward on top of q, k and v (MiB, the range over masks):", "",
                  *memory_table(memory)]
    return lines


def dist_tables(rows: Sequence[dict], impls: dict[str, str] = DIST_IMPLS) -> list[str]:
    """One run's per-GPU TFLOP/s table, with maskc's stage plan and the all-to-all bandwidth."""
    dist = [row for row in rows if row["kind"] == "dist" and row["impl"] in impls]

    def plan(line: list[dict], directions: Sequence[str]) -> str:
        return next((row["plan"] for row in line if row["impl"] == "maskc" and "plan" in row), DASH)

    links = defaultdict(list)
    for row in sorted((r for r in rows if r["kind"] == "link" and "error" not in r), key=lambda r: r["gpus"]):
        links[row["collective"]].append(f"{row['gbps']:.0f} GB/s at {row['gpus']} GPUs")
    lines = [f"{name.capitalize()} bandwidth per rank and direction: {', '.join(at)}." for name, at in links.items()]
    if lines:
        lines.append("")
    return [*lines, ("Per-GPU TFLOP/s of the slowest rank, forward / backward (plan: maskc's stages, `f` when the first "
                     "joins the local call):"), "", *attention_table(dist, "gpus", impls, {"plan": plan})]


def train_cell(row: dict | None) -> str:
    """tokens/s, ms per step and peak GiB of one train row; 'failed' for an error, a dash for none."""
    if row is None:
        return DASH
    if "error" in row:
        return "failed"
    peak = f", {row['peak_mib'] / 1024:.1f} GiB" if "peak_mib" in row else ""
    return f"{row['tokens_per_s']:,.0f}/s, {number(row['ms'])} ms{peak}"


def train_table(rows: Sequence[dict]) -> list[str]:
    """One run's train rows, per model (and whether compiled): a line per row length, a column per
    implementation."""
    train = [row for row in rows if row["kind"] == "train"]
    lines = []
    for model, compiled in dict.fromkeys((row["model"], row["compiled"]) for row in train):
        mine = [row for row in train if row["model"] == model and row["compiled"] == compiled]
        columns = [impl for impl in TRAIN_IMPLS if any(row["impl"] == impl for row in mine)]
        cells = {(row["tokens"], row["docs"], row["impl"]): row for row in mine}
        table = [[tokens(n), str(docs), *(train_cell(cells.get((n, docs, impl))) for impl in columns)]
                 for n, docs in sorted({(row["tokens"], row["docs"]) for row in mine})]  # fmt: skip
        lines += [f"{model}{', under torch.compile' if compiled else ''}:", "",
                  *markdown_table(["tokens", "documents", *(TRAIN_IMPLS[c] for c in columns)], table, range(len(columns) + 2)),
                  ""]  # fmt: skip
    return lines[:-1]


def train_section(rows: Sequence[dict]) -> list[str]:
    """The training steps' section: a table per run holding the newest measurement of some row
    length and implementation (none before one)."""
    runs = current_runs(rows, "train")
    if not runs:
        return []
    out = [TRAIN]
    for run in runs:
        mine = of_run(rows, run, "train")
        out += [*run_heading(mine), *train_table(mine), ""]
    return out


#: The columns of the plan and stages tables: each field's title and format.
COLUMNS = {
    "mask": ("mask", lambda v: v.replace("_", " ")), "gpus": ("GPUs", str), "tokens": ("tokens", lambda v: f"{v:,}"),
    "algorithm": ("algorithm", str), "chunk": ("chunk", str), "imbalance": ("imbalance", lambda v: f"{v:.4f}"),
    "bound": ("bound", lambda v: f"{v:.4f}"), "max_over_bound": ("max / bound", lambda v: f"{v:.4f}"),
    "rows_moved": ("K/V rows moved", lambda v: f"{v:,}"), "ring_rows": ("ring P2P rows", lambda v: f"{v:,}"),
    "allgather_rows": ("all-gather rows", lambda v: f"{v:,}"), "stages": ("stages", str),
    "fused": ("fused", lambda v: "yes" if v else "no"), "model_fwd_ms": ("modelled fwd ms", number),
    "model_bwd_ms": ("modelled bwd ms", number), "plan_ms": ("plan ms", number), "solve_ms": ("solve ms", number),
    "chosen": ("chosen", lambda v: "yes" if v else ""),
}


def field_table(rows: Sequence[dict], fields: Sequence[str]) -> list[str]:
    """A line per row, a column per field of `fields` that some row has."""
    present = [f for f in fields if any(f in row for row in rows)]
    lines = [[COLUMNS[f][1](row[f]) if f in row else DASH for f in present] for row in rows]
    right = [i for i, f in enumerate(present) if f not in ("mask", "algorithm")]
    return markdown_table([COLUMNS[f][0] for f in present], lines, right)


def run_heading(rows: Sequence[dict]) -> list[str]:
    first = rows[0]
    about = [f"Command: `{first['command']}`."]
    if "versions" in first:
        about.append(f"{first['versions']}.")
    if "note" in first:
        about.append(first["note"])
    return [f"### {first['device']}, {first['date']}, commit `{first['commit']}`", "", " ".join(about), ""]


def plot_runs(rows: Sequence[dict]) -> dict[str, str]:
    """The run each figure shows: for the kernels, the shown run with both directions at 16k and
    64k (at PLOT_HEAD_DIM in DTYPE with HEADS) beside the most other libraries, then over the
    most masks (the newest of equals); for the scaling, the newest shown run over several GPU
    counts."""
    chosen = {}
    candidates = []
    for run in current_runs(rows, "kernel", KERNEL_IMPLS):
        mine = plotted_kernel_rows(rows, run)
        both = all(any(r["seqlen"] == s and r["direction"] == d and r["impl"] == "maskc" and "error" not in r for r in mine)
                   for s in PLOT_SEQLENS for d in ("fwd", "bwd"))
        if both:
            libraries = len({r["impl"] for r in mine if not r["impl"].startswith("maskc")})
            candidates.append(((libraries, len({r["mask"] for r in mine})), run))
    if candidates:
        chosen[KERNEL_PLOT] = max(candidates, key=lambda c: c[0])[1]
    for run in current_runs(rows, "dist", DIST_IMPLS):
        if len({r["gpus"] for r in of_run(rows, run, "dist")}) > 1:
            chosen[DIST_PLOT] = run
            break
    return chosen


def plotted_kernel_rows(rows: Sequence[dict], run: str) -> list[dict]:
    """The kernel rows of `run` the figure can show: those of PLOT_HEAD_DIM in DTYPE with HEADS."""
    return [row for row in of_run(rows, run, "kernel") if shape(row) == (PLOT_HEAD_DIM, DTYPE, HEADS)]


def describe(rows: Sequence[dict], run: str) -> str:
    first = next(row for row in rows if row["run"] == run)
    return f"{first['device']}, {first['date']}, commit `{first['commit']}`"


def plotted_runs(rows: Sequence[dict], plots: dict[str, str], plot: str, caption: str, kind: str, impls,
                 tables: Callable[[list[dict]], list[str]]) -> list[str]:
    """A section's figure (where `plot` was drawn) and one heading and its tables per current run of `kind`."""
    out = []
    if plot in plots:
        out += [f"![{caption}](img/{plot})", "", f"The figure shows the run of {describe(rows, plots[plot])}.", ""]
    for run in current_runs(rows, kind, impls):
        mine = [row for row in rows if row["run"] == run]
        out += [*run_heading(mine), *tables(mine), ""]
    return out


def shortfall_source(row: dict) -> str:
    """Where a shortfall was measured: the device, date and commit of a row of its run."""
    return f"{row['device']}, {row['date']}, `{row['commit']}`"


def ratios(tflops: dict[tuple, float], peer_masks: set[str]) -> dict[tuple, float]:
    """maskc's TFLOP/s ({(impl, seqlen, mask, direction): TFLOP/s} of one head dim in one run)
    against each of its targets, per (seqlen, mask, direction, goal). The goal is a peer's name:
    over the faster of the PEERS that ran the mask; OWN_FULL: over its own full mask's, on an
    irregular mask or one no peer has a kernel for (not in `peer_masks`, the masks a peer ran in
    any run); FLEXIBLE: over the fastest of the FLEXIBLE_PEERS that ran an irregular mask. A goal
    this run cannot measure (the libraries did not run the mask's direction, there is no full
    mask) is left out."""
    out: dict[tuple, float] = {}
    for (impl, seqlen, mask, direction), value in tflops.items():
        if impl != "maskc":
            continue

        def fastest_of(impls: Sequence[str]) -> tuple[float, str] | None:
            ran = [(tflops[(other, seqlen, mask, direction)], other) for other in impls if (other, seqlen, mask, direction) in tflops]
            return max(ran, default=None)

        irregular = mask not in STANDARD_MASKS
        if native := fastest_of(PEERS):
            out[(seqlen, mask, direction, native[1])] = value / native[0]
        if (full := tflops.get(("maskc", seqlen, "full", direction))) and (irregular or mask not in peer_masks):
            out[(seqlen, mask, direction, OWN_FULL)] = value / full
        if irregular and (flexible := fastest_of(FLEXIBLE_PEERS)):
            out[(seqlen, mask, direction, FLEXIBLE)] = value / flexible[0]
    return out


def tflops_shortfalls(measured: dict[tuple, float]) -> dict[str, list[str]]:
    """The `ratios` below their targets (the faster peer's TFLOP/s, OWN_FULL_TARGET of the full
    mask's, FLEXIBLE_TARGET times the fastest flexible library's), by goal and direction."""
    below = {
        **{peer: (f"below {KERNEL_IMPLS[peer]}", 1.0) for peer in PEERS},
        OWN_FULL: (f"below {OWN_FULL_TARGET:.0%} of full", OWN_FULL_TARGET),
        FLEXIBLE: (f"below {FLEXIBLE_TARGET}x the fastest flexible-mask library", FLEXIBLE_TARGET),
    }
    short: dict[str, list[str]] = {f"{label}, {d}": [] for label, _ in below.values() for d in DIRECTION_NAMES.values()}
    for (seqlen, mask, direction, goal), ratio in measured.items():
        label, target = below[goal]
        if round(ratio, 2) < target:
            short[f"{label}, {DIRECTION_NAMES[direction]}"].append(f"{mask.replace('_', ' ')} {tokens(seqlen)} {ratio:.2f}")
    return short


def memory_shortfalls(memory: Sequence[dict]) -> list[str]:
    """Per sequence length, maskc's highest peak (of one head dim's memory rows, each length's
    from one run) where above the lowest other library's highest."""
    short = []
    for seqlen, by_impl in peaks(memory).items():
        # maskc's deterministic and portable variants are not other libraries
        others = [values[-1] for impl, values in by_impl.items() if not impl.startswith("maskc")]
        if "maskc" in by_impl and others and (ours := by_impl["maskc"][-1]) > (lowest := min(others)):
            short.append(f"{tokens(seqlen)} {mib(ours)} MiB against {mib(lowest)}")
    return short


def kernel_shortfalls(rows: Sequence[dict]) -> list[str]:
    """A line per head dim, dtype and head count (`shape`): what of its TFLOP/s and peak memory
    falls short (tflops_shortfalls, memory_shortfalls) at TARGET_SEQLENS, each (sequence length,
    mask) from the newest run measuring it with maskc and a peer (maskc alone, for a mask no
    peer has a kernel for), each length's memory from the newest run measuring it with maskc and
    a peer; the line names those runs."""
    found: dict[tuple[int | str, str, str], dict[tuple, float]] = defaultdict(dict)
    memory: dict[tuple[int | str, str, str], dict[int, list[dict]]] = defaultdict(dict)
    used: dict[tuple[int | str, str, str], dict[str, dict]] = defaultdict(dict)
    mask_order = list(dict.fromkeys(row["mask"] for row in rows if row["kind"] == "kernel"))
    peer_masks = {row["mask"] for row in rows if row["kind"] == "kernel" and row["impl"] in PEERS and "error" not in row}
    for run in current_runs(rows, "kernel", {"maskc", *PEERS, *FLEXIBLE_PEERS}):
        mine = [row for row in of_run(rows, run, "kernel") if "error" not in row]
        for config in dict.fromkeys(map(shape, mine)):
            tflops = {(row["impl"], row["seqlen"], row["mask"], row["direction"]): row["tflops"]
                      for row in mine if shape(row) == config}  # fmt: skip
            impls = {impl for impl, *_ in tflops}
            if "maskc" not in impls:
                continue
            measured = ratios(tflops, peer_masks)
            new = {k: v for k, v in measured.items() if k[0] in TARGET_SEQLENS and k not in found[config]}
            peaks_of = defaultdict(list)
            for row in of_run(rows, run, "memory") if impls.intersection((*PEERS, *FLEXIBLE_PEERS)) else ():
                if shape(row) == config and row["seqlen"] in TARGET_SEQLENS and row["seqlen"] not in memory[config]:
                    peaks_of[row["seqlen"]].append(row)
            if new or peaks_of:
                found[config].update(new)
                memory[config].update(peaks_of)
                used[config][run] = mine[0]
    lines = []
    for config in sorted(used, key=shape_order):
        measured = sorted(found[config].items(), key=lambda item: (item[0][0], mask_order.index(item[0][1])))
        short = tflops_shortfalls(dict(measured))
        short["peak memory"] = memory_shortfalls([row for seqlen_rows in memory[config].values() for row in seqlen_rows])
        parts = [f"{what}: {', '.join(items)}" for what, items in short.items() if items]
        runs = "; ".join(dict.fromkeys(map(shortfall_source, used[config].values())))
        lines.append(f"- **{shape_title(config)}** ({runs}): " + ("; ".join(parts) if parts else "none") + ".")
    return lines


def host_shortfalls(rows: Sequence[dict]) -> list[str]:
    """A line per host pass of the newest run timing maskc's calls: its time over the lowest
    other library's where above."""
    timed = [row for row in rows if row["kind"] == "host" and row["step"].startswith(f"{HOST_IMPLS['maskc']} (")]
    lines = []
    for run in current_runs(timed, "host")[:1]:
        mine = of_run(rows, run, "host")
        for pass_, title in HOST_PASSES.items():
            times = {impl: row["ms"] * 1e3 for row in mine for impl, call in HOST_IMPLS.items()
                     if row["step"].startswith(f"{call} ({title},")}  # fmt: skip
            ours = times.pop("maskc", None)
            if ours is not None and times and ours > min(times.values()):
                peer = min(times, key=times.get)
                lines.append(f"- **Host time, {title}** ({shortfall_source(mine[0])}): "
                             f"{ours:.1f} us against {KERNEL_IMPLS.get(peer, peer)}'s {times[peer]:.1f}.")  # fmt: skip
    return lines


def render(rows: Sequence[dict]) -> str:
    """docs/performance.md for `rows` (read_results' order)."""
    plots = plot_runs(rows)
    out = [INTRO, ONE_GPU]
    out += plotted_runs(rows, plots, KERNEL_PLOT, "TFLOP/s per mask, forward and backward, at 16k and 64k tokens", "kernel",
                        KERNEL_IMPLS, kernel_tables)  # fmt: skip
    out.append(SEVERAL_GPUS)
    out += plotted_runs(rows, plots, DIST_PLOT, "per-GPU TFLOP/s against the number of GPUs", "dist", DIST_IMPLS, dist_tables)
    out += train_section(rows)
    lines = [[row["step"], number(row["ms"]), row["device"], row["date"], f"`{row['commit']}`", f"`bench/{row['bench']}.py`"]
             for row in latest(rows, "host").values()]
    out += [SHORT, *kernel_shortfalls(rows), *host_shortfalls(rows), "", LIMITS]
    out += [HOST, *markdown_table(["step", "ms", "device", "date", "commit", "benchmark"], lines, [1]), "", PLANS]
    for kind, fields in (("plan", PLAN_FIELDS), ("stages", STAGES_FIELDS)):
        for run in current_runs(rows, kind):
            mine = of_run(rows, run, kind)
            out += [*run_heading(mine), *field_table(mine, fields), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def draw(rows: Sequence[dict], img: Path = IMG) -> list[Path]:
    """Redraw the figures of plot_runs under `img`; each PNG names its run in its Description."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    written = []
    for name, run in plot_runs(rows).items():
        if name == KERNEL_PLOT:
            fig = _kernel_figure(plt, plotted_kernel_rows(rows, run))
        else:
            fig = _dist_figure(plt, of_run(rows, run, "dist"))
        fig.suptitle(describe(rows, run).replace("`", ""), fontsize=9)
        img.mkdir(parents=True, exist_ok=True)
        path = img / name
        fig.savefig(path, dpi=110, metadata={"Description": f"run {run}"})
        plt.close(fig)
        written.append(path)
    return written


def _kernel_figure(plt: Any, rows: list[dict]) -> Any:
    impls = [impl for impl in KERNEL_IMPLS if any(row["impl"] == impl for row in rows)]
    masks = list(dict.fromkeys(row["mask"] for row in rows))
    fig, axes = plt.subplots(2, len(PLOT_SEQLENS), figsize=(6 * len(PLOT_SEQLENS), 7), squeeze=False)
    width = 0.8 / len(impls)
    for col, seqlen in enumerate(PLOT_SEQLENS):
        for line, direction in enumerate(("fwd", "bwd")):
            ax = axes[line, col]
            for i, impl in enumerate(impls):
                values = {r["mask"]: r["tflops"] for r in rows
                          if r["impl"] == impl and r["seqlen"] == seqlen and r["direction"] == direction and "error" not in r}
                xs = [m + (i - (len(impls) - 1) / 2) * width for m, name in enumerate(masks) if name in values]
                ax.bar(xs, [values[name] for name in masks if name in values], width, color=color(KERNEL_IMPLS, impl))
            ax.set_xticks(range(len(masks)), [m.replace("_", "\n") for m in masks], fontsize=7)
            ax.set_title(f"{'forward' if direction == 'fwd' else 'backward'}, {tokens(seqlen)} tokens", fontsize=9)
            ax.set_ylabel("TFLOP/s")
            ax.grid(axis="y", alpha=0.3)
    legend(plt, fig, KERNEL_IMPLS, impls)
    return fig


def _dist_figure(plt: Any, rows: list[dict]) -> Any:
    impls = [impl for impl in DIST_IMPLS if any(row["impl"] == impl for row in rows)]
    masks = list(dict.fromkeys(row["mask"] for row in rows))
    fig, axes = plt.subplots(2, len(masks), figsize=(3.2 * len(masks), 6), sharex=True, squeeze=False)
    gpus = sorted({row["gpus"] for row in rows})
    for col, mask in enumerate(masks):
        for line, direction in enumerate(("fwd", "bwd")):
            ax = axes[line, col]
            for impl in impls:
                points = sorted((r["gpus"], r["tflops"]) for r in rows
                                if r["mask"] == mask and r["impl"] == impl and r["direction"] == direction and "error" not in r)
                if points:
                    ax.plot(*zip(*points), marker="o", color=color(DIST_IMPLS, impl))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0, col].set_title(mask.replace("_", " "), fontsize=9)
        axes[1, col].set_xlabel("GPUs")
        axes[1, col].set_xticks(gpus)
    axes[0, 0].set_ylabel("forward TFLOP/s per GPU")
    axes[1, 0].set_ylabel("backward TFLOP/s per GPU")
    legend(plt, fig, DIST_IMPLS, impls)
    return fig


def color(impls: dict[str, str], impl: str) -> str:
    """One colour per implementation, the same in every figure of its kind."""
    return f"C{list(impls).index(impl)}"


def legend(plt: Any, fig: Any, titles: dict[str, str], impls: list[str]) -> None:
    """A legend of `impls` above the panels, under the figure's title."""
    handles = [plt.Rectangle((0, 0), 1, 1, color=color(titles, impl)) for impl in impls]
    fig.legend(handles, [titles[impl] for impl in impls], loc="upper center", ncol=len(impls), fontsize=8, bbox_to_anchor=(0.5, 0.96))
    fig.tight_layout(rect=(0, 0, 1, 0.91))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the results files (default bench/results)")
    parser.add_argument("--check", action="store_true", help="only check that docs/performance.md is up to date")
    parser.add_argument("--plots", action="store_true", help="also redraw the figures under docs/img (needs matplotlib)")
    args = parser.parse_args()
    rows = read_results(args.results)
    text = render(rows)
    if args.check:
        if DOC.read_text() != text:
            sys.exit(f"{DOC.relative_to(ROOT)} is out of date: run python bench/report.py")
        return
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    if args.plots:
        for path in draw(rows):
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
