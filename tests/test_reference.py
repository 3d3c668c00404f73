"""reference_attention against a naive dense float64 attention written here, independently.

The blockwise oracle is what every kernel is judged by, so it is itself checked against the
simplest possible formulation: a dense mask, a masked softmax over keys and sinks, and plain
autograd for the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maskc.ir import AttnSlice, Mask
from maskc.reference import AttentionMeta, _Config, _tiles, reference_attention

TYPES = ("full", "causal", "inv_causal", "bi_causal")
HEADS = ((4, 2), (4, 1), (2, 2))


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dense: torch.Tensor,
    scale: float,
    softcap: float,
    sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense masked softmax with repeated kv heads; returns out [Tq,Hq,D], lse [Tq,Hq], max [Hq]."""
    tq, hq, _ = q.shape
    group = hq // k.shape[1]
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kr) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~dense, -math.inf)
    max_logits = s.detach().amax(dim=(1, 2))
    sinks = torch.zeros(0, hq, dtype=q.dtype) if sink is None else sink.to(q.dtype)
    logits = torch.cat([s, sinks.T.unsqueeze(1).expand(hq, tq, sinks.shape[0])], dim=-1)
    live = logits.detach().amax(dim=-1) > -math.inf
    lse = torch.logsumexp(torch.where(live.unsqueeze(-1), logits, 0.0), dim=-1)
    p = torch.exp(s - torch.where(live, lse, 0.0).unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", p, vr)
    return out, torch.where(live, lse, -math.inf).T, max_logits


@dataclass(frozen=True)
class Case:
    mask: Mask
    hq: int
    hkv: int
    head_dim: int
    softcap: float
    num_sinks: int | None
    scale: float | None
    block_q: int
    block_k: int
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    sq, sk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    slices = []
    for _ in range(draw(st.integers(0, 4))):
        qs = draw(st.integers(0, sq))
        ks = draw(st.integers(0, sk))
        qe, ke = draw(st.integers(qs, sq)), draw(st.integers(ks, sk))
        slices.append(AttnSlice(q=(qs, qe), k=(ks, ke), type=draw(st.sampled_from(TYPES))))
    hq, hkv = draw(st.sampled_from(HEADS))
    return Case(
        mask=Mask(slices, sq, sk),
        hq=hq,
        hkv=hkv,
        head_dim=draw(st.sampled_from((4, 8))),
        softcap=draw(st.sampled_from((0.0, 1.5))),
        num_sinks=draw(st.sampled_from((None, 1, 2))),
        scale=draw(st.sampled_from((None, 0.7))),
        block_q=draw(st.sampled_from((1, 3, 8, 64))),
        block_k=draw(st.sampled_from((2, 5, 64))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_inputs(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v, sink, and output/lse loss weights, all float64 values exactly representable in dtype."""
    gen = torch.Generator().manual_seed(case.seed)
    sq, sk = case.mask.seqlen_q, case.mask.seqlen_k

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).double()

    q = rand(sq, case.hq, case.head_dim, scale=1.5)
    k = rand(sk, case.hkv, case.head_dim, scale=1.5)
    v = rand(sk, case.hkv, case.head_dim)
    sink = rand(case.num_sinks or 0, case.hq).float().double()
    return q, k, v, sink, rand(sq, case.hq, case.head_dim), rand(sq, case.hq)


def loss_of(out: torch.Tensor, lse: torch.Tensor, w_out: torch.Tensor, w_lse: torch.Tensor) -> torch.Tensor:
    """Uses both outputs so the lse gradient path is tested; -inf lse rows contribute nothing."""
    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    return (out.double() * w_out).sum() + (finite_lse.double() * w_lse).sum()


def run_both(case: Case, dtype: torch.dtype, sink_dtype: torch.dtype) -> tuple[dict, dict]:
    """Values and gradients from reference_attention (inputs in dtype) and the float64 naive oracle."""
    q, k, v, sink, w_out, w_lse = make_inputs(case, dtype)
    results = []
    for impl_dtype, impl_sink_dtype, fn in (
        (dtype, sink_dtype, "ref"),
        (torch.float64, torch.float64, "naive"),
    ):
        leaves = [x.to(impl_dtype, copy=True).requires_grad_() for x in (q, k, v)]
        sink_leaf = sink.to(impl_sink_dtype, copy=True).requires_grad_() if case.num_sinks else None
        if fn == "ref":
            out, meta = reference_attention(
                *leaves,
                case.mask,
                softmax_scale=case.scale,
                softcap=case.softcap,
                sink=sink_leaf,
                return_max_logits=True,
                _block_q=case.block_q,
                _block_k=case.block_k,
            )
            lse, max_logits = meta.lse, meta.max_logits
        else:
            scale = case.scale if case.scale is not None else 1 / math.sqrt(case.head_dim)
            out, lse, max_logits = naive_attention(*leaves, case.mask.to_dense(), scale, case.softcap, sink_leaf)
        loss_of(out, lse, w_out, w_lse).backward()
        grads = [x.grad for x in leaves] + ([sink_leaf.grad] if sink_leaf is not None else [])
        results.append({"out": out, "lse": lse, "max_logits": max_logits, "grads": grads})
    return results[0], results[1]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Error bounded by tol relative to the tensor's scale (and absolutely), -inf matching -inf."""
    assert actual.shape == expected.shape
    a, e = actual.double(), expected.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(e))
    assert not torch.isnan(a).any()
    fin = torch.isfinite(e)
    if fin.any():
        bound = tol * (1 + e[fin].abs().max())
        assert (a[fin] - e[fin]).abs().max() <= bound


@pytest.mark.slow
@settings(max_examples=120, deadline=None, derandomize=True)
@given(cases())
def test_float64_matches_naive(case: Case) -> None:
    ref, naive = run_both(case, torch.float64, torch.float64)
    assert ref["out"].dtype == torch.float64 and ref["lse"].dtype == torch.float64
    for key in ("out", "lse"):
        assert_close(ref[key], naive[key], 1e-10)
    assert ref["max_logits"].dtype == torch.float32
    assert_close(ref["max_logits"], naive["max_logits"].float(), 1e-6)
    assert len(ref["grads"]) == len(naive["grads"])
    for got, want in zip(ref["grads"], naive["grads"]):
        assert got.dtype == torch.float64
        assert_close(got, want, 1e-10)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(cases(), st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
def test_low_precision_matches_float64_oracle(case: Case, dtype: torch.dtype) -> None:
    ref, naive = run_both(case, dtype, torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert ref["out"].dtype == dtype and ref["lse"].dtype == torch.float32
    for key in ("out", "lse", "max_logits"):
        assert_close(ref[key], naive[key], tol)
    for i, (got, want) in enumerate(zip(ref["grads"], naive["grads"])):
        assert got.dtype == (torch.float32 if i == 3 else dtype)
        assert_close(got, want, tol)


def test_float32_sink_with_float64_inputs() -> None:
    mask = Mask([AttnSlice(q=(0, 6), k=(0, 6), type="causal")], 6, 6)
    q, k, v = (torch.randn(6, 2, 4, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(1, 2, requires_grad=True)
    out, meta = reference_attention(q, k, v, mask, sink=sink)
    meta.lse.sum().backward()
    assert sink.grad is not None and sink.grad.dtype == torch.float32
    expected, expected_lse, _ = naive_attention(q, k, v, mask.to_dense(), 0.5, 0.0, sink.detach())
    assert_close(out, expected, 1e-12)
    assert_close(meta.lse, expected_lse, 1e-12)


@pytest.mark.parametrize("num_sinks", [None, 2])
def test_rows_without_keys(num_sinks: int | None) -> None:
    # Rows 0-1 (causal with Lk < Lq) and 6-7 (no slice) allow no key.
    mask = Mask([AttnSlice(q=(0, 6), k=(0, 4), type="causal")], 8, 5)
    q = torch.randn(8, 2, 4, requires_grad=True)
    k = torch.randn(5, 1, 4, requires_grad=True)
    v = torch.randn(5, 1, 4, requires_grad=True)
    sink = None if num_sinks is None else torch.randn(num_sinks, 2, requires_grad=True)
    out, meta = reference_attention(q, k, v, mask, sink=sink, _block_q=3, _block_k=2)
    empty = torch.tensor([0, 1, 6, 7])
    assert torch.equal(out[empty], torch.zeros(4, 2, 4))
    if sink is None:
        assert torch.isneginf(meta.lse[empty]).all()
    else:
        assert torch.allclose(meta.lse[empty], torch.logsumexp(sink.detach(), 0).expand(4, 2))
    (out.sum() + torch.where(torch.isfinite(meta.lse), meta.lse, 0.0).sum()).backward()
    for x in (q, k, v) + (() if sink is None else (sink,)):
        assert x.grad is not None and torch.isfinite(x.grad).all()
    assert torch.equal(q.grad[empty], torch.zeros(4, 2, 4))


def test_empty_mask() -> None:
    mask = Mask([], 3, 4)
    q = torch.randn(3, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(4, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(4, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    out, meta = reference_attention(q, k, v, mask, return_max_logits=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(meta.lse).all() and torch.isneginf(meta.max_logits).all()
    assert not meta.max_logits.requires_grad
    out.float().sum().backward()
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x))


def test_meta_and_defaults() -> None:
    mask = Mask([AttnSlice(q=(0, 4), k=(0, 4))], 4, 4)
    q = torch.randn(4, 2, 4)
    out, meta = reference_attention(q, q, q, mask)
    assert isinstance(meta, AttentionMeta) and meta.max_logits is None
    assert out.shape == q.shape and meta.lse.shape == (4, 2) and meta.lse.dtype == torch.float32
    expected, _, _ = naive_attention(q.double(), q.double(), q.double(), mask.to_dense(), 0.5, 0.0, None)
    assert_close(out, expected, 1e-5)


def test_never_builds_the_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Mask) -> torch.Tensor:
        raise AssertionError("reference_attention must not call Mask.to_dense")

    monkeypatch.setattr(Mask, "to_dense", refuse)
    mask = Mask([AttnSlice(q=(0, 16), k=(0, 16), type="causal")], 16, 16)
    q = torch.randn(16, 2, 4, requires_grad=True)
    out, _ = reference_attention(q, q, q, mask, _block_q=4, _block_k=4)
    out.sum().backward()


def test_tiles_skip_empty_blocks_and_drop_full_block_masks() -> None:
    mask = Mask([AttnSlice(q=(0, 8), k=(0, 8), type="causal"), AttnSlice(q=(8, 16), k=(8, 16))], 16, 16)
    cfg = _Config(mask, 1.0, 0.0, block_q=4, block_k=4, want_max_logits=False)
    layout = [
        (t.q0, [(kt.k0, kt.allowed is None) for kt in t.ktiles]) for t in _tiles(cfg, torch.device("cpu"))
    ]
    assert layout == [
        (0, [(0, False)]),
        (4, [(0, True), (4, False)]),
        (8, [(8, True), (12, True)]),
        (12, [(8, True), (12, True)]),
    ]


def _valid() -> dict:
    mask = Mask([AttnSlice(q=(0, 4), k=(0, 6), type="causal")], 4, 6)
    return {
        "q": torch.randn(4, 4, 8),
        "k": torch.randn(6, 2, 8),
        "v": torch.randn(6, 2, 8),
        "mask": mask,
    }


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"q": torch.randn(4, 8)}, ValueError, "q must have shape"),
        ({"q": [[1.0]]}, TypeError, "q must be a torch.Tensor"),
        ({"q": torch.randn(5, 4, 8)}, ValueError, "do not match the mask"),
        ({"k": torch.randn(5, 2, 8), "v": torch.randn(5, 2, 8)}, ValueError, "do not match the mask"),
        ({"k": torch.randn(6, 3, 8), "v": torch.randn(6, 3, 8)}, ValueError, "multiple of kv heads"),
        ({"v": torch.randn(6, 1, 8)}, ValueError, "same keys and heads"),
        ({"k": torch.randn(6, 2, 4), "v": torch.randn(6, 2, 4)}, ValueError, "head_dim"),
        ({"k": torch.randn(6, 2, 8, dtype=torch.float64)}, TypeError, "share a dtype"),
        ({"k": torch.randn(6, 2, 8, device="meta")}, ValueError, "share a device"),
        (
            {
                "q": torch.ones(4, 4, 8, dtype=torch.int32),
                "k": torch.ones(6, 2, 8, dtype=torch.int32),
                "v": torch.ones(6, 2, 8, dtype=torch.int32),
            },
            TypeError,
            "unsupported dtype",
        ),
        ({"mask": torch.ones(4, 6, dtype=torch.bool)}, TypeError, "mask must be a maskc Mask"),
        ({"sink": torch.randn(2, 3)}, ValueError, "sink must have shape"),
        ({"sink": torch.randn(4)}, ValueError, "sink must have shape"),
        ({"sink": torch.randn(1, 4, dtype=torch.bfloat16)}, TypeError, "sink dtype"),
        ({"sink": torch.randn(1, 4, dtype=torch.float64)}, TypeError, "sink dtype"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"softmax_scale": math.inf}, ValueError, "softmax_scale"),
        ({"softmax_scale": 0.0}, ValueError, "softmax_scale must be a finite number > 0"),
        ({"softmax_scale": -0.125}, ValueError, "softmax_scale must be a finite number > 0"),
        ({"softmax_scale": "0.125"}, TypeError, "softmax_scale must be a number, got str"),
        ({"softcap": "1"}, TypeError, "softcap must be a number, got str"),
        ({"_block_q": 0}, ValueError, "block sizes"),
    ],
)
def test_rejects_bad_input(change: dict, error: type[Exception], match: str) -> None:
    args = _valid() | change
    with pytest.raises(error, match=match):
        reference_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("mask"), **args)


def test_functional_forward_and_backward_over_split_keys_give_the_whole_attention() -> None:
    """What maskc.dist's stages rely on: attending to two parts of the keys separately, merging
    by lse, and running each part's backward against the merged output and lse gives the whole
    attention's output, lse and gradients (softcap, sinks, an lse gradient included)."""
    from maskc.dist.execute import _merge
    from maskc.reference import reference_backward, reference_forward

    torch.manual_seed(0)
    tq, tk, split = 70, 90, 45
    first = [AttnSlice((0, 70), (0, 40), "causal")]
    second = [AttnSlice((10, 30), (50, 90), "full"), AttnSlice((40, 70), (60, 80), "inv_causal")]
    mask = Mask(first + second, tq, tk)
    q, k, v = (torch.randn(t, h, 8, dtype=torch.float64) for t, h in ((tq, 4), (tk, 2), (tk, 2)))
    sink = torch.randn(2, 4, dtype=torch.float64)
    dout, dlse = torch.randn(tq, 4, 8, dtype=torch.float64), torch.randn(tq, 4, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    ref, meta = reference_attention(*leaves[:3], mask, sink=leaves[3], softcap=3.0)
    ((ref * dout).sum() + (torch.where(torch.isfinite(meta.lse), meta.lse, 0.0) * dlse).sum()).backward()

    shifted = [AttnSlice(a.q, (a.k[0] - split, a.k[1] - split), a.type) for a in second]
    parts = [Mask(first, tq, split), Mask(shifted, tq, tk - split)]
    keys = [slice(0, split), slice(split, tk)]
    outs = [reference_forward(q, k[s], v[s], m, softcap=3.0, sink=sink if i == 0 else None)
            for i, (s, m) in enumerate(zip(keys, parts))]  # fmt: skip
    out, lse = _merge([o[0] for o in outs], [o[1] for o in outs])
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, meta.lse.detach())
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, (s, m) in enumerate(zip(keys, parts)):
        dq_i, dk[s], dv[s], dsink = reference_backward(q, k[s], v[s], out, lse, dout, dlse, m, softcap=3.0,
                                                       sink=sink if i == 0 else None)  # fmt: skip
        dq += dq_i
        if i == 0:
            torch.testing.assert_close(dsink, leaves[3].grad, rtol=1e-10, atol=1e-10)
    for ours, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(ours, leaf.grad, rtol=1e-10, atol=1e-10)
