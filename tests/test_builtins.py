"""The table of built-ins: the docs list it, and the Python front's Builder has its statements."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import maskc
from maskc.frontend.builtins import BUILTINS

DSL_DOC = Path(__file__).resolve().parents[1] / "docs" / "dsl.md"


def test_the_language_page_lists_every_builtin_with_its_defaults():
    section = DSL_DOC.read_text().split("### Builtins", 1)[1].split("\n### ", 1)[0]
    listed = re.search(r"```\n(.*?)```", section, re.S)
    assert listed is not None, "docs/dsl.md's Builtins section has no list of signatures"
    assert listed.group(1).splitlines() == [b.signature() for b in BUILTINS.values()]


@pytest.mark.parametrize("builtin", [b for b in BUILTINS.values() if b.python], ids=lambda b: b.name)
def test_builder_methods_take_the_table_parameters(builtin):
    params = list(inspect.signature(getattr(maskc.Builder, builtin.name)).parameters.values())[1:]
    assert [p.name for p in params] == list(builtin.names)
    assert [p.default is inspect.Parameter.empty for p in params] == [a.default is None for a in builtin.args]
    assert all(p.default is None for p in params if p.default is not inspect.Parameter.empty)


def test_builder_has_no_statements_beyond_the_table():
    methods = {name for name, _ in inspect.getmembers(maskc.Builder, inspect.isfunction) if not name.startswith("_")}
    assert methods - {"finish"} == {b.name for b in BUILTINS.values() if b.python}
