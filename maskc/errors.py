"""Error and warning types shared by every layer, so callers can catch maskc problems precisely."""

from __future__ import annotations


class MaskcError(Exception):
    """Base class of every error maskc raises on purpose."""


class PerformanceWarning(UserWarning):
    """Something that leaves results correct but makes them slower (a kernel ptxas compiled
    into a slow form)."""


class MaskError(MaskcError, ValueError):
    """An attention mask (slices, ranges, sequence lengths) is invalid."""


class MaskParamError(MaskcError, ValueError):
    """A runtime parameter of a mask family is missing, unknown or malformed."""


class MaskSyntaxError(MaskcError):
    """A mask source file is malformed; the message names file:line:col."""

    def __init__(self, message: str, *, source: str = "<string>", line: int = 0, column: int = 0):
        self.source = source
        self.line = line
        self.column = column
        self.detail = message
        super().__init__(f"{source}:{line}:{column}: {message}")


class MaskSemanticError(MaskSyntaxError):
    """A well-formed mask source means something invalid (unknown name, wrong type, ...)."""


class ArtifactError(MaskcError):
    """An artifact directory is missing, tampered with, or from an incompatible version."""


class VariantError(MaskcError, ValueError):
    """A kernel variant asks for something no kernel family supports."""


class MissingExtraError(MaskcError, ImportError):
    """An optional dependency is not installed; the message names the extra of maskc that
    brings it (maskc.lazy.optional_imports)."""


class CompilerUnavailableError(MissingExtraError):
    """Kernels must be compiled but the CUTLASS DSL is not installed here."""
