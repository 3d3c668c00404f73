"""The kernels `maskc.attention` can run: registered from artifact directories, or fetched from
the kernel source (the JIT compiler, where installed) on first use.

A kernel is found by its *request* — arch, head dim, dtype, head counts, feature flags — the
fields a call determines; the tile shape it was built with comes from its manifest entry and
decides the schedule the runtime builds for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from maskc.artifact import toolchain
from maskc.artifact.abi import ENTRY_POINTS, abi_to_json
from maskc.artifact.kernel_families import HeadDim
from maskc.artifact.manifest import Manifest, open_manifest
from maskc.artifact.source import kernel_source
from maskc.artifact.variant import KernelVariant
from maskc.errors import ArtifactError
from maskc.lazy import install_command
from maskc.runtime.launch import CuteRuntime, Kernel, runtime_at, runtime_of

REQUEST_FIELDS = (
    "arch", "direction", "head_dim", "dtype", "num_heads_q", "num_heads_kv", "has_softcap", "has_sink", "has_max_logits",
    "pack_gqa", "deterministic", "unmasked", "portable", "portable_next", "tall",
)  # fmt: skip
_OPTIONAL_FIELDS = ("pack_gqa", "deterministic", "unmasked", "portable", "portable_next", "tall")  # False where a request or manifest leaves them out


def request_key(fields: Mapping[str, Any]) -> tuple:
    """The fields that find a kernel; head_dim_v is head_dim's where a request or manifest leaves it out."""
    key = tuple(fields.get(f, False) if f in _OPTIONAL_FIELDS else fields[f] for f in REQUEST_FIELDS)
    return (*key, HeadDim.of(fields).v)


class LaunchShape(NamedTuple):
    """How a kernel runs, which decides the schedule built for it: tile_m is in query tokens
    (with PackGQA, the kernel's TILE_M packed rows hold TILE_M / G tokens), items_per_tile the
    work items of each q tile (query heads, or K/V heads with PackGQA); a backward item may be
    split into `pieces` (one per query head of its K/V head); `ctas_per_sm` persistent CTAs
    share an SM."""

    tile_m: int
    tile_n: int
    items_per_tile: int
    deterministic: bool = False
    pieces: int = 1
    ctas_per_sm: int = 1
    document_tiles: bool = False
    """Its k blocks (forward) or k tiles and q blocks (backward) start at each document
    (`KernelFamily.document_tiles`)."""
    document_rows: bool = False
    """A forward's q tiles start at each document too (`KernelVariant.document_rows`)."""


def launch_shape(fields: Mapping[str, Any]) -> LaunchShape:
    """The launch shape of the kernel with manifest `fields` (its tiles and stages included); its
    family says how it runs."""
    hq, hkv = fields["num_heads_q"], fields["num_heads_kv"]
    variant = KernelVariant(**fields)
    family = variant.family
    if fields["direction"] == "bwd":  # items are (k tile, kv head); tile_m is the q block
        deterministic = fields.get("deterministic", False)
        pieces = hq // hkv if family.split_backward and not deterministic else 1
        # A deterministic CTA waits for lower items' CTAs: one per SM keeps them all resident.
        ctas_per_sm = 1 if deterministic else variant.ctas_per_sm
        return LaunchShape(fields["tile_m"], fields["tile_n"], hkv, deterministic, pieces, ctas_per_sm,
                           family.document_tiles)  # fmt: skip
    ctas_per_sm = variant.ctas_per_sm
    if fields.get("pack_gqa", False):
        return LaunchShape(fields["tile_m"] // (hq // hkv), fields["tile_n"], hkv, ctas_per_sm=ctas_per_sm,
                           document_tiles=family.document_tiles)  # fmt: skip
    return LaunchShape(fields["tile_m"], fields["tile_n"], hq, ctas_per_sm=ctas_per_sm,
                       document_tiles=family.document_tiles, document_rows=family.document_tiles)  # fmt: skip


class Entry:
    """A registered kernel and its launch shape; `index` is its place in `LOADED`: what the
    custom ops' plans name it by."""

    def __init__(self, load: Callable[[], Kernel] | None, shape: LaunchShape):
        self._load, self._kernel = load, None
        self.shape = shape
        self.tile_m, self.tile_n, self.deterministic = shape.tile_m, shape.tile_n, shape.deterministic
        self.index = len(LOADED)
        LOADED.append(self)

    @property
    def kernel(self) -> Kernel:
        """The kernel, its object loaded on first use: an artifact may hold kernels for GPUs
        other than this one (other archs), which are never loaded here."""
        if self._kernel is None:
            self._kernel = self._load()
        return self._kernel


def entry_for(load: Callable[[], Kernel] | None, fields: Mapping[str, Any]) -> Entry:
    """The entry of the kernel with manifest `fields`."""
    return Entry(load, launch_shape(fields))


KERNELS: dict[tuple, Entry] = {}
LOADED: list[Entry] = []
FROM_SOURCE: set[tuple] = set()
"""The request keys of the kernels the kernel source compiled (not registered by the user)."""


def loaded(index: int) -> Entry:
    """The kernel a custom op names by its index."""
    return LOADED[index]


def find_kernel(request: Mapping[str, Any], alternative: Mapping[str, Any] | None = None) -> Entry:
    """A registered kernel for `request`; else one for `alternative`, a kernel that serves the
    same call more slowly, registered from an artifact (the user's kernels win over compiling)
    or where nothing can compile; else one from the kernel source. A slower kernel the source
    compiled for an earlier call never stands in for the one asked for."""
    entry = KERNELS.get(request_key(request))
    if entry is None and alternative is not None:
        other = KERNELS.get(request_key(alternative))
        if other is not None and (request_key(alternative) not in FROM_SOURCE or kernel_source() is None):
            entry = other
    return entry or _from_source(request)


def _from_source(request: Mapping[str, Any]) -> Entry:
    """The kernel for `request` from the kernel source (maskc.artifact.source): compiled, or
    fetched from the compiler's cache."""
    source = kernel_source()
    if source is None:
        raise ArtifactError(
            f"no compiled maskc kernel for {dict(request)} and the compiler is not installed; build one with "
            f"`maskc compile` and pass its directory to maskc.runtime.register_artifact, or install the compiler: "
            f"{install_command('compiler')}"
        )
    FROM_SOURCE.update(_register(source(request)))
    return KERNELS[request_key(request)]


def register_artifact(directory: str | Path, sha256: str | None = None) -> list[str]:
    """Verify an artifact directory and make its kernels available to `maskc.attention`; the
    keys of its kernels. `sha256` pins the manifest's digest (`maskc verify DIR` prints it),
    and with it every file of the directory. Nothing is written to the directory, and the
    kernel objects and a runtime library it ships are used as the bytes that were verified."""
    manifest = open_manifest(directory, sha256)
    FROM_SOURCE.difference_update(_register(directory, manifest))
    return [v["key"] for v in manifest.body.get("variants", [])]


def _register(directory: str | Path, manifest: Manifest | None = None) -> list[tuple]:
    """Register the kernels of an artifact directory (its `manifest`, opened if None); their request keys."""
    manifest = manifest or open_manifest(directory)
    variants = manifest.body.get("variants", [])
    if not variants:
        return []
    for v in variants:
        entry_point = ENTRY_POINTS.get(v["fields"]["direction"])
        if entry_point is None or v["abi"] != abi_to_json(entry_point.args):
            raise ArtifactError(f"kernel {v['key']!r} in {directory} was built for another argument ABI: recompile")
    runtime = _runtime_for(manifest)
    for v in variants:
        abi = ENTRY_POINTS[v["fields"]["direction"]].args
        load = partial(Kernel, runtime, manifest.files[v["object"]], v["function"], abi)
        KERNELS[request_key(v["fields"])] = entry_for(load, v["fields"])
    return [request_key(v["fields"]) for v in variants]


def _runtime_for(manifest: Manifest) -> CuteRuntime:
    """The runtime library an artifact's objects run on. One it ships (hashed by its manifest) or
    one $MASKC_CUTE_RUNTIME names is the user's choice; the installed wheel's must be the DSL
    release recorded in the manifest, since objects run on the runtime of the release that built
    them."""
    shipped = toolchain.shipped_library(manifest.files, manifest.directory)
    if shipped is not None:
        return runtime_of(shipped, str(manifest.directory))
    library = toolchain.find_runtime_library()
    built, installed = manifest.body.get("toolchain", {}).get("nvidia-cutlass-dsl"), toolchain.installed_dsl_version()
    if built is not None and library == toolchain.installed_library() and installed != built:
        raise ArtifactError(
            f"kernels in {manifest.directory} were built with nvidia-cutlass-dsl {built}, but the runtime library found is "
            f"nvidia-cutlass-dsl {installed}'s: recompile, or ship the runtime with `maskc compile --bundle-runtime`"
        )
    return runtime_at(library)
