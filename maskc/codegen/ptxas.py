"""What ptxas said about a compiled variant: its registers, stack and spills, and whether it
serialised the wgmma instructions.

The CUTLASS DSL runs ptxas itself; with `remarks{ptx}` it passes `-v` and writes ptxas's log as
remarks to the file `--remark-output` names (`OPTIONS`). A serialised wgmma (ptxas's "Potential
Performance Loss: wgmma.mma_async instructions are serialized" notes, C7518 and its kin: every
product waits for the one before) leaves the kernel correct but about a third slower, so it must
not pass silently: a branch that left a product in flight across it did that to every wgmma of
the forward once (docs/design/forward-kernel.md).
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from maskc.errors import PerformanceWarning

#: cute.compile options that make the DSL write ptxas's log (as YAML remarks) to a file.
OPTIONS = "remarks{{ptx}} --remark-output={path}"

_USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SERIALIZED = re.compile(r"\((C75\d\d)\) Potential Performance Loss: (wgmma[^\n']*)")


@dataclass(frozen=True)
class PtxasReport:
    """ptxas's account of a variant's kernels (one, or the backward's preprocess and main
    kernel): the most registers and stack bytes any of them uses, their spill bytes (stores and
    loads) summed, and ptxas's note where it serialised wgmma instructions ("" where not)."""

    registers: int
    stack_bytes: int
    spill_bytes: int
    serialized: str

    @classmethod
    def parse(cls, log: str) -> PtxasReport | None:
        """The report of a ptxas -v log; None where it has no resource usage."""
        usage = [tuple(map(int, m.groups())) for m in _USAGE.finditer(log)]
        registers = [int(m.group(1)) for m in _REGISTERS.finditer(log)]
        if not usage or not registers:
            return None
        serialized = _SERIALIZED.search(log)
        return cls(
            registers=max(registers),
            stack_bytes=max(stack for stack, _, _ in usage),
            spill_bytes=sum(stores + loads for _, stores, loads in usage),
            serialized=f"{serialized.group(1)}: {serialized.group(2).strip()}" if serialized else "",
        )


def remarks_file() -> Path:
    """A new, empty file for the DSL's remarks (in the temporary folder: an option's path must
    hold no spaces, and parallel compiles each need their own)."""
    fd, name = tempfile.mkstemp(prefix="maskc-ptxas-", suffix=".yaml")
    os.close(fd)
    return Path(name)


def read_report(remarks: Path, key: str) -> PtxasReport | None:
    """The report in the remarks file the DSL wrote for variant `key` (None where it wrote no
    resource usage: an older DSL), which is removed; a serialised wgmma is a PerformanceWarning
    naming the variant."""
    try:
        report = PtxasReport.parse(remarks.read_text())
    finally:
        remarks.unlink(missing_ok=True)
    if report is not None and report.serialized:
        warnings.warn(
            f"kernel variant {key}: ptxas serialised its wgmma instructions ({report.serialized}); it computes "
            "correctly but runs slower",
            PerformanceWarning,
            stacklevel=3,
        )
    return report
