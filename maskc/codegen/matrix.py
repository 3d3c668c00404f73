"""The compile matrix: which kernels a training job needs, read from the kernel families."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

from maskc.artifact.kernel_families import (
    PORTABLE,
    PORTABLE_NEXT,
    HeadDim,
    KernelFamily,
    native_family,
    pack_gqa_supported,
    select_tiles,
)
from maskc.ir import Mask
from maskc.ir.schedule import backward_has_partial_blocks


@dataclass(frozen=True)
class Features:
    """The optional features asked for (`maskc compile --softcap` etc.)."""

    softcap: bool = False
    sink: bool = False
    max_logits: bool = False
    #: Also the deterministic backward.
    deterministic: bool = False
    #: Also the portable kernels where the arch has kernels of its own.
    portable: bool = False
    #: Also the experimental next portable kernels (PORTABLE_NEXT) beside the portable ones.
    portable_next: bool = False


def kernel_requests(
    archs: Sequence[str],
    head_dims: Sequence[HeadDim],
    heads: Sequence[tuple[int, int]],
    dtypes: Sequence[str],
    features: Features,
    masks: Sequence[Mask],
) -> list[dict[str, Any]]:
    """The kernels (as runtime requests) a job on `masks` needs, per arch, head dim, heads and
    dtype, from each family that serves the arch: the portable one where the arch has no
    verified kernels of its own (none, or experimental ones) or `features.portable` asks for
    it, and the arch's own; beside the portable ones the experimental next portable kernels
    where `features.portable_next` asks for them or the head dim has only them. Per family, the forward per GQA strategy (plain, and PackGQA where
    the family has it and the heads allow it) and tile shape (also the tall one where the
    family has one for the head dim; the runtime picks both per mask) and the backward
    (softcap is its only feature: sinks and max logits need nothing in it), also without line
    masks where the family has that variant and a mask's backward has no partial block. A head
    dim whose backward the family lacks gets its forward alone (the runtime refuses gradients
    there, naming the head dims that have them)."""
    requests = []
    for arch in archs:
        native = native_family(arch)
        families: list[KernelFamily] = []
        if features.portable or native is None or native.experimental:
            families.append(PORTABLE)
        if native is not None:
            families.append(native)
        for head_dim in head_dims:
            chosen = [f for f in families if f is not PORTABLE or head_dim in PORTABLE.head_dims]
            if PORTABLE in families and (features.portable_next or PORTABLE not in chosen):
                chosen.insert(0, PORTABLE_NEXT)
            for family in chosen:
                select_tiles(arch, head_dim, "fwd", family.portable, portable_next=family is PORTABLE_NEXT)  # names the head dims it has otherwise
            unmasked = {family: _unmasked_choices(family, arch, head_dim, masks) for family in chosen}
            for (hq, hkv), dtype in product(heads, dtypes):
                base = {"arch": arch, "head_dim": head_dim.qk, "head_dim_v": head_dim.v, "dtype": dtype,
                        "num_heads_q": hq, "num_heads_kv": hkv}  # fmt: skip
                for family in chosen:
                    requests += _family_requests(family, base, features, unmasked[family])
    return requests


def _unmasked_choices(family: KernelFamily, arch: str, head_dim: HeadDim, masks: Sequence[Mask]) -> tuple[bool, ...]:
    """The backward variants by line masks: () where the family has no backward for the head dim."""
    if head_dim not in family.backward.arch_tiles(arch):
        return ()
    if not family.has("bwd", "unmasked"):
        return (False,)
    tiles = select_tiles(arch, head_dim, "bwd", family.portable, portable_next=family is PORTABLE_NEXT)
    return (False, True) if any(not backward_has_partial_blocks(m, tiles.tile_m, tiles.tile_n) for m in masks) else (False,)


def _family_requests(
    family: KernelFamily, base: dict[str, Any], features: Features, unmasked: tuple[bool, ...]
) -> list[dict[str, Any]]:
    kind = {name: True for name, on in family.selector.items() if on}
    packs = (False, True) if family.has("fwd", "pack_gqa") and pack_gqa_supported(base["num_heads_q"], base["num_heads_kv"]) else (False,)
    talls = (False, True) if HeadDim.of(base) in family.forward.tall_tiles else (False,)
    forward = [
        {**base, "direction": "fwd", "has_softcap": features.softcap, "has_sink": features.sink,
         "has_max_logits": features.max_logits, "pack_gqa": pack, **kind, **({"tall": True} if tall else {})}
        for tall, pack in product(talls, packs)
    ]  # fmt: skip
    deterministic = (False, True) if features.deterministic and family.has("bwd", "deterministic") else (False,)
    backward = [
        {**base, "direction": "bwd", "has_softcap": features.softcap, "has_sink": False, "has_max_logits": False,
         "pack_gqa": False, "deterministic": det, "unmasked": no_masks, **kind}
        for det, no_masks in product(deterministic, unmasked)
    ]  # fmt: skip
    return forward + backward
