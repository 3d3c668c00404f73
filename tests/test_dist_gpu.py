"""maskc.dist.attention over NCCL with maskc's kernels (bf16), 2 and 4 GPUs, against the reference.

Needs at least two GPUs; kernels come from $MASKC_GPU_ARTIFACTS (as in test_attention_gpu.py):
heads 8:2, head_dim 128, bf16, forward and backward.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_dist_execute import run_ranks

import maskc
from maskc.dist import make_plan
from maskc.ir import Mask

pytestmark = pytest.mark.gpu

SEQ, HQ, HKV, D = 8192, 8, 2, 128
MASKS = {
    "varlen_causal": lambda: Mask.from_cu_seqlens([0, 1000, 3700, 3701, 6000, 8192], causal=True),
    "sliding_window": lambda: Mask.sliding_window([0, SEQ], 511).with_global_tokens(64),
    "full": lambda: Mask.from_cu_seqlens([0, SEQ]),
}

# (stage count, local fusion) forced; None: the cost model's choice.
STAGES = {"varlen_causal": (3, False), "sliding_window": (2, True), "full": (None, None)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


def _worker(rank: int, world: int, port: int, name: str, errors: mp.Queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        for directory in filter(None, os.environ.get("MASKC_GPU_ARTIFACTS", "").split(":")):
            maskc.runtime.register_artifact(directory)
        g = torch.Generator(device="cuda").manual_seed(0)  # the same global inputs on every rank
        mask = MASKS[name]()
        q, k, v = (torch.randn(SEQ, h, D, device="cuda", generator=g) for h in (HQ, HKV, HKV))
        dout = torch.randn(SEQ, HQ, D, device="cuda", generator=g)

        def run(fn, dtype):
            leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
            out = fn(*leaves)
            (out.float() * dout).sum().backward()
            return [out.float()] + [x.grad.float() for x in leaves]

        exact = run(lambda *t: maskc.reference_attention(*t, mask)[0], torch.float64)
        low = run(lambda *t: maskc.reference_attention(*t, mask)[0], torch.bfloat16)
        num_stages, fuse_local = STAGES[name]
        plan = make_plan(mask, world, 512, num_stages=num_stages, fuse_local=fuse_local)

        def distributed(qq, kk, vv):
            local = [maskc.dist.dispatch(x, plan) for x in (qq, kk, vv)]
            return maskc.dist.undispatch(maskc.dist.attention(*local, plan)[0], plan)

        ours = run(distributed, torch.bfloat16)
        for label, o, lo, ex in zip(("out", "dq", "dk", "dv"), ours, low, exact):
            assert not torch.isnan(o).any(), f"{label} has NaN"
            assert _rel(o, ex) <= 2 * _rel(lo, ex) + 1e-3, f"{label}: {_rel(o, ex):.2e} vs bf16 reference {_rel(lo, ex):.2e}"
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(MASKS))
def test_nccl_forward_and_backward_with_maskc_kernels(world: int, name: str) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run_ranks(_worker, world, name, timeout=300)
