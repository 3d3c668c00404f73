"""The artifact manifest: its format's one definition, written by codegen, verified by the runtime.

A manifest lists every file of its directory with a sha256. Reading an artifact directory
verifies it as a whole and keeps the bytes it hashed (`Manifest.files`), so what a runtime
uses is exactly what was checked: never a file changed, swapped or added after compilation,
never a file outside the directory (symbolic links are resolved first), never anything but a
regular file within the size limits (`maskc.limits`), never a second read of a file from disk.
Each kernel's record must describe the kernel it names (its fields make the variant whose key,
object name and entry point the record gives, and the object exports that entry point), since
the runtime launches the object as its fields say. The manifest's own sha256
(`Manifest.sha256`) pins all of it: the one value to publish or commit beside a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

from maskc.artifact.abi import ENTRY_POINTS
from maskc.artifact.kernel_families import FLAGS
from maskc.artifact.variant import KernelVariant
from maskc.errors import ArtifactError, VariantError
from maskc.files import write_atomic
from maskc.limits import MAX_ARTIFACT_BYTES, MAX_ARTIFACT_FILE_BYTES, check_count

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: What `stat.filemode` calls each kind of file that is not a regular one, for messages.
_NOT_REGULAR = {"d": "a directory", "p": "a named pipe (FIFO)", "s": "a socket", "c": "a device", "b": "a device",
                "l": "a symbolic link"}  # fmt: skip


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_text(body: Mapping[str, Any], digests: Mapping[str, str]) -> str:
    """The manifest of `body` listing the files with their sha256 `digests`: the one
    serialisation, so the same artifact always has the same manifest digest."""
    return json.dumps({**body, "format_version": FORMAT_VERSION, "files": dict(digests)}, indent=2, sort_keys=True) + "\n"


def write_manifest(directory: Path, body: dict[str, Any]) -> Path:
    """Hash every file named in `body["files"]` and write the manifest atomically."""
    digests = {name: sha256_of(directory / name) for name in body["files"]}
    return write_atomic(directory / MANIFEST_NAME, manifest_text(body, digests))


def exported_symbol(function: str) -> bytes:
    """A symbol that every object `export_to_c` writes for the entry point `function` defines
    (`<function>_function_name`, in the sm90, portable and sm100 objects alike), as the
    object's string table holds it: NUL on both sides."""
    return f"\0{function}_function_name\0".encode()


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
    format and schema, the sha256 of every file it lists (each read once, inside the
    directory) and each kernel's record against its object; anything else raises
    ArtifactError naming the problem."""
    pinned = None if sha256 is None else _pinned(sha256)
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory} is not a directory: not a maskc artifact directory")
    raw = manifest_bytes(directory)
    if raw is None:
        raise ArtifactError(f"no {MANIFEST_NAME} in {directory}: not a maskc artifact directory")
    digest = hashlib.sha256(raw).hexdigest()
    if pinned is not None and digest != pinned:
        raise ArtifactError(f"{directory / MANIFEST_NAME} has sha256 {digest}, not the pinned {pinned}")
    where = f"{directory / MANIFEST_NAME}"
    body = _decode(raw, where)
    _check_schema(body, where)
    root, files, spent = directory.resolve(), {}, len(raw)
    for name, expected in body["files"].items():
        data = _read_inside(root, directory, name, spent)
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise ArtifactError(f"artifact file {directory / name} was modified: sha256 {actual} != manifest's {expected}")
        files[name] = data
        spent += len(data)
    for i, record in enumerate(body.get("variants", [])):
        _check_kernel(record, files[record["object"]], f"{where}: variants[{i}]")
    return Manifest(directory, body, digest, MappingProxyType(files))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The verified manifest of `directory` (see `open_manifest`)."""
    return open_manifest(directory).body


def manifest_bytes(directory: Path) -> bytes | None:
    """The manifest file of `directory` as it is, unverified (read as any file it lists is), or
    None where there is none."""
    root = directory.resolve()
    if not os.path.exists(root / MANIFEST_NAME):
        return None
    return _read_inside(root, directory, MANIFEST_NAME)


def listed_names(directory: Path, raw: bytes) -> list[str]:
    """The names of the files the manifest text `raw` of `directory` lists, each one a manifest
    may hold, without reading the files or checking the rest: what replacing an artifact (of
    any format version, or altered since) removes."""
    where = f"{directory / MANIFEST_NAME}"
    files = _decode(raw, where)["files"]
    _of(dict, "an object")(files, f"{where}: files")
    for name in files:
        _relative(directory, name)
    return list(files)


def _pinned(sha256: object) -> str:
    """A digest the caller pinned, normalised: refused before any file is read where it cannot be one."""
    if not isinstance(sha256, str):
        raise TypeError(f"sha256 must be a str of 64 hex digits (the manifest digest `maskc verify` prints), got {type(sha256).__name__}")
    pinned = sha256.strip().lower()
    _sha256(pinned, "the pinned sha256")
    return pinned


def _decode(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest text `raw` as JSON: an object with a files table."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ArtifactError(f"{where} is nested too deeply to be a maskc manifest") from None
    if not isinstance(body, dict) or "files" not in body:
        raise ArtifactError(f"{where} is not a maskc manifest (no 'files' table)")
    return body


def _relative(directory: Path, name: str) -> PurePosixPath:
    """`name` as a path a manifest may list: relative, without '..', naming a file."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ArtifactError(f"manifest in {directory} names a file outside its directory: {name!r}")
    if "\0" in name:
        raise ArtifactError(f"manifest in {directory} names a file with a NUL byte in its name: {name!r}")
    return rel


def _read_inside(root: Path, directory: Path, name: str, spent: int = 0) -> bytes:
    """The bytes of `name`, which must be a regular file inside `root` once every symbolic link
    is resolved, within the size limits (`spent`: the bytes of the directory read before it).
    It is checked before it is opened (opening a FIFO blocks; a device may act on it), and again
    once open, in case it was swapped in between; one read of the size it has holds it whole."""
    real = Path(os.path.realpath(root / _relative(directory, name)))
    if not real.is_relative_to(root):
        raise ArtifactError(f"artifact file {directory / name} leads outside {directory} (through a symbolic link)")
    try:
        _check_file(os.lstat(real), directory, name, spent)
        with open(os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW), "rb") as f:
            size = _check_file(os.fstat(f.fileno()), directory, name, spent)
            data = f.read(size + 1)
    except FileNotFoundError:
        raise ArtifactError(f"artifact file {directory / name} listed in the manifest is missing") from None
    except OSError as exc:
        raise ArtifactError(f"artifact file {directory / name} cannot be read: {exc.strerror}") from None
    if len(data) != size:
        raise ArtifactError(f"artifact file {directory / name} changed size while it was read")
    return data


def _check_file(info: os.stat_result, directory: Path, name: str, spent: int) -> int:
    """The size of the file `name` with status `info`: a regular file within the limits."""
    kind = stat.filemode(info.st_mode)[0]
    if kind != "-":
        raise ArtifactError(f"artifact file {directory / name} is {_NOT_REGULAR.get(kind, 'a special file')}, not a regular file")
    check_count(info.st_size, MAX_ARTIFACT_FILE_BYTES, f"size in bytes of artifact file {directory / name}", ArtifactError)
    check_count(spent + info.st_size, MAX_ARTIFACT_BYTES, f"size in bytes of the files of {directory} up to {name}", ArtifactError)
    return info.st_size


#: The fields of a kernel variant, which a kernel's record holds.
_VARIANT_FIELDS = frozenset(field.name for field in dataclasses.fields(KernelVariant))


def _check_kernel(record: Mapping[str, Any], data: bytes, where: str) -> None:
    """Refuse a kernel record that does not describe its object `data`: the runtime builds the
    schedule and the launch from its fields, so edited fields would run the kernel wrongly. The
    fields must make a valid variant whose key is the record's; `compile_variant` names the
    object after the key and exports the direction's entry point, which the record must name
    and the object define. (A consistent edit that keeps the direction passes; `maskc verify
    --rebuild` and a pinned manifest digest catch that.)"""
    unknown = sorted(record["fields"].keys() - _VARIANT_FIELDS)
    if unknown:
        raise ArtifactError(f"{where}.fields.{unknown[0]} is not a field of a kernel variant")
    try:
        variant = KernelVariant(**record["fields"])
    except VariantError as exc:
        raise ArtifactError(f"{where}.fields describe no kernel this maskc builds: {exc}") from None
    key, function = variant.key(), ENTRY_POINTS[variant.direction].name
    for field, recorded, expected in (
        ("key", record["key"], key),
        ("function", record["function"], function),
        ("object's file name", PurePosixPath(record["object"]).name, f"{key}.o"),
    ):
        if recorded != expected:
            raise ArtifactError(f"{where}.{field} is {recorded!r}, but its fields give {expected!r}")
    if exported_symbol(function) not in data:
        raise ArtifactError(f"{where}.object {record['object']} does not export {function}: not the kernel its record describes")


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
    | {name: _INT for name in ("head_dim", "num_heads_q", "num_heads_kv", "tile_m", "tile_n", "num_stages")},
    {name: _BOOL for name in (*FLAGS, "portable", "portable_next", "tall")} | {"head_dim_v": _INT},
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


def _check_schema(body: dict[str, Any], where: str) -> None:
    """Refuse a manifest that is not one of this format, naming the first wrong field; then
    check that every file it names for a mask or kernel is one it hashes."""
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
