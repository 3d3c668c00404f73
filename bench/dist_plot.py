"""Scaling plot of bench/dist.py's rows: per-GPU TFLOP/s against the number of GPUs, one column
per mask, forward above and backward below, maskc beside the baselines measured in the same
runs.

`python bench/dist_plot.py ROWS.jsonl [...] --out PLOT.png [--plan 1f]`: the rows of several
torchrun runs (one per GPU count). maskc is the cost model's plan (`maskc`), or with --plan a
forced one: for "1f" (one stage, local keys fused) a row's `maskc_1f` entry, or its `maskc`
entry when the model picked that plan.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASELINES = {"torch_ring": "PyTorch ring CP", "flex_allgather": "all-gather + FlexAttention"}


def maskc_figure(row: dict[str, Any], plan: str) -> list[float] | None:
    """The row's (fwd, bwd) TFLOP/s of maskc with stage plan `plan` ("model", "2", "1f", ...)."""
    chosen = f"{row['num_stages']}{'f' if row.get('fuse_local') else ''}"
    value = row.get("maskc") if plan in ("model", chosen) else row.get(f"maskc_{plan}")
    return value if isinstance(value, list) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--plan", default="model", help="maskc's stage plan: the model's, or a stage count ('f': fused)")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.rows for line in path.read_text().splitlines() if '"mask"' in line]
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    fig, axes = plt.subplots(2, len(masks), figsize=(3.2 * len(masks), 6), sharex=True, squeeze=False)
    series = {f"maskc ({args.plan})": lambda r: maskc_figure(r, args.plan)}
    series.update({label: (lambda r, key=key: r.get(key) if isinstance(r.get(key), list) else None) for key, label in BASELINES.items()})
    for col, mask in enumerate(masks):
        mine = sorted((r for r in rows if r["mask"] == mask), key=lambda r: r["cp"])
        for label, figure in series.items():
            points = [(r["cp"], figure(r)) for r in mine if figure(r) is not None]
            for direction, ax in enumerate(axes[:, col]):
                ax.plot([p[0] for p in points], [p[1][direction] for p in points], marker="o", label=label)
        axes[0, col].set_title(mask)
        axes[1, col].set_xlabel("GPUs (16k tokens each)")
        cps = sorted({r["cp"] for r in mine})
        axes[1, col].set_xticks(cps)
    axes[0, 0].set_ylabel("forward TFLOP/s per GPU")
    axes[1, 0].set_ylabel("backward TFLOP/s per GPU")
    for ax in axes.ravel():
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0, -1].legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
