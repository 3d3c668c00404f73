"""Vectorised lowering of a checked mask definition to a Mask.

Each statement runs once over a *batch* of loop iterations (a `Frame`): the mask body is a
batch of one row; a `for` builds a child batch with one row per (parent row, element) pair;
an `if` runs its body on the rows where the condition holds. Every value is a numpy array
with one entry per row, so a loop over thousands of documents costs a handful of numpy
calls, and emitting statements hand whole arrays of slices to the shared SliceBuffer.
Built-in calls run through their entries in maskc/frontend/builtins.py, as the Python front's do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from maskc.errors import MaskError
from maskc.frontend import syntax as s
from maskc.frontend.builtins import BUILTINS, Chunks, Seq
from maskc.frontend.emit import SliceBuffer, check_rows
from maskc.frontend.params import DocList, ParamValue
from maskc.ir import Mask
from maskc.ir.slices import ragged_expand
from maskc.limits import MAX_INT


@dataclass(frozen=True, eq=False)
class RangeV:
    """One range per row."""

    start: np.ndarray
    end: np.ndarray

    def take(self, index: np.ndarray) -> RangeV:
        return RangeV(self.start[index], self.end[index])


@dataclass(frozen=True, eq=False)
class DocsV:
    """Per row, the documents [lo, hi) of one shared boundary array (slicing moves lo/hi only)."""

    bounds: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def take(self, index: np.ndarray) -> DocsV:
        return DocsV(self.bounds, self.lo[index], self.hi[index])


Value = np.ndarray | RangeV | DocsV | Chunks | Seq


class Frame:
    """A batch of `size` rows; `index[r]` is row r's row in the parent (None: the same rows)."""

    __slots__ = ("size", "parent", "index", "vars")

    def __init__(self, size: int, parent: Frame | None = None, index: np.ndarray | None = None):
        self.size = size
        self.parent = parent
        self.index = index
        self.vars: dict[str, Value] = {}

    def get(self, name: str) -> Value:
        """A variable's per-row values, gathered from the enclosing batch on first use."""
        value = self.vars.get(name)
        if value is None:
            assert self.parent is not None, name
            value = self.parent.get(name)
            if self.index is not None:
                value = value[self.index] if isinstance(value, np.ndarray) else value.take(self.index)
            self.vars[name] = value
        return value

    def sub(self, index: np.ndarray) -> Frame:
        """The batch of the given rows of this one."""
        return Frame(len(index), self, index)


def lower_mask(mask: s.MaskDef, source: str, values: Mapping[str, ParamValue]) -> Mask:
    """The Mask of one mask definition for checked parameter values."""
    top = Frame(1)
    for name, value in values.items():
        if isinstance(value, DocList):
            top.vars[name] = DocsV(value.bounds, np.zeros(1, np.int64), np.array([value.count], np.int64))
        else:
            top.vars[name] = np.array([value], dtype=np.int64)
    run = _Lowering(mask.name, source)
    run.block(mask.body, top)
    return run.buffer.build()


def constant(expr: s.Expr, source: str, mask_name: str) -> int | tuple[int, ...]:
    """Value of a parameter default (checked to use no names): an int or a tuple of ints."""
    run = _Lowering(mask_name, source)
    if isinstance(expr, s.ListLit):
        return tuple(int(run.eval(item, Frame(1))[0]) for item in expr.items)
    return int(run.eval(expr, Frame(1))[0])


class _Lowering:
    def __init__(self, mask_name: str, source: str):
        self.mask_name = mask_name
        self.source = source
        self.buffer = SliceBuffer()

    def where(self, pos: s.Pos, func: str | None = None) -> str:
        site = f"{self.source}:{pos.line}:{pos.column}: in mask {self.mask_name!r}"
        return f"{site}: {func}()" if func else site

    def fail(self, pos: s.Pos, message: str) -> MaskError:
        return MaskError(f"{self.where(pos)}: {message}")

    # Statements.

    def block(self, body: tuple[s.Stmt, ...], frame: Frame) -> None:
        if frame.size == 0:
            return
        for stmt in body:
            _STATEMENTS[type(stmt)](self, stmt, frame)

    def stmt_assign(self, stmt: s.Assign, frame: Frame) -> None:
        frame.vars[stmt.name] = self.eval(stmt.value, frame)

    def stmt_for(self, stmt: s.For, frame: Frame) -> None:
        parent, element = self.expand(self.eval(stmt.iter, frame), stmt.iter.pos)
        child = frame.sub(parent)
        child.vars[stmt.var] = element
        self.block(stmt.body, child)

    def stmt_if(self, stmt: s.If, frame: Frame) -> None:
        rest: np.ndarray | None = None  # rows no branch has taken yet; None: all of them
        for cond, body in stmt.branches:
            here = frame if rest is None else frame.sub(rest)
            holds = self.eval(cond, here)
            taken = np.flatnonzero(holds)
            if rest is None and taken.size == frame.size:
                self.block(body, Frame(frame.size, frame))
                return
            self.block(body, frame.sub(taken if rest is None else rest[taken]))
            rest = np.flatnonzero(~holds) if rest is None else rest[~holds]
            if rest.size == 0:
                return
        self.block(stmt.orelse, Frame(frame.size, frame) if rest is None else frame.sub(rest))

    def stmt_assert(self, stmt: s.Assert, frame: Frame) -> None:
        if not self.eval(stmt.cond, frame).all():
            raise self.fail(stmt.pos, f"assertion failed: {stmt.message}" if stmt.message else "assertion failed")

    def stmt_call(self, stmt: s.CallStmt, frame: Frame) -> None:
        self.expr_call(stmt.call, frame)

    # Iteration: (parent row of each element, the elements).

    def expand(self, it: Value, pos: s.Pos) -> tuple[np.ndarray, Value]:
        if isinstance(it, DocsV):
            parent, local = ragged_expand(check_rows(it.hi - it.lo, self.where(pos)))
            doc = it.lo[parent] + local
            return parent, RangeV(it.bounds[doc], it.bounds[doc + 1])
        if isinstance(it, Chunks):
            parent, starts, ends = it.expand(self.where(pos, "chunks"))
            return parent, RangeV(starts, ends)
        assert isinstance(it, Seq)
        return it.expand(self.where(pos))

    # Expressions: each returns one value per row of the frame.

    def eval(self, e: s.Expr, frame: Frame) -> Value:
        return _EXPRESSIONS[type(e)](self, e, frame)

    def expr_num(self, e: s.Num, frame: Frame) -> Value:
        if abs(e.value) > MAX_INT:
            raise self.fail(e.pos, f"integer {e.value} is outside the integers maskc computes with (at most 2^62 - 1 in magnitude)")
        return np.full(frame.size, e.value, dtype=np.int64)

    def expr_name(self, e: s.Name, frame: Frame) -> Value:
        return frame.get(e.id)

    def expr_range(self, e: s.RangeLit, frame: Frame) -> Value:
        start, end = self.eval(e.start, frame), self.eval(e.end, frame)
        bad = start > end
        if bad.any():
            i = int(np.argmax(bad))
            raise self.fail(e.pos, f"range {start[i]}:{end[i]} is reversed (start > end)")
        return RangeV(start, end)

    def expr_attr(self, e: s.Attr, frame: Frame) -> Value:
        obj = self.eval(e.obj, frame)
        if isinstance(obj, RangeV):
            start, end = obj.start, obj.end
        else:
            if e.name == "count":
                return obj.hi - obj.lo
            start, end = obj.bounds[obj.lo], obj.bounds[obj.hi]
        return {"start": start, "end": end}.get(e.name, end - start)

    def expr_index(self, e: s.Index, frame: Frame) -> Value:
        docs, i = self.eval(e.obj, frame), self.eval(e.index, frame)
        count = docs.hi - docs.lo
        k = np.where(i < 0, i + count, i)
        bad = (k < 0) | (k >= count)
        if bad.any():
            r = int(np.argmax(bad))
            raise self.fail(e.pos, f"index {i[r]} out of range for a list of {count[r]} documents")
        doc = docs.lo + k
        return RangeV(docs.bounds[doc], docs.bounds[doc + 1])

    def expr_slice(self, e: s.SliceOf, frame: Frame) -> Value:
        docs = self.eval(e.obj, frame)
        count = docs.hi - docs.lo

        def bound(expr: s.Expr | None, default: np.ndarray) -> np.ndarray:
            if expr is None:
                return default
            b = self.eval(expr, frame)
            return np.clip(np.where(b < 0, b + count, b), 0, count)

        lo = bound(e.lo, np.zeros_like(count))
        hi = np.maximum(lo, bound(e.hi, count))
        return DocsV(docs.bounds, docs.lo + lo, docs.lo + hi)

    def expr_binop(self, e: s.BinOp, frame: Frame) -> Value:
        """Exact: operands and results stay within MAX_INT, so a sum or difference cannot
        overflow int64, and a product is checked before it is computed."""
        a, b = self.eval(e.left, frame), self.eval(e.right, frame)
        if e.op in ("//", "%") and not b.all():
            raise self.fail(e.pos, "integer division by zero" if e.op == "//" else "modulo by zero")
        wraps = e.op == "*" and bool((np.abs(a) > MAX_INT // np.maximum(np.abs(b), 1)).any())
        out = None if wraps else _ARITHMETIC[e.op](a, b)
        if out is None or (np.abs(out) > MAX_INT).any():
            raise self.fail(e.pos, f"the result of {e.op!r} is outside the integers maskc computes with (at most 2^62 - 1 in magnitude)")
        return out

    def expr_neg(self, e: s.Neg, frame: Frame) -> Value:
        return -self.eval(e.operand, frame)

    def expr_not(self, e: s.Not, frame: Frame) -> Value:
        return ~self.eval(e.operand, frame)

    def expr_boolop(self, e: s.BoolOp, frame: Frame) -> Value:
        """The right operand is evaluated only on the rows the left one leaves undecided."""
        left = self.eval(e.left, frame)
        undecided = np.flatnonzero(left if e.op == "and" else ~left)
        if undecided.size == 0:
            return left
        out = left.copy()
        out[undecided] = self.eval(e.right, frame.sub(undecided))
        return out

    def expr_compare(self, e: s.Compare, frame: Frame) -> Value:
        values = [self.eval(x, frame) for x in e.operands]
        out = np.ones(frame.size, dtype=bool)
        for op, a, b in zip(e.ops, values, values[1:]):
            out &= _COMPARISONS[op](a, b)
        return out

    def expr_call(self, e: s.Call, frame: Frame) -> Value:
        """A built-in through its table entry: arguments in parameter order, defaults filled in."""
        spec = BUILTINS[e.func]
        args = [self.eval(a, frame) for a in e.args]
        kwargs = {kw.name: self.eval(kw.value, frame) for kw in e.kwargs}
        values = spec.arrange(args, kwargs, lambda c: np.full(frame.size, c, dtype=np.int64))
        if spec.once:
            values = [int(v[0]) for v in values]
        plain = [(v.start, v.end) if isinstance(v, RangeV) else v for v in values]
        return spec.lower(self.buffer, self.where(e.pos, e.func), *plain)


_ARITHMETIC: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "+": np.add,
    "-": np.subtract,
    "*": np.multiply,
    "//": np.floor_divide,
    "%": np.mod,
}
_COMPARISONS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "==": np.equal,
    "!=": np.not_equal,
    "<": np.less,
    "<=": np.less_equal,
    ">": np.greater,
    ">=": np.greater_equal,
}
_STATEMENTS = {
    s.Assign: _Lowering.stmt_assign,
    s.CallStmt: _Lowering.stmt_call,
    s.For: _Lowering.stmt_for,
    s.If: _Lowering.stmt_if,
    s.Assert: _Lowering.stmt_assert,
}
_EXPRESSIONS = {
    s.Num: _Lowering.expr_num,
    s.Name: _Lowering.expr_name,
    s.RangeLit: _Lowering.expr_range,
    s.Attr: _Lowering.expr_attr,
    s.Index: _Lowering.expr_index,
    s.SliceOf: _Lowering.expr_slice,
    s.BinOp: _Lowering.expr_binop,
    s.Neg: _Lowering.expr_neg,
    s.Not: _Lowering.expr_not,
    s.BoolOp: _Lowering.expr_boolop,
    s.Compare: _Lowering.expr_compare,
    s.Call: _Lowering.expr_call,
}
