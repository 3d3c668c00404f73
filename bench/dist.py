"""Context-parallel benchmark: maskc.dist.attention beside PyTorch's ring context parallelism
and all-gathered keys/values + FlexAttention, per-GPU TFLOP/s, forward and backward.

Run one process per GPU: `torchrun --nproc-per-node N bench/dist.py --artifacts DIR --out OUT`
(DIR: a `maskc compile` directory with the 64:8 d=128 bf16 kernels). The seeds' settings:
16k tokens per GPU (--per-gpu), heads 64:8, d=128, bf16; per-GPU TFLOP/s = 4 * area * Hq * D /
time / N with time the slowest rank's median (the backward counts 2.5x the FLOPs). Masks as in
bench/kernel.py over the N * 16k global tokens. Baselines in the same run: PyTorch's
`context_parallel` (ring over SDPA, load-balanced for causal) on full and causal; every rank
all-gathering K and V and running FlexAttention on its contiguous query shard (the backward
reduce-scatters dK, dV) on every mask. `--also` adds maskc with forced stage plans beside the
cost model's, `--sm-margins` a sweep of the SMs left to NCCL; with several GPUs the all-to-all
bandwidth (what CostModel.bandwidth stands for) is measured first. Rank 0 appends one JSON row
per mask to OUT/dist.jsonl and prints a table (plot the rows with bench/dist_plot.py).
`--device cpu` runs the maskc path only, over gloo with the reference attention in float32 (a
smoke test of the harness, not a benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import maskc  # noqa: E402
from maskc.dist import make_plan  # noqa: E402

from kernel import D, HKV, HQ, build_masks, compiled_flex, flex_mask_mod  # noqa: E402

MASKS = ("full", "causal", "varlen_full", "varlen_causal", "varlen_block_causal")


def slowest_median_ms(fn: Callable[[], object], device: torch.device, runs: int = 10, warmup: int = 3) -> float:
    """Median of `runs` timed calls on this rank, the largest over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    median = torch.tensor(sorted(times)[len(times) // 2], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def forward_backward_ms(call: Callable[[], torch.Tensor], leaves: list[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """(forward ms, backward ms) of `call`, whose output's backward is timed alone."""
    with torch.no_grad():
        fwd = slowest_median_ms(call, device)
    out = call()
    grad = torch.randn_like(out)

    def backward() -> None:
        for x in leaves:
            x.grad = None
        out.backward(grad, retain_graph=True)

    return fwd, slowest_median_ms(backward, device)


def alltoall_bandwidth(nbytes: int, device: torch.device) -> float:
    """GB/s per rank and direction of an even all-to-all moving `nbytes` out of every rank
    (the slowest rank's median): the number CostModel.bandwidth stands for."""
    world = dist.get_world_size()
    send = torch.empty(nbytes // world * world, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    ms = slowest_median_ms(lambda: dist.all_to_all_single(recv, send), device)
    return send.numel() * (world - 1) / world / (ms * 1e-3) / 1e9


class _GatherSequence(torch.autograd.Function):
    """All ranks' contiguous shards of a sequence-first tensor, in rank order; the backward
    reduce-scatters the gradient back to the shards."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = x.new_empty(x.shape[0] * dist.get_world_size(), *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = grad.new_empty(grad.shape[0] // dist.get_world_size(), *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous())
        return out


def allgather_flex(name: str, seqlen: int, lens: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """The all-gather + FlexAttention baseline: (call, leaves) for this rank's contiguous shard."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = seqlen // dist.get_world_size()
    off = dist.get_rank() * rows
    mod = flex_mask_mod(name, seqlen, lens, q.device, q_offset=off)
    block_mask = None if mod is None else create_block_mask(mod, 1, None, rows, seqlen, device=q.device)
    flex = compiled_flex()
    shard = [x[off : off + rows].detach().clone().requires_grad_() for x in (q, k, v)]

    def call() -> torch.Tensor:
        kk, vv = (_GatherSequence.apply(x) for x in shard[1:])
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (shard[0], kk, vv))
        return flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)

    return call, shard


def torch_ring(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float] | str:
    """PyTorch's context parallelism (ring attention over SDPA) on full / causal: (fwd, bwd) ms."""
    import torch.distributed.tensor.experimental._attention as cp_impl
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    causal = name == "causal"
    qt, kt, vt = (x.detach().transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    do = torch.randn_like(qt)
    cp_impl._cp_options.enable_load_balance = causal
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        with context_parallel(mesh, buffers=(qt, kt, vt, do), buffer_seq_dims=(2, 2, 2, 2)):
            # The buffers are sharded in place and restored (resized) on exit: the leaves are copies.
            leaves = [x.detach().clone().requires_grad_() for x in (qt, kt, vt)]

            def call() -> torch.Tensor:
                return F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)

            return forward_backward_ms(call, leaves, qt.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, help="maskc compile directory (CUDA)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--per-gpu", type=int, default=16384, help="tokens per GPU")
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--sm-margins", default="", help="also run maskc with each of these sm_margin values (a sweep)")
    parser.add_argument(
        "--also", default="", help="also run maskc with these forced plans: stage counts, 'f' for local fusion (e.g. 1,1f,2)"
    )
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        maskc.runtime.register_artifact(args.artifacts)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    heads = (HQ, HKV) if cuda else (4, 2)
    seqlen = args.per_gpu * world
    masks, lens = build_masks(seqlen)
    torch.manual_seed(seqlen)  # the same global inputs on every rank
    q, k, v = (torch.randn(seqlen, h, D if cuda else 16, device=device, dtype=dtype) for h in (heads[0], heads[1], heads[1]))
    args.out.mkdir(parents=True, exist_ok=True)
    if world > 1:
        kv_bytes = q.shape[0] // world * 2 * heads[1] * q.shape[2] * q.element_size()  # a rank's K and V
        link = {"cp": world, "alltoall_GBps": alltoall_bandwidth(kv_bytes, device)}
        if rank == 0:
            print(json.dumps(link), flush=True)
            with (args.out / "dist.jsonl").open("a") as log:
                print(json.dumps(link), file=log)
    forced = [(int(spec.rstrip("f")), spec.endswith("f")) for spec in args.also.split(",") if spec]
    margins = [int(m) for m in args.sm_margins.split(",") if m]
    rows = []
    for name in args.masks.split(","):
        mask = masks[name]
        flops = 4 * mask.area() * heads[0] * q.shape[2]
        row: dict[str, Any] = {"cp": world, "per_gpu": args.per_gpu, "mask": name, "area": mask.area()}
        plan = make_plan(mask, world)
        row["num_stages"], row["fuse_local"] = plan.stages.num_stages, plan.stages.fuse_local

        def ours(plan: Any, sm_margin: int = 0) -> tuple[float, float]:
            local = [maskc.dist.dispatch(x, plan).detach().requires_grad_() for x in (q, k, v)]
            return forward_backward_ms(lambda: maskc.dist.attention(*local, plan, sm_margin=sm_margin)[0], local, device)

        runs: dict[str, Callable[[], tuple[float, float] | str]] = {"maskc": lambda: ours(plan)}
        runs.update({f"maskc_sm{m}": lambda m=m: ours(plan, m) for m in margins})
        for n, fuse in forced:
            if (n, fuse) != (plan.stages.num_stages, plan.stages.fuse_local):
                other = make_plan(mask, world, num_stages=n, fuse_local=fuse)
                runs[f"maskc_{n}{'f' if fuse else ''}"] = lambda other=other: ours(other)
        if cuda and not args.no_baselines:
            runs["flex_allgather"] = lambda: forward_backward_ms(*allgather_flex(name, seqlen, lens, q, k, v), device)
            if name in ("full", "causal") and world > 1:
                runs["torch_ring"] = lambda: torch_ring(name, q, k, v)
        for tag, run in runs.items():
            try:
                fwd, bwd = run()
                row[tag] = [flops / fwd / 1e9 / world, 2.5 * flops / bwd / 1e9 / world]
            except Exception as exc:  # a baseline that cannot run this case is reported, not fatal
                row[tag] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            with (args.out / "dist.jsonl").open("a") as log:
                print(json.dumps(row), file=log)
    if rank == 0:
        tags = [t for t in dict.fromkeys(key for row in rows for key in row) if t.startswith("maskc")]
        tags += ["torch_ring", "flex_allgather"]
        print("\n cp mask                 stages " + " ".join(f"{t:>15}" for t in tags) + "  (per-GPU TFLOP/s fwd / bwd)")
        for row in rows:
            cells = [row.get(t) for t in tags]
            text = [f"{c[0]:6.0f} / {c[1]:4.0f}" if isinstance(c, list) else ("-" if c is None else "error") for c in cells]
            stages = f"{row['num_stages']}{'f' if row['fuse_local'] else ''}"
            print(f" {row['cp']:2d} {row['mask']:20s} {stages:>6} " + " ".join(f"{t:>15}" for t in text))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
