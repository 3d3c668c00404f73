"""maskc: a declarative attention-mask compiler for long-context training."""

__version__ = "0.1.0"

from maskc.errors import ArtifactError, MaskcError, MaskError, MaskParamError, MaskSemanticError, MaskSyntaxError
from maskc.frontend.params import CuSeqLens, SeqLens
from maskc.frontend.python_front import Builder, mask
from maskc.ir import AttnSlice, Mask
from maskc.reference import AttentionMeta, reference_attention
from maskc.runtime import attention

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
    "SeqLens",
    "attention",
    "mask",
    "reference_attention",
]
