"""Regenerate docs/performance.md and docs/performance-history.md from the rows in bench/results
(see bench/README.md).

`python bench/report.py` rewrites both pages; `--check` only says whether they are up to date
(exit status 1 if not); `--plots` also redraws their figures under docs/img (needs matplotlib).
The pages are a function of the rows alone, byte for byte, so a test can check them; the figures
are redrawn on request only, and carry the id of the run they show, which the test checks too.

docs/performance.md is short, to read in minutes: per device the newest run at the settings,
a line per other head dim and head count, the newest run of each other kind and a summary of
what falls short. docs/performance-history.md keeps the newest measurement of every
implementation and configuration: the tables of every run that holds one, newest first, each
with the baselines measured in that run, and the full lists of what falls short.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from record import HOST_IMPLS, HOST_PASSES, RESULTS, ROOT, key, read_results

DOC = ROOT / "docs" / "performance.md"
HISTORY = ROOT / "docs" / "performance-history.md"
#: The longest docs/performance.md may be: a page to read in minutes.
DOC_LINES = 200
IMG = ROOT / "docs" / "img"
#: The implementations the page shows, with their column titles; other rows (forced plans,
#: SM-margin sweeps) stay in the results for the design notes.
KERNEL_IMPLS = {
    "maskc": "maskc",
    "maskc_det": "maskc deterministic",
    "maskc_portable": "maskc portable",
    "maskc_portable_next": "maskc portable next (experimental)",
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
#: The settings' head dim, dtype and heads (`shape`): what the main page's tables of each device show.
DEFAULT_SHAPE = (PLOT_HEAD_DIM, DTYPE, HEADS)
DASH = "—"
#: The directions' names in prose.
DIRECTION_NAMES = {"fwd": "forward", "bwd": "backward"}

INTRO = """\
# How fast maskc is

maskc beside other attention libraries on one GPU, over several and in a training step, and its
host time: the newest run of each. The [history](performance-history.md) keeps every run holding
a newest figure (more head dims, lengths, maskc's deterministic and portable kernels), every
shortfall, and how to reproduce them. `python bench/report.py` writes both from `bench/results/`.
"""

HISTORY_INTRO = """\
# How fast maskc is: every run

The record behind [the performance page](performance.md): for each implementation and
configuration its newest measurement, each table one run, newest first. An older run keeps its
table while it holds the newest figure of something (a library the newer runs did not measure,
say). This page is generated from the rows in `bench/results/` by `python bench/report.py`;
every benchmark appends its rows there (`bench/README.md`).
"""

SETTINGS = """\
Each table is one run, every library in it on the same device; runs differ by about 3%, so
compare within a table. **Settings** (MagiAttention's): one sequence, 64 query and 8 key/value
heads, head dim 128, bf16, unless a table names others (192/128: q and k 192, v 128). Varlen
masks pack documents of real lengths (`bench/data/`), each at most a quarter of the sequence;
block-causal blocks are 1024 tokens; the sliding window sees the 1024 keys up to each query. No
other library has a kernel of its own for the shared question (an eighth of the sequence is a
question that every answer, a packed causal document, sees) or global + window (256 global tokens
that see and are seen by all, 512 keys on each side of every query). TFLOP/s count the mask's
exact area: forward `2 * area * Hq * (D_qk + D_v)`, backward 2.5 times that. A dash: no kernel
for the mask, or not measured; "failed": no kernel for the head dim or direction.
"""

REPRODUCING = """\
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

`bench/kernel.py`: maskc (`maskc deterministic`: `deterministic=True`; `maskc portable`: the
kernels for every NVIDIA GPU since Ampere) beside FlashAttention-4 (FA4), cuDNN and
FlashAttention-2 (`SDPA flash`; both through PyTorch's SDPA), with kernels for some masks, and
FlexAttention (on its Triton backend and on FA4's) and FA4's `mask_mod`, which take any mask.
Each library's output and gradients are checked against maskc's before it is timed; the backward
is timed alone. `maskc / FA4`: maskc's TFLOP/s over FA4's on the line (forward / backward; below
1, FA4 is faster); `maskc / flexible`: over the faster of Flex on FA4 and FA4's `mask_mod`; `maskc / full`: over
maskc's own on the full mask of the same length.
"""

#: After ONE_GPU on the history page: how the libraries run, and how its tables are headed.
ONE_GPU_EVERY_RUN = """\
FlexAttention runs under `torch.compile`, on FA4's backend with `kernel_options={"BACKEND":
"FLASH"}`; FA4's `mask_mod` takes FlexAttention's block-sparse tiles; the backward timed is
`out.backward`. A library whose output or gradients differ from maskc's on the same inputs
records that instead of a time. A table of another dtype (fp16) or head count (64:64, MHA; 64:1,
MQA) than the settings' names it in its heading; fp16 runs the bf16 kernels' code with the other
element type, and measures as bf16 does.
"""

OTHER_SHAPES = """\
## Other head dims and head counts, 16k

The newest run of each beside another library: maskc's TFLOP/s on the full mask, and each ratio
above as its range over the masks (`maskc / full` without the full mask itself).
"""

MEMORY = "## Peak memory"

SEVERAL_GPUS = """\
## Several GPUs: context parallelism

`bench/dist.py`: `maskc.dist.attention`, one process per GPU (NCCL), 16k tokens per GPU and the
masks above over all of them, beside PyTorch's ring context parallelism (`context_parallel` over
SDPA; full and causal) and all-gathering the keys and values before FlexAttention. Per-GPU
TFLOP/s: the whole mask's FLOPs over the GPUs, in the slowest rank's median time.
"""

TRAIN = """\
## Training steps in Hugging Face Transformers

`bench/train_step.py`: steps (forward with labels, backward, fused AdamW) of a Llama-style model
through Transformers' `attn_implementation` on one packed row of real-length documents (maskc,
FA4, FA2: `position_ids`; FlexAttention: a BlockMask; SDPA: a dense mask). Each cell: tokens per
second, ms per step (median), peak memory with weights, gradients and optimizer states; "failed":
out of memory, not installed, or a first forward other than maskc's (the row's error says which).
"""

#: maskc's target on an irregular mask (every mask but STANDARD_MASKS), and on any mask no peer
#: has a kernel for: this share of its own TFLOP/s on the full mask of the same length.
OWN_FULL_TARGET = 0.92
#: The masks every attention library has; the others are irregular.
STANDARD_MASKS = ("full", "causal")
#: The libraries whose kernels maskc's are held against, mask by mask: the faster of those that
#: ran the mask sets the target (FA4 has every benchmark mask but three, SDPA cuDNN full and causal).
PEERS = ("fa4", "sdpa_cudnn")
#: The fastest libraries that take any mask (a mask_mod over block-sparse tiles, on FA4's
#: kernels): on an irregular mask, maskc's target is FLEXIBLE_TARGET times the faster of those
#: that ran it. FlexAttention on Triton, slower than both, sets no target (a run without these
#: two shows no `maskc / flexible`).
FLEXIBLE_PEERS = ("flex_fa4", "fa4_mask_mod")
FLEXIBLE_TARGET = 1.15
#: What a ratio is held against (`ratios`): a peer's name, OWN_FULL or FLEXIBLE.
OWN_FULL, FLEXIBLE = "full", "flexible"
#: The sequence lengths the speed and memory targets are set at (the seeds' 16k and 64k).
TARGET_SEQLENS = (16384, 65536)

SHORT = """\
## Short of the targets

maskc's targets, at 16k and 64k tokens: at least the TFLOP/s of the faster of FA4 and cuDNN on
every mask either has; on every mask but full and causal (and any no peer has), at least 92% of
its own full mask's and 1.15 times the faster of Flex on FA4 and FA4's `mask_mod`; no more peak memory or
host time per call than the lowest other library in the same run.
"""

#: After SHORT on the history page, in its paragraph: what its list holds.
SHORT_EVERY = """\
What falls short in the newest measurement of each head dim, mask and length beside FA4 or
cuDNN (the runs named), and in the newest host-time run (maskc's figure over the target's, named
by the faster library):
"""

#: After SHORT on the main page, in its paragraph: what its summary holds.
SHORT_SUMMARY = """\
Per head dim, dtype and head count, how many masks and lengths fall short of each target and the
lowest (maskc's figure over the target's); the history lists [every one, and what holds each
back](performance-history.md#short-of-the-targets) in full:
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

#: The main page's short account of LIMITS (which the history page keeps in full).
LIMITS_SHORT = """\
## What holds these back

- The backward against FA4: its block loop waits longer, and at 64k its CTAs drift apart until
  L2 no longer holds the rows they walk; at d=192 and 192/128 causal items read twice FA4's DRAM
  bytes at 16k (`docs/design/backward-order.md`, `docs/design/head-dims.md`).
- Windows and packed documents leave each q tile few blocks to spread its fixed costs over, in
  every library (FA4's sliding window: 0.66-0.79 of its full mask); at 64:64 the forward has no
  heads to pack, at 64:1 a 16k mask has about one backward item per CTA (`docs/design/head-counts.md`).
- Memory: the peak holds a float32 dQ accumulator, at 192/128 128 bytes per query row and head
  over FlexAttention's. Host time: maskc's autograd node, buffers and launches run in Python,
  cuDNN's in C++ (`docs/design/host-time.md`).
"""

#: The main page's host time: one call of each library.
HOST_CALLS = """\
## Host time

One call on 128 causal tokens (64:8 heads, d=128, bf16), forward / forward + backward through
autograd, in microseconds of CPU time: the newest run on each device. What a new mask costs the
host is in the [history](performance-history.md#host-time).
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


def direction_ratios(ours: Sequence[dict], theirs: Sequence[dict]) -> dict[str, float]:
    """`ours`' TFLOP/s over `theirs`' per direction both measured (neither failed)."""
    mine = {row["direction"]: row["tflops"] for row in ours if "error" not in row}
    other = {row["direction"]: row["tflops"] for row in theirs if "error" not in row}
    return {d: mine[d] / other[d] for d in mine if d in other}


def ratio_cell(ours: Sequence[dict], theirs: Sequence[dict], directions: Sequence[str]) -> str:
    """`ours`' TFLOP/s over `theirs`' for the `directions` of the table, 'fwd / bwd'; a dash
    where either lacks a direction (or failed it), one dash where either has none."""
    if not any("error" not in row for row in ours) or not any("error" not in row for row in theirs):
        return DASH
    found = direction_ratios(ours, theirs)
    return " / ".join(f"{found[d]:.2f}" if d in found else DASH for d in directions)


def fastest(line: Sequence[dict], impls: Sequence[str]) -> list[dict]:
    """Per direction, the row of the fastest of `impls` on a line (those that ran it)."""
    best: dict[str, dict] = {}
    for row in line:
        if row["impl"] in impls and "error" not in row and row["tflops"] > best.get(row["direction"], {"tflops": 0})["tflops"]:
            best[row["direction"]] = row
    return list(best.values())


#: The ratio columns' titles (`ratio_sides`).
OVER_FA4, OVER_FLEXIBLE, OVER_FULL = "maskc / FA4", "maskc / flexible", "maskc / full"

#: What a ratio column sets against each other on a line of a table: (maskc's rows, the others').
Sides = Callable[[list[dict]], tuple[list[dict], list[dict]]]


def ratio_sides(kernel: Sequence[dict]) -> dict[str, Sides]:
    """The ratio columns a table of `kernel` rows has, each with the rows it divides on a line:
    maskc's over FA4's, over the faster flexible-mask library's (FLEXIBLE_PEERS), and over maskc's own on the
    full mask of the same length (each where the rows measured both)."""
    def impl_rows(line: list[dict], impl: str) -> list[dict]:
        return [row for row in line if row["impl"] == impl]

    columns: dict[str, Sides] = {}
    impls = {row["impl"] for row in kernel}
    if {"maskc", "fa4"} <= impls:
        columns[OVER_FA4] = lambda line: (impl_rows(line, "maskc"), impl_rows(line, "fa4"))
    if "maskc" in impls and impls.intersection(FLEXIBLE_PEERS):
        columns[OVER_FLEXIBLE] = lambda line: (impl_rows(line, "maskc"), fastest(line, FLEXIBLE_PEERS))
    full: dict[int, list[dict]] = defaultdict(list)
    for row in kernel:
        if row["impl"] == "maskc" and row["mask"] == "full":
            full[row["seqlen"]].append(row)
    if full and any(row["mask"] != "full" for row in kernel):
        columns[OVER_FULL] = lambda line: (impl_rows(line, "maskc"), full.get(line[0]["seqlen"], []))
    return columns


def ratio_columns(kernel: Sequence[dict]) -> dict[str, Callable[[list[dict], Sequence[str]], str]]:
    """The columns that say where maskc stands (`ratio_sides`), as cells of a line and the
    table's directions."""
    return {title: (lambda line, dirs, sides=sides: ratio_cell(*sides(line), dirs)) for title, sides in ratio_sides(kernel).items()}


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
        lines.append([tokens(seqlen), *(span(by_impl.get(impl, []), ".0f") for impl in columns)])
    return markdown_table(["seqlen", *(KERNEL_IMPLS[c] for c in columns)], lines, range(len(columns) + 1))


def kernel_tables(rows: Sequence[dict], impls: dict[str, str] = KERNEL_IMPLS) -> list[str]:
    """The TFLOP/s table of one run's kernel rows, and its memory table if it measured memory;
    where the run measured another head dim, dtype or head count than the settings' (or
    several), those tables for each under its own heading."""
    kernel = [row for row in rows if row["kind"] == "kernel" and row["impl"] in impls]
    memory = [row for row in rows if row["kind"] == "memory" and row["impl"] in impls]
    shapes = list(dict.fromkeys(map(shape, [*kernel, *memory])))
    if shapes in ([], [DEFAULT_SHAPE]):
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
    """A run's heading on the history page: where, when, and the command and versions."""
    first = rows[0]
    about = [f"Command: `{first['command']}`."]
    if "versions" in first:
        about.append(f"{first['versions']}.")
    if "note" in first:
        about.append(first["note"])
    return [f"### {first['device']}, {first['date']}, commit `{first['commit']}`", "", " ".join(about), ""]


def run_sections(rows: Sequence[dict], runs: Iterable[str], tables: Callable[[list[dict]], list[str]]) -> list[str]:
    """Per run of `runs`, its run_heading and `tables`, each given all the rows of the run."""
    out = []
    for run in runs:
        mine = [row for row in rows if row["run"] == run]
        out += [*run_heading(mine), *tables(mine), ""]
    return out


def train_section(rows: Sequence[dict]) -> list[str]:
    """The training steps' section: a table per run holding the newest measurement of some row
    length and implementation (none before one)."""
    runs = current_runs(rows, "train")
    return [TRAIN, *run_sections(rows, runs, train_table)] if runs else []


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
    return [row for row in of_run(rows, run, "kernel") if shape(row) == DEFAULT_SHAPE]


def describe(rows: Sequence[dict], run: str, device: bool = True) -> str:
    """A run in prose: its device (unless not `device`), date and commit."""
    first = next(row for row in rows if row["run"] == run)
    return f"{first['device'] + ', ' if device else ''}{first['date']}, commit `{first['commit']}`"


KERNEL_CAPTION = "TFLOP/s per mask, forward and backward, at 16k and 64k tokens"
DIST_CAPTION = "per-GPU TFLOP/s against the number of GPUs"


def figure(rows: Sequence[dict], plots: dict[str, str], plot: str, caption: str, named: bool = True) -> list[str]:
    """The figure `plot`, where plot_runs chose a run for it, and where `named` a line naming
    the run (which the figure's title names too)."""
    if plot not in plots:
        return []
    return [f"![{caption}](img/{plot})", "", *([f"The figure shows the run of {describe(rows, plots[plot])}.", ""] if named else [])]


def run_source(row: dict) -> str:
    """Where a figure was measured, in a line or a cell: the device, date and commit of a row of its run."""
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


def tflops_shortfalls(measured: dict[tuple, float]) -> dict[str, list[tuple[str, float]]]:
    """The `ratios` below their targets (the faster peer's TFLOP/s, OWN_FULL_TARGET of the full
    mask's, FLEXIBLE_TARGET times the fastest flexible library's), by goal and direction: the
    mask and length of each, and its ratio."""
    below = {
        **{peer: (f"below {KERNEL_IMPLS[peer]}", 1.0) for peer in PEERS},
        OWN_FULL: (f"below {OWN_FULL_TARGET:.0%} of full", OWN_FULL_TARGET),
        FLEXIBLE: (f"below {FLEXIBLE_TARGET}x the faster flexible-mask library", FLEXIBLE_TARGET),
    }
    short: dict[str, list[tuple[str, float]]] = {f"{label}, {d}": [] for label, _ in below.values() for d in DIRECTION_NAMES.values()}
    for (seqlen, mask, direction, goal), ratio in measured.items():
        label, target = below[goal]
        if round(ratio, 2) < target:
            short[f"{label}, {DIRECTION_NAMES[direction]}"].append((f"{mask.replace('_', ' ')} {tokens(seqlen)}", ratio))
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


class Shortfalls(NamedTuple):
    """What of one head dim, dtype and head count's figures falls short of its targets."""

    title: str
    #: run_source of each run the figures come from, newest first.
    runs: list[str]
    #: tflops_shortfalls: by goal and direction, the mask and length and the ratio of each.
    tflops: dict[str, list[tuple[str, float]]]
    #: memory_shortfalls.
    memory: list[str]


def shape_shortfalls(rows: Sequence[dict]) -> list[Shortfalls]:
    """Per head dim, dtype and head count (`shape`): what of its TFLOP/s and peak memory falls
    short (tflops_shortfalls, memory_shortfalls) at TARGET_SEQLENS, each (sequence length, mask)
    from the newest run measuring it with maskc and a peer (maskc alone, for a mask no peer has
    a kernel for), each length's memory from the newest run measuring it with maskc and a peer."""
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
    out = []
    for config in sorted(used, key=shape_order):
        measured = sorted(found[config].items(), key=lambda item: (item[0][0], mask_order.index(item[0][1])))
        out.append(Shortfalls(
            shape_title(config), list(dict.fromkeys(map(run_source, used[config].values()))), tflops_shortfalls(dict(measured)),
            memory_shortfalls([row for seqlen_rows in memory[config].values() for row in seqlen_rows]),
        ))  # fmt: skip
    return out


def shortfall_line(short: Shortfalls, parts: list[str], runs: bool) -> str:
    """A shape's line of shortfalls: its title, the runs where `runs`, its `parts` (or none)."""
    sources = f" ({'; '.join(short.runs)})" if runs else ""
    return f"- **{short.title}**{sources}: " + ("; ".join(parts) if parts else "none") + "."


def kernel_shortfalls(rows: Sequence[dict]) -> list[str]:
    """A line per shape_shortfalls: every mask and length short of each target, with the runs
    they come from."""
    lines = []
    for short in shape_shortfalls(rows):
        parts = [f"{what}: {', '.join(f'{item} {ratio:.2f}' for item, ratio in items)}"
                 for what, items in short.tflops.items() if items]  # fmt: skip
        if short.memory:
            parts.append(f"peak memory: {', '.join(short.memory)}")
        lines.append(shortfall_line(short, parts, runs=True))
    return lines


def shortfall_summary(rows: Sequence[dict]) -> list[str]:
    """kernel_shortfalls in a few words a shape: per target, how many fall short and the lowest."""
    lines = []
    for short in shape_shortfalls(rows):
        parts = []
        for what, items in short.tflops.items():
            if items:
                item, ratio = min(items, key=lambda found: found[1])
                parts.append(f"{what}: {len(items)} (lowest {item} {ratio:.2f})")
        if short.memory:
            parts.append(f"peak memory: {', '.join(short.memory)}")
        lines.append(shortfall_line(short, parts, runs=False))
    return lines


def call_times(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """The host time (us) of one call of each of HOST_IMPLS in a run's host rows, per pass."""
    return {pass_: {impl: row["ms"] * 1e3 for row in rows for impl, call in HOST_IMPLS.items()
                    if row["step"].startswith(f"{call} ({title},")}
            for pass_, title in HOST_PASSES.items()}  # fmt: skip


def call_runs(rows: Sequence[dict]) -> list[str]:
    """The runs holding the newest time of some call of maskc's, newest first."""
    timed = [row for row in rows if row["kind"] == "host" and row["step"].startswith(f"{HOST_IMPLS['maskc']} (")]
    return current_runs(timed, "host")


def host_shortfalls(rows: Sequence[dict]) -> list[str]:
    """A line per host pass of the newest run timing maskc's calls: its time over the lowest
    other library's where above."""
    lines = []
    for run in call_runs(rows)[:1]:
        mine = of_run(rows, run, "host")
        for pass_, times in call_times(mine).items():
            ours = times.pop("maskc", None)
            if ours is not None and times and ours > min(times.values()):
                peer = min(times, key=times.get)
                lines.append(f"- **Host time, {HOST_PASSES[pass_]}** ({run_source(mine[0])}): "
                             f"{ours:.1f} us against {KERNEL_IMPLS.get(peer, peer)}'s {times[peer]:.1f}.")  # fmt: skip
    return lines


def host_calls(rows: Sequence[dict]) -> list[str]:
    """The main page's host time: per device, the newest run's time of one call of each library,
    forward / forward + backward."""
    newest: dict[str, str] = {}
    for run in call_runs(rows):
        newest.setdefault(next(row["device"] for row in rows if row["run"] == run), run)
    lines = []
    for device in sorted(newest):
        mine = of_run(rows, newest[device], "host")
        times = call_times(mine)
        cells = [" / ".join(number(times[pass_][impl]) if impl in times[pass_] else DASH for pass_ in HOST_PASSES)
                 if any(impl in by_impl for by_impl in times.values()) else DASH for impl in HOST_IMPLS]  # fmt: skip
        lines.append([run_source(mine[0]), *cells])
    if not lines:
        return []
    header = ["run", *(KERNEL_IMPLS[impl] for impl in HOST_IMPLS)]
    return [HOST_CALLS, *markdown_table(header, lines, range(1, len(header))), ""]


def host_table(rows: Sequence[dict]) -> list[str]:
    """The history page's host time: the newest measurement of every step."""
    lines = [[row["step"], number(row["ms"]), row["device"], row["date"], f"`{row['commit']}`", f"`bench/{row['bench']}.py`"]
             for row in latest(rows, "host").values()]
    return [HOST, *markdown_table(["step", "ms", "device", "date", "commit", "benchmark"], lines, [1]), ""]


def newest_runs(rows: Sequence[dict], kind: str, keep: Callable[[dict], bool], of: Callable[[dict], Any]) -> dict[Any, str]:
    """Per `of` (a row's length, say), the newest run with `kind` rows of maskc and of another
    library that `keep` keeps (maskc's failed or not): what the main page shows of `kind`."""
    order = run_order(rows)
    measured: dict[tuple[Any, str], set[str]] = defaultdict(set)
    for row in rows:
        if row["kind"] == kind and keep(row):
            measured[(of(row), row["run"])].add(row["impl"])
    newest: dict[Any, str] = {}
    for (what, run), impls in sorted(measured.items(), key=lambda item: order[item[0][1]]):
        if "maskc" in impls and any(not impl.startswith("maskc") for impl in impls):
            newest[what] = run
    return newest


def at_settings(row: dict) -> bool:
    """A kernel or memory row the main page's tables of each device show."""
    return shape(row) == DEFAULT_SHAPE and row["seqlen"] in TARGET_SEQLENS and row["impl"] in KERNEL_IMPLS


#: Implementations that are not a default anywhere (opt-in, experimental): a run timing them is
#: kept on the history page, and the main page shows the runs of what users get.
EXPERIMENTAL_IMPLS = ("maskc_portable_next",)


def shipped_at_settings(rows: Sequence[dict], kind: str) -> Callable[[dict], bool]:
    """at_settings, for the rows of runs that time no EXPERIMENTAL_IMPLS."""
    experimental = {row["run"] for row in rows if row["kind"] == kind and row["impl"] in EXPERIMENTAL_IMPLS}
    return lambda row: at_settings(row) and row["run"] not in experimental


def newest_runs_at_settings(rows: Sequence[dict]) -> dict[str, dict[int, str]]:
    """Per device, per length of TARGET_SEQLENS, the newest run measuring maskc beside another
    library at DEFAULT_SHAPE (shipped_at_settings): what the main page's tables show."""
    newest: dict[str, dict[int, str]] = defaultdict(dict)
    keep = shipped_at_settings(rows, "kernel")
    for (device, seqlen), run in sorted(newest_runs(rows, "kernel", keep, lambda row: (row["device"], row["seqlen"])).items()):
        newest[device][seqlen] = run
    return dict(newest)


def shown_rows(rows: Sequence[dict], kind: str, runs: dict[int, str]) -> list[dict]:
    """The `kind` rows at_settings of `runs` (a run per length), each length's of its run."""
    return [row for row in rows if row["kind"] == kind and at_settings(row) and runs.get(row["seqlen"]) == row["run"]]


def sources(rows: Sequence[dict], runs: dict[int, str], device: bool = True) -> str:
    """Which run each length comes from: '16k and 64k from the run of <device>, <date>, commit
    <commit>' (without the device where the heading names it)."""
    lengths: dict[str, list[str]] = defaultdict(list)
    for seqlen, run in sorted(runs.items()):
        lengths[run].append(tokens(seqlen))
    return ", ".join(f"{' and '.join(at)} from the run of {describe(rows, run, device)}" for run, at in lengths.items())


def device_section(rows: Sequence[dict], device: str, runs: dict[int, str]) -> list[str]:
    """A device's heading and TFLOP/s table, each length from its run of `runs`."""
    kernel = shown_rows(rows, "kernel", runs)
    return [f"### {device}", "", f"TFLOP/s, forward / backward; {sources(rows, runs, device=False)}:", "",
            *attention_table(kernel, "seqlen", KERNEL_IMPLS, ratio_columns(kernel)), ""]  # fmt: skip


def memory_section(rows: Sequence[dict]) -> list[str]:
    """The main page's peaks: each length's from the newest run measuring maskc's beside another library's."""
    runs = newest_runs(rows, "memory", shipped_at_settings(rows, "memory"), lambda row: row["seqlen"])
    if not runs:
        return []
    caption = f"Of one forward + backward on top of q, k and v, in MiB (the range over masks); {sources(rows, runs)}:"
    return [MEMORY, "", caption, "", *memory_table(shown_rows(rows, "memory", runs)), ""]


def dist_section(rows: Sequence[dict], plots: dict[str, str]) -> list[str]:
    """The main page's context parallelism: the figure, and the newest run's table at its most GPUs."""
    runs = current_runs(rows, "dist", DIST_IMPLS)
    if not runs:
        return []
    mine = [row for row in rows if row["run"] == runs[0]]
    most = max(row["gpus"] for row in mine if row["kind"] == "dist")
    shown = [row for row in mine if row["kind"] != "dist" or row["gpus"] == most]
    note = f"The run of {describe(rows, runs[0])}, at {most} GPUs (the history page has every count)."
    return [SEVERAL_GPUS, *figure(rows, plots, DIST_PLOT, DIST_CAPTION, named=False), note, *dist_tables(shown), ""]


def train_rows(rows: Sequence[dict]) -> tuple[list[dict], list[str]]:
    """The main page's training steps: each model's row lengths from the newest run measuring
    maskc beside another implementation, and those runs."""
    def length(row: dict) -> tuple:
        return row["model"], row["compiled"], row["tokens"], row["docs"]

    runs = newest_runs(rows, "train", lambda row: True, length)
    shown = [row for row in rows if row["kind"] == "train" and runs.get(length(row)) == row["run"]]
    return shown, list(dict.fromkeys(runs.values()))


def train_newest(rows: Sequence[dict]) -> list[str]:
    """The main page's training-steps section: one table per model, its lengths from their newest runs."""
    shown, runs = train_rows(rows)
    if not shown:
        return []
    named = "; ".join(dict.fromkeys(describe(rows, run) for run in runs))
    return [TRAIN, f"The newest run of each length: {named}.", *train_table(shown), ""]


def span(values: Sequence[float], digits: str = ".2f") -> str:
    """'0.91-0.99': the range of `values` in format `digits`, one figure where both ends agree, a dash for none."""
    if not values:
        return DASH
    low, high = f"{min(values):{digits}}", f"{max(values):{digits}}"
    return low if low == high else f"{low}-{high}"


def ratio_spans(kernel: Sequence[dict], directions: Sequence[str]) -> dict[str, str]:
    """Each ratio column's range over the masks of `kernel` (one length of one run), 'fwd / bwd';
    the full mask is left out of OVER_FULL, where it is 1 by definition."""
    by_mask: dict[str, list[dict]] = defaultdict(list)
    for row in kernel:
        by_mask[row["mask"]].append(row)
    spans = {}
    for title, sides in ratio_sides(kernel).items():
        found: dict[str, list[float]] = defaultdict(list)
        for mask, line in by_mask.items():
            if title != OVER_FULL or mask != "full":
                for direction, ratio in direction_ratios(*sides(line)).items():
                    found[direction].append(ratio)
        spans[title] = " / ".join(span(found[d]) for d in directions) if found else DASH
    return spans


#: The length of the main page's line per other head dim and head count.
OTHER_SHAPES_SEQLEN = 16384


def other_shapes(rows: Sequence[dict]) -> list[str]:
    """The main page's line per head dim, dtype and head count other than DEFAULT_SHAPE, from the
    newest run measuring maskc beside another library at OTHER_SHAPES_SEQLEN: maskc's TFLOP/s on
    the full mask and the range of each ratio column over the masks."""
    def kept(row: dict) -> bool:
        return row["seqlen"] == OTHER_SHAPES_SEQLEN and shape(row) != DEFAULT_SHAPE and row["impl"] in KERNEL_IMPLS

    newest = newest_runs(rows, "kernel", kept, shape)
    shown = {config: [row for row in of_run(rows, run, "kernel") if kept(row) and shape(row) == config]
             for config, run in sorted(newest.items(), key=lambda item: shape_order(item[0]))}  # fmt: skip
    directions = [d for d in ("fwd", "bwd") if any(row["direction"] == d for kernel in shown.values() for row in kernel)]
    lines = []
    for (head_dim, dtype, heads), kernel in shown.items():
        spans = ratio_spans(kernel, directions)
        full = [row for row in kernel if row["impl"] == "maskc" and row["mask"] == "full"]
        lines.append([str(head_dim), dtype, heads, run_source(kernel[0]), direction_cell(full, directions),
                      *(spans.get(title, DASH) for title in (OVER_FA4, OVER_FLEXIBLE, OVER_FULL))])  # fmt: skip
    if not lines:
        return []
    header = ["head dim", "dtype", "heads", "run", "maskc, full mask", OVER_FA4, OVER_FLEXIBLE, OVER_FULL]
    return [OTHER_SHAPES, *markdown_table(header, lines, [0, 4]), ""]


def render(rows: Sequence[dict]) -> str:
    """docs/performance.md for `rows` (read_results' order): the newest run of each kind."""
    plots = plot_runs(rows)
    out = [INTRO, SETTINGS]
    if devices := newest_runs_at_settings(rows):
        out.append(ONE_GPU)
        for device, runs in devices.items():
            out += device_section(rows, device, runs)
    out += figure(rows, plots, KERNEL_PLOT, KERNEL_CAPTION, named=False)
    out += other_shapes(rows)
    out += memory_section(rows)
    out += dist_section(rows, plots)
    out += train_newest(rows)
    out += host_calls(rows)
    out += [SHORT + SHORT_SUMMARY, *shortfall_summary(rows), *host_shortfalls(rows), "", LIMITS_SHORT]
    return "\n".join(out).rstrip("\n") + "\n"


def render_history(rows: Sequence[dict]) -> str:
    """docs/performance-history.md for `rows` (read_results' order): every run holding a newest
    measurement, and every shortfall."""
    plots = plot_runs(rows)
    out = [HISTORY_INTRO, SETTINGS, REPRODUCING, ONE_GPU, ONE_GPU_EVERY_RUN]
    out += figure(rows, plots, KERNEL_PLOT, KERNEL_CAPTION)
    out += run_sections(rows, current_runs(rows, "kernel", KERNEL_IMPLS), kernel_tables)
    out += [SEVERAL_GPUS, *figure(rows, plots, DIST_PLOT, DIST_CAPTION)]
    out += run_sections(rows, current_runs(rows, "dist", DIST_IMPLS), dist_tables)
    out += train_section(rows)
    out += [SHORT + SHORT_EVERY, *kernel_shortfalls(rows), *host_shortfalls(rows), "", LIMITS]
    out += [*host_table(rows), PLANS]
    for kind, fields in (("plan", PLAN_FIELDS), ("stages", STAGES_FIELDS)):
        out += run_sections(rows, current_runs(rows, kind), lambda mine, kind=kind, fields=fields: field_table(
            [row for row in mine if row["kind"] == kind], fields))  # fmt: skip
    return "\n".join(out).rstrip("\n") + "\n"


def render_pages(rows: Sequence[dict]) -> dict[Path, str]:
    """Each page bench/report.py writes, with its text for `rows`."""
    return {DOC: render(rows), HISTORY: render_history(rows)}


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
    parser.add_argument("--check", action="store_true", help="only check that the pages are up to date")
    parser.add_argument("--plots", action="store_true", help="also redraw the figures under docs/img (needs matplotlib)")
    args = parser.parse_args()
    rows = read_results(args.results)
    pages = render_pages(rows)
    if args.check:
        stale = [str(path.relative_to(ROOT)) for path, text in pages.items() if not path.exists() or path.read_text() != text]
        if stale:
            sys.exit(f"{', '.join(stale)} out of date: run python bench/report.py")
        return
    for path, text in pages.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    if args.plots:
        for path in draw(rows):
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
