"""Module attributes imported on first use (PEP 562), so importing a package stays light."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(module: str, namespace: dict[str, Any], sources: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `module` that imports `name` from `sources[name]` on first
    access and keeps it in the module's `namespace`, so later accesses cost nothing."""

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(source), name)
        return value

    return __getattr__
