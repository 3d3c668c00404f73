"""The toolchain a compiled kernel needs, as artifacts record and ship it: the CUTLASS DSL
release that built it, and the DSL's runtime library its object runs on (found where the user
installed it, or shipped in an artifact directory). Found without importing the DSL."""

from __future__ import annotations

import importlib.util
import lzma
import os
import platform
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from maskc.errors import ArtifactError
from maskc.version import __version__

LIBRARY = "libcute_dsl_runtime.so"
ENV_LIBRARY = "MASKC_CUTE_RUNTIME"


def installed_library() -> Path | None:
    """The library inside an installed nvidia-cutlass-dsl wheel, found without importing it."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for cuda in ("cu13", "cu12"):
            path = Path(root) / cuda / "lib" / LIBRARY
            if path.is_file():
                return path
    return None


def installed_dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl release, read from package metadata (nothing is imported)."""
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return None


def _decompressed(data: bytes, what: str | Path) -> bytes:
    try:
        return lzma.decompress(data)
    except lzma.LZMAError as exc:
        raise ArtifactError(f"{what} is not a valid xz archive: {exc}") from None


def find_runtime_library() -> Path:
    """The runtime library the user installed: $MASKC_CUTE_RUNTIME (plain or .xz), else the wheel's."""
    searched = []
    env = os.environ.get(ENV_LIBRARY)
    if env:
        searched.append(f"${ENV_LIBRARY}={env}")
        if Path(env).is_file():
            return Path(env)
    installed = installed_library()
    searched.append("the nvidia-cutlass-dsl package")
    if installed is not None:
        return installed
    raise ArtifactError(f"{LIBRARY} not found; looked in: {', '.join(searched)}")


def library_bytes(path: Path) -> bytes:
    """The library at `path`, decompressed where it is a `.xz`."""
    data = path.read_bytes()
    return _decompressed(data, path) if path.suffix == ".xz" else data


def shipped_library(files: Mapping[str, bytes], directory: Path) -> bytes | None:
    """The runtime library an artifact directory ships (plain or .xz), from the bytes its
    manifest hashed (`Manifest.files`): a library the manifest does not list is never used."""
    if LIBRARY in files:
        return files[LIBRARY]
    if LIBRARY + ".xz" in files:
        return _decompressed(files[LIBRARY + ".xz"], directory / (LIBRARY + ".xz"))
    return None


def toolchain() -> dict[str, str | None]:
    """Versions an object depends on, recorded in every manifest entry. Python is one: the DSL
    embeds the kernel function's signature in the object, pickled, and pickles of the standard
    library's enums differ between Python releases (3.11.2 and 3.11.7, seen here)."""
    return {"maskc": __version__, "nvidia-cutlass-dsl": installed_dsl_version(), "python": platform.python_version()}
