"""The artifact manifest: the one definition of its format, read here and written by codegen.

A manifest lists every file of its directory with a sha256, so a runtime never trusts a
file that was changed, swapped or added after compilation, and never reads outside the
directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

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


def _inside(directory: Path, name: str) -> Path:
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ArtifactError(f"manifest in {directory} names a file outside its directory: {name!r}")
    return directory / rel


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Read and verify `directory/manifest.json`: format version and the sha256 of every file."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"no {MANIFEST_NAME} in {directory}: not a maskc artifact directory")
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
        raise ArtifactError(f"{path} is not a maskc manifest (no 'files' table)")
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format version {version!r}; this maskc reads version {FORMAT_VERSION}: recompile the artifacts"
        )
    for name, expected in body["files"].items():
        file = _inside(directory, name)
        if not file.is_file():
            raise ArtifactError(f"artifact file {file} listed in the manifest is missing")
        actual = sha256_of(file)
        if actual != expected:
            raise ArtifactError(f"artifact file {file} was modified: sha256 {actual} != manifest's {expected}")
    return body
