"""Static checks of a parsed mask file: names, builtins and their arguments, types, seqlen().

Every expression has a type known before any parameter value is seen, so all these
mistakes are reported at load time with their file:line:col; lowering then only meets
errors that depend on values.
"""

from __future__ import annotations

import difflib

from maskc.errors import MaskSemanticError
from maskc.frontend import syntax as s
from maskc.frontend.builtins import BUILTINS, Builtin, T
from maskc.frontend.params import PARAM_KINDS

PARAM_TYPES = {"int": T.INT, "seqlens": T.DOCS, "cu_seqlens": T.DOCS}
# What a `for` loop over each iterable type binds its variable to.
ELEMENT = {T.DOCS: T.RANGE, T.CHUNKS: T.RANGE, T.SEQ: T.INT}
ATTRIBUTES = {T.RANGE: ("start", "end", "len"), T.DOCS: ("start", "end", "len", "count")}


def semantic_error(source: str, pos: s.Pos, message: str) -> MaskSemanticError:
    return MaskSemanticError(message, source=source, line=pos.line, column=pos.column)


def _bind(call: s.Call, source: str) -> dict[str, s.Expr]:
    """Arguments of a call to a keyword-capable builtin, by parameter name."""
    spec = BUILTINS[call.func]
    names = spec.names
    if len(call.args) > len(names):
        raise semantic_error(
            source, call.pos, f"{call.func}() takes at most {len(names)} arguments ({len(call.args)} given)"
        )
    bound = dict(zip(spec.positional(len(call.args)), call.args))
    for kw in call.kwargs:
        if kw.name not in names:
            raise semantic_error(
                source, kw.pos, f"{call.func}() has no parameter {kw.name!r}; its parameters are {', '.join(names)}"
            )
        if kw.name in bound:
            raise semantic_error(source, kw.pos, f"{call.func}() got two values for {kw.name!r}")
        bound[kw.name] = kw.value
    missing = [a.name for a in spec.args if a.default is None and a.name not in bound]
    if missing:
        raise semantic_error(
            source, call.pos, f"{call.func}() is missing {missing[0]!r}; its parameters are {', '.join(names)}"
        )
    return bound


def check_module(module: s.Module) -> None:
    """Raise MaskSemanticError for the first static mistake in the file."""
    seen: dict[str, s.MaskDef] = {}
    for mask in module.masks:
        if mask.name in seen:
            first = seen[mask.name].pos.line
            raise semantic_error(
                module.source, mask.pos, f"mask {mask.name!r} is defined twice (first at line {first})"
            )
        seen[mask.name] = mask
        _MaskChecker(module.source, mask).run()


class _MaskChecker:
    def __init__(self, source: str, mask: s.MaskDef):
        self.source = source
        self.mask = mask
        self.scopes: list[dict[str, T]] = []
        self.seqlen_at: s.Pos | None = None
        self.in_default = False

    def error(self, pos: s.Pos, message: str) -> MaskSemanticError:
        return semantic_error(self.source, pos, message)

    def run(self) -> None:
        top: dict[str, T] = {}
        for p in self.mask.params:
            if p.name in top:
                raise self.error(p.pos, f"duplicate param {p.name!r} in mask {self.mask.name!r}")
            if p.kind not in PARAM_TYPES:
                raise self.error(
                    p.pos, f"param {p.name!r} has unknown type {p.kind!r}; expected one of: {', '.join(PARAM_KINDS)}"
                )
            self.check_default(p)
            top[p.name] = PARAM_TYPES[p.kind]
        self.scopes = [top]
        self.block(self.mask.body)
        if self.seqlen_at is None:
            raise self.error(
                self.mask.pos,
                f"mask {self.mask.name!r} never calls seqlen(...); declare the sequence length(s) once at the top level",
            )

    def check_default(self, p: s.ParamDecl) -> None:
        if p.default is None:
            return
        self.scopes, self.in_default = [{}], True
        if p.kind == "int":
            if isinstance(p.default, s.ListLit):
                raise self.error(p.default.pos, f"default of int param {p.name!r} must be an int, not a list")
            self.expect(p.default, T.INT, f"default of {p.name!r}")
        else:
            if not isinstance(p.default, s.ListLit):
                raise self.error(
                    p.default.pos, f"default of {p.kind} param {p.name!r} must be a list literal like [1024, 2048]"
                )
            for item in p.default.items:
                self.expect(item, T.INT, f"element of the default of {p.name!r}")
        self.in_default = False

    # Statements.

    def block(self, body: tuple[s.Stmt, ...]) -> None:
        for stmt in body:
            getattr(self, "stmt_" + type(stmt).__name__)(stmt)

    def nested(self, body: tuple[s.Stmt, ...], bindings: dict[str, T]) -> None:
        self.scopes.append(bindings)
        self.block(body)
        self.scopes.pop()

    def stmt_Assign(self, stmt: s.Assign) -> None:
        if self.lookup_outer(stmt.name):
            raise self.error(
                stmt.pos,
                f"cannot assign {stmt.name!r} here: it belongs to an enclosing block, and variables of "
                "enclosing blocks are read-only inside for/if bodies (use a new name)",
            )
        self.scopes[-1][stmt.name] = self.type_of(stmt.value)

    def stmt_CallStmt(self, stmt: s.CallStmt) -> None:
        call = stmt.call
        spec = self.builtin(call)
        if spec.returns is not None:
            use = "iterate over it in a for loop" if spec.returns in ELEMENT else "assign it to a name"
            raise self.error(call.pos, f"{call.func}() returns a value that is not used; {use}")
        if spec.once:
            if len(self.scopes) > 1:
                raise self.error(call.pos, f"{call.func}() must be at the top level of the mask body, not inside for/if")
            if self.seqlen_at is not None:
                raise self.error(
                    call.pos, f"{call.func}() is called twice (first at line {self.seqlen_at.line}); call it exactly once"
                )
            self.seqlen_at = call.pos
        self.arguments(call, spec)

    def stmt_For(self, stmt: s.For) -> None:
        iterable = self.type_of(stmt.iter)
        if iterable not in ELEMENT:
            raise self.error(
                stmt.iter.pos,
                f"cannot iterate over {_a(iterable)}; iterate over a document list, chunks(range, size) or range(...)",
            )
        if self.lookup(stmt.var) is not None:
            raise self.error(stmt.pos, f"loop variable {stmt.var!r} shadows an existing variable; use a new name")
        self.nested(stmt.body, {stmt.var: ELEMENT[iterable]})

    def stmt_If(self, stmt: s.If) -> None:
        for cond, body in stmt.branches:
            self.expect(cond, T.BOOL, "condition")
            self.nested(body, {})
        self.nested(stmt.orelse, {})

    def stmt_Assert(self, stmt: s.Assert) -> None:
        self.expect(stmt.cond, T.BOOL, "assert condition")

    # Expressions.

    def lookup(self, name: str) -> T | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def lookup_outer(self, name: str) -> bool:
        return any(name in scope for scope in self.scopes[:-1])

    def expect(self, expr: s.Expr, want: T, what: str) -> None:
        got = self.type_of(expr)
        if got is not want:
            hint = " (compare with ==, <, ... to get a bool)" if want is T.BOOL and got is T.INT else ""
            raise self.error(expr.pos, f"{what} must be {_a(want)}, got {_a(got)}{hint}")

    def type_of(self, e: s.Expr) -> T:
        return getattr(self, "expr_" + type(e).__name__)(e)

    def expr_Num(self, e: s.Num) -> T:
        return T.INT

    def expr_Name(self, e: s.Name) -> T:
        t = self.lookup(e.id)
        if t is None:
            known = [name for scope in self.scopes for name in scope]
            close = difflib.get_close_matches(e.id, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            if self.in_default:
                hint = " (parameter defaults must be constants)"
            raise self.error(e.pos, f"unknown name {e.id!r}{hint}")
        return t

    def expr_RangeLit(self, e: s.RangeLit) -> T:
        self.expect(e.start, T.INT, "range start")
        self.expect(e.end, T.INT, "range end")
        return T.RANGE

    def expr_Attr(self, e: s.Attr) -> T:
        t = self.type_of(e.obj)
        allowed = ATTRIBUTES.get(t, ())
        if e.name not in allowed:
            has = f"; {_a(t)} has " + ", ".join("." + a for a in allowed) if allowed else f"; {_a(t)} has no attributes"
            raise self.error(e.pos, f"{t.value} has no attribute .{e.name}{has}")
        return T.INT

    def expr_Index(self, e: s.Index) -> T:
        self.expect(e.obj, T.DOCS, "the indexed value")
        self.expect(e.index, T.INT, "index")
        return T.RANGE

    def expr_SliceOf(self, e: s.SliceOf) -> T:
        self.expect(e.obj, T.DOCS, "the sliced value")
        for bound in (e.lo, e.hi):
            if bound is not None:
                self.expect(bound, T.INT, "slice bound")
        return T.DOCS

    def expr_BinOp(self, e: s.BinOp) -> T:
        left, right = self.type_of(e.left), self.type_of(e.right)
        if left is not T.INT or right is not T.INT:
            raise self.error(
                e.pos,
                f"unsupported operand types for {e.op}: {left.value} and {right.value} (arithmetic works on ints)",
            )
        return T.INT

    def expr_Neg(self, e: s.Neg) -> T:
        self.expect(e.operand, T.INT, "operand of unary -")
        return T.INT

    def expr_Not(self, e: s.Not) -> T:
        self.expect(e.operand, T.BOOL, "operand of not")
        return T.BOOL

    def expr_BoolOp(self, e: s.BoolOp) -> T:
        self.expect(e.left, T.BOOL, f"operand of {e.op}")
        self.expect(e.right, T.BOOL, f"operand of {e.op}")
        return T.BOOL

    def expr_Compare(self, e: s.Compare) -> T:
        for operand in e.operands:
            self.expect(operand, T.INT, "compared value")
        return T.BOOL

    def expr_Call(self, e: s.Call) -> T:
        spec = self.builtin(e)
        if spec.returns is None:
            raise self.error(e.pos, f"{e.func}() emits slices and has no value; use it as a statement")
        self.arguments(e, spec)
        return spec.returns

    def builtin(self, call: s.Call) -> Builtin:
        spec = BUILTINS.get(call.func)
        if spec is None:
            close = difflib.get_close_matches(call.func, BUILTINS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise self.error(call.pos, f"unknown function {call.func!r}; {hint}known functions: {', '.join(BUILTINS)}")
        return spec

    def arguments(self, call: s.Call, spec: Builtin) -> None:
        if not spec.positional_only:
            types = {a.name: a.type for a in spec.args}
            for name, value in _bind(call, self.source).items():
                self.expect(value, types[name], f"{call.func}() argument {name!r}")
            return
        if call.kwargs:
            raise self.error(call.kwargs[0].pos, f"{call.func}() takes no keyword arguments")
        n = len(call.args)
        most = None if spec.variadic else len(spec.args)
        if n < spec.required or (most is not None and n > most):
            want = f"at least {spec.required}" if most is None else f"{spec.required} to {most}"
            raise self.error(call.pos, f"{call.func}() takes {want} arguments ({n} given)")
        for arg in call.args:
            self.expect(arg, T.INT, f"{call.func}() argument")


def _a(t: T) -> str:
    """A type with its article, for messages."""
    return {T.INT: "an int", T.BOOL: "a bool", T.RANGE: "a range", T.DOCS: "a document list"}.get(t, t.value)
