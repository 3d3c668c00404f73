"""Training steps on the GPU with a new mask every step: compiled without recompiling, in
batches, and with masks prepared ahead of time. Kernels as in test_attention_gpu.py (artifacts
from $MASKC_GPU_ARTIFACTS, or compiled on first use)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import maskc
from maskc.ir import Mask

pytestmark = pytest.mark.gpu
HQ, HKV, D = 8, 2, 128


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    for directory in filter(None, os.environ.get("MASKC_GPU_ARTIFACTS", "").split(":")):
        maskc.runtime.register_artifact(directory)


def _packed(rng: np.random.Generator, low: int = 1000, high: int = 6000) -> Mask:
    total, count = int(rng.integers(low, high)), int(rng.integers(1, 12))
    cuts = np.sort(rng.choice(np.arange(1, total), count - 1, replace=False))
    return Mask.from_cu_seqlens(np.r_[0, cuts, total], causal=True)


def _inputs(shape_q: tuple[int, ...], shape_k: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, device="cuda", generator=g).to(torch.bfloat16).requires_grad_() for s in (shape_q, shape_k, shape_k)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def _step(q, k, v, mask):
    out, meta = maskc.attention(q, k, v, mask)
    return out.float().square().mean() + meta.lse.mean()


def test_twenty_compiled_steps_with_new_masks_compile_twice_at_most() -> None:
    """torch.compile (inductor, fullgraph): 20 forward + backward steps, each with another packed
    document mask (other lengths and document counts): no compilation after the second step,
    gradients as in eager mode (the same kernels: within the atomics' reordering)."""
    rng = np.random.default_rng(0)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_step, fullgraph=True)
    graphs = []
    for i in range(20):
        mask = _packed(rng)
        leaves = _inputs((mask.seqlen_q, HQ, D), (mask.seqlen_k, HKV, D), seed=i)
        compiled(*leaves, mask).backward()
        graphs.append(counters["stats"]["unique_graphs"])
        eager = [x.detach().clone().requires_grad_() for x in leaves]
        _step(*eager, mask).backward()
        for ours, theirs in zip(leaves, eager):
            assert _rel(ours.grad, theirs.grad) < 1e-2
    assert graphs[1] <= 2 and graphs[-1] == graphs[1], graphs


def test_a_batch_runs_as_one_launch_equal_to_row_by_row() -> None:
    rng = np.random.default_rng(1)
    rows = [_packed(rng, 2048, 2049) for _ in range(3)]
    q, k, v = _inputs((3, 2048, HQ, D), (3, 2048, HKV, D), seed=5)
    for mask, row_masks in ((rows[0], [rows[0]] * 3), (Mask.stack(rows), rows)):
        out, meta = maskc.attention(q, k, v, mask)
        (out.float().square().sum() + meta.lse.sum()).backward()
        grads = [x.grad for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        for b, row in enumerate(row_masks):
            leaves = [x[b].detach().clone().requires_grad_() for x in (q, k, v)]
            ref, ref_meta = maskc.reference_attention(*(x.float() for x in leaves), row)
            (ref.square().sum() + ref_meta.lse.sum()).backward()
            assert _rel(out[b], ref) < 1e-2 and float((meta.lse[b] - ref_meta.lse).abs().max()) < 1e-3
            for grad, leaf in zip(grads, leaves):
                assert _rel(grad[b], leaf.grad) < 2e-2


def test_a_padded_batch_leaves_its_padding_out() -> None:
    """attention_mask [B, S] with right, left and no padding: each row's real tokens as if alone,
    the padding's rows 0 and without gradient."""
    rng = np.random.default_rng(4)
    row = _packed(rng, 3000, 3001)
    runs = [(0, 2500), (700, 3000), (0, 3000)]
    padding = torch.tensor([[a <= i < e for i in range(3000)] for a, e in runs], device="cuda")
    q, k, v = _inputs((3, 3000, HQ, D), (3, 3000, HKV, D), seed=6)
    out, meta = maskc.attention(q, k, v, row, attention_mask=padding)
    (out.float().square().sum() + torch.where(padding[..., None], meta.lse, 0).sum()).backward()
    for b, (a, e) in enumerate(runs):
        assert (out[b, :a] == 0).all() and (out[b, e:] == 0).all() and (k.grad[b, :a] == 0).all()
        leaves = [x[b].detach().float().requires_grad_() for x in (q, k, v)]
        ref, ref_meta = maskc.reference_attention(*leaves, row.crop((a, e), (a, e)))
        (ref.square().sum() + ref_meta.lse[a:e].sum()).backward()
        assert _rel(out[b, a:e], ref[a:e]) < 1e-2
        for x, leaf in zip((q, k, v), leaves):
            assert _rel(x.grad[b], leaf.grad) < 2e-2


def test_a_prepared_mask_gives_the_same_results_without_planning_in_the_step() -> None:
    mask = _packed(np.random.default_rng(2), 8000, 8001)
    target = maskc.target_for("cuda", num_heads_q=HQ, num_heads_kv=HKV, head_dim=D)
    shipped = pickle.loads(pickle.dumps(maskc.prepare(Mask.from_table(mask.table.clone()), target)))
    q, k, v = _inputs((mask.seqlen_q, HQ, D), (mask.seqlen_k, HKV, D), seed=3)
    results = []
    for m in (mask, shipped):
        out, meta = maskc.attention(q, k, v, m)
        (out.float().square().sum() + meta.lse.sum()).backward()
        results.append([out, *(x.grad for x in (q, k, v))])
        for x in (q, k, v):
            x.grad = None
    for ours, theirs in zip(*results):
        assert _rel(ours, theirs) < 1e-2


def test_masks_kept_on_gpu_tensors_are_read_once_and_again_after_a_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Position ids and padding on the GPU: the mask built from them is kept for the next call
    (reading them waits for the GPU), and built again after torch writes them in place; an
    inference tensor, which counts no writes, is read at every call."""
    reads = []
    from_position_ids = Mask.from_position_ids
    monkeypatch.setattr(Mask, "from_position_ids", lambda *a, **kw: reads.append(1) or from_position_ids(*a, **kw))
    rng = np.random.default_rng(7)
    s = 2000
    positions = torch.tensor(np.concatenate([np.arange(n) for n in (700, 1300)]), device="cuda").repeat(2, 1)
    positions[1, :900] = torch.arange(900, device="cuda")
    q, k, v = _inputs((2, s, HQ, D), (2, s, HKV, D), seed=8)
    padding = torch.ones(2, s, dtype=torch.long, device="cuda")

    def attend() -> torch.Tensor:
        with torch.no_grad():
            return maskc.attention(q, k, v, maskc.PositionMask(positions, True), attention_mask=padding)[0]

    def expected() -> torch.Tensor:
        rows = [Mask.from_position_ids(r, causal=True) for r in positions.cpu()]
        with torch.no_grad():
            return maskc.attention(q, k, v, Mask.stack(rows), attention_mask=padding.cpu().bool().cuda())[0]

    attend()
    attend()
    assert len(reads) == 2  # one per row, once
    positions[0, 1000:] = torch.arange(s - 1000, device="cuda")  # a third document in row 0
    padding[1, int(rng.integers(1500, s)) :] = 0
    out = attend()
    assert len(reads) == 4
    assert _rel(out, expected()) < 1e-3
    reads.clear()
    with torch.inference_mode():
        inference = positions.clone()
    for _ in range(2):
        with torch.no_grad():
            maskc.attention(q, k, v, maskc.PositionMask(inference, True))
    assert len(reads) == 4
