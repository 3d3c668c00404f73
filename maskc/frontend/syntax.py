"""The AST of the mask language: frozen dataclasses, each node with its source position."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pos:
    """1-based line and column of a node's first character."""

    line: int
    column: int


@dataclass(frozen=True)
class Num:
    pos: Pos
    value: int


@dataclass(frozen=True)
class Name:
    pos: Pos
    id: str


@dataclass(frozen=True)
class RangeLit:
    """`start:end`, allowed where an argument or an assigned value is expected."""

    pos: Pos
    start: Expr
    end: Expr


@dataclass(frozen=True)
class Attr:
    pos: Pos
    obj: Expr
    name: str


@dataclass(frozen=True)
class Index:
    pos: Pos
    obj: Expr
    index: Expr


@dataclass(frozen=True)
class SliceOf:
    """`obj[lo:hi]` with either bound optional, as in Python."""

    pos: Pos
    obj: Expr
    lo: Expr | None
    hi: Expr | None


@dataclass(frozen=True)
class BinOp:
    """Integer arithmetic: op is one of + - * // %."""

    pos: Pos
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Neg:
    pos: Pos
    operand: Expr


@dataclass(frozen=True)
class Not:
    pos: Pos
    operand: Expr


@dataclass(frozen=True)
class BoolOp:
    """`and` / `or`; the right operand is only evaluated where the left does not decide."""

    pos: Pos
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Compare:
    """A chain `a < b <= c` meaning `a < b and b <= c`."""

    pos: Pos
    ops: tuple[str, ...]
    operands: tuple[Expr, ...]


@dataclass(frozen=True)
class Keyword:
    pos: Pos
    name: str
    value: Expr


@dataclass(frozen=True)
class Call:
    pos: Pos
    func: str
    args: tuple[Expr, ...]
    kwargs: tuple[Keyword, ...]


@dataclass(frozen=True)
class ListLit:
    """A list of int expressions; only a parameter default may be one."""

    pos: Pos
    items: tuple[Expr, ...]


Expr = Num | Name | RangeLit | Attr | Index | SliceOf | BinOp | Neg | Not | BoolOp | Compare | Call | ListLit


@dataclass(frozen=True)
class Assign:
    pos: Pos
    name: str
    value: Expr


@dataclass(frozen=True)
class CallStmt:
    pos: Pos
    call: Call


@dataclass(frozen=True)
class For:
    pos: Pos
    var: str
    iter: Expr
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class If:
    """`if`/`elif` branches in order, then the optional `else` body."""

    pos: Pos
    branches: tuple[tuple[Expr, tuple[Stmt, ...]], ...]
    orelse: tuple[Stmt, ...]


@dataclass(frozen=True)
class Assert:
    pos: Pos
    cond: Expr
    message: str | None


Stmt = Assign | CallStmt | For | If | Assert


@dataclass(frozen=True)
class ParamDecl:
    pos: Pos
    name: str
    kind: str
    default: Expr | None


@dataclass(frozen=True)
class MaskDef:
    pos: Pos
    name: str
    params: tuple[ParamDecl, ...]
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class Module:
    """A parsed file; `source` is the name used in error locations (a path or "<string>")."""

    source: str
    masks: tuple[MaskDef, ...]
