"""Render a kernel variant's Jinja template into CuTe-DSL Python source.

Templates live in `templates/` (installed as the package `maskc.templates`); each
kernel family has one top-level template that includes small macro files, so the
mask, schedule, softmax and epilogue code exists in one place for every architecture.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import sys
from pathlib import Path

import jinja2

from maskc.artifact.abi import ENTRY_POINTS, PACE_COUNTERS
from maskc.artifact.kernel_families import DIRECTIONS, DTYPES, FAMILIES, SM100, WARPGROUP_ROWS, portable_warps
from maskc.artifact.variant import KernelVariant, variant_for

_DTYPES = {d.name: d for d in DTYPES}


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja environment: templates/ on the loader path, undefined names are errors."""
    root = importlib.resources.files("maskc.templates")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_name(variant: KernelVariant) -> str:
    """The top-level template of the variant's kernel family and direction."""
    return f"attn_{variant.direction}_{variant.family.templates}.py.jinja"


def context(variant: KernelVariant) -> dict:
    """Everything a template may read: the variant's fields, the argument ABIs its signature is
    rendered from (`entry_points`), plus derived static values."""
    base = {
        "v": variant,
        "key": variant.key(),
        "dtype_cutlass": f"cutlass.{_DTYPES[variant.dtype].cutlass}",
        "entry_points": ENTRY_POINTS,
        "pace_counters": PACE_COUNTERS,
    }
    if variant.portable:
        warps = portable_warps(variant.direction, variant.tile_m, variant.tile_n)
        return {**base, "num_warps": warps, "num_threads": 32 * warps, "dq_grid": variant.portable_dq_grid}
    if variant.family is SM100:
        # TMEM-owning warps (forward: 4 softmax; backward: 8 computing P and dS, 4 reducing dQ),
        # one MMA warp, one TMA warp.
        return {**base, "num_threads": 448 if variant.direction == "bwd" else 192}
    num_wg = variant.num_mma_warpgroups
    # Registers per thread after setmaxnreg: producer down, consumers up (sum fits 64K regs).
    producer_regs, consumer_regs = {2: (24, 240), 3: (32, 160)}[num_wg]
    return {
        **base,
        "dtype_torch": f"torch.{_DTYPES[variant.dtype].torch}",
        "wg_rows": WARPGROUP_ROWS,
        "num_mma_wg": num_wg,
        "q_stages": variant.q_stages,
        "num_threads": 128 * (num_wg + 1),
        "producer_regs": producer_regs,
        "consumer_regs": consumer_regs,
    }


def _tidy(source: str) -> str:
    """Blank lines left by macro calls: at most two between top-level blocks, one inside them."""
    source = re.sub(r"\n{4,}", "\n\n\n", source)
    return re.sub(r"\n{3,}(?=[ \t]+\S)", "\n\n", source)


def render(variant: KernelVariant) -> str:
    """The CuTe-DSL source of `variant` (a Python module defining its entry point, `attn_fwd` or `attn_bwd`)."""
    return _tidy(environment().get_template(template_name(variant)).render(**context(variant)))


def reference_variants() -> dict[str, KernelVariant]:
    """The kernels committed rendered in docs/kernels/ so that they can be read without running
    the compiler (and a template change shows up as a diff of kernel code), by file name: each
    family's forward and backward at `maskc compile`'s defaults (heads 64:8, head dim 128, bf16,
    no options), the plain forward (not tall, no PackGQA) and the masked backward; the next
    portable kernels' as `<name>_next.py`."""
    variants = {}
    for family in FAMILIES:
        for direction in DIRECTIONS:
            request = {"arch": family.archs[0], "direction": direction, "head_dim": 128, "dtype": "bf16",
                       "num_heads_q": 64, "num_heads_kv": 8, **family.selector}  # fmt: skip
            variant = variant_for(request)
            name = template_name(variant).removesuffix(".py.jinja") + ("_next" if variant.portable_next else "")
            variants[f"{name}.py"] = variant
    return variants


def write_references(folder: Path) -> None:
    """Render every reference variant into `folder` (docs/kernels), one module per file name."""
    for name, variant in reference_variants().items():
        (folder / name).write_text(render(variant))


if __name__ == "__main__":  # python -m maskc.codegen.render docs/kernels
    write_references(Path(sys.argv[1]))
