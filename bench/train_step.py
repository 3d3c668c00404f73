"""Training steps of a Llama-style model in Hugging Face Transformers on one packed row of
real-length documents, with each attention implementation that keeps the documents apart.

The model: LlamaConfig with 8 layers, hidden 2048, 16:4 heads of 128, MLP 5632, vocab 32000,
bf16, built on the GPU with `from_config` and loaded with the same seeded weights for every
implementation; AdamW (fused). The row: --tokens tokens (batch 1) of documents whose lengths are
drawn from the real histogram (`common.pack_documents`: each at most a quarter of the row, the
last cut to fit), random token ids, position_ids that restart at 0 at every document, and
labels = input_ids (Transformers shifts them). Each implementation gets the documents the way it
takes them:

- `maskc`: attn_implementation="maskc" (`maskc.integrations.transformers`), position_ids alone;
- `flash_attention_4`, `flash_attention_2`: Transformers' own, given the documents as its
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them: `cu_seq_lens_q` /
  `cu_seq_lens_k` and `max_length_q` / `max_length_k` as Python ints, beside the position_ids
  (from the position_ids alone Transformers hands FA4 the longest document as a tensor, which its
  varlen call refuses); only where the package is installed (no kernel from the Hub in its place);
- `flex_attention`: a document-causal BlockMask as attention_mask, built compiled (no S x S step);
- `sdpa`: the dense [1, 1, S, S] boolean document-causal mask as attention_mask (16 GiB at 128k).

Every forward passes use_cache=False (a training step keeps no cache). An implementation that
cannot run a case (not installed, not accepted by this Transformers, out of memory) records an
error row, and the run goes on. Before timing, each implementation's first forward (same
weights, same row, no gradients) is compared with maskc's: its loss (`loss_diff`) and its last
hidden states (`hidden_diff`, relative L2 distance); beyond LOSS_TOLERANCE or HIDDEN_TOLERANCE it
attends across documents or computes something else, and its row records that instead of a time.

One step: zero_grad(set_to_none=True), forward with labels, loss.backward(), optimizer.step();
`ms` is the median over --steps steps after WARMUP steps, each between torch.cuda.synchronize()
calls; `tokens_per_s` is tokens / (ms / 1000); `peak_mib` is torch.cuda.max_memory_allocated over
the timed steps (weights, gradients and AdamW's states included). Every step trains on the same
row, so each mask is made once: maskc's plan is cached on the position_ids, the BlockMask and the
dense mask are built before the steps, and so are FlashAttention's document boundaries. --compile runs the steps through torch.compile(model).

Run on a GPU: `python bench/train_step.py [--tokens 32768,65536,131072] [--steps 10]
[--impls maskc,flash_attention_4,flash_attention_2,flex_attention,sdpa] [--compile]
[--artifacts DIR...]` (DIR: `maskc compile` directories with kernels for 16:4 heads, d=128,
bf16; without them maskc compiles its kernels on first use); appends train rows to
bench/results (or --out; see bench/README.md) and prints the run's table.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import transformers
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from transformers.utils import import_utils

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import pack_documents  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402
from report import train_table  # noqa: E402

import maskc.integrations.transformers  # noqa: E402 (registers attn_implementation="maskc")

#: The implementations, as Transformers' attn_implementation names them; maskc runs first, as
#: the others are checked against it.
IMPLS = ("maskc", "flash_attention_4", "flash_attention_2", "flex_attention", "sdpa")
TOKENS = (32768, 65536, 131072)
WARMUP = 3
SEED = 0
#: How far the first forward's loss may be from maskc's. Measured on the CPU with this model at
#: 4k tokens: maskc (its reference attention) and SDPA, both bf16, 2.4e-4 apart; bf16 and
#: float32 5e-4; attending across documents and not 1.8e-2. The loss of random tokens at
#: initialisation hardly depends on what attention sees, so the hidden states are compared too.
LOSS_TOLERANCE = 5e-3
#: How far the last hidden states may be from maskc's (relative L2 distance), in the same
#: measurement: 0.018 (maskc and SDPA), 0.12 (bf16 and float32), 1.2 (across documents).
HIDDEN_TOLERANCE = 0.5


@dataclass(frozen=True)
class Size:
    """The model's dimensions (the defaults: the benchmark's; TINY: the tests')."""

    layers: int = 8
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    intermediate: int = 5632
    vocab: int = 32000


TINY = Size(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=61)


def llama_config(size: Size, max_positions: int) -> transformers.LlamaConfig:
    """The LlamaConfig of `size`, without attention dropout (maskc has none); its use_cache stays
    Transformers' default (True), as in the configs models ship with."""
    return transformers.LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim, max_position_embeddings=max_positions, attention_dropout=0.0,
    )  # fmt: skip


def model_name(size: Size, dtype: torch.dtype) -> str:
    """What the rows' `model` says: every dimension, and the dtype."""
    return (f"Llama, {size.layers} layers, hidden {size.hidden}, {size.heads}:{size.kv_heads} heads of {size.head_dim}, "
            f"MLP {size.intermediate}, vocab {size.vocab}, {str(dtype).removeprefix('torch.')}")  # fmt: skip


@dataclass(frozen=True)
class PackedRow:
    """One row of packed documents: `lengths` sum to the row's tokens; `input_ids` and
    `position_ids` are [1, S], `document_ids` [S] (int32, the masks' tables)."""

    lengths: np.ndarray
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def packed_row(tokens: int, vocab: int, device: torch.device | str, seed: int = SEED) -> PackedRow:
    """`tokens` tokens of documents with real lengths (`common.pack_documents`), the same for a seed."""
    return row_of(pack_documents(tokens, seed), vocab, device, seed)


def row_of(lengths: Sequence[int] | np.ndarray, vocab: int, device: torch.device | str, seed: int = SEED) -> PackedRow:
    """The row of documents of `lengths`, with random token ids (the same for a seed)."""
    counts = torch.as_tensor(lengths)
    tokens = int(counts.sum())
    ids = torch.randint(vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    position_ids = (torch.arange(tokens) - starts)[None]
    document_ids = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)
    return PackedRow(np.asarray(lengths), *(x.to(device) for x in (ids, position_ids, document_ids)))


def document_causal(document_ids: torch.Tensor) -> Callable:
    """The FlexAttention mask_mod of causal attention within each document."""
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (document_ids[q_idx] == document_ids[kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


def block_mask(document_ids: torch.Tensor, compiled: bool = True) -> BlockMask:
    """The document-causal BlockMask, [1, 1, S, S] as Transformers passes a 4-D mask on; built
    compiled, it evaluates only the blocks' pairs (uncompiled, it first builds all S x S)."""
    seqlen = len(document_ids)
    return create_block_mask(document_causal(document_ids), 1, None, seqlen, seqlen, device=document_ids.device,
                             _compile=compiled)  # fmt: skip


def dense_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The document-causal [1, 1, S, S] boolean mask (True: attend) for SDPA, made in place so
    that one S x S tensor is all it takes."""
    return (document_ids[:, None] == document_ids[None, :]).tril_()[None, None]


def attention_mask(impl: str, row: PackedRow) -> torch.Tensor | BlockMask | None:
    """What `impl` gets as attention_mask: the others read the documents from position_ids."""
    if impl == "flex_attention":
        return block_mask(row.document_ids)
    if impl == "sdpa":
        return dense_mask(row.document_ids)
    return None


def flash_kwargs(row: PackedRow) -> dict:
    """The document boundaries Transformers' FlashAttention path takes, as its
    DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them (the lengths as ints)."""
    cu = torch.as_tensor(np.r_[0, np.cumsum(row.lengths)], dtype=torch.int32, device=row.input_ids.device)
    longest = int(row.lengths.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def batch(impl: str, row: PackedRow) -> dict:
    """The model's keyword arguments for a training forward of `impl` on `row`."""
    inputs = {"input_ids": row.input_ids, "position_ids": row.position_ids, "labels": row.input_ids, "use_cache": False}
    if impl.startswith("flash_attention_"):
        return {**inputs, **flash_kwargs(row)}
    mask = attention_mask(impl, row)
    return inputs if mask is None else {**inputs, "attention_mask": mask}


def require_installed(impl: str) -> None:
    """ImportError where a FlashAttention implementation's package is not installed: Transformers
    would otherwise fetch a kernel from the Hub in its place (or fail to, offline)."""
    if not impl.startswith("flash_attention_"):
        return
    version = impl.removeprefix("flash_attention_")
    available = getattr(import_utils, f"is_flash_attn_{version}_available", None)
    if available is None:
        raise ImportError(f"Transformers {transformers.__version__} has no {impl}")
    if not available():
        package = "flash-attn-4" if version == "4" else "flash-attn"
        raise ImportError(f"{impl} needs the {package} package and a CUDA GPU")


def build_model(impl: str, config: transformers.LlamaConfig, weights: dict[str, torch.Tensor], device: torch.device,
                dtype: torch.dtype) -> torch.nn.Module:  # fmt: skip
    """The model with `impl`'s attention on `device`, holding `weights`, in training mode."""
    require_installed(impl)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=dtype)
    model.load_state_dict(weights)
    return model.train()


def initial_weights(config: transformers.LlamaConfig, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The seeded initial weights every implementation starts from, kept on the CPU."""
    torch.manual_seed(SEED)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}


@dataclass(frozen=True)
class FirstForward:
    """An implementation's forward on the initial weights: its loss and last hidden states [S,
    hidden] (on the CPU)."""

    loss: float
    hidden: torch.Tensor


def first_forward(model: torch.nn.Module, inputs: dict) -> FirstForward:
    """The forward of the first step, without gradients."""
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    return FirstForward(float(out.loss), out.hidden_states[-1][0].cpu())


class DocumentMismatch(ValueError):
    """An implementation computes another model than maskc on the same weights and row: most
    likely it attends across documents. Its time would compare unlike work, so its row records
    this instead."""


def compare(first: FirstForward, reference: FirstForward | None) -> dict:
    """The row's `loss` and, against maskc's first forward `reference` (None: maskc did not run,
    nothing to check), `loss_diff` and `hidden_diff`; DocumentMismatch beyond a tolerance."""
    if reference is None:
        return {"loss": first.loss}
    loss_diff = abs(first.loss - reference.loss)
    ours, theirs = reference.hidden.float(), first.hidden.float()
    hidden_diff = float(torch.linalg.vector_norm(theirs - ours) / torch.linalg.vector_norm(ours))
    if not (loss_diff <= LOSS_TOLERANCE and hidden_diff <= HIDDEN_TOLERANCE):
        raise DocumentMismatch(
            f"attends across documents? loss {first.loss:.4f} against maskc's {reference.loss:.4f} "
            f"(at most {LOSS_TOLERANCE:g} apart), last hidden states {hidden_diff:.3f} apart (at most {HIDDEN_TOLERANCE:g})"
        )
    return {"loss": first.loss, "loss_diff": loss_diff, "hidden_diff": hidden_diff}


def train_step(forward: Callable[..., object], optimizer: torch.optim.Optimizer, inputs: dict) -> None:
    """One training step: zero_grad, forward with labels, backward, optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    forward(**inputs).loss.backward()
    optimizer.step()


def timed_steps(step: Callable[[], None], steps: int, device: torch.device) -> dict:
    """`ms`, the median time of `steps` steps after WARMUP, each between synchronizations, and on
    a GPU `peak_mib`, the most memory allocated in them."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(WARMUP):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    measured = {"ms": statistics.median(times)}
    if cuda:
        measured["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return measured


@dataclass
class Reference:
    """maskc's first forward on the current row, which the other implementations' must agree
    with; None until maskc ran (where it cannot, the others go unchecked)."""

    first: FirstForward | None = None


def measure(impl: str, config: transformers.LlamaConfig, weights: dict[str, torch.Tensor], row: PackedRow,
            args: argparse.Namespace, reference: Reference) -> list[dict]:  # fmt: skip
    """The values of `impl`'s row (one dict, as Run.write_measured takes them): its first forward
    checked against maskc's (maskc's becomes the reference), then its training steps timed."""
    model = build_model(impl, config, weights, args.device, args.dtype)
    inputs = batch(impl, row)
    first = first_forward(model, inputs)
    if impl == "maskc":
        reference.first = first
    checked = compare(first, None if impl == "maskc" else reference.first)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if args.compile else model
    timed = timed_steps(lambda: train_step(forward, optimizer, inputs), args.steps, args.device)
    return [{**timed, "tokens_per_s": row.tokens / (timed["ms"] / 1e3), **checked}]


def measure_all(run: Run, args: argparse.Namespace) -> list[dict]:
    """The train rows of every row length and implementation `args` name."""
    config = llama_config(args.size, max(args.tokens))
    weights = initial_weights(config, args.device, args.dtype)
    rows = []
    for tokens in args.tokens:
        row = packed_row(tokens, args.size.vocab, args.device)
        case = {"model": model_name(args.size, args.dtype), "tokens": tokens, "docs": len(row.lengths),
                "compiled": args.compile}  # fmt: skip
        reference = Reference()
        for impl in args.impls:
            # Each implementation compiles its own graphs (FlexAttention's, or the model's under
            # --compile) from scratch: the earlier ones' do not count towards dynamo's limits.
            torch._dynamo.reset()
            [result] = run.write_measured(
                [("train", {"impl": impl, **case})], partial(measure, impl, config, weights, row, args, reference)
            )
            rows.append(result)
            gc.collect()
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
            value = result.get("error") or f"{result['ms']:.1f} ms, {result['tokens_per_s']:,.0f} tokens/s"
            print(f"{tokens} tokens, {case['docs']} documents, {impl}: {value}", flush=True)
    return rows


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens must be comma-separated integers, got {text!r}") from None
    if any(n < 1 for n in tokens):
        raise argparse.ArgumentTypeError(f"every row holds at least one token, got {text!r}")
    return tokens


def parse_impls(text: str) -> list[str]:
    """The named implementations, maskc first (the others are checked against it)."""
    impls = list(dict.fromkeys(text.split(",")))
    if unknown := [impl for impl in impls if impl not in IMPLS]:
        raise argparse.ArgumentTypeError(f"unknown implementation {unknown[0]!r}: choose among {', '.join(IMPLS)}")
    return sorted(impls, key=lambda impl: impl != "maskc")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options of `argv` (default: the command line's), with the model's `size` and `dtype`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=parse_tokens, default=list(TOKENS),
                        help="comma-separated row lengths, one packed row of batch 1 each (default: 32768,65536,131072)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help=f"timed steps, after {WARMUP} warm-up steps (default: 10)")
    parser.add_argument("--impls", type=parse_impls, default=list(IMPLS),
                        help=f"comma-separated implementations among {', '.join(IMPLS)} (default: all)")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="run the steps through torch.compile(model)")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model (2 layers, hidden 64, head dim 16): checks the benchmark itself on the CPU")  # fmt: skip
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"),
                        help="where the model runs (default: cuda; cpu only with --tiny, float32, no peak memory)")  # fmt: skip
    parser.add_argument("--artifacts", type=Path, nargs="*", default=[],
                        help="maskc compile directories with kernels for the model's heads, head dim and dtype (default: "
                             "maskc compiles them on first use, where the CUTLASS DSL is installed)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args(argv)
    args.size = TINY if args.tiny else Size()
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    if args.device.type != "cuda" and not args.tiny:
        parser.error("the benchmark's model runs on a GPU: --device cpu needs --tiny")
    return args


def main() -> None:
    args = parse_args()
    device = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else cpu_device()
    run = Run.start("train_step", device, args.out)
    for directory in args.artifacts:
        maskc.runtime.register_artifact(directory)
    rows = measure_all(run, args)
    print("\n".join(["", f"run {run.run}", "", *train_table(rows)]))


if __name__ == "__main__":
    main()
