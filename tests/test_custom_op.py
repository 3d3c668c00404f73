"""maskc.attention as torch.library custom ops, checked without a GPU.

The ops' fake implementations run under FakeTensorMode on fake CUDA tensors. For torch.compile,
CPU tensors stand in for CUDA ones: the runtime's CUDA-only seams (the device check, the device
query, the kernel registry) are patched and the ops get CPU implementations computed with the
reference attention's math (eager mode calls those implementations without the dispatcher, so
they are patched too), so what is checked is the integration (tracing without graph breaks, op
arguments, autograd wiring), not the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

import maskc
from maskc import reference
from maskc.artifact.families import select_tiles
from maskc.ir import AttnSlice, Mask
from maskc.ir.schedule import build_backward_schedule, build_deterministic_backward_schedule, build_schedule
from maskc.runtime import api, ops, plan, registry

HQ, HKV, D = 8, 2, 128
MASK = Mask.from_cu_seqlens([0, 37, 100, 129], causal=True)
OTHER_MASK = Mask.from_cu_seqlens([0, 64, 129], causal=True)
ENTRY_KEYS = (("fwd", False), ("fwd", True), ("bwd", False))
"""(direction, pack_gqa) of the kernels the CPU runs 'have'."""


def test_ops_are_registered_with_tensor_and_scalar_arguments_only() -> None:
    fwd = torch.ops.maskc.attn_fwd.default._schema
    bwd = torch.ops.maskc.attn_bwd.default._schema
    allowed = {"Tensor", "Optional[Tensor]", "List[int]", "float", "bool"}
    for schema in (fwd, bwd):
        assert {str(a.type) for a in schema.arguments} <= allowed, schema
    assert [r.type.kind() for r in fwd.returns] == ["TensorType"] * 3
    assert [r.type.kind() for r in bwd.returns] == ["TensorType"] * 4


@pytest.mark.parametrize("return_max_logits", [False, True])
@pytest.mark.parametrize("with_sink", [False, True])
def test_fake_implementations_give_exact_shapes(return_max_logits: bool, with_sink: bool) -> None:
    tq, tk = 300, 200
    with FakeTensorMode():
        q = torch.empty(tq, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(tk, HKV, D, dtype=torch.bfloat16, device="cuda")
        sink = torch.empty(3, HQ, dtype=torch.float32, device="cuda") if with_sink else None
        schedule, launch = torch.empty(40, dtype=torch.int32, device="cuda"), [0, 132, 2, 3, 2, 3, 4]
        out, lse, row_max = torch.ops.maskc.attn_fwd(q, k, k, sink, schedule, launch, 0.1, 0.0, return_max_logits, None, [])
        dq, dk, dv, dsink = torch.ops.maskc.attn_bwd(q, k, k, out, lse, sink, out, lse, schedule, launch, 0.1, 0.0)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, torch.bfloat16, "cuda")
    assert (lse.shape, lse.dtype) == ((tq, HQ), torch.float32)
    assert (row_max.shape, row_max.dtype) == ((tq, HQ) if return_max_logits else (0,), torch.float32)
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
    assert (dk.shape, dk.dtype) == (dv.shape, dv.dtype) == (k.shape, k.dtype)
    assert (dsink.shape, dsink.dtype) == ((3, HQ) if with_sink else (0,), torch.float32)


@dataclass
class _Doubles:
    """The CPU stand-ins for the kernels: reference math on `mask`, and what the ops were given."""

    mask: Mask
    entries: dict[tuple[str, bool], Any]
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def config(self, scale: float, softcap: float, return_max_logits: bool = False) -> Any:
        return reference._Config(self.mask, scale, softcap, reference.BLOCK_Q, reference.BLOCK_K, return_max_logits)

    def forward(self, q, k, v, sink, schedule, launch, softmax_scale, softcap, return_max_logits, bwd_schedule, bwd_launch):
        self.calls.append(("fwd", {"schedule": schedule, "launch": launch, "bwd_schedule": bwd_schedule,
                                   "bwd_launch": bwd_launch}))  # fmt: skip
        out, lse, max_logits = reference._forward(q, k, v, sink, self.config(softmax_scale, softcap, return_max_logits))
        row_max = max_logits.expand(q.shape[0], -1).contiguous() if return_max_logits else lse.new_empty(0)
        return out, lse, row_max

    def backward(self, q, k, v, out, lse, sink, dout, dlse, schedule, launch, softmax_scale, softcap):
        self.calls.append(("bwd", {"schedule": schedule, "launch": launch}))
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        dq, dk, dv, dsink = reference._backward(q, k, v, out, lse, sink, dout, dlse, self.config(softmax_scale, softcap))
        return dq, dk, dv, dsink if dsink is not None else lse.new_empty(0)


def _register(monkeypatch: pytest.MonkeyPatch, direction: str, pack_gqa: bool, **features: bool) -> Any:
    """A kernel entry without a kernel in the runtime's registry: sm_90a, 8:2 heads, d=128, bf16."""
    tiles = select_tiles("sm_90a", D, direction)
    fields = {"arch": "sm_90a", "head_dim": D, "dtype": "bf16", "num_heads_q": HQ, "num_heads_kv": HKV,
              "has_softcap": False, "has_sink": False, "has_max_logits": False, **features, "direction": direction,
              "pack_gqa": pack_gqa, "tile_m": tiles.tile_m, "tile_n": tiles.tile_n}  # fmt: skip
    entry = registry.entry_for(None, fields)
    monkeypatch.setitem(registry.KERNELS, registry.request_key(fields), entry)
    return entry


@pytest.fixture
def cpu_ops(monkeypatch: pytest.MonkeyPatch):
    """maskc.attention on CPU tensors: an 'SM90 GPU', kernels registered for 8:2 heads, d=128, bf16
    (both GQA strategies forward, and the backward), and the ops' CPU doubles."""
    monkeypatch.setattr(api, "_check_device", lambda name, x: None)
    monkeypatch.setattr(plan, "device_info", lambda device: ((9, 0), 132))
    monkeypatch.setattr(registry, "LOADED", [])
    doubles = _Doubles(MASK, {key: _register(monkeypatch, *key) for key in ENTRY_KEYS})
    monkeypatch.setattr(ops, "attn_fwd_impl", doubles.forward)  # eager mode calls the implementations directly
    monkeypatch.setattr(ops, "attn_bwd_impl", doubles.backward)
    with torch.library._scoped_library("maskc", "IMPL") as lib:
        lib.impl("attn_fwd", doubles.forward, "CPU")
        lib.impl("attn_bwd", doubles.backward, "CPU")
        yield doubles


def _inputs(mask: Mask, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tq, tk = mask.shape
    shapes = [(tq, HQ, D), (tk, HKV, D), (tk, HKV, D)]
    return [torch.randn(s, generator=g).to(torch.bfloat16).requires_grad_() for s in shapes]


def _loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Uses lse too, so its gradient is part of what is checked."""
    return out.float().square().sum() + (lse * torch.linspace(-1, 1, lse.shape[1])).sum()


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


@pytest.mark.parametrize("build,params", [
    (build_schedule, (128, 128)), (build_backward_schedule, (128, 128, 2, 3)),
    (build_deterministic_backward_schedule, (128, 128, 2, 3)),
])  # fmt: skip
@pytest.mark.parametrize("mask", [MASK, Mask([], 5, 7), Mask([AttnSlice((0, 450), (0, 1500)), AttnSlice((900, 1000), (5, 77))], 1500, 1500)])  # fmt: skip
def test_a_flat_schedule_cuts_back_into_the_abi_arrays(mask: Mask, build: Any, params: tuple[int, ...]) -> None:
    """One op argument per schedule: the kernel still gets each array, empty ones as a zero row."""
    flat, rows, _ = plan.schedule_tensors(mask, build, torch.device("cpu"), *params)
    views = plan.schedule_views(flat, rows)
    assert plan.schedule_views(flat, rows) is views  # cut once per schedule tensor
    arrays = build(mask, *params).arrays()
    assert flat.dtype == torch.int32 and list(views) == [a.name for a in plan.SCHEDULE_ARGS[: len(arrays)]]
    for arg, array in zip(plan.SCHEDULE_ARGS, arrays):
        expected = torch.from_numpy(array) if len(array) else torch.zeros(1, *array.shape[1:], dtype=torch.int32)
        assert torch.equal(views[arg.name], expected), arg.name


def test_eager_matches_the_reference_through_the_ops(cpu_ops: _Doubles) -> None:
    """The autograd wiring: dq, dk, dv and the lse gradient reach the right inputs."""
    q, k, v = _inputs(MASK)
    out, meta = maskc.attention(q, k, v, MASK)
    _loss(out, meta.lse).backward()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref, ref_meta = maskc.reference_attention(*leaves, MASK)
    _loss(ref, ref_meta.lse).backward()
    assert torch.equal(out, ref) and torch.equal(meta.lse, ref_meta.lse)
    for ours, theirs in zip((q, k, v), leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert [name for name, _ in cpu_ops.calls] == ["fwd", "bwd"]


def test_sink_gradient_and_max_logits_through_the_ops(cpu_ops: _Doubles, monkeypatch: pytest.MonkeyPatch) -> None:
    for direction, pack_gqa in ENTRY_KEYS:
        _register(monkeypatch, direction, pack_gqa, has_softcap=True, has_sink=direction == "fwd",
                  has_max_logits=direction == "fwd")  # fmt: skip
    q, k, v = _inputs(MASK)
    sink = torch.randn(2, HQ, requires_grad=True)
    out, meta = maskc.attention(q, k, v, MASK, softcap=5.0, sink=sink, return_max_logits=True)
    _loss(out, meta.lse).backward()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
    ref, ref_meta = maskc.reference_attention(*leaves[:3], MASK, softcap=5.0, sink=leaves[3], return_max_logits=True)
    _loss(ref, ref_meta.lse).backward()
    torch.testing.assert_close(meta.max_logits, ref_meta.max_logits)
    assert not meta.max_logits.requires_grad
    for ours, theirs in zip((q, k, v, sink), leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_no_backward_is_planned_without_grad(cpu_ops: _Doubles) -> None:
    q, k, v = _inputs(MASK)
    with torch.no_grad():
        out, meta = maskc.attention(q, k, v, MASK)
    assert out.grad_fn is None and meta.lse.grad_fn is None
    (name, args), = cpu_ops.calls
    assert args["bwd_schedule"] is None and args["bwd_launch"] == []
    assert registry.LOADED[args["launch"][0]] in (cpu_ops.entries["fwd", False], cpu_ops.entries["fwd", True])
    out, _ = maskc.attention(q, k, v, MASK)
    assert out.grad_fn is not None and registry.LOADED[cpu_ops.calls[-1][1]["bwd_launch"][0]] is cpu_ops.entries["bwd", False]


@pytest.mark.parametrize("features", [False, True], ids=["plain", "softcap_sink_max_logits"])
def test_compiled_fullgraph_forward_and_backward_without_graph_breaks(
    cpu_ops: _Doubles, monkeypatch: pytest.MonkeyPatch, features: bool
) -> None:
    """One dynamo graph holding attn_fwd; AOT autograd's backward graph holds attn_bwd; values
    and gradients equal the eager run's."""
    for direction, pack_gqa in ENTRY_KEYS:
        _register(monkeypatch, direction, pack_gqa, has_softcap=True, has_sink=direction == "fwd",
                  has_max_logits=direction == "fwd")  # fmt: skip
    backend, graphs = _recording_backend()

    def step(q, k, v, sink, mask):
        kwargs = {"softcap": 5.0, "sink": sink, "return_max_logits": True} if features else {}
        out, meta = maskc.attention(q, k, v, mask, **kwargs)
        return _loss(out, meta.lse) + (meta.max_logits.sum() if features else 0)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    leaves = [*_inputs(MASK), torch.randn(2, HQ, requires_grad=True)]
    if not features:
        leaves[3].requires_grad_(False)
    compiled(*leaves, MASK).backward()
    eager_leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]
    step(*eager_leaves, MASK).backward()
    for ours, theirs in zip(leaves, eager_leaves):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert len(graphs["dynamo"]) == 1 and len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    assert torch.ops.maskc.attn_fwd.default in _targets(graphs["fw"][0])
    assert torch.ops.maskc.attn_bwd.default in _targets(graphs["bw"][0])
    assert torch.ops.maskc.attn_fwd.default not in _targets(graphs["bw"][0])

    grads = [x.grad for x in leaves]
    for x in leaves:
        x.grad = None
    compiled(*leaves, MASK).backward()  # the same mask: no new compilation
    assert len(graphs["dynamo"]) == 1
    for x, grad in zip(leaves, grads):
        torch.testing.assert_close(x.grad, grad)


def test_compiled_graph_is_specialised_to_its_mask(cpu_ops: _Doubles) -> None:
    """Another mask of the same shape must not reuse the first one's schedules: it recompiles."""
    backend, graphs = _recording_backend()
    compiled = torch.compile(lambda q, k, v, mask: maskc.attention(q, k, v, mask)[0], backend=backend, fullgraph=True)
    q, k, v = _inputs(MASK)
    with torch.no_grad():
        compiled(q, k, v, MASK)
        cpu_ops.mask = OTHER_MASK
        out = compiled(q, k, v, OTHER_MASK)
    assert len(graphs["dynamo"]) == 2
    assert torch.equal(out, maskc.reference_attention(q.detach(), k.detach(), v.detach(), OTHER_MASK)[0])


def test_explain_reports_no_graph_break(cpu_ops: _Doubles) -> None:
    q, k, v = _inputs(MASK)
    explanation = torch._dynamo.explain(lambda q, k, v: maskc.attention(q, k, v, MASK)[0])(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_plan_errors_are_the_eager_errors(cpu_ops: _Doubles) -> None:
    q = torch.zeros(MASK.seqlen_q, 6, D, dtype=torch.bfloat16)
    with pytest.raises(maskc.MaskcError, match="pack_gqa needs Hq / Hkv a power of two"):
        maskc.attention(q, q[:, :2].contiguous(), q[:, :2].contiguous(), MASK, pack_gqa=True)


def test_deterministic_selects_the_ordered_backward_kernel_and_schedule(cpu_ops: _Doubles, monkeypatch: pytest.MonkeyPatch) -> None:
    """deterministic=True plans the deterministic backward variant with the ranked schedule (nine
    arrays); the default plans the plain one (seven: the forward's five and the item lists)."""
    ordered = _register(monkeypatch, "bwd", False, deterministic=True)
    for deterministic, entry, arrays in ((False, cpu_ops.entries["bwd", False], 7), (True, ordered, 9)):
        q, k, v = _inputs(MASK)
        out, meta = maskc.attention(q, k, v, MASK, deterministic=deterministic)
        _loss(out, meta.lse).backward()
        name, args = cpu_ops.calls[-1]
        assert name == "bwd" and registry.LOADED[args["launch"][0]] is entry
        assert len(args["launch"]) == 3 + arrays and entry.deterministic == deterministic  # kernel, CTAs, split slots, rows
