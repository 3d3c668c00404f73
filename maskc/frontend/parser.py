"""Source text -> AST, with lark errors turned into readable MaskSyntaxErrors at file:line:col."""

from __future__ import annotations

import ast as pyast
import functools
from collections.abc import Iterator
from importlib import resources
from typing import Any

from maskc.errors import MaskSemanticError, MaskSyntaxError
from maskc.frontend import syntax as s
from maskc.lazy import optional_imports
from maskc.limits import MAX_NESTING

with optional_imports("the mask language"):
    from lark import Lark, Token, Transformer, Tree, v_args
    from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
    from lark.indenter import DedentError, Indenter

_WORDS = {
    "NAME": "a name",
    "STRING": "a string",
    "_NL": "a new line",
    "_INDENT": "an indented block",
    "_DEDENT": "the end of the block",
    "$END": "the end of the file",
}
_FOUND = {"_NL": "end of line", "_INDENT": "indent", "_DEDENT": "dedent", "$END": "end of file"}
# Tokens that may start an expression; listed together as "an expression" in messages.
_EXPRESSION_START = {"NAME", "INT", "FLOAT", "LPAR", "MINUS", "NOT"}
# Tokens that may continue an expression; listed together as "an operator" in messages.
_OPERATORS = {"+", "-", "*", "//", "/", "%", "==", "!=", "<", "<=", ">", ">=", "and", "or", ".", "["}


class _Indenter(Indenter):
    NL_type = "_NL"
    OPEN_PAREN_types = ["LPAR", "LSQB"]
    CLOSE_PAREN_types = ["RPAR", "RSQB"]
    INDENT_type = "_INDENT"
    DEDENT_type = "_DEDENT"
    tab_len = 8

    def handle_NL(self, token: Token) -> Iterator[Token]:
        try:
            yield from super().handle_NL(token)
        except DedentError:
            raise _BadDedent(token) from None


class _BadDedent(Exception):
    """Carries the newline token whose indentation matches no enclosing block."""

    def __init__(self, token: Token):
        self.token = token


@functools.cache
def _parser() -> Lark:
    grammar = resources.files("maskc.frontend").joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", postlex=_Indenter(), propagate_positions=True, maybe_placeholders=True)


def parse(text: str, source: str = "<string>") -> s.Module:
    """Parse mask source text; `source` names the file in error messages."""
    if not text.endswith("\n"):
        text += "\n"
    try:
        tree = _parser().parse(text)
    except _BadDedent as e:
        column = len(e.token.rsplit("\n", 1)[1]) + 1
        message = "unindent does not match any outer indentation level"
        raise MaskSyntaxError(message, source=source, line=e.token.end_line, column=column) from None
    except UnexpectedInput as e:
        raise _syntax_error(e, source) from None
    _check_nesting(tree, source)
    try:
        return s.Module(source, _ToAst(source).transform(tree))
    except VisitError as e:
        raise e.orig_exc from None


def _check_nesting(tree: Tree, source: str) -> None:
    """Refuse a program nested deeper than MAX_NESTING (walked without recursion): the passes
    after parsing recurse once per level, and a deeper program would exhaust Python's stack."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise MaskSyntaxError(
                f"nested too deeply: more than {MAX_NESTING} levels of blocks and operators; split the expression "
                "with intermediate names",
                source=source, line=node.meta.line, column=node.meta.column,
            )  # fmt: skip
        stack.extend((child, depth + 1) for child in node.children if isinstance(child, Tree))


def _syntax_error(e: UnexpectedInput, source: str) -> MaskSyntaxError:
    line, column = e.line, e.column
    if isinstance(e, UnexpectedCharacters):
        found = f"unexpected character {e.char!r}"
        expected = e.allowed
    elif isinstance(e, UnexpectedToken):
        found = f"unexpected {_describe_token(e.token)}"
        expected = e.accepts or e.expected
        if e.token.type == "_NL":
            line, column = e.token.line, e.token.column
        elif e.token.type in ("_INDENT", "_DEDENT"):
            line, column = (e.token.end_line or line), len(e.token.value) + 1
    else:
        assert isinstance(e, UnexpectedEOF)
        found, expected = "unexpected end of file", e.expected
    if line is None or line < 0:
        line, column = 0, 0
    return MaskSyntaxError(f"{found}; expected {_expected_words(expected)}", source=source, line=line, column=column)


def _describe_token(token: Token) -> str:
    return _FOUND.get(token.type) or repr(str(token))


def _expected_words(names: set[str]) -> str:
    """Terminal names as words: literals quoted, expression starts and operators folded."""
    terminals = {t.name: t for t in _parser().terminals}
    literals, words = set(), set()
    if "INT" in names:
        names = set(names) - _EXPRESSION_START
        words.add("an expression")
    for name in names:
        term = terminals.get(name)
        if term is not None and term.pattern.type == "str":
            literals.add(term.pattern.value)
        else:
            words.add(_WORDS.get(name, name.lower()))
    operators = literals & _OPERATORS
    items = [repr(x) for x in sorted(literals - operators)] + sorted(words)
    if operators:
        items.append("an operator")
    if len(items) == 1:
        return items[0]
    return "one of: " + ", ".join(items[:-1]) + " or " + items[-1]


def _pos(node: Token | Tree | Any) -> s.Pos:
    if isinstance(node, Token):
        return s.Pos(node.line, node.column)
    return s.Pos(node.meta.line, node.meta.column)


@v_args(meta=True)
class _ToAst(Transformer):
    """Builds the frozen AST; rejects floats and `/` here since they have no meaning at all."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def _error(self, message: str, pos: s.Pos) -> MaskSemanticError:
        return MaskSemanticError(message, source=self.source, line=pos.line, column=pos.column)

    def start(self, meta, children):
        return tuple(children)

    def mask_def(self, meta, children):
        name, *params, body = children
        return s.MaskDef(_pos(name), str(name), tuple(p for p in params if p is not None), body)

    def param(self, meta, children):
        name, kind, default = children
        return s.ParamDecl(_pos(name), str(name), str(kind), default)

    def list(self, meta, children):
        return s.ListLit(s.Pos(meta.line, meta.column), tuple(c for c in children if c is not None))

    def block(self, meta, children):
        return tuple(children)

    def call_stmt(self, meta, children):
        (call,) = children
        return s.CallStmt(call.pos, call)

    def assign(self, meta, children):
        name, value = children
        return s.Assign(_pos(name), str(name), value)

    def assert_stmt(self, meta, children):
        cond, message = children
        pos = s.Pos(meta.line, meta.column)
        try:
            text = None if message is None else pyast.literal_eval(str(message))
        except (SyntaxError, ValueError) as exc:  # a NUL byte, a bad escape
            why = exc.msg if isinstance(exc, SyntaxError) else exc
            raise self._error(f"the assert message {str(message)[:40]!r} is not a valid string: {why}", pos) from None
        return s.Assert(pos, cond, text)

    def for_stmt(self, meta, children):
        var, it, body = children
        return s.For(s.Pos(meta.line, meta.column), str(var), it, body)

    def if_stmt(self, meta, children):
        cond, body, *elifs, orelse = children
        return s.If(s.Pos(meta.line, meta.column), ((cond, body), *elifs), orelse or ())

    def elif_clause(self, meta, children):
        return tuple(children)

    def else_clause(self, meta, children):
        (body,) = children
        return body

    def call(self, meta, children):
        name, *args = children
        positional, keywords = [], []
        for arg in args:
            if arg is None:
                continue
            if isinstance(arg, s.Keyword):
                keywords.append(arg)
            elif keywords:
                raise self._error("positional argument after a keyword argument", arg.pos)
            else:
                positional.append(arg)
        return s.Call(_pos(name), str(name), tuple(positional), tuple(keywords))

    def kwarg(self, meta, children):
        name, value = children
        return s.Keyword(_pos(name), str(name), value)

    def range_lit(self, meta, children):
        start, end = children
        return s.RangeLit(start.pos, start, end)

    def or_op(self, meta, children):
        return s.BoolOp(children[0].pos, "or", *children)

    def and_op(self, meta, children):
        return s.BoolOp(children[0].pos, "and", *children)

    def not_op(self, meta, children):
        return s.Not(s.Pos(meta.line, meta.column), children[0])

    def comparison(self, meta, children):
        return s.Compare(children[0].pos, tuple(children[1::2]), tuple(children[0::2]))

    def comp_op(self, meta, children):
        return str(children[0])

    def binop(self, meta, children):
        left, op, right = children
        if op == "/":
            raise self._error("'/' is not supported: use '//' for integer division", _pos(op))
        return s.BinOp(_pos(op), str(op), left, right)

    def neg(self, meta, children):
        minus, operand = children
        if isinstance(operand, s.Num):
            return s.Num(_pos(minus), -operand.value)
        return s.Neg(_pos(minus), operand)

    def attr(self, meta, children):
        obj, name = children
        return s.Attr(_pos(name), obj, str(name))

    def index(self, meta, children):
        obj, index = children
        return s.Index(index.pos, obj, index)

    def slice(self, meta, children):
        obj, lo, hi = children
        return s.SliceOf(s.Pos(meta.line, meta.column), obj, lo, hi)

    def int(self, meta, children):
        (token,) = children
        return s.Num(_pos(token), int(token))

    def float(self, meta, children):
        (token,) = children
        raise self._error(f"{token} is not an integer: masks use integer token counts only", _pos(token))

    def name(self, meta, children):
        (token,) = children
        return s.Name(_pos(token), str(token))
