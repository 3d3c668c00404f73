"""Artifact directories: written by codegen, verified and loaded by the runtime."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fake_kernels import FIELDS, KEY, fake_kernel

from maskc.artifact.manifest import sha256_of, write_manifest
from maskc.codegen import LoweredMask, write_artifact
from maskc.errors import ArtifactError
from maskc.files import write_atomic
from maskc.ir import Mask
from maskc.runtime import FORMAT_VERSION, load_artifact, open_manifest, read_manifest, register_artifact


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
    _rewrite_manifest(artifact, files={**read_manifest(artifact)["files"], "../m.mask": "0" * 64})
    with pytest.raises(ArtifactError, match="outside its directory"):
        read_manifest(artifact)


def test_corrupted_manifest_is_refused(artifact: Path) -> None:
    (artifact / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_manifest(artifact)


@pytest.mark.slow
def test_runtime_imports_without_the_compiler_stack() -> None:
    code = (
        "import sys, maskc.runtime\n"
        "heavy = [m for m in ('lark', 'jinja2', 'cutlass') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _fake_cache_entry(directory: Path) -> Path:
    """A cache entry as an older maskc left it (owner-only modes), with a file its manifest does not list."""
    directory.mkdir(mode=0o700)
    (directory / "dump").mkdir(mode=0o700)
    variant = fake_kernel(directory)
    for name in ("dump/k.ptx", "stray.so"):
        (directory / name).write_bytes(name.encode())
    for name in (variant["object"], "dump/k.ptx", "stray.so"):
        (directory / name).chmod(0o600)
    write_manifest(directory, {"variants": [variant], "files": [variant["object"], "dump/k.ptx"]})
    return directory


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775), (0o077, 0o600, 0o700)])
def test_artifact_directories_are_written_with_the_umask_modes(tmp_path: Path, umask: int, file_mode: int, dir_mode: int) -> None:
    """Readable by a team under the usual umask (every file, the manifest included), whatever
    modes the cache entries had; only the files a manifest hashes are copied."""
    entry = _fake_cache_entry(tmp_path / "entry")
    source = tmp_path / "m.mask"
    source.write_text("# source\n")
    source.chmod(0o600)
    old = os.umask(umask)
    try:
        write_artifact(tmp_path / "out", [LoweredMask("m", {}, Mask.from_cu_seqlens([0, 8]))], source=source,
                       kernels=[entry], plans={"m": "{}"})  # fmt: skip
    finally:
        os.umask(old)
    out = tmp_path / "out"
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    expected = {".": dir_mode, "kernels": dir_mode, "kernels/entry": dir_mode, "kernels/entry/dump": dir_mode}
    expected |= {name: file_mode for name in ("manifest.json", "m.ir.json", "m.plan.json", "source.mask",
                                               f"kernels/entry/{KEY}.o", "kernels/entry/dump/k.ptx")}  # fmt: skip
    assert modes == expected
    assert set(read_manifest(out)["files"]) == set(expected) - {".", "kernels", "kernels/entry", "kernels/entry/dump", "manifest.json"}


def test_concurrent_atomic_writes_leave_one_whole_file(tmp_path: Path) -> None:
    """Eight writers of one path: the result is one writer's bytes, whole, and no temporary file stays."""
    target = tmp_path / "manifest.json"
    payloads = [bytes([i]) * (1 << 20) for i in range(8)]
    threads = [threading.Thread(target=write_atomic, args=(target, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "x", b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_an_output_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")
    with pytest.raises(ArtifactError, match="a file of that name exists"):
        write_artifact(tmp_path / "out", [LoweredMask("m", {}, Mask.from_cu_seqlens([0, 8]))])


def test_symbolic_links_out_of_the_directory_are_refused(artifact: Path, tmp_path: Path) -> None:
    """A manifest entry read through a link (a linked folder or file) must not reach outside."""
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (artifact / "etc").symlink_to(tmp_path)
    _rewrite_manifest(artifact, files={**read_manifest(artifact)["files"], "etc/secret.txt": sha256_of(secret)})
    with pytest.raises(ArtifactError, match=r"artifact file .*etc/secret.txt leads outside .* \(through a symbolic link\)"):
        read_manifest(artifact)
    (artifact / "etc").unlink()
    (artifact / "etc").symlink_to(secret)
    _rewrite_manifest(artifact, files={**read_manifest_files(artifact), "etc": sha256_of(secret)})
    with pytest.raises(ArtifactError, match="leads outside"):
        read_manifest(artifact)
    (artifact / "etc").unlink()
    (artifact / "etc").symlink_to(artifact / "docs.ir.json")  # a link that stays inside is fine
    _rewrite_manifest(artifact, files={**read_manifest_files(artifact), "etc": sha256_of(artifact / "docs.ir.json")})
    assert "etc" in read_manifest(artifact)["files"]


def read_manifest_files(artifact: Path) -> dict:
    """The manifest's file table as written (without verifying it), less the test's `etc` entries."""
    return {k: v for k, v in json.loads((artifact / "manifest.json").read_text())["files"].items() if not k.startswith("etc")}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"masks": ["docs"]}, r"manifest.json: masks must be an object, got list"),
        ({"variants": {"k": {}}}, r"manifest.json: variants must be a list, got dict"),
        ({"variants": [{"key": "k", "object": "docs.ir.json", "function": "f", "abi": []}]}, r"variants\[0\] has no 'fields'"),
        ({"variants": [{"key": "k", "object": "docs.ir.json", "function": "f", "abi": [], "fields": {**FIELDS, "head_dim": "128"}}]},
         r"variants\[0\].fields.head_dim must be an integer, got \"128\""),
        ({"variants": [{"key": "k", "object": "nowhere.o", "function": "f", "abi": [], "fields": FIELDS}]},
         r"variants\[0\].object names 'nowhere.o', which the manifest does not hash"),
        ({"masks": {"docs": {"ir": "docs.ir.json", "seqlen_q": 8, "seqlen_k": True}}}, r'masks\["docs"\].seqlen_k must be an integer, got true'),
        ({"masks": {"docs": {"seqlen_q": 8, "seqlen_k": 8}}}, r'masks\["docs"\] has no \'ir\''),
        ({"toolchain": {"torch": 2}}, r'toolchain\["torch"\] must be a string, got 2'),
        ({"files": {"docs.ir.json": "abc"}}, r'files\["docs.ir.json"\] must be a sha256 \(64 lowercase hex digits\), got "abc"'),
        ({"files": []}, r"manifest.json: files must be an object, got list"),
    ],
)  # fmt: skip
def test_a_malformed_manifest_is_an_artifact_error_naming_the_field(artifact: Path, change: dict, message: str) -> None:
    _rewrite_manifest(artifact, **change)
    for load in (read_manifest, load_artifact, register_artifact):
        with pytest.raises(ArtifactError, match=message):
            load(artifact)


def test_the_manifest_digest_pins_the_whole_directory(artifact: Path) -> None:
    digest = hashlib.sha256((artifact / "manifest.json").read_bytes()).hexdigest()
    assert open_manifest(artifact, sha256=digest).sha256 == digest
    assert load_artifact(artifact, sha256=digest.upper()).masks.keys() == {"docs", "window"}
    assert register_artifact(artifact, sha256=digest) == []
    with pytest.raises(ArtifactError, match=f"manifest.json has sha256 {digest}, not the pinned 0000"):
        register_artifact(artifact, sha256="0" * 64)
    with pytest.raises(ArtifactError, match="not the pinned"):
        load_artifact(artifact, sha256="0" * 64)
