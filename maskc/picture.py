"""Pictures of masks: a coverage image downsampled to at most `size` x `size` cells.

Each cell shows the fraction of its (query, key) pairs the mask allows. Columns are exact;
rows are sampled (the first row of every cell plus evenly spaced ones), so a 1M-token mask
draws in well under a second without materialising anything dense.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from maskc.files import write_atomic
from maskc.ir import Mask
from maskc.ir.slices import RowLines
from maskc.lazy import optional_imports

ROWS_PER_CELL = 4
PAIRS_PER_CHUNK = 4096


def coverage(mask: Mask, size: int = 512) -> np.ndarray:
    """float `[rows, cols]` image in [0, 1], rows = min(size, seqlen_q), cols = min(size, seqlen_k)."""
    sq, sk = mask.shape
    n_rows, n_cols = min(size, sq), min(size, sk)
    image = np.zeros((n_rows, n_cols))
    if n_rows == 0 or n_cols == 0:
        return image
    row_edges = np.linspace(0, sq, n_rows + 1).astype(np.int64)
    col_edges = np.linspace(0, sk, n_cols + 1).astype(np.int64)
    heights = np.diff(row_edges)
    picks = np.minimum(heights, ROWS_PER_CELL)
    cell_of_pick = np.repeat(np.arange(n_rows), picks)
    offset = np.arange(picks.sum()) - np.repeat(np.cumsum(picks) - picks, picks)
    rows = row_edges[cell_of_pick] + offset * heights[cell_of_pick] // picks[cell_of_pick]

    norm = mask.normalize()
    lines = RowLines.of(norm.q_ranges, norm.k_ranges, norm.types)
    first = np.searchsorted(rows, lines.r0)
    count = np.searchsorted(rows, lines.r1) - first
    owner = np.repeat(np.arange(len(count)), count)
    pick = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    for at in range(0, len(owner), PAIRS_PER_CHUNK):
        o, p = owner[at : at + PAIRS_PER_CHUNK], pick[at : at + PAIRS_PER_CHUNK]
        lo = lines.lo_a[o] + lines.lo_s[o] * rows[p]
        width = lines.hi_a[o] + lines.hi_s[o] * rows[p] - lo + 1
        # Keys of [lo, lo + width) left of each column edge; differences give per-cell counts.
        left_of = np.clip(col_edges[None, :] - lo[:, None], 0, width[:, None])
        np.add.at(image, cell_of_pick[p], np.diff(left_of, axis=1))
    return image / (picks[:, None] * np.diff(col_edges)[None, :])


def _pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (no display needed), imported on first use."""
    with optional_imports("drawing masks and plans"):
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot

    return pyplot


def subplots(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """`matplotlib.pyplot.subplots`, drawn without a display."""
    return _pyplot().subplots(*args, **kwargs)


def write_png(fig: Any, path: str | Path, dpi: int) -> Path:
    """Write `fig` as a PNG to exactly `path` (whatever its suffix), atomically, and close it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    _pyplot().close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, buffer.getvalue())


def save_picture(mask: Mask, path: str | Path, *, title: str = "", size: int = 512) -> Path:
    """Write a PNG of the mask (queries down, keys across) and return its path."""
    sq, sk = mask.shape
    aspect = min(max(sq / max(sk, 1), 0.25), 4.0)
    fig, ax = subplots(figsize=(6, 6 * aspect))
    ax.imshow(coverage(mask, size), cmap="Blues", vmin=0, vmax=1, extent=(0, sk, sq, 0), interpolation="nearest")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"{title}\n{len(mask)} slices, {sq} x {sk}, density {mask.density():.4f}".strip(), fontsize=9)
    fig.tight_layout()
    return write_png(fig, path, dpi=150)
