"""Rebuild an artifact directory's kernels and compare them with what it ships.

Compiling a variant is deterministic (the same variant, templates and toolchain give the
same object, byte for byte), so a user who does not want to trust a publisher's objects can
recompile them from the variant records in the manifest and check that they are the ones
shipped. Where they differ, the report says which files differ and what the toolchain or the
templates that built them were, against the ones doing the rebuild.
"""

from __future__ import annotations

import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from maskc.artifact.manifest import Manifest
from maskc.artifact.toolchain import toolchain
from maskc.artifact.variant import KernelVariant
from maskc.codegen.cache import sources_digest

#: Files that `compile_variant` writes next to an object, by suffix; the PTX dump is left out
#: (it records the path it was written to).
_COMPARED = {".o": "object", ".h": "header", ".py": "rendered source"}


@dataclass(frozen=True)
class Rebuilt:
    """One kernel of an artifact, recompiled: `differences` is empty when every file matches."""

    key: str
    differences: tuple[str, ...]

    @property
    def identical(self) -> bool:
        return not self.differences


def rebuild(manifest: Manifest) -> list[Rebuilt]:
    """Recompile every kernel of `manifest` in a temporary directory and compare its files."""
    here, recorded = toolchain(), manifest.body.get("toolchain", {})
    drift = tuple(
        f"built with {name} {recorded[name]}, rebuilt with {here[name]}"
        for name in here
        if name in recorded and recorded[name] != here[name]
    )
    return [_rebuild_one(manifest, v, drift) for v in manifest.body.get("variants", [])]


def _rebuild_one(manifest: Manifest, record: dict, drift: tuple[str, ...]) -> Rebuilt:
    from maskc.codegen.compile import compile_variant

    variant = KernelVariant(**record["fields"])  # valid: open_manifest checked each record against its kernel
    obj = PurePosixPath(record["object"])
    with tempfile.TemporaryDirectory() as tmp:
        built = compile_variant(variant, tmp, keep_ptx=False)
        differences = []
        for suffix, what in _COMPARED.items():
            shipped = manifest.files.get(str(obj.with_suffix(suffix)))
            if shipped is None:
                continue
            fresh = Path(tmp, f"{built.key}{suffix}").read_bytes()
            if fresh != shipped:
                differences.append(_difference(what, shipped, fresh))
    sources = record.get("sources")
    if differences and sources is not None and sources != sources_digest():
        differences.append(f"built from templates and code generator {sources[:16]}, rebuilt from {sources_digest()[:16]}")
    return Rebuilt(record["key"], tuple(differences) + (drift if differences else ()))


def _difference(what: str, shipped: bytes, fresh: bytes) -> str:
    changed = sum(a != b for a, b in zip(shipped, fresh)) + abs(len(shipped) - len(fresh))
    text = f"{what} differs ({changed:,} of {max(len(shipped), len(fresh)):,} bytes; shipped {len(shipped):,}, rebuilt {len(fresh):,})"
    old, new = _elf_sections(shipped), _elf_sections(fresh)
    if old and new:
        sections = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
        text += f" in ELF sections {', '.join(sections)}" if sections else " in the layout only (every section is equal)"
    return text


def _elf_sections(data: bytes) -> dict[str, bytes]:
    """The sections of a little-endian ELF64 object by name ({} for anything else): where two
    builds of one kernel differ says what differs (the device code, the host code, the data the
    DSL embeds)."""
    if data[:6] != b"\x7fELF\x02\x01" or len(data) < 64:
        return {}
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * entsize) for i in range(count)]
    if not headers or names_at >= count:
        return {}
    names = data[headers[names_at][4] : headers[names_at][4] + headers[names_at][5]]
    sections = {}
    for name_at, kind, _, _, offset, size in headers:
        name = names[name_at : names.index(b"\0", name_at)].decode(errors="replace")
        sections[name] = b"" if kind == 8 else data[offset : offset + size]  # SHT_NOBITS holds no bytes
    return sections
