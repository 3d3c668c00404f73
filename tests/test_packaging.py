"""The package list in pyproject.toml names every package of the tree (the wheel's contents
are checked file by file in CI, from a built wheel: .ci/wheel)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_of_the_tree_is_listed() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    # A package mapped to its own folder (maskc.runtime -> runtime/) is not also one under maskc/.
    assert set(setuptools["packages"]) == found
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
