"""The content-addressed kernel cache: a repeat compile is a no-op; concurrent compiles are safe."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from maskc.artifact.manifest import exported_symbol
from maskc.artifact.variant import KernelVariant, variant_for
from maskc.codegen import cache
from maskc.files import make_temporary_dir
from maskc.runtime import read_manifest

pytest.importorskip("cutlass", reason="compiling kernels needs the CUTLASS DSL")

REQUEST = {
    "arch": "sm_90a", "direction": "fwd", "head_dim": 128, "dtype": "bf16", "num_heads_q": 8, "num_heads_kv": 8,
    "has_softcap": False, "has_sink": False, "has_max_logits": False, "pack_gqa": False,
}  # fmt: skip


@pytest.mark.slow
def test_second_compile_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path))
    first = cache.cached_kernel(variant_for(REQUEST))
    manifest = read_manifest(first)
    assert manifest["variants"][0]["key"] == variant_for(REQUEST).key()

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr("maskc.codegen.compile.compile_variant", no_compiling)
    assert cache.cached_kernel(variant_for(REQUEST)) == first
    # Another variant, or edited templates or code generator, is another address.
    assert cache.entry_address(variant_for({**REQUEST, "num_heads_kv": 2})) != first.name
    monkeypatch.setattr(cache, "sources_digest", lambda: "edited sources")
    assert cache.entry_address(variant_for(REQUEST)) != first.name


def test_the_address_follows_the_code_generator_not_only_the_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Editing a module that shapes the generated code (render.py, the variants, the kernel
    families, the ABI), not only a template, gives every variant another address."""
    names = {name for _, name in cache.source_files()}
    shaping = {"codegen/render.py", "codegen/compile.py", "artifact/variant.py", "artifact/kernel_families.py", "artifact/abi.py"}
    assert shaping | {"sm90/host.jinja"} <= names
    edited = tmp_path / "render.py"
    edited.write_bytes(dict((name, path) for path, name in cache.source_files())["codegen/render.py"].read_bytes())
    files = [(edited if name == "codegen/render.py" else path, name) for path, name in cache.source_files()]
    monkeypatch.setattr(cache, "source_files", lambda: files)
    cache.sources_digest.cache_clear()
    before = cache.entry_address(variant_for(REQUEST))
    edited.write_text(edited.read_text() + "\n# edited\n")
    cache.sources_digest.cache_clear()
    assert cache.entry_address(variant_for(REQUEST)) != before
    cache.sources_digest.cache_clear()


@pytest.mark.slow
def test_concurrent_compiles_share_one_entry(tmp_path: Path) -> None:
    code = (
        "import json, sys; from maskc.codegen.cache import cached_kernel; from maskc.artifact.variant import variant_for; "
        "print(cached_kernel(variant_for(json.loads(sys.argv[1]))))"
    )
    env = {**os.environ, cache.ENV_CACHE: str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, json.dumps(REQUEST)], env=env, stdout=subprocess.PIPE, text=True,
                         umask=0o022)  # fmt: skip
        for _ in range(3)
    ]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    entries = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert [e.name for e in entries] == [Path(paths.pop()).name], "one entry, no leftover build directories"
    read_manifest(entries[0])
    # Written for sharing: what the umask gives a new file, not a temporary file's 0600 / 0700.
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in entries[0].rglob("*")}
    assert stat.S_IMODE(entries[0].stat().st_mode) == 0o755
    assert modes and all(mode == (0o755 if (tmp_path / name).is_dir() else 0o644) for name, mode in modes.items()), modes


def test_a_compile_sweeps_what_killed_compiles_left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staging directory whose entry's lock nobody holds is a dead compile's; one whose lock is
    held belongs to a compile still running and stays."""
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path))

    def fake_compile(variant: KernelVariant, out: Path) -> SimpleNamespace:
        obj = out / f"{variant.key()}.o"
        obj.write_bytes(b"object" + exported_symbol("attn_fwd"))
        return SimpleNamespace(seconds=0.0, object_path=obj, function_prefix="attn_fwd")

    monkeypatch.setattr("maskc.codegen.compile.compile_variant", fake_compile)
    dead = [make_temporary_dir(tmp_path, name) for name in ("0123456789abcdef01234567", cache.entry_address(variant_for(REQUEST)))]
    live = make_temporary_dir(tmp_path, "live0123456789abcdef0123")
    legacy, recent = tmp_path / ".build-old", tmp_path / ".build-recent"  # an earlier maskc's names
    for folder in (legacy, recent):
        folder.mkdir()
    os.utime(legacy, (0, 0))
    dead.append(legacy)
    with open(tmp_path / "live0123456789abcdef0123.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a running compile of that entry holds it
        entry = cache.cached_kernel(variant_for(REQUEST))
    assert not any(d.exists() for d in dead) and live.is_dir() and recent.is_dir()
    assert read_manifest(entry)["files"].keys() == {f"{variant_for(REQUEST).key()}.o"}
