"""Lowering speed: examples/varlen_block_causal.mask over 1M tokens in 4,000 documents.

Lowering runs at every training step (document boundaries change every batch), so it must
cost a small fraction of a step. Run: `python bench/lower.py [--runs 30] [--block 2048]`.
"""

from __future__ import annotations

import argparse
import csv
import re
import runpy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maskc.frontend import load  # noqa: E402
from maskc.ir import Mask  # noqa: E402

HISTOGRAM = ROOT / "bench" / "data" / "doc_length_distribution.csv"
FAMILY_FILE = ROOT / "examples" / "varlen_block_causal.mask"


def sample_doc_lengths(total: int, count: int, seed: int = 0) -> np.ndarray:
    """`count` lengths from the real histogram, each in [1, total // 4], summing to `total`."""
    lo, hi, weight = [], [], []
    with HISTOGRAM.open(newline="") as f:
        for row in csv.DictReader(f):
            a, b = map(int, re.findall(r"\d+", row["range"]))
            lo.append(max(a, 1))
            hi.append(b)
            weight.append(int(row["number"]))
    rng = np.random.default_rng(seed)
    p = np.asarray(weight, dtype=np.float64)
    bins = rng.choice(len(p), size=count, p=p / p.sum())
    cap = total // 4
    lens = np.minimum(rng.integers(np.asarray(lo)[bins], np.asarray(hi)[bins] + 1), cap)
    lens = np.clip(np.floor(lens * (total / lens.sum())).astype(np.int64), 1, cap)
    # Rounding and clipping leave a few tokens over or under; move them one token at a time.
    while (diff := total - int(lens.sum())) != 0:
        movable = np.flatnonzero(lens < cap) if diff > 0 else np.flatnonzero(lens > 1)
        chosen = rng.permutation(movable)[: abs(diff)]
        lens[chosen] += 1 if diff > 0 else -1
    return lens


def timed(fn: Callable[[], object], runs: int) -> tuple[float, float, object]:
    """(median ms, min ms, last result) over `runs` calls after one warm-up call."""
    result = fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--docs", type=int, default=4000)
    args = parser.parse_args()

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
    print(
        f"varlen_block_causal: {len(lens)} docs, {int(lens.sum()):,} tokens, block {args.block}; "
        f"doc length min/median/max {lens.min()}/{int(np.median(lens))}/{lens.max()}"
    )
    print(f"{'stage':<32}{'median ms':>11}{'min ms':>10}{'slices':>9}")
    for name, fn, is_mask in rows:
        median, best, result = timed(fn, args.runs)
        slices = str(len(result)) if is_mask else "-"
        print(f"{name:<32}{median:>11.3f}{best:>10.3f}{slices:>9}")


if __name__ == "__main__":
    main()
