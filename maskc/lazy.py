"""Module attributes imported on first use (PEP 562), so importing a package stays light."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable


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
