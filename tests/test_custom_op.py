"""maskc.attention as torch.library custom ops, checked without a GPU.

On the CPU the ops compute the reference attention, so eager and compiled calls are checked
for real: values, gradients, graphs without breaks, and a new mask every step compiling
nothing. The GPU side of the ops (planning a mask inside the op, choosing kernels and
schedules) runs here too with CPU tensors standing in for CUDA ones: the CPU implementations
are swapped for the CUDA ones, whose kernel launches are replaced by the reference math
(`cuda_on_cpu`), so what is checked is the planning and its wiring, not the kernels.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import maskc
from maskc import reference
from maskc.artifact.abi import PACE_COUNTERS
from maskc.artifact.kernel_families import HeadDim, select_tiles
from maskc.artifact.variant import variant_for
from maskc.ir import AttnSlice, Mask
from maskc.ir import schedule as schedules
from maskc.runtime import call_plan, masks, ops, plan_records, prepared, registry

HQ, HKV, D = 8, 2, 128
MASK = Mask.from_cu_seqlens([0, 37, 100, 129], causal=True)
ENTRY_KEYS = (("fwd", False), ("fwd", True), ("bwd", False))
"""(direction, pack_gqa) of the kernels the CPU 'GPU' has."""


def test_ops_take_the_mask_as_tensors_and_options_as_constants() -> None:
    fwd = torch.ops.maskc.attn_fwd.default._schema
    bwd = torch.ops.maskc.attn_bwd.default._schema
    allowed = {"Tensor", "Optional[Tensor]", "List[int]", "float", "bool"}
    for schema in (fwd, bwd):
        assert {str(a.type) for a in schema.arguments} <= allowed, schema
        assert str(next(a for a in schema.arguments if a.name == "mask").type) == "Tensor"
    assert [r.type.kind() for r in fwd.returns] == ["TensorType"] * 4
    assert [r.type.kind() for r in bwd.returns] == ["TensorType"] * 4


def test_a_forward_for_the_backward_gives_lse_log2_in_its_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """With for_backward the forward's fourth output holds the backward's lse_log2: every query
    head's rows, padded to whole q blocks of the backward's tile (3 x 300 rows here)."""
    monkeypatch.setattr(call_plan, "device_info", lambda device: ((9, 0), 132))
    options = ops.Options(None, False, None).encode()
    with FakeTensorMode():
        q = torch.empty(3, 300, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(3, 200, HKV, D, dtype=torch.bfloat16, device="cuda")
        table = torch.empty(4, 5, dtype=torch.int32)
        *_, lse_log2 = torch.ops.maskc.attn_fwd(q, k, k, None, table, None, None, 0.1, 0.0, False, True, options)
    tile = select_tiles("sm_90a", HeadDim(D, D), "bwd").tile_m
    assert (lse_log2.shape, lse_log2.dtype) == ((HQ * -(-900 // tile) * tile,), torch.float32)


@pytest.mark.parametrize("batch", [(), (3,)], ids=["packed", "batched"])
@pytest.mark.parametrize("return_max_logits", [False, True])
@pytest.mark.parametrize("with_sink", [False, True])
def test_fake_implementations_give_exact_shapes(return_max_logits: bool, with_sink: bool, batch: tuple[int, ...]) -> None:
    tq, tk = 300, 200
    options = ops.Options(None, False, None).encode()
    with FakeTensorMode():
        q = torch.empty(*batch, tq, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(*batch, tk, HKV, D, dtype=torch.bfloat16, device="cuda")
        sink = torch.empty(3, HQ, dtype=torch.float32, device="cuda") if with_sink else None
        table = torch.empty(4, 5, dtype=torch.int32)
        out, lse, row_max, lse_log2 = torch.ops.maskc.attn_fwd(q, k, k, sink, table, None, None, 0.1, 0.0, return_max_logits,
                                                               False, options)  # fmt: skip
        dq, dk, dv, dsink = torch.ops.maskc.attn_bwd(q, k, k, out, lse, None, sink, out, lse, table, None, None, 0.1, 0.0,
                                                     options)  # fmt: skip
    rows = (*batch, tq, HQ)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, torch.bfloat16, "cuda")
    assert (lse.shape, lse.dtype) == (rows, torch.float32)
    assert (row_max.shape, row_max.dtype) == (rows if return_max_logits else (0,), torch.float32)
    assert (lse_log2.shape, lse_log2.dtype) == ((0,), torch.float32)
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
    assert (dk.shape, dk.dtype) == (dv.shape, dv.dtype) == (k.shape, k.dtype)
    assert (dsink.shape, dsink.dtype) == ((3, HQ) if with_sink else (0,), torch.float32)


def _inputs(mask: Mask, seed: int = 0, dtype: torch.dtype = torch.bfloat16, batch: tuple[int, ...] = ()) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tq, tk = mask.shape
    shapes = [(*batch, tq, HQ, D), (*batch, tk, HKV, D), (*batch, tk, HKV, D)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Uses lse too, so its gradient is part of what is checked."""
    return out.float().square().sum() + (lse * torch.linspace(-1, 1, lse.shape[-1])).sum()


def _leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.detach().clone().requires_grad_(x.requires_grad) for x in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_attention_is_the_reference_with_its_gradients(dtype: torch.dtype) -> None:
    q, k, v = _inputs(MASK, dtype=dtype)
    sink = torch.randn(2, HQ, requires_grad=True)
    out, meta = maskc.attention(q, k, v, MASK, softcap=5.0, sink=sink, return_max_logits=True)
    _loss(out, meta.lse).backward()
    leaves = _leaves([q, k, v, sink])
    ref, ref_meta = maskc.reference_attention(*leaves[:3], MASK, softcap=5.0, sink=leaves[3], return_max_logits=True)
    _loss(ref, ref_meta.lse).backward()
    assert out.dtype == dtype and torch.equal(out, ref) and torch.equal(meta.lse, ref_meta.lse)
    assert torch.equal(meta.max_logits, ref_meta.max_logits) and not meta.max_logits.requires_grad
    for ours, theirs in zip((q, k, v, sink), leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)


@pytest.mark.parametrize("use", ["out", "lse"])
def test_gradients_when_only_out_or_only_lse_reaches_the_loss(use: str) -> None:
    """The op's backward gets None for the output gradient that does not exist (no zeros are
    made for it) and gives the reference's gradients either way."""
    q, k, v = _inputs(MASK, dtype=torch.float32)
    leaves = _leaves([q, k, v])
    for fn, inputs in ((maskc.attention, (q, k, v)), (maskc.reference_attention, leaves)):
        out, meta = fn(*inputs, MASK)
        (out.sum() if use == "out" else torch.where(torch.isfinite(meta.lse), meta.lse, 0.0).sum()).backward()
    for ours, theirs in zip((q, k, v), leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_cpu_attention_without_grad_builds_no_graph() -> None:
    q, k, v = _inputs(MASK, dtype=torch.float32)
    with torch.no_grad():
        out, meta = maskc.attention(q, k, v, MASK)
    assert out.grad_fn is None and meta.lse.grad_fn is None


def _per_row_reference(q, k, v, row_masks: list[Mask]) -> tuple[torch.Tensor, torch.Tensor]:
    outs = [maskc.reference_attention(q[b], k[b], v[b], m) for b, m in enumerate(row_masks)]
    return torch.stack([o for o, _ in outs]), torch.stack([meta.lse for _, meta in outs])


def test_a_batch_shares_one_row_mask_or_packs_one_mask_per_row() -> None:
    """q [B, S, H, D]: a mask over one row serves every row, a stacked mask gives each row its
    own; out and lse come back in q's layout, equal to attending row by row."""
    rows = [Mask.from_cu_seqlens([0, 40, 96], causal=True), Mask.from_cu_seqlens([0, 96], causal=True),
            Mask.from_cu_seqlens([0, 10, 50, 96])]  # fmt: skip
    q, k, v = _inputs(rows[0], dtype=torch.float32, batch=(3,))
    for mask, row_masks in ((rows[0], [rows[0]] * 3), (Mask.stack(rows), rows)):
        out, meta = maskc.attention(q, k, v, mask)
        ref_out, ref_lse = _per_row_reference(q, k, v, row_masks)
        assert out.shape == q.shape and meta.lse.shape == q.shape[:-1]
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(meta.lse, ref_lse)
    with pytest.raises(maskc.MaskcError, match=r"covers one row \(96, 96\) or the whole batch \(288, 288\)"):
        maskc.attention(q, k, v, Mask.from_cu_seqlens([0, 95]))
    with pytest.raises(ValueError, match="batched q, k, v are"):
        maskc.attention(q, k[0], v[0], rows[0])


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "per_row"])
def test_padding_is_left_out_of_a_batch(stacked: bool) -> None:
    """attention_mask [B, S]: right, left, no and full padding; each row equals attending its
    real tokens alone, the padding's rows are 0 (lse -inf) and get no gradient."""
    s = 80
    runs = [(0, 60), (25, 80), (0, 80), (0, 0)]
    padding = torch.tensor([[a <= i < e for i in range(s)] for a, e in runs])
    row = Mask.from_cu_seqlens([0, 30, s], causal=True)
    mask = Mask.stack([row] * len(runs)) if stacked else row
    q, k, v = _inputs(row, dtype=torch.float32, batch=(len(runs),))
    out, meta = maskc.attention(q, k, v, mask, attention_mask=padding)
    (out.square().sum() + torch.where(padding[..., None], meta.lse, 0).sum()).backward()
    for b, (a, e) in enumerate(runs):
        assert (out[b, :a] == 0).all() and (out[b, e:] == 0).all() and torch.isneginf(meta.lse[b, e:]).all()
        assert (k.grad[b, :a] == 0).all() and (v.grad[b, e:] == 0).all()
        if e > a:
            kept = row.crop((a, e), (a, e))
            leaves = [x[b].detach().clone().requires_grad_() for x in (q, k, v)]
            ref, ref_meta = maskc.reference_attention(*leaves, kept)
            (ref.square().sum() + ref_meta.lse[a:e].sum()).backward()
            torch.testing.assert_close(out[b, a:e], ref[a:e])
            torch.testing.assert_close(q.grad[b], leaves[0].grad)
            torch.testing.assert_close(k.grad[b], leaves[1].grad)
    size = len(mask.memo)
    with torch.no_grad():
        maskc.attention(q, k, v, mask, attention_mask=padding.roll(1, 0))  # another step's padding
    assert len(mask.memo) == size  # kept with its padding tensor: the mask's memo does not grow step by step
    with pytest.raises(maskc.MaskError, match="row 1 has padding between its tokens"):
        maskc.attention(q, k, v, mask, attention_mask=torch.tensor([[True] * s, [True, False] * (s // 2)] * 2))
    with pytest.raises(maskc.MaskError, match="goes with batched q"):
        maskc.attention(q[0], k[0], v[0], row, attention_mask=padding[0])


def test_a_padding_mask_is_ones_on_real_tokens_and_nothing_else() -> None:
    """bool, integer or float 0 / 1 give one answer; an additive mask (0 keep, -inf drop) and any
    other value are refused, since taking them as 'non-zero is real' inverts or blurs them."""
    row = Mask.from_cu_seqlens([0, 30, 48], causal=True)
    q, k, v = _inputs(row, dtype=torch.float32, batch=(2,))
    padding = torch.ones(2, 48, dtype=torch.bool)
    padding[1, 40:] = False
    with torch.no_grad():
        outs = [maskc.attention(q, k, v, row, attention_mask=padding.to(dtype))[0]
                for dtype in (torch.bool, torch.long, torch.int8, torch.float32, torch.bfloat16)]  # fmt: skip
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
        additive = torch.zeros(2, 48).masked_fill(~padding, -math.inf)
        with pytest.raises(maskc.MaskError, match=r"got -inf at \[1, 40\]\. An additive mask .* is not one"):
            maskc.attention(q, k, v, row, attention_mask=additive)
        for value in (2, -1, 0.5):
            with pytest.raises(maskc.MaskError, match=f"1 \\(or True\\) on real tokens .*got {value}"):
                maskc.attention(q, k, v, row, attention_mask=padding.float().index_fill(1, torch.tensor([3]), value))
        with pytest.raises(maskc.MaskError, match="attention_mask must be a CPU or CUDA tensor, got one on meta"):
            maskc.attention(q, k, v, row, attention_mask=padding.to("meta"))
        with pytest.raises(maskc.MaskError, match="position_ids must be a CPU or CUDA tensor"):
            maskc.PositionMask(torch.zeros(48, dtype=torch.long, device="meta"), True)


def test_a_batch_mask_keeps_each_row_to_its_own_keys() -> None:
    """A mask over a whole batch whose rows are not each [S, S] (12 + 20 tokens for B=2, S=16)
    would let row 1 attend row 0's keys: refused, with or without padding."""
    q, k, v = _inputs(Mask.from_cu_seqlens([0, 16]), dtype=torch.float32, batch=(2,))
    leaky = Mask.stack([Mask.from_cu_seqlens([0, 12], causal=True), Mask.from_cu_seqlens([0, 20], causal=True)])
    with torch.no_grad():
        with pytest.raises(maskc.MaskError, match="lets a batch row attend another row's tokens: slice 1"):
            maskc.attention(q, k, v, leaky)
        with pytest.raises(maskc.MaskError, match="lets a batch row attend another row's tokens"):
            maskc.attention(q, k, v, leaky, attention_mask=torch.ones(2, 16))
        # A slice whose ranges cross rows but whose keys stay in its own row is fine.
        inv = Mask([AttnSlice((0, 16), (0, 16), "causal"), AttnSlice((16, 32), (0, 32), "causal")], 32, 32)
        crossing = Mask.stack([Mask.from_cu_seqlens([0, 16], causal=True)] * 2)
        assert not inv.equivalent(crossing)
        with pytest.raises(maskc.MaskError, match="another row's tokens"):
            maskc.attention(q, k, v, inv)
        bottom_right = Mask([AttnSlice((0, 16), (0, 16), "causal"), AttnSlice((0, 32), (16, 32), "causal")], 32, 32)
        out, _ = maskc.attention(q, k, v, bottom_right)  # its rows 0..15 see nothing of the second slice
        torch.testing.assert_close(out, maskc.attention(q, k, v, crossing)[0])


def _written_without_a_version_bump(tensor: torch.Tensor, how: str, index: tuple, value: int) -> None:
    version = tensor._version
    if how == "numpy":
        tensor.numpy()[index] = value
    else:
        tensor.data[index] = value
    assert tensor._version == version


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_cached_masks_follow_writes_torch_does_not_count(how: str) -> None:
    """Position ids and padding written through a numpy view or `.data` (no version bump): the
    next call sees the new content, not the mask kept from the old."""
    rng = np.random.default_rng(3)
    positions = torch.stack([_positions(rng, 64) for _ in range(2)])
    q, k, v = _inputs(Mask.from_cu_seqlens([0, 64]), dtype=torch.float32, batch=(2,))

    def expected(rows: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        mask = Mask.stack([Mask.from_position_ids(r, causal=True) for r in rows])
        return maskc.attention(q, k, v, mask, attention_mask=padding)[0]

    with torch.no_grad():
        maskc.attention(q, k, v, maskc.PositionMask(positions, True))
        _written_without_a_version_bump(positions, how, (1, slice(10, 40)), 0)
        torch.testing.assert_close(maskc.attention(q, k, v, maskc.PositionMask(positions, True))[0], expected(positions))
        padding = torch.ones(2, 64, dtype=torch.long)
        row = Mask.from_cu_seqlens([0, 64], causal=True)
        maskc.attention(q, k, v, row, attention_mask=padding)
        _written_without_a_version_bump(padding, how, (0, slice(50, None)), 0)
        out = maskc.attention(q, k, v, row, attention_mask=padding)[0]
        assert (out[0, 50:] == 0).all()
        torch.testing.assert_close(out[0], maskc.reference_attention(q[0], k[0], v[0], row.crop((0, 50), (0, 50)))[0])


def test_a_write_to_a_masks_table_is_refused_not_ignored() -> None:
    mask = Mask.from_cu_seqlens([0, 20, 48], causal=True)
    q, k, v = _inputs(mask, dtype=torch.float32)
    with torch.no_grad():
        maskc.attention(q, k, v, mask)
        mask.table[1, 1] = 10
        with pytest.raises(maskc.MaskError, match=r"table \(Mask.table\) was written to"):
            maskc.attention(q, k, v, mask)
        edited = Mask.from_table(mask.table)
        assert edited.q_ranges[0].tolist() == [0, 10]
        out, _ = maskc.attention(q, k, v, edited)
        torch.testing.assert_close(out, maskc.reference_attention(q, k, v, edited)[0])


def _recording_backend() -> tuple[Any, dict[str, list[torch.fx.GraphModule]]]:
    """aot_eager that keeps every forward and backward graph it compiles."""
    graphs: dict[str, list[torch.fx.GraphModule]] = {"dynamo": [], "fw": [], "bw": []}

    def keep(kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    aot = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))

    def backend(gm: torch.fx.GraphModule, example_inputs: Any):
        graphs["dynamo"].append(gm)
        return aot(gm, example_inputs)

    return backend, graphs


def _targets(gm: torch.fx.GraphModule) -> set[Any]:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("features", [False, True], ids=["plain", "softcap_sink_max_logits"])
def test_compiled_fullgraph_forward_and_backward_without_graph_breaks(features: bool) -> None:
    """One dynamo graph holding attn_fwd; AOT autograd's backward graph holds attn_bwd; values
    and gradients equal the eager run's."""
    backend, graphs = _recording_backend()

    def step(q, k, v, sink, mask):
        kwargs = {"softcap": 5.0, "sink": sink, "return_max_logits": True} if features else {}
        out, meta = maskc.attention(q, k, v, mask, **kwargs)
        return _loss(out, meta.lse) + (meta.max_logits.sum() if features else 0)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    leaves = [*_inputs(MASK, dtype=torch.float32), torch.randn(2, HQ, requires_grad=features)]
    compiled(*leaves, MASK).backward()
    eager_leaves = _leaves(leaves)
    step(*eager_leaves, MASK).backward()
    for ours, theirs in zip(leaves, eager_leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert len(graphs["dynamo"]) == 1 and len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    assert torch.ops.maskc.attn_fwd.default in _targets(graphs["fw"][0])
    assert torch.ops.maskc.attn_bwd.default in _targets(graphs["bw"][0])
    assert torch.ops.maskc.attn_fwd.default not in _targets(graphs["bw"][0])


def _packed_documents(rng: np.random.Generator) -> Mask:
    """A packed row of 1 to 8 causal documents, 64 to 512 tokens in all."""
    total = int(rng.integers(64, 513))
    count = int(rng.integers(1, 9))
    cuts = np.sort(rng.choice(np.arange(1, total), count - 1, replace=False))
    return Mask.from_cu_seqlens(np.r_[0, cuts, total], causal=True)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_a_new_mask_every_step_compiles_nothing_after_the_second_step(dynamic: bool | None) -> None:
    """20 compiled training steps (forward and backward), each with another packed-document mask
    (other document counts and lengths, so other sequence lengths and slice counts): one
    compilation, a second when the lengths first turn dynamic, then none; gradients equal the
    eager ones every step."""
    rng = np.random.default_rng(0)
    torch._dynamo.reset()
    counters.clear()

    def step(q, k, v, mask):
        out, meta = maskc.attention(q, k, v, mask)
        return _loss(out, meta.lse)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    graphs = []
    for i in range(20):
        mask = _packed_documents(rng)
        leaves = _inputs(mask, seed=i, dtype=torch.float32)
        compiled(*leaves, mask).backward()
        graphs.append(counters["stats"]["unique_graphs"])
        eager = _leaves(leaves)
        step(*eager, mask).backward()
        for ours, theirs in zip(leaves, eager):
            torch.testing.assert_close(ours.grad, theirs.grad)
    assert graphs[1] <= 2 and graphs[-1] == graphs[1], graphs


def _positions(rng: np.random.Generator, total: int) -> torch.Tensor:
    """The position ids of a packed row of `total` tokens: 1 to 8 documents."""
    cuts = np.sort(rng.choice(np.arange(1, total), int(rng.integers(0, 8)), replace=False))
    return torch.cat([torch.arange(n) for n in np.diff(np.r_[0, cuts, total])])


def test_position_ids_are_data_inside_a_compiled_step() -> None:
    """maskc.PositionMask built inside the compiled code from a position_ids input: new packings
    (rows alike or not) compile nothing after the second step and equal the Mask's results."""
    rng = np.random.default_rng(5)
    torch._dynamo.reset()
    counters.clear()

    def step(q, k, v, position_ids):
        out, meta = maskc.attention(q, k, v, maskc.PositionMask(position_ids, True, (20, 0)))
        return _loss(out, meta.lse)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    graphs = []
    for i in range(8):
        s = int(rng.integers(64, 513))
        positions = torch.stack([_positions(rng, s) for _ in range(2)])
        if i % 2:
            positions = positions[:1].expand(2, -1).contiguous()  # rows alike: one shared row mask
        leaves = _inputs(Mask.from_cu_seqlens([0, s]), seed=i, dtype=torch.float32, batch=(2,))
        compiled(*leaves, positions).backward()
        graphs.append(counters["stats"]["unique_graphs"])
        masks_of_rows = [Mask.from_position_ids(row, causal=True, window=(20, 0)) for row in positions]
        eager = _leaves(leaves)
        _loss(*_out_lse_of(maskc.attention, *eager, Mask.stack(masks_of_rows))).backward()
        for ours, theirs in zip(leaves, eager):
            torch.testing.assert_close(ours.grad, theirs.grad)
    assert graphs[1] <= 2 and graphs[-1] == graphs[1], graphs
    with pytest.raises(maskc.MaskError, match="integer tensor"):
        maskc.PositionMask(torch.zeros(4), True)
    with pytest.raises(maskc.MaskError, match="window must be a pair"):
        maskc.PositionMask(torch.zeros(4, dtype=torch.long), True, (3,))


@dataclass
class _Kernels:
    """The CUDA implementations' launches on a CPU 'GPU': reference math, and what they were given."""

    launches: list[tuple[str, call_plan.Launch]] = field(default_factory=list)
    backward_took: list[str] = field(default_factory=list)

    def forward(self, q, k, v, sink, launch, scale, softcap, return_max_logits, lse_log2_rows=0):
        self.launches.append(("fwd", launch))
        cfg = reference._Config(_LAST_MASK[0], scale, softcap, reference.BLOCK_Q, reference.BLOCK_K, return_max_logits)
        out, lse, max_logits = reference._forward(q, k, v, sink, cfg)
        row_max = max_logits.expand(q.shape[0], -1).contiguous() if return_max_logits else lse.new_empty(0)
        lse_log2 = torch.full((q.shape[1], lse_log2_rows), math.inf)  # lse in log2 units, head-major, padded
        if lse_log2_rows:
            lse_log2[:, : q.shape[0]] = lse.t() * math.log2(math.e)
        return out, lse, row_max, lse_log2.view(-1)

    def backward(self, q, k, v, out, lse, sink, dout, dlse, launch, scale, softcap, dq_accum=None, lse_log2=None):
        self.launches.append(("bwd", launch))
        self.backward_took.append("lse" if lse is not None else "lse_log2")
        cfg = reference._Config(_LAST_MASK[0], scale, softcap, reference.BLOCK_Q, reference.BLOCK_K, False)
        if lse is None:  # the forward's lse_log2 stands for it
            lse = lse_log2.view(q.shape[1], -1)[:, : q.shape[0]].t() / math.log2(math.e)
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        return reference._backward(q, k, v, out, lse, sink, dout, dlse, cfg)


_LAST_MASK: list[Mask] = []
"""The mask the last planned call was planned for (the stand-in kernels attend with it)."""


def _register(monkeypatch: pytest.MonkeyPatch, direction: str, pack_gqa: bool, **features: bool) -> registry.Entry:
    """A kernel entry without a kernel in the runtime's registry: sm_90a, 8:2 heads, d=128, bf16."""
    tiles = select_tiles("sm_90a", HeadDim(D, D), direction)
    fields = {"arch": "sm_90a", "head_dim": D, "dtype": "bf16", "num_heads_q": HQ, "num_heads_kv": HKV,
              "has_softcap": False, "has_sink": False, "has_max_logits": False, **features, "direction": direction,
              "pack_gqa": pack_gqa, "tile_m": tiles.tile_m, "tile_n": tiles.tile_n, "num_stages": tiles.num_stages}  # fmt: skip
    entry = registry.entry_for(None, fields)
    monkeypatch.setitem(registry.KERNELS, registry.request_key(fields), entry)
    return entry


@pytest.fixture
def cuda_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """The CUDA implementations on CPU tensors: an 'SM90 GPU' with kernels for 8:2 heads, d=128,
    bf16 (both GQA strategies forward, and the backward) whose launches compute the reference;
    every schedule build is counted."""
    monkeypatch.setattr(call_plan, "device_info", lambda device: ((9, 0), 132))
    monkeypatch.setattr(registry, "LOADED", [])
    entries = {key: _register(monkeypatch, *key) for key in ENTRY_KEYS}
    kernels = _Kernels()
    monkeypatch.setattr(ops, "forward_cuda", kernels.forward)
    monkeypatch.setattr(ops, "backward_cuda", kernels.backward)
    monkeypatch.setattr(ops, "attn_fwd_cpu", ops.attn_fwd_cuda)
    monkeypatch.setattr(ops, "attn_bwd_cpu", ops.attn_bwd_cuda)
    call_mask = masks.call_mask

    def remember(mask: Mask, *shapes: Any) -> Mask:
        _LAST_MASK[:] = [call_mask(mask, *shapes)]
        return _LAST_MASK[0]

    monkeypatch.setattr(masks, "call_mask", remember)
    builds: list[str] = []
    for name in ("build_forward_schedule", "build_backward_schedule", "build_deterministic_backward_schedule"):
        monkeypatch.setattr(call_plan, name, _counted(getattr(schedules, name), builds))
    monkeypatch.setattr(call_plan, "select_forward", _counted(call_plan.select_forward, builds))  # the forward's decision
    return entries, kernels, builds


def test_the_backward_keeps_the_forwards_lse_log2_not_lse(cuda_on_cpu: Any) -> None:
    """On the GPU path the autograd node holds the forward's lse_log2 instead of lse, so a
    caller that drops lse frees it before the backward; with sinks (whose gradient needs it)
    it holds lse too."""
    mask = Mask.from_cu_seqlens([0, 37, 100, 129], causal=True)  # MASK's plans stay unmade for the tests that count them
    q, k, v = _inputs(mask)
    sink = torch.zeros(2, HQ, requires_grad=True)
    for with_sink in (False, True):
        out, meta = maskc.attention(q, k, v, mask, sink=sink if with_sink else None)
        saved = [t.untyped_storage().data_ptr() for t in out.grad_fn.saved_tensors if t is not None]
        assert (meta.lse.untyped_storage().data_ptr() in saved) == with_sink


def _counted(build: Any, calls: list[str]) -> Any:
    """`build`, appending its name to `calls` at each call (under its own name: memo keys use it)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(build.__name__)
        return build(*args, **kwargs)

    counted.__name__ = build.__name__
    return counted


def test_the_gpu_path_plans_inside_the_op_once_per_mask(cuda_on_cpu: Any) -> None:
    """Four layers with one mask, forward and backward: one forward decision (tile and GQA
    strategy), one forward and one backward schedule, from the kernels the plan chose; the
    forward plans no backward."""
    entries, kernels, builds = cuda_on_cpu
    q, k, v = _inputs(MASK)
    x = q
    for _ in range(4):
        x, _ = maskc.attention(x, k, v, MASK)
    assert [name for name, _ in kernels.launches] == ["fwd"] * 4 and builds == ["select_forward", "build_forward_schedule"]
    x.float().sum().backward()
    assert [name for name, _ in kernels.launches[4:]] == ["bwd"] * 4
    assert builds == ["select_forward", "build_forward_schedule", "build_backward_schedule"]
    assert kernels.launches[0][1].kernel in (entries["fwd", False], entries["fwd", True])
    assert kernels.launches[-1][1].kernel is entries["bwd", False] and q.grad is not None
    assert kernels.backward_took == ["lse_log2"] * 4  # the forward's: lse itself is not kept for the backward


def test_the_gpu_path_under_compile_plans_each_new_mask_in_the_op(cuda_on_cpu: Any) -> None:
    entries, kernels, builds = cuda_on_cpu
    rng = np.random.default_rng(1)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, mask: _loss(*_out_lse_of(maskc.attention, q, k, v, mask)), backend="aot_eager",
                             fullgraph=True)  # fmt: skip
    for i in range(4):
        mask = _packed_documents(rng)
        leaves = _inputs(mask, seed=i)
        compiled(*leaves, mask).backward()
        eager = _leaves(leaves)
        _loss(*_out_lse_of(maskc.reference_attention, *eager, mask)).backward()
        for ours, theirs in zip(leaves, eager):
            torch.testing.assert_close(ours.grad, theirs.grad)
    assert builds.count("build_forward_schedule") == 4 and builds.count("build_backward_schedule") == 4


def _out_lse_of(attention: Any, q, k, v, mask):
    out, meta = attention(q, k, v, mask)
    return out, meta.lse


def test_deterministic_selects_the_ordered_backward_kernel_and_schedule(cuda_on_cpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """deterministic=True plans the deterministic backward variant with the ranked schedule
    (eleven arrays); the default plans the plain one (nine: the forward's six, the q blocks'
    bounds and the item lists)."""
    entries, kernels, _ = cuda_on_cpu
    ordered = _register(monkeypatch, "bwd", False, deterministic=True)
    for deterministic, entry, arrays in ((False, entries["bwd", False], 9), (True, ordered, 11)):
        q, k, v = _inputs(MASK)
        out, meta = maskc.attention(q, k, v, MASK, deterministic=deterministic)
        _loss(out, meta.lse).backward()
        name, launch = kernels.launches[-1]
        assert name == "bwd" and launch.kernel is entry and entry.deterministic == deterministic
        assert len(launch.rows) == arrays


@pytest.mark.parametrize("pack_gqa", [False, True])
def test_sm90_kernels_take_blocks_and_tiles_per_document(cuda_on_cpu: Any, pack_gqa: bool) -> None:
    """The SM90 forward's k blocks and backward's k tiles start at each document, and so do the
    backward's q blocks and the forward's q tiles where it packs no query heads: their
    schedules' key and query bounds are `document_tiles`', not the grid's (PackGQA's q tiles
    stay on the grid)."""
    _, kernels, _ = cuda_on_cpu
    mask = Mask.from_cu_seqlens([0, 300, 1000, 1500], causal=True)
    q, k, v = _inputs(mask)
    out, meta = maskc.attention(q, k, v, mask, pack_gqa=pack_gqa)
    _loss(out, meta.lse).backward()
    (_, forward), (_, backward) = kernels.launches[-2:]
    for launch in (forward, backward):
        keys = call_plan.schedule_views(launch.schedule, launch.rows)["key_bounds"].tolist()
        starts = schedules.document_tiles(mask, launch.kernel.tile_m, launch.kernel.tile_n)[1]
        assert keys == [*starts.tolist(), 1500] and 300 in keys and 1000 in keys
    queries = call_plan.schedule_views(backward.schedule, backward.rows)["query_bounds"].tolist()
    starts = schedules.document_tiles(mask, backward.kernel.tile_m, backward.kernel.tile_n)[0]
    assert queries == [*starts.tolist(), 1500] and 300 in queries and 1000 in queries
    shape = forward.kernel.shape
    assert shape.document_rows != pack_gqa
    tiles = schedules.document_tiles(mask, shape.tile_m, shape.tile_n)[0] if not pack_gqa else range(0, 1500, shape.tile_m)
    assert call_plan.schedule_views(forward.schedule, forward.rows)["query_bounds"].tolist() == [*tiles, 1500]


def test_a_callers_dq_buffer_keeps_the_backwards_q_blocks_on_the_grid(cuda_on_cpu: Any) -> None:
    """attention_backward's dq_accum has Tq rows, too few for the views of q blocks that start
    at each document: its plan keeps them on the grid (k tiles still per document), apart from
    the plan of the calls that own their dQ."""
    mask = Mask.from_cu_seqlens([0, 300, 1000, 1500], causal=True)
    target = _target()
    own, grid = (call_plan.plan_backward(mask, target, torch.device("cpu"), grid_queries=g) for g in (False, True))
    tile_m, tile_n = grid.kernel.tile_m, grid.kernel.tile_n
    views = [call_plan.schedule_views(launch.schedule, launch.rows) for launch in (own, grid)]
    starts = schedules.document_tiles(mask, tile_m, tile_n)
    assert views[0]["query_bounds"].tolist() == [*starts[0].tolist(), 1500]
    assert views[1]["query_bounds"].tolist() == [*range(0, 1500, tile_m), 1500]
    assert views[0]["key_bounds"].tolist() == views[1]["key_bounds"].tolist() == [*starts[1].tolist(), 1500]


def test_plan_errors_reach_the_caller(cuda_on_cpu: Any) -> None:
    q = torch.zeros(MASK.seqlen_q, 6, D, dtype=torch.bfloat16)
    with pytest.raises(maskc.MaskcError, match="pack_gqa needs Hq / Hkv a power of two"):
        maskc.attention(q, q[:, :2].contiguous(), q[:, :2].contiguous(), MASK, pack_gqa=True)


def _target() -> call_plan.Target:
    return call_plan.make_target((9, 0), 132, torch.bfloat16, HQ, HKV, HeadDim(D, D), False, False, False, None, False)


def test_a_prepared_mask_crosses_a_process_boundary_and_needs_no_planning(cuda_on_cpu: Any) -> None:
    """What a DataLoader worker does: prepare the mask, pickle it (the Mask itself stays behind);
    the training step then decides nothing, builds no schedule and gets the same results."""
    entries, kernels, builds = cuda_on_cpu
    mask = Mask.from_cu_seqlens([0, 300, 1000, 1500], causal=True)
    ready = prepared.prepare(mask, pickle.loads(pickle.dumps(_target())))  # the target crosses to the worker too
    data = pickle.dumps(ready)
    assert len(data) < 4 * (ready.table.numel() + ready.plan.numel()) + 4096  # the tensors, not the Mask they carry
    shipped = pickle.loads(data)
    assert builds == ["select_forward", "build_forward_schedule", "build_backward_schedule"]
    builds.clear()
    assert getattr(shipped.table, "_maskc_mask", None) is None
    q, k, v = _inputs(mask)
    out, meta = maskc.attention(q, k, v, shipped)
    _loss(out, meta.lse).backward()
    assert builds == [] and [name for name, _ in kernels.launches] == ["fwd", "bwd"]
    leaves = _leaves([q, k, v])
    ref, ref_meta = maskc.reference_attention(*leaves, mask)
    _loss(ref, ref_meta.lse).backward()
    torch.testing.assert_close(out, ref)
    for ours, theirs in zip((q, k, v), leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_a_prepared_mask_carries_the_schedule_of_the_tall_tile(cuda_on_cpu: Any) -> None:
    """A mask whose forward takes d=128's tall tile: the worker builds that tile's schedule,
    which the step then finds (no decision, no build)."""
    _, _, builds = cuda_on_cpu
    target = _target()
    shipped = pickle.loads(pickle.dumps(prepared.prepare(Mask.from_cu_seqlens([0, 8192]), target)))
    builds.clear()
    mask = masks.mask_of(shipped.table, shipped.plan)
    request, _ = call_plan.forward_requests(mask, target)
    kernel = variant_for(request)  # the kernel the call runs, and the shape it launches with
    shape = registry.launch_shape(kernel.to_dict())
    assert request["tall"] and kernel.tile_m == 192 and call_plan.forward_schedule(mask, shape, target.num_sms)
    assert builds == []


def test_a_plan_for_another_target_is_ignored_and_planned_in_the_call(cuda_on_cpu: Any) -> None:
    _, _, builds = cuda_on_cpu
    mask = Mask.from_cu_seqlens([0, 700], causal=True)
    other = call_plan.make_target((9, 0), 132, torch.bfloat16, HQ, HKV, HeadDim(64, 64), False, False, False, None, False)  # other tiles
    shipped = pickle.loads(pickle.dumps(prepared.prepare(mask, other)))
    builds.clear()
    q, k, v = _inputs(mask)
    with torch.no_grad():
        maskc.attention(q, k, v, shipped)
    assert builds == ["select_forward", "build_forward_schedule"]


def test_a_prepared_plan_is_only_used_with_its_own_mask() -> None:
    mask, other = Mask.from_cu_seqlens([0, 700], causal=True), Mask.from_cu_seqlens([0, 699, 700], causal=True)
    plan_data = prepared.prepare(mask, _target()).plan
    with pytest.raises(maskc.MaskcError, match="made for another mask"):
        plan_records.decode(plan_data, other.table)
    with pytest.raises(maskc.MaskcError, match="1-D int32 CPU tensor"):
        plan_records.decode(plan_data.float(), mask.table)
    assert plan_records.decode(prepared.prepare(mask, None).plan, mask.table) == []


def test_a_mask_table_is_found_again_by_content_when_its_tensor_is_another() -> None:
    copy = MASK.table.clone()
    found = masks.mask_of(copy)
    assert found == MASK and masks.mask_of(copy.clone()) is found
    with pytest.raises(maskc.MaskError, match="int32 tensor"):
        Mask.from_table(copy.float())


def test_a_table_holds_a_mask_exactly() -> None:
    mask = Mask([AttnSlice((0, 450), (0, 1500)), AttnSlice((900, 1000), (5, 77), "bi_causal")], 1500, 1600)
    assert Mask.from_table(mask.table.clone()) == mask and mask.table[0, :2].tolist() == [1500, 1600]
    with pytest.raises(maskc.MaskError, match="past seqlen_q"):
        Mask.from_table(torch.tensor([[10, 10, 0, 0, 0], [0, 11, 0, 3, 0]], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,padded", [(1, 1), (2, 2), (65, 72), (1001, 1008), (4096, 4096)])
def test_the_dq_cast_in_place_is_the_cast_written_over_the_accumulator(rows: int, padded: int, dtype: torch.dtype) -> None:
    """cast_in_place gives exactly `.to(dtype)` of the accumulator's first rows (the kernel's
    8-row padding left out), in the accumulator's own bytes: no buffer of the gradient's size."""
    accum = torch.randn(padded, 3, 64) * 1e3
    expected = accum[:rows].to(dtype)
    got = ops.cast_in_place(accum[:rows], dtype)
    assert got.data_ptr() == accum.data_ptr() and got.dtype == dtype and torch.equal(got, expected)


def test_split_workspaces_are_kept_per_stream_grown_and_bounded(monkeypatch) -> None:
    """The split items' workspace (ops._split_sums): one per (device, stream), reused while big
    enough, grown (a new zeroed buffer) when a schedule needs more, and kept for the last
    SPLIT_WORKSPACE_STREAMS streams only; its counters start with the CTAs' pace, also for a
    schedule without split items. (CPU tensors stand in for the GPU's: the logic is the same.)"""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "_SPLIT_WORKSPACES", type(ops._SPLIT_WORKSPACES)())
    cpu = torch.device("cpu")
    sums, counts = ops._split_sums(2, 8, 2, cpu, stream=1)
    assert (sums.numel(), counts.numel(), counts.dtype) == (16, PACE_COUNTERS + 4, torch.int32)
    assert not sums.any() and not counts.any()
    assert counts.data_ptr() == sums.data_ptr() + 16 * 4  # one buffer: the counters after the sums
    same = ops._split_sums(2, 8, 2, cpu, stream=1)
    assert same[0] is sums and same[1] is counts  # the same views: no new tensors a call
    again, _ = ops._split_sums(1, 8, 2, cpu, stream=1)
    assert again.data_ptr() == sums.data_ptr()  # big enough: the same memory
    grown, _ = ops._split_sums(4, 8, 2, cpu, stream=1)
    assert grown.numel() == 32 and grown.data_ptr() != sums.data_ptr()
    assert ops._split_sums(2, 8, 2, cpu, stream=1)[0].data_ptr() == grown.data_ptr()  # the grown buffer's views
    assert len(ops._SPLIT_WORKSPACES[(cpu, 1)].views) == 1  # only the last call's: masks change every step
    no_split, pace = ops._split_sums(0, 8, 2, cpu, stream=1)
    assert (no_split.numel(), pace.numel()) == (0, PACE_COUNTERS)
    for stream in range(2, 2 + ops.SPLIT_WORKSPACE_STREAMS):
        ops._split_sums(1, 8, 2, cpu, stream=stream)
    assert len(ops._SPLIT_WORKSPACES) == ops.SPLIT_WORKSPACE_STREAMS and (cpu, 1) not in ops._SPLIT_WORKSPACES
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured, _ = ops._split_sums(1, 8, 2, cpu, stream=2)
    assert all(captured.data_ptr() != w.buffer.data_ptr() for w in ops._SPLIT_WORKSPACES.values())  # a graph's own zeros


def test_the_ops_pass_torch_library_opcheck() -> None:
    """Schema, fake implementations, autograd registration and AOT dispatch agree with the
    kernels (the CPU's), for the forward with inputs that need gradients and its backward."""
    options = ops.Options(None, False, None).encode()
    q, k, v = (torch.randn(129, h, D, dtype=torch.float32, requires_grad=True) for h in (HQ, HKV, HKV))
    forward = (q, k, v, None, MASK.table, None, None, D**-0.5, 0.0, False, True, options)
    torch.library.opcheck(torch.ops.maskc.attn_fwd.default, forward)
    out, lse, _, lse_log2 = torch.ops.maskc.attn_fwd(*(x.detach() if isinstance(x, torch.Tensor) else x for x in forward))
    plain = [x.detach() for x in (q, k, v)]
    backward = (*plain, out, lse, lse_log2, None, torch.randn_like(out), None, MASK.table, None, None, D**-0.5, 0.0, options)
    torch.library.opcheck(torch.ops.maskc.attn_bwd.default, backward)
