"""Reference attention: the exact, blockwise oracle every generated kernel is tested against.

It walks the mask in (q block x k block) tiles with an online softmax, so long sequences never
materialise a full score matrix or dense mask, and it recomputes the tiles in backward instead of
storing probabilities. Half inputs are computed in float32 and float64 inputs in float64, which
keeps the float64 path exact enough to check kernels and this module itself against.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from maskc.ir import Mask

BLOCK_Q = 512
"""Query rows per tile: bounds the per-tile mask rows ([BLOCK_Q, seqlen_k] bools) and scores."""

BLOCK_K = 1024
"""Key columns per tile; tiles with no allowed element are skipped entirely."""

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionMeta:
    """Side outputs of attention.

    lse: [Tq, Hq] natural-log softmax denominator (float32, float64 for float64 inputs);
        -inf for rows with no allowed key and no sink.
    max_logits: [Hq] float32 max final logit per head (-inf if the head sees nothing),
        or None when not requested.
    """

    lse: torch.Tensor
    max_logits: torch.Tensor | None


@dataclass(frozen=True)
class _Config:
    """Everything but the tensors, shared by forward and backward."""

    mask: Mask
    scale: float
    softcap: float
    block_q: int
    block_k: int
    want_max_logits: bool


@dataclass(frozen=True)
class _KTile:
    """Key columns [k0, k1) of a query tile; allowed is None when every element is allowed."""

    k0: int
    k1: int
    allowed: torch.Tensor | None


@dataclass(frozen=True)
class _QTile:
    """Query rows [q0, q1) and the key tiles that hold at least one allowed element."""

    q0: int
    q1: int
    ktiles: tuple[_KTile, ...]


def _tiles(cfg: _Config, device: torch.device) -> Iterator[_QTile]:
    """Yield the non-empty tiles, reading only block_q mask rows at a time."""
    mask = cfg.mask
    for q0 in range(0, mask.seqlen_q, cfg.block_q):
        q1 = min(q0 + cfg.block_q, mask.seqlen_q)
        rows = mask.dense_rows(q0, q1)
        col_any, col_all = rows.any(dim=0), rows.all(dim=0)
        ktiles = []
        for k0 in range(0, mask.seqlen_k, cfg.block_k):
            k1 = min(k0 + cfg.block_k, mask.seqlen_k)
            if not bool(col_any[k0:k1].any()):
                continue
            allowed = None if bool(col_all[k0:k1].all()) else rows[:, k0:k1].to(device)
            ktiles.append(_KTile(k0, k1, allowed))
        yield _QTile(q0, q1, tuple(ktiles))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[R, Hq, ...] -> [Hkv, G, R, ...]: each kv head against its group, without repeating k/v."""
    return x.unflatten(1, (hkv, -1)).movedim(0, 2)


def _unheads(x: torch.Tensor) -> torch.Tensor:
    """Inverse of _heads: [Hkv, G, R, ...] -> [R, Hq, ...]."""
    return x.movedim(2, 0).flatten(1, 2)


def _kv(x: torch.Tensor, kt: _KTile) -> torch.Tensor:
    """Key/value rows of a tile as [Hkv, 1, C, D], broadcasting over the group dimension."""
    return x[kt.k0 : kt.k1].movedim(0, 1).unsqueeze(1)


def _scaled_queries(q: torch.Tensor, tile: _QTile, hkv: int, cfg: _Config) -> torch.Tensor:
    """softmax_scale * q of a tile as [Hkv, G, R, D]: scaling R x D once beats scaling every R x C tile."""
    return _heads(q[tile.q0 : tile.q1].to(_compute_dtype(q.dtype)) * cfg.scale, hkv)


def _logits(qh: torch.Tensor, kh: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """Softcapped, unmasked logits [Hkv, G, R, C] of scaled queries; backward needs them unmasked for tanh'."""
    s = torch.matmul(qh, kh.transpose(-1, -2))
    if cfg.softcap > 0:
        s = torch.tanh(s / cfg.softcap) * cfg.softcap
    return s


def _masked(s: torch.Tensor, kt: _KTile) -> torch.Tensor:
    """Disallowed logits become -inf, so they vanish from max, exp and sums alike."""
    return s if kt.allowed is None else s.masked_fill(~kt.allowed, -math.inf)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """Replace -inf maxima/lse by 0 so exp(-inf - x) stays 0 instead of NaN on empty rows."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


def _sinks(sink: torch.Tensor | None, hq: int, ct: torch.dtype, device: torch.device) -> torch.Tensor:
    """Sinks [S, Hq] in the compute dtype; no sink is S = 0, so one code path serves both."""
    if sink is None:
        return torch.empty((0, hq), dtype=ct, device=device)
    return sink.to(ct)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None, cfg: _Config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ct = _compute_dtype(q.dtype)
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    kc, vc = k.to(ct), v.to(ct)
    out = torch.empty((tq, hq, v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((tq, hq), dtype=ct, device=q.device)
    max_logits = torch.full((hkv, hq // hkv), -math.inf, dtype=ct, device=q.device)
    # The sinks act as one value-less key whose logit is their logsumexp (-inf without sinks).
    sink_lse = _heads(torch.logsumexp(_sinks(sink, hq, ct, q.device), dim=0).unsqueeze(0), hkv)
    for tile in _tiles(cfg, q.device):
        qh = _scaled_queries(q, tile, hkv, cfg)
        m = sink_lse.expand(*qh.shape[:-1]).clone()
        den = (m > -math.inf).to(ct)
        acc = qh.new_zeros(*qh.shape[:-1], v.shape[-1])
        for kt in tile.ktiles:
            s = _masked(_logits(qh, _kv(kc, kt), cfg), kt)
            if cfg.want_max_logits:
                max_logits = torch.maximum(max_logits, s.amax(dim=(-1, -2)))
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = _finite_or_zero(m_new)
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()
            alpha = torch.exp(m - m_safe)
            den = den * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, _kv(vc, kt))
            m = m_new
        lse[tile.q0 : tile.q1] = _unheads(_finite_or_zero(m) + torch.log(den))
        out_t = acc / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1)
        out[tile.q0 : tile.q1] = _unheads(out_t).to(q.dtype)
    return out, lse, max_logits.flatten().to(torch.float32)


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sink: torch.Tensor | None,
    dout: torch.Tensor,
    dlse: torch.Tensor,
    cfg: _Config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Recompute P = exp(s - lse) per tile; dS = P * (dP - (rowsum(dO*O) - dlse))."""
    ct = _compute_dtype(q.dtype)
    hkv = k.shape[1]
    kc, vc = k.to(ct), v.to(ct)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=k.device)
    dv = torch.zeros(v.shape, dtype=ct, device=v.device)
    sinks = _sinks(sink, q.shape[1], ct, q.device)
    dsink = torch.zeros_like(sinks)
    for tile in _tiles(cfg, q.device):
        rows = slice(tile.q0, tile.q1)
        do_t = dout[rows].to(ct)
        lse_t = _finite_or_zero(lse[rows])
        # d(loss)/d(logit) = P * (dP - delta) for keys and sinks alike, with dP = 0 for sinks.
        delta = (do_t * out[rows].to(ct)).sum(dim=-1) - dlse[rows].to(ct)  # [R, Hq]
        p_sink = torch.exp(sinks.unsqueeze(0) - lse_t.unsqueeze(1))  # [R, S, Hq]
        dsink -= (p_sink * delta.unsqueeze(1)).sum(dim=0)
        if not tile.ktiles:
            continue
        qh = _scaled_queries(q, tile, hkv, cfg)
        doh = _heads(do_t, hkv)
        lse_h = _heads(lse_t, hkv).unsqueeze(-1)
        delta_h = _heads(delta, hkv).unsqueeze(-1)
        dqh = torch.zeros_like(qh)
        for kt in tile.ktiles:
            kh, vh = _kv(kc, kt), _kv(vc, kt)
            s = _logits(qh, kh, cfg)
            p = torch.exp(_masked(s, kt) - lse_h)
            ds = p * (torch.matmul(doh, vh.transpose(-1, -2)) - delta_h)
            if cfg.softcap > 0:
                ds = ds * (1 - (s / cfg.softcap) ** 2)
            dqh += torch.matmul(ds, kh)
            dk[kt.k0 : kt.k1] += torch.matmul(ds.transpose(-1, -2), qh).sum(dim=1).movedim(0, 1)
            dv[kt.k0 : kt.k1] += torch.matmul(p.transpose(-1, -2), doh).sum(dim=1).movedim(0, 1)
        dq[rows] = _unheads(dqh) * cfg.scale
    dsink_out = None if sink is None else dsink.to(sink.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink_out


class _Attention(torch.autograd.Function):
    """Saves only q, k, v, sink, out and lse; backward recomputes the tiles."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink: torch.Tensor | None,
        cfg: _Config,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse, max_logits = _forward(q, k, v, sink, cfg)
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(max_logits)
        return out, lse, max_logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, dlse: torch.Tensor, _dmax: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sink, out, lse = ctx.saved_tensors
        dq, dk, dv, dsink = _backward(q, k, v, out, lse, sink, dout, dlse, ctx.cfg)
        return dq, dk, dv, dsink, None


def _check_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    softmax_scale: float | None,
    softcap: float,
    sink: torch.Tensor | None,
) -> float:
    """Check the arguments against the attention contract every implementation shares
    (`check_attention_tensors`, and the mask's lengths); return the effective softmax scale."""
    scale = check_attention_tensors(q, k, v, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    check_mask_lengths(q, k, mask)
    return scale


def check_mask_lengths(q: torch.Tensor, k: torch.Tensor, mask: Mask) -> None:
    """The mask is a Mask over q's and k's sequence lengths."""
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a maskc Mask, got {type(mask).__name__}")
    if q.shape[0] != mask.seqlen_q or k.shape[0] != mask.seqlen_k:
        raise ValueError(
            f"q/k sequence lengths ({q.shape[0]}, {k.shape[0]}) do not match the mask ({mask.seqlen_q}, {mask.seqlen_k})"
        )


def check_attention_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None,
    softcap: float,
    sink: torch.Tensor | None,
) -> float:
    """Check the tensors and scalars of a call (shapes, dtypes, devices, heads, sink, softcap,
    scale), not its mask; return the effective softmax scale."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape [seqlen, heads, head_dim], got {tuple(x.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {q.dtype}; expected one of {_SUPPORTED_DTYPES}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same keys and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    _, hq, d = q.shape
    _, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"q head_dim {d} != k head_dim {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if sink is not None:
        _check_tensor("sink", sink)
        allowed_sink = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if sink.dtype not in allowed_sink:
            raise TypeError(f"sink dtype must be one of {allowed_sink}, got {sink.dtype}")
        if sink.ndim != 2 or sink.shape[1] != hq:
            raise ValueError(f"sink must have shape [num_sinks, {hq}], got {tuple(sink.shape)}")
        if sink.device != q.device:
            raise ValueError(f"sink is on {sink.device} but q is on {q.device}")
    for name, value in (("softcap", softcap), ("softmax_scale", 1.0 if softmax_scale is None else softmax_scale)):
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymInt, torch.SymFloat)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    # Comparisons rather than math.isfinite, which torch.compile cannot trace (NaN fails both).
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not 0 < scale < math.inf:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    return scale


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    _block_q: int = BLOCK_Q,
    _block_k: int = BLOCK_K,
) -> tuple[torch.Tensor, AttentionMeta]:
    """Masked (GQA) attention, differentiable in q, k, v and sink; the oracle for kernels.

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] (Dv = D but in MLA-style models) with
    Hq % Hkv == 0, out [Tq, Hq, Dv]; logits are softmax_scale * q.k (softmax_scale > 0,
    default 1/sqrt(D)), softcapped as c * tanh(s / c) when softcap > 0. sink [S, Hq] holds raw
    logits that join every row's denominator without a value. Rows without an allowed key give
    out = 0 and lse = -inf (logsumexp of the sinks with a sink). _block_q/_block_k size the
    tiles; tests shrink them to exercise the multi-tile paths.
    """
    if _block_q <= 0 or _block_k <= 0:
        raise ValueError(f"block sizes must be positive, got ({_block_q}, {_block_k})")
    scale = check_attention_args(q, k, v, mask, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    cfg = _Config(mask, scale, float(softcap), _block_q, _block_k, return_max_logits)
    out, lse, max_logits = _Attention.apply(q, k, v, sink, cfg)
    return out, AttentionMeta(lse=lse, max_logits=max_logits if return_max_logits else None)


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, max_logits or None) of `reference_attention`, with no autograd: the
    reference side of `maskc.runtime.api.attention_forward`."""
    scale = check_attention_args(q, k, v, mask, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    cfg = _Config(mask, scale, float(softcap), BLOCK_Q, BLOCK_K, return_max_logits)
    with torch.no_grad():
        out, lse, max_logits = _forward(q, k, v, sink, cfg)
    return out, lse, max_logits if return_max_logits else None


def reference_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dsink or None) over `mask` given the forward's `out` and `lse`, which may
    come from a larger softmax (the lse of all keys and the merged output make one part of the
    keys' gradients exact): the reference side of `attention_backward`."""
    scale = check_attention_args(q, k, v, mask, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    cfg = _Config(mask, scale, float(softcap), BLOCK_Q, BLOCK_K, False)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    with torch.no_grad():
        return _backward(q, k, v, out, lse, sink, dout, dlse, cfg)

