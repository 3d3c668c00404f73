"""bench/sass.py: the block loops found in an nvdisasm listing, and a clear error without nvdisasm."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from maskc.errors import MaskcError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sass  # noqa: E402


def listing(kernels: dict[str, list[str]]) -> str:
    """An nvdisasm -c listing of `kernels` (name: lines, labels as ".L_x_N:", others instructions)."""
    lines = ["\t.headerflags\t@\"EF_CUDA_SM90\""]
    for name, body in kernels.items():
        lines += [f"//--------------------- .text.{name} ---", f"\t.section\t.text.{name}", f".text.{name}:"]
        address = 0
        for line in body:
            if line.startswith(".L_x_"):
                lines.append(line)
            else:
                lines.append(f"        /*{address:04x}*/                   {line} ;")
                address += 16
    return "\n".join(lines) + "\n"


SASS = listing({
    "kernel_cutlass_attn_bwd_kernel_CopyAtom_ThrID10": [
        "S2R R0, SR_TID.X",
        ".L_x_1:",  # the item loop: entered again in the middle of the block loop
        "LDG.E R2, desc[UR4][R4.64]",
        ".L_x_2:",  # the block loop
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",
        "@!P0 LDL R3, [R1+0x8]",
        ".L_x_3:",
        "LDS.64 R6, [R5]",
        "STSM.16.M88.4 [R7], R8",
        "BAR.SYNC.DEFER_BLOCKING 0x3, 0x100",
        "@P1 BRA `(.L_x_2)",
        "HGMMA.64x128x16.F32.BF16 R88, R228, gdesc[UR8].tnspB, R88",
        "@P2 BRA `(.L_x_3)",
        "@P3 BRA `(.L_x_1)",
        "EXIT",
    ],
    "kernel_cutlass_attn_bwd_prep_kernel_tensorptr": [
        ".L_x_9:",
        "MUFU.EX2 R1, R2",
        "@P0 BRA `(.L_x_9)",
        "BRA `(.L_x_10)",
        ".L_x_10:",
        "EXIT",
    ],
})  # fmt: skip


def test_every_back_edge_is_a_loop_of_its_kernel() -> None:
    found = {(sass.short_name(loop.kernel), loop.first, loop.last) for loop in sass.loops(SASS)}
    assert found == {("attn_bwd_kernel", 2, 7), ("attn_bwd_kernel", 4, 9), ("attn_bwd_kernel", 1, 10),
                     ("attn_bwd_prep_kernel", 0, 1)}  # fmt: skip


def test_the_block_loops_are_the_innermost_that_issue_wgmma() -> None:
    """The loop closed at 7 is the block loop; the one entered at 4 (overlapping it) and the item
    loop hold its back edge; the preprocess's loop issues no wgmma."""
    (block,) = sass.block_loops(SASS)
    assert (block.first, block.last, block.size) == (2, 7, 6)
    assert block.opcodes["HGMMA"] == 1 and block.opcodes["LDL"] == 1 and block.opcodes["LDS"] == 1
    assert block.opcodes["STSM"] == 1 and block.opcodes["BAR"] == 1 and block.opcodes["BRA"] == 1
    table = sass.loop_table(SASS)
    assert table[2] == "| attn_bwd_kernel | 2-7 | 6 | 1 / 0 | 1 / 0 | 1 / 0 / 0 / 1 | 0 / 0 | 1 | 1 | 0 | 0 |"
    assert len(table) == 3


PORTABLE = listing({
    "kernel_cutlass_attn_bwd_kernel_tensorptrbf16": [
        ".L_x_4:",  # the item loop
        "LDG.E R2, desc[UR4][R4.64]",
        ".L_x_5:",  # the block loop: a warp MMA, an ldmatrix, a dQ reduction
        "LDSM.16.M88.4 R8, [R3]",
        "HMMA.16816.F32.BF16 R24, R8, R12, R24",
        "@P0 RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R6.64], R24",
        "@P1 BRA `(.L_x_5)",
        "@P2 BRA `(.L_x_4)",
        "EXIT",
    ],
})  # fmt: skip


def test_the_portable_kernels_block_loops_are_those_that_issue_warp_mmas() -> None:
    (block,) = sass.block_loops(PORTABLE)
    assert (block.first, block.last) == (1, 4) and block.opcodes["HMMA"] == 1 and block.opcodes["RED"] == 1
    assert sass.loop_table(PORTABLE)[2] == "| attn_bwd_kernel | 1-4 | 4 | 0 / 1 | 0 / 0 | 0 / 1 / 0 / 0 | 0 / 1 | 1 | 0 | 0 | 0 |"


def test_a_listing_is_read_without_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    path = tmp_path / "other.sass"
    path.write_text(PORTABLE)
    monkeypatch.setattr(sys, "argv", ["sass.py", "--listing", str(path)])
    sass.main()
    assert "| attn_bwd_kernel | 1-4 | 4 | 0 / 1 |" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["sass.py", "--listing", str(tmp_path / "missing.sass")])
    with pytest.raises(SystemExit):
        sass.main()
    assert "cannot read the listing" in capsys.readouterr().err


def test_a_variant_the_families_lack_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    monkeypatch.setenv("NVDISASM", "/opt/nvdisasm")
    monkeypatch.setattr(sys, "argv", ["sass.py", "--direction", "fwd", "--head-dim", "128", "--unmasked"])
    with pytest.raises(SystemExit):
        sass.main()
    assert "unmasked is a backward option" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["sass.py", "--head-dim", "128"])
    with pytest.raises(SystemExit):
        sass.main()
    assert "--direction and --head-dim" in capsys.readouterr().err


def test_other_kernels_keep_their_whole_symbol() -> None:
    symbol = "_ZN5flash44flash_bwd_dq_dk_dv_loop_seqk_parallel_kernelI23Flash_bwd_kernel_traitsILi128EEEvNS_6ParamsE"
    assert sass.short_name(symbol) == symbol


def test_opcodes_drop_predicates_and_modifiers() -> None:
    assert sass.opcode("@!P0 LDS.64 R2, [R3]") == "LDS"
    assert sass.opcode("@UP1 UIADD3.64 UR12, UR8, 0x2, URZ") == "UIADD3"
    assert sass.opcode("HGMMA.64x64x16.F32.BF16 R184, gdesc[UR8], RZ, !UPT") == "HGMMA"


def test_without_nvdisasm_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVDISASM", raising=False)
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    monkeypatch.setattr(sass.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MaskcError, match="pip install nvidia-cuda-nvdisasm"):
        sass.find_nvdisasm()
    monkeypatch.setenv("NVDISASM", "/opt/nvdisasm")
    assert sass.find_nvdisasm() == "/opt/nvdisasm"


@pytest.mark.slow
def test_a_compile_keeps_the_cubin_asked_for(tmp_path: Path) -> None:
    """compile_variant(keep_cubin=True) leaves the cubin nvdisasm reads, and no PTX unless asked."""
    pytest.importorskip("cutlass.cute")
    from maskc.artifact.kernel_families import HeadDim
    from maskc.artifact.variant import variant_for
    from maskc.codegen.compile import compile_variant

    variant = variant_for(sass.request("fwd", HeadDim(64, 64), (8, 8)))
    built = compile_variant(variant, tmp_path, keep_ptx=False, keep_cubin=True)
    dump = tmp_path / f"{built.key}.dump"
    assert list(dump.rglob("*.cubin")) and not list(dump.rglob("*.ptx")) and built.ptx_path is None
