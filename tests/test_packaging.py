"""The package as it installs: pyproject.toml's package list names every package of the tree
(the wheel's contents are checked file by file in CI, from a built wheel: .ci/wheel), and
every public name of the lazily imported `maskc` still loads."""

from __future__ import annotations

import subprocess
import sys
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


@pytest.mark.slow
def test_every_public_name_and_subpackage_loads_on_first_use() -> None:
    """`import maskc` imports little (tests/test_cli.py checks that --help needs no torch); the
    public names and the subpackages (`maskc.runtime.register_artifact` after a plain `import
    maskc`) load on first use, in a fresh process where nothing imported them before."""
    code = (
        "import maskc\n"
        "assert callable(maskc.runtime.register_artifact) and callable(maskc.dist.make_plan)\n"
        "assert all(getattr(maskc, name) is not None for name in maskc.__all__)\n"
        "assert maskc.ir.Mask is maskc.Mask and maskc.attention is maskc.runtime.attention\n"
        "try:\n"
        "    maskc.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('maskc.no_such_name did not raise')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
