"""The Python front: `@maskc.mask` turns a function that drives a `Builder` into a MaskFamily.

The function runs once per lowering; its emit calls take single ranges or whole numpy arrays
of them, so a vectorised function is as fast as the DSL. The decorator lowers the family
right away with its example parameters, so a broken mask fails at import, not at step 1.
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from maskc.errors import MaskcError, MaskError, MaskParamError
from maskc.frontend.builtins import BUILTINS, Chunks, T
from maskc.frontend.emit import SliceBuffer
from maskc.frontend.mask_family import MaskFamily
from maskc.frontend.params import (
    CuSeqLens,
    DocList,
    Param,
    ParamKind,
    ParamValue,
    Range,
    SeqLens,
    as_int,
    coerce,
    plain_default,
)

if typing.TYPE_CHECKING:
    from maskc.ir import Mask

_KINDS: dict[Any, ParamKind] = {int: "int", SeqLens: "seqlens", CuSeqLens: "cu_seqlens"}


class Ranges:
    """Many ranges at once, as from `Builder.chunks`; `owner[i]` is the input range chunk i came from."""

    __slots__ = ("starts", "ends", "owner")

    def __init__(self, starts: np.ndarray, ends: np.ndarray, owner: np.ndarray):
        self.starts, self.ends, self.owner = starts, ends, owner

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[Range]:
        return (Range(s, e) for s, e in zip(self.starts.tolist(), self.ends.tolist()))

    def __repr__(self) -> str:
        return f"Ranges({len(self)} ranges)"


RangeLike = Range | tuple[Any, Any] | range | Ranges
IntLike = int | np.ndarray


class Builder:
    """Collects the slices of one lowering; every range argument may also be arrays of ranges.

    Its methods are the DSL's built-ins (maskc/frontend/builtins.py), with their parameters;
    an optional one left out or None takes the table's default.
    """

    def __init__(self, mask_name: str):
        self._name = mask_name
        self._buffer = SliceBuffer()

    def seqlen(self, q: int, k: int | None = None) -> None:
        """Declare seqlen_q (and seqlen_k, which defaults to it); exactly once per mask."""
        self._call("seqlen", q=q, k=k)

    def full(self, q: RangeLike, k: RangeLike) -> None:
        self._call("full", q=q, k=k)

    def causal(self, q: RangeLike, k: RangeLike) -> None:
        self._call("causal", q=q, k=k)

    def inv_causal(self, q: RangeLike, k: RangeLike) -> None:
        self._call("inv_causal", q=q, k=k)

    def bi_causal(self, q: RangeLike, k: RangeLike) -> None:
        self._call("bi_causal", q=q, k=k)

    def band(self, q: RangeLike, k: RangeLike, left: IntLike | None = None, right: IntLike | None = None) -> None:
        """Sliding window: `left` keys before and `right` after the bottom-right aligned diagonal."""
        self._call("band", q=q, k=k, left=left, right=right)

    def prefix_lm(self, seq: RangeLike, prefix: IntLike) -> None:
        """The first `prefix` tokens of `seq` see each other fully, the rest are causal over `seq`."""
        self._call("prefix_lm", seq=seq, prefix=prefix)

    def chunks(self, seq: RangeLike, size: IntLike) -> Ranges:
        """Consecutive `size`-token pieces of each range (the last one shorter)."""
        return self._call("chunks", seq=seq, size=size)

    def finish(self) -> Mask:
        """The Mask of everything emitted so far (called by the family after the function ran)."""
        if self._buffer.seqlen is None:
            raise MaskError(f"mask {self._name!r} never called seqlen(); every mask must declare its sequence lengths")
        return self._buffer.build()

    def _call(self, name: str, **given: Any) -> Any:
        """Run built-in `name` on the given values (None: not given) converted to its parameter types."""
        spec = BUILTINS[name]
        where = self._where(name)
        values = spec.arrange((), {n: v for n, v in given.items() if v is not None}, lambda c: c)
        convert = {T.RANGE: _as_ranges, T.INT: _as_int if spec.once else _as_ints}
        plain = [convert[a.type](v, a.name, where) for a, v in zip(spec.args, values)]
        result = spec.lower(self._buffer, where, *plain)
        if isinstance(result, Chunks):
            owner, starts, ends = result.expand(where)
            return Ranges(starts, ends, owner)
        return result

    def _where(self, method: str) -> str:
        """The user's call site: the innermost frame outside this module."""
        frame = sys._getframe(1)
        while frame.f_code.co_filename == __file__ and frame.f_back is not None:
            frame = frame.f_back
        return f"{frame.f_code.co_filename}:{frame.f_lineno}: in mask {self._name!r}: {method}()"


def mask(fn: Callable[..., None] | None = None, /, *, example: Mapping[str, Any] | None = None) -> Any:
    """Decorator: `@mask` or `@mask(example={...})`; returns a MaskFamily, lowered once right away."""

    def decorate(f: Callable[..., None]) -> MaskFamily:
        family = _family(f)
        try:
            family.lower(**(example or {}))
        except Exception as e:
            error = MaskParamError if isinstance(e, MaskParamError) else MaskError
            why = str(e) if isinstance(e, MaskcError) else f"{type(e).__name__}: {e}"
            raise error(
                f"@maskc.mask {family.name!r} ({family.origin}) failed to lower with its example params: {why}"
            ) from e
        return family

    return decorate if fn is None else decorate(fn)


def _family(fn: Callable[..., None]) -> MaskFamily:
    name = fn.__name__
    origin = f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}"
    signature = inspect.signature(fn)
    args = list(signature.parameters.values())
    if not args or args[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise MaskError(f"@maskc.mask {name!r} ({origin}): the first parameter must take the Builder")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise MaskError(f"@maskc.mask {name!r} ({origin}): cannot resolve parameter annotations: {e}") from e
    params = []
    for arg in args[1:]:
        kind = _KINDS.get(hints.get(arg.name))
        if kind is None or arg.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            raise MaskError(
                f"@maskc.mask {name!r} ({origin}): parameter {arg.name!r} must be a named parameter "
                "annotated int, maskc.SeqLens or maskc.CuSeqLens"
            )
        default = None
        if arg.default is not inspect.Parameter.empty:
            try:
                default = plain_default(kind, coerce(kind, arg.default))
            except MaskParamError as e:
                raise MaskParamError(
                    f"@maskc.mask {name!r} ({origin}): default of {arg.name!r} ({kind}): {e}"
                ) from None
        params.append(Param(arg.name, kind, default))

    def lower(values: Mapping[str, ParamValue]) -> Mask:
        builder = Builder(name)
        fn(builder, **values)
        return builder.finish()

    return MaskFamily(name, tuple(params), lower, origin)


def _as_int(value: Any, what: str, where: str) -> int:
    try:
        return as_int(value)
    except MaskParamError as e:
        raise MaskError(f"{where}: {what}: {e}") from None


def _as_ints(value: Any, what: str, where: str) -> np.ndarray:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim > 1:
        raise MaskError(f"{where}: {what} must be an int or a 1-D int array, got {value!r}")
    return arr.astype(np.int64, copy=False)


def _as_ranges(value: Any, what: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(value, Ranges):
        return value.starts, value.ends
    if isinstance(value, range):
        if value.step != 1:
            raise MaskError(f"{where}: {what} must be a contiguous range, got {value!r}")
        return np.int64(value.start), np.int64(value.stop)
    if isinstance(value, DocList):
        raise MaskError(
            f"{where}: {what} is a document list; pass one document, or (docs.starts, docs.ends) for all of them"
        )
    try:
        start, end = value
    except (TypeError, ValueError):
        raise MaskError(f"{where}: {what} must be a (start, end) pair or a range, got {value!r}") from None
    return _as_ints(start, f"{what} start", where), _as_ints(end, f"{what} end", where)
