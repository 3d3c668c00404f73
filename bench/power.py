"""SM clock and board power while maskc's and FA4's kernels run back to back: is a gap cycles
or clock?

    python bench/power.py --artifacts DIR [--masks full,causal] [--heads 64:8] [--head-dim 128]

The H200 runs these kernels at its power cap (`docs/design/measuring.md`), so a kernel's
TFLOP/s is the work it does per cycle times a clock that its power draw sets. For each mask and
direction (16k tokens, bf16), the implementations take turns in `--rounds` windows of
`--window` seconds of calls back to back while nvidia-smi samples the SM clock and the board
power every 20 ms. Per window it prints TFLOP/s, the mean clock and power, and TFLOP/s per GHz:
where two libraries run at one clock, a gap between them is cycles; where they do the same work
per GHz, it is the clock. A profile, not a benchmark: it writes no rows. Run on the GPU machine,
with FA4 installed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from kernel import baselines, build_masks, forward_flops, inputs, maskc_call, parse_head_dims, parse_heads  # noqa: E402  # noqa: E402
from report import markdown_table  # noqa: E402

import maskc  # noqa: E402
from maskc.artifact.kernel_families import HeadDim  # noqa: E402

SEQLEN = 16384
#: nvidia-smi's query: one line every SAMPLE_MS of time, SM clock (MHz), power (W).
QUERY = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits"]
SAMPLE_MS = 20
#: Seconds of calls before a window's timing starts: the clock settles to the kernel's draw.
SETTLE_S = 0.3


class Sample(NamedTuple):
    time: float
    """Seconds since the epoch (nvidia-smi's local timestamp)."""
    mhz: float
    watts: float


def parse_samples(text: str) -> list[Sample]:
    """nvidia-smi's lines ("2026/12/05 07:01:02.123, 1755, 688.21"); lines it could not measure
    ("[N/A]") or cut short are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append(Sample(stamp, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    return samples


def window_means(samples: list[Sample], start: float, end: float) -> tuple[float, float] | None:
    """Mean clock (MHz) and power (W) of the samples in [start, end]; None without any."""
    inside = [s for s in samples if start <= s.time <= end]
    if not inside:
        return None
    return statistics.fmean(s.mhz for s in inside), statistics.fmean(s.watts for s in inside)


class Window(NamedTuple):
    case: tuple[str, str, str]
    """(mask, direction, implementation)."""
    start: float
    end: float
    tflops: float


def timed_window(case: tuple[str, str, str], call: Callable[[], object], flops: float, seconds: float) -> Window:
    """`call` back to back for SETTLE_S, then timed for `seconds`: its TFLOP/s and when it ran."""
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin, calls, start = time.time(), 0, None
    while time.time() - begin < SETTLE_S + seconds:
        if start is None and time.time() - begin >= SETTLE_S:
            torch.cuda.synchronize()
            start, calls = time.time(), 0
            first.record()
        call()
        calls += 1
        if calls % 4 == 0:  # the host stays a few calls ahead, no more
            torch.cuda.synchronize()
    last.record()
    torch.cuda.synchronize()
    return Window(case, start, time.time(), calls * flops / first.elapsed_time(last) / 1e9)


Pass = tuple[Callable[[], object], float]
"""A call that runs one direction of one implementation once, and its FLOPs."""


def passes(mask_name: str, head_dim: HeadDim, heads: tuple[int, int]) -> dict[tuple[str, str], Pass]:
    """Per (direction, implementation) on `mask_name`: its Pass."""
    masks, lens = build_masks(SEQLEN)
    mask = masks[mask_name]
    q, k, v = inputs(SEQLEN, head_dim, True, heads=heads)
    flops = forward_flops(mask.area(), head_dim, heads[0])
    calls = {"maskc": maskc_call(q, k, v, mask)}
    fa4 = baselines(mask_name, SEQLEN, lens, q, k, v).get("fa4")
    if fa4 is not None:
        calls["fa4"] = fa4
    out: dict[tuple[str, str], Pass] = {}
    for impl, call in calls.items():
        def forward(call=call) -> None:
            with torch.no_grad():
                call()

        result = call()
        o = result[0] if isinstance(result, tuple) else result
        grad = torch.randn_like(o)

        def backward(o=o, grad=grad) -> None:
            q.grad = k.grad = v.grad = None
            o.backward(grad, retain_graph=True)

        out[("fwd", impl)] = (forward, flops)
        out[("bwd", impl)] = (backward, 2.5 * flops)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", required=True, help="a `maskc compile` directory with the kernels")
    parser.add_argument("--masks", default="full,causal", help="comma-separated benchmark masks")
    parser.add_argument("--heads", type=parse_heads, default=[(64, 8)], help="HQ:HKV (default 64:8)")
    parser.add_argument("--head-dim", type=parse_head_dims, default=parse_head_dims("128"))
    parser.add_argument("--window", type=float, default=2.5, help="seconds of calls a window")
    parser.add_argument("--rounds", type=int, default=3, help="windows per implementation and case")
    args = parser.parse_args()
    maskc.runtime.register_artifact(args.artifacts)
    windows = []
    with tempfile.TemporaryFile("w+") as log:
        smi = subprocess.Popen([*QUERY, "-lms", str(SAMPLE_MS)], stdout=log)
        try:
            for mask_name in args.masks.split(","):
                runs = passes(mask_name, args.head_dim[0], args.heads[0])
                for direction in ("fwd", "bwd"):
                    for _ in range(args.rounds):
                        for (d, impl), (call, flops) in runs.items():
                            if d == direction:
                                windows.append(timed_window((mask_name, direction, impl), call, flops, args.window))
        finally:
            smi.terminate()
            smi.wait()
        log.seek(0)
        samples = parse_samples(log.read())
    lines = []
    for window in windows:
        means = window_means(samples, window.start, window.end)
        mhz, watts = means if means is not None else (float("nan"), float("nan"))
        per_ghz = window.tflops / mhz * 1e3
        lines.append([*window.case, f"{window.tflops:.0f}", f"{mhz:.0f}", f"{watts:.0f}", f"{per_ghz:.0f}"])
    header = ["mask", "direction", "impl", "TFLOP/s", "SM MHz", "W", "TFLOP/s per GHz"]
    print("\n".join(markdown_table(header, lines, [3, 4, 5, 6])))


if __name__ == "__main__":
    main()
