"""bench/power.py's reading of nvidia-smi: its samples, and a window's means (the measurement
itself runs on the GPU machine)."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import power  # noqa: E402

LOG = """2026/12/05 07:01:02.000, 1755, 688.21
2026/12/05 07:01:02.020, 1740, 691.00
2026/12/05 07:01:02.040, [N/A], 690.10
2026/12/05 07:01:02.0
2026/12/05 07:01:02.060, 1500, 700.00
"""


def test_samples_are_read_and_lines_without_values_skipped() -> None:
    samples = power.parse_samples(LOG)
    assert [(s.mhz, s.watts) for s in samples] == [(1755, 688.21), (1740, 691.0), (1500, 700.0)]
    t0 = datetime(2026, 12, 5, 7, 1, 2).timestamp()
    assert abs(samples[1].time - (t0 + 0.02)) < 1e-6


def test_a_window_averages_the_samples_inside_it() -> None:
    samples = power.parse_samples(LOG)
    t0 = samples[0].time
    assert power.window_means(samples, t0, t0 + 0.03) == (1747.5, (688.21 + 691.0) / 2)
    assert power.window_means(samples, t0 + 0.05, t0 + 0.07) == (1500, 700.0)
    assert power.window_means(samples, t0 + 1, t0 + 2) is None
