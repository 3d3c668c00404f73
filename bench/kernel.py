"""Kernel benchmark on MagiAttention's settings: b=1, heads 64:8, d=128, bf16, seqlen 1k..64k.

maskc beside FlashAttention-4 (where it supports the mask natively), torch SDPA (cuDNN and
flash backends, full/causal) and FlexAttention, in one run, forward TFLOP/s with the seeds'
formula (4 * area * Hq * D / time). Varlen documents come from the real length histogram
(`common.pack_documents`). Masks are the shipped examples, lowered by maskc.

With --backward, also the backward TFLOP/s (2.5 x the forward FLOPs, `out.backward` timed alone)
and the peak memory of one forward + backward of every implementation; --deterministic adds maskc
with deterministic=True, --portable maskc's portable kernels. The host time of one
maskc.attention call is measured first.

Run on the GPU machine: `python bench/kernel.py --artifacts DIR... [--seqlens 16384,65536]
[--backward] [--deterministic] [--portable]` (DIR: `maskc compile` directories holding the d=128
bf16 64:8 kernels). Appends kernel, memory and host rows to bench/results (or --out; see
bench/README.md) and prints the run's tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import maskc  # noqa: E402
from maskc.frontend import load  # noqa: E402
from maskc.ir import Mask  # noqa: E402

from common import pack_documents  # noqa: E402
from record import RESULTS, Run  # noqa: E402
from report import kernel_tables  # noqa: E402

HQ, HKV, D = 64, 8, 128
WINDOW = 1024
BLOCK = 1024
HOST_CALLS = 2000
HOST_STEP = f"one maskc.attention call (forward, 128 causal tokens, {HQ}:{HKV} heads, d={D}; mean of {HOST_CALLS})"
MASKS = ("full", "causal", "varlen_full", "varlen_causal", "sliding_window_causal", "varlen_block_causal")


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
    }
    return masks, lens


def timed_tflops(fn: Callable[[], object], area: int) -> float:
    from triton.testing import do_bench

    fn()
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return 4 * area * HQ * D / ms / 1e9


def timed_backward_tflops(fn: Callable[[], object], area: int, leaves: list[torch.Tensor]) -> float:
    """Backward TFLOP/s (the seeds' 2.5 x forward FLOPs) of `fn`'s output, timed alone."""
    from triton.testing import do_bench

    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)
    ms = do_bench(lambda: out.backward(grad, retain_graph=True), warmup=10, rep=60, return_mode="median", grad_to_none=leaves)
    return 2.5 * 4 * area * HQ * D / ms / 1e9


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


def flex_mask_mod(name: str, seqlen: int, lens: np.ndarray, device: torch.device, q_offset: int = 0) -> Callable | None:
    """FlexAttention's mask_mod of benchmark mask `name` (None: full), for query rows starting at
    global row `q_offset` (a rank's shard in bench/dist.py)."""
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.as_tensor(lens, device=device))
    start = torch.as_tensor(np.r_[0, np.cumsum(lens)[:-1]], device=device)[doc]
    block = (torch.arange(seqlen, device=device) - start) // BLOCK
    o = q_offset
    mods = {
        "full": None,
        "causal": lambda b, h, i, j: i + o >= j,
        "varlen_full": lambda b, h, i, j: doc[i + o] == doc[j],
        "varlen_causal": lambda b, h, i, j: (doc[i + o] == doc[j]) & (i + o >= j),
        "sliding_window_causal": lambda b, h, i, j: (i + o >= j) & (i + o - j < WINDOW),
        "varlen_block_causal": lambda b, h, i, j: (doc[i + o] == doc[j]) & (block[j] <= block[i + o]),
    }
    return mods[name]


def compiled_flex() -> Callable:
    """FlexAttention under torch.compile. It recompiles per shape, mask and grad mode; past
    dynamo's default limits it would fall back to eager, which materialises every score (and
    runs out of memory at long sequences), so the limits are raised."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 1000
    torch._dynamo.config.recompile_limit = 1000
    return torch.compile(flex_attention, dynamic=False)


def baselines(name: str, seqlen: int, lens: np.ndarray, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable]:
    """The baseline calls that express mask `name` natively (seqlen-first q/k/v)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    calls: dict[str, Callable] = {}
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if name in ("full", "causal"):
        for backend, tag in ((SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn"), (SDPBackend.FLASH_ATTENTION, "sdpa_flash")):

            def sdpa(backend=backend) -> torch.Tensor:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=name == "causal", enable_gqa=True)

            calls[tag] = sdpa
    mod = flex_mask_mod(name, seqlen, lens, q.device)
    flex = compiled_flex()
    block_mask = None if mod is None else create_block_mask(mod, 1, None, seqlen, seqlen, device=q.device)
    calls["flex"] = lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return calls
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
    return calls


def measure(run: Run, case: dict, impl: str, call: Callable[[], object], leaves: list[torch.Tensor] | None) -> list[dict]:
    """The rows of `impl` on `case`: forward TFLOP/s; with `leaves` (the inputs whose gradients
    the backward computes) also backward TFLOP/s and the peak memory of a forward + backward."""

    def forward() -> list[dict]:
        with torch.no_grad():
            return [{"tflops": timed_tflops(call, case["area"])}]

    rows = run.write_measured([("kernel", {**case, "impl": impl, "direction": "fwd"})], forward)
    if leaves is not None:
        rows += run.write_measured(
            [("kernel", {**case, "impl": impl, "direction": "bwd"}), ("memory", {**case, "impl": impl})],
            lambda: [{"tflops": timed_backward_tflops(call, case["area"], leaves)}, {"peak_mib": peak_memory_mib(call, leaves)}],
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--artifacts", required=True, type=Path, nargs="+", help="maskc compile directories with the 64:8 d=128 bf16 kernels"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    parser.add_argument("--seqlens", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--backward", action="store_true", help="also time the backward of every implementation")
    parser.add_argument(
        "--deterministic", action="store_true", help="also maskc with deterministic=True (needs those kernels)"
    )
    parser.add_argument(
        "--portable", action="store_true", help="also maskc's portable kernels (portable=True: warp MMA, every GPU since Ampere)"
    )
    args = parser.parse_args()
    run = Run.start("kernel", torch.cuda.get_device_name(), args.out)
    for directory in args.artifacts:
        maskc.runtime.register_artifact(directory)
    host = run.write("host", step=HOST_STEP, ms=host_overhead_us() / 1e3)
    print(f"{host['step']}: {host['ms'] * 1e3:.1f} us", flush=True)
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        torch.manual_seed(seqlen)
        q = torch.randn(seqlen, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
        k = torch.randn(seqlen, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
        v = torch.randn(seqlen, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
        masks, lens = build_masks(seqlen)
        for name in args.masks.split(","):
            mask = masks[name]
            case = {"mask": name, "seqlen": seqlen, "heads": f"{HQ}:{HKV}", "head_dim": D, "dtype": "bf16",
                    "docs": len(lens), "area": mask.area()}
            calls = {"maskc": lambda: maskc.attention(q, k, v, mask)[0]}
            if args.deterministic:
                calls["maskc_det"] = lambda: maskc.attention(q, k, v, mask, deterministic=True)[0]
            if args.portable:
                calls["maskc_portable"] = lambda: maskc.attention(q, k, v, mask, portable=True)[0]
            if not args.no_baselines:
                calls.update(baselines(name, seqlen, lens, q, k, v))
            for impl, call in calls.items():
                for row in measure(run, case, impl, call, [q, k, v] if args.backward else None):
                    rows.append(row)
                    value = row.get("tflops", row.get("peak_mib", row.get("error")))
                    print(f"{seqlen} {name} {impl} {row['kind']} {row.get('direction', '')} {value}", flush=True)
    all_impls = {impl: impl for impl in dict.fromkeys(row["impl"] for row in rows)}
    print("\n".join(["", f"run {run.run}", "", *kernel_tables(rows, all_impls)]))


def host_overhead_us(calls: int = HOST_CALLS) -> float:
    """CPU time of one maskc.attention call, on a problem so small the GPU never holds the host back."""
    mask = Mask.from_cu_seqlens([0, 128], causal=True)
    q = torch.randn(128, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(128, HKV, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        maskc.attention(q, k, k, mask)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        maskc.attention(q, k, k, mask)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


if __name__ == "__main__":
    main()
