"""The performance record: every row in bench/results is well formed, docs/performance.md (short:
the newest run of each kind), docs/performance-history.md (every run holding a newest figure)
and their figures are what bench/report.py makes of them, and the benchmarks write their rows
through bench/record.py (with fake timings here: the GPU benchmarks run on GPU machines only)."""

from __future__ import annotations

import json
import re
import runpy
import struct
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import record  # noqa: E402
import report  # noqa: E402
from record import RowError, Run, read_results, read_rows  # noqa: E402

NOW = datetime(2026, 12, 1, 8, 30, tzinfo=timezone.utc)


def png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (keyword -> text)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is no PNG"
    chunks, at = {}, 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"tEXt":
            keyword, text = body.split(b"\0", 1)
            chunks[keyword.decode("latin-1")] = text.decode("latin-1")
        at += 12 + length
    return chunks


def scratch_run(tmp_path: Path, bench: str = "kernel", device: str = "NVIDIA H200") -> Run:
    return Run.start(bench, device, tmp_path, argv=["bench/kernel.py", "--backward"], now=NOW)


def test_every_row_in_bench_results_is_well_formed() -> None:
    rows = read_results()
    kinds = {row["kind"] for row in rows}
    assert {"kernel", "memory", "dist", "link", "host", "plan"} <= kinds
    assert all(path.stem in record.KINDS for path in (BENCH / "results").glob("*.jsonl"))


def test_performance_doc_is_generated_from_the_rows() -> None:
    pages = report.render_pages(read_results())
    assert set(pages) == {ROOT / "docs" / "performance.md", ROOT / "docs" / "performance-history.md"}
    for path, expected in pages.items():
        assert path.read_text() == expected, f"{path.relative_to(ROOT)} is out of date: run python bench/report.py"


def test_the_page_is_short_and_shows_the_newest_run_at_the_settings_beside_every_library() -> None:
    """docs/performance.md reads in minutes, and each device's table is the newest run at the
    settings at each of 16k and 64k that times no experimental kernels (found here without the
    report's helpers), with a column for every library that run measured."""
    rows = read_results()
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert report.DOC_LINES == 200 and len(doc.splitlines()) <= report.DOC_LINES
    order = report.run_order(rows)
    settings = [row for row in rows if row["kind"] == "kernel" and row["impl"] in report.KERNEL_IMPLS
                and (row["head_dim"], row["dtype"], row["heads"]) == (128, "bf16", "64:8")]  # fmt: skip
    devices = sorted({row["device"] for row in settings})
    assert {"NVIDIA H100 80GB HBM3", "NVIDIA H200"} <= set(devices)
    for device in devices:
        section = doc[doc.index(f"### {device}\n"):]
        section = section[:section.index("\n#")]
        header = next(line for line in section.splitlines() if line.startswith("| seqlen | mask |"))
        for seqlen in (16384, 65536):
            impls = defaultdict(set)
            for row in settings:
                if row["device"] == device and row["seqlen"] == seqlen:
                    impls[row["run"]].add(row["impl"])
            shipped = {run: measured for run, measured in impls.items() if not measured & set(report.EXPERIMENTAL_IMPLS)}
            newest = max((run for run, measured in shipped.items() if {"maskc"} < measured), key=order.__getitem__)
            first = next(row for row in rows if row["run"] == newest)
            named = rf"{report.tokens(seqlen)}( and \d+k)? from the run of {first['date']}, commit `{re.escape(first['commit'])}`"
            assert re.search(named, section), f"{device}: the {report.tokens(seqlen)} lines are not of the newest run"
            for impl in impls[newest]:
                assert f" {report.KERNEL_IMPLS[impl]} |" in header, f"{device}: the newest run's {impl} is missing"


def test_a_run_superseded_on_the_page_stays_on_the_history(tmp_path: Path) -> None:
    """The page shows each length's newest run beside another library; an older run holding the
    only figure of a library (cuDNN here) keeps its table on the history page, and a newer run of
    one length takes only that length's lines."""
    case = {"mask": "full", "seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "direction": "fwd"}
    old = Run.start("kernel", "NVIDIA H200", tmp_path, argv=["bench/kernel.py"], now=NOW.replace(day=1))
    for impl, tflops in (("maskc", 500.0), ("fa4", 600.0), ("sdpa_cudnn", 550.0)):
        old.write("kernel", impl=impl, tflops=tflops, **case)
    new = Run.start("kernel", "NVIDIA H200", tmp_path, argv=["bench/kernel.py"], now=NOW.replace(day=2))
    for impl, tflops in (("maskc", 620.0), ("fa4", 640.0)):
        new.write("kernel", impl=impl, tflops=tflops, **case)
    alone = Run.start("kernel", "NVIDIA H200", tmp_path, argv=["bench/kernel.py"], now=NOW.replace(day=3))
    alone.write("kernel", impl="maskc", tflops=700.0, **case)
    longer = Run.start("kernel", "NVIDIA H200", tmp_path, argv=["bench/kernel.py"], now=NOW.replace(day=4))
    for impl, tflops in (("maskc", 630.0), ("flex_fa4", 420.0)):
        longer.write("kernel", impl=impl, tflops=tflops, **{**case, "seqlen": 65536})
    rows = read_results(tmp_path)
    doc, history = report.render(rows), report.render_history(rows)
    assert (f"TFLOP/s, forward / backward; 16k from the run of {NOW.replace(day=2):%Y-%m-%d}, commit `{new.commit}`, "
            f"64k from the run of {NOW.replace(day=4):%Y-%m-%d}, commit `{longer.commit}`:") in doc
    assert "| 16k | full | 0.97 | — | 620 | 640 | — |" in doc and "| 64k | full | — | 1.50 | 630 | — | 420 |" in doc
    assert "| 550 |" not in doc and "| 700 |" not in doc and f"{NOW:%Y-%m-%d}" not in doc
    assert f"### NVIDIA H200, {NOW:%Y-%m-%d}, commit `{old.commit}`" in history
    assert "| 16k | full | 0.83 | 500 | 600 | 550 |" in history and "| 16k | full | 700 |" in history


def test_the_page_has_a_line_per_other_head_dim_and_head_count(tmp_path: Path) -> None:
    """Another shape's line comes from its newest run at 16k beside another library: maskc's full
    mask, and each ratio's range over the masks (maskc / full without the full mask)."""
    run = Run.start("kernel", "NVIDIA H100 80GB HBM3", tmp_path, argv=["bench/kernel.py"], now=NOW)
    case = {"seqlen": 16384, "heads": "64:1", "head_dim": 64, "dtype": "fp16", "direction": "fwd"}
    for mask, maskc, fa4 in (("full", 600.0, 650.0), ("causal", 570.0, 600.0), ("shared_question", 540.0, None)):
        run.write("kernel", impl="maskc", tflops=maskc, mask=mask, **case)
        if fa4 is not None:
            run.write("kernel", impl="fa4", tflops=fa4, mask=mask, **case)
    run.write("kernel", impl="maskc", tflops=100.0, mask="full", **{**case, "seqlen": 65536})
    doc = report.render(read_results(tmp_path))
    section = doc[doc.index("## Other head dims and head counts, 16k"):]
    assert "| head dim | dtype | heads | run | maskc, full mask | maskc / FA4 | maskc / flexible | maskc / full |" in section
    source = f"NVIDIA H100 80GB HBM3, {NOW:%Y-%m-%d}, `{run.commit}`"
    assert f"| 64 | fp16 | 64:1 | {source} | 600 | 0.92-0.95 | — | 0.90-0.95 |" in section
    assert "### NVIDIA H100" not in doc


def test_figures_show_the_runs_the_doc_names() -> None:
    rows = read_results()
    plots = report.plot_runs(rows)
    assert set(plots) == {report.KERNEL_PLOT, report.DIST_PLOT}
    docs = [(ROOT / "docs" / page).read_text() for page in ("performance.md", "performance-history.md")]
    for name, run in plots.items():
        assert all(f"](img/{name})" in doc for doc in docs)
        assert png_text(ROOT / "docs" / "img" / name).get("Description") == f"run {run}", (
            f"docs/img/{name} shows another run than {run}: run python bench/report.py --plots"
        )


def test_the_kernel_figure_shows_the_run_over_the_most_libraries_then_masks(tmp_path: Path) -> None:
    """A newer run over fewer masks (a memory run on the full mask, say) leaves the figure to the
    run beside as many libraries over more masks; among equals the newest shows."""

    def measured(run: str, day: int, masks: tuple[str, ...]) -> None:
        r = Run.start("kernel", "NVIDIA H200", tmp_path, run=run, argv=["bench/kernel.py"], now=NOW.replace(day=day))
        for mask in masks:
            for seqlen in report.PLOT_SEQLENS:
                for direction in ("fwd", "bwd"):
                    case = {"mask": mask, "seqlen": seqlen, "heads": "64:8", "head_dim": report.PLOT_HEAD_DIM,
                            "dtype": "bf16", "direction": direction}  # fmt: skip
                    r.write("kernel", impl="maskc", tflops=600.0, **case)
                    r.write("kernel", impl="fa4", tflops=650.0, **case)

    measured("masks", 1, ("full", "causal"))
    measured("full_only", 2, ("full",))
    assert report.plot_runs(read_results(tmp_path))[report.KERNEL_PLOT] == "masks"
    measured("newest", 3, ("full", "causal"))
    assert report.plot_runs(read_results(tmp_path))[report.KERNEL_PLOT] == "newest"


def test_the_doc_shows_the_newest_figure_of_each_implementation(tmp_path: Path) -> None:
    """A newer run supersedes an older one's figures for what both measured; the older run keeps
    its table while it holds the only figure of something (here FA4)."""
    case = {"mask": "full", "seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "direction": "fwd"}
    old = Run.start("kernel", "NVIDIA H200", tmp_path / "a", run="old", argv=["bench/kernel.py"], now=NOW.replace(day=1))
    old.write("kernel", impl="maskc", tflops=500.0, **case)
    old.write("kernel", impl="fa4", tflops=650.0, **case)
    new = Run.start("kernel", "NVIDIA H200", tmp_path / "a", run="new", argv=["bench/kernel.py"], now=NOW.replace(day=2))
    new.write("kernel", impl="maskc", tflops=600.0, **case)
    rows = read_results(tmp_path / "a")
    assert report.current_runs(rows, "kernel", report.KERNEL_IMPLS) == ["new", "old"]
    newer = Run.start("kernel", "NVIDIA H200", tmp_path / "a", run="newer", argv=["bench/kernel.py"], now=NOW.replace(day=3))
    newer.write("kernel", impl="fa4", tflops=640.0, **case)
    newer.write("kernel", impl="maskc", error="RuntimeError: out of memory", **case)
    rows = read_results(tmp_path / "a")
    assert report.current_runs(rows, "kernel", report.KERNEL_IMPLS) == ["newer", "new"]
    history = report.render_history(rows)
    assert history.index("| 16k | full | — | failed | 640 |") < history.index("| 16k | full | 600 |")
    assert "500" not in history
    doc = report.render(rows)
    assert "| 16k | full | — | failed | 640 |" in doc
    assert "| 16k | full | 600 |" not in doc and "| 500 |" not in doc


def test_kernel_tables_say_where_maskc_stands(tmp_path: Path) -> None:
    """Beside the TFLOP/s: maskc over FA4 on each line, and over maskc's own full mask at the
    same length (a dash where the run lacks either side); every cell has the table's
    directions, a dash for one a line lacks (a run cut short)."""
    run = Run.start("kernel", "NVIDIA H200", tmp_path / "a", argv=["bench/kernel.py"], now=NOW)
    case = {"seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16"}
    for mask, direction, maskc, fa4 in (("full", "fwd", 600.0, 650.0), ("full", "bwd", 500.0, 625.0),
                                        ("causal", "fwd", 570.0, 570.0), ("shared_question", "fwd", 540.0, None)):
        run.write("kernel", impl="maskc", tflops=maskc, mask=mask, direction=direction, **case)
        if fa4 is not None:
            run.write("kernel", impl="fa4", tflops=fa4, mask=mask, direction=direction, **case)
    rows = read_results(tmp_path / "a")
    for doc in (report.render(rows), report.render_history(rows)):
        assert "| seqlen | mask | maskc / FA4 | maskc / full | maskc | FA4 |" in doc
        assert "| 16k | full | 0.92 / 0.80 | 1.00 / 1.00 | 600 / 500 | 650 / 625 |" in doc
        assert "| 16k | causal | 1.00 / — | 0.95 / — | 570 / — | 570 / — |" in doc
        assert "| 16k | shared question | — | 0.90 / — | 540 / — | — |" in doc


def test_the_doc_says_what_falls_short_of_the_targets(tmp_path: Path) -> None:
    """Below FA4 where FA4 has the mask, below 92% of maskc's full mask where it has not, memory
    and host time over the lowest other library's; what meets its target is not listed."""
    run = Run.start("kernel", "NVIDIA H200", tmp_path / "a", argv=["bench/kernel.py"], now=NOW)
    case = {"seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16"}
    for mask, maskc, fa4 in (("full", 600.0, 650.0), ("causal", 700.0, 650.0), ("shared_question", 540.0, None),
                             ("varlen_block_causal", 580.0, None)):  # fmt: skip
        run.write("kernel", impl="maskc", tflops=maskc, mask=mask, direction="fwd", **case)
        if fa4 is not None:
            run.write("kernel", impl="fa4", tflops=fa4, mask=mask, direction="fwd", **case)
    for impl, peak in (("maskc", 1096.25), ("flex", 1096.0), ("maskc_det", 2000.0), ("fa4", 1500.0)):
        run.write("memory", impl=impl, peak_mib=peak, mask="full", **case)
    for impl, fwd, both in (("maskc", 0.045, 0.2), ("sdpa_cudnn", 0.022, 0.25)):
        for pass_, ms in (("fwd", fwd), ("fwd+bwd", both)):
            run.write("host", step=f"{record.HOST_IMPLS[impl]} ({record.HOST_PASSES[pass_]}, 128 causal tokens)", ms=ms)
    rows = read_results(tmp_path / "a")
    history, doc = report.render_history(rows), report.render(rows)
    short = history[history.index("## Short of the targets"):history.index("What holds these back")]
    assert (f"- **Head dim 128** (NVIDIA H200, {NOW:%Y-%m-%d}, `{run.commit}`): below FA4, forward: full 16k 0.92; "
            "below 92% of full, forward: shared question 16k 0.90; peak memory: 16k 1096.25 MiB against 1096.") in short
    summary = doc[doc.index("## Short of the targets"):doc.index("What holds these back")]
    assert ("- **Head dim 128**: below FA4, forward: 1 (lowest full 16k 0.92); "
            "below 92% of full, forward: 1 (lowest shared question 16k 0.90); peak memory: 16k 1096.25 MiB against 1096.") in summary
    for section in (short, summary):
        assert "- **Host time, forward** (NVIDIA H200" in section and "45.0 us against cuDNN's 22.0." in section
        listed = section[section.index("- **"):]
        assert "forward + backward through autograd" not in listed and "causal" not in listed
    assert f"| NVIDIA H200, {NOW:%Y-%m-%d}, `{run.commit}` | 45 / 200 | 22 / 250 | — |" in doc


def test_a_run_of_some_masks_supersedes_only_those(tmp_path: Path) -> None:
    """A newer run measuring a few masks replaces their figures; the others still come from the
    older run, each ratio from one run, and lengths without targets are left out. The target of
    a mask is the faster of FA4 and cuDNN where both ran it; an irregular mask also has 92% of
    maskc's full mask."""
    case = {"heads": "64:8", "head_dim": 192, "dtype": "bf16", "direction": "bwd"}
    old = Run.start("kernel", "NVIDIA H100", tmp_path / "a", argv=["bench/kernel.py"], now=NOW.replace(hour=9))
    for seqlen in (4096, 16384):
        for mask, maskc, fa4 in (("full", 400.0, 500.0), ("sliding_window_causal", 300.0, 400.0), ("causal", 450.0, 500.0)):
            old.write("kernel", impl="maskc", tflops=maskc, mask=mask, seqlen=seqlen, **case)
            old.write("kernel", impl="fa4", tflops=fa4, mask=mask, seqlen=seqlen, **case)
        old.write("kernel", impl="maskc", tflops=200.0, mask="shared_question", seqlen=seqlen, **case)
        for mask, cudnn in (("full", 450.0), ("causal", 600.0)):
            old.write("kernel", impl="sdpa_cudnn", tflops=cudnn, mask=mask, seqlen=seqlen, **case)
    new = Run.start("kernel", "NVIDIA H200", tmp_path / "a", argv=["bench/kernel.py"], now=NOW.replace(hour=17))
    for mask, maskc, fa4 in (("full", 420.0, 500.0), ("sliding_window_causal", 380.0, 400.0)):
        new.write("kernel", impl="maskc", tflops=maskc, mask=mask, seqlen=16384, **case)
        new.write("kernel", impl="fa4", tflops=fa4, mask=mask, seqlen=16384, **case)
    [line] = report.kernel_shortfalls(read_results(tmp_path / "a"))
    day = f"{NOW:%Y-%m-%d}"
    assert line == (f"- **Head dim 192** (NVIDIA H200, {day}, `{new.commit}`; NVIDIA H100, {day}, `{old.commit}`): "
                    "below FA4, backward: full 16k 0.84, sliding window causal 16k 0.95; "
                    "below cuDNN, backward: causal 16k 0.75; "
                    "below 92% of full, backward: sliding window causal 16k 0.90, shared question 16k 0.50.")  # fmt: skip


def test_irregular_masks_are_held_against_their_full_mask_and_the_flexible_libraries(tmp_path: Path) -> None:
    """An irregular mask has three targets at once: the native peer (FA4) where it has the mask,
    92% of maskc's own full mask, and 1.15x the faster of the flexible-mask libraries on FA4's
    kernels (Flex on FA4, FA4's mask_mod; FlexAttention on Triton sets none); the standard masks
    only the first. The table shows maskc over the faster flexible library on each line."""
    run = Run.start("kernel", "NVIDIA H100", tmp_path / "a", argv=["bench/kernel.py"], now=NOW)
    case = {"seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "direction": "fwd"}
    for mask, impls in (("full", {"maskc": 600.0, "fa4": 600.0, "flex_fa4": 650.0}),
                        ("causal", {"maskc": 600.0, "fa4": 600.0, "fa4_mask_mod": 620.0}),
                        ("varlen_causal", {"maskc": 540.0, "fa4": 530.0, "flex": 300.0, "flex_fa4": 480.0}),
                        ("varlen_full", {"maskc": 560.0, "fa4": 540.0, "flex": 550.0}),
                        ("shared_question", {"maskc": 560.0, "flex_fa4": 500.0, "fa4_mask_mod": 450.0})):  # fmt: skip
        for impl, tflops in impls.items():
            run.write("kernel", impl=impl, tflops=tflops, mask=mask, **case)
    rows = read_results(tmp_path / "a")
    [line] = report.kernel_shortfalls(rows)
    assert line.endswith("below 92% of full, forward: varlen causal 16k 0.90; "
                         "below 1.15x the faster flexible-mask library, forward: varlen causal 16k 1.12, shared question 16k 1.12.")  # fmt: skip
    assert "below FA4" not in line and " full 16k" not in line and "causal 16k 0.97" not in line
    for doc in (report.render(rows), report.render_history(rows)):
        assert "| seqlen | mask | maskc / FA4 | maskc / flexible | maskc / full | maskc | FA4 | FlexAttention | Flex on FA4 | FA4 mask_mod |" in doc
        assert "| 16k | varlen causal | 1.02 | 1.12 | 0.90 | 540 | 530 | 300 | 480 | — |" in doc
        assert "| 16k | shared question | — | 1.12 | 0.93 | 560 | — | — | 500 | 450 |" in doc
        assert "| 16k | varlen full | 1.04 | — | 0.93 | 560 | 540 | 550 | — | — |" in doc


def test_a_run_of_maskc_alone_counts_for_masks_no_peer_has(tmp_path: Path) -> None:
    """The 92%-of-full target compares maskc with itself: a newer run of maskc alone supersedes
    the figures of masks no peer has a kernel for, not those of a mask a peer ran elsewhere."""
    case = {"seqlen": 16384, "heads": "64:8", "head_dim": 192, "dtype": "bf16", "direction": "bwd"}
    old = Run.start("kernel", "NVIDIA H200", tmp_path / "a", argv=["bench/kernel.py"], now=NOW.replace(hour=9))
    for mask, maskc, fa4 in (("full", 400.0, 500.0), ("causal", 360.0, 400.0)):
        old.write("kernel", impl="maskc", tflops=maskc, mask=mask, **case)
        old.write("kernel", impl="fa4", tflops=fa4, mask=mask, **case)
    old.write("kernel", impl="maskc", tflops=200.0, mask="shared_question", **case)
    alone = Run.start("kernel", "NVIDIA H200", tmp_path / "a", argv=["bench/kernel.py"], now=NOW.replace(day=2))
    for mask, maskc in (("full", 500.0), ("causal", 100.0), ("shared_question", 440.0)):
        alone.write("kernel", impl="maskc", tflops=maskc, mask=mask, **case)
    [line] = report.kernel_shortfalls(read_results(tmp_path / "a"))
    later, day = f"{NOW.replace(day=2):%Y-%m-%d}", f"{NOW:%Y-%m-%d}"
    assert line == (f"- **Head dim 192** (NVIDIA H200, {later}, `{alone.commit}`; NVIDIA H200, {day}, `{old.commit}`): "
                    "below FA4, backward: full 16k 0.80, causal 16k 0.90; below 92% of full, backward: shared question 16k 0.88.")  # fmt: skip


def test_runs_of_one_day_are_ordered_by_their_start(tmp_path: Path) -> None:
    """Rows are read kind by kind (host before kernel), so the later of two runs on one day
    whose rows start in an earlier file still supersedes the other: its name's start time
    orders them."""
    case = {"mask": "full", "seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "direction": "fwd"}
    early = Run.start("kernel", "NVIDIA H200", tmp_path / "a", argv=["bench/kernel.py"], now=NOW.replace(hour=9))
    early.write("kernel", impl="maskc", tflops=500.0, **case)
    late = Run.start("kernel", "NVIDIA H200", tmp_path / "a", argv=["bench/kernel.py"], now=NOW.replace(hour=17))
    late.write("host", step="one maskc.attention call", ms=0.05)
    late.write("kernel", impl="maskc", tflops=600.0, **case)
    rows = read_results(tmp_path / "a")
    assert rows[0]["kind"] == "host" and rows[0]["run"] == late.run
    assert report.current_runs(rows, "kernel", report.KERNEL_IMPLS) == [late.run]
    assert "| 16k | full | 600 |" in report.render_history(rows)


def test_rows_are_checked_when_written(tmp_path: Path) -> None:
    run = scratch_run(tmp_path)
    case = {"mask": "full", "seqlen": 1024, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "direction": "fwd"}
    with pytest.raises(RowError, match="missing tflops"):
        run.write("kernel", impl="maskc", **case)
    with pytest.raises(RowError, match="no field speed"):
        run.write("kernel", impl="maskc", tflops=1.0, speed=2.0, **case)
    with pytest.raises(RowError, match="direction must be one of fwd, bwd"):
        run.write("kernel", impl="maskc", tflops=1.0, **{**case, "direction": "both"})
    with pytest.raises(RowError, match="seqlen must be int"):
        run.write("kernel", impl="maskc", tflops=1.0, **{**case, "seqlen": 1024.0})
    with pytest.raises(RowError, match="carries no tflops"):
        run.write("kernel", impl="maskc", tflops=1.0, error="failed", **case)
    assert not (tmp_path / "kernel.jsonl").exists()
    row = run.write("kernel", impl="maskc", tflops=612, **case)
    assert json.loads((tmp_path / "kernel.jsonl").read_text()) == row
    assert row["run"] == f"2026-12-01T083000Z-{row['commit']}" and row["date"] == "2026-12-01"
    assert row["command"] == "python bench/kernel.py --backward"


def test_reading_names_the_file_and_line_of_a_bad_row(tmp_path: Path) -> None:
    run = scratch_run(tmp_path)
    good = run.write("host", step="lower", ms=0.5)
    path = tmp_path / "host.jsonl"
    bad = {key: value for key, value in good.items() if key != "date"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RowError, match=r"host.jsonl:2: missing date"):
        read_rows(path)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(RowError, match=r"host.jsonl:2: Expecting property name"):
        read_rows(path)
    link = run.write("link", collective="all-to-all", gpus=2, gbps=1.0)
    path.write_text(json.dumps(link) + "\n")
    with pytest.raises(RowError, match=r"host.jsonl:1: a link row in the host file"):
        read_rows(path)


def test_the_rows_of_one_run_agree(tmp_path: Path) -> None:
    run = scratch_run(tmp_path)
    row = run.write("host", step="a", ms=1.0)
    (tmp_path / "host.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "step": "b", "commit": "abcdef0"}) + "\n")
    with pytest.raises(RowError, match=re.escape(f"the rows of run {row['run']} differ in commit")):
        read_results(tmp_path)
    (tmp_path / "host.jsonl").unlink()
    (tmp_path / "speed.jsonl").write_text("")
    with pytest.raises(RowError, match="no kind of row is called 'speed'"):
        read_results(tmp_path)


def test_the_commit_comes_from_git_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASKC_BENCH_COMMIT", raising=False)
    assert record.COMMIT.fullmatch(record.tree_commit())
    monkeypatch.setenv("MASKC_BENCH_COMMIT", "abc1234+dirty")
    assert record.tree_commit() == "abc1234+dirty"
    monkeypatch.setenv("MASKC_BENCH_COMMIT", "HEAD")
    with pytest.raises(RowError, match="MASKC_BENCH_COMMIT must be a git sha"):
        record.tree_commit()


def load_script(name: str) -> dict:
    return runpy.run_path(str(BENCH / f"{name}.py"), run_name=f"bench_{name}")


def test_kernel_benchmark_rows_with_fake_timings(tmp_path: Path) -> None:
    kernel = load_script("kernel")
    run = scratch_run(tmp_path)
    case = {"mask": "causal", "seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "docs": 9, "area": 134225920}
    globals_ = kernel["measure"].__globals__
    globals_["timed_tflops"] = lambda call, area: 600.0
    globals_["timed_backward_tflops"] = lambda call, area, leaves: 520.0
    globals_["peak_memory_mib"] = lambda call, leaves: 1360.5
    leaves = [torch.zeros(1)]
    rows = kernel["measure"](run, case, "maskc", lambda: None, leaves)
    assert [(r["kind"], r.get("direction"), r.get("tflops", r.get("peak_mib"))) for r in rows] == [
        ("kernel", "fwd", 600.0), ("kernel", "bwd", 520.0), ("memory", None, 1360.5)
    ]

    def no_backward(call: object, area: int, leaves: list) -> float:
        raise NotImplementedError("no backward for this mask")

    globals_["timed_backward_tflops"] = no_backward
    rows += kernel["measure"](run, case, "fa4", lambda: None, leaves)
    assert rows[3]["tflops"] == 600.0
    assert rows[4]["error"] == rows[5]["error"] == "NotImplementedError: no backward for this mask"
    assert sorted(map(json.dumps, read_results(tmp_path))) == sorted(map(json.dumps, rows))
    table = report.kernel_tables(rows)
    assert "| 16k | causal | 1.00 / — | 600 / 520 | 600 / failed |" in table
    assert "| 16k | 1360 | — |" in table


@pytest.mark.slow
def test_dist_benchmark_rows_with_fake_timings(tmp_path: Path) -> None:
    dist = load_script("dist")
    run = scratch_run(tmp_path, bench="dist")
    case = {"mask": "full", "gpus": 4, "tokens_per_gpu": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "area": 4294967296}
    rows = dist["measure"](run, case, "maskc", "1f", lambda: (8.0, 25.0))
    flops = 4 * 4294967296 * 64 * 128
    assert [r["tflops"] for r in rows] == [flops / 8.0 / 1e9 / 4, 2.5 * flops / 25.0 / 1e9 / 4]
    assert all(r["plan"] == "1f" and r["kind"] == "dist" for r in rows)
    run.write("link", collective="all-to-all", gpus=4, gbps=220.4)
    table = report.dist_tables(read_results(tmp_path))
    assert table[0] == "All-to-all bandwidth per rank and direction: 220 GB/s at 4 GPUs."
    assert f"| 4 | full | 1f | {rows[0]['tflops']:.0f} / {rows[1]['tflops']:.0f} |" in table


@pytest.mark.parametrize("script", ["kernel", "dist", "report"])
def test_gpu_benchmarks_explain_themselves_anywhere(script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", [f"bench/{script}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / f"{script}.py"), run_name="__main__")
    assert done.value.code == 0
    assert "bench/README.md" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("script", "args", "kinds"),
    [
        ("lower", ["--runs", "1", "--tokens", "65536", "--docs", "100"], {"host"}),
        ("schedule", ["--runs", "1"], {"host"}),
        ("step_host", ["--runs", "1", "--cases", "128k"], {"host"}),
        ("dist_plan", ["--cp", "2", "--tokens-per-rank", "4096", "--algorithms", "swap"], {"plan"}),
        ("dist_dispatch", ["--runs", "1", "--tokens", "65536", "--cp", "8", "--chunk", "1024"], {"plan", "host"}),
        ("dist_stages", ["--runs", "1"], {"stages", "host"}),
    ],
)
def test_host_benchmarks_write_their_rows(script: str, args: list[str], kinds: set[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [f"bench/{script}.py", *args, "--out", str(tmp_path)])
    runpy.run_path(str(BENCH / f"{script}.py"), run_name="__main__")
    rows = read_results(tmp_path)
    assert {row["kind"] for row in rows} == kinds
    assert {row["bench"] for row in rows} == {script}
    assert len({row["run"] for row in rows}) == 1
    assert rows[0]["command"] == f"python bench/{script}.py {' '.join(args)} --out {tmp_path}"
    report.render_pages(rows)


def test_a_run_of_experimental_kernels_stays_on_the_history(tmp_path: Path) -> None:
    """A newer run that also times the opt-in kernels does not take the page's lines from the run
    of what users get; its figures are on the history page."""
    case = {"mask": "full", "seqlen": 16384, "heads": "64:8", "head_dim": 128, "dtype": "bf16", "direction": "fwd"}
    shipped = Run.start("kernel", "NVIDIA H200", tmp_path, argv=["bench/kernel.py"], now=NOW.replace(day=1))
    for impl, tflops in (("maskc", 620.0), ("fa4", 640.0)):
        shipped.write("kernel", impl=impl, tflops=tflops, **case)
    trial = Run.start("kernel", "NVIDIA H200", tmp_path, argv=["bench/kernel.py", "--portable"], now=NOW.replace(day=2))
    for impl, tflops in (("maskc", 610.0), ("maskc_portable_next", 330.0), ("sdpa_flash", 360.0)):
        trial.write("kernel", impl=impl, tflops=tflops, **case)
    rows = read_results(tmp_path)
    doc, history = report.render(rows), report.render_history(rows)
    assert f"16k from the run of {NOW.replace(day=1):%Y-%m-%d}, commit `{shipped.commit}`" in doc
    assert "| 330 |" not in doc and "| 330 |" in history
