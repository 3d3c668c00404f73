"""Where the host time of a call goes, on the problem whose host time `kernel.py` measures (128
causal tokens, 64:8 heads, d=128, bf16; the same calls of maskc, SDPA cuDNN and FA4):

1. per library and pass, the host time of a call and its wall time (the GPU's work waited
   for: where the two agree, the host is what the benchmark times), with autograd's device
   thread running the backward and with the backward on the calling thread;
2. torch.profiler's tables of every library's calls: the kernels' GPU time and each op's
   host time;
3. cProfile of maskc's forward + backward (the backward on the calling thread, so that the
   profiler sees it), by own time and by cumulative time.

A profile, not a benchmark: it prints and writes no rows (the host rows are kernel.py's).
Run on the GPU machine: `python bench/host_profile.py --artifacts DIR [--out FILE]` (DIR: a
`maskc compile` directory with the 64:8 bf16 d=128 kernels and their backward).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel import HOST_TOKENS, D, HostCall, host_calls, host_times_us, inputs, warmed_pass
from report import markdown_table

import maskc
from maskc.artifact.kernel_families import HeadDim

PASSES = {"fwd": False, "fwd+bwd": True}


def engine_table(hosts: dict[str, HostCall], calls: int, rounds: int) -> list[str]:
    """Median host and wall microseconds a call of every library and pass, over `rounds`
    interleaved batches, with the engine's device thread and without (the forward has no
    backward to move, so it is timed once)."""
    columns = {"host": (True, 0), "wall": (True, 1), "host, calling thread": (False, 0), "wall, calling thread": (False, 1)}
    lines = []
    for pass_, backward in PASSES.items():
        runs = {threads: host_times_us(hosts, backward, calls, rounds, threads) for threads in ((True, False) if backward else (True,))}
        for impl in hosts:
            cells = []
            for threads, clock in columns.values():
                times = runs.get(threads, runs[True])[impl]
                cells.append("failed" if isinstance(times, Exception) else f"{statistics.median(t[clock] for t in times):.1f}")
            lines.append([impl, pass_, *cells])
    return markdown_table(["impl", "pass", *(f"{name} (us)" for name in columns)], lines, [2, 3, 4, 5])


def profiler_tables(hosts: dict[str, HostCall], steps: int, rows: int) -> list[str]:
    """torch.profiler over `steps` calls of each library and pass (after their warm-up): ops by
    their GPU time where there is a GPU, and by their own host time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out = []
    for impl, host in hosts.items():
        for pass_, backward in PASSES.items():
            try:
                once, context = warmed_pass(host, backward)
                with context(), profile(activities=activities) as prof:
                    for _ in range(steps):
                        once()
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 (a library that cannot run is reported)
                out += [f"### {impl} {pass_}: failed ({type(exc).__name__}: {exc})"[:300], ""]
                continue
            sorts = (["device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
            for key in sorts:
                out += [f"### {impl} {pass_}, {steps} calls, by {key}", "",
                        prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70), ""]  # fmt: skip
    return out


def cprofile_maskc(host: HostCall, steps: int, rows: int) -> list[str]:
    """cProfile of `steps` forward + backward calls of maskc, the backward on the calling thread."""
    step, context = warmed_pass(host, True, engine_threads=False)
    profiler = cProfile.Profile()
    with context():
        profiler.enable()
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiler.disable()
    out = []
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(rows)
        out += [f"### cProfile, maskc fwd+bwd, {steps} calls, by {key}", "", text.getvalue()]
    return out


def host_profile(device: str = "cuda", calls: int = 1500, rounds: int = 5, steps: int = 50, cprofile_steps: int = 500,
                 rows: int = 30) -> list[str]:  # fmt: skip
    """The three parts of the profile (see the module's docstring), as lines of text."""
    q, k, v = inputs(HOST_TOKENS, HeadDim(D, D), False, device)
    hosts = host_calls(q, k, v)
    return [
        f"## Host and wall time a call ({rounds} interleaved batches of {calls // rounds})", "",
        *engine_table(hosts, calls, rounds), "",
        "## torch.profiler", "", *profiler_tables(hosts, steps, rows),
        "## cProfile", "", *cprofile_maskc(hosts["maskc"], cprofile_steps, rows + 15),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", required=True, type=Path, help="maskc compile directory with the d=128 kernels and backward")
    parser.add_argument("--out", type=Path, help="also write the profile to this file")
    args = parser.parse_args()
    maskc.runtime.register_artifact(args.artifacts)
    text = "\n".join(host_profile())
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
