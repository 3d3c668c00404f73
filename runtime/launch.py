"""Launch exported CuTe-DSL objects through libcute_dsl_runtime.so, with ctypes only.

The argument structs are built once per kernel and only their data pointers and extents
change per call, which keeps the host cost of a launch to a few microseconds.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import torch

from maskc.artifact.abi import Arg, ScalarArg, StreamArg, TensorArg
from maskc.artifact.toolchain import LIBRARY, library_bytes
from maskc.errors import ArtifactError


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


@cache
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
        # Per-call work split by argument kind up front, so a call is plain loops of stores: per
        # tensor its name, struct, the struct's extents array (held: ctypes makes a new array
        # object at every read of the field), the dims whose extents it takes, and its alignment.
        self._entries = []
        for arg, slot in zip(abi, self._slots):
            if isinstance(arg, TensorArg):
                dims = arg.dynamic_dims()
                self._entries.append((arg.name, slot, slot.dynamic_shapes if dims else None, dims, arg.alignment))
        self._scalars = [(arg.name, slot) for arg, slot in zip(abi, self._slots) if isinstance(arg, ScalarArg)]
        self._schedule: Mapping[str, torch.Tensor] | None = None
        self._call_entries = self._entries
        self._stream = next(slot for arg, slot in zip(abi, self._slots) if isinstance(arg, StreamArg))
        self._run = runtime.lib.CuteDSLRT_Function_Run
        self._nargs = len(abi) + 1

    def __call__(self, tensors: Mapping[str, torch.Tensor], schedule: Mapping[str, torch.Tensor],
                 scalars: Mapping[str, float | int], stream: int) -> None:  # fmt: skip
        """Launch with the call's `tensors` and a `schedule`'s (the runtime's own arrays, the same
        mapping for every call with one mask: its slots are filled when it changes, which saves
        the host a few microseconds in every layer after the first)."""
        if schedule is not self._schedule:
            self._fill([entry for entry in self._entries if entry[0] in schedule], schedule)
            self._call_entries = [entry for entry in self._entries if entry[0] not in schedule]
            self._schedule = schedule
        self._fill(self._call_entries, tensors)
        for name, slot in self._scalars:
            slot.value = scalars[name]
        self._stream.value = stream
        code = self._run(self._fn, self._args, self._nargs)
        if code:
            self.runtime.check(code, self.prefix)
        if self._ret.value != 0:
            raise RuntimeError(f"kernel {self.prefix} returned error code {self._ret.value}")

    def _fill(self, entries: list, tensors: Mapping[str, torch.Tensor]) -> None:
        """Point the structs of `entries` (see __init__) at their tensors in `tensors`."""
        for name, slot, extents, dims, align in entries:
            t = tensors[name]
            address = t.data_ptr()  # 0 for an empty tensor (an empty dlse): ctypes reads it back as None
            if address % align:
                raise ValueError(f"{self.prefix}: tensor {name!r} must be {align}-byte aligned (got address {address:#x})")
            if not t.is_contiguous():  # the kernels index every tensor densely from its address
                raise ValueError(f"{self.prefix}: tensor {name!r} must be contiguous (strides {t.stride()})")
            slot.data = address
            if extents is not None:
                shape = t.shape
                for i, d in enumerate(dims):
                    extents[i] = shape[d]
