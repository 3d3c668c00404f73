"""Runtime parameters of mask families: their declaration, the document-list value, coercion.

Both fronts (the DSL and `@maskc.mask`) declare parameters with `Param` and check the values
a caller passes with `bind_params`, so a family behaves the same whichever front wrote it.
This module stays free of lark and torch imports: light consumers import it directly.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from maskc.errors import MaskParamError
from maskc.limits import MAX_INT, MAX_ROWS, MAX_TOKENS, check_count

ParamKind = Literal["int", "seqlens", "cu_seqlens"]
PARAM_KINDS: tuple[ParamKind, ...] = ("int", "seqlens", "cu_seqlens")


class Range(NamedTuple):
    """A half-open token range [start, end); a plain (start, end) tuple wherever one is expected."""

    start: int
    end: int

    @property
    def len(self) -> int:
        return self.end - self.start


class DocList:
    """Consecutive documents given by their boundaries; document i is [bounds[i], bounds[i+1]).

    `.start/.end/.len` describe the span of the whole list, `.count` the number of documents.
    Iterating yields `Range`s, indexing returns a `Range` and slicing another `DocList`;
    `starts`/`ends`/`lens` are read-only numpy arrays for vectorised use.
    """

    __slots__ = ("bounds",)

    def __init__(self, bounds: np.ndarray):
        bounds = np.array(bounds, dtype=np.int64)
        bounds.flags.writeable = False
        self.bounds = bounds

    @property
    def starts(self) -> np.ndarray:
        return self.bounds[:-1]

    @property
    def ends(self) -> np.ndarray:
        return self.bounds[1:]

    @property
    def lens(self) -> np.ndarray:
        return np.diff(self.bounds)

    @property
    def start(self) -> int:
        return int(self.bounds[0])

    @property
    def end(self) -> int:
        return int(self.bounds[-1])

    @property
    def len(self) -> int:
        return self.end - self.start

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Range]:
        b = self.bounds.tolist()
        return (Range(s, e) for s, e in zip(b[:-1], b[1:]))

    def __getitem__(self, item: int | slice) -> Range | DocList:
        if isinstance(item, slice):
            lo, hi, step = item.indices(self.count)
            if step != 1:
                raise IndexError("document lists can only be sliced with step 1")
            return DocList(self.bounds[lo : max(lo, hi) + 1])
        i = operator.index(item)
        if not -self.count <= i < self.count:
            raise IndexError(f"document index {i} out of range for {self.count} documents")
        i %= self.count
        return Range(int(self.bounds[i]), int(self.bounds[i + 1]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DocList) and np.array_equal(self.bounds, other.bounds)

    def __hash__(self) -> int:
        return hash(self.bounds.tobytes())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lens={_short(self.lens.tolist())}, start={self.start})"


class SeqLens(DocList):
    """Annotation (and value type) of a parameter given as document lengths."""


class CuSeqLens(DocList):
    """Annotation (and value type) of a parameter given as cumulative boundaries from 0."""


@dataclass(frozen=True)
class Param:
    """A declared parameter; `default` is an int, a tuple of ints (lengths or bounds), or None."""

    name: str
    kind: ParamKind
    default: int | tuple[int, ...] | None = None

    def __str__(self) -> str:
        text = f"{self.name}: {self.kind}"
        if self.default is not None:
            default = list(self.default) if isinstance(self.default, tuple) else self.default
            text += f" = {_short(default)}"
        return text


ParamValue = int | DocList


def coerce(kind: ParamKind, value: Any) -> ParamValue:
    """Check one value against its kind; raises MaskParamError with a message (no mask name)."""
    if kind == "int":
        return as_int(value)
    arr = _as_int_vector(value, kind)
    check_count(arr.size, MAX_ROWS, f"{kind} values", MaskParamError)
    if kind == "seqlens":
        if arr.size and arr.min() < 0:
            i = int(np.argmax(arr < 0))
            raise MaskParamError(f"document lengths must be >= 0, got {int(arr[i])} at index {i}")
        # Each length is checked before the sum, so the sum cannot overflow.
        check_count(int(arr.max(initial=0)), MAX_TOKENS, "tokens in a document", MaskParamError)
        bounds = np.zeros(arr.size + 1, dtype=np.int64)
        np.cumsum(arr, out=bounds[1:])
        check_count(int(bounds[-1]), MAX_TOKENS, "tokens in all documents", MaskParamError)
        return SeqLens(bounds)
    if arr.size == 0 or arr[0] != 0:
        raise MaskParamError(f"cu_seqlens must start at 0, got {_short(arr.tolist())}")
    steps = np.diff(arr)
    if steps.size and steps.min() < 0:
        i = int(np.argmax(steps < 0)) + 1
        raise MaskParamError(
            f"cu_seqlens must be non-decreasing, got {int(arr[i])} after {int(arr[i - 1])} at index {i}"
        )
    check_count(int(arr[-1]), MAX_TOKENS, "tokens in all documents", MaskParamError)
    return CuSeqLens(arr)


def plain_default(kind: ParamKind, value: ParamValue) -> int | tuple[int, ...]:
    """How `Param.default` stores a checked value: lengths for seqlens, bounds for cu_seqlens."""
    if isinstance(value, DocList):
        return tuple((value.lens if kind == "seqlens" else value.bounds).tolist())
    return value


def bind_params(mask_name: str, params: Sequence[Param], given: Mapping[str, Any]) -> dict[str, ParamValue]:
    """Values for every parameter, from `given` or the defaults, with errors naming the mask."""
    declared = {p.name: p for p in params}
    expected = ", ".join(str(p) for p in params) or "none"
    unknown = [name for name in given if name not in declared]
    if unknown:
        raise MaskParamError(f"mask {mask_name!r}: unknown param {unknown[0]!r}; expected params: {expected}")
    values: dict[str, ParamValue] = {}
    for p in params:
        if p.name in given:
            try:
                values[p.name] = coerce(p.kind, given[p.name])
            except MaskParamError as e:
                raise MaskParamError(f"mask {mask_name!r}: param {p.name!r} ({p.kind}): {e}") from None
        elif p.default is not None:
            values[p.name] = coerce(p.kind, p.default)
        else:
            raise MaskParamError(
                f"mask {mask_name!r}: missing param {p.name!r} (no default); expected params: {expected}"
            )
    return values


def as_int(value: Any) -> int:
    """`value` as a Python int; ints of any kind (numpy, 0-d int tensors) pass, bools and floats do not."""
    if _is_tensor(value) and not _is_int_dtype(value.dtype):
        raise MaskParamError(f"expected an int, got a {value.dtype} tensor")
    if isinstance(value, (bool, np.bool_)):
        raise MaskParamError(f"expected an int, got {_describe(value)}")
    try:
        number = operator.index(value)
    except TypeError:
        raise MaskParamError(f"expected an int, got {_describe(value)}") from None
    if abs(number) > MAX_INT:
        raise MaskParamError(f"{number} is outside the integers maskc computes with (at most 2^62 - 1 in magnitude)")
    return number


def _as_int_vector(value: Any, kind: str) -> np.ndarray:
    if _is_tensor(value):
        if value.device.type != "cpu":
            raise MaskParamError(
                f"{kind} must be a CPU tensor (got one on {value.device}); "
                "move it with .cpu() once, outside the training step"
            )
        value = value.detach().numpy()
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple, range)):
        bad = next((x for x in value if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer))), None)
        if isinstance(bad, (list, tuple, np.ndarray)):
            raise MaskParamError(f"{kind} must be 1-D, got a nested {type(bad).__name__}")
        if bad is not None:
            raise MaskParamError(f"{kind} must hold ints, got {_describe(bad)}")
        try:
            arr = np.asarray(value, dtype=np.int64)
        except OverflowError:
            raise MaskParamError(f"{kind} value out of the int64 range") from None
    else:
        raise MaskParamError(f"{kind} must be a list, tuple, numpy array or CPU tensor of ints, got {_describe(value)}")
    if arr.ndim != 1:
        raise MaskParamError(f"{kind} must be 1-D, got shape {tuple(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise MaskParamError(f"{kind} must hold ints, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=True)


def _is_int_dtype(dtype: Any) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {_short(value)}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ...]"
