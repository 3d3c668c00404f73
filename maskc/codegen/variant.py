"""Kernel variants: the static choices one compiled attention kernel is specialised for.

A `KernelVariant` names everything that is baked into a kernel's code (architecture,
direction, head dim, dtype, head counts, tile shape, pipeline depth and the optional
softcap / sink / max-logits features). Everything else (sequence lengths, the mask's
tile schedule, the scale, the softcap value) is a runtime argument, so one variant
serves every training step of a model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from maskc.errors import MaskcError
from maskc.ir.strategy import PORTABLE_TILE_M, select_tiles

SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a")
#: Archs with a kernel of their own (sm_90a: TMA + wgmma; sm_100a: TMA + tcgen05 with tensor
#: memory); every arch has the portable kernel.
NATIVE_ARCHS = ("sm_90a", "sm_100a")
#: Native kernels compiled (and checked at the PTX level) but never run: no such GPU was
#: available. The manifest marks them experimental and the runtime uses them only when asked.
EXPERIMENTAL_ARCHS = ("sm_100a",)
#: Archs whose own backward also has the unmasked variant and splits items into pieces (one
#: per query head); the portable and SM100 backwards have neither.
BACKWARD_EXTRAS_ARCHS = ("sm_90a",)
SUPPORTED_DIRECTIONS = ("fwd", "bwd")
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = ("bf16", "fp16")

#: Rows of the query tile owned by one consumer warpgroup (one wgmma M extent).
WARPGROUP_ROWS = 64
#: Persistent CTAs of the portable kernel per SM: 128 threads of at most 255 registers and
#: 80 KiB of shared memory at d=128, so two fit an SM80 or SM90 SM (each also runs alone).
PORTABLE_CTAS_PER_SM = 2
#: Shared memory one CTA may use per arch, and what the kernel keeps for barriers.
SMEM_BYTES = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90a": 227 * 1024, "sm_100a": 227 * 1024,
              "sm_120a": 99 * 1024}  # fmt: skip
_SMEM_RESERVE = 1024


class VariantError(MaskcError, ValueError):
    """A kernel variant asks for something no template supports."""


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: see the module docstring. Construction validates."""

    arch: str
    direction: str
    head_dim: int
    dtype: str
    num_heads_q: int
    num_heads_kv: int
    tile_m: int
    tile_n: int
    num_stages: int
    has_softcap: bool = False
    has_sink: bool = False
    has_max_logits: bool = False
    #: PackGQA: the M tile holds the G = num_heads_q / num_heads_kv query heads of one K/V head
    #: for TILE_M / G consecutive tokens (packed row p = token * G + g), so each K/V block
    #: serves G heads; work items walk K/V heads. See maskc.ir.strategy.select_pack_gqa.
    pack_gqa: bool = False
    #: Backward only: dQ additions in a fixed order (k tiles in ascending order per q block,
    #: through semaphores), so gradients are bitwise identical from run to run.
    deterministic: bool = False
    #: Backward only: no line masks, so the runtime gives it only schedules without a partial
    #: block (a full mask). The masked kernel's line state spills registers in its block loop.
    unmasked: bool = False
    #: The portable kernel (warp MMA, cp.async, ldmatrix: every GPU since SM80) instead of the
    #: arch's own; the only kernel of an arch outside NATIVE_ARCHS.
    portable: bool = False

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise VariantError(f"arch {self.arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
        if self.direction not in SUPPORTED_DIRECTIONS:
            raise VariantError(
                f"direction {self.direction!r} is not supported; supported: {', '.join(SUPPORTED_DIRECTIONS)}"
            )
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise VariantError(
                f"head_dim {self.head_dim} is not supported; supported head dims: "
                f"{', '.join(str(d) for d in SUPPORTED_HEAD_DIMS)}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise VariantError(f"dtype {self.dtype!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
        for name in ("num_heads_q", "num_heads_kv", "tile_m", "tile_n", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise VariantError(f"{name} must be a positive int, got {value!r}")
        for name in ("has_softcap", "has_sink", "has_max_logits", "pack_gqa", "deterministic", "unmasked", "portable"):
            if not isinstance(getattr(self, name), bool):
                raise VariantError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_heads_q % self.num_heads_kv:
            raise VariantError(
                f"num_heads_q ({self.num_heads_q}) must be a multiple of num_heads_kv ({self.num_heads_kv})"
            )
        if self.pack_gqa:
            g = self.num_heads_q // self.num_heads_kv
            if g < 2 or g & (g - 1) or g > WARPGROUP_ROWS:
                raise VariantError(
                    f"pack_gqa needs num_heads_q / num_heads_kv to be a power of two in [2, {WARPGROUP_ROWS}], "
                    f"got {self.num_heads_q} / {self.num_heads_kv} = {g}"
                )
        if not self.portable and self.arch not in NATIVE_ARCHS:
            raise VariantError(f"arch {self.arch} has only the portable kernel (portable=True)")
        if self.direction == "fwd":
            if self.deterministic:
                raise VariantError("deterministic is a backward option (the forward is deterministic already)")
            if self.unmasked:
                raise VariantError("unmasked is a backward option (the forward masks only its partial blocks already)")
        if self.portable:
            self._check_portable()
        elif self.arch == "sm_100a":
            self._check_sm100()
        elif self.direction == "bwd":
            self._check_backward_tiles()
        else:
            self._check_forward_tiles()
        if not 1 <= self.num_stages <= 8:
            raise VariantError(f"num_stages {self.num_stages} must be in [1, 8]")
        if self.smem_bytes() > SMEM_BYTES[self.arch] - _SMEM_RESERVE:
            raise VariantError(
                f"variant needs {self.smem_bytes()} bytes of shared memory, more than the "
                f"{SMEM_BYTES[self.arch] - _SMEM_RESERVE} a CTA has on {self.arch}; use fewer stages or a smaller tile"
            )

    def _check_portable(self) -> None:
        """The portable kernels: four warps of 16 rows each (query rows forward, keys backward)."""
        if self.pack_gqa:
            raise VariantError("the portable kernel has no pack_gqa variant")
        if self.direction == "bwd":
            if self.has_sink or self.has_max_logits:
                raise VariantError("the backward kernel has no sink / max_logits variants (the caller computes dsink)")
            if self.unmasked:
                raise VariantError("the portable backward has no unmasked variant yet")
            self._check_fixed_tiles("portable backward")
            return
        if self.tile_m != PORTABLE_TILE_M:
            raise VariantError(f"portable tile_m {self.tile_m} is not supported; supported: {PORTABLE_TILE_M} (4 warps)")
        if self.tile_n not in (64, 128):
            raise VariantError(f"portable tile_n {self.tile_n} is not supported; supported: 64, 128")
        if self.num_stages != 2:
            raise VariantError(f"portable num_stages {self.num_stages} is not supported; supported: 2")

    def _check_sm100(self) -> None:
        """The SM100 kernels: 128 TMEM lanes of query rows (forward) or keys (backward)."""
        if self.pack_gqa:
            raise VariantError(f"the sm_100a {self.direction} has no pack_gqa variant yet")
        if self.direction == "bwd" and (self.has_sink or self.has_max_logits or self.unmasked):
            raise VariantError(
                "the sm_100a backward has no sink / max_logits / unmasked variants (the caller computes the sinks' "
                "gradient, lse already includes them, and only partial blocks are masked anyway)"
            )
        self._check_fixed_tiles(f"sm_100a {self.direction}")

    def _check_fixed_tiles(self, kernel: str) -> None:
        """Kernels built for one tile shape: the one select_tiles gives."""
        tiles = select_tiles(self.arch, self.head_dim, self.direction, self.portable)
        if (self.tile_m, self.tile_n, self.num_stages) != (tiles.tile_m, tiles.tile_n, tiles.num_stages):
            raise VariantError(
                f"{kernel} tiles {self.tile_m} x {self.tile_n} with {self.num_stages} stage(s) are not supported; "
                f"supported: {tiles.tile_m} x {tiles.tile_n}, {tiles.num_stages} stage{'s' if tiles.num_stages > 1 else ''}"
            )

    def _check_forward_tiles(self) -> None:
        """The forward kernel: q tiles of 64 rows per consumer warpgroup, O in registers."""
        if self.tile_m not in (128, 192):
            raise VariantError(
                f"tile_m {self.tile_m} is not supported; supported: 128 (2 consumer warpgroups), "
                "192 (3 consumer warpgroups)"
            )
        if self.tile_m == 192 and (self.head_dim != 64 or self.tile_n > 128):
            raise VariantError("tile_m 192 (3 consumer warpgroups) needs head_dim 64 and tile_n <= 128 (registers)")
        if self.tile_n % 16 or not 64 <= self.tile_n <= 192:
            raise VariantError(f"tile_n {self.tile_n} must be a multiple of 16 in [64, 192]")
        if self.head_dim == 128 and self.tile_n > 176:
            raise VariantError(f"tile_n {self.tile_n} with head_dim 128 does not fit in registers; use <= 176")

    def _check_backward_tiles(self) -> None:
        """The backward kernel: work items are k tiles of tile_n keys (64 per consumer warpgroup),
        runs are q blocks of tile_m queries; dK and dV accumulate in registers."""
        if self.pack_gqa or self.has_sink or self.has_max_logits:
            raise VariantError(
                "the backward kernel has no pack_gqa / sink / max_logits variants (the sinks' gradient "
                "is computed by the caller; lse already includes them)"
            )
        if self.tile_n != 128:
            raise VariantError(f"backward tile_n {self.tile_n} is not supported; supported: 128 (2 consumer warpgroups)")
        if self.tile_m != 64:
            raise VariantError(f"backward tile_m {self.tile_m} is not supported; supported: 64 (registers)")
        if self.num_stages % 2:
            raise VariantError(f"backward num_stages {self.num_stages} must be even (blocks alternate two dS buffers)")

    # ---- derived properties ---------------------------------------------------------------

    @property
    def num_mma_warpgroups(self) -> int:
        """Consumer warpgroups: each owns 64 rows of the query tile (backward: 64 keys of the k tile)."""
        return (self.tile_n if self.direction == "bwd" else self.tile_m) // WARPGROUP_ROWS

    @property
    def experimental(self) -> bool:
        """Compiled but never run on its GPU (see EXPERIMENTAL_ARCHS)."""
        return not self.portable and self.arch in EXPERIMENTAL_ARCHS

    @property
    def qheads_per_kvhead(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    @property
    def tile_tokens(self) -> int:
        """Query tokens of one M tile: the rows of the schedule's q tiles (TILE_M / G packed)."""
        return self.tile_m // self.qheads_per_kvhead if self.pack_gqa else self.tile_m

    @property
    def element_bytes(self) -> int:
        return 2

    def smem_bytes(self, q_stages: int = 1) -> int:
        """Shared memory for the Q buffers (each also stages O) and the K and V stages.

        Backward: the K and V tile and `num_stages` (Q, dO) blocks; then SM90's two dS^T blocks
        of the k tile, fp32 lse / delta rows and the fp32 dQ staging tile, or one dS^T block for
        the portable and SM100 backwards. SM100's forward: the Q tile and the K/V stages (P
        stays in tensor memory)."""
        if self.direction == "bwd":
            kv = 2 * self.tile_n * self.head_dim
            qdo = 2 * self.num_stages * self.tile_m * self.head_dim
            if self.portable or self.arch != "sm_90a":
                return (kv + qdo + self.tile_n * self.tile_m) * self.element_bytes
            fp32 = self.tile_m * self.head_dim + 2 * self.num_stages * self.tile_m
            return (kv + qdo + 2 * self.tile_n * self.tile_m) * self.element_bytes + 4 * fp32
        if self.arch == "sm_100a" and not self.portable:
            return (self.tile_m + self.num_stages * self.tile_n) * self.head_dim * self.element_bytes
        q = q_stages * self.tile_m * self.head_dim
        kv = 2 * self.num_stages * self.tile_n * self.head_dim
        return (q + kv) * self.element_bytes

    @property
    def q_stages(self) -> int:
        """Q buffers: two when they fit, so the next work item's Q loads while this one's
        softmax tail and epilogue run (and its O tile leaves through the other buffer). The
        portable kernel has one."""
        if self.portable:
            return 1
        return 2 if self.smem_bytes(2) <= SMEM_BYTES[self.arch] - _SMEM_RESERVE else 1

    # ---- naming ----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        """A short hash of every field (stable across runs and machines)."""
        body = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:10]

    def key(self) -> str:
        """A stable short name, usable as a file name and a C symbol prefix."""
        arch = self.arch.replace("_", "").rstrip("a")
        flags = "".join(
            letter
            for letter, on in (
                ("c", self.has_softcap), ("s", self.has_sink), ("m", self.has_max_logits), ("p", self.pack_gqa),
                ("d", self.deterministic), ("u", self.unmasked),
            )
            if on
        )
        if self.portable:
            arch += "_portable"
        return (
            f"attn_{self.direction}_{arch}_d{self.head_dim}_{self.dtype}_h{self.num_heads_q}x{self.num_heads_kv}"
            f"_t{self.tile_m}x{self.tile_n}s{self.num_stages}{('_' + flags) if flags else ''}_{self.digest()}"
        )
