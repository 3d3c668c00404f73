"""The artifact manifest: its format's one definition, written by codegen, verified by the runtime.

A manifest lists every file of its directory with a sha256. Reading an artifact directory
verifies it as a whole and keeps the bytes it hashed (`Manifest.files`), so what a runtime
uses is exactly what was checked: never a file changed, swapped or added after compilation,
never a file outside the directory (symbolic links are resolved first), never a second
read of a file from disk. The manifest's own sha256 (`Manifest.sha256`) pins all of it: the
one value to publish or commit beside a model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Callable, Mapping

from maskc.artifact.families import FLAGS
from maskc.errors import ArtifactError
from maskc.files import write_atomic

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, body: dict[str, Any]) -> Path:
    """Hash every file named in `body["files"]` and write the manifest atomically."""
    body = {**body, "format_version": FORMAT_VERSION}
    body["files"] = {name: sha256_of(directory / name) for name in sorted(body["files"])}
    return write_atomic(directory / MANIFEST_NAME, json.dumps(body, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Manifest:
    """A verified artifact directory: its manifest (`body`, schema-checked), the manifest's
    sha256, and the bytes of every file it lists, as they were hashed."""

    directory: Path
    body: dict[str, Any]
    sha256: str
    files: Mapping[str, bytes]


def open_manifest(directory: str | Path, sha256: str | None = None) -> Manifest:
    """Verify `directory`: its manifest's digest against `sha256` where given, the manifest's
    format and schema, and the sha256 of every file it lists (each read once, inside the
    directory); anything else raises ArtifactError naming the problem."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory} is not a directory: not a maskc artifact directory")
    root = directory.resolve()
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"no {MANIFEST_NAME} in {directory}: not a maskc artifact directory")
    raw = _read_inside(root, directory, MANIFEST_NAME)
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256.strip().lower():
        raise ArtifactError(f"{directory / MANIFEST_NAME} has sha256 {digest}, not the pinned {sha256.strip()}")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{directory / MANIFEST_NAME} is not valid JSON: {exc}") from None
    _check_schema(body, f"{directory / MANIFEST_NAME}")
    files = {}
    for name, expected in body["files"].items():
        data = _read_inside(root, directory, name)
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise ArtifactError(f"artifact file {directory / name} was modified: sha256 {actual} != manifest's {expected}")
        files[name] = data
    return Manifest(directory, body, digest, MappingProxyType(files))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The verified manifest of `directory` (see `open_manifest`)."""
    return open_manifest(directory).body


def _read_inside(root: Path, directory: Path, name: str) -> bytes:
    """The bytes of `name`, which must stay inside `root` once every symbolic link is resolved."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ArtifactError(f"manifest in {directory} names a file outside its directory: {name!r}")
    real = (root / rel).resolve()
    if not real.is_relative_to(root):
        raise ArtifactError(f"artifact file {directory / name} leads outside {directory} (through a symbolic link)")
    try:
        return real.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"artifact file {directory / name} listed in the manifest is missing") from None
    except OSError as exc:
        raise ArtifactError(f"artifact file {directory / name} cannot be read: {exc.strerror}") from None


# ---- the schema: what a manifest holds, checked in one place --------------------------------

Check = Callable[[Any, str], None]


def _fail(where: str, expected: str, value: Any) -> None:
    shown = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    raise ArtifactError(f"{where} must be {expected}, got {shown[:60]}")


def _of(kind: type, expected: str) -> Check:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            _fail(where, expected, value)

    return check


def _sha256(value: Any, where: str) -> None:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        _fail(where, "a sha256 (64 lowercase hex digits)", value)


def _record(required: Mapping[str, Check], optional: Mapping[str, Check] = MappingProxyType({})) -> Check:
    def check(value: Any, where: str) -> None:
        _of(dict, "an object")(value, where)
        for key, check_field in required.items():
            if key not in value:
                raise ArtifactError(f"{where or 'the manifest'} has no {key!r}")
            check_field(value[key], f"{where}.{key}" if where else key)
        for key, check_field in optional.items():
            if key in value:
                check_field(value[key], f"{where}.{key}" if where else key)

    return check


def _table(check_value: Check) -> Check:
    def check(value: Any, where: str) -> None:
        _of(dict, "an object")(value, where)
        for key, item in value.items():
            check_value(item, f"{where}[{json.dumps(key)}]")

    return check


def _list(check_item: Check) -> Check:
    def check(value: Any, where: str) -> None:
        _of(list, "a list")(value, where)
        for i, item in enumerate(value):
            check_item(item, f"{where}[{i}]")

    return check


_INT, _STR, _BOOL = _of(int, "an integer"), _of(str, "a string"), _of(bool, "true or false")
#: A kernel's fields: what the runtime matches a call against and builds its schedule from.
_FIELDS = _record(
    {name: _STR for name in ("arch", "direction", "dtype")}
    | {name: _INT for name in ("head_dim", "num_heads_q", "num_heads_kv", "tile_m", "tile_n")},
    {name: _BOOL for name in (*FLAGS, "portable")} | {"num_stages": _INT, "head_dim_v": _INT},
)
_VARIANT = _record(
    {"key": _STR, "object": _STR, "function": _STR, "abi": _list(_of(dict, "an object")), "fields": _FIELDS},
    {"experimental": _BOOL, "sources": _STR},
)
_MASK = _record(
    {"ir": _STR, "seqlen_q": _INT, "seqlen_k": _INT},
    {"params": _of(dict, "an object"), "num_slices": _INT, "area": _INT, "plan": _STR},
)
_MANIFEST = _record(
    {"format_version": _INT, "files": _table(_sha256)},
    {"masks": _table(_MASK), "variants": _list(_VARIANT), "toolchain": _table(_of((str, type(None)), "a string")),
     "archs": _list(_STR), "source": _of((str, type(None)), "a string or null"), "maskc_version": _STR},  # fmt: skip
)


def _check_schema(body: Any, where: str) -> None:
    """Refuse a manifest that is not one of this format, naming the first wrong field; then
    check that every file it names for a mask or kernel is one it hashes."""
    if not isinstance(body, dict) or "files" not in body:
        raise ArtifactError(f"{where} is not a maskc manifest (no 'files' table)")
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{where} has format version {version!r}; this maskc reads version {FORMAT_VERSION}: recompile the artifacts")
    try:
        _MANIFEST(body, "")
    except ArtifactError as exc:
        raise ArtifactError(f"{where}: {exc}") from None
    named = [(f"masks[{json.dumps(m)}].{key}", entry[key]) for m, entry in body.get("masks", {}).items()
             for key in ("ir", "plan") if key in entry]  # fmt: skip
    named += [(f"variants[{i}].object", v["object"]) for i, v in enumerate(body.get("variants", []))]
    for field, name in named:
        if name not in body["files"]:
            raise ArtifactError(f"{where}: {field} names {name!r}, which the manifest does not hash")
