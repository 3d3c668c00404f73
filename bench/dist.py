"""Context-parallel benchmark: maskc.dist.attention beside PyTorch's ring context parallelism
and all-gathered keys/values + FlexAttention, per-GPU TFLOP/s, forward and backward.

Run one process per GPU: `torchrun --nproc-per-node N bench/dist.py --artifacts DIR [--run ID]`
(DIR: a `maskc compile` directory with the 64:8 d=128 bf16 kernels). The seeds' settings:
16k tokens per GPU (--per-gpu), heads 64:8, d=128, bf16; per-GPU TFLOP/s = 4 * area * Hq * D /
time / N with time the slowest rank's median (the backward counts 2.5x the FLOPs). Masks as in
bench/kernel.py over the N * 16k global tokens. Baselines in the same run: PyTorch's
`context_parallel` (ring over SDPA, load-balanced for causal) on full and causal; every rank
all-gathering K and V and running FlexAttention on its contiguous query shard (the backward
reduce-scatters dK, dV) on every mask. `--also` adds maskc with forced stage plans beside the
cost model's, `--sm-margins` a sweep of the SMs left to NCCL; with several GPUs the all-to-all
bandwidth (what CostModel.bandwidth stands for) is measured first. Rank 0 appends dist and
link rows to bench/results (or --out; see bench/README.md) and prints the run's table. To
measure scaling, give the invocations for each GPU count one run id (`--run ID`): bench/report.py
plots a run over its GPU counts. `--device cpu` runs the maskc path only, over gloo with the
reference attention in float32 (a smoke test of the harness, not a benchmark).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel import HKV, HQ, D, build_masks, compiled_flex, flex_mask_mod  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402
from report import dist_tables  # noqa: E402

import maskc  # noqa: E402
from maskc.dist import make_plan  # noqa: E402

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


def torch_ring(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
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


def measure(run: Run, case: dict, impl: str, plan: str | None, fwd_bwd: Callable[[], tuple[float, float]]) -> list[dict]:
    """The forward and backward rows of `impl` on `case`, per-GPU TFLOP/s from the (forward,
    backward) ms that `fwd_bwd` measures."""
    flops = 4 * case["area"] * int(case["heads"].split(":")[0]) * case["head_dim"]
    fields = {**case, "impl": impl, **({"plan": plan} if plan else {})}

    def tflops() -> list[dict]:
        fwd, bwd = fwd_bwd()
        return [{"tflops": flops / fwd / 1e9 / case["gpus"]}, {"tflops": 2.5 * flops / bwd / 1e9 / case["gpus"]}]

    return run.write_measured([("dist", {**fields, "direction": d}) for d in ("fwd", "bwd")], tflops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, help="maskc compile directory (CUDA)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    parser.add_argument("--run", help="the run these rows join (default: a new one): one id for the GPU counts of a sweep")
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
    run = Run.start(
        "dist", torch.cuda.get_device_name() if cuda else cpu_device(), args.out if rank == 0 else None, args.run,
        launcher=f"torchrun --nproc-per-node {world}",
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    heads = (HQ, HKV) if cuda else (4, 2)
    head_dim = D if cuda else 16
    seqlen = args.per_gpu * world
    masks, lens = build_masks(seqlen)
    torch.manual_seed(seqlen)  # the same global inputs on every rank
    q, k, v = (torch.randn(seqlen, h, head_dim, device=device, dtype=dtype) for h in (heads[0], heads[1], heads[1]))
    rows = []
    if world > 1:
        kv_bytes = q.shape[0] // world * 2 * heads[1] * q.shape[2] * q.element_size()  # a rank's K and V
        rows.append(run.write("link", collective="all-to-all", gpus=world, gbps=alltoall_bandwidth(kv_bytes, device), mbytes=kv_bytes / 1e6))
    forced = [(int(spec.rstrip("f")), spec.endswith("f")) for spec in args.also.split(",") if spec]
    margins = [int(m) for m in args.sm_margins.split(",") if m]
    for name in args.masks.split(","):
        mask = masks[name]
        case = {"mask": name, "gpus": world, "tokens_per_gpu": args.per_gpu, "heads": f"{heads[0]}:{heads[1]}",
                "head_dim": head_dim, "dtype": "bf16" if cuda else "fp32", "area": mask.area()}
        plan = make_plan(mask, world)

        def ours(plan: Any, sm_margin: int = 0) -> tuple[float, float]:
            local = [maskc.dist.dispatch(x, plan).detach().requires_grad_() for x in (q, k, v)]
            return forward_backward_ms(lambda: maskc.dist.attention(*local, plan, sm_margin=sm_margin)[0], local, device)

        runs: dict[str, tuple[str | None, Callable[[], tuple[float, float]]]] = {"maskc": (plan_name(plan), lambda: ours(plan))}
        runs.update({f"maskc_sm{m}": (plan_name(plan), lambda m=m: ours(plan, m)) for m in margins})
        for n, fuse in forced:
            if (n, fuse) != (plan.stages.num_stages, plan.stages.fuse_local):
                other = make_plan(mask, world, num_stages=n, fuse_local=fuse)
                runs[f"maskc_{plan_name(other)}"] = (plan_name(other), lambda other=other: ours(other))
        if cuda and not args.no_baselines:
            runs["flex_allgather"] = (None, lambda: forward_backward_ms(*allgather_flex(name, seqlen, lens, q, k, v), device))
            if name in ("full", "causal") and world > 1:
                runs["torch_ring"] = (None, lambda: torch_ring(name, q, k, v))
        for impl, (stages, fwd_bwd) in runs.items():
            rows += measure(run, case, impl, stages, fwd_bwd)
            if cuda:
                torch.cuda.empty_cache()
    if rank == 0:
        all_impls = {impl: impl for impl in dict.fromkeys(row["impl"] for row in rows if row["kind"] == "dist")}
        print("\n".join([f"run {run.run}", "", *dist_tables(rows, all_impls)]))
    dist.destroy_process_group()


def plan_name(plan: Any) -> str:
    """A plan's stages as the tables write them: the count, 'f' when the first joins the local call."""
    return f"{plan.stages.num_stages}{'f' if plan.stages.fuse_local else ''}"


if __name__ == "__main__":
    main()
