"""The frontend: the mask language (`load`) and the Python front, both producing MaskFamilies.

Importing this package stays light: the parser (and with it lark) loads on first use of
`load`, and everything else on first attribute access, so the runtime can import
`maskc.frontend.params` without pulling in the compiler stack.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from maskc.lazy import lazy_attributes

if TYPE_CHECKING:
    from maskc.frontend.mask_family import MaskFamily

_LAZY = {
    "MaskFamily": "maskc.frontend.mask_family",
    "Param": "maskc.frontend.params",
    "DocList": "maskc.frontend.params",
    "Range": "maskc.frontend.params",
    "SeqLens": "maskc.frontend.params",
    "CuSeqLens": "maskc.frontend.params",
    "Builder": "maskc.frontend.python_front",
    "mask": "maskc.frontend.python_front",
}

__all__ = ["load", *_LAZY]


def load(source: str | os.PathLike[str]) -> dict[str, MaskFamily]:
    """Mask families of a .mask file (path) or of source text, by name, in order of appearance."""
    from maskc.frontend.dsl import load as load_dsl

    return load_dsl(source)


__getattr__ = lazy_attributes(__name__, globals(), _LAZY)
