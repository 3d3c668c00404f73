"""Launch exported CuTe-DSL objects through libcute_dsl_runtime.so, with ctypes only.

The argument structs are built once per kernel and only their data pointers and extents
change per call, which keeps the host cost of a launch to a few microseconds.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import lzma
import os
import threading
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Mapping

import torch

from maskc.errors import ArtifactError
from maskc.runtime.abi import Arg, ScalarArg, StreamArg, TensorArg

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


class CuteRuntime:
    """The loaded runtime library; one per process and library (`runtime_at`, `runtime_of`)."""

    def __init__(self, path: Path, name: str | None = None):
        self.name = name or str(path)
        try:
            lib = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
        except OSError as exc:
            raise ArtifactError(f"cannot load {self.name}: {exc}") from None
        lib.CuteDSLRT_Module_Create_From_Bytes.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]
        lib.CuteDSLRT_Module_Get_Function.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.CuteDSLRT_Function_Run.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.CuteDSLRT_GetErrorString.restype = ctypes.c_char_p
        for fn in ("CuteDSLRT_Module_Create_From_Bytes", "CuteDSLRT_Module_Get_Function", "CuteDSLRT_Function_Run"):
            getattr(lib, fn).restype = ctypes.c_int
        self.lib = lib
        self._lock = threading.Lock()

    def check(self, code: int, what: str) -> None:
        if code != 0:
            detail = self.lib.CuteDSLRT_GetErrorString(code).decode(errors="replace")
            raise RuntimeError(f"{what} failed: {detail} (CuteDSLRT error {code})")

    def function(self, object_bytes: bytes, prefix: str) -> ctypes.c_void_p:
        """Load an exported object and return its entry point named by `prefix`."""
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        with self._lock:
            self.check(
                self.lib.CuteDSLRT_Module_Create_From_Bytes(ctypes.byref(module), object_bytes, len(object_bytes), None, 0),
                f"loading kernel object {prefix}",
            )
            self.check(self.lib.CuteDSLRT_Module_Get_Function(ctypes.byref(fn), module, prefix.encode()), f"finding {prefix}")
        return fn


@lru_cache(maxsize=None)
def runtime_at(path: Path) -> CuteRuntime:
    """The library the user installed at `path` (`find_runtime_library`)."""
    if path.suffix == ".xz":
        return runtime_of(library_bytes(path), str(path))
    return CuteRuntime(path)


_FROM_BYTES: dict[str, CuteRuntime] = {}


def runtime_of(data: bytes, name: str) -> CuteRuntime:
    """The library whose bytes are `data`, loaded from exactly those bytes (an anonymous
    in-memory file, never a path someone could swap after the bytes were checked)."""
    digest = hashlib.sha256(data).hexdigest()
    runtime = _FROM_BYTES.get(digest)
    if runtime is None:
        with os.fdopen(os.memfd_create(LIBRARY), "wb") as f:
            f.write(data)
            f.flush()
            runtime = CuteRuntime(Path(f"/proc/self/fd/{f.fileno()}"), f"{LIBRARY} of {name} (sha256 {digest[:16]})")
        _FROM_BYTES[digest] = runtime
    return runtime


_SCALAR_CTYPES = {"float32": ctypes.c_float, "int32": ctypes.c_int32}


def _tensor_struct(arg: TensorArg) -> ctypes.Structure:
    fields = [("data", ctypes.c_void_p)]
    dims = arg.dynamic_dims()
    if dims:
        fields.append(("dynamic_shapes", ctypes.c_int32 * len(dims)))
    return type(f"{arg.name}_t", (ctypes.Structure,), {"_fields_": fields})()


class Kernel:
    """An exported kernel bound to its ABI: `kernel(tensors, scalars, stream)` launches it.

    Not re-entrant: its argument structs are reused from call to call.
    """

    def __init__(self, runtime: CuteRuntime, object_bytes: bytes, prefix: str, abi: tuple[Arg, ...]):
        self.runtime = runtime
        self.prefix = prefix
        self.abi = abi
        self._fn = runtime.function(object_bytes, prefix)
        self._slots: list[ctypes._CData] = []
        for arg in abi:
            if isinstance(arg, TensorArg):
                self._slots.append(_tensor_struct(arg))
            elif isinstance(arg, ScalarArg):
                self._slots.append(_SCALAR_CTYPES[arg.dtype]())
            else:
                self._slots.append(ctypes.c_void_p())
        self._ret = ctypes.c_int32()
        self._args = (ctypes.c_void_p * (len(abi) + 1))(
            *(ctypes.addressof(s) for s in self._slots), ctypes.addressof(self._ret)
        )
        # Per-call work split by argument kind up front, so a call is plain loops of stores.
        self._tensors = [
            (arg.name, slot, arg.dynamic_dims(), arg.alignment)
            for arg, slot in zip(abi, self._slots)
            if isinstance(arg, TensorArg)
        ]
        self._scalars = [(arg.name, slot) for arg, slot in zip(abi, self._slots) if isinstance(arg, ScalarArg)]
        self._stream = next(slot for arg, slot in zip(abi, self._slots) if isinstance(arg, StreamArg))
        self._run = runtime.lib.CuteDSLRT_Function_Run
        self._nargs = len(abi) + 1

    def __call__(self, tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, float | int], stream: int) -> None:
        for name, slot, dims, align in self._tensors:
            t = tensors[name]
            address = t.data_ptr()  # 0 for an empty tensor (an empty dlse): ctypes reads it back as None
            slot.data = address
            if address % align:
                raise ValueError(f"{self.prefix}: tensor {name!r} must be {align}-byte aligned (got address {address:#x})")
            for i, d in enumerate(dims):
                slot.dynamic_shapes[i] = t.shape[d]
        for name, slot in self._scalars:
            slot.value = scalars[name]
        self._stream.value = stream
        code = self._run(self._fn, self._args, self._nargs)
        if code:
            self.runtime.check(code, self.prefix)
        if self._ret.value != 0:
            raise RuntimeError(f"kernel {self.prefix} returned error code {self._ret.value}")
