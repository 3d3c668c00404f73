"""bench/tiles.py, the tile-shape A/B: shapes are checked against what the templates are
written for before anything compiles, and each directory holds its own shape's kernels."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from maskc.artifact.kernel_families import SM90, HeadDim, Tiles
from maskc.errors import VariantError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import tiles  # noqa: E402


def test_shapes_are_parsed_and_checked_before_compiling() -> None:
    assert tiles.parse_tiles("128x112", 2) == Tiles(128, 112, 2)
    for bad in ("128", "x64", "128x", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match="a tile shape is MxN"):
            tiles.parse_tiles(bad, 2)
    assert tiles.checked(HeadDim(192, 192), "fwd", Tiles(128, 112, 2)) == Tiles(128, 112, 2)
    with pytest.raises(VariantError, match="does not fit in registers"):
        tiles.checked(HeadDim(128, 128), "fwd", Tiles(128, 176, 2))
    with pytest.raises(VariantError, match="tile_n 128 needs head_dim <= 128 .* head_dim 256 takes tile_n 64"):
        tiles.checked(HeadDim(256, 256), "bwd", Tiles(64, 128, 2))
    assert tiles.checked(HeadDim(256, 256), "bwd", Tiles(64, 64, 1)) == Tiles(64, 64, 1)


def test_each_directory_holds_its_shapes_kernels_and_the_table_is_left_as_it_was(tmp_path: Path) -> None:
    pytest.importorskip("cutlass")
    head_dim = HeadDim(256, 256)
    before = dict(SM90.forward.tiles)
    dirs = tiles.build(tmp_path, head_dim, "fwd", [Tiles(128, 64, 2)])
    assert [d.name for d in dirs] == ["table", "128x64s2"] and dict(SM90.forward.tiles) == before
    for d, tile_n in zip(dirs, (before[head_dim].tile_n, 64)):
        variants = json.loads((d / "manifest.json").read_text())["variants"]
        forward = [v for v in variants if v["fields"]["direction"] == "fwd"]
        assert forward and {v["fields"]["tile_n"] for v in forward} == {tile_n}
