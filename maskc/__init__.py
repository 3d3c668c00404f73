"""maskc: a declarative attention-mask compiler for long-context training."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from maskc.artifact.source import set_kernel_source
from maskc.errors import ArtifactError, MaskcError, MaskError, MaskParamError, MaskSemanticError, MaskSyntaxError
from maskc.lazy import lazy_attributes
from maskc.version import __version__ as __version__  # re-exported: maskc.__version__

# The public names that need torch (or the grammar) are imported on first use, so `import
# maskc` (and with it the `maskc` command's --help and --version) stays fast.
_LAZY = {
    "AttentionMeta": "maskc.reference",
    "AttnSlice": "maskc.ir",
    "Builder": "maskc.frontend.python_front",
    "CuSeqLens": "maskc.frontend.params",
    "Mask": "maskc.ir",
    "PositionMask": "maskc.runtime",
    "PreparedMask": "maskc.runtime",
    "SeqLens": "maskc.frontend.params",
    "attention": "maskc.runtime",
    "mask": "maskc.frontend.python_front",
    "prepare": "maskc.runtime",
    "reference_attention": "maskc.reference",
    "target_for": "maskc.runtime",
}

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path
    from typing import Any

    from maskc.frontend.params import CuSeqLens, SeqLens
    from maskc.frontend.python_front import Builder, mask
    from maskc.ir import AttnSlice, Mask
    from maskc.reference import AttentionMeta, reference_attention
    from maskc.runtime import PositionMask, PreparedMask, attention, prepare, target_for


__getattr__ = lazy_attributes(__name__, globals(), _LAZY)


def _compile_kernel(request: Mapping[str, Any]) -> Path:
    """The just-in-time compile (maskc.codegen.jit), imported with the first kernel it builds."""
    from maskc.codegen.jit import compile_request

    return compile_request(request)


# The runtime never imports the compiler; where the CUTLASS DSL is installed, it compiles the
# kernels no registered artifact holds through this kernel source.
if importlib.util.find_spec("cutlass") is not None:
    set_kernel_source(_compile_kernel)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ArtifactError",
    "AttentionMeta",
    "AttnSlice",
    "Builder",
    "CuSeqLens",
    "Mask",
    "MaskError",
    "MaskParamError",
    "MaskSemanticError",
    "MaskSyntaxError",
    "MaskcError",
    "PositionMask",
    "PreparedMask",
    "SeqLens",
    "attention",
    "mask",
    "prepare",
    "reference_attention",
    "target_for",
]
