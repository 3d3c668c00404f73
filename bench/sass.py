"""The block loops of maskc's compiled kernels, read from their SASS: what to check before a
kernel change costs GPU time (`docs/design/fa4-comparison.md`, `docs/design/portable-kernels.md`).

    python bench/sass.py --direction bwd --head-dim 128 [--unmasked] [--heads 64:8] [--out DIR]
    python bench/sass.py --direction bwd --head-dim 128 --arch sm_80 --portable [--portable-next]
    python bench/sass.py --listing FILE

compiles, on any machine, the variant a call with those fields runs (its family's tile; SM90's
own kernels unless `--arch` and `--portable` say otherwise), keeps its cubin and disassembles it
with nvdisasm (`pip install nvidia-cuda-nvdisasm`, or the path in $NVDISASM); `--listing` reads
an `nvdisasm -c` listing of any cubin instead (another library's kernel, to compare). It prints
ptxas's report (registers, stack and spill bytes) and, for each innermost loop that issues
matrix products (HGMMA or HMMA: the block loops), its instructions and those worth watching:
local loads and stores (spills), shared-memory traffic, global loads and L2 reductions,
branches, barriers, R2UR (operands moved to the uniform datapath inside the loop) and MUFU.
Counts are static, per pass through the loop's code: a branch the loop skips (a partial block's
masking, say) still counts. A profile, not a benchmark: it writes no rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel import parse_head_dims, parse_heads  # noqa: E402
from report import markdown_table  # noqa: E402

from maskc.artifact.kernel_families import ARCH_NAMES, HeadDim  # noqa: E402
from maskc.errors import MaskcError  # noqa: E402

#: Opcodes (without modifiers) the loop table counts, by column title.
WATCHED = {
    "HGMMA / HMMA": ("HGMMA", "HMMA"),
    "local ld / st": ("LDL", "STL"),
    "shared ld / st": ("LDS", "LDSM", "STS", "STSM"),
    "global ld / red": ("LDG", "RED"),
    "branches": ("BRA",),
    "barriers": ("BAR",),
    "R2UR": ("R2UR",),
    "MUFU": ("MUFU",),
}

_TEXT = re.compile(r"^\s*\.text\.(\S+):")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?(\.L_x_\d+)")


@dataclass(frozen=True)
class Loop:
    """A loop of one kernel: its instructions from the back edge's target to the back edge."""

    kernel: str
    first: int
    last: int
    opcodes: Counter

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def opcode(instruction: str) -> str:
    """An instruction's opcode without its predicate and modifiers ("@!P0 LDS.64 R2, [R3]" -> "LDS")."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split(maxsplit=1)[0].split(".")[0]


def loops(sass: str) -> list[Loop]:
    """Every loop of an nvdisasm listing: a branch back to a label at or before it, per kernel."""
    kernel, instructions, labels, found = "", [], {}, []
    for line in sass.splitlines() + [".text.end:"]:
        if m := _TEXT.match(line):
            for i, text in enumerate(instructions):
                target = _BRANCH.search(text)
                if target and labels.get(target.group(1), i + 1) <= i:
                    first = labels[target.group(1)]
                    found.append(Loop(kernel, first, i, Counter(opcode(t) for t in instructions[first : i + 1])))
            kernel, instructions, labels = m.group(1), [], {}
        elif m := _LABEL.match(line):
            labels[m.group(1)] = len(instructions)
        elif m := _INSTRUCTION.match(line):
            instructions.append(m.group(1))
    return found


def block_loops(sass: str) -> list[Loop]:
    """The innermost loops that issue matrix products (wgmma or warp MMAs): the back edge of no
    other such loop of their kernel lies inside them (ptxas may enter an outer loop in the middle
    of an inner one, so their ranges can overlap without nesting)."""
    mma = [loop for loop in loops(sass) if any(loop.opcodes[op] for op in WATCHED["HGMMA / HMMA"])]
    return [
        loop for loop in mma
        if not any(o is not loop and o.kernel == loop.kernel and loop.first <= o.last < loop.last for o in mma)
    ]  # fmt: skip


def short_name(kernel: str) -> str:
    """A maskc kernel's symbol up to its name's end ("kernel_cutlass_attn_bwd_kernel_CopyAtom..." ->
    "attn_bwd_kernel"); another's whole (a listing's C++ instantiations differ in their arguments)."""
    m = re.match(r"kernel_cutlass_(.*?kernel)(?:_|$)", kernel)
    return m.group(1) if m else kernel


def loop_table(sass: str) -> list[str]:
    """The block loops as a markdown table."""
    rows = []
    for loop in block_loops(sass):
        counts = [" / ".join(str(loop.opcodes[op]) for op in ops) for ops in WATCHED.values()]
        rows.append([short_name(loop.kernel), f"{loop.first}-{loop.last}", str(loop.size), *counts])
    return markdown_table(["kernel", "first-last", "instructions", *WATCHED], rows, list(range(2, 3 + len(WATCHED))))


def find_nvdisasm() -> str:
    """nvdisasm: $NVDISASM, on PATH, or from the nvidia-cuda-nvdisasm wheel."""
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not found and (spec := importlib.util.find_spec("nvidia")) is not None:
        wheel = [path for root in spec.submodule_search_locations for path in sorted(Path(root).glob("*/bin/nvdisasm"))]
        found = str(wheel[0]) if wheel else None
    if not found:
        raise MaskcError("nvdisasm not found: `pip install nvidia-cuda-nvdisasm`, or set $NVDISASM to its path")
    return found


#: The variant flags the command line may set.
FLAGS = ("unmasked", "tall", "pack_gqa", "deterministic", "portable", "portable_next")


def request(direction: str, head_dim: HeadDim, heads: tuple[int, int], dtype: str = "bf16",
            flags: Iterable[str] = (), arch: str = "sm_90a") -> dict:  # fmt: skip
    """The runtime request of the variant to read on `arch` (no softcap, sinks or max logits),
    with `flags` (of FLAGS) on: "portable" for the portable kernels, and so on."""
    return {
        "arch": arch, "direction": direction, "head_dim": head_dim.qk, "head_dim_v": head_dim.v, "dtype": dtype,
        "num_heads_q": heads[0], "num_heads_kv": heads[1], "has_softcap": False, "has_sink": False,
        "has_max_logits": False, "pack_gqa": False, "deterministic": False, "portable": False,
        **{flag: True for flag in flags},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--direction", choices=("fwd", "bwd"))
    parser.add_argument("--head-dim", type=parse_head_dims, help="D, or Dqk/Dv like 192/128")
    parser.add_argument("--arch", choices=ARCH_NAMES, default="sm_90a", help="the arch compiled for (default sm_90a)")
    parser.add_argument("--heads", type=parse_heads, default=[(64, 8)], help="HQ:HKV (default 64:8)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    for flag in FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", action="store_true", help=f"the variant with {flag}")
    parser.add_argument("--out", type=Path, help="keep the source, cubin and SASS here (default: a temporary folder)")
    parser.add_argument("--listing", type=Path, help="read this nvdisasm -c listing instead of compiling a variant")
    args = parser.parse_args()
    if args.listing:
        try:
            print("\n".join(loop_table(args.listing.read_text())))
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"cannot read the listing {args.listing}: {error}")
        return
    if not (args.direction and args.head_dim):
        parser.error("--direction and --head-dim name the variant to compile (or --listing a listing to read)")
    nvdisasm = find_nvdisasm()

    from maskc.artifact.variant import variant_for
    from maskc.codegen.compile import compile_variant

    flags = [flag for flag in FLAGS if getattr(args, flag)]
    try:
        variant = variant_for(request(args.direction, args.head_dim[0], args.heads[0], args.dtype, flags, args.arch))
    except MaskcError as error:
        parser.error(str(error))
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        built = compile_variant(variant, out, keep_ptx=False, keep_cubin=True)
        print(f"{built.key}: {built.ptxas}")
        for cubin in sorted((out / f"{built.key}.dump").rglob("*.cubin")):
            sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            cubin.with_suffix(".sass").write_text(sass)
            print("\n".join(loop_table(sass)))


if __name__ == "__main__":
    main()
