"""Loading mask files: parse, check statically, and wrap each definition as a MaskFamily."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from maskc.errors import MaskcError, MaskParamError, MaskSemanticError, MaskSyntaxError
from maskc.frontend import syntax as s
from maskc.frontend.check import check_module, semantic_error
from maskc.frontend.lower import constant, lower_mask
from maskc.frontend.mask_family import MaskFamily
from maskc.frontend.params import Param, coerce, plain_default
from maskc.frontend.parser import parse


def load(source: str | os.PathLike[str]) -> dict[str, MaskFamily]:
    """Mask families of a file (a path) or of source text, by name, in order of appearance."""
    text, name = _read(source)
    module = parse(text, name)
    if not module.masks:
        raise MaskSemanticError(
            "no mask definitions found (expected 'mask name(params):' blocks)", source=name, line=1, column=1
        )
    check_module(module)
    return {mask.name: _family(mask, name) for mask in module.masks}


def _read(source: str | os.PathLike[str]) -> tuple[str, str]:
    """(text, name for error locations); a one-line str ending in .mask must name a file."""
    if isinstance(source, os.PathLike):
        path = Path(source)
    elif isinstance(source, str) and "\n" not in source and (source.endswith(".mask") or os.path.isfile(source)):
        path = Path(source)
    elif isinstance(source, str):
        return source, "<string>"
    else:
        raise TypeError(f"load() expects a path or source text, got {type(source).__name__}")
    if path.is_dir():
        raise MaskcError(f"{path} is a directory, not a mask file")
    if not path.is_file():
        raise FileNotFoundError(f"mask file not found: {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8"), str(path)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise MaskSyntaxError("not a mask file: the text is not UTF-8", source=str(path), line=line, column=column) from None


def _family(mask: s.MaskDef, source: str) -> MaskFamily:
    params = []
    for p in mask.params:
        default = None
        if p.default is not None:
            try:
                default = plain_default(p.kind, coerce(p.kind, constant(p.default, source, mask.name)))
            except MaskParamError as e:
                raise semantic_error(source, p.default.pos, f"default of param {p.name!r} ({p.kind}): {e}") from None
        params.append(Param(p.name, p.kind, default))
    lower = functools.partial(lower_mask, mask, source)
    return MaskFamily(mask.name, tuple(params), lower, f"{source}:{mask.pos.line}")
