"""bench/host_profile.py on the CPU (the profile itself is taken on GPU machines): its three parts
come out for maskc, and a library that cannot run (SDPA's cuDNN backend here) is reported, not
fatal."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow
def test_profile_has_times_tables_and_cprofile_and_reports_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    profile = runpy.run_path(str(BENCH / "host_profile.py"), run_name="bench_host_profile")
    profile["warmed_pass"].__globals__["HOST_WARMUP"] = 1
    text = "\n".join(profile["host_profile"](device="cpu", calls=4, rounds=2, steps=2, cprofile_steps=3, rows=10))
    table = text.split("## torch.profiler")[0].splitlines()
    assert "| impl | pass | host (us) | wall (us) | host, calling thread (us) | wall, calling thread (us) |" in table
    maskc_rows = [line.split(" | ") for line in table if line.startswith("| maskc |")]
    assert [row[1] for row in maskc_rows] == ["fwd", "fwd+bwd"]
    for row in maskc_rows:
        host, wall = float(row[2]), float(row[3])
        assert 0 < host <= wall
    assert "| sdpa_cudnn | fwd | failed | failed | failed | failed |" in table
    assert "### maskc fwd+bwd, 2 calls, by self_cpu_time_total" in text
    assert "### sdpa_cudnn fwd: failed (RuntimeError: No viable backend" in text
    assert "### cProfile, maskc fwd+bwd, 3 calls, by tottime" in text
    by_cumulative = text.split("### cProfile, maskc fwd+bwd, 3 calls, by cumulative")[1]
    assert "api.py:" in by_cumulative and "(attention)" in by_cumulative  # maskc.attention, under the step
