"""maskc.attention inside torch.compile(fullgraph=True) on the GPU: a small attention block,
compiled with inductor, against its eager run, forward and backward, with no graph break.

Kernels come from $MASKC_GPU_ARTIFACTS (as in test_attention_gpu.py) or are compiled on first
use; the block needs bf16, 8:2 heads, d=128, forward and backward.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import maskc
from maskc.ir import Mask

pytestmark = pytest.mark.gpu

HQ, HKV, D, DIM = 8, 2, 128, 256


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    for directory in filter(None, os.environ.get("MASKC_GPU_ARTIFACTS", "").split(":")):
        maskc.runtime.register_artifact(directory)


class Block(torch.nn.Module):
    """Project to q/k/v, attend under a fixed mask, project back; returns the output and lse."""

    def __init__(self, mask: Mask):
        super().__init__()
        self.mask = mask
        self.qkv = torch.nn.Linear(DIM, (HQ + 2 * HKV) * D, bias=False)
        self.proj = torch.nn.Linear(HQ * D, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = (y.reshape(t, -1, D).contiguous() for y in (q, k, v))
        out, meta = maskc.attention(q, k, v, self.mask)
        return self.proj(out.reshape(t, HQ * D)), meta.lse


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    finite = torch.isfinite(b)
    return float(torch.linalg.vector_norm(a[finite] - b[finite]) / torch.linalg.vector_norm(b[finite]).clamp_min(1e-30))


def test_compiled_block_matches_eager_forward_and_backward() -> None:
    torch.manual_seed(0)
    mask = Mask.from_cu_seqlens([0, 300, 817, 1201, 2018], causal=True)
    block = Block(mask).to("cuda", torch.bfloat16)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    weights = torch.linspace(-1, 1, HQ, device="cuda")

    def run(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        for p in block.parameters():
            p.grad = None
        x = x.detach().clone().requires_grad_()
        y, lse = model(x)
        (y.float().square().mean() + (lse * weights).mean()).backward()
        return [y, lse, x.grad, *(p.grad for p in block.parameters())]

    for step in range(2):
        x = torch.randn(mask.seqlen_q, DIM, device="cuda", dtype=torch.bfloat16)
        eager = run(block, x)
        ours = run(compiled, x)
        for name, a, b in zip(("out", "lse", "dx", "dW_qkv", "dW_proj"), ours, eager):
            assert not torch.isnan(a).any(), f"step {step}: {name} has NaN"
            assert _rel(a, b) < 2e-2, f"step {step}: {name} differs from eager by {_rel(a, b):.2e}"
    assert counter.frame_count == 1, "graph break or recompilation"
