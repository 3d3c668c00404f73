"""Content-addressed kernel cache: compiling the same variant twice is a no-op.

An entry's address hashes the variant, the maskc and DSL versions and the sources that
shape the generated code (the templates, the code generator's modules, the kernel families,
variants and ABI of maskc.artifact), so editing
any of them or upgrading the DSL never serves a stale object. Each
entry is a one-kernel artifact directory (manifest + object + header + PTX) that the
runtime registers as it is. Compiles go to a temporary directory and are renamed into place
under a per-entry file lock: concurrent compiles of one variant do the work once, and a
reader never sees a half-written entry. Entries are written with the umask's modes
(`maskc.files`), so a cache on a shared file system serves a whole team.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import lzma
import os
import shutil
import time
from importlib import resources
from pathlib import Path

import maskc.artifact.abi
import maskc.artifact.kernel_families
import maskc.artifact.variant
from maskc.artifact.abi import ENTRY_POINTS, abi_to_json
from maskc.artifact.manifest import MANIFEST_NAME, write_manifest
from maskc.artifact.toolchain import LIBRARY, find_runtime_library, library_bytes, toolchain
from maskc.artifact.variant import KernelVariant
from maskc.files import locked, make_temporary_dir, temporaries, write_atomic

ENV_CACHE = "MASKC_CACHE"


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "maskc" / "kernels"
    return Path(os.environ.get(ENV_CACHE, default))


def source_files() -> list[tuple[Path, str]]:
    """What a kernel's source and exported interface come from besides its variant, by name:
    the templates, maskc/codegen's modules, and the kernel families, variants and ABI."""
    templates = Path(str(resources.files("maskc.templates")))
    files = [(p, p.relative_to(templates).as_posix()) for p in sorted(templates.rglob("*.jinja"))]
    files += [(p, f"codegen/{p.name}") for p in sorted(Path(__file__).parent.glob("*.py"))]
    contract = (maskc.artifact.abi, maskc.artifact.kernel_families, maskc.artifact.variant)
    return files + [(Path(m.__file__), f"artifact/{Path(m.__file__).name}") for m in contract]


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    digest = hashlib.sha256()
    for path, name in source_files():
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def entry_address(variant: KernelVariant) -> str:
    body = {"variant": dataclasses.asdict(variant), "toolchain": toolchain(), "sources": sources_digest()}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


def variant_record(variant: KernelVariant, object_name: str, function: str) -> dict:
    """The manifest entry of a compiled variant: what the runtime matches and how it calls it."""
    return {
        "key": variant.key(),
        "fields": dataclasses.asdict(variant),
        "object": object_name,
        "function": function,
        "abi": abi_to_json(ENTRY_POINTS[variant.direction].args),
        "experimental": variant.experimental,
        "sources": sources_digest(),
    }


def cached_kernel(variant: KernelVariant) -> Path:
    """The cache entry (an artifact directory) of `variant`, compiling it if absent."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / entry_address(variant)
    if (final / MANIFEST_NAME).is_file():
        return final
    with locked(_lock_path(root, final.name)):
        if (final / MANIFEST_NAME).is_file():
            return final
        from maskc.codegen.compile import compile_variant

        _sweep_dead_builds(root, final.name)
        staging = make_temporary_dir(root, final.name)
        try:
            built = compile_variant(variant, staging)
            files = [p.relative_to(staging).as_posix() for p in sorted(staging.rglob("*")) if p.is_file()]
            body = {
                "toolchain": toolchain(),
                "compile_seconds": round(built.seconds, 3),
                "variants": [variant_record(variant, built.object_path.name, built.function_prefix)],
                "files": files,
            }
            write_manifest(staging, body)
            if final.exists():
                shutil.rmtree(final)
            os.rename(staging, final)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return final


def _lock_path(root: Path, entry: str) -> Path:
    """The lock of one cache entry: whoever holds it may build the entry."""
    return root / f"{entry}.lock"


def _sweep_dead_builds(root: Path, held: str) -> None:
    """Remove the staging directories that killed compiles left behind: one belongs to a live
    compile only while its entry's lock is held (`held`: the entry whose lock this process holds)."""
    for staging, entry in temporaries(root):
        if entry == held:
            shutil.rmtree(staging, ignore_errors=True)
            continue
        with locked(_lock_path(root, entry), wait=False) as free:
            if free:
                shutil.rmtree(staging, ignore_errors=True)
    # maskc 0.1.0 before this sweep named its staging `.build-*`, tied to no lock: an hour old is dead.
    for staging in root.glob(".build-*"):
        try:
            dead = time.time() - staging.stat().st_mtime > 3600
        except FileNotFoundError:  # another compile swept it first
            continue
        if dead:
            shutil.rmtree(staging, ignore_errors=True)


def compressed_runtime_library() -> Path:
    """libcute_dsl_runtime.so of the installed DSL, xz-compressed once (43 MB -> about 13 MB) for shipping."""
    data = library_bytes(find_runtime_library())
    target = cache_root() / "runtime" / hashlib.sha256(data).hexdigest()[:16] / f"{LIBRARY}.xz"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lzma.compress(data, preset=9))
    return target
