"""bench/kernel.py's head-dim sweep, on the CPU with fake timings (the benchmark itself runs on
GPU machines only): the inputs and FLOPs of each head dim, the rows it writes (asymmetric head
dims as "192/128"), the error rows of what cannot run a head dim, and the report's tables of a
run over several head dims."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch

import maskc
from maskc.artifact.kernel_families import HeadDim
from maskc.ir import Mask

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import report
from record import RowError, Run, read_results

NOW = datetime(2026, 12, 1, 8, 30, tzinfo=timezone.utc)
MLA = HeadDim(192, 128)


@pytest.fixture
def kernel() -> dict:
    """bench/kernel.py's globals, fresh for each test (the fakes patched into them stay there)."""
    return runpy.run_path(str(BENCH / "kernel.py"), run_name="bench_kernel")


def scratch_run(tmp_path: Path, run: str | None = None, day: int = 1) -> Run:
    return Run.start("kernel", "NVIDIA H200", tmp_path, run=run, argv=["bench/kernel.py", "--backward"], now=NOW.replace(day=day))


def case(head_dim: object, seqlen: int = 256, dtype: str = "bf16") -> dict:
    return {"mask": "causal", "seqlen": seqlen, "heads": "64:8", "head_dim": head_dim, "dtype": dtype, "docs": 1,
            "area": seqlen * (seqlen + 1) // 2}


def test_head_dims_parse_and_name_rows(kernel: dict) -> None:
    assert kernel["parse_head_dims"]("64,192/128") == [HeadDim(64, 64), MLA]
    with pytest.raises(argparse.ArgumentTypeError, match="192x128"):
        kernel["parse_head_dims"]("128,192x128")
    assert kernel["head_dim_field"](HeadDim(128, 128)) == 128
    assert kernel["head_dim_field"](MLA) == "192/128"


def test_flops_count_the_qk_and_v_head_dims(kernel: dict) -> None:
    area = 1000
    assert kernel["forward_flops"](area, HeadDim(128, 128)) == 4 * area * 64 * 128
    assert kernel["forward_flops"](area, MLA) == 2 * area * 64 * (192 + 128)


def test_inputs_have_the_head_dims_shapes(kernel: dict) -> None:
    q, k, v = kernel["inputs"](256, MLA, True, device="cpu")
    assert [tuple(x.shape) for x in (q, k, v)] == [(256, 64, 192), (256, 8, 192), (256, 8, 128)]
    assert all(x.requires_grad and x.dtype == torch.bfloat16 for x in (q, k, v))
    assert torch.equal(q, kernel["inputs"](256, MLA, False, device="cpu")[0])


def usage_error(kernel: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> str:
    """What bench/kernel.py prints when `args` stop it with a usage error (exit code 2), before any GPU work."""
    monkeypatch.setattr(sys, "argv", ["bench/kernel.py", "--artifacts", "kernels", *args])
    with pytest.raises(SystemExit) as done:
        kernel["main"]()
    assert done.value.code == 2
    return capsys.readouterr().err


def test_bad_head_dims_stop_the_benchmark_before_it_starts(kernel: dict, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    assert "--head-dims" in usage_error(kernel, monkeypatch, capsys, "--head-dims", "128,big")


def test_unknown_baselines_stop_the_benchmark_before_it_starts(kernel: dict, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    assert "unknown fa3" in usage_error(kernel, monkeypatch, capsys, "--baselines", "flex,fa3")


def test_portable_calls_run_the_family_they_name_and_leave_the_environment(kernel: dict,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(maskc, "attention", lambda *a, **kw: (seen.append((kw, os.environ.get("MASKC_PORTABLE_NEXT"))), None))
    monkeypatch.setenv("MASKC_PORTABLE_NEXT", "1")
    kernel["portable_call"](None, None, None, None, next_family=False)()
    assert os.environ["MASKC_PORTABLE_NEXT"] == "1"
    monkeypatch.delenv("MASKC_PORTABLE_NEXT")
    kernel["portable_call"](None, None, None, None, next_family=True)()
    assert seen == [({"portable": True}, "0"), ({"portable": True}, "1")]
    assert "MASKC_PORTABLE_NEXT" not in os.environ


def test_head_dim_rows_are_checked(tmp_path: Path) -> None:
    run = scratch_run(tmp_path)
    for head_dim in (128, "192/128"):
        run.write("kernel", impl="maskc", direction="fwd", tflops=1.0, **case(head_dim))
        run.write("memory", impl="maskc", peak_mib=1.0, **case(head_dim))
    for bad in ("192x128", "128", 128.0, True):
        with pytest.raises(RowError, match="head_dim must be an int or Dqk/Dv like '192/128'"):
            run.write("kernel", impl="maskc", direction="fwd", tflops=1.0, **case(bad))
    assert [row["head_dim"] for row in read_results(tmp_path)] == [128, "192/128", 128, "192/128"]


def test_a_head_dim_without_maskc_backward_gives_error_rows(kernel: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """maskc's forward at 192/128 is measured (under no_grad); its backward raises before the
    forward on the GPU, which becomes the backward and memory rows' error. A baseline that
    cannot run the head dim at all has error rows too, and neither stops the run."""
    attention = maskc.attention

    def gpu_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, **options: bool) -> tuple:
        if torch.is_grad_enabled() and q.requires_grad:
            raise maskc.MaskcError(f"head_dim {HeadDim(q.shape[2], v.shape[2])} has no backward kernel")
        return attention(q, k, v, mask, **options)

    monkeypatch.setattr(maskc, "attention", gpu_like)
    globals_ = kernel["measure"].__globals__
    outputs = []

    def fake_forward(call: object, flops: int) -> float:
        outputs.append(call())
        return flops / 1e9  # 1 ms

    globals_["timed_tflops"] = fake_forward
    globals_["timed_backward_tflops"] = lambda call, flops, leaves: (call(), 2.5 * flops / 1e9)[1]
    globals_["peak_memory_mib"] = lambda call, leaves: 10.0
    q, k, v = kernel["inputs"](256, MLA, True, device="cpu")
    mask = Mask.from_cu_seqlens([0, 256], causal=True)
    mla = case(kernel["head_dim_field"](MLA))
    run = scratch_run(tmp_path)
    rows = kernel["measure"](run, mla, "maskc", kernel["maskc_call"](q, k, v, mask), [q, k, v])
    assert outputs[0].shape == (256, 64, 128)
    assert rows[0]["tflops"] == 2 * mla["area"] * 64 * (192 + 128) / 1e9
    assert [(row["kind"], row.get("direction"), row["error"]) for row in rows[1:]] == [
        ("kernel", "bwd", "MaskcError: head_dim 192/128 has no backward kernel"),
        ("memory", None, "MaskcError: head_dim 192/128 has no backward kernel"),
    ]

    def no_kernel() -> torch.Tensor:
        raise RuntimeError("No available kernel. Aborting execution.")

    rows += kernel["measure"](run, mla, "sdpa_flash", no_kernel, [q, k, v])
    assert [row["error"] for row in rows[3:]] == ["RuntimeError: No available kernel. Aborting execution."] * 3
    rows += kernel["measure"](run, mla, "fa4", lambda: outputs[0], [q, k, v])
    assert [row.get("tflops", row.get("peak_mib")) for row in rows[6:]] == [rows[0]["tflops"], 2.5 * rows[0]["tflops"], 10.0]
    assert sorted(map(json.dumps, read_results(tmp_path))) == sorted(map(json.dumps, rows))
    fwd, bwd = f"{rows[0]['tflops']:.0f}", f"{2.5 * rows[0]['tflops']:.0f}"
    table = report.kernel_tables(rows)
    assert f"| 256 | causal | 1.00 / — | {fwd} / failed | {fwd} / {bwd} | failed / failed |" in table
    assert "| 256 | — | 10 | — |" in table


def test_heads_parse_into_the_inputs_and_flops(kernel: dict) -> None:
    assert kernel["parse_heads"]("64:8,64:64,64:1") == [(64, 8), (64, 64), (64, 1)]
    for bad, message in (("64:6", "64:6: the kv heads must divide"), ("64x8", "HQ:HKV like 64:8, got '64x8'"), ("0:0", "0:0")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            kernel["parse_heads"](bad)
    q, k, v = kernel["inputs"](32, HeadDim(64, 64), False, "cpu", heads=(16, 1))
    assert [x.shape for x in (q, k, v)] == [(32, 16, 64), (32, 1, 64), (32, 1, 64)]
    assert kernel["forward_flops"](10, HeadDim(64, 64), 16) == 4 * 10 * 16 * 64
    assert kernel["forward_flops"](10, MLA) == 2 * 10 * 64 * (192 + 128)  # the settings' 64 query heads


def test_dtypes_parse_into_the_inputs_and_rows(kernel: dict) -> None:
    assert kernel["parse_dtypes"]("bf16,fp16") == ["bf16", "fp16"]
    with pytest.raises(argparse.ArgumentTypeError, match="'fp32': choose among bf16, fp16"):
        kernel["parse_dtypes"]("bf16,fp32")
    q, k, v = kernel["inputs"](64, MLA, True, "cpu", "fp16")
    assert [x.dtype for x in (q, k, v)] == [torch.float16] * 3 and q.requires_grad
    assert [x.shape for x in (q, k, v)] == [(64, 64, 192), (64, 8, 192), (64, 8, 128)]
    bf16 = kernel["inputs"](64, MLA, False, "cpu")[0]
    assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.float(), q.detach().float(), rtol=1e-2, atol=1e-2)  # same draws


def test_a_run_over_two_dtypes_has_tables_and_shortfalls_per_dtype(tmp_path: Path) -> None:
    """fp16 rows never supersede or mix with bf16 ones, nor rows of other head counts with the
    settings' 64:8: each gets its tables, its line of shortfalls, and the figure shows bf16 at
    64:8 only."""
    run = scratch_run(tmp_path, run="dtypes")
    for dtype, tflops in (("bf16", 600.0), ("fp16", 500.0)):
        for seqlen in report.PLOT_SEQLENS:
            for direction in ("fwd", "bwd"):
                run.write("kernel", impl="maskc", direction=direction, tflops=tflops, **case(128, seqlen, dtype))
                run.write("kernel", impl="fa4", direction=direction, tflops=550.0, **case(128, seqlen, dtype))
    rows = read_results(tmp_path)
    table = report.kernel_tables(rows)
    assert table[0] == "#### Head dim 128"
    split = table.index("#### Head dim 128, fp16")
    assert "| 16k | causal | 1.09 / 1.09 | 600 / 600 | 550 / 550 |" in table[:split]
    assert "| 16k | causal | 0.91 / 0.91 | 500 / 500 | 550 / 550 |" in table[split:]
    bf16, fp16 = report.kernel_shortfalls(rows)
    assert bf16.startswith("- **Head dim 128** (") and bf16.endswith("): none.")
    assert fp16.startswith("- **Head dim 128, fp16** (") and "below FA4, forward: causal 16k 0.91, causal 64k 0.91" in fp16
    assert report.plotted_kernel_rows(rows, "dtypes") == [row for row in rows if row["dtype"] == "bf16"]
    mha = {**case(128, 16384), "heads": "64:64"}
    run.write("kernel", impl="maskc", direction="fwd", tflops=500.0, **mha)
    run.write("kernel", impl="fa4", direction="fwd", tflops=550.0, **mha)
    rows = read_results(tmp_path)
    assert "#### Head dim 128, 64:64 heads" in report.kernel_tables(rows)
    assert report.kernel_shortfalls(rows)[1] == (
        f"- **Head dim 128, 64:64 heads** ({rows[0]['device']}, {rows[0]['date']}, `{rows[0]['commit']}`): "
        "below FA4, forward: causal 16k 0.91."
    )
    assert report.plotted_kernel_rows(rows, "dtypes") == [row for row in rows if row["dtype"] == "bf16" and row["heads"] == "64:8"]


def test_a_run_over_several_head_dims_has_tables_per_head_dim(tmp_path: Path) -> None:
    run = scratch_run(tmp_path, run="sweep")
    for head_dim, tflops in ((128, 600.0), ("192/128", 550.0)):
        for seqlen in report.PLOT_SEQLENS:
            for direction, value in (("fwd", tflops), ("bwd", tflops - 100)):
                run.write("kernel", impl="maskc", direction=direction, tflops=value, **case(head_dim, seqlen))
            run.write("memory", impl="maskc", peak_mib=tflops, **case(head_dim, seqlen))
    rows = read_results(tmp_path)
    table = report.kernel_tables(rows)
    assert table[0] == "#### Head dim 128"
    split = table.index("#### Head dim 192/128 (q and k 192, v 128)")
    assert table[2 : split - 1] == report.kernel_tables([row for row in rows if row["head_dim"] == 128])
    assert table[split:] == report.kernel_tables([row for row in rows if row["head_dim"] == "192/128"])  # headed alone too
    assert "| 16k | causal | 600 / 500 |" in table[:split] and "| 16k | causal | 550 / 450 |" in table[split:]
    assert "| 64k | 550 |" in table[split:]
    assert "#### Head dim 128" in report.render_history(rows)
    assert report.plot_runs(rows)[report.KERNEL_PLOT] == "sweep"
    assert report.plotted_kernel_rows(rows, "sweep") == [row for row in rows if row["kind"] == "kernel" and row["head_dim"] == 128]
    newer = scratch_run(tmp_path, run="mla only", day=2)
    for seqlen in report.PLOT_SEQLENS:
        for direction in ("fwd", "bwd"):
            newer.write("kernel", impl="maskc", direction=direction, tflops=1.0, **case("192/128", seqlen))
            newer.write("kernel", impl="fa4", direction=direction, tflops=1.0, **case("192/128", seqlen))
    assert report.plot_runs(read_results(tmp_path))[report.KERNEL_PLOT] == "sweep"


#: The step of maskc's forward host rows of the first method (one batch of 2000 calls), in the results.
MASKC_FORWARD_STEP_OF_ONE_BATCH = "one maskc.attention call (forward, 128 causal tokens, 64:8 heads, d=128; mean of 2000)"


def test_host_steps_say_what_was_timed_and_how(kernel: dict) -> None:
    """The problem's part of a step is the earlier method's (the rows' history shows the same
    problem), the method's part is new: a median of interleaved batches is not a mean of one."""
    step = kernel["host_step"]("maskc", "fwd")
    assert step == "one maskc.attention call (forward, 128 causal tokens, 64:8 heads, d=128; median of 10 interleaved batches of 200)"
    problem = MASKC_FORWARD_STEP_OF_ONE_BATCH.split("; ")[0]
    assert step.split("; ")[0] == problem and step != MASKC_FORWARD_STEP_OF_ONE_BATCH
    assert any(row["step"] == MASKC_FORWARD_STEP_OF_ONE_BATCH for row in read_results() if row["kind"] == "host")
    assert kernel["host_step"]("sdpa_cudnn", "fwd+bwd", calls=10, rounds=5) == (
        "one SDPA cuDNN call (forward + backward through autograd, 128 causal tokens, 64:8 heads, d=128; "
        "median of 5 interleaved batches of 2)"
    )


def test_host_batches_take_turns_and_a_failure_leaves_them(kernel: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round times one batch of every implementation in turn; one that fails in its warm-up
    has its exception for a result, one that fails later leaves the turns with its exception."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    kernel["host_batches"].__globals__["HOST_WARMUP"] = 1
    order: list[str] = []
    later = RuntimeError("failed in the third batch")

    def call(name: str, fail_at: int | None = None, exc: Exception | None = None):
        def run() -> torch.Tensor:
            order.append(name)
            if fail_at is not None and len([n for n in order if n == name]) >= fail_at:
                raise exc
            return torch.zeros(1)
        return kernel["HostCall"](run, ())

    # c's sixth call fails: after its warm-up and two batches of two, the first of the third batch.
    hosts = {"a": call("a"), "b": call("b", fail_at=1, exc=ValueError("no kernel")), "c": call("c", fail_at=6, exc=later)}
    times = kernel["host_times_us"](hosts, False, calls=8, rounds=4)
    assert isinstance(times["b"], ValueError) and times["c"] is later
    assert len(times["a"]) == 4 and all(0 < host <= wall for host, wall in times["a"])
    # Warm-ups (one call each), then rounds of two calls a batch: a, c, a, c, a, c (c raises), a.
    assert order == ["a", "b", "c", "a", "a", "c", "c", "a", "a", "c", "c", "a", "a", "c", "a", "a"]


@pytest.fixture
def no_fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attn not installed, wherever these tests run."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


def test_host_calls_compute_the_same_attention_on_their_own_leaves(kernel: dict, no_fa4: None, capsys: pytest.CaptureFixture) -> None:
    """The baselines' leaves alias q/k/v in their layouts (made once, outside the timed loop), their
    calls give maskc's output, and a forward + backward leaves one call's gradients (None'd every
    iteration, not summed). SDPA runs its CPU kernel here: its cuDNN backend is the context's."""
    q, k, v = kernel["inputs"](128, HeadDim(128, 128), False, device="cpu")
    calls = kernel["host_calls"](q, k, v)
    assert list(calls) == ["maskc", "sdpa_cudnn"]
    assert "no FA4 host rows" in capsys.readouterr().out
    sdpa = calls["sdpa_cudnn"]
    assert [tuple(x.shape) for x in sdpa.leaves] == [(1, 64, 128, 128), (1, 8, 128, 128), (1, 8, 128, 128)]
    assert [x.data_ptr() for x in sdpa.leaves] == [x.data_ptr() for x in calls["maskc"].leaves] == [x.data_ptr() for x in (q, k, v)]
    with torch.no_grad():
        expected = calls["maskc"].call()
        torch.testing.assert_close(sdpa.call()[0].transpose(0, 1), expected, atol=2e-2, rtol=2e-2)
    for host in calls.values():
        for x in host.leaves:
            x.requires_grad_()
        step = kernel["forward_backward"](host)
        step()
        once = [x.grad.clone() for x in host.leaves]
        step()
        assert all(torch.equal(x.grad, g) for x, g in zip(host.leaves, once, strict=True))


def test_host_rows_of_a_baseline_that_cannot_run_are_errors(kernel: dict, no_fa4: None, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (no synchronize to do, and real CPU timings of a few calls) maskc's host rows are
    measured and SDPA's, without a cuDNN kernel here, are error rows; the table shows both."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    kernel["measure_host"].__globals__["HOST_WARMUP"] = 1
    rows = kernel["measure_host"](scratch_run(tmp_path), device="cpu", calls=4, rounds=2)
    assert [(impl, pass_, "ms" in row) for impl, passes in rows.items() for pass_, row in passes.items()] == [
        ("maskc", "fwd", True), ("maskc", "fwd+bwd", True), ("sdpa_cudnn", "fwd", False), ("sdpa_cudnn", "fwd+bwd", False),
    ]
    assert rows["maskc"]["fwd+bwd"]["step"] == kernel["host_step"]("maskc", "fwd+bwd", calls=4, rounds=2)
    assert all(0 < row["min_ms"] <= row["ms"] for row in rows["maskc"].values())
    assert rows["sdpa_cudnn"]["fwd"]["error"].startswith("RuntimeError: No viable backend")
    assert read_results(tmp_path) == [row for passes in rows.values() for row in passes.values()]
    table = kernel["host_table"](rows)
    assert table[:2] == ["| impl | forward (us) | fwd+bwd (us) |", "|---|---:|---:|"]
    assert table[2].startswith(f"| maskc | {rows['maskc']['fwd']['ms'] * 1e3:.1f} | ")
    assert table[3] == "| sdpa_cudnn | failed | failed |"


def test_every_benchmark_masks_flex_mask_mod_allows_exactly_its_pairs(kernel: dict) -> None:
    """FlexAttention, the baseline of the masks no other library has, attends exactly the pairs
    maskc's lowered mask does (the shared question and global + window too)."""
    seqlen = 4096
    masks, lens = kernel["build_masks"](seqlen)
    assert set(masks) == set(kernel["MASKS"])
    i, j = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    for name, mask in masks.items():
        mod = kernel["flex_mask_mod"](name, seqlen, lens, torch.device("cpu"))
        allowed = torch.ones(seqlen, seqlen, dtype=torch.bool) if mod is None else mod(0, 0, i, j)
        assert torch.equal(allowed, mask.to_dense()), name


def test_baselines_are_timed_only_where_they_compute_maskcs_attention(kernel: dict, tmp_path: Path) -> None:
    """Before a baseline is timed, its output (and its gradients, for the backward) is compared
    with maskc's on the same inputs, in its own layout ([1, H, S, D] for SDPA): one that agrees
    carries how closely (`max_err`), one that attends other pairs, or gives NaN, records that as
    its error and is not timed."""
    import torch.nn.functional as F

    globals_ = kernel["measure"].__globals__
    timed = []
    globals_["timed_tflops"] = lambda call, flops: (timed.append("fwd"), 1.0)[1]
    globals_["timed_backward_tflops"] = lambda call, flops, leaves: (timed.append("bwd"), 1.0)[1]
    globals_["peak_memory_mib"] = lambda call, leaves: 10.0
    q, k, v = (x.float().detach().requires_grad_() for x in kernel["inputs"](128, HeadDim(64, 64), True, device="cpu"))
    mask = Mask.from_cu_seqlens([0, 128], causal=True)
    leaves = [q, k, v]
    expected = kernel["expectation"](kernel["maskc_call"](q, k, v, mask), 128, leaves)
    assert expected.grad.shape == (128, 64, 64) and len(expected.outputs.grads) == 3
    qt, kt, vt = (x.transpose(0, 1)[None] for x in leaves)
    run = scratch_run(tmp_path)
    seen = case(64, seqlen=128)

    def sdpa(causal: bool) -> Callable[[], torch.Tensor]:
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)

    rows = kernel["measure"](run, seen, "sdpa_math", sdpa(True), leaves, expected)
    assert [row["kind"] for row in rows] == ["kernel", "kernel", "memory"] and timed == ["fwd", "bwd"]
    assert all(0 <= row["max_err"] < 1e-5 for row in rows[:2])
    rows = kernel["measure"](run, seen, "sdpa_math", sdpa(False), leaves, expected)
    assert timed == ["fwd", "bwd"]
    assert rows[0]["error"].startswith("BaselineMismatch: its outputs differ from maskc's by 1.04 of their largest magnitude")
    assert rows[1]["error"].startswith("BaselineMismatch: its gradients differ from maskc's by")
    rows = kernel["measure"](run, seen, "nan", lambda: torch.full_like(expected.outputs.out, float("nan")), None, expected)
    assert rows[0]["error"].startswith("BaselineMismatch: its outputs differ from maskc's by nan") and timed == ["fwd", "bwd"]
    read_results(tmp_path)


def test_maskc_tables_feed_the_flexible_libraries_mask_mods(kernel: dict) -> None:
    """The per-token tables the mask_mods read: documents, blocks restarting at each document,
    and the shared question's parts (0 the question, then one per answer)."""
    seqlen = 4096
    masks, lens = kernel["build_masks"](seqlen)
    tables = kernel["mask_tables"](seqlen, lens, "cpu")
    assert [t.dtype for t in tables.aux()] == [torch.int32] * 3 and all(t.shape == (seqlen,) for t in tables.aux())
    starts = np.r_[0, np.cumsum(lens)[:-1]]
    assert torch.equal(tables.doc[torch.as_tensor(starts)], torch.arange(len(lens), dtype=torch.int32))
    assert (tables.block[torch.as_tensor(starts)] == 0).all() and int(tables.block.max()) == (int(lens.max()) - 1) // kernel["BLOCK"]
    question = seqlen // kernel["QUESTION_SHARE"]
    assert (tables.asked[:question] == 0).all() and (tables.asked[question:] > 0).all()
