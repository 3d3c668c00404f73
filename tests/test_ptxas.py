"""maskc.codegen.ptxas: the report read from ptxas's log, and the warning a serialised wgmma
gives (on logs in the form the CUTLASS DSL writes them; no compiler needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from maskc.codegen.ptxas import PtxasReport, read_report
from maskc.errors import PerformanceWarning

ENTRY = "ptxas info    : Compiling entry function ''kernel_cutlass_attn_bwd_kernel_0'' for ''sm_90a''\n"
MAIN = (
    "ptxas info    : Function properties for kernel_cutlass_attn_bwd_kernel_0\n"
    "ptxas         .     80 bytes stack frame, 96 bytes spill stores, 120 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 16 barriers, 80 bytes cumulative stack size\n"
)
PREP = (
    "ptxas info    : Function properties for kernel_cutlass_attn_bwd_prep_kernel_0\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 32 registers, used 1 barriers\n"
)
SERIALIZED = (
    "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
    "program dependence on compiler-inserted WG.DP in divergent path in the function ''kernel_cutlass_attn_fwd_0''\n"
)


def remarks(log: str) -> str:
    """A remarks file as the DSL writes it: YAML, the log one quoted scalar."""
    return f"--- !Analysis\nPass:            ptxas info\nName:            RemarkPTXAS\nArgs:\n  - Remark:      'ptxas output: {log}'\n...\n"


def test_a_report_takes_the_largest_kernel_and_sums_the_spills() -> None:
    report = PtxasReport.parse(remarks(ENTRY + MAIN + PREP))
    assert report == PtxasReport(registers=168, stack_bytes=80, spill_bytes=216, serialized="")


def test_a_log_without_resource_usage_gives_no_report() -> None:
    assert PtxasReport.parse(remarks("ptxas info    : 0 bytes gmem\n")) is None
    assert PtxasReport.parse("") is None


def test_a_serialised_wgmma_is_a_warning_naming_the_variant_and_the_file_goes(tmp_path: Path) -> None:
    path = tmp_path / "remarks.yaml"
    path.write_text(remarks(SERIALIZED + ENTRY + PREP))
    with pytest.warns(PerformanceWarning, match=r"kernel variant attn_fwd_x: ptxas serialised its wgmma instructions \(C7518: "
                      r"wgmma\.mma_async instructions are serialized due to program dependence"):
        report = read_report(path, "attn_fwd_x")
    assert report.serialized.startswith("C7518: wgmma.mma_async instructions are serialized")
    assert not path.exists()


def test_a_clean_log_warns_nothing(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    path = tmp_path / "remarks.yaml"
    path.write_text(remarks(ENTRY + MAIN))
    assert read_report(path, "attn_bwd_x").spill_bytes == 216
    assert not recwarn.list and not path.exists()
