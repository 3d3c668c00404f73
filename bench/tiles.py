"""Tile-shape A/B of maskc's kernels: the kernel family's own tiles against others, alternating.

A tile shape is compiled into the kernel, so an A/B needs one artifact directory per shape:

    python bench/tiles.py build --out ab --head-dim 192 --tiles 128x64,128x112     # any machine
    python bench/tiles.py run ab/* --head-dims 192 --rounds 2 --backward          # the GPU machine

`build` compiles the 64:8 bf16 kernels of one head dim and direction with each tile shape (the
family table's own first, as `table`), checked against the shapes the templates are written for,
into DIR/<shape>. `run` times every directory in turn with `bench/kernel.py --no-baselines`,
round after round (measuring.md: only ratios within one call compare), writes its rows under
--out (a scratch folder: the rows do not say which tiles ran, so they stay out of
bench/results), and prints TFLOP/s per directory and round.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import MappingProxyType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ab import Arm, add_run_command, alternate  # noqa: E402
from record import read_results  # noqa: E402

from maskc.artifact import kernel_families  # noqa: E402
from maskc.artifact.kernel_families import HeadDim, Tiles  # noqa: E402
from maskc.artifact.variant import KernelVariant  # noqa: E402
from maskc.errors import VariantError  # noqa: E402


def parse_tiles(text: str, stages: int) -> Tiles:
    """"128x112" (tile_m x tile_n) with `stages` pipeline stages."""
    m, sep, n = text.partition("x")
    if not sep or not m.isdigit() or not n.isdigit():
        raise argparse.ArgumentTypeError(f"a tile shape is MxN, like 128x112; got {text!r}")
    return Tiles(int(m), int(n), stages)


def checked(head_dim: HeadDim, direction: str, tiles: Tiles) -> Tiles:
    """`tiles`, or a VariantError saying why the SM90 templates have no such kernel."""
    KernelVariant("sm_90a", direction, head_dim.qk, "bf16", 64, 8, tiles.tile_m, tiles.tile_n, tiles.num_stages,
                  head_dim_v=head_dim.v)  # fmt: skip
    return tiles


def build(out: Path, head_dim: HeadDim, direction: str, shapes: list[Tiles]) -> list[Path]:
    """One `maskc compile` directory per tile shape: the table's own shape for `head_dim` is
    swapped for the shape while its kernels compile (the table is the one place tiles live)."""
    from maskc.cli import main

    kernel = kernel_families.SM90.kernel(direction)
    own = kernel.tiles[head_dim]
    dirs = []
    for tiles in [own, *(t for t in shapes if t != own)]:
        name = "table" if tiles == own else f"{tiles.tile_m}x{tiles.tile_n}s{tiles.num_stages}"
        object.__setattr__(kernel, "tiles", MappingProxyType({**kernel.tiles, head_dim: tiles}))
        try:
            code = main(["compile", str(ROOT / "examples" / "full.mask"), "-o", str(out / name), "--head-dim",
                         str(head_dim), "--heads", "64:8", "--dtype", "bf16"])  # fmt: skip
        finally:
            object.__setattr__(kernel, "tiles", MappingProxyType({**kernel.tiles, head_dim: own}))
        if code:
            raise SystemExit(code)
        dirs.append(out / name)
    return dirs


def run(dirs: list[Path], args: argparse.Namespace) -> None:
    """The directories timed in turn (`ab.alternate`); then a line per (directory, round)."""
    out = alternate([Arm(d.name, d) for d in dirs], args, ROOT / "bench")
    for d in dirs:
        for round_ in range(args.rounds):
            rows = [r for r in read_results(out / f"{d.name}.{round_}") if r["kind"] == "kernel"]
            cells = [f"{r['mask']} {r['seqlen'] // 1024}k {r['direction']} "
                     f"{r['tflops']:.0f}" if "tflops" in r else f"{r['mask']} {r['direction']} failed" for r in rows]  # fmt: skip
            print(f"{d.name} round {round_ + 1}: " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile one artifact directory per tile shape (no GPU needed)")
    b.add_argument("--out", type=Path, required=True, help="folder of the artifact directories")
    b.add_argument("--head-dim", type=HeadDim.parse, required=True, help="e.g. 128 or 192/128")
    b.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    b.add_argument("--tiles", required=True, help="comma-separated MxN shapes, e.g. 128x64,128x112")
    b.add_argument("--stages", type=int, default=2, help="pipeline stages of every shape (default: 2)")
    add_run_command(sub, "dirs", "directories `build` wrote", "tile_ab")
    args = parser.parse_args()
    if args.command == "build":
        try:
            shapes = [checked(args.head_dim, args.direction, parse_tiles(t, args.stages)) for t in args.tiles.split(",")]
        except (argparse.ArgumentTypeError, VariantError) as e:
            parser.error(str(e))
        for d in build(args.out, args.head_dim, args.direction, shapes):
            print(d)
    else:
        run(args.dirs, args)


if __name__ == "__main__":
    main()
