"""The `maskc` command line: inspect mask files and compile them to artifact directories."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import maskc
from maskc.artifact import kernel_families
from maskc.errors import MaskcError, MaskParamError
from maskc.lazy import optional_imports

if TYPE_CHECKING:
    from maskc.ir import Mask

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


def _plan(args: argparse.Namespace) -> int:
    """Plan every family context parallelism can take; say in one line why each other one is
    skipped. --json and --png take one plan: exactly one family must be plannable."""
    from maskc.dist.plan import make_plan, unplannable
    from maskc.dist.report import format_report, save_plan_picture

    masks, skipped = [], []
    for family, given in _select(args.file, args.mask, args.param):
        mask = family.lower(**given)
        reason = unplannable(mask)
        if reason is None:
            masks.append((family.name, mask))
        else:
            skipped.append(f"mask {family.name}: {reason}")
    if not masks and len(skipped) == 1:
        raise MaskcError(f"cannot plan {skipped[0]}")
    for line in skipped:
        print(f"maskc: skipping {line}", file=sys.stderr)
    if not masks:
        raise MaskcError(f"no mask of {args.file} can be planned")
    for option in ("json", "png"):
        if getattr(args, option) and len(masks) > 1:
            raise MaskcError(f"--{option} takes one plan; {args.file} has {len(masks)} plannable masks: pick one with --mask")
    for name, mask in masks:
        plan = make_plan(mask, args.cp, args.chunk_size, algorithm=args.algorithm, num_stages=args.stages,
                         fuse_local=args.fuse_local)  # fmt: skip
        print(plan.to_json() if args.json else format_report(plan, name))
        if args.png:
            written = save_plan_picture(plan, args.png, name)
            print(f"  picture         {written}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _csv(kind: type, what: str, choices: Sequence | None = None):
    """argparse type for a comma-separated list of `kind` values (each one of `choices`, where given)."""

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except argparse.ArgumentTypeError:
            raise
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}") from None
        unknown = [v for v in values if choices is not None and v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"no kernels for {', '.join(map(str, unknown))}; choose from {', '.join(map(str, choices))}"
            )
        return values

    return parse


def _arch_help() -> str:
    """The archs of the kernel families table, each with the kernels it gets."""
    own = [f"{a} ({'the portable kernels and its own, experimental' if f.experimental else 'its own kernels'})"
           for a in kernel_families.ARCH_NAMES if (f := kernel_families.native_family(a)) is not None]  # fmt: skip
    portable = [a for a in kernel_families.ARCH_NAMES if kernel_families.native_family(a) is None]
    return f"target archs: {', '.join(own)}, {', '.join(portable)} (the portable kernels only); default: sm_90a"


def _heads(text: str) -> tuple[int, int]:
    q, sep, kv = text.partition(":")
    try:
        pair = (int(q), int(kv if sep else q))
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads must look like HQ:HKV (e.g. 64:8), got {text!r}") from None
    if pair[0] <= 0 or pair[1] <= 0 or pair[0] % pair[1]:
        raise argparse.ArgumentTypeError(f"heads {text!r}: query heads must be a positive multiple of kv heads")
    return pair


def _kernel_requests(args: argparse.Namespace, masks: list[Mask]) -> list[dict[str, Any]]:
    """The kernels `maskc compile` builds for these options (maskc.codegen.matrix)."""
    from maskc.codegen.matrix import Features, kernel_requests

    features = Features(softcap=args.softcap, sink=args.sink, max_logits=args.max_logits,
                        deterministic=args.deterministic, portable=args.portable,
                        portable_next=args.portable_next)  # fmt: skip
    return kernel_requests(args.arch, args.head_dim, args.heads, args.dtype, features, masks)


def _compile(args: argparse.Namespace) -> int:
    from maskc.codegen import LoweredMask, write_artifact

    lowered = [
        LoweredMask(family.name, {**family.defaults, **given}, family.lower(**given))
        for family, given in _select(args.file, args.mask, args.param)
    ]
    kernels, library = [], None
    if not args.ir_only:
        with optional_imports("`maskc compile`"):
            from tqdm import tqdm

        from maskc.artifact.variant import variant_for
        from maskc.codegen.cache import cached_kernel, compressed_runtime_library

        variants = [variant_for(r) for r in _kernel_requests(args, [item.mask for item in lowered])]
        for variant in tqdm(variants, desc="compiling kernels", unit="variant", disable=len(variants) < 2):
            kernels.append(cached_kernel(variant))
        library = compressed_runtime_library() if args.bundle_runtime else None
    plans = None
    if args.cp is not None:
        from maskc.dist.plan import make_plan

        plans = {
            item.name: make_plan(item.mask, args.cp, args.chunk_size, algorithm=args.algorithm).to_json()
            for item in lowered
        }
    manifest = write_artifact(args.output, lowered, source=Path(args.file), kernels=kernels, runtime_library=library,
                              plans=plans, overwrite=args.overwrite)  # fmt: skip
    for item in lowered:
        print(f"{item.name}: {len(item.mask)} slices, {item.mask.seqlen_q} x {item.mask.seqlen_k}, area {item.mask.area()}")
    print(f"{len(kernels)} kernel variant(s); wrote {manifest}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Verify an artifact directory as the runtime would, print the digest that pins it, and
    with --rebuild recompile its kernels and compare them byte for byte (status 1 where any
    differs)."""
    from maskc.artifact.manifest import open_manifest

    manifest = open_manifest(args.directory, args.sha256)
    body = manifest.body
    variants = body.get("variants", [])
    print(f"{args.directory}: every file matches its manifest ({len(manifest.files)} files)")
    print(f"  manifest sha256  {manifest.sha256}")
    print(f"  masks            {', '.join(body.get('masks', {})) or 'none'}")
    print(f"  kernels          {len(variants)} ({', '.join(body.get('archs', [])) or 'no arch'})")
    if not args.rebuild:
        return 0
    from maskc.codegen.reproduce import rebuild

    results = rebuild(manifest)
    for result in results:
        print(f"  {result.key}: {'identical' if result.identical else 'DIFFERS: ' + '; '.join(result.differences)}")
    same = sum(r.identical for r in results)
    print(f"rebuilt {len(results)} kernel(s): {same} identical, {len(results) - same} different")
    return 0 if same == len(results) else 1


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error as one line (not the usage block), like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="maskc", description=maskc.__doc__)
    parser.add_argument("--version", action="version", version=f"maskc {maskc.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def dist_options(p, required: bool) -> None:
        p.add_argument("--cp", type=_positive, required=required, metavar="N", help="context-parallel ranks")
        p.add_argument("--chunk-size", type=_positive, metavar="T", help="tokens per chunk (default: from seqlen and cp)")
        p.add_argument(
            "--algorithm",
            default="swap",
            help="chunk dispatch: contiguous, greedy (the seeds' min-heap), swap (default: greedy + exchanges) "
            "or local (exchanges from contiguous: less communication)",
        )

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("file", metavar="FILE", help="a .mask file")
        p.add_argument("--mask", metavar="NAME", help="act on this mask family only (default: every family in FILE)")
        p.add_argument("--param", "-p", metavar="NAME=VALUE", action="append", default=[], help=PARAM_HELP)

    show = sub.add_parser("show", help="lower masks and report slices, area, density and a PNG picture")
    common(show)
    show.add_argument("--png-dir", default="build", metavar="DIR", help="where to write NAME.png (default: build)")
    show.add_argument("--no-png", action="store_true", help="print the report only")
    show.add_argument("--size", type=_positive, default=512, metavar="N", help="picture cells per side (default: 512)")
    show.set_defaults(func=_show)

    comp = sub.add_parser("compile", help="lower masks and write an artifact directory (IR + manifest)")
    common(comp)
    comp.add_argument("-o", "--output", required=True, metavar="DIR", help="artifact directory to write")
    comp.add_argument(
        "--overwrite", action="store_true",
        help="replace the artifact DIR already holds, removing the files of its manifest that the new one does not list "
        "(without it, a DIR holding another artifact is refused)",
    )  # fmt: skip
    kernel = comp.add_argument_group("kernels (compiled ahead of time; no GPU needed)")
    kernel.add_argument("--arch", type=_csv(str, "archs", kernel_families.ARCH_NAMES), default=["sm_90a"], help=_arch_help())
    head_dims, dtypes = ",".join(map(str, kernel_families.HEAD_DIMS)), ",".join(kernel_families.DTYPE_NAMES)
    kernel.add_argument("--head-dim", type=_csv(kernel_families.HeadDim.parse, "head dims (D, or QK/V like 192/128)",
                        kernel_families.HEAD_DIMS), default=[kernel_families.HeadDim(128, 128)],
                        help=f"head dims among {head_dims} (QK/V: q and k QK, v V; default: 128)")  # fmt: skip
    kernel.add_argument("--heads", type=_csv(_heads, "HQ:HKV pairs"), default=[(64, 8)], help="query:kv heads, e.g. 64:8,8:8 (default: 64:8)")
    kernel.add_argument("--dtype", type=_csv(str, "dtypes", kernel_families.DTYPE_NAMES), default=["bf16"],
                        help=f"dtypes among {dtypes} (default: bf16)")  # fmt: skip
    kernel.add_argument("--softcap", action="store_true", help="variants with logit softcapping")
    kernel.add_argument("--sink", action="store_true", help="variants with attention sinks")
    kernel.add_argument("--max-logits", action="store_true", help="variants that also return max logits")
    kernel.add_argument(
        "--deterministic", action="store_true", help="also the deterministic backward (bitwise reproducible gradients)"
    )
    kernel.add_argument(
        "--portable", action="store_true", help="also the portable kernels where an arch has kernels of its own"
    )
    kernel.add_argument(
        "--portable-next", action="store_true",
        help="also the experimental next portable kernels (checked on an H100 only; the runtime takes them with MASKC_PORTABLE_NEXT=1) "
        "beside the portable ones; a head dim that only they have gets them without it",
    )  # fmt: skip
    kernel.add_argument("--bundle-runtime", action="store_true", help="ship libcute_dsl_runtime.so.xz in the artifact directory")
    kernel.add_argument("--ir-only", action="store_true", help="write the IR and manifest only, no kernels")
    dist_options(comp.add_argument_group("context parallelism (the plan goes into the artifact directory)"), False)
    comp.set_defaults(func=_compile)

    plan = sub.add_parser("plan", help="context-parallel plan: chunk dispatch, communication tables, overlap stages")
    common(plan)
    dist_options(plan, True)
    plan.add_argument("--stages", type=_positive, metavar="N", help="overlap stages (default: the cost model's best)")
    plan.add_argument(
        "--fuse-local", action=argparse.BooleanOptionalAction, default=None,
        help="run the first stage's keys in the local call, or not (default: the cost model's choice)",
    )
    plan.add_argument("--json", action="store_true", help="print Plan.to_json() (one mask: pick it with --mask)")
    plan.add_argument(
        "--png", metavar="PATH", help="also draw which chunks went where and the per-rank areas, as a PNG at PATH"
    )
    plan.set_defaults(func=_plan)

    verify = sub.add_parser("verify", help="check an artifact directory against its manifest; print the digest that pins it")
    verify.add_argument("directory", metavar="DIR", help="an artifact directory (maskc compile -o DIR)")
    verify.add_argument("--sha256", metavar="HEX", help="the manifest digest the directory must have (as published beside it)")
    verify.add_argument(
        "--rebuild", action="store_true",
        help="also recompile every kernel from its recorded variant and compare the files byte for byte (needs the CUTLASS DSL)",
    )  # fmt: skip
    verify.set_defaults(func=_verify)
    return parser


def _describe(exc: OSError) -> str:
    """An OS error as one line naming the file: 'out/x.png: Permission denied'."""
    if exc.filename is None:
        return exc.strerror or str(exc)
    return f"{exc.filename}: {exc.strerror or exc}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A user error (bad input, a file that cannot be read or written) prints
    one line and returns 2; anything else is a bug and raises with its traceback."""
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # The reader (`| head`) went away: end quietly, and keep the interpreter's final flush
        # of stdout from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a process that a broken pipe stopped reports
    except KeyboardInterrupt:
        return 130
    except MaskcError as exc:
        message = str(exc)
    except OSError as exc:
        message = _describe(exc)
    print(f"maskc: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
