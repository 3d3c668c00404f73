"""The mask language's built-ins, in one table that both fronts read.

The checker takes each built-in's parameters, types and arity from here, the DSL lowering and
the Python front's `Builder` take its defaults and the function that lowers it, and
docs/dsl.md lists the signatures this table writes (tests/test_builtins.py keeps them equal),
so a built-in is described once.

A lowering function gets the `SliceBuffer` of the lowering, the call site for its errors and
the call's values in parameter order, defaults filled in: ints as int64 arrays (one entry
per row), ranges as (starts, ends) arrays; a built-in called `once` per mask gets plain ints.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from maskc.errors import MaskError
from maskc.frontend.emit import RangeArrays, SliceBuffer, check_rows, split_chunks
from maskc.ir.slices import ragged_expand

V = TypeVar("V")


class T(enum.Enum):
    """Static types of expressions."""

    INT = "int"
    BOOL = "bool"
    RANGE = "range"
    DOCS = "document list"
    CHUNKS = "chunks(...)"
    SEQ = "range(...)"


@dataclass(frozen=True)
class Arg:
    """A parameter: `default` is an int, the name of an earlier parameter whose value it takes, or None (required)."""

    name: str
    type: T
    default: int | str | None = None


@dataclass(frozen=True)
class Builtin:
    """A built-in: `returns` None means a statement that emits slices; `lower` computes its effect or value."""

    name: str
    args: tuple[Arg, ...]
    returns: T | None
    lower: Callable[..., Any]
    positional_only: bool = False
    variadic: bool = False
    once: bool = False  # called once per mask, at the top level (the checker sees to it)
    python: bool = True  # a `Builder` method; False where Python's own built-in of that name serves

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    @property
    def required(self) -> int:
        return sum(a.default is None for a in self.args)

    def positional(self, n: int) -> tuple[str, ...]:
        """The parameters n positional arguments fill: the required ones and the first n - required
        optional ones, in order (so `range(stop)` fills stop, as Python's range does)."""
        optional = [a.name for a in self.args if a.default is not None][: max(0, n - self.required)]
        return tuple(a.name for a in self.args if a.default is None or a.name in optional)

    def arrange(self, args: Sequence[V], kwargs: Mapping[str, V], constant: Callable[[int], V]) -> list[V]:
        """The values of a call that fits, in parameter order with defaults filled in; a
        variadic built-in's extra arguments follow."""
        bound = {**dict(zip(self.positional(len(args)), args)), **kwargs}
        for a in self.args:
            if a.name not in bound:
                bound[a.name] = bound[a.default] if isinstance(a.default, str) else constant(a.default)
        return [bound[name] for name in self.names] + list(args[len(self.args) :])

    def signature(self) -> str:
        """How docs/dsl.md lists the built-in."""
        params = [a.name if a.default is None else f"{a.name}={a.default}" for a in self.args]
        params += ["..."] if self.variadic else []
        params += ["/"] if self.positional_only else []
        value = f" -> {self.returns.value}" if self.returns is not None else ""
        return f"{self.name}({', '.join(params)}){value}"


@dataclass(frozen=True, eq=False)
class Chunks:
    """`chunks(seq, size)` per row, expanded only when iterated."""

    start: np.ndarray
    end: np.ndarray
    size: np.ndarray

    def take(self, index: np.ndarray) -> Chunks:
        return Chunks(self.start[index], self.end[index], self.size[index])

    def expand(self, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row of each chunk, chunk starts, chunk ends)."""
        return split_chunks(self.start, self.end, self.size, where)


@dataclass(frozen=True, eq=False)
class Seq:
    """`range(start, stop, step)` per row."""

    start: np.ndarray
    stop: np.ndarray
    step: np.ndarray

    def take(self, index: np.ndarray) -> Seq:
        return Seq(self.start[index], self.stop[index], self.step[index])

    def expand(self, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(row of each element, the elements)."""
        parent, local = ragged_expand(check_rows(np.maximum(0, -((self.start - self.stop) // self.step)), where))
        return parent, self.start[parent] + local * self.step[parent]


def _primitive(kind: str) -> Callable[[SliceBuffer, str, RangeArrays, RangeArrays], None]:
    def lower(out: SliceBuffer, where: str, q: RangeArrays, k: RangeArrays) -> None:
        out.add(kind, q, k, where)

    return lower


def _band(out: SliceBuffer, where: str, q: RangeArrays, k: RangeArrays, left: np.ndarray, right: np.ndarray) -> None:
    out.band(q, k, left, right, where)


def _prefix_lm(out: SliceBuffer, where: str, seq: RangeArrays, prefix: np.ndarray) -> None:
    out.prefix_lm(seq, prefix, where)


def _seqlen(out: SliceBuffer, where: str, q: int, k: int) -> None:
    out.declare_seqlen(q, k, where)


def _chunks(out: SliceBuffer, where: str, seq: RangeArrays, size: np.ndarray) -> Chunks:
    return Chunks(*seq, size)


def _range(out: SliceBuffer, where: str, start: np.ndarray, stop: np.ndarray, step: np.ndarray) -> Seq:
    if not step.all():
        raise MaskError(f"{where} step must not be 0")
    return Seq(start, stop, step)


def _extreme(reduce: np.ufunc) -> Callable[..., np.ndarray]:
    def lower(out: SliceBuffer, where: str, *values: np.ndarray) -> np.ndarray:
        return reduce.reduce(values)

    return lower


_QK = (Arg("q", T.RANGE), Arg("k", T.RANGE))
_AB = (Arg("a", T.INT), Arg("b", T.INT))

BUILTINS: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("seqlen", (Arg("q", T.INT), Arg("k", T.INT, "q")), None, _seqlen, once=True),
        *(Builtin(kind, _QK, None, _primitive(kind)) for kind in ("full", "causal", "inv_causal", "bi_causal")),
        Builtin("band", (*_QK, Arg("left", T.INT, 0), Arg("right", T.INT, 0)), None, _band),
        Builtin("prefix_lm", (Arg("seq", T.RANGE), Arg("prefix", T.INT)), None, _prefix_lm),
        Builtin("chunks", (Arg("seq", T.RANGE), Arg("size", T.INT)), T.CHUNKS, _chunks),
        Builtin(
            "range",
            (Arg("start", T.INT, 0), Arg("stop", T.INT), Arg("step", T.INT, 1)),
            T.SEQ,
            _range,
            positional_only=True,
            python=False,
        ),
        Builtin("min", _AB, T.INT, _extreme(np.minimum), positional_only=True, variadic=True, python=False),
        Builtin("max", _AB, T.INT, _extreme(np.maximum), positional_only=True, variadic=True, python=False),
    )
}
