"""From a runtime request (what a call needs) to a compiled, cached kernel variant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maskc.codegen.cache import cached_kernel
from maskc.codegen.variant import KernelVariant
from maskc.ir.strategy import select_tiles


def variant_for(request: dict[str, Any]) -> KernelVariant:
    """The variant serving `request`: its fields plus the tile shape chosen for them."""
    tiles = select_tiles(request["arch"], request["head_dim"], request["direction"], request.get("portable", False))
    return KernelVariant(**request, tile_m=tiles.tile_m, tile_n=tiles.tile_n, num_stages=tiles.num_stages)


def compile_request(request: dict[str, Any]) -> Path:
    """The cache entry (an artifact directory) holding the kernel for `request`."""
    return cached_kernel(variant_for(request))
