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
    #: Bytes the kernel may assume its data pointer is aligned to; None: 16 for the bf16/fp16
    #: inputs (TMA), the element size otherwise. The runtime checks it on every call.
    align: int | None = None

    @property
    def alignment(self) -> int:
        return self.align if self.align is not None else 16 if self.dtype == "input" else 4

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
            out.append(
                {"kind": "tensor", "name": arg.name, "dtype": arg.dtype, "shape": list(arg.shape), "align": arg.alignment}
            )
        elif isinstance(arg, ScalarArg):
            out.append({"kind": "scalar", "name": arg.name, "dtype": arg.dtype})
        else:
            out.append({"kind": "stream", "name": arg.name})
    return out

BACKWARD_ABI: tuple[Arg, ...] = (
    TensorArg("q", "input", ("Tq", "Hq", "D")),
    TensorArg("k", "input", ("Tk", "Hkv", "D")),
    TensorArg("v", "input", ("Tk", "Hkv", "D")),
    TensorArg("out", "input", ("Tq", "Hq", "D")),
    TensorArg("dout", "input", ("Tq", "Hq", "D")),
    TensorArg("lse", "float32", ("Tq", "Hq")),
    TensorArg("dlse", "float32", ("DL", "Hq")),
    TensorArg("lse_log2", "float32", ("QP",), align=16),
    TensorArg("delta", "float32", ("QP",), align=16),
    TensorArg("dq_accum", "float32", ("Tq8", "Hq", "D"), align=16),
    TensorArg("dk", "input", ("Tk", "Hkv", "D")),
    TensorArg("dv", "input", ("Tk", "Hkv", "D")),
    TensorArg("dq_semaphore", "int32", ("QS",)),
    TensorArg("work_blocks", "int32", ("WB",)),
    TensorArg("block_rank", "int32", ("B",)),
    TensorArg("dkv_accum", "float32", ("KA",), align=16),
    TensorArg("dkv_count", "int32", ("KC",)),
    TensorArg("items", "int32", ("I", 5)),
    TensorArg("cta_items", "int32", ("G1",)),
    *SCHEDULE_AND_LAUNCH,
)
"""`attn_bwd`'s arguments: the backward schedule (`build_backward_schedule`: work items are k
tiles, runs are q blocks, lines have keys as rows). `out` and `lse` are the forward's, `dlse`
the gradient of lse (DL = Tq) or empty (DL = 0). A preprocess kernel launched first writes the
per-query statistics head-major and padded to whole q blocks (QP = Hq * ceil(Tq / tile_m) *
tile_m; the main kernel loads a block's with one TMA copy) into the caller's scratch buffers:
`lse_log2` = lse * log2(e), +inf for padding and rows with no key (P = 0); `delta` =
rowsum(dO * O) - dlse in float32, 0 for padding. dK/dV are owned per (k tile, kv head) and
summed over the kv head's query heads; dQ (times the softmax scale) is added to `dq_accum` in
fp32 by TMA reductions (zeroed by the caller; Tq8 = Tq rounded up to a multiple of 8: the
kernel adds whole 8-row groups, rows >= Tq unused). Deterministic variants order those additions:
`dq_semaphore` [Hq * ceil(Tq / tile_m) * 2] counts the additions landed per (head, q block,
warpgroup) (zeroed by the caller), and `work_blocks` / `block_rank` come from
`build_deterministic_backward_schedule`; other variants never read the three (one element each).
CTA c of the `num_ctas` runs items[cta_items[c]:cta_items[c+1]], rows (work, K/V head, flags:
1 to walk each q block's query heads innermost, 2 to walk the q blocks first to last; query
head within the K/V head, -1 for all; split slot, -1 for none) (`maskc.ir.items`). The pieces
of a split item (one per query head) add dK / dV into `dkv_accum` (KA = slots * 2 * tile_n *
D, per slot and 64-key warpgroup block [2, 64, D]) and count themselves in `dkv_count` (KC =
slots * tile_n / 64), both zeroed by the caller (one element each when there is no slot)."""

ABIS: dict[str, tuple[Arg, ...]] = {"fwd": FORWARD_ABI, "bwd": BACKWARD_ABI}
"""The ABI of each kernel direction."""
