"""The just-in-time path: from a runtime request (what a call needs) to a compiled, cached
kernel. `import maskc` registers `compile_request` as the runtime's kernel source
(maskc.artifact.source) where the CUTLASS DSL is installed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maskc.artifact.variant import variant_for
from maskc.codegen.cache import cached_kernel


def compile_request(request: Mapping[str, Any]) -> Path:
    """The cache entry (an artifact directory) holding the kernel for `request`."""
    return cached_kernel(variant_for(request))
