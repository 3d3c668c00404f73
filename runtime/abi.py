"""The kernels' argument ABI: one definition the compiler and the runtime both read.

codegen builds its fake tensors from these specs and records them in the manifest; the
runtime packs its ctypes argument structs from the same specs. An exported CuTe-DSL
function takes `void **args`: one pointer per argument, in order, then one to an int32
return code. A tensor argument points to `{void *data; int32_t dynamic_shapes[k];}` — the
extents of its dynamic dims in order (every tensor here is compact row-major with only
leading dims dynamic, so no stride is dynamic) — a scalar to its value, the stream to a
`cudaStream_t`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

# Dims named by the variant are compile-time constants; every other named dim is dynamic.
STATIC_DIMS = ("Hq", "Hkv", "D")


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: Literal["input", "float32", "int32"]  # "input": the variant's bf16/fp16
    shape: tuple[Union[str, int], ...]

    def dynamic_dims(self) -> tuple[int, ...]:
        """Positions of the dims whose extent is passed at run time."""
        return tuple(i for i, d in enumerate(self.shape) if isinstance(d, str) and d not in STATIC_DIMS)


@dataclass(frozen=True)
class ScalarArg:
    name: str
    dtype: Literal["float32", "int32"]


@dataclass(frozen=True)
class StreamArg:
    name: str = "stream"


Arg = Union[TensorArg, ScalarArg, StreamArg]

SCHEDULE_AND_LAUNCH: tuple[Arg, ...] = (
    TensorArg("work_tile", "int32", ("W",)),
    TensorArg("work_ranges", "int32", ("W1",)),
    TensorArg("ranges", "int32", ("R", 3)),
    TensorArg("work_lines", "int32", ("W1",)),
    TensorArg("lines", "int32", ("L", 6)),
    ScalarArg("softmax_scale", "float32"),
    ScalarArg("softcap", "float32"),
    ScalarArg("num_ctas", "int32"),
    StreamArg(),
)
"""The tail every kernel shares: its tile schedule (maskc/ir/schedule.py) and launch scalars."""

FORWARD_ABI: tuple[Arg, ...] = (
    TensorArg("q", "input", ("Tq", "Hq", "D")),
    TensorArg("k", "input", ("Tk", "Hkv", "D")),
    TensorArg("v", "input", ("Tk", "Hkv", "D")),
    TensorArg("out", "input", ("Tq", "Hq", "D")),
    TensorArg("lse", "float32", ("Tq", "Hq")),
    TensorArg("row_max", "float32", ("Tq", "Hq")),
    TensorArg("sink", "float32", ("S", "Hq")),
    *SCHEDULE_AND_LAUNCH,
)
"""`attn_fwd`'s arguments, in order (see maskc/ir/schedule.py for the schedule tensors)."""


def abi_to_json(abi: tuple[Arg, ...]) -> list[dict]:
    """The manifest's record of an ABI, so a runtime can refuse objects built for another."""
    out = []
    for arg in abi:
        if isinstance(arg, TensorArg):
            out.append({"kind": "tensor", "name": arg.name, "dtype": arg.dtype, "shape": list(arg.shape)})
        elif isinstance(arg, ScalarArg):
            out.append({"kind": "scalar", "name": arg.name, "dtype": arg.dtype})
        else:
            out.append({"kind": "stream", "name": arg.name})
    return out

BACKWARD_ABI: tuple[Arg, ...] = (
    TensorArg("q", "input", ("Tq", "Hq", "D")),
    TensorArg("k", "input", ("Tk", "Hkv", "D")),
    TensorArg("v", "input", ("Tk", "Hkv", "D")),
    TensorArg("dout", "input", ("Tq", "Hq", "D")),
    TensorArg("lse", "float32", ("Tq", "Hq")),
    TensorArg("delta", "float32", ("Tq", "Hq")),
    TensorArg("dq_accum", "float32", ("Tq", "Hq", "D")),
    TensorArg("dk", "input", ("Tk", "Hkv", "D")),
    TensorArg("dv", "input", ("Tk", "Hkv", "D")),
    *SCHEDULE_AND_LAUNCH,
)
"""`attn_bwd`'s arguments: the backward schedule (`build_backward_schedule`: work items are k
tiles, runs are q blocks, lines have keys as rows); `delta` = rowsum(dO * O) - dlse; dK/dV are
owned per (k tile, kv head) and summed over the kv head's query heads; dQ is accumulated in fp32
(zeroed by the caller)."""

ABIS: dict[str, tuple[Arg, ...]] = {"fwd": FORWARD_ABI, "bwd": BACKWARD_ABI}
"""The ABI of each kernel direction."""
