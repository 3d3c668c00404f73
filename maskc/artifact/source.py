"""Where the runtime gets a kernel that no registered artifact directory holds.

The runtime never imports the compiler: it asks the kernel source registered here, if any,
for an artifact directory holding the kernel a call needs. `import maskc` registers the
code generator's just-in-time compile where the CUTLASS DSL is installed; without it, a
missing kernel is an error that says how to build one ahead of time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class KernelSource(Protocol):
    def __call__(self, request: Mapping[str, Any]) -> Path:
        """An artifact directory holding the kernel for `request` (a kernel's fields but its tile
        shape: arch, direction, head dim, dtype, head counts and flags)."""


_source: KernelSource | None = None


def set_kernel_source(source: KernelSource | None) -> None:
    """Make `source` the runtime's way to a missing kernel (None: no way)."""
    global _source
    _source = source


def kernel_source() -> KernelSource | None:
    return _source
