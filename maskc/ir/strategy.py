"""Kernel strategy choices that depend on the problem: the tile shape.

Measured on an H200 (heads 64:8, bf16, 8k-16k tokens): at d=128, 128x128 tiles with two
K/V stages (two consumer warpgroups) reach 600-690 TFLOP/s on full/causal masks, while
128x176 spills registers and drops to about 420; at d=64, 192x128 (three consumer
warpgroups) beats 128x128 by about 15% on full masks.
"""

from __future__ import annotations

from dataclasses import dataclass

from maskc.errors import MaskcError

SUPPORTED_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class Tiles:
    tile_m: int
    tile_n: int
    num_stages: int


_SM90 = {64: Tiles(192, 128, 2), 128: Tiles(128, 128, 2)}


def select_tiles(arch: str, head_dim: int) -> Tiles:
    """Tile shape of the forward kernel for `arch` and `head_dim`."""
    if arch != "sm_90a":
        raise MaskcError(f"no forward kernel for arch {arch!r}; supported: sm_90a")
    if head_dim not in _SM90:
        raise MaskcError(f"head_dim {head_dim} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")
    return _SM90[head_dim]
