"""The kernel families: which kernels maskc has, for which GPUs, in what shapes, with what options.

This table is the one place these facts are written. `KernelVariant` validates against it, a
compile takes its tile shapes from it, the renderer picks a family's templates by it, the
runtime chooses between the GPU's own kernels and the portable ones with it, `maskc compile`
offers its archs, head dims and dtypes, and docs/support.md's tables are generated from it
(`support_table`; tests/test_kernel_families.py checks the committed copy).

Tile shapes were measured on an H200 (heads 64:8, bf16, 8k-16k tokens): at d=128, 128x128 tiles
with two K/V stages (two consumer warpgroups) reach 600-690 TFLOP/s on full and causal masks,
while 128x176 spills registers and drops to about 420; at d=64, 192x128 (three consumer
warpgroups) beats 128x128 by about 15% on full masks, and at d=96 (P through shared memory)
128x160 by 3-10% (docs/design/tile-shapes.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from maskc.errors import VariantError

#: Shared memory a CTA has on the archs whose kernels take `Kernel.compact_tiles`.
COMPACT_SMEM = 99 * 1024

#: Environment variable that opts a process into the experimental portable kernels (PORTABLE_NEXT).
PORTABLE_NEXT_ENV = "MASKC_PORTABLE_NEXT"

#: Rows of the query tile owned by one consumer warpgroup (one wgmma M extent); the backward's
#: per-warpgroup counters (dQ semaphores, split-item counts) count in blocks of as many keys.
WARPGROUP_ROWS = 64


@dataclass(frozen=True)
class Arch:
    """A compile target (the DSL's --gpu-arch and `maskc compile --arch`)."""

    name: str
    #: The CUDA compute capability of its GPUs, which the runtime maps back to this arch.
    capability: tuple[int, int]
    #: Shared memory one CTA may use.
    smem_bytes: int
    #: Shared memory of one SM, which the CTAs resident on it share (each also gives 1 KiB to
    #: the system): with `smem_bytes`, how many CTAs of a kernel an SM holds.
    sm_smem_bytes: int
    #: Example GPUs, for the docs.
    gpus: str
    #: maskc's GPU test suite has run on one of its GPUs.
    tested: bool = False


ARCHS: tuple[Arch, ...] = (
    Arch("sm_80", (8, 0), 163 * 1024, 164 * 1024, "A100, A800"),
    Arch("sm_86", (8, 6), 99 * 1024, 100 * 1024, "A10, A40, RTX 30xx"),
    Arch("sm_89", (8, 9), 99 * 1024, 100 * 1024, "L4, L40S, RTX 40xx"),
    Arch("sm_90a", (9, 0), 227 * 1024, 228 * 1024, "H100, H200, GH200", tested=True),
    Arch("sm_100a", (10, 0), 227 * 1024, 228 * 1024, "B200, GB200"),
    Arch("sm_120a", (12, 0), 99 * 1024, 128 * 1024, "RTX 50xx, RTX PRO 6000"),
)
ARCH_NAMES = tuple(a.name for a in ARCHS)


@dataclass(frozen=True)
class Dtype:
    """An input dtype, by the names each layer knows it by."""

    name: str
    torch: str  # torch.<torch>
    cutlass: str  # cutlass.<cutlass>


DTYPES: tuple[Dtype, ...] = (Dtype("bf16", "bfloat16", "BFloat16"), Dtype("fp16", "float16", "Float16"))
DTYPE_NAMES = tuple(d.name for d in DTYPES)

DIRECTIONS = ("fwd", "bwd")

#: The optional features a kernel may be specialised for: KernelVariant's flag -> the option's name.
FLAGS = {
    "has_softcap": "softcap",
    "has_sink": "sink",
    "has_max_logits": "max_logits",
    "pack_gqa": "pack_gqa",
    "deterministic": "deterministic",
    "unmasked": "unmasked",
}


@dataclass(frozen=True, order=True)
class HeadDim:
    """A kernel's head dims: `qk` of q and k, `v` of v (and so of the output). MLA-style models
    train with qk 192 and v 128; everywhere else they are equal."""

    qk: int
    v: int

    def __str__(self) -> str:
        return str(self.qk) if self.qk == self.v else f"{self.qk}/{self.v}"

    @classmethod
    def parse(cls, text: str) -> HeadDim:
        """`"128"` or `"192/128"` (qk/v), as the command line and messages write them."""
        qk, slash, v = text.strip().partition("/")
        if not qk.isdigit() or (slash and not v.isdigit()):
            raise ValueError(f"a head dim is an int or qk/v (like 192/128), got {text!r}")
        return cls(int(qk), int(v or qk))

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> HeadDim:
        """The head dims of a kernel's fields or a request: `head_dim`, and `head_dim_v` where
        given (manifests written before asymmetric head dims have none: square)."""
        return cls(fields["head_dim"], fields.get("head_dim_v") or fields["head_dim"])


def _square(*dims: int) -> tuple[HeadDim, ...]:
    return tuple(HeadDim(d, d) for d in dims)


#: The asymmetric head dims of MLA-style models (DeepSeek-V2/V3): q/k 192, v 128.
MLA = HeadDim(192, 128)


@dataclass(frozen=True)
class Tiles:
    """A kernel's tile shape (backward: tile_m is the q block, tile_n the k tile) and pipeline depth."""

    tile_m: int
    tile_n: int
    num_stages: int


@dataclass(frozen=True)
class TileChoices:
    """The tile shapes a kernel's templates are written for (its default ones among them): each
    extent one of these, and `fits` naming what a shape lacks (registers, mostly), or None."""

    tile_m: tuple[int, ...]
    tile_n: tuple[int, ...]
    num_stages: tuple[int, ...]
    fits: Callable[[HeadDim, Tiles], str | None] = lambda head_dim, tiles: None


@dataclass(frozen=True, eq=False)
class Kernel:
    """One direction of a kernel family."""

    #: The tile shape compiled for each head dim (the head dims the kernel supports).
    tiles: Mapping[HeadDim, Tiles]
    #: Its optional features (keys of FLAGS).
    flags: frozenset[str]
    #: Other tile shapes it accepts; None: only `tiles`.
    choices: TileChoices | None
    #: How it works, for the docs.
    summary: str
    #: A second, taller shape compiled for some head dims (more query rows a tile), which the
    #: runtime takes per mask where its estimate is faster (maskc.ir.strategy.select_forward).
    tall_tiles: Mapping[HeadDim, Tiles] = field(default_factory=dict)
    #: The tile shapes on archs with COMPACT_SMEM a CTA, where `tiles` would not fit; None: `tiles`
    #: fit every arch. A head dim left out has no kernel there.
    compact_tiles: Mapping[HeadDim, Tiles] | None = None
    #: Why head dims of the family's forward have none of this kernel, for the error that says so.
    missing: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiles", MappingProxyType(dict(self.tiles)))
        object.__setattr__(self, "tall_tiles", MappingProxyType(dict(self.tall_tiles)))
        if self.compact_tiles is not None:
            object.__setattr__(self, "compact_tiles", MappingProxyType(dict(self.compact_tiles)))
            assert self.compact_tiles.keys() <= self.tiles.keys() and not self.tall_tiles
        assert self.flags <= FLAGS.keys(), self.flags - FLAGS.keys()
        assert self.tall_tiles.keys() <= self.tiles.keys()

    @property
    def head_dims(self) -> tuple[HeadDim, ...]:
        return tuple(sorted(self.tiles))

    def arch_tiles(self, arch_name: str) -> Mapping[HeadDim, Tiles]:
        """The tile shape compiled for each head dim on `arch_name` (the head dims it has there)."""
        if self.compact_tiles is not None and arch(arch_name).smem_bytes <= COMPACT_SMEM:
            return self.compact_tiles
        return self.tiles


@dataclass(frozen=True, eq=False)
class KernelFamily:
    """Kernels written for one kind of GPU (or, portable, for every one since SM80)."""

    name: str
    #: How docs and messages name it.
    title: str
    #: The archs it compiles for.
    archs: tuple[str, ...]
    #: Its top-level templates: templates/attn_{direction}_{templates}.py.jinja.
    templates: str
    forward: Kernel
    backward: Kernel
    #: The portable kernels: every arch has them, and they are the only ones of an arch no other family serves.
    portable: bool = False
    #: Not yet a default anywhere: the manifest marks its kernels experimental and the runtime
    #: uses them only when asked.
    experimental: bool = False
    #: What running an experimental family on a GPU has shown so far (None: it has never run).
    gpu_checked: str | None = None
    #: Backward items may be split into pieces, one per query head of their K/V head.
    split_backward: bool = False
    #: The forward takes k blocks and the backward k tiles at any key, and the backward q
    #: blocks at any query but in the deterministic kernel (`maskc.ir.schedule.document_tiles`:
    #: each document's tokens in tiles of their own; the schedules' `key_bounds` and
    #: `query_bounds`; a document's last tile writes only its own rows of O, dK and dV); else
    #: all on the grid.
    document_tiles: bool = False
    dtypes: tuple[str, ...] = DTYPE_NAMES

    def __post_init__(self) -> None:
        assert self.backward.tiles.keys() <= self.forward.tiles.keys(), self.name
        assert set(self.archs) <= set(ARCH_NAMES), self.name

    @property
    def head_dims(self) -> tuple[HeadDim, ...]:
        """Every head dim it has a forward for (the backward's are among them)."""
        return self.forward.head_dims

    @property
    def selector(self) -> dict[str, bool]:
        """The request and variant fields that pick it among an arch's families."""
        return {"portable": self.portable, "portable_next": self is PORTABLE_NEXT}

    def kernel(self, direction: str) -> Kernel:
        return self.forward if direction == "fwd" else self.backward

    def has(self, direction: str, flag: str) -> bool:
        """Whether the `direction` kernel has the optional feature `flag` (a key of FLAGS)."""
        return flag in self.kernel(direction).flags


def sm90_p_in_smem(tile_m: int, head_dim_v: int) -> bool:
    """Whether the SM90 forward's P reaches O += P V through shared memory instead of as a
    register operand: with three consumer warpgroups (160 registers a thread) above head dim
    64, O, S and P of a warpgroup's 64 rows do not fit in registers together."""
    return tile_m > 128 and head_dim_v > 64


def _sm90_forward_fits(head_dim: HeadDim, tiles: Tiles) -> str | None:
    """O and S of a consumer warpgroup's 64 rows live in its registers, and with them the P of
    the block before (softmax overlaps the previous P V): about head_dim.v / 2 + 3 * tile_n / 4
    of a thread's registers, and more than 188 spills (at d=128, 128x176 measured about 420
    TFLOP/s against 600-690 for 128x128). Three warpgroups have 160 registers: O, S and P up to
    head dim 64; above it O and S alone (P in shared memory, `sm90_p_in_smem`), head_dim.v / 2 +
    tile_n / 2 of them, up to 128 (d=128 at 192x128 spills 88 bytes outside its block loop).
    Up to head dim 128 only: there the warpgroups take turns at the tensor cores, and that
    barrier orders every warp's P before the product that reads it."""
    if tiles.tile_m == 192:
        if head_dim.v > 128:
            return f"tile_m 192 (3 consumer warpgroups) needs head_dim <= 128, got {head_dim}"
        if sm90_p_in_smem(192, head_dim.v) and head_dim.v // 2 + tiles.tile_n // 2 > 128:
            return f"tile_m 192 (3 consumer warpgroups) with head_dim {head_dim} needs tile_n <= {256 - head_dim.v} (registers)"
        if not sm90_p_in_smem(192, head_dim.v) and tiles.tile_n > 128:
            return "tile_m 192 (3 consumer warpgroups) with head_dim <= 64 needs tile_n <= 128 (registers)"
    if head_dim.v // 2 + 3 * tiles.tile_n // 4 > 188:
        return f"tile_n {tiles.tile_n} with head_dim {head_dim} does not fit in registers"
    return None


def _sm90_backward_fits(head_dim: HeadDim, tiles: Tiles) -> str | None:
    """A 128-key tile keeps dK and dV of a warpgroup's 64 keys over every head dim in its
    registers, qk / 2 + v / 2 of a thread's: 128 at d=128. A 64-key tile gives each of the two
    warpgroups half of the head dims (backward_warpgroups). A 96-key tile gives each 48 keys with
    S's queries on the wgmma M axis: dK^T and dV^T of 48 keys over every head dim, 72 + 72
    registers at d=192. A 128-query block doubles S^T and dP^T (64 registers each), which leaves
    room for dK and dV only at d=64."""
    if tiles.tile_n == 128 and max(head_dim.qk, head_dim.v) > 128:
        return f"tile_n 128 needs head_dim <= 128 (dK and dV in registers); head_dim {head_dim} takes tile_n 64"
    if tiles.tile_n == 96 and (tiles.tile_m != 64 or not 128 < max(head_dim.qk, head_dim.v) <= 192):
        return (
            f"tile_n 96 needs tile_m 64 and a head dim above 128 up to 192 (dK^T and dV^T of 48 keys in "
            f"registers); head_dim {head_dim} with tile_m {tiles.tile_m} takes tile_n 64"
        )
    if tiles.tile_m == 128 and (tiles.tile_n != 128 or max(head_dim.qk, head_dim.v) > 64):
        return (
            f"tile_m 128 needs tile_n 128 and head_dim <= 64 (S^T and dP^T of 128 queries in registers); "
            f"head_dim {head_dim} with tile_n {tiles.tile_n} takes tile_m 64"
        )
    return None


def backward_warpgroups(tile_n: int) -> int:
    """Consumer warpgroups of an SM90 backward: one per 64 keys of its k tile, or two sharing a
    64-key tile by splitting the head dims. The runtime sizes every backward's per-warpgroup
    counters (dQ semaphores, split-item counts) by it; the portable and SM100 ones use the first."""
    return max(2, tile_n // WARPGROUP_ROWS)


SM90 = KernelFamily(
    name="sm90",
    title="SM90",
    archs=("sm_90a",),
    templates="sm90",
    forward=Kernel(
        # Key blocks sized per head dim: O, S and the previous P share the registers, and the
        # K / V stages the shared memory. Each shape won an A/B (docs/design/tile-shapes.md).
        tiles={HeadDim(64, 64): Tiles(192, 128, 2), HeadDim(96, 96): Tiles(192, 128, 2),
               HeadDim(128, 128): Tiles(128, 128, 2), MLA: Tiles(128, 128, 2), HeadDim(192, 192): Tiles(128, 96, 2),
               HeadDim(256, 256): Tiles(128, 80, 2)},  # fmt: skip
        # d=128 with three consumer warpgroups: 6-7% faster on full blocks, slower on masks
        # with many partial ones (tile-shapes.md).
        tall_tiles={HeadDim(128, 128): Tiles(192, 128, 2)},
        flags=frozenset({"has_softcap", "has_sink", "has_max_logits", "pack_gqa"}),
        # q tiles of 64 rows per consumer warpgroup (two or three), O in registers.
        choices=TileChoices(tile_m=(128, 192), tile_n=tuple(range(64, 193, 16)), num_stages=tuple(range(1, 9)),
                            fits=_sm90_forward_fits),  # fmt: skip
        summary=("TMA, wgmma, warp-specialised: a producer warpgroup and two or three consumer warpgroups; k blocks "
                 "start at each document"),
    ),
    backward=Kernel(
        # q blocks of 64 queries against k tiles of 128 keys (up to d=128: two consumer
        # warpgroups of 64 keys, dK and dV in registers), of 96 keys (d=192: 48 a warpgroup,
        # S with the queries on M, KernelVariant.bwd_query_rows) or of 64 keys (d=256: the two
        # warpgroups split the head dims); blocks alternate two dS buffers, so the Q stages come
        # in pairs. At d=64 the q blocks have 128 queries, dQ split by rows
        # (KernelVariant.bwd_dq_splits_rows). At d=192 dO gets one stage, at d=256 one and dQ is
        # staged in halves (KernelVariant.bwd_staging).
        tiles={HeadDim(64, 64): Tiles(128, 128, 2), **dict.fromkeys(_square(96, 128), Tiles(64, 128, 2)),
               HeadDim(192, 192): Tiles(64, 96, 2), MLA: Tiles(64, 96, 2), HeadDim(256, 256): Tiles(64, 64, 2)},  # fmt: skip
        flags=frozenset({"has_softcap", "deterministic", "unmasked"}),
        choices=TileChoices(tile_m=(64, 128), tile_n=(64, 96, 128), num_stages=(1, 2, 4, 6, 8), fits=_sm90_backward_fits),
        summary="TMA, wgmma, warp-specialised; k tiles and q blocks start at each document; long items split by query head",
    ),
    split_backward=True,
    document_tiles=True,
)

# Never run: no Blackwell GPU here. Forward: 128 query rows (one TMEM lane each) against 128-key
# blocks; K and V share the stages (P lives in tensor memory). Backward: k tiles of 128 keys
# (TMEM lanes) against q blocks of 128 queries, two (Q, dO) stages; dK, dV, S^T, dP^T / dQ fill
# the 512 TMEM columns at d=128.
SM100 = KernelFamily(
    name="sm100",
    title="SM100",
    archs=("sm_100a",),
    templates="sm100",
    forward=Kernel(
        tiles={HeadDim(64, 64): Tiles(128, 128, 4), HeadDim(128, 128): Tiles(128, 128, 3)},
        flags=frozenset({"has_softcap", "has_sink", "has_max_logits"}),
        choices=None,
        summary="tcgen05 MMA, S / O / P in tensor memory, TMA, warp-specialised",
    ),
    backward=Kernel(
        tiles=dict.fromkeys(_square(64, 128), Tiles(128, 128, 2)),
        flags=frozenset({"has_softcap", "deterministic"}),
        choices=None,
        summary="tcgen05 MMA, S^T / P^T / dP^T / dQ / dK / dV in tensor memory, TMA, warp-specialised",
    ),
    experimental=True,
)

# Four warps of 16 rows (query rows forward, keys backward). Forward: 64-key blocks at d=128
# (S and O in registers side by side), 128 at d=64. Backward: k tiles of 64 keys (dK and dV in
# registers) against q blocks of 64 queries, one (Q, dO) stage.
PORTABLE = KernelFamily(
    name="portable",
    title="portable",
    archs=ARCH_NAMES,
    templates="sm80",
    forward=Kernel(
        tiles={HeadDim(64, 64): Tiles(64, 128, 2), HeadDim(128, 128): Tiles(64, 64, 2)},
        flags=frozenset({"has_softcap", "has_sink", "has_max_logits"}),
        choices=TileChoices(tile_m=(64,), tile_n=(64, 128), num_stages=(2,)),
        summary="warp MMA, cp.async, ldmatrix",
    ),
    backward=Kernel(
        tiles=dict.fromkeys(_square(64, 128), Tiles(64, 64, 1)),
        flags=frozenset({"has_softcap", "deterministic"}),
        choices=None,
        summary="warp MMA, dQ by L2 reductions",
    ),
    portable=True,
)

# The portable kernels rewritten for speed, behind PORTABLE_NEXT_ENV until measured ahead of
# the verified ones.
# Forward: 32 query rows a warp, PackGQA, d=96 and d=256. Backward: FlashAttention-2's shape,
# eight warps of 16 keys (a 128-key k tile) against q blocks of 64 queries, two (Q, dO) stages:
# the next step's Q and dO load while this one computes.
PORTABLE_NEXT = KernelFamily(
    name="portable_next",
    title="portable next",
    gpu_checked=("the GPU suite's 118 portable-next cases passed on one H100 (`portable=True`), before the backward's rows "
                 "without branches and dQ grids, which no GPU has run; one speed measurement"),
    archs=ARCH_NAMES,
    templates="sm80",
    forward=Kernel(
        # 32 query rows a warp (two M extents share each K and V fragment; Q read from shared
        # memory a k step at a time) up to d=128: 128 x 128 at d=64, 128 x 64 at d=96, 128 x 32
        # at d=128 (O has 128 registers a thread there; 64 keys spill). d=256: 16 rows a warp
        # against 32-key blocks (two K/V stages fill 96 KiB, which every arch has).
        tiles={HeadDim(64, 64): Tiles(128, 128, 2), HeadDim(96, 96): Tiles(128, 64, 2),
               HeadDim(128, 128): Tiles(128, 32, 2), HeadDim(256, 256): Tiles(64, 32, 2)},  # fmt: skip
        flags=frozenset({"has_softcap", "has_sink", "has_max_logits", "pack_gqa"}),
        choices=TileChoices(tile_m=(64, 128), tile_n=(32, 64, 128), num_stages=(2,)),
        summary="warp MMA, cp.async, ldmatrix, 32 query rows a warp up to d=128",
    ),
    backward=Kernel(
        # d=256: two walks of an item's q blocks (dV, then dK and dQ: KernelVariant.
        # portable_bwd_two_walks) over 64-key tiles and 32-query blocks in two stages, 132 KiB
        # (ptxas, sm_80: no spill; 64-query blocks in one stage spill 4472 bytes).
        tiles={**dict.fromkeys(_square(64, 96, 128), Tiles(64, 128, 2)), HeadDim(256, 256): Tiles(32, 64, 2)},
        flags=frozenset({"has_softcap", "deterministic"}),
        choices=None,
        summary=("warp MMA, a warp per 16 keys of the k tile, the next step's Q and dO by cp.async during this one (two "
                 "stages), dQ by L2 reductions; d=256 walks each item twice (dV, then dK and dQ)"),
        # On 99 KiB: d=128's 144 KiB become 88 with 32-query blocks and one stage (ptxas, sm_86
        # and sm_89: no spill, where the verified 64-key tile spills 2600 bytes; sm_120a: 1584,
        # 1208); d=96's 112 KiB 80 with 64 keys (its dQ^T warp grid needs 64-query blocks). No
        # d=256: 64 keys x 32 queries in one stage need 100 KiB, 16-query blocks a dS^T layout
        # the templates lack, and 32-key tiles CTAs of two warps.
        compact_tiles={HeadDim(64, 64): Tiles(64, 128, 2), HeadDim(96, 96): Tiles(64, 64, 2),
                       HeadDim(128, 128): Tiles(32, 128, 1)},  # fmt: skip
    ),
    portable=True,
    experimental=True,
)

FAMILIES: tuple[KernelFamily, ...] = (SM90, SM100, PORTABLE, PORTABLE_NEXT)
HEAD_DIMS = tuple(sorted({d for f in FAMILIES for d in f.head_dims}))


def arch(name: str) -> Arch:
    for a in ARCHS:
        if a.name == name:
            return a
    raise VariantError(f"arch {name!r} is not supported; supported: {', '.join(ARCH_NAMES)}")


def arch_of_capability(capability: tuple[int, int]) -> Arch | None:
    """The arch of a GPU of this compute capability, or None where maskc has no kernel for it."""
    return next((a for a in ARCHS if a.capability == capability), None)


def portable_warps(direction: str, tile_m: int, tile_n: int) -> int:
    """Warps of a portable CTA: four in the forward (16 or 32 query rows each), one per 16 keys
    of the backward's k tile."""
    return 4 if direction == "fwd" else tile_n // 16


def native_family(arch_name: str) -> KernelFamily | None:
    """The family written for `arch_name` itself, or None where only the portable kernels serve it."""
    return next((f for f in FAMILIES if not f.portable and arch_name in f.archs), None)


def default_family(arch_name: str) -> KernelFamily:
    """The family the runtime uses on `arch_name` unless told otherwise: the arch's own where it
    has run, else the portable one."""
    native = native_family(arch_name)
    return native if native is not None and not native.experimental else PORTABLE


def family_of(arch_name: str, portable: bool = False, portable_next: bool = False) -> KernelFamily:
    """The family of a kernel for `arch_name`: the portable one (its experimental next kernels
    with `portable_next`), or the arch's own."""
    if portable:
        return PORTABLE_NEXT if portable_next else PORTABLE
    family = native_family(arch_name)
    if family is None:
        raise VariantError(f"arch {arch_name} has only the portable kernel (portable=True)")
    return family


def select_tiles(
    arch_name: str, head_dim: HeadDim, direction: str = "fwd", portable: bool = False, tall: bool = False,
    portable_next: bool = False,
) -> Tiles:
    """Tile shape of the `direction` kernel for `arch_name` and `head_dim` (backward: tile_m is
    the q block, tile_n the k tile), the arch's own kernel or the portable one (`portable_next`:
    its experimental next kernels); with `tall` its tall shape (`Kernel.tall_tiles`)."""
    if head_dim not in HEAD_DIMS:
        raise VariantError(f"head_dim {head_dim} is not supported; supported head dims: {_listed(HEAD_DIMS)}")
    if not portable and native_family(arch_name) is None:
        raise VariantError(f"no kernel of its own for arch {arch_name!r} ({_native_archs()} have them); use the portable kernel")
    family = family_of(arch_name, portable, portable_next)
    check_head_dim(family, direction, head_dim, arch_name)
    kernel = family.kernel(direction)
    if not tall:
        return kernel.arch_tiles(arch_name)[head_dim]
    if head_dim not in kernel.tall_tiles:
        raise VariantError(
            f"the {family.title} {'forward' if direction == 'fwd' else 'backward'} has no tall tile for head_dim {head_dim}"
            + (f"; it has one for {_listed(tuple(sorted(kernel.tall_tiles)))}" if kernel.tall_tiles else "")
        )
    return kernel.tall_tiles[head_dim]


def check_head_dim(family: KernelFamily, direction: str, head_dim: HeadDim, arch_name: str | None = None) -> None:
    """Raise VariantError naming the supported set where `family` has no `direction` kernel for
    `head_dim` (on `arch_name`, where given: archs with less shared memory may have fewer)."""
    kernel = family.kernel(direction)
    name = f"the {family.title} {'forward' if direction == 'fwd' else 'backward'}"
    if head_dim not in kernel.tiles:
        why = f" ({kernel.missing})" if kernel.missing else ""
        raise VariantError(f"{name} has no kernel for head_dim {head_dim}{why}; it supports {_listed(kernel.head_dims)}")
    tiles = kernel.arch_tiles(arch_name) if arch_name is not None else kernel.tiles
    if head_dim not in tiles:
        raise VariantError(
            f"{name} has no kernel for head_dim {head_dim} on {arch_name} (its shapes need more than the "
            f"{COMPACT_SMEM // 1024} KiB of shared memory a CTA has there); there it supports {_listed(tuple(sorted(tiles)))}"
        )


def pack_gqa_supported(num_heads_q: int, num_heads_kv: int) -> bool:
    """Whether a PackGQA kernel exists for these heads: G = Hq / Hkv a power of two in [2, 64]
    (the G heads of a packed row group share one warpgroup's rows)."""
    if num_heads_kv <= 0 or num_heads_q % num_heads_kv:
        return False
    g = num_heads_q // num_heads_kv
    return 2 <= g <= WARPGROUP_ROWS and not g & (g - 1)


def _listed(values: tuple) -> str:
    return ", ".join(str(v) for v in values)


def _native_archs() -> str:
    return " and ".join(a for f in FAMILIES if not f.portable for a in f.archs)


# ---- docs ----------------------------------------------------------------------------------------


def _options(kernel: Kernel) -> str:
    return ", ".join(FLAGS[f] for f in FLAGS if f in kernel.flags) or "none"


def _tiles(kernel: Kernel) -> str:
    text = _shapes(kernel.tiles, kernel.tall_tiles)
    if kernel.compact_tiles is None:
        return text
    compact = ", ".join(f"`{a.name}`" for a in ARCHS if a.smem_bytes <= COMPACT_SMEM)
    return f"{text}; on {compact} (99 KiB a CTA): {_shapes(kernel.compact_tiles, {})}"


def _shapes(tiles: Mapping[HeadDim, Tiles], tall_tiles: Mapping[HeadDim, Tiles]) -> str:
    shapes = {}
    for head_dim, t in tiles.items():
        shape = f"{t.tile_m} x {t.tile_n}"
        if head_dim in tall_tiles:
            tall = tall_tiles[head_dim]
            shape += f" (or {tall.tile_m} x {tall.tile_n} per mask)"
        shapes.setdefault(f"{shape}, {t.num_stages} stage{'s' if t.num_stages > 1 else ''}", []).append(head_dim)
    if len(shapes) == 1:
        return next(iter(shapes))
    return "; ".join(f"d={_listed(tuple(ds))}: {shape}" for shape, ds in shapes.items())


def support_table() -> str:
    """The tables of docs/support.md: the kernels each arch gets, then what each family supports."""
    lines = [
        "| arch (`--arch`) | GPUs | kernels (the default first) | maskc has run on its GPUs |",
        "|---|---|---|---|",
    ]
    for a in ARCHS:
        default = default_family(a.name)
        others = [f for f in (native_family(a.name), PORTABLE) if f is not None and f is not default]
        kernels = [f"{default.title}"] + [f"{f.title} (`portable={f.portable}`)" for f in others]
        kernels.append(f"{PORTABLE_NEXT.title} (experimental: `{PORTABLE_NEXT_ENV}=1`)")
        lines.append(f"| `{a.name}` | {a.gpus} | {', '.join(kernels)} | {'yes' if a.tested else 'no: compiled only'} |")
    lines += [
        "",
        "| kernels | archs | status | head dims | dtypes | forward | backward |",
        "|---|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        archs = "every arch" if family.portable else ", ".join(f"`{a}`" for a in family.archs)
        status = "verified"
        if family.experimental:
            status = f"**experimental**: {family.gpu_checked or 'compiled, never run'}"
        dims = _listed(family.head_dims)
        if family.backward.head_dims != family.head_dims:
            dims += f" (backward: {_listed(family.backward.head_dims)})"
        cells = [family.title, archs, status, dims, ", ".join(family.dtypes)]
        for kernel in (family.forward, family.backward):
            cells.append(f"{kernel.summary}; tiles {_tiles(kernel)}; options: {_options(kernel)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_BEGIN, _END = "<!-- begin generated tables -->\n", "<!-- end generated tables -->\n"


def with_support_table(doc: str) -> str:
    """`doc` (docs/support.md) with the tables between its markers made from this table."""
    head, begin, rest = doc.partition(_BEGIN)
    _, end, tail = rest.partition(_END)
    if not begin or not end:
        raise ValueError(f"no {_BEGIN.strip()} ... {_END.strip()} block")
    return head + _BEGIN + support_table() + _END + tail


if __name__ == "__main__":  # python -m maskc.artifact.kernel_families docs/support.md
    doc = Path(sys.argv[1])
    doc.write_text(with_support_table(doc.read_text()))
