"""Kernel benchmark on MagiAttention's settings: b=1, heads 64:8, bf16, seqlen 1k..64k, head dim
128 or a sweep of head dims (and of dtypes, --dtypes bf16,fp16, and of head counts, --heads
64:8,64:64,64:1 for GQA, MHA and MQA).

maskc beside FlashAttention-4 (where it supports the mask natively), torch SDPA (cuDNN and
flash backends, full/causal) and the flexible-mask libraries (FlexAttention on its Triton and on
FA4's backend, FA4's own mask_mod; one BlockMask per mask, built without the dense S x S step), in
one run, each checked against maskc's output (and gradients) on the same inputs first (`max_err`),
forward TFLOP/s with the seeds'
formula, counting the q/k and v head dims apart: 2 * area * Hq * (Dqk + Dv) / time (4 * area *
Hq * D where they are equal). Varlen documents come from the real length histogram
(`common.pack_documents`). Masks are the shipped examples, lowered by maskc.

--head-dims measures every mask and seqlen at each head dim (default 128): D, or Dqk/Dv like
192/128 (q and k 192, v 128, as in MLA-style models), so q is [S, 64, Dqk], k [S, 8, Dqk] and
v [S, 8, Dv]. A library that cannot run a head dim records an error row for it, and the run
goes on.

With --backward, also the backward TFLOP/s (2.5 x the forward FLOPs, `out.backward` timed alone)
and the peak memory of one forward + backward of every implementation. --deterministic adds
maskc with deterministic=True, --portable maskc's portable kernels, --portable-next the experimental
next portable kernels beside them in the same run.

First comes the host time: the CPU time of one call on a problem so small (128 causal tokens,
64:8 heads, d=128, bf16) that the GPU never holds the host back, of maskc.attention beside SDPA
(cuDNN backend) and FA4 (where flash_attn is installed), forward alone (under no_grad) and
forward + backward through autograd, each timed in batches that take turns with the other
libraries' (the median batch). --host-only measures just that, for a short GPU call;
--no-host skips it (kernel A/B runs).

Run on the GPU machine: `python bench/kernel.py --artifacts DIR... [--seqlens 16384,65536]
[--head-dims 64,128,192/128] [--dtypes bf16,fp16] [--heads 64:8,64:64] [--backward]
[--deterministic] [--portable] [--portable-next] [--host-only | --no-host]` (DIR: `maskc compile` directories
holding the kernels of those head dims, dtypes and head counts, and bf16 64:8 d=128's with its
backward for the host time). Appends kernel, memory and host rows to bench/results (or --out;
see bench/README.md) and prints the run's tables.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import pack_documents
from record import HOST_IMPLS, HOST_PASSES, RESULTS, Run
from report import kernel_tables, markdown_table

import maskc
from maskc.artifact.kernel_families import PORTABLE_NEXT_ENV, HeadDim
from maskc.frontend import load
from maskc.ir import Mask
from maskc.runtime.call_plan import TORCH_DTYPES

HQ, HKV = 64, 8
#: The head dim of the host time (and of bench/dist.py).
D = 128
WINDOW = 1024
BLOCK = 1024
#: Shared question: the question's share of the sequence; the answers are packed documents.
QUESTION_SHARE = 8
#: Global + sliding window: global tokens, and the keys a query sees on each side (2 * 512 + 1
#: around it, about the sliding window's 1024).
GLOBALS = 256
HALF_WINDOW = WINDOW // 2
HOST_TOKENS = 128
HOST_WARMUP = 50
HOST_CALLS = 2000
#: The batches the host calls are timed in, each implementation's taking turns with the others'.
HOST_ROUNDS = 10
#: The dtypes --dtypes may name (maskc's kernel dtypes), by the name their rows record.
DTYPES = {name: dtype for dtype, name in TORCH_DTYPES.items()}
MASKS = ("full", "causal", "varlen_full", "varlen_causal", "sliding_window_causal", "varlen_block_causal",
         "shared_question", "global_sliding_window")  # fmt: skip


def question_docs(seqlen: int) -> np.ndarray:
    """The shared-question mask's documents: the question (a QUESTION_SHARE-th of the sequence),
    then answers of real document lengths."""
    question = seqlen // QUESTION_SHARE
    return np.r_[question, pack_documents(seqlen - question, seed=seqlen + 1)]


def build_masks(seqlen: int) -> tuple[dict[str, Mask], np.ndarray]:
    """Every benchmark mask at `seqlen`, lowered from examples/, and the document lengths."""
    lens = pack_documents(seqlen, seed=seqlen)

    def lower(name: str, **params: object) -> Mask:
        return load(ROOT / "examples" / f"{name}.mask")[name].lower(**params)

    masks = {
        "full": lower("full", n=seqlen),
        "causal": lower("causal", n=seqlen),
        "varlen_full": lower("varlen_full", docs=lens),
        "varlen_causal": lower("varlen_causal", docs=lens),
        # The seeds' window W counts the diagonal: a query sees W keys, i.e. W - 1 before it.
        "sliding_window_causal": lower("sliding_window_causal", n=seqlen, window=WINDOW - 1),
        "varlen_block_causal": lower("varlen_block_causal", docs=lens, block=BLOCK),
        "shared_question": lower("shared_question", docs=question_docs(seqlen)),
        "global_sliding_window": lower("global_sliding_window", n=seqlen, globals=GLOBALS, window=HALF_WINDOW),
    }
    return masks, lens


def parse_head_dims(text: str) -> list[HeadDim]:
    """--head-dims: comma-separated head dims, each D or Dqk/Dv (like 192/128)."""
    try:
        return [HeadDim.parse(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_heads(text: str) -> list[tuple[int, int]]:
    """--heads: comma-separated HQ:HKV pairs, each HKV dividing HQ."""
    pairs = []
    for part in text.split(","):
        try:
            hq, hkv = map(int, part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"heads must be HQ:HKV like 64:8, got {part!r}") from None
        if hq < 1 or hkv < 1 or hq % hkv:
            raise argparse.ArgumentTypeError(f"{part}: the kv heads must divide the query heads")
        pairs.append((hq, hkv))
    return pairs


def parse_dtypes(text: str) -> list[str]:
    """--dtypes: comma-separated DTYPES names."""
    names = text.split(",")
    if unknown := [name for name in names if name not in DTYPES]:
        raise argparse.ArgumentTypeError(f"unknown dtype {unknown[0]!r}: choose among {', '.join(DTYPES)}")
    return names


def head_dim_field(head_dim: HeadDim) -> int | str:
    """A row's head_dim: the int D where q/k and v agree (as in every row before asymmetric head
    dims), else "Dqk/Dv"."""
    return head_dim.qk if head_dim.qk == head_dim.v else str(head_dim)


def forward_flops(area: int, head_dim: HeadDim, heads_q: int = HQ) -> int:
    """FLOPs of the forward: Q K^T over Dqk and P V over Dv on every unmasked (query, key) pair
    of every one of `heads_q` query heads; the seeds' 4 * area * Hq * D where Dqk = Dv = D."""
    return 2 * area * heads_q * (head_dim.qk + head_dim.v)


def timed_tflops(fn: Callable[[], object], flops: int) -> float:
    """TFLOP/s of `fn`, which does `flops` FLOPs a call."""
    from triton.testing import do_bench

    fn()
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return flops / ms / 1e9


def timed_backward_tflops(fn: Callable[[], object], flops: int, leaves: list[torch.Tensor]) -> float:
    """Backward TFLOP/s of `fn`'s output, timed alone: the seeds' 2.5 x the forward's `flops`."""
    from triton.testing import do_bench

    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)
    ms = do_bench(lambda: out.backward(grad, retain_graph=True), warmup=10, rep=60, return_mode="median", grad_to_none=leaves)
    return 2.5 * flops / ms / 1e9


def peak_memory_mib(fn: Callable[[], object], leaves: list[torch.Tensor]) -> float:
    """GPU memory one forward + backward of `fn` needs on top of its inputs (MiB): what grows
    with the problem (FlexAttention's block mask, any S-sized buffer) shows up here."""
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    for x in leaves:
        x.grad = None
    return peak / 2**20


@dataclass(frozen=True)
class MaskTables:
    """Per token of a benchmark sequence, what the mask_mods of the flexible-mask libraries read
    (int32, on the device): its document, its block within the document (varlen block causal)
    and its part of the shared-question mask (0: the question, i > 0: the i-th answer)."""

    doc: torch.Tensor
    block: torch.Tensor
    asked: torch.Tensor

    def aux(self) -> list[torch.Tensor]:
        """FA4's aux tensors, in the order bench/fa4_masks.py reads them."""
        return [self.doc, self.block, self.asked]


def mask_tables(seqlen: int, lens: np.ndarray, device: torch.device | str) -> MaskTables:
    """The MaskTables of the benchmark masks at `seqlen` with documents `lens`."""
    def doc_ids(lens: np.ndarray) -> np.ndarray:
        return np.repeat(np.arange(len(lens)), lens)

    doc = doc_ids(lens)
    start = np.r_[0, np.cumsum(lens)[:-1]][doc]
    block = (np.arange(seqlen) - start) // BLOCK
    return MaskTables(*(torch.as_tensor(x, dtype=torch.int32, device=device) for x in (doc, block, doc_ids(question_docs(seqlen)))))


def flex_mask_mod(name: str, seqlen: int, lens: np.ndarray, device: torch.device, q_offset: int = 0) -> Callable | None:
    """FlexAttention's mask_mod of benchmark mask `name` (None: full), for query rows starting at
    global row `q_offset` (a rank's shard in bench/dist.py)."""
    t = mask_tables(seqlen, lens, device)
    doc, block, asked = t.doc, t.block, t.asked
    o = q_offset
    mods = {
        "full": None,
        "causal": lambda b, h, i, j: i + o >= j,
        "varlen_full": lambda b, h, i, j: doc[i + o] == doc[j],
        "varlen_causal": lambda b, h, i, j: (doc[i + o] == doc[j]) & (i + o >= j),
        "sliding_window_causal": lambda b, h, i, j: (i + o >= j) & (i + o - j < WINDOW),
        "varlen_block_causal": lambda b, h, i, j: (doc[i + o] == doc[j]) & (block[j] <= block[i + o]),
        "shared_question": lambda b, h, i, j: ((asked[i + o] == asked[j]) & (i + o >= j)) | ((asked[j] == 0) & (asked[i + o] > 0)),
        "global_sliding_window": lambda b, h, i, j: (j < GLOBALS) | (i + o < GLOBALS) | ((i + o - j).abs() <= HALF_WINDOW),
    }
    return mods[name]


def compiled_flex() -> Callable:
    """FlexAttention under torch.compile. It recompiles per shape, mask, backend and grad mode;
    past dynamo's default limits it would fall back to eager, which materialises every score
    (and runs out of memory at long sequences), so the limits are raised. Its backward is timed
    on one graph run again and again (retain_graph), which buffers donated to the backward
    would forbid."""
    import torch._functorch.config as functorch_config
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 1000
    torch._dynamo.config.recompile_limit = 1000
    functorch_config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def block_mask(mod: Callable | None, seqlen: int, device: torch.device) -> object | None:
    """The FlexAttention BlockMask of `mod` (None for the full mask), built compiled: the
    default builds the whole S x S mask first (32 GiB for global + window at 64k), the compiled
    one only the blocks'."""
    from torch.nn.attention.flex_attention import create_block_mask

    return None if mod is None else create_block_mask(mod, 1, None, seqlen, seqlen, device=device, _compile=True)


def fa4_mask_mod_call(name: str, tables: MaskTables, blocks: object, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> Callable[[], object]:  # fmt: skip
    """FA4's own mask_mod + block-sparse path on mask `name`: the mask_mod of bench/fa4_masks.py
    over `tables`, and `blocks` (the BlockMask FlexAttention gets) as its block-sparse tensors,
    k blocks per q block for the forward and q blocks per k block for the backward."""
    from fa4_masks import MASK_MODS
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    size = tuple(blocks.BLOCK_SIZE)
    forward = BlockSparseTensorsTorch(blocks.kv_num_blocks, blocks.kv_indices, blocks.full_kv_num_blocks,
                                      blocks.full_kv_indices, block_size=size)  # fmt: skip
    backward = BlockSparseTensorsTorch(blocks.q_num_blocks, blocks.q_indices, blocks.full_q_num_blocks,
                                       blocks.full_q_indices, block_size=size)  # fmt: skip
    return lambda: flash_attn_func(q[None], k[None], v[None], mask_mod=MASK_MODS[name], aux_tensors=tables.aux(),
                                   block_sparse_tensors=forward, block_sparse_tensors_bwd=backward)  # fmt: skip


#: The baselines' row names (`baselines`), each run where it expresses the mask.
BASELINES = ("sdpa_cudnn", "sdpa_flash", "flex", "flex_fa4", "fa4", "fa4_mask_mod")


def baselines(name: str, seqlen: int, lens: np.ndarray, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable]:
    """The baseline calls that express mask `name` natively (seqlen-first q/k/v): SDPA (full and
    causal), FlexAttention on its Triton and its FA4 backend, and FA4 (its own masks, and every
    other through its mask_mod) where flash_attn is installed."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls: dict[str, Callable] = {}
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if name in ("full", "causal"):
        for backend, tag in ((SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn"), (SDPBackend.FLASH_ATTENTION, "sdpa_flash")):

            def sdpa(backend=backend) -> torch.Tensor:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=name == "causal", enable_gqa=True)

            calls[tag] = sdpa
    blocks = block_mask(flex_mask_mod(name, seqlen, lens, q.device), seqlen, q.device)
    flex = compiled_flex()
    calls["flex"] = lambda: flex(qt, kt, vt, block_mask=blocks, enable_gqa=True)
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return calls
    calls["flex_fa4"] = lambda: flex(qt, kt, vt, block_mask=blocks, enable_gqa=True, kernel_options={"BACKEND": "FLASH"})
    cu = torch.as_tensor(np.r_[0, np.cumsum(lens)], dtype=torch.int32, device=q.device)
    longest = int(lens.max())
    fa4 = {
        "full": lambda: flash_attn_func(q[None], k[None], v[None], causal=False),
        "causal": lambda: flash_attn_func(q[None], k[None], v[None], causal=True),
        "sliding_window_causal": lambda: flash_attn_func(q[None], k[None], v[None], causal=True, window_size=(WINDOW - 1, 0)),
        "varlen_full": lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=False),
        "varlen_causal": lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True),
    }
    if name in fa4:
        calls["fa4"] = fa4[name]
    if blocks is not None:
        calls["fa4_mask_mod"] = fa4_mask_mod_call(name, mask_tables(seqlen, lens, q.device), blocks, q, k, v)
    return calls


def inputs(seqlen: int, head_dim: HeadDim, requires_grad: bool, device: str = "cuda", dtype: str = "bf16",
           heads: tuple[int, int] = (HQ, HKV)) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """q [S, Hq, Dqk], k [S, Hkv, Dqk], v [S, Hkv, Dv] in `dtype` (a DTYPES name) with `heads` (Hq,
    Hkv), the same for every run at `seqlen`."""
    torch.manual_seed(seqlen)
    hq, hkv = heads
    shapes = ((hq, head_dim.qk), (hkv, head_dim.qk), (hkv, head_dim.v))
    return tuple(torch.randn(seqlen, h, d, device=device, dtype=DTYPES[dtype], requires_grad=requires_grad) for h, d in shapes)


def maskc_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, **options: bool) -> Callable[[], torch.Tensor]:
    """maskc.attention's output on these inputs, with `options`."""
    return lambda: maskc.attention(q, k, v, mask, **options)[0]


def portable_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, next_family: bool) -> Callable[[], torch.Tensor]:
    """maskc.attention's output with portable=True, on the verified portable kernels or (with
    `next_family`) the experimental next ones, whatever $MASKC_PORTABLE_NEXT says outside the
    call: a call's backward runs its forward's family, so one run times both side by side."""
    def call() -> torch.Tensor:
        saved = os.environ.get(PORTABLE_NEXT_ENV)
        os.environ[PORTABLE_NEXT_ENV] = "1" if next_family else "0"
        try:
            return maskc.attention(q, k, v, mask, portable=True)[0]
        finally:
            if saved is None:
                del os.environ[PORTABLE_NEXT_ENV]
            else:
                os.environ[PORTABLE_NEXT_ENV] = saved

    return call


class BaselineMismatch(ValueError):
    """A baseline computes other attention than maskc on the same inputs: its timing would
    compare unlike work, so its rows record this instead."""


#: The largest difference a baseline's output or gradients may have from maskc's on the same
#: inputs, relative to the largest magnitude of maskc's: bf16 rounding and summation order differ
#: by a few 1e-3; a mask that keeps other pairs, or a kernel that skips blocks, by far more.
AGREEMENT = 0.05


@dataclass(frozen=True)
class Outputs:
    """One implementation's attention on a case, seqlen-first in float32: its output [S, Hq, Dv]
    and, where its backward ran, the gradients of q, k and v."""

    out: torch.Tensor
    grads: tuple[torch.Tensor, ...] = ()


def seqlen_first(out: object, seqlen: int) -> torch.Tensor:
    """An implementation's output as [S, Hq, Dv]: maskc's as it is; FA4's ([1, S, H, D], first of
    a tuple) and SDPA's or FlexAttention's ([1, H, S, D]) without their batch."""
    out = out[0] if isinstance(out, tuple) else out
    if out.dim() == 3:
        return out
    return out[0] if out.shape[1] == seqlen else out[0].transpose(0, 1)


def outputs(call: Callable[[], object], seqlen: int, leaves: Sequence[torch.Tensor] = (), grad: torch.Tensor | None = None) -> Outputs:
    """`call`'s Outputs: the output alone (under no_grad) without `leaves`; with them, also their
    gradients against `grad` (an [S, Hq, Dv] gradient of the output)."""
    if not leaves:
        with torch.no_grad():
            return Outputs(seqlen_first(call(), seqlen).float())
    for x in leaves:
        x.grad = None
    out = seqlen_first(call(), seqlen)
    out.backward(grad)
    grads = tuple(x.grad.float() for x in leaves)
    for x in leaves:
        x.grad = None
    return Outputs(out.detach().float(), grads)


def agreement(theirs: Sequence[torch.Tensor], ours: Sequence[torch.Tensor], what: str) -> float:
    """The largest difference of `theirs` from `ours` (tensor by tensor), relative to the largest
    magnitude of ours; BaselineMismatch where over AGREEMENT (or not a number)."""
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(theirs, ours, strict=True))
    if not worst <= AGREEMENT:
        raise BaselineMismatch(f"its {what} differ from maskc's by {worst:.3g} of their largest magnitude (at most {AGREEMENT} agree)")
    return worst


@dataclass(frozen=True)
class Expected:
    """What a baseline's rows are checked against: maskc's Outputs on the case, and the gradient
    of the output its backward took."""

    outputs: Outputs
    grad: torch.Tensor | None = None


def measure(run: Run, case: dict, impl: str, call: Callable[[], object], leaves: list[torch.Tensor] | None,
            expected: Expected | None = None) -> list[dict]:  # fmt: skip
    """The rows of `impl` on `case` (whose head_dim gives the FLOPs): forward TFLOP/s; with
    `leaves` (the inputs whose gradients the backward computes) also backward TFLOP/s and the
    peak memory of a forward + backward. With `expected`, the output (and the gradients) must first
    agree with maskc's, and the rows carry how closely they did (`max_err`). Whatever raises (a
    library without a kernel for the case, maskc without a backward at the head dim, a baseline
    that computes other attention) is recorded as the rows' error."""
    flops = forward_flops(case["area"], HeadDim.parse(str(case["head_dim"])), int(case["heads"].split(":")[0]))

    def forward() -> list[dict]:
        checked = {}
        if expected is not None:
            checked["max_err"] = agreement([outputs(call, case["seqlen"]).out], [expected.outputs.out], "outputs")
        with torch.no_grad():
            return [{"tflops": timed_tflops(call, flops), **checked}]

    def backward() -> list[dict]:
        checked = {}
        if expected is not None and expected.grad is not None:
            theirs = outputs(call, case["seqlen"], leaves, expected.grad).grads
            checked["max_err"] = agreement(theirs, expected.outputs.grads, "gradients")
        return [{"tflops": timed_backward_tflops(call, flops, leaves), **checked}, {"peak_mib": peak_memory_mib(call, leaves)}]

    rows = run.write_measured([("kernel", {**case, "impl": impl, "direction": "fwd"})], forward)
    if leaves is not None:
        rows += run.write_measured(
            [("kernel", {**case, "impl": impl, "direction": "bwd"}), ("memory", {**case, "impl": impl})], backward
        )
    return rows


def host_step(impl: str, pass_: str, calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> str:
    """The `step` of `impl`'s host row of `pass_` (a HOST_PASSES key): what was timed, on what, and
    how (`measure_host`). Rows of the earlier method (one batch of 2000 calls, "mean of 2000")
    keep their own steps: the two do not compare."""
    return (f"{HOST_IMPLS[impl]} ({HOST_PASSES[pass_]}, {HOST_TOKENS} causal tokens, {HQ}:{HKV} heads, d={D}; "
            f"median of {rounds} interleaved batches of {calls // rounds})")  # fmt: skip


@dataclass(frozen=True)
class HostCall:
    """One implementation on the host-time problem: its call (returning the attention output),
    its inputs (leaves, whose gradients its backward fills), and the context it runs under. They
    are set up once outside the timed loop, so that the loop times the call and nothing else."""

    call: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]
    context: Callable[[], AbstractContextManager] = nullcontext


def host_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, HostCall]:
    """maskc, SDPA cuDNN and (where flash_attn is installed) FA4 on seqlen-first q/k/v of the
    host-time problem. Each gets leaves of its own, aliasing q/k/v in the layout it takes (the
    baselines' views are made here, not in the call, and as leaves their backward runs no view
    ops); SDPA's backend is chosen around each batch, as entering sdpa_kernel costs about 10 us."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def leaves(layout: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(layout(x.detach()) for x in (q, k, v))

    mq, mk, mv = ours = leaves(lambda x: x)
    calls = {"maskc": HostCall(maskc_call(mq, mk, mv, Mask.from_cu_seqlens([0, HOST_TOKENS], causal=True)), ours)}
    sq, sk, sv = sdpa = leaves(lambda x: x.transpose(0, 1).unsqueeze(0))
    calls["sdpa_cudnn"] = HostCall(
        lambda: F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True), sdpa,
        lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]),
    )
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        print("flash_attn is not installed: no FA4 host rows", flush=True)
        return calls
    fq, fk, fv = fa4 = leaves(lambda x: x[None])
    calls["fa4"] = HostCall(lambda: flash_attn_func(fq, fk, fv, causal=True)[0], fa4)
    return calls


def forward_backward(host: HostCall) -> Callable[[], None]:
    """What a training step does with `host`: its leaves' gradients set to None (as zero_grad
    does), the call, and its backward through autograd against a gradient made here, once."""
    grad = torch.randn_like(host.call())

    def step() -> None:
        for x in host.leaves:
            x.grad = None
        host.call().backward(grad)

    return step


def warmed_pass(host: HostCall, backward: bool, engine_threads: bool = True) -> tuple[Callable[[], object], Callable[[], ExitStack]]:
    """`host` warmed up for one pass: its forward alone, as in inference (under no_grad, on inputs
    that need no gradient: FA4 would allocate its LSE for one that does), or with `backward` its
    forward_backward (without `engine_threads`, autograd runs the backward on the calling thread,
    not on the device's). Returns the pass's call and the context it runs in (entered anew each
    time)."""
    for x in host.leaves:
        x.requires_grad_(backward)

    def context() -> ExitStack:
        stack = ExitStack()
        for manager in (host.context(), torch.set_grad_enabled(backward), torch.autograd.set_multithreading_enabled(engine_threads)):
            stack.enter_context(manager)
        return stack

    with context():
        once = forward_backward(host) if backward else host.call
        for _ in range(HOST_WARMUP):
            once()
    return once, context


def host_batches(host: HostCall, backward: bool, engine_threads: bool = True) -> Callable[[int], tuple[float, float]]:
    """`host`'s pass warmed up (`warmed_pass`), and a function that times a batch of it: the mean
    time of one call over that many calls back to back, in microseconds, synchronized only
    before and after: the host's (the calls issued) and the wall's (their GPU work done too; the
    GPU work is tiny, so the two agree and the host is what is timed)."""
    once, context = warmed_pass(host, backward, engine_threads)

    def batch(calls: int) -> tuple[float, float]:
        with context():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                once()
            issued = time.perf_counter() - start
            torch.cuda.synchronize()
            done = time.perf_counter() - start
        return issued / calls * 1e6, done / calls * 1e6

    return batch


def host_times_us(hosts: dict[str, HostCall], backward: bool, calls: int, rounds: int,
                  engine_threads: bool = True) -> dict[str, list[tuple[float, float]] | Exception]:  # fmt: skip
    """Per implementation, its batch times (host, wall) of one pass (`host_batches`, `calls //
    rounds` calls a batch), the implementations taking turns batch by batch: whatever else the
    machine does meanwhile (its clocks, other processes) falls on all of them alike, so the times
    of one run compare. What raises (a baseline without a kernel for the problem) is that
    implementation's result and leaves the turns."""
    times: dict[str, list[tuple[float, float]] | Exception] = {}
    batches = {}
    for impl, host in hosts.items():
        try:
            batches[impl] = host_batches(host, backward, engine_threads)
            times[impl] = []
        except Exception as exc:  # noqa: BLE001 (a failure of the measured library is a result)
            times[impl] = exc
    for _ in range(rounds):
        for impl, batch in list(batches.items()):
            try:
                times[impl].append(batch(calls // rounds))
            except Exception as exc:  # noqa: BLE001
                times[impl] = exc
                del batches[impl]
    return times


def measure_host(run: Run, device: str = "cuda", calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> dict[str, dict[str, dict]]:
    """The host rows of every implementation and pass ({impl: {pass: row}}), all on the same q/k/v:
    per pass the median and the fastest host time of the implementations' interleaved batches
    (host_times_us). An error (the exception of a baseline that cannot run) is the row's, not
    the run's end."""
    q, k, v = inputs(HOST_TOKENS, HeadDim(D, D), False, device)
    hosts = host_calls(q, k, v)
    measured = {pass_: host_times_us(hosts, pass_ == "fwd+bwd", calls, rounds) for pass_ in HOST_PASSES}
    rows: dict[str, dict[str, dict]] = {}
    for impl in hosts:
        for pass_ in HOST_PASSES:
            step = host_step(impl, pass_, calls, rounds)

            measured_times = measured[pass_][impl]
            times = [host for host, _ in measured_times] if isinstance(measured_times, list) else measured_times

            def median_ms(times: list[float] | Exception = times) -> list[dict]:
                if isinstance(times, Exception):
                    raise times
                return [{"ms": statistics.median(times) / 1e3, "min_ms": min(times) / 1e3}]

            [row] = run.write_measured([("host", {"step": step})], median_ms)
            rows.setdefault(impl, {})[pass_] = row
            value = row["error"] if "error" in row else f"{row['ms'] * 1e3:.1f} us (batches {min(times):.1f} to {max(times):.1f})"
            print(f"{step}: {value}", flush=True)
    return rows


def host_table(rows: dict[str, dict[str, dict]]) -> list[str]:
    """measure_host's rows as a table: microseconds per call, forward and forward + backward."""

    def cell(row: dict) -> str:
        return "failed" if "error" in row else f"{row['ms'] * 1e3:.1f}"

    lines = [[impl, *(cell(passes[pass_]) for pass_ in HOST_PASSES)] for impl, passes in rows.items()]
    return markdown_table(["impl", "forward (us)", "fwd+bwd (us)"], lines, [1, 2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--artifacts", required=True, type=Path, nargs="+",
        help="maskc compile directories with the kernels of the --head-dims, --dtypes and --heads (and bf16 64:8 d=128's with its backward, for the host time)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    parser.add_argument("--seqlens", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument(
        "--head-dims", type=parse_head_dims, default=[HeadDim(D, D)],
        help="comma-separated head dims, each D or Dqk/Dv (q and k Dqk, v Dv), e.g. 64,128,192/128 (default: 128)",
    )
    parser.add_argument(
        "--dtypes", type=parse_dtypes, default=["bf16"],
        help=f"comma-separated dtypes among {', '.join(DTYPES)}, each measured at every head dim (default: bf16)",
    )
    parser.add_argument(
        "--heads", type=parse_heads, default=[(HQ, HKV)],
        help=f"comma-separated query:kv head counts, each measured at every head dim and dtype (default: {HQ}:{HKV})",
    )
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument(
        "--baselines", type=lambda text: set(text.split(",")), default=None,
        help=f"comma-separated baselines to run, among {', '.join(BASELINES)} (default: every one)",
    )
    parser.add_argument("--backward", action="store_true", help="also time the backward of every implementation")
    parser.add_argument(
        "--deterministic", action="store_true", help="also maskc with deterministic=True (needs those kernels)"
    )
    parser.add_argument(
        "--portable", action="store_true", help="also maskc's portable kernels (portable=True: warp MMA, every GPU since Ampere)"
    )
    parser.add_argument(
        "--portable-next", action="store_true",
        help="also the experimental next portable kernels (rows maskc_portable_next; needs `maskc compile --portable-next` kernels)",
    )
    host_time = parser.add_mutually_exclusive_group()
    host_time.add_argument(
        "--host-only", action="store_true", help="measure only the host time of maskc, SDPA cuDNN and FA4, and stop"
    )
    host_time.add_argument("--no-host", action="store_true", help="skip the host time (kernel A/B runs)")
    args = parser.parse_args()
    if args.baselines is not None and not args.baselines <= set(BASELINES):
        parser.error(f"--baselines: unknown {', '.join(sorted(args.baselines - set(BASELINES)))}; known: {', '.join(BASELINES)}")
    run = Run.start("kernel", torch.cuda.get_device_name(), args.out)
    for directory in args.artifacts:
        maskc.runtime.register_artifact(directory)
    host = None if args.no_host else measure_host(run)
    out = ["", f"run {run.run}", ""]
    if not args.host_only:
        rows = measure_kernels(run, args)
        out += [*kernel_tables(rows, {impl: impl for impl in dict.fromkeys(row["impl"] for row in rows)}), ""]
    if host is not None:
        out += ["Host time per call (us):", "", *host_table(host)]
    print("\n".join(out))


def expectation(maskc_call: Callable[[], torch.Tensor], seqlen: int, leaves: list[torch.Tensor] | None) -> Expected | None:
    """maskc's Outputs on a case, which the baselines' must agree with: with `leaves`, its
    gradients too, against a random gradient of the output, where maskc has the backward. None
    where maskc cannot run the case (its rows say why): the baselines go unchecked."""
    try:
        forward = outputs(maskc_call, seqlen)
    except Exception:  # noqa: BLE001 (maskc's own rows record what failed)
        return None
    if leaves is None:
        return Expected(forward)
    grad = torch.randn_like(forward.out, dtype=leaves[0].dtype)
    try:
        return Expected(outputs(maskc_call, seqlen, leaves, grad), grad)
    except Exception:  # noqa: BLE001
        return Expected(forward)


def measure_kernels(run: Run, args: argparse.Namespace) -> list[dict]:
    """The kernel and memory rows of every seqlen, head dim, dtype, head count, mask and
    implementation `args` name."""
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        masks, lens = build_masks(seqlen)
        for head_dim, dtype, heads in itertools.product(args.head_dims, args.dtypes, args.heads):
            q, k, v = inputs(seqlen, head_dim, args.backward, dtype=dtype, heads=heads)
            for name in args.masks.split(","):
                mask = masks[name]
                case = {"mask": name, "seqlen": seqlen, "heads": "{}:{}".format(*heads), "head_dim": head_dim_field(head_dim),
                        "dtype": dtype, "docs": len(lens), "area": mask.area()}
                calls = {"maskc": maskc_call(q, k, v, mask)}
                if args.deterministic:
                    calls["maskc_det"] = maskc_call(q, k, v, mask, deterministic=True)
                if args.portable:
                    calls["maskc_portable"] = portable_call(q, k, v, mask, next_family=False)
                if args.portable_next:
                    calls["maskc_portable_next"] = portable_call(q, k, v, mask, next_family=True)
                if not args.no_baselines:
                    calls.update((impl, call) for impl, call in baselines(name, seqlen, lens, q, k, v).items()
                                 if args.baselines is None or impl in args.baselines)  # fmt: skip
                leaves = [q, k, v] if args.backward else None
                expected = expectation(calls["maskc"], seqlen, leaves)
                for impl, call in calls.items():
                    for row in measure(run, case, impl, call, leaves, None if impl == "maskc" else expected):
                        rows.append(row)
                        value = row.get("tflops", row.get("peak_mib", row.get("error")))
                        print(f"{seqlen} d={head_dim} {dtype} {case['heads']} {name} {impl} {row['kind']} {row.get('direction', '')} {value}", flush=True)
    return rows


if __name__ == "__main__":
    main()
