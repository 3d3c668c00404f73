"""Compile a kernel variant ahead of time: render, cute.compile for the target arch, export.

Works on a machine with no GPU (the CUTLASS DSL compiles for a named arch and the export
needs only its runtime libraries loaded). The CUTLASS DSL is imported lazily here, never
by the runtime.

The argument ABI is `maskc.artifact.abi.FORWARD_ABI` (`BACKWARD_ABI` for direction "bwd"):
the fake compile-time arguments below are derived from it, and so is the kernel's signature
(templates/common/abi.jinja), so the object and the runtime can never disagree.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from maskc.artifact.abi import ENTRY_POINTS, STATIC_DIMS, ScalarArg, TensorArg
from maskc.artifact.variant import KernelVariant
from maskc.codegen import ptxas
from maskc.errors import CompilerUnavailableError
from maskc.lazy import install_command, optional_imports

with optional_imports("rendering kernels"):
    from maskc.codegen.render import render

_RUNTIME_LIBS_LOADED = False


@dataclass(frozen=True)
class CompiledObject:
    """The files one compiled variant produced."""

    variant: KernelVariant
    key: str
    source_path: Path
    object_path: Path
    header_path: Path
    ptx_path: Path | None
    function_prefix: str
    seconds: float
    #: What ptxas said (registers, stack, spills, serialised wgmma); None where the DSL wrote no log.
    ptxas: ptxas.PtxasReport | None = None

    @property
    def ptx_text(self) -> str:
        return self.ptx_path.read_text() if self.ptx_path is not None else ""


def _load_runtime_libraries() -> None:
    """export_to_c resolves the CUDA runtime symbols of the DSL's runtime libraries; load them."""
    global _RUNTIME_LIBS_LOADED
    if _RUNTIME_LIBS_LOADED:
        return
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
    _RUNTIME_LIBS_LOADED = True


def _import_source(path: Path, module_name: str):
    """Import a rendered module from its file (the DSL re-reads the source, so it must be a file)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import rendered kernel {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def fake_arguments(variant: KernelVariant) -> list:
    """Compile-time stand-ins for the ABI of the variant's direction: one symbolic extent per
    dynamic dim name."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dtypes = {
        "input": {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[variant.dtype],
        "float32": cutlass.Float32,
        "int32": cutlass.Int32,
    }
    static = {"Hq": variant.num_heads_q, "Hkv": variant.num_heads_kv, "D": variant.head_dim, "Dv": variant.head_dim_v}
    symbols: dict[str, object] = {}
    args: list = []
    for arg in ENTRY_POINTS[variant.direction].args:
        if isinstance(arg, TensorArg):
            shape = tuple(
                d if isinstance(d, int) else static[d] if d in STATIC_DIMS else symbols.setdefault(d, cute.sym_int())
                for d in arg.shape
            )
            order = tuple(range(len(shape) - 1, -1, -1))  # compact row-major
            args.append(
                make_fake_compact_tensor(dtypes[arg.dtype], shape, stride_order=order, assumed_align=arg.alignment)
            )
        elif isinstance(arg, ScalarArg):
            args.append(dtypes[arg.dtype](0))
        else:
            args.append(make_fake_stream())
    return args


def require_dsl() -> None:
    """Fail clearly, before any work, where the CUTLASS DSL (the kernel compiler) is missing."""
    if importlib.util.find_spec("cutlass") is None:
        raise CompilerUnavailableError(
            f"compiling kernels needs the CUTLASS DSL: {install_command('compiler')}; `maskc compile --ir-only` writes "
            "the IR without kernels"
        )


def compile_variant(variant: KernelVariant, out_dir: str | Path, *, keep_ptx: bool = True,
                    keep_cubin: bool = False) -> CompiledObject:  # fmt: skip
    """Render, compile for `variant.arch` and export `<key>.o` + `<key>.h` into `out_dir`.

    The rendered source is written to `<key>.py` next to the object (the DSL needs a real
    file); PTX is kept in `<key>.dump/` when `keep_ptx`, and so is the cubin when `keep_cubin`
    (for its SASS: bench/sass.py).
    """
    require_dsl()
    import cutlass.cute as cute

    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = variant.key()
    source_path = out / f"{key}.py"
    source_path.write_text(render(variant))
    module = _import_source(source_path, f"maskc_kernel_{key}")

    remarks = ptxas.remarks_file()
    options = f"--gpu-arch {variant.arch} {ptxas.OPTIONS.format(path=remarks)}"
    dump_dir = out / f"{key}.dump"
    if keep_ptx or keep_cubin:
        dump_dir.mkdir(exist_ok=True)
        options += "".join(flag for flag, kept in ((" --keep-ptx", keep_ptx), (" --keep-cubin", keep_cubin)) if kept)
        options += f" --dump-dir={dump_dir}"
    try:
        prefix = ENTRY_POINTS[variant.direction].name
        compiled = cute.compile(getattr(module, prefix), *fake_arguments(variant), options=options)
        report = ptxas.read_report(remarks, key)
        _load_runtime_libraries()
        compiled.export_to_c(file_path=str(out), file_name=key, function_prefix=prefix)
    finally:
        sys.modules.pop(module.__name__, None)
        remarks.unlink(missing_ok=True)

    ptx_path = None
    if keep_ptx:
        ptx_files = sorted(dump_dir.rglob("*.ptx"))
        ptx_path = ptx_files[0] if ptx_files else None
    return CompiledObject(
        variant=variant,
        key=key,
        source_path=source_path,
        object_path=out / f"{key}.o",
        header_path=out / f"{key}.h",
        ptx_path=ptx_path,
        function_prefix=ENTRY_POINTS[variant.direction].name,
        seconds=time.perf_counter() - start,
        ptxas=report,
    )
