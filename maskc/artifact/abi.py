"""The kernels' argument ABI: one definition the compiler and the runtime both read.

codegen builds its fake tensors from these specs, records them in the manifest and renders
them as the kernels' signatures (templates/common/abi.jinja: parameter names, annotations and
comments all come from here); the runtime packs its ctypes argument structs from the same
specs. An exported CuTe-DSL function takes `void **args`: one pointer per argument, in order,
then one to an int32 return code. A tensor argument points to `{void *data; int32_t
dynamic_shapes[k];}` — the extents of its dynamic dims in order (every tensor here is compact
row-major with only leading dims dynamic, so no stride is dynamic) — a scalar to its value,
the stream to a `cudaStream_t`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from maskc.artifact.variant import KernelVariant

# Dims named by the variant are compile-time constants; every other named dim is dynamic.
STATIC_DIMS = ("Hq", "Hkv", "D", "Dv")
#: How a signature's comments show a dim whose name cannot say it.
_SHOWN_DIMS = {"W1": "W+1", "G1": "G+1", "DL": "0 or Tq"}
_SHOWN_DTYPES = {"input": "DTYPE", "float32": "fp32", "int32": "int32"}
_UNUSED = "not used by this variant"
#: The counters at the front of the backward's `dkv_count`: the CTAs' pace (steps counted, CTAs
#: done; KernelVariant.bwd_paced), ahead of the split items' piece counters.
PACE_COUNTERS = 2


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: Literal["input", "float32", "int32"]  # "input": the variant's bf16/fp16
    shape: tuple[str | int, ...]
    #: The kernel function's parameter.
    param: str
    #: Bytes the kernel may assume its data pointer is aligned to; None: 16 for the bf16/fp16
    #: inputs (TMA), the element size otherwise. The runtime checks it on every call.
    align: int | None = None
    doc: str = ""
    #: The KernelVariant flag without which the kernel never reads or writes it.
    used_when: str | None = None
    #: The caller passes it zeroed (the kernel adds into it): part of the binary interface,
    #: since a kernel that adds into a buffer the runtime does not zero writes garbage.
    zeroed: bool = False

    @property
    def alignment(self) -> int:
        return self.align if self.align is not None else 16 if self.dtype == "input" else 4

    def dynamic_dims(self) -> tuple[int, ...]:
        """Positions of the dims whose extent is passed at run time."""
        return tuple(i for i, d in enumerate(self.shape) if isinstance(d, str) and d not in STATIC_DIMS)

    @property
    def annotation(self) -> str:
        return "cute.Tensor"

    def comment(self, variant: KernelVariant) -> str:
        """The argument's comment in the signature of `variant`'s kernel."""
        shape = ", ".join(_SHOWN_DIMS.get(d, str(d)) for d in self.shape)
        doc = f"{self.doc} (zero)" if self.zeroed else self.doc
        return _comment(f"[{shape}] {_SHOWN_DTYPES[self.dtype]}", doc, self.used_when, variant)


@dataclass(frozen=True)
class ScalarArg:
    name: str
    dtype: Literal["float32", "int32"]
    doc: str = ""
    used_when: str | None = None

    @property
    def param(self) -> str:
        return self.name

    @property
    def annotation(self) -> str:
        return {"float32": "Float32", "int32": "Int32"}[self.dtype]

    def comment(self, variant: KernelVariant) -> str:
        return _comment("", self.doc, self.used_when, variant)


@dataclass(frozen=True)
class StreamArg:
    name: str = "stream"

    @property
    def param(self) -> str:
        return self.name

    @property
    def annotation(self) -> str:
        return "cuda.CUstream"

    def comment(self, variant: KernelVariant) -> str:
        return ""


def _comment(described: str, doc: str, used_when: str | None, variant: KernelVariant) -> str:
    if used_when is not None and not getattr(variant, used_when):
        return f"{described} ({_UNUSED})" if described else _UNUSED
    if described and doc:
        return f"{described}: {doc}"
    return described or doc


Arg = TensorArg | ScalarArg | StreamArg


def _schedule_and_launch(tile: str, runs: str, lines: str, keys: str, *bounds: TensorArg) -> tuple[Arg, ...]:
    """The tail every kernel shares: its tile schedule (maskc/ir/schedule.py; `tile`, `runs`,
    `lines` and `keys` say what a work item, a run, a line and a key bound are in this
    direction, `bounds` follow the key bounds) and launch scalars."""
    return (
        TensorArg("work_tile", "int32", ("W",), param="mWorkTile", doc=f"{tile} of each work item"),
        TensorArg("work_ranges", "int32", ("W1",), param="mWorkRanges", doc="CSR offsets into mRanges"),
        TensorArg("ranges", "int32", ("R", 4), param="mRanges", doc=runs),
        TensorArg("work_lines", "int32", ("W1",), param="mWorkLines", doc="CSR offsets into mLines"),
        TensorArg("lines", "int32", ("L", 6), param="mLines", doc=lines),
        TensorArg("key_bounds", "int32", ("NK1",), param="mKeyBounds", doc=keys, used_when="document_tiles"),
        *bounds,
        ScalarArg("softmax_scale", "float32"),
        ScalarArg("softcap", "float32", doc="c of s = c * tanh(scale * qk / c)", used_when="has_softcap"),
        ScalarArg("num_ctas", "int32", doc="persistent grid size"),
        StreamArg(),
    )


FORWARD_ABI: tuple[Arg, ...] = (
    TensorArg("q", "input", ("Tq", "Hq", "D"), param="mQ"),
    TensorArg("k", "input", ("Tk", "Hkv", "D"), param="mK"),
    TensorArg("v", "input", ("Tk", "Hkv", "Dv"), param="mV"),
    TensorArg("out", "input", ("Tq", "Hq", "Dv"), param="mO", doc="written"),
    TensorArg("lse", "float32", ("Tq", "Hq"), param="mLSE", doc="written (natural log; -inf for rows with no key)"),
    TensorArg("lse_log2", "float32", ("QP",), align=16, param="mLSE2",
              doc="written unless empty: the backward's lse_log2 rows below Tq"),
    TensorArg("row_max", "float32", ("Tq", "Hq"), param="mRowMax", doc="written", used_when="has_max_logits"),
    TensorArg("sink", "float32", ("S", "Hq"), param="mSink", used_when="has_sink"),
    *_schedule_and_launch("q tile", "(n_begin, n_end, partial, first key)", "(r0, r1, lo_a, lo_s, hi_a, hi_s)",
                          "k block n is keys [key_bounds[n], key_bounds[n + 1])",
                          TensorArg("query_bounds", "int32", ("NQ1",), param="mQueryBounds", used_when="document_rows",
                                    doc="q tile m is queries [query_bounds[m], query_bounds[m + 1])")),
)  # fmt: skip
"""`attn_fwd`'s arguments, in order (see maskc/ir/schedule.py for the schedule tensors). With
`document_rows` a q tile's box is the tile_m queries from its first, and only its own rows
reach `out` and `lse` (a document's last tile is shorter than tile_m). Where
`lse_log2` has rows the forward also writes lse in the units the backward's kernels load it in
(BACKWARD_ABI), head-major, QP / Hq rows a head, for a backward that then needs no lse."""

BACKWARD_ABI: tuple[Arg, ...] = (
    TensorArg("q", "input", ("Tq", "Hq", "D"), param="mQ"),
    TensorArg("k", "input", ("Tk", "Hkv", "D"), param="mK"),
    TensorArg("v", "input", ("Tk", "Hkv", "Dv"), param="mV"),
    TensorArg("out", "input", ("Tq", "Hq", "Dv"), param="mO", doc="the forward's output"),
    TensorArg("dout", "input", ("Tq", "Hq", "Dv"), param="mdO"),
    TensorArg("lse", "float32", ("Tq", "Hq"), param="mLSEf", doc="the forward's lse, or empty"),
    TensorArg("dlse", "float32", ("DL", "Hq"), param="mdLSE", doc="the gradient of lse, if any"),
    TensorArg("lse_log2", "float32", ("QP",), align=16, param="mLSE",
              doc="lse * log2(e) per head (SM90: - log2(scale)), padded (+inf: P = 0); the preprocess writes it"),
    TensorArg("delta", "float32", ("QP",), align=16, param="mDelta",
              doc="written by the preprocess: rowsum(dO * O) - dlse per head, padded to q blocks"),
    TensorArg("dq_accum", "float32", ("Tq8", "Hq", "D"), align=16, param="mdQ", doc="scale * dS K added",
              zeroed=True),
    TensorArg("dk", "input", ("Tk", "Hkv", "D"), param="mdK", doc="written"),
    TensorArg("dv", "input", ("Tk", "Hkv", "Dv"), param="mdV", doc="written"),
    TensorArg("dq_semaphore", "int32", ("QS",), param="mSemaphore",
              doc="dQ additions landed per (head, q block, warpgroup)", used_when="deterministic", zeroed=True),
    TensorArg("work_blocks", "int32", ("WB",), param="mWorkBlocks", doc="CSR offsets into mBlockRank",
              used_when="deterministic"),
    TensorArg("block_rank", "int32", ("B",), param="mBlockRank", doc="lower k tiles adding to the same q block",
              used_when="deterministic"),
    TensorArg("dkv_accum", "float32", ("KA",), align=16, param="mdKVAccum",
              doc="per split slot, TILE_K x (HEAD_DIM + HEAD_DIM_V) dK / dV sums by warpgroup", zeroed=True),
    TensorArg("dkv_count", "int32", ("KC",), param="mdKVCount",
              doc="the CTAs' pace (PACE_COUNTERS), then pieces done per split slot and warpgroup", zeroed=True),
    TensorArg("query_bounds", "int32", ("NQ1",), param="mQueryBounds", used_when="document_tiles",
              doc="q block m is queries [query_bounds[m], query_bounds[m + 1])"),
    TensorArg("items", "int32", ("I", 6), param="mItems",
              doc="(work, K/V head, flags, first q head, q heads, slot) items by CTA (maskc.ir.items)"),
    TensorArg("cta_items", "int32", ("G1",), param="mCtaItems", doc="CSR offsets of each CTA's items"),
    *_schedule_and_launch("k tile", "(m_begin, m_end, partial, first query) q blocks",
                          "(r0, r1, lo_a, lo_s, hi_a, hi_s), rows keys, columns queries",
                          "k tile n is keys [key_bounds[n], key_bounds[n + 1])"),
)  # fmt: skip
"""`attn_bwd`'s arguments: the backward schedule (`build_backward_schedule`: work items are k
tiles, runs are q blocks, lines have keys as rows). `out` and `lse` are the forward's, `dlse`
the gradient of lse (DL = Tq) or empty (DL = 0). A preprocess kernel launched first writes the
per-query statistics head-major and padded to whole q blocks (QP = Hq * ceil(Tq / tile_m) *
tile_m; the main kernel loads a block's with one TMA copy) into the caller's scratch buffers:
`lse_log2` = lse * log2(e), +inf for padding and rows with no key (P = 0), on SM90 minus
log2(softmax scale), so that P, dS and the products of dS come out scaled; `delta` =
rowsum(dO * O) - dlse in float32, 0 for padding. With `lse` empty (no rows), `lse_log2`
holds the forward's rows below Tq already (its FORWARD_ABI output) and the preprocess writes
only the padding. dK/dV are owned per (k tile, kv head) and
summed over the kv head's query heads (with `document_tiles`, SM90: k tile n is keys
[key_bounds[n], key_bounds[n + 1]), a document's last tile shorter than tile_n, whose own rows
of dK/dV alone are written; q block m is queries [query_bounds[m], query_bounds[m +
1]), its box the tile_m queries from the first, so a document's last block adds zeros to the
next one's rows); dQ (times the softmax scale) is added to `dq_accum` in fp32 by TMA
reductions (zeroed by the caller; Tq8 = Tq rounded up to a multiple of 8, rows >= Tq unused:
the kernel adds whole 8-row groups counted from each q block's first row, and the rows of a
last, partial group by atomics). Deterministic
variants order those additions:
`dq_semaphore` [Hq * ceil(Tq / tile_m) * 2] counts the additions landed per (head, q block,
warpgroup) (zeroed by the caller), and `work_blocks` / `block_rank` come from
`build_deterministic_backward_schedule`; other variants never read the three (one element each).
CTA c of the `num_ctas` runs items[cta_items[c]:cta_items[c+1]], rows (work, K/V head, flags:
1 to walk each q block's query heads innermost, 2 to walk the q blocks first to last; the first
of its query heads within the K/V head's, and how many, -1 for all; split slot, -1 for none)
(`maskc.ir.items`). The pieces of a split item (a few query heads each) add dK / dV into
`dkv_accum` (KA = slots * tile_n * (D + Dv): per slot, each consumer warpgroup's dK and dV in
the kernel's own order; empty when there is no slot) and count their query heads in
`dkv_count` after its PACE_COUNTERS first counters (KC = PACE_COUNTERS + slots * tile_n / 64),
both zero on entry; the piece that counts an item's last query heads clears its slot and
counter. The first counters pace the CTAs of the SM90 kernels that keep pace
(`KernelVariant.bwd_paced`): each counts its steps on the first, its end on the second, and
the last CTA to end clears both. So both are zero again when the kernel ends and the caller
can keep them for the next launch on the stream."""


@dataclass(frozen=True)
class EntryPoint:
    """An exported kernel function: its name (also the C symbol prefix of its object) and arguments."""

    name: str
    args: tuple[Arg, ...]


ENTRY_POINTS: dict[str, EntryPoint] = {"fwd": EntryPoint("attn_fwd", FORWARD_ABI), "bwd": EntryPoint("attn_bwd", BACKWARD_ABI)}
"""The entry point of each kernel direction."""


def abi_to_json(abi: tuple[Arg, ...]) -> list[dict]:
    """The manifest's record of an ABI (names, kinds, dtypes, shapes, alignments, the buffers
    passed zeroed: what the binary interface is made of), so a runtime can refuse objects built
    for another."""
    out = []
    for arg in abi:
        if isinstance(arg, TensorArg):
            record = {"kind": "tensor", "name": arg.name, "dtype": arg.dtype, "shape": list(arg.shape), "align": arg.alignment}
            out.append({**record, "zeroed": True} if arg.zeroed else record)
        elif isinstance(arg, ScalarArg):
            out.append({"kind": "scalar", "name": arg.name, "dtype": arg.dtype})
        else:
            out.append({"kind": "stream", "name": arg.name})
    return out
