"""Imports on first use: module attributes (PEP 562), so importing a package stays light, and
the optional dependencies, so the runtime needs only torch and numpy."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

from maskc.errors import MissingExtraError

#: Every optional dependency by the name it imports as: the distribution pip installs and the
#: extra of maskc that brings it (pyproject.toml's optional-dependencies; tests/test_packaging.py
#: checks that the two agree).
OPTIONAL: dict[str, tuple[str, str]] = {
    "lark": ("lark", "compiler"),
    "jinja2": ("jinja2", "compiler"),
    "cutlass": ("nvidia-cutlass-dsl", "compiler"),
    "tqdm": ("tqdm", "compiler"),
    "networkx": ("networkx", "dist"),
    "matplotlib": ("matplotlib", "pictures"),
    "transformers": ("transformers", "transformers"),
    "torchtitan": ("torchtitan", "torchtitan"),
    "triton": ("triton", "torchtitan"),  # imported by torchtitan, not by maskc
}


def lazy_attributes(module: str, namespace: dict[str, Any], sources: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `module` that imports `name` from `sources[name]`, or the
    submodule `module.name` (so `import maskc; maskc.runtime.register_artifact(...)` works as
    it would after an eager import), on first access, and keeps it in the module's `namespace`,
    so later accesses cost nothing."""

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is not None:
            value = getattr(importlib.import_module(source), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{module}.{name}") is not None:
            value = importlib.import_module(f"{module}.{name}")
        else:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__


def install_command(extra: str) -> str:
    """The command that adds `extra` to this maskc: pip keeps the maskc installed (from its wheel
    or source tree) and installs what the extra adds."""
    return f"pip install 'maskc[{extra}]'"


@contextlib.contextmanager
def optional_imports(what: str) -> Iterator[None]:
    """Imports of optional dependencies, for `what` ("the mask language"): a missing one is a
    one-line MissingExtraError naming the pip command that installs it. The ImportError is
    dropped (`from None`): its traceback says nothing more. Anything else missing, a part of an
    installed package among them, stays the ImportError it is."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name not in OPTIONAL:
            raise
        distribution, extra = OPTIONAL[exc.name]
        raise MissingExtraError(f"{what} needs {distribution}: {install_command(extra)}") from None
