"""Artifact directories: written by codegen, verified and loaded by the runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maskc.codegen import LoweredMask, write_artifact
from maskc.errors import ArtifactError
from maskc.ir import Mask
from maskc.runtime import FORMAT_VERSION, load_artifact, read_manifest


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    source = tmp_path / "m.mask"
    source.write_text("# any source text\n")
    masks = [
        LoweredMask("docs", {"docs": [3, 5]}, Mask.from_cu_seqlens([0, 3, 8], causal=True)),
        LoweredMask("window", {"n": 16}, Mask.sliding_window([0, 16], left=4)),
    ]
    write_artifact(tmp_path / "out", masks, source=source)
    return tmp_path / "out"


def test_round_trip(artifact: Path) -> None:
    loaded = load_artifact(artifact)
    assert loaded.masks["docs"] == Mask.from_cu_seqlens([0, 3, 8], causal=True)
    assert loaded.masks["window"] == Mask.sliding_window([0, 16], left=4)
    manifest = loaded.manifest
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["masks"]["docs"]["params"] == {"docs": [3, 5]}
    assert manifest["masks"]["docs"]["area"] == 6 + 15
    assert set(manifest["files"]) == {"source.mask", "docs.ir.json", "window.ir.json"}


def test_tampered_file_is_refused(artifact: Path) -> None:
    ir = artifact / "docs.ir.json"
    ir.write_text(ir.read_text().replace('"causal"', '"full"'))
    with pytest.raises(ArtifactError, match="docs.ir.json was modified"):
        load_artifact(artifact)


def test_missing_pieces_are_refused(artifact: Path, tmp_path: Path) -> None:
    (artifact / "window.ir.json").unlink()
    with pytest.raises(ArtifactError, match="window.ir.json listed in the manifest is missing"):
        read_manifest(artifact)
    with pytest.raises(ArtifactError, match="not a maskc artifact directory"):
        read_manifest(tmp_path)


def _rewrite_manifest(artifact: Path, **changes: object) -> None:
    path = artifact / "manifest.json"
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


def test_version_mismatch_is_refused(artifact: Path) -> None:
    _rewrite_manifest(artifact, format_version=FORMAT_VERSION + 1)
    with pytest.raises(ArtifactError, match="format version .* recompile"):
        read_manifest(artifact)


def test_files_outside_the_directory_are_refused(artifact: Path) -> None:
    _rewrite_manifest(artifact, files={"../m.mask": "0" * 64})
    with pytest.raises(ArtifactError, match="outside its directory"):
        read_manifest(artifact)


def test_corrupted_manifest_is_refused(artifact: Path) -> None:
    (artifact / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_manifest(artifact)


def test_runtime_imports_without_the_compiler_stack() -> None:
    code = (
        "import sys, maskc.runtime\n"
        "heavy = [m for m in ('lark', 'jinja2', 'cutlass') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
