"""MaskFamily: a mask whose structure is fixed and whose parameters are filled at each step.

One class for both fronts: a front supplies the parameter declarations and a function that
lowers checked values to a Mask; binding and validating the values happens here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from maskc.frontend.params import Param, ParamValue, bind_params

if TYPE_CHECKING:
    from maskc.ir import Mask

LowerFn = Callable[[Mapping[str, ParamValue]], "Mask"]


class MaskFamily:
    """A named mask family; `lower(**params)` builds the Mask for one set of parameter values."""

    __slots__ = ("name", "params", "origin", "_lower")

    def __init__(self, name: str, params: tuple[Param, ...], lower: LowerFn, origin: str = "<unknown>"):
        self.name = name
        self.params = tuple(params)
        self.origin = origin
        self._lower = lower

    @property
    def defaults(self) -> dict[str, int | tuple[int, ...]]:
        """Defaults of the parameters that have one, by name."""
        return {p.name: p.default for p in self.params if p.default is not None}

    def lower(self, **params: Any) -> Mask:
        """Lower to a Mask; missing params take their defaults (MaskParamError if there is none)."""
        return self._lower(bind_params(self.name, self.params, params))

    def __repr__(self) -> str:
        return f"<MaskFamily {self.name}({', '.join(str(p) for p in self.params)}) from {self.origin}>"
