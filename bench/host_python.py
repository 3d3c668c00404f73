"""maskc's own host time per call, on any machine: the Python that `maskc.attention` runs for a
CUDA call, with the GPU stubbed out.

    python bench/host_python.py [--calls 3000] [--rounds 5] [--profile fwd|grad|fwd+bwd]

The CPU stands in for the GPU: the inputs are CPU tensors of 8 tokens (so no arithmetic counts)
that take the CUDA path (`ops.attn_fwd_cuda`, `ops.backward_cuda`: the checks, the plan lookups,
the outputs and buffers, the argument slots), and every kernel is a launcher whose runtime call
returns at once (on the GPU machine the runtime library's call, which encodes the TMA descriptors
and launches, adds about 5 us a kernel; `bench/host_profile.py` measures that there). Beside it, a
trivial `torch.autograd.Function` with maskc's signature that only allocates its outputs and
gradients: what autograd's own plumbing costs any Python op, the floor under maskc's figure.
maskc is also timed inside a function compiled by `torch.compile` (fullgraph, the aot_eager
backend): the path of a compiled model, through the custom ops and the dispatcher.

It prints the median microseconds a call over `--rounds` batches of `--calls`, for the forward
under no_grad, the forward with inputs that need gradients, and a forward + backward (the
backward on the calling thread: there is no device thread on the CPU); `--profile` adds a
cProfile of one of them. A profile, not a benchmark: it writes no rows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import maskc
from maskc.artifact.abi import ENTRY_POINTS
from maskc.artifact.variant import variant_for
from maskc.runtime import call_plan, launch, ops, registry

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import timed  # noqa: E402
from report import markdown_table  # noqa: E402

TOKENS, HQ, HKV, D = 8, 8, 1, 128
SM90 = ((9, 0), 132)


class _NoRuntime:
    """A runtime library whose every launch returns at once."""

    lib = type("Lib", (), {"CuteDSLRT_Function_Run": staticmethod(lambda fn, args, nargs: 0)})()

    def function(self, object_bytes: bytes, prefix: str) -> None:
        return None


def _stub_kernel(request: Mapping[str, Any], alternative: Mapping[str, Any] | None = None) -> registry.Entry:
    """The registered entry of `request`, made on first use: its family's tile, a stubbed launcher."""
    key = registry.request_key(request)
    if key not in registry.KERNELS:
        variant = variant_for(request)
        abi = ENTRY_POINTS[request["direction"]].args
        fields = {**request, "tile_m": variant.tile_m, "tile_n": variant.tile_n, "num_stages": variant.num_stages}
        registry.KERNELS[key] = registry.entry_for(lambda: launch.Kernel(_NoRuntime(), b"", "stub", abi), fields)
    return registry.KERNELS[key]


def stubbed_gpu() -> ExitStack:
    """A context in which CPU calls of `maskc.attention` run the CUDA path on a stubbed SM90 GPU."""
    stack = ExitStack()
    for target, name, value in (
        (call_plan, "device_info", lambda device: SM90),
        (ops, "_stream", lambda device: 0),
        (torch.cuda, "is_current_stream_capturing", lambda: False),
        (ops, "attn_fwd_cpu", ops.attn_fwd_cuda),
        (ops, "attn_bwd_cpu", ops.attn_bwd_cuda),
        (registry, "find_kernel", _stub_kernel),
        (registry, "LOADED", []),
    ):
        stack.enter_context(mock.patch.object(target, name, value))
    stack.enter_context(mock.patch.dict(registry.KERNELS, clear=True))  # only the stubs, none registered before
    return stack


class _Trivial(torch.autograd.Function):
    """maskc's autograd signature with nothing behind it: its outputs and gradients allocated."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        q, k, v, sink, table, prepared, padding, *_ = inputs
        out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)
        row_max, lse_log2 = q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, None, None, sink, table, prepared, padding)
        ctx.mark_non_differentiable(row_max, lse_log2)
        ctx.set_materialize_grads(False)
        return out, lse, row_max, lse_log2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor, *_: Any) -> tuple:  # type: ignore[override]
        q, k, v, *_ = ctx.saved_tensors
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) + (None,) * 9


def passes() -> dict[str, dict[str, Callable[[], None]]]:
    """Per library (maskc eager; maskc in a function compiled by torch.compile, fullgraph, with
    the aot_eager backend, which calls the custom ops; the trivial Function), its three passes
    on the same leaves."""
    mask = maskc.Mask.from_cu_seqlens([0, TOKENS], causal=True)
    q, k, v = (torch.randn(TOKENS, h, D, dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV))
    grad = torch.randn(TOKENS, HQ, D, dtype=torch.bfloat16)
    scale = D**-0.5
    compiled = torch.compile(lambda q, k, v, mask: maskc.attention(q, k, v, mask)[0], backend="aot_eager", fullgraph=True)
    calls = {
        "maskc": lambda: maskc.attention(q, k, v, mask)[0],
        "maskc, torch.compile": lambda: compiled(q, k, v, mask),
        "trivial Function": lambda: _Trivial.apply(q, k, v, None, mask.table, None, None, scale, 0.0, False, True, [])[0],
    }

    def forward(call: Callable[[], torch.Tensor]) -> None:
        with torch.no_grad():
            call()

    def forward_backward(call: Callable[[], torch.Tensor]) -> None:
        q.grad = k.grad = v.grad = None
        call().backward(grad)

    return {impl: {"fwd": lambda c=call: forward(c), "grad": call, "fwd+bwd": lambda c=call: forward_backward(c)}
            for impl, call in calls.items()}  # fmt: skip


def median_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Median microseconds a call over `rounds` batches of `calls`, after a batch of warm-up."""

    def batch() -> None:
        for _ in range(calls):
            fn()

    median_ms, _, _ = timed(batch, rounds)
    return median_ms * 1e3 / calls


def host_python(calls: int, rounds: int, profile: str | None = None) -> list[str]:
    """The table of every library and pass (and a cProfile of maskc's `profile` pass)."""
    header = ["library", "forward, no_grad (us)", "forward, with gradients (us)", "forward + backward (us)"]
    with stubbed_gpu():
        runs = passes()
        rows = [[impl, *(f"{median_us(fn, calls, rounds):.1f}" for fn in by_pass.values())] for impl, by_pass in runs.items()]
        lines = markdown_table(header, rows, [1, 2, 3])
        if profile is not None:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                runs["maskc"][profile]()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            lines += ["", f"cProfile of {calls} maskc calls ({profile}), by own time:", text.getvalue()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls a batch")
    parser.add_argument("--rounds", type=int, default=5, help="batches per pass")
    parser.add_argument("--profile", choices=("fwd", "grad", "fwd+bwd"), help="also cProfile this pass of maskc")
    args = parser.parse_args()
    print("\n".join(host_python(args.calls, args.rounds, args.profile)))


if __name__ == "__main__":
    main()
