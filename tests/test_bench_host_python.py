"""bench/host_python.py: maskc's CUDA path runs on the CPU with the GPU stubbed, its table comes
out for maskc and the trivial Function, and nothing of the stub outlives the measurement."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import maskc
from maskc.runtime import ops, registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import host_python  # noqa: E402


def test_the_cuda_path_runs_stubbed_and_the_stub_is_undone() -> None:
    kernels, fwd_cpu = dict(registry.KERNELS), ops.attn_fwd_cpu
    lines = host_python.host_python(calls=3, rounds=1, profile="fwd+bwd")
    assert lines[0].startswith("| library | forward, no_grad (us)")
    rows = {line.split(" | ")[0][2:]: [float(x) for x in line.rstrip(" |").split(" | ")[1:]] for line in lines[2:5]}
    assert set(rows) == {"maskc", "maskc, torch.compile", "trivial Function"}
    assert all(t > 0 for r in rows.values() for t in r)
    assert "cProfile of 3 maskc calls (fwd+bwd)" in "\n".join(lines[5:])
    assert registry.KERNELS == kernels and ops.attn_fwd_cpu is fwd_cpu
    with host_python.stubbed_gpu():  # the CUDA path plans SM90 kernels (the reference plans none)
        host_python.passes()["maskc"]["fwd+bwd"]()
        planned = {(key[0], key[1]) for key in registry.KERNELS}
    assert planned == {("sm_90a", "fwd"), ("sm_90a", "bwd")}
    q = torch.randn(4, 2, 64)
    out, _ = maskc.attention(q, q, q, maskc.Mask.from_cu_seqlens([0, 4]))  # the reference again
    assert torch.isfinite(out).all()
