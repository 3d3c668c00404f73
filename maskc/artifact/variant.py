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
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from maskc.artifact.kernel_families import (
    ARCH_NAMES,
    DIRECTIONS,
    DTYPE_NAMES,
    FLAGS,
    SM90,
    SM100,
    WARPGROUP_ROWS,
    HeadDim,
    KernelFamily,
    Tiles,
    arch,
    backward_warpgroups,
    check_head_dim,
    family_of,
    pack_gqa_supported,
    portable_warps,
    select_tiles,
    sm90_p_in_smem,
)
from maskc.errors import VariantError

#: Shared memory a kernel keeps for its barriers.
_SMEM_RESERVE = 1024


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
    #: arch's own; the only kernel of an arch no other family serves.
    portable: bool = False
    #: The head dim of v and the output where it differs from q and k's (MLA: 192 / 128);
    #: None: the same.
    head_dim_v: int | None = None
    #: With `portable`: the experimental next portable kernels (PORTABLE_NEXT: the GPU suite passed on
    #: an H100, not yet a default), which the runtime takes only where $MASKC_PORTABLE_NEXT is 1.
    portable_next: bool = False
    #: Forward only: the family's tall tile for the head dim (`Kernel.tall_tiles`), compiled
    #: beside the other and taken per mask (maskc.ir.strategy.select_forward).
    tall: bool = False

    def __post_init__(self) -> None:
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.arch not in ARCH_NAMES:
            raise VariantError(f"arch {self.arch!r} is not supported; supported: {', '.join(ARCH_NAMES)}")
        if self.direction not in DIRECTIONS:
            raise VariantError(f"direction {self.direction!r} is not supported; supported: {', '.join(DIRECTIONS)}")
        if self.dtype not in DTYPE_NAMES:
            raise VariantError(f"dtype {self.dtype!r} is not supported; supported: {', '.join(DTYPE_NAMES)}")
        for name in ("head_dim", "head_dim_v", "num_heads_q", "num_heads_kv", "tile_m", "tile_n", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise VariantError(f"{name} must be a positive int, got {value!r}")
        for name in (*FLAGS, "portable", "portable_next", "tall"):
            if not isinstance(getattr(self, name), bool):
                raise VariantError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.portable_next and not self.portable:
            raise VariantError("portable_next chooses among the portable kernels: it needs portable=True")
        family = self.family
        if self.head_dims not in family.head_dims:
            raise VariantError(
                f"head_dim {self.head_dims} is not supported; supported head dims: {', '.join(map(str, family.head_dims))}"
            )
        check_head_dim(family, self.direction, self.head_dims, self.arch)
        if self.num_heads_q % self.num_heads_kv:
            raise VariantError(
                f"num_heads_q ({self.num_heads_q}) must be a multiple of num_heads_kv ({self.num_heads_kv})"
            )
        if self.pack_gqa and not pack_gqa_supported(self.num_heads_q, self.num_heads_kv):
            raise VariantError(
                f"pack_gqa needs num_heads_q / num_heads_kv to be a power of two in [2, {WARPGROUP_ROWS}], "
                f"got {self.num_heads_q} / {self.num_heads_kv} = {self.num_heads_q // self.num_heads_kv}"
            )
        if self.tall:
            select_tiles(self.arch, self.head_dims, self.direction, self.portable, True, self.portable_next)  # names where there is one
        if self.direction == "fwd":
            if self.deterministic:
                raise VariantError("deterministic is a backward option (the forward is deterministic already)")
            if self.unmasked:
                raise VariantError("unmasked is a backward option (the forward masks only its partial blocks already)")
        self._check_flags(family)
        self._check_tiles(family)
        if self.smem_bytes() > self._smem_available():
            raise VariantError(
                f"variant needs {self.smem_bytes()} bytes of shared memory, more than the "
                f"{self._smem_available()} a CTA has on {self.arch}; use fewer stages or a smaller tile"
            )

    def _check_flags(self, family: KernelFamily) -> None:
        kernel = family.kernel(self.direction)
        for flag, option in FLAGS.items():
            if getattr(self, flag) and flag not in kernel.flags:
                why = (
                    " (the runtime computes the sinks' gradient, and lse already includes them)"
                    if self.direction == "bwd" and flag in ("has_sink", "has_max_logits")
                    else ""
                )
                options = ", ".join(FLAGS[f] for f in FLAGS if f in kernel.flags)
                raise VariantError(f"the {self._kernel_name(family)} has no {option} variant{why}; its options: {options}")

    def _check_tiles(self, family: KernelFamily) -> None:
        """A tile shape the family's templates are written for: its default one for the head
        dim, or one of its other choices where it has them."""
        kernel = family.kernel(self.direction)
        tiles = Tiles(self.tile_m, self.tile_n, self.num_stages)
        choices = kernel.choices
        if choices is None:
            default = kernel.arch_tiles(self.arch)[self.head_dims]
            if tiles != default:
                raise VariantError(
                    f"{self._kernel_name(family)} tiles {self.tile_m} x {self.tile_n} with {self.num_stages} stage(s) are "
                    f"not supported; supported: {default.tile_m} x {default.tile_n}, {default.num_stages} "
                    f"stage{'s' if default.num_stages > 1 else ''}"
                )
            return
        for name, allowed in (("tile_m", choices.tile_m), ("tile_n", choices.tile_n), ("num_stages", choices.num_stages)):
            if getattr(self, name) not in allowed:
                raise VariantError(
                    f"{self._kernel_name(family)} {name} {getattr(self, name)} is not supported; supported: {_span(allowed)}"
                )
        problem = choices.fits(self.head_dims, tiles)
        if problem is not None:
            raise VariantError(f"{self._kernel_name(family)}: {problem}")

    def _kernel_name(self, family: KernelFamily) -> str:
        return f"{family.title} {'forward' if self.direction == 'fwd' else 'backward'}"

    # ---- derived properties ---------------------------------------------------------------

    @property
    def head_dims(self) -> HeadDim:
        return HeadDim(self.head_dim, self.head_dim_v)

    @property
    def num_mma_warpgroups(self) -> int:
        """Consumer warpgroups: each owns 64 rows of the query tile (backward: see backward_warpgroups)."""
        return backward_warpgroups(self.tile_n) if self.direction == "bwd" else self.tile_m // WARPGROUP_ROWS

    @property
    def family(self) -> KernelFamily:
        """The kernel family whose templates render this variant."""
        return family_of(self.arch, self.portable, self.portable_next)

    @property
    def experimental(self) -> bool:
        """Compiled but never run on its GPU (see KernelFamily.experimental)."""
        return self.family.experimental

    @property
    def document_tiles(self) -> bool:
        """Its k blocks (forward) or k tiles and q blocks (backward) may start at any token
        (KernelFamily.document_tiles)."""
        return self.family.document_tiles

    @property
    def document_rows(self) -> bool:
        """A forward whose q tiles start at each document too: document_tiles without PackGQA
        (a packed tile's 16 or fewer tokens seldom cross a document's end)."""
        return self.direction == "fwd" and self.document_tiles and not self.pack_gqa

    @property
    def qheads_per_kvhead(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    @property
    def pack_g(self) -> int:
        """Query heads of a packed row group: G = Hq / Hkv with PackGQA, else 1 (the templates' PACK_G)."""
        return self.qheads_per_kvhead if self.pack_gqa else 1

    @property
    def tile_tokens(self) -> int:
        """Query tokens of one M tile: the rows of the schedule's q tiles (TILE_M / G packed)."""
        return self.tile_m // self.qheads_per_kvhead if self.pack_gqa else self.tile_m

    @property
    def element_bytes(self) -> int:
        return 2

    def smem_bytes(self, q_stages: int = 1, staging: tuple[int, int] | None = None) -> int:
        """Shared memory for the Q buffers (each also stages O) and the K and V stages.

        Backward: the K and V tile and `num_stages` Q (and dO) blocks; then SM90's P^T and dS^T blocks of
        the k tile (`bwd_score_buffers`), fp32
        lse / delta rows, the fp32 dQ staging tile (SM90's dO stages and dQ chunks are
        `staging`, default `bwd_staging`), a split piece's rank per warpgroup and each stage's
        q block and flag (the producer's walk), or one dS^T
        block for the portable and SM100 backwards. SM100's forward: the Q tile and the K/V stages (P stays in tensor memory); SM90's,
        also P where it goes through shared memory."""
        dims = self.head_dim + self.head_dim_v
        if self.direction == "bwd":
            kv = self.tile_n * dims
            if self.family is not SM90:
                return (kv + self.num_stages * self.tile_m * dims + self.tile_n * self.tile_m) * self.element_bytes
            do_stages, dq_chunks = staging or self.bwd_staging
            qdo = self.tile_m * (self.num_stages * self.head_dim + do_stages * self.head_dim_v)
            scores = self.bwd_score_buffers * self.tile_n * self.tile_m
            stats = 2 * self.num_stages * self.tile_m
            words = self.tile_m * self.head_dim // dq_chunks + stats + self.num_mma_warpgroups + 2 * self.num_stages
            return (kv + qdo + scores) * self.element_bytes + 4 * words
        if self.family is SM100:
            # Square head dims only: K and V share the stages.
            return (self.tile_m + self.num_stages * self.tile_n) * self.head_dim * self.element_bytes
        q = q_stages * self.tile_m * self.head_dim
        kv = self.num_stages * self.tile_n * dims
        p = self.tile_m * self.tile_n if self.p_in_smem else 0
        return (q + kv + p) * self.element_bytes

    @property
    def p_in_smem(self) -> bool:
        """The SM90 forward stages P in shared memory for O += P V (`sm90_p_in_smem`; the
        templates' P_IN_SMEM)."""
        return self.family is SM90 and self.direction == "fwd" and sm90_p_in_smem(self.tile_m, self.head_dim_v)

    @property
    def bwd_splits_keys(self) -> bool:
        """The SM90 backward's warpgroups each own a block of the k tile's keys (64 of 128, or 48
        of 96 with `bwd_query_rows`); else they share a 64-key tile and split its queries and
        head dims (the templates' SPLIT_KEYS)."""
        return self.tile_n > WARPGROUP_ROWS

    @property
    def bwd_query_rows(self) -> bool:
        """The SM90 backward's S and dP have the queries on the wgmma M axis (FA4's d=192
        formulation): the two warpgroups split a 96-key tile, 48 keys each, and hold dK^T and
        dV^T with the head dims on M, P^T and dS^T going through shared memory (the templates'
        QUERY_ROWS). A key block that is not 64 keys cannot be an M extent, hence the swap."""
        return self.bwd_splits_keys and self.tile_n % WARPGROUP_ROWS != 0

    @property
    def bwd_paced(self) -> bool:
        """The SM90 backward's CTAs keep pace with each other (the producer waits while its CTA
        is ahead of the mean; bwd_pipeline.jinja): at d=256 a step's Q, dO and dQ rows are
        128 KiB, and at 64k tokens CTAs drifting apart over an item's 8192 steps left L2 60%
        hits (design note backward-order.md); at d=96 and 128 it gains 0-2% (d=96 full 64k 8%).
        Only the 64-query blocks with keys on the wgmma M axis: d=64's 128-query blocks and
        the query-rows formulation (d=192, 192/128) gained nothing or lost. Not in the
        deterministic kernel, whose waits it would compound."""
        return (self.family is SM90 and self.direction == "bwd" and not self.deterministic
                and self.tile_m == WARPGROUP_ROWS and not self.bwd_query_rows)  # fmt: skip

    @property
    def bwd_key_block(self) -> int:
        """Keys of the k tile one consumer warpgroup owns (all of a shared 64-key tile)."""
        return self.tile_n // self.num_mma_warpgroups if self.bwd_splits_keys else self.tile_n

    @property
    def bwd_ds_stages(self) -> int:
        """dS^T buffers of the SM90 backward (the templates' DS_STAGES): two, which blocks
        alternate (one with one Q stage); one with `bwd_query_rows` (two buffers of P^T and of
        dS^T do not fit beside a whole dQ staging tile at d=192)."""
        return 1 if self.bwd_query_rows else min(2, self.num_stages)

    @property
    def bwd_score_buffers(self) -> int:
        """(key block x q block) 16-bit tiles of P^T and dS^T in the SM90 backward's shared memory,
        per key block: the dS^T buffers, and as many of P^T unless P^T is a register operand
        (SPLIT_KEYS without QUERY_ROWS)."""
        return self.bwd_ds_stages * (1 if self.bwd_splits_keys and not self.bwd_query_rows else 2)

    @property
    def bwd_dq_splits_rows(self) -> bool:
        """The SM90 backward's warpgroups split a q block's dQ = dS K by queries, each its 64 of a
        128-query block over every head dim (one N = head-dim wgmma per 16 keys); else by
        head-dim columns, each over the whole block (the templates' DQ_SPLITS_ROWS)."""
        return self.tile_m > WARPGROUP_ROWS

    @property
    def bwd_dq_warpgroups(self) -> int:
        """The SM90 backward's consumer warpgroups that compute dQ: all of them, or only the
        first (FA4's dQ_single_wg) where halving the head dims would leave slices that are not
        whole 32-column swizzle atoms (d=96: 48 columns). Then K keeps 64-byte swizzle atoms for
        S^T = K Q^T, dQ is one N=96 product, and the first warpgroup gets 16 registers of the
        other's."""
        if self.bwd_splits_keys and not self.bwd_dq_splits_rows and (self.head_dim // 2) % 32:
            return 1
        return self.num_mma_warpgroups

    @property
    def bwd_staging(self) -> tuple[int, int]:
        """The SM90 backward's dO stages and the chunks a warpgroup stages its dQ columns of a q
        block in: `num_stages` and whole where that fits in shared memory, else one dO stage
        (d=192 with 96-key tiles), else one dO stage and halves (d=256 with two Q stages: the
        next Q still loads during a block, and dO once the block's dV is done)."""
        for staging in ((self.num_stages, 1), (1, 1)):
            if self.smem_bytes(staging=staging) <= self._smem_available():
                return staging
        return (1, 2)

    @property
    def portable_dq_grid(self) -> tuple[int, int, int]:
        """The portable backward's dQ^T = K^T dS^T, whose M is the head dims: its warp grid (head
        dims x queries) and the head-dim rows one product covers (the templates' DQ_WARPS_M,
        DQ_WARPS_N and DQ_ROWS). The verified kernels put every warp on M where each gets 16 head
        dims, else as many as whole 16-row blocks allow and the rest across the queries, one
        16-row extent a warp per product (d=64 with 8 warps: 4 x 2, d=96: 2 x 4). The next ones
        cover every head dim in one product where its accumulator fits in 32 registers a thread,
        on the grid that ldmatrix's the fewest K^T and dS^T fragments a k step (warps_m x16 ones
        of K^T, each of 16 rows, and one of dS^T per 16 queries a warp; ties to the taller grid):
        4 x 2 at d=128, two 16-row extents a warp, 4 ldmatrix.x4 a k step where 8 x 1 took 5."""
        warps = portable_warps("bwd", self.tile_m, self.tile_n)
        d = self.head_dim
        if self.portable_next and d * self.tile_m <= 32 * 32 * warps:
            grids = [(m, warps // m) for m in (warps >> i for i in range(warps.bit_length()))
                     if d % (16 * m) == 0 and self.tile_m % (16 * (warps // m)) == 0]  # fmt: skip
            warps_m, warps_n = min(grids, key=lambda g: (d // (16 * g[0]) + self.tile_m // (16 * g[1]), -g[0]))
            return warps_m, warps_n, d
        warps_m = warps
        while d % (16 * warps_m):
            warps_m //= 2
        return warps_m, warps // warps_m, 16 * warps_m

    @property
    def portable_bwd_two_walks(self) -> bool:
        """The portable backward walks an item's q blocks twice (the templates' TWO_WALKS): dV
        first, then dK and dQ, each walk recomputing S^T. Above d=128 a warp's 16 keys hold
        dK and dV of 128 registers each, which do not fit beside S^T and dP^T (ptxas, d=256 in
        one walk: 68 KB of spills); one at a time they hold as many as d=128's in one walk."""
        return self.portable and self.direction == "bwd" and self.head_dim > 128

    @property
    def portable_bwd_rows_without_branches(self) -> bool:
        """The next portable backward's q blocks that lie wholly inside the sequence (all but
        each sequence's last) load Q and dO and add dQ with no branch a row (the templates'
        ROWS_WITHOUT_BRANCHES; the last block keeps the checks). In the verified kernels each
        row's check is a branch, and each dQ element's reduction sits in one of its own behind a
        convergence barrier. SASS, sm_80, d=128, a full block's step: 1342 -> 1042 instructions
        with the 4 x 2 dQ grid (docs/design/portable-kernels.md). Not on sm_120a at d=64, where
        ptxas then spills 616 bytes (72 local loads in the block loop) against none."""
        return self.portable_next and self.direction == "bwd" and not (self.arch == "sm_120a" and self.head_dim == 64)

    @property
    def portable_bwd_a_by_k_step(self) -> bool:
        """The portable backward's S^T = K Q^T and dP^T = V dO^T ldmatrix K and V one k step at a
        time beside Q and dO (the templates' A_BY_K_STEP) rather than as whole fragments first:
        with TWO_WALKS, but on sm_100a. ptxas at d=256, spill bytes whole -> by k step: sm_80 0
        -> 0, deterministic 3392 -> 16; sm_90a 0 -> 0 both; sm_100a 952 -> 3528, deterministic
        32 -> 128."""
        return self.portable_bwd_two_walks and self.arch != "sm_100a"

    @property
    def portable_b_by_x4(self) -> bool:
        """The portable kernels' B operands (K and V in the forward) are ldmatrix'ed one x4 (two n8
        atoms) at a time, each product beside its copy (the templates' B_BY_X4): in the next
        forward's 32-key blocks (d=128 and 256), where ptxas measured it: sm_80 spill bytes 132 ->
        8 at d=128, 88 -> 64 at d=256. Elsewhere it spilled more (the 32-row forward's 128x128 at
        d=64: 240 -> 420, 128x64 at d=96: 48 -> 224) or the same (the next backward)."""
        return self.portable_next and self.direction == "fwd" and self.tile_n == 32

    @property
    def q_stages(self) -> int:
        """Q buffers: two when they fit, so the next work item's Q loads while this one's
        softmax tail and epilogue run (and its O tile leaves through the other buffer). The
        portable kernel has one."""
        if self.portable:
            return 1
        return 2 if self.smem_bytes(2) <= self._smem_available() else 1

    def _smem_available(self) -> int:
        return arch(self.arch).smem_bytes - _SMEM_RESERVE

    @property
    def ctas_per_sm(self) -> int:
        """Persistent CTAs that share an SM: one of the arch's own kernels (warp-specialised,
        sized to a whole SM); of a portable kernel as many as the SM's 64K registers (at up to
        255 a thread: two CTAs of 128 threads, one of 256) and its shared memory (each CTA's,
        its barriers' and the system's 1 KiB) hold at once. More than fit would run in a second
        wave behind the first, against a deal made for all of them at once."""
        if not self.portable:
            return 1
        registers = 65536 // (256 * 32 * portable_warps(self.direction, self.tile_m, self.tile_n))
        shared = arch(self.arch).sm_smem_bytes // (self.smem_bytes() + _SMEM_RESERVE + 1024)
        return max(1, min(registers, shared))

    # ---- naming ----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Its fields; `portable_next` only where set, so the kernels from before it keep their digests."""
        fields = asdict(self)
        if not self.portable_next:
            del fields["portable_next"]
        return fields

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
            arch += "_portable_next" if self.portable_next else "_portable"
        v = f"v{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        return (
            f"attn_{self.direction}_{arch}_d{self.head_dim}{v}_{self.dtype}_h{self.num_heads_q}x{self.num_heads_kv}"
            f"_t{self.tile_m}x{self.tile_n}s{self.num_stages}{('_' + flags) if flags else ''}_{self.digest()}"
        )


def variant_for(request: Mapping[str, Any]) -> KernelVariant:
    """The variant serving a runtime request (a kernel's fields but its tile shape): the
    request plus the tile shape its kernel family compiles for the head dim (the tall one
    where the request asks for it)."""
    tiles = select_tiles(
        request["arch"], HeadDim.of(request), request["direction"], request.get("portable", False), request.get("tall", False),
        request.get("portable_next", False),
    )
    return KernelVariant(**request, tile_m=tiles.tile_m, tile_n=tiles.tile_n, num_stages=tiles.num_stages)


def _span(values: tuple[int, ...]) -> str:
    """Allowed values for a message: a long evenly spaced run as a range, else listed."""
    steps = {b - a for a, b in zip(values, values[1:])}
    if len(values) > 4 and len(steps) == 1:
        step = steps.pop()
        return f"{values[0]} to {values[-1]}" if step == 1 else f"multiples of {step} in [{values[0]}, {values[-1]}]"
    return ", ".join(map(str, values))
