"""Lowering speed: examples/varlen_block_causal.mask over 1M tokens in 4,000 documents.

Lowering runs at every training step (document boundaries change every batch), so it must
cost a small fraction of a step. Run: `python bench/lower.py [--runs 30] [--block 2048]`;
appends host rows to bench/results (or --out; see bench/README.md) and prints them.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import sample_doc_lengths, timed  # noqa: E402
from record import RESULTS, Run, cpu_device  # noqa: E402

from maskc.frontend import load  # noqa: E402
from maskc.ir import Mask  # noqa: E402

FAMILY_FILE = ROOT / "examples" / "varlen_block_causal.mask"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args()
    run = Run.start("lower", cpu_device(), args.out)

    lens = sample_doc_lengths(args.tokens, args.docs)
    lens_list = lens.tolist()
    family = load(FAMILY_FILE)["varlen_block_causal"]
    python_family = runpy.run_path(str(ROOT / "examples" / "python_mask.py"))["varlen_block_causal"]
    mask = family.lower(docs=lens, block=args.block)
    q, k, t = mask.q_ranges.copy(), mask.k_ranges.copy(), mask.types.copy()

    rows = [
        ("load .mask (parse + check)", lambda: load(FAMILY_FILE), False),
        ("DSL lower, docs as numpy", lambda: family.lower(docs=lens, block=args.block), True),
        ("DSL lower, docs as list", lambda: family.lower(docs=lens_list, block=args.block), True),
        ("@maskc.mask lower (vectorised)", lambda: python_family.lower(docs=lens, block=args.block), True),
        ("  of which Mask.from_arrays", lambda: Mask.from_arrays(q, k, t, mask.seqlen_q, mask.seqlen_k), True),
    ]
    inputs = f"{len(lens):,} documents, {int(lens.sum()):,} tokens, block {args.block}"
    print(
        f"varlen_block_causal: {len(lens)} docs, {int(lens.sum()):,} tokens, block {args.block}; "
        f"doc length min/median/max {lens.min()}/{int(np.median(lens))}/{lens.max()}"
    )
    print(f"{'stage':<32}{'median ms':>11}{'min ms':>10}{'slices':>9}")
    for name, fn, is_mask in rows:
        median, best, result = timed(fn, args.runs)
        slices = str(len(result)) if is_mask else "-"
        print(f"{name:<32}{median:>11.3f}{best:>10.3f}{slices:>9}")
        label = name.strip().replace("of which", "the lowering's")
        step = f"varlen_block_causal.mask: {label}" + (f" ({inputs})" if is_mask else "")
        run.write("host", step=step, ms=median, min_ms=best)


if __name__ == "__main__":
    main()
