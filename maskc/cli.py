"""The `maskc` command line: inspect mask files and compile them to artifact directories."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import maskc
from maskc.errors import MaskcError, MaskParamError

PARAM_HELP = (
    "a runtime parameter NAME=VALUE (repeatable): an int (block=2048), a list of ints "
    "for seqlens/cu_seqlens parameters (docs=512,1024,300), or @FILE holding the list"
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parse_list(value: str, name: str) -> list[int]:
    if value.startswith("@"):
        try:
            value = Path(value[1:]).read_text()
        except OSError as exc:
            raise MaskParamError(f"parameter {name!r}: cannot read {value[1:]}: {exc.strerror}") from None
    items = [x for x in re.split(r"[\s,\[\]]+", value) if x]
    try:
        return [int(x) for x in items]
    except ValueError:
        raise MaskParamError(f"parameter {name!r} expects a list of integers, got {value!r}") from None


def _parse_value(kind: str, value: str, name: str) -> Any:
    if kind == "int":
        try:
            return int(value)
        except ValueError:
            raise MaskParamError(f"parameter {name!r} expects an integer, got {value!r}") from None
    return _parse_list(value, name)


def _select(path: str, mask_name: str | None, pairs: Sequence[str]) -> list[tuple[Any, dict[str, Any]]]:
    """The families to act on, each with the parameters given for it on the command line."""
    from maskc.frontend import load

    families = load(Path(path))
    if not families:
        raise MaskcError(f"{path} defines no mask")
    if mask_name is not None:
        if mask_name not in families:
            raise MaskcError(f"{path} has no mask {mask_name!r}; it defines: {', '.join(families)}")
        families = {mask_name: families[mask_name]}
    raw: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise MaskParamError(f"--param expects NAME=VALUE, got {pair!r}")
        raw[name.strip()] = value.strip()
    chosen = []
    used: set[str] = set()
    for family in families.values():
        kinds = {p.name: p.kind for p in family.params}
        given = {n: _parse_value(kinds[n], v, n) for n, v in raw.items() if n in kinds}
        used.update(given)
        chosen.append((family, given))
    unknown = sorted(set(raw) - used)
    if unknown:
        declared = sorted({p.name for f, _ in chosen for p in f.params})
        raise MaskParamError(
            f"unknown parameter(s) {', '.join(unknown)} for {', '.join(families)}; "
            f"declared: {', '.join(declared) or 'none'}"
        )
    return chosen


def _show(args: argparse.Namespace) -> int:
    from maskc.picture import save_picture

    for family, given in _select(args.file, args.mask, args.param):
        mask = family.lower(**given)
        norm = mask.normalize()
        print(f"mask {family.name}")
        print(f"  seqlen     {mask.seqlen_q} x {mask.seqlen_k}")
        print(f"  slices     {len(mask)} ({len(norm)} after normalisation)")
        print(f"  area       {mask.area()}")
        print(f"  density    {mask.density():.6f}")
        if not args.no_png:
            png = save_picture(mask, Path(args.png_dir) / f"{family.name}.png", title=family.name, size=args.size)
            print(f"  picture    {png}")
    return 0


def _compile(args: argparse.Namespace) -> int:
    from maskc.codegen import LoweredMask, write_artifact

    lowered = [
        LoweredMask(family.name, {**family.defaults, **given}, family.lower(**given))
        for family, given in _select(args.file, args.mask, args.param)
    ]
    manifest = write_artifact(args.output, lowered, source=Path(args.file))
    for item in lowered:
        print(f"{item.name}: {len(item.mask)} slices, {item.mask.seqlen_q} x {item.mask.seqlen_k}, area {item.mask.area()}")
    print(f"wrote {manifest}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maskc", description=maskc.__doc__)
    parser.add_argument("--version", action="version", version=f"maskc {maskc.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("file", metavar="FILE", help="a .mask file")
        p.add_argument("--mask", metavar="NAME", help="act on this mask family only (default: every family in FILE)")
        p.add_argument("--param", "-p", metavar="NAME=VALUE", action="append", default=[], help=PARAM_HELP)

    show = sub.add_parser("show", help="lower masks and report slices, area, density and a PNG picture")
    common(show)
    show.add_argument("--png-dir", default=".", metavar="DIR", help="where to write NAME.png (default: .)")
    show.add_argument("--no-png", action="store_true", help="print the report only")
    show.add_argument("--size", type=_positive, default=512, metavar="N", help="picture cells per side (default: 512)")
    show.set_defaults(func=_show)

    comp = sub.add_parser("compile", help="lower masks and write an artifact directory (IR + manifest)")
    common(comp)
    comp.add_argument("-o", "--output", required=True, metavar="DIR", help="artifact directory to write")
    comp.set_defaults(func=_compile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (MaskcError, OSError) as exc:
        print(f"maskc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
