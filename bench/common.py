"""Shared benchmark inputs and timing: real document lengths, a median-of-runs timer."""

from __future__ import annotations

import csv
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HISTOGRAM = ROOT / "bench" / "data" / "doc_length_distribution.csv"


def draw_doc_lengths(count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` raw document lengths from the real histogram (uniform inside each bin)."""
    lo, hi, weight = [], [], []
    with HISTOGRAM.open(newline="") as f:
        for row in csv.DictReader(f):
            a, b = map(int, re.findall(r"\d+", row["range"]))
            lo.append(max(a, 1))
            hi.append(b)
            weight.append(int(row["number"]))
    p = np.asarray(weight, dtype=np.float64)
    bins = rng.choice(len(p), size=count, p=p / p.sum())
    return rng.integers(np.asarray(lo)[bins], np.asarray(hi)[bins] + 1)


def sample_doc_lengths(total: int, count: int, seed: int = 0) -> np.ndarray:
    """Exactly `count` lengths shaped like the histogram, each in [1, total // 4], summing to `total`."""
    rng = np.random.default_rng(seed)
    cap = total // 4
    lens = np.minimum(draw_doc_lengths(count, rng), cap)
    lens = np.clip(np.floor(lens * (total / lens.sum())).astype(np.int64), 1, cap)
    # Rounding and clipping leave a few tokens over or under; move them one token at a time.
    while (diff := total - int(lens.sum())) != 0:
        movable = np.flatnonzero(lens < cap) if diff > 0 else np.flatnonzero(lens > 1)
        chosen = rng.permutation(movable)[: abs(diff)]
        lens[chosen] += 1 if diff > 0 else -1
    return lens


def pack_documents(total: int, seed: int = 0) -> np.ndarray:
    """The seeds' varlen inputs: raw draws from the histogram, each capped at a quarter of the
    sequence, packed in draw order until `total` tokens (the last document cut to fit)."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(draw_doc_lengths(max(64, total // 64), rng), max(total // 4, 1))
    while lens.sum() < total:
        lens = np.r_[lens, np.minimum(draw_doc_lengths(max(64, total // 64), rng), max(total // 4, 1))]
    cut = int(np.searchsorted(np.cumsum(lens), total))
    lens = lens[: cut + 1].copy()
    lens[-1] -= int(lens.sum()) - total
    return lens[lens > 0].astype(np.int64)


def timed(fn: Callable[[], object], runs: int) -> tuple[float, float, object]:
    """(median ms, min ms, last result) over `runs` calls after one warm-up call."""
    result = fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), result

