"""`maskc.attention`: masked attention on the GPU through compiled maskc kernels.

Kernels come from artifact directories (`register_artifact`) or, when the compiler stack
is installed, are compiled on first use into the content-addressed cache (JIT). A kernel
is found by its *request* — arch, head dim, dtype, head counts, feature flags — the fields
a call determines; the tile shape it was built with comes from its manifest entry and
decides the schedule the runtime builds for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from maskc.codegen.variant import WARPGROUP_ROWS
from maskc.errors import ArtifactError, MaskcError
from maskc.ir import Mask
from maskc.ir.schedule import build_backward_schedule, build_deterministic_backward_schedule, build_schedule
from maskc.ir.strategy import SUPPORTED_HEAD_DIMS, pack_gqa_supported, select_pack_gqa, select_tiles
from maskc.reference import AttentionMeta, check_attention_args
from maskc.runtime.abi import ABIS, abi_to_json
from maskc.runtime.launch import Kernel, find_runtime_library, installed_dsl_version, installed_library, runtime_at
from maskc.runtime.manifest import read_manifest

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
LOG2_E = math.log2(math.e)
ARCHS = {(9, 0): "sm_90a"}
REQUEST_FIELDS = (
    "arch", "direction", "head_dim", "dtype", "num_heads_q", "num_heads_kv", "has_softcap", "has_sink", "has_max_logits",
    "pack_gqa", "deterministic",
)
_OPTIONAL_FIELDS = ("pack_gqa", "deterministic")  # False where a request or manifest leaves them out


def _request_key(fields: dict[str, Any]) -> tuple:
    return tuple(fields.get(f, False) if f in _OPTIONAL_FIELDS else fields[f] for f in REQUEST_FIELDS)


class _Entry:
    """A loaded kernel and the tile shape its schedule needs: tile_m is in query tokens (with
    PackGQA, the kernel's TILE_M packed rows hold TILE_M / G tokens), and items_per_tile the
    work items of each q tile (query heads, or K/V heads with PackGQA)."""

    def __init__(self, kernel: Kernel, tile_m: int, tile_n: int, items_per_tile: int, deterministic: bool = False):
        self.kernel, self.tile_m, self.tile_n, self.items_per_tile = kernel, tile_m, tile_n, items_per_tile
        self.deterministic = deterministic


def _entry(kernel: Kernel, fields: dict[str, Any]) -> _Entry:
    hq, hkv = fields["num_heads_q"], fields["num_heads_kv"]
    if fields["direction"] == "bwd":  # items are (k tile, kv head); tile_m is the q block
        return _Entry(kernel, fields["tile_m"], fields["tile_n"], hkv, fields.get("deterministic", False))
    if fields.get("pack_gqa", False):
        return _Entry(kernel, fields["tile_m"] // (hq // hkv), fields["tile_n"], hkv)
    return _Entry(kernel, fields["tile_m"], fields["tile_n"], hq)


def _pack_gqa(mask: Mask, request: dict[str, Any], num_sms: int) -> bool:
    """The GQA strategy for this call (maskc.ir.strategy.select_pack_gqa), cached in mask.memo."""
    hq, hkv = request["num_heads_q"], request["num_heads_kv"]
    if not pack_gqa_supported(hq, hkv):
        return False
    tiles = select_tiles(request["arch"], request["head_dim"])
    key = ("pack_gqa", hq, hkv, tiles.tile_m, tiles.tile_n, num_sms)
    cached = mask.memo.get(key)
    if cached is None:
        cached = mask.memo[key] = select_pack_gqa(mask, hq, hkv, tiles.tile_m, tiles.tile_n, num_sms)
    return cached


def _find_kernel(request: dict[str, Any], strategy_forced: bool) -> _Entry:
    """A registered kernel for `request`; else, unless the caller forced the GQA strategy, one
    of the other strategy (registered artifacts win over compiling); else compile `request`."""
    entry = _KERNELS.get(_request_key(request))
    if entry is None and not strategy_forced:
        entry = _KERNELS.get(_request_key({**request, "pack_gqa": not request["pack_gqa"]}))
    return entry or _jit(request)


_KERNELS: dict[tuple, _Entry] = {}


def register_artifact(directory: str | Path) -> list[str]:
    """Verify an artifact directory and make its kernels available to `maskc.attention`."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    variants = manifest.get("variants", [])
    if not variants:
        return []
    for v in variants:
        abi = ABIS.get(v.get("fields", {}).get("direction", "fwd"))
        if abi is None or v.get("abi") != abi_to_json(abi):
            raise ArtifactError(f"kernel {v.get('key')!r} in {directory} was built for another argument ABI: recompile")
        if v.get("object") not in manifest["files"]:
            raise ArtifactError(f"kernel {v.get('key')!r} in {directory} has no hashed object file")
    library = find_runtime_library(directory)
    _check_runtime_version(manifest, library, directory)
    runtime = runtime_at(library)
    for v in variants:
        kernel = Kernel(runtime, (directory / v["object"]).read_bytes(), v["function"], ABIS[v["fields"]["direction"]])
        _KERNELS[_request_key(v["fields"])] = _entry(kernel, v["fields"])
    return [v["key"] for v in variants]


def _check_runtime_version(manifest: dict[str, Any], library: Path, directory: Path) -> None:
    """Objects run on the runtime library of the DSL release that built them. A library shipped
    with the artifacts (or named by $MASKC_CUTE_RUNTIME) is the user's choice; the installed
    wheel's is checked against the release recorded in the manifest."""
    built = manifest.get("toolchain", {}).get("nvidia-cutlass-dsl")
    if built is None or library != installed_library():
        return
    installed = installed_dsl_version()
    if installed != built:
        raise ArtifactError(
            f"kernels in {directory} were built with nvidia-cutlass-dsl {built}, but the runtime library "
            f"found is nvidia-cutlass-dsl {installed}'s: recompile, or ship the runtime with `maskc compile --bundle-runtime`"
        )


def _jit(request: dict[str, Any]) -> _Entry:
    """Compile (or fetch from the cache) the kernel for `request`; needs the compiler stack."""
    try:
        from maskc.codegen.jit import compile_request
    except ImportError as exc:
        raise ArtifactError(
            f"no compiled maskc kernel for {request} and the compiler is not installed ({exc}); "
            "build one with `maskc compile` and pass its directory to maskc.runtime.register_artifact"
        ) from None
    register_artifact(compile_request(request))
    return _KERNELS[_request_key(request)]


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    sink: torch.Tensor | None,
    softmax_scale: float | None,
    softcap: float,
) -> float:
    """What the kernels need beyond the shared contract (CUDA, bf16/fp16, contiguous, a head
    dim with a kernel), then the contract itself; returns the effective softmax scale."""
    named = [("q", q), ("k", k), ("v", v)] + ([("sink", sink)] if sink is not None else [])
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type != "cuda":
            raise ValueError(f"maskc.attention runs on CUDA tensors; {name} is on {x.device} (use maskc.reference_attention on CPU)")
        if name != "sink" and x.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; maskc kernels take bfloat16 or float16")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    scale = check_attention_args(q, k, v, mask, softmax_scale=softmax_scale, softcap=softcap, sink=sink)
    if q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise MaskcError(f"head_dim {q.shape[2]} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")
    return scale


def _schedule_tensors(mask: Mask, build: Callable, tile_m: int, tile_n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A schedule on the device, built once per (mask, direction, tile, device): masks are immutable."""
    key = (build.__name__, tile_m, tile_n, device)
    cached = mask.memo.get(key)
    if cached is None:
        s = build(mask, tile_m, tile_n)
        names = ("work_tile", "work_ranges", "ranges", "work_lines", "lines", "work_blocks", "block_rank")
        cached = {n: _device_int32(a, device) for n, a in zip(names, s.arrays())}
        mask.memo[key] = cached
    return cached


def _device_int32(array, device: torch.device) -> torch.Tensor:
    """A schedule array on the device; an empty one gets a zero row (never read) so it has an address."""
    t = torch.from_numpy(array)
    if t.shape[0] == 0:
        t = torch.zeros((1, *t.shape[1:]), dtype=torch.int32)
    return t.to(device)


@dataclass(frozen=True, eq=False)
class _Call:
    """Everything of one attention call but its tensors, shared by forward and backward."""

    mask: Mask
    scale: float
    softcap: float
    num_sms: int
    forward: _Entry
    backward: _Entry | None
    return_max_logits: bool


def _launch(entry: _Entry, build: Callable, call: _Call, tensors: dict, device: torch.device) -> None:
    schedule = _schedule_tensors(call.mask, build, entry.tile_m, entry.tile_n, device)
    scalars = {
        "softmax_scale": call.scale,
        "softcap": call.softcap,
        "num_ctas": min(call.num_sms, max(1, schedule["work_tile"].shape[0] * entry.items_per_tile)),
    }
    entry.kernel({**tensors, **schedule}, scalars, torch.cuda.current_stream(device).cuda_stream)


def _forward(q, k, v, sink, call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tq, hq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=q.device)
    row_max = torch.empty(tq, hq, dtype=torch.float32, device=q.device) if call.return_max_logits else lse
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "row_max": row_max}
    tensors["sink"] = sink if sink is not None else lse[:1]
    _launch(call.forward, build_schedule, call, tensors, q.device)
    return out, lse, row_max


def _padded_head_major(x: torch.Tensor, tile_m: int, fill: float) -> torch.Tensor:
    """[Tq, Hq] -> [Hq * ceil(Tq / tile_m) * tile_m]: the backward kernel's layout of per-query
    statistics (one TMA copy per q block), padded with `fill`."""
    tq, hq = x.shape
    out = x.new_full((hq, -(-tq // tile_m) * tile_m), fill)
    out[:, :tq] = x.t()
    return out.view(-1)


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor, budget: int = 1 << 26) -> torch.Tensor:
    """[Tq, Hq] float32 sum over the head dim of a * b, computed in float32 a slab of rows at a
    time so the float32 copies stay within `budget` bytes whatever the sequence length."""
    tq, hq, d = a.shape
    rows = max(1, budget // (8 * hq * d))
    out = torch.empty(tq, hq, dtype=torch.float32, device=a.device)
    for start in range(0, tq, rows):
        part = slice(start, start + rows)
        torch.sum(a[part].float() * b[part].float(), dim=-1, out=out[part])
    return out


def _backward(q, k, v, out, lse, sink, dout, dlse, call: _Call):
    """dq, dk, dv from the backward kernel; dsink from its closed form (the sinks join the
    softmax with no value: d sink = -sum over rows of P_sink * (rowsum(dO * O) - dlse))."""
    delta = _rowwise_dot(dout, out)
    if dlse is not None:
        delta = delta - dlse
    # Rows with no key (lse = -inf) and the padding get lse = +inf, so P = 0 there.
    lse_log2 = torch.where(lse == -math.inf, math.inf, lse * LOG2_E)
    entry = call.backward
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    tensors = {"q": q, "k": k, "v": v, "dout": dout.contiguous(), "dq_accum": dq_accum, "dk": dk, "dv": dv,
               "lse_log2": _padded_head_major(lse_log2, entry.tile_m, math.inf),
               "delta": _padded_head_major(delta, entry.tile_m, 0.0)}  # fmt: skip
    if entry.deterministic:  # one counter per (head, q block, consumer warpgroup)
        semaphores = q.shape[1] * -(-q.shape[0] // entry.tile_m) * (entry.tile_n // WARPGROUP_ROWS)
        tensors["dq_semaphore"] = torch.zeros(semaphores, dtype=torch.int32, device=q.device)
        _launch(entry, build_deterministic_backward_schedule, call, tensors, q.device)
    else:
        unused = torch.zeros(1, dtype=torch.int32, device=q.device)
        tensors.update(dq_semaphore=unused, work_blocks=unused, block_rank=unused)
        _launch(entry, build_backward_schedule, call, tensors, q.device)
    dsink = None
    if sink is not None:
        dsink = -(torch.exp(sink[None] - lse[:, None, :]) * delta[:, None, :]).sum(dim=0)
    return dq_accum.to(q.dtype), dk, dv, dsink


class _Attention(torch.autograd.Function):
    """Saves q, k, v, out, lse (and the sinks); the backward kernel recomputes the rest."""

    @staticmethod
    def forward(ctx: Any, q, k, v, sink, call: _Call):  # type: ignore[override]
        out, lse, row_max = _forward(q, k, v, sink, call)
        if row_max is lse:  # no max logits asked for: a distinct output, so lse stays differentiable
            row_max = lse.new_empty(0)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.call = call
        ctx.mark_non_differentiable(row_max)
        return out, lse, row_max

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout, dlse, _drow_max):  # type: ignore[override]
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = _backward(q, k, v, out, lse, sink, dout, dlse, ctx.call)
        return dq, dk, dv, dsink, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, AttentionMeta]:
    """Masked attention with maskc's kernels; the same contract as `maskc.reference_attention`,
    differentiable in q, k, v and sink (the gradient flows through lse too).

    pack_gqa: the GQA strategy. None (default) lets maskc.ir.strategy.select_pack_gqa decide
    from the mask and the head counts (PackGQA packs the G = Hq / Hkv query heads of a K/V
    head into one M tile); True / False force it (True needs G a power of two in [2, 64]).
    deterministic: the backward adds each q block's dQ contributions in a fixed order, so the
    gradients are bitwise identical from run to run (a little slower).
    """
    scale = _check_inputs(q, k, v, mask, sink, softmax_scale, softcap)
    capability, num_sms = _device_info(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if capability not in ARCHS:
        raise MaskcError(f"no maskc kernel for compute capability {capability}; supported: {sorted(ARCHS)}")
    tq, hq, d = q.shape
    base = {"arch": ARCHS[capability], "head_dim": d, "dtype": DTYPES[q.dtype], "num_heads_q": hq,
            "num_heads_kv": k.shape[1], "has_softcap": softcap > 0}  # fmt: skip
    request = {**base, "direction": "fwd", "has_sink": sink is not None, "has_max_logits": return_max_logits}
    if pack_gqa is None:
        request["pack_gqa"] = _pack_gqa(mask, request, num_sms)
    else:
        if pack_gqa and not pack_gqa_supported(hq, k.shape[1]):
            raise MaskcError(f"pack_gqa needs Hq / Hkv a power of two in [2, 64]; got {hq} / {k.shape[1]}")
        request["pack_gqa"] = bool(pack_gqa)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sink))
    backward = None
    if needs_grad:
        backward_request = {**base, "direction": "bwd", "has_sink": False, "has_max_logits": False, "pack_gqa": False,
                            "deterministic": bool(deterministic)}  # fmt: skip
        backward = _find_kernel(backward_request, strategy_forced=True)
    call = _Call(mask, scale, float(softcap), num_sms, _find_kernel(request, strategy_forced=pack_gqa is not None),
                 backward, return_max_logits)  # fmt: skip
    if needs_grad:
        out, lse, row_max = _Attention.apply(q, k, v, sink, call)
    else:
        out, lse, row_max = _forward(q, k, v, sink, call)
    max_logits = row_max.amax(dim=0) if return_max_logits else None
    return out, AttentionMeta(lse=lse, max_logits=max_logits)


@lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, multiprocessor count) of a GPU, asked once per process."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count
