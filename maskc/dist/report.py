"""What `maskc plan` prints and draws for a context-parallel plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from maskc.dist.plan import Plan
from maskc.picture import subplots, write_png


def format_report(plan: Plan, name: str) -> str:
    """Balance (per-rank area against the lower bound), communication against ring P2P and
    all-gather (rows and bytes), overlap stages and the modelled time, as text."""
    s = plan.summary()
    areas = plan.rank_areas()
    row_bytes = plan.cost.bytes_per_row
    comm = s["comm_rows_total"]

    def volume(rows: int, baseline: bool = True) -> str:
        share = f" ({rows / comm:.2f}x maskc)" if comm and baseline else ""
        return f"{rows:>14,} rows {rows * row_bytes / 2**30:10.2f} GiB{share}"

    lines = [
        f"plan {name}: {s['seqlen']} tokens (padded to {s['padded_length']}) over {s['cp_size']} ranks, "
        f"{plan.num_chunks} chunks of {s['chunk_size']}, dispatch {s['algorithm']!r}",
        f"  area per rank   min {areas.min():,}  mean {areas.mean():,.0f}  max {areas.max():,}",
        f"  imbalance       {s['imbalance']:.4f} (max / mean); lower bound on max {s['lower_bound']:,} "
        f"({s['max_area'] / max(s['lower_bound'], 1):.4f}x)",
        "  K/V rows received, forward (the backward sends as many dK/dV rows back):",
        f"    maskc         {volume(comm, baseline=False)}",
        f"    ring P2P      {volume(s['ring_p2p_rows_total'])}",
        f"    all-gather    {volume(s['allgather_rows_total'])}",
        f"  overlap stages  {s['num_stages']}{' (the first fused with the local keys: one call)' if s['fuse_local'] else ''}; "
        f"modelled forward {s['modelled_forward_s'] * 1e3:.3f} ms, "
        f"backward {s['modelled_backward_s'] * 1e3:.3f} ms",
        f"  {'rank':>6} {'chunks':>7} {'area':>16} {'recv MiB':>10} {'ring MiB':>10} {'all-gather MiB':>15}",
    ]
    mib = row_bytes / 2**20
    for r in s["ranks"]:
        lines.append(
            f"  {r['rank']:>6} {len(r['chunks']):>7} {r['area']:>16,} {r['recv_rows'] * mib:>10.1f} "
            f"{r['ring_p2p_recv_rows'] * mib:>10.1f} {r['allgather_recv_rows'] * mib:>15.1f}"
        )
    return "\n".join(lines)


def save_plan_picture(plan: Plan, path: str | Path, title: str) -> Path:
    """PNG: which rank owns each chunk (top) and each rank's area against the mean and the lower
    bound (bottom)."""
    fig, (top, bottom) = subplots(2, 1, figsize=(10, 5), gridspec_kw={"height_ratios": [1, 2]})
    top.imshow(plan.rank_of_chunk[None, :], aspect="auto", cmap="turbo", interpolation="nearest", vmin=0,
               vmax=max(plan.cp_size - 1, 1))  # fmt: skip
    top.set_yticks([])
    top.set_xlabel(f"chunk ({plan.chunk_size} tokens), coloured by rank")
    areas = plan.rank_areas()
    bottom.bar(np.arange(plan.cp_size), areas, color="tab:blue")
    bottom.axhline(areas.mean(), color="tab:green", label="mean")
    bottom.axhline(plan.lower_bound(), color="tab:red", linestyle="--", label="lower bound on max")
    bottom.set_xlabel("rank")
    bottom.set_ylabel("mask area")
    bottom.legend(fontsize=8)
    fig.suptitle(f"{title}: cp {plan.cp_size}, imbalance {plan.imbalance():.3f}", fontsize=10)
    fig.tight_layout()
    return write_png(fig, path, dpi=110)
