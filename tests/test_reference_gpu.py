"""The reference attention on a CUDA GPU: the same answers as the float64 CPU oracle.

The CPU path is checked element by element against a naive dense implementation in
test_reference.py; here the device path (bf16 and float64 on the GPU) is checked against
that CPU path on masks of every family, at sizes spanning several tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskc.ir import AttnSlice, Mask
from maskc.reference import reference_attention

pytestmark = pytest.mark.gpu


def _block_causal(cu: list[int], block: int) -> Mask:
    rows = []
    for start, end in zip(cu[:-1], cu[1:]):
        for b in range(start, end, block):
            rows.append(((b, min(b + block, end)), (start, min(b + block, end))))
    q, k = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    return Mask.from_arrays(q, k, np.zeros(len(rows), np.int64), cu[-1], cu[-1])


def _random(seed: int, sq: int, sk: int) -> Mask:
    rng = np.random.default_rng(seed)
    slices = []
    for _ in range(12):
        qs, qe = sorted(rng.integers(0, sq + 1, 2))
        ks, ke = sorted(rng.integers(0, sk + 1, 2))
        slices.append(AttnSlice((int(qs), int(qe)), (int(ks), int(ke)), ("full", "causal", "inv_causal", "bi_causal")[seed % 4]))
        seed += 1
    return Mask(slices, sq, sk)


CU = [0, 700, 1100, 2300, 2500]
MASKS = {
    "full": Mask.from_cu_seqlens([0, 2500]),
    "causal": Mask.from_cu_seqlens([0, 2500], causal=True),
    "varlen_full": Mask.from_cu_seqlens(CU),
    "varlen_causal": Mask.from_cu_seqlens(CU, causal=True),
    "sliding_window": Mask.sliding_window([0, 2500], left=300),
    "global_window": Mask.sliding_window(CU, left=200, right=100).with_global_tokens(16),
    "block_causal": _block_causal(CU, 256),
    "random_unequal": _random(3, 1900, 2600),
}


def _run(mask: Mask, dtype: torch.dtype, device: str, seed: int, softcap: float, with_sink: bool):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 8, 2, 128
    q = torch.randn(mask.seqlen_q, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(mask.seqlen_k, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(mask.seqlen_k, hkv, d, generator=gen, dtype=torch.float64)
    sink = torch.randn(2, hq, generator=gen, dtype=torch.float32) if with_sink else None
    dout = torch.randn(mask.seqlen_q, hq, d, generator=gen, dtype=torch.float64)
    leaves = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
    sink_leaf = sink.to(device).requires_grad_() if sink is not None else None
    out, meta = reference_attention(*leaves, mask, softcap=softcap, sink=sink_leaf, return_max_logits=True)
    (out.double() * dout.to(device)).sum().backward()
    grads = [x.grad for x in leaves] + ([sink_leaf.grad] if sink_leaf is not None else [])
    return [t.detach().double().cpu() for t in (out, meta.lse, meta.max_logits, *grads)]


def _rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    fin = torch.isfinite(e)
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)) and not torch.isnan(a).any()
    return float((a[fin] - e[fin]).norm() / e[fin].norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(MASKS))
def test_cuda_matches_cpu_oracle(name: str) -> None:
    mask = MASKS[name]
    softcap, with_sink = (30.0, True) if name in ("causal", "global_window", "random_unequal") else (0.0, False)
    expected = _run(mask, torch.float64, "cpu", 0, softcap, with_sink)
    exact = _run(mask, torch.float64, "cuda", 0, softcap, with_sink)
    for a, e in zip(exact, expected):
        assert _rel_err(a, e) < 1e-10
    bf16 = _run(mask, torch.bfloat16, "cuda", 0, softcap, with_sink)
    # out, lse, max_logits, dq, dk, dv[, dsink]: bf16 storage, float32 compute.
    limits = [1e-2, 1e-3, 1e-2, 2e-2, 2e-2, 2e-2, 2e-2]
    for a, e, limit in zip(bf16, expected, limits):
        assert _rel_err(a, e) < limit


def test_cuda_long_sequence_memory_stays_blockwise() -> None:
    n, hq, hkv, d = 32768, 8, 2, 128
    mask = Mask.from_cu_seqlens([0, n], causal=True)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, meta = reference_attention(q, k, v, mask)
    out.sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    # A materialised [Hq, Tq, Tk] float32 score matrix alone would be 32 GiB.
    assert peak < 2 * 2**30, peak
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(meta.lse).all()
