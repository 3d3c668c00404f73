"""What verifying an artifact directory refuses (`maskc verify`, `register_artifact`, both through
`open_manifest`): kernel records that do not describe their objects, files that are not regular
files or are too large, manifests that would crash the reader; and what writing one into a
directory that already holds an artifact does."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from fake_kernels import KEY, REQUEST, fake_kernel

from maskc import cli
from maskc.artifact import manifest as manifest_module
from maskc.artifact.abi import ENTRY_POINTS, abi_to_json
from maskc.artifact.manifest import write_manifest
from maskc.artifact.variant import variant_for
from maskc.codegen import LoweredMask, write
from maskc.errors import ArtifactError
from maskc.ir import Mask
from maskc.runtime import load_artifact, open_manifest, register_artifact

ROOT = Path(__file__).resolve().parents[1]
MASKS = [LoweredMask("docs", {}, Mask.from_cu_seqlens([0, 3, 8], causal=True))]


def _cache_entry(directory: Path) -> Path:
    """A cache entry (a one-kernel artifact directory) holding a stand-in object."""
    directory.mkdir()
    record = fake_kernel(directory)
    write_manifest(directory, {"variants": [record], "files": [record["object"]]})
    return directory


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    """An artifact directory laid out as `maskc compile` writes one, with one stand-in kernel."""
    write.write_artifact(tmp_path / "out", MASKS, kernels=[_cache_entry(tmp_path / "entry")])
    return tmp_path / "out"


def _body(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def _edit(directory: Path, edit: Callable[[dict], Any]) -> None:
    """Apply `edit` to the manifest, rehashing nothing: the files it lists stay as they are."""
    body = _body(directory)
    edit(body)
    (directory / "manifest.json").write_text(json.dumps(body))


def _list(directory: Path, name: str) -> None:
    """Add `name` to the manifest's files (with any digest: it is refused before it is hashed)."""
    _edit(directory, lambda body: body["files"].update({name: "0" * 64}))


def _verify_refuses(directory: Path, capsys: pytest.CaptureFixture, message: str, *options: str) -> None:
    """`maskc verify DIR` exits with status 2 and one line on stderr matching `message`."""
    capsys.readouterr()
    assert cli.main(["verify", str(directory), *options]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def _refused(directory: Path, capsys: pytest.CaptureFixture, message: str) -> None:
    """Verifying `directory` raises ArtifactError matching `message` wherever it is verified."""
    for load in (open_manifest, load_artifact, register_artifact):
        with pytest.raises(ArtifactError, match=message):
            load(directory)
    _verify_refuses(directory, capsys, message)


# ---- kernel records must describe their kernels ----------------------------------------------


def _set_field(name: str, value: Any, kernel: int = 0) -> Callable[[dict], None]:
    return lambda body: body["variants"][kernel]["fields"].update({name: value})


def _set(name: str, value: Any, kernel: int = 0) -> Callable[[dict], None]:
    return lambda body: body["variants"][kernel].update({name: value})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_field("tile_m", 192), rf"variants\[0\].key is '{KEY}', but its fields give 'attn_fwd_sm90_d128_bf16_h8x8_t192x128s2_\w+'"),
        (_set_field("num_heads_q", 16), rf"variants\[0\].key is '{KEY}', but its fields give 'attn_fwd_sm90_d128_bf16_h16x8_"),
        (_set_field("pack_gqa", True), r"variants\[0\].fields describe no kernel this maskc builds: pack_gqa needs"),
        (_set_field("tile_m", 100), r"variants\[0\].fields describe no kernel .*: SM90 forward tile_m 100 is not supported"),
        (_set_field("num_heads_kv", 3), r"fields describe no kernel .*: num_heads_q \(8\) must be a multiple of num_heads_kv \(3\)"),
        (_set_field("bogus", 1), r"variants\[0\].fields.bogus is not a field of a kernel variant"),
        (lambda body: body["variants"][0]["fields"].pop("num_stages"), r"variants\[0\].fields has no 'num_stages'"),
        (_set("key", "attn_fwd_other"), rf"variants\[0\].key is 'attn_fwd_other', but its fields give '{KEY}'"),
        (_set("function", "attn_bwd"), r"variants\[0\].function is 'attn_bwd', but its fields give 'attn_fwd'"),
    ],
    ids=["tile_m", "num_heads_q", "pack_gqa", "unsupported tile_m", "heads", "unknown field", "no num_stages", "key", "function"],
)  # fmt: skip
def test_a_kernel_record_its_kernel_does_not_match_is_refused(artifact: Path, capsys: pytest.CaptureFixture,
                                                              edit: Callable[[dict], None], message: str) -> None:  # fmt: skip
    """The runtime builds a kernel's schedule and launch from its record's fields: an edited
    field would run the object under a wrong description. Every file still matches its hash."""
    assert cli.main(["verify", str(artifact)]) == 0
    _edit(artifact, edit)
    _refused(artifact, capsys, message)


def _describe_as(directory: Path, fields: dict, object_name: str | None = None) -> None:
    """Rewrite the kernel's record consistently for `fields` (key, function, ABI), its object
    renamed to `object_name` (default: the key's), and rehash: what a careful editor does."""
    body = _body(directory)
    record = body["variants"][0]
    variant = variant_for({k: fields[k] for k in REQUEST})
    old = record["object"]
    new = PurePosixPath(old).with_name(object_name or f"{variant.key()}.o").as_posix()
    (directory / old).rename(directory / new)
    entry = ENTRY_POINTS[variant.direction]
    record.update(key=variant.key(), function=entry.name, fields=asdict(variant), object=new, abi=abi_to_json(entry.args))
    write_manifest(directory, {**body, "files": [new, *(name for name in body["files"] if name != old)]})


def test_an_object_that_does_not_export_its_records_function_is_refused(artifact: Path, capsys: pytest.CaptureFixture) -> None:
    """A forward object described, consistently and rehashed, as a backward kernel."""
    _describe_as(artifact, {**REQUEST, "direction": "bwd"})
    _refused(artifact, capsys, r"variants\[0\].object kernels/entry/attn_bwd_\w+\.o does not export attn_bwd: not the kernel")


def test_an_object_not_named_after_its_key_is_refused(artifact: Path, capsys: pytest.CaptureFixture) -> None:
    _describe_as(artifact, REQUEST, object_name="kernel.o")
    _refused(artifact, capsys, rf"variants\[0\].object's file name is 'kernel.o', but its fields give '{KEY}.o'")


# ---- only regular files, read within limits --------------------------------------------------


def _finishes(call: Callable[[], Any], fifo: Path | None = None) -> Any:
    """`call()`'s result or the exception it raised, run in a thread: still blocked after 20 s,
    the test fails (after unblocking it by opening the other end of `fifo`)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(20)
        pytest.fail("verifying the artifact blocked on a file it lists")
    return outcome[0]


def _make(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        socket.socket(socket.AF_UNIX).bind(str(path))


@pytest.mark.parametrize(("kind", "described"), [("fifo", r"a named pipe \(FIFO\)"), ("directory", "a directory"),
                                                 ("socket", "a socket")])  # fmt: skip
def test_a_listed_file_that_is_not_a_regular_file_is_refused_without_blocking(
    artifact: Path, capsys: pytest.CaptureFixture, kind: str, described: str
) -> None:
    """Opening a FIFO for reading blocks until a writer comes: it must be refused before."""
    _make(kind, artifact / "special")
    _list(artifact, "special")
    message = rf"artifact file .*/special is {described}, not a regular file"
    fifo = artifact / "special" if kind == "fifo" else None
    for load in (open_manifest, register_artifact):
        assert re.search(message, str(_finishes(lambda: load(artifact), fifo))), kind
    assert _finishes(lambda: cli.main(["verify", str(artifact)]), fifo) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_a_listed_file_larger_than_any_artifact_file_is_refused_before_it_is_read(artifact: Path, capsys: pytest.CaptureFixture) -> None:
    """A sparse 3 GiB file: refused by its size (no 3 GiB read into memory, no MemoryError)."""
    with open(artifact / "big.o", "wb") as f:
        f.truncate(3 * 2**30)
    _list(artifact, "big.o")
    _refused(artifact, capsys, r"size in bytes of artifact file .*/big.o: 3,221,225,472 is more than maskc supports \(at most 268,435,456\)")


def test_files_larger_together_than_an_artifact_directory_holds_are_refused(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit on the directory's total (verifying keeps every file in memory), here lowered to 1 MiB."""
    monkeypatch.setattr(manifest_module, "MAX_ARTIFACT_BYTES", 2**20)
    open_manifest(artifact)
    with open(artifact / "big.o", "wb") as f:
        f.truncate(2**20 - 1)
    _list(artifact, "big.o")
    with pytest.raises(ArtifactError, match=r"size in bytes of the files of .*/out up to big.o: 1,0\d\d,\d{3} is more than maskc supports \(at most 1,048,576\)"):
        open_manifest(artifact)


def test_names_no_file_can_have_are_refused(artifact: Path, capsys: pytest.CaptureFixture) -> None:
    """A NUL byte in a name, a loop of symbolic links: an ArtifactError, not a ValueError or RuntimeError."""
    _list(artifact, "a\0b")
    _refused(artifact, capsys, r"names a file with a NUL byte in its name: 'a\\x00b'")
    _edit(artifact, lambda body: body["files"].pop("a\0b"))
    (artifact / "loop").symlink_to("loop2")
    (artifact / "loop2").symlink_to("loop")
    _list(artifact, "loop")
    _refused(artifact, capsys, r"artifact file .*/loop is a symbolic link, not a regular file")


# ---- manifests that are not JSON a reader can take, digests that are not digests -------------


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000], ids=["lists", "objects"])
def test_a_manifest_nested_too_deeply_is_an_artifact_error(artifact: Path, capsys: pytest.CaptureFixture, text: str) -> None:
    (artifact / "manifest.json").write_text(text)
    _refused(artifact, capsys, r"manifest.json is nested too deeply to be a maskc manifest")


def test_a_pinned_digest_that_is_not_one_is_refused_clearly(artifact: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(TypeError, match=r"sha256 must be a str of 64 hex digits .*, got int"):
        register_artifact(artifact, sha256=12345)
    for pinned in ("xyz", "g" * 64, "ab" * 33):
        with pytest.raises(ArtifactError, match=r"the pinned sha256 must be a sha256 \(64 lowercase hex digits\), got \""):
            register_artifact(artifact, sha256=pinned)
        _verify_refuses(artifact, capsys, r"the pinned sha256 must be a sha256", "--sha256", pinned)


# ---- writing into a directory that holds an artifact -----------------------------------------


def _compile(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    status = cli.main(["compile", *args])
    return status, capsys.readouterr().err


def _listing(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*")}


def test_a_directory_holding_another_artifact_is_replaced_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The same compile again is fine; another one is refused (its masks and kernels would be
    dropped without a word) unless --overwrite, which leaves only the new artifact's files."""
    out = tmp_path / "out"
    causal, full = str(ROOT / "examples" / "causal.mask"), str(ROOT / "examples" / "full.mask")
    assert _compile(capsys, causal, "-o", str(out), "--ir-only") == (0, "")
    first = (out / "manifest.json").read_bytes()
    assert _compile(capsys, causal, "-o", str(out), "--ir-only") == (0, "")
    status, err = _compile(capsys, full, "-o", str(out), "--ir-only")
    assert status == 2 and len(err.splitlines()) == 1, err
    assert re.search(r"out already holds another artifact .*: replace it with `maskc compile --overwrite`", err), err
    assert (out / "manifest.json").read_bytes() == first and open_manifest(out).body["masks"].keys() == {"causal"}
    assert _compile(capsys, full, "-o", str(out), "--ir-only", "--overwrite") == (0, "")
    assert load_artifact(out).masks.keys() == {"full"}
    assert _listing(out) == {"manifest.json", "source.mask", "full.ir.json"}


def test_replacing_an_artifact_removes_its_kernels_and_nothing_outside(tmp_path: Path) -> None:
    """The old kernels' files and folders go; a file the old manifest reaches through a linked
    folder (outside the directory) and a file it does not list stay."""
    out = tmp_path / "out"
    write.write_artifact(out, MASKS, kernels=[_cache_entry(tmp_path / "entry")])
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("not the artifact's")
    (out / "linked").symlink_to(tmp_path / "elsewhere")
    (out / "notes.txt").write_text("the user's")
    _edit(out, lambda body: body["files"].update({"linked/keep.txt": "0" * 64}))
    with pytest.raises(ArtifactError, match="already holds another artifact"):
        write.write_artifact(out, MASKS)
    write.write_artifact(out, MASKS, overwrite=True)
    assert _listing(out) == {"manifest.json", "docs.ir.json", "linked", "notes.txt"}
    assert (tmp_path / "elsewhere" / "keep.txt").read_text() == "not the artifact's"
    assert open_manifest(out).files.keys() == {"docs.ir.json"}


def test_concurrent_writes_into_one_directory_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writes of different artifacts at once: one succeeds, the other finds its artifact and
    is refused; the directory holds exactly the winner's files, and no lock file."""
    out = tmp_path / "out"
    real_write = write.write_atomic

    def slow_write(path: Path, data: bytes | str) -> Path:
        """Each file a while in the writing, so that two unserialised writers would overlap."""
        time.sleep(0.05)
        return real_write(path, data)

    monkeypatch.setattr(write, "write_atomic", slow_write)
    start = threading.Barrier(2)
    outcomes: dict[str, Any] = {}

    def run(name: str) -> None:
        start.wait()
        try:
            outcomes[name] = write.write_artifact(out, [LoweredMask(name, {}, Mask.from_cu_seqlens([0, 8]))])
        except ArtifactError as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    refused = [name for name, outcome in outcomes.items() if isinstance(outcome, ArtifactError)]
    assert len(refused) == 1 and "already holds another artifact" in str(outcomes[refused[0]]), outcomes
    (winner,) = outcomes.keys() - set(refused)
    assert load_artifact(out).masks.keys() == {winner}
    assert _listing(out) == {"manifest.json", f"{winner}.ir.json"}


# ---- the same on real compiled kernels -------------------------------------------------------


def _maskc(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MASKC_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "maskc", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


COMPILE = ("compile", "examples/causal.mask", "--head-dim", "64", "--dtype", "fp16")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real artifact directory (a forward and a backward kernel for 4 heads) and its kernel cache."""
    pytest.importorskip("cutlass", reason="compiling kernels needs the CUTLASS DSL")
    root = tmp_path_factory.mktemp("compiled")
    result = _maskc(*COMPILE, "--heads", "4:4", "-o", str(root / "art"), cache=root / "cache")
    assert result.returncode == 0, result.stderr
    return root / "art", root / "cache"


def _assert_one_line(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 2 and one error line matching `message`, after the compile's progress bar if any."""
    assert result.returncode == 2, result
    *progress, error = result.stderr.splitlines()
    assert all(not line or line.startswith("compiling kernels") for line in progress), result.stderr
    assert error.startswith("maskc: error: ") and re.search(message, error), result.stderr


@pytest.mark.slow
def test_edited_records_of_real_kernels_are_refused(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    """The fields, key and function of a compiled forward kernel, each edited; then its record
    rewritten consistently (and rehashed) as a backward kernel's."""
    art, cache = compiled
    assert _maskc("verify", str(art), cache=cache).returncode == 0
    fwd = next(i for i, v in enumerate(_body(art)["variants"]) if v["fields"]["direction"] == "fwd")
    edits = {
        "tile_m": (_set_field("tile_m", 128, fwd), r"variants\[\d\].key is 'attn_fwd_sm90_d64_fp16_h4x4_t192x128s2_\w+', but its fields give 'attn_fwd_sm90_d64_fp16_h4x4_t128x128s2_"),
        "num_heads_q": (_set_field("num_heads_q", 8, fwd), r"variants\[\d\].key is .*_h4x4_.*, but its fields give .*_h8x4_"),
        "key": (_set("key", "attn_fwd_sm90_d64_fp16_h8x4_t192x128s2_0123456789", fwd), r"variants\[\d\].key is .*_h8x4_.*, but its fields give .*_h4x4_"),
        "function": (_set("function", "attn_bwd", fwd), r"variants\[\d\].function is 'attn_bwd', but its fields give 'attn_fwd'"),
    }  # fmt: skip
    for name, (edit, message) in edits.items():
        copy = tmp_path / name
        shutil.copytree(art, copy, symlinks=True)
        _edit(copy, edit)
        _assert_one_line(_maskc("verify", str(copy), cache=cache), message)
        with pytest.raises(ArtifactError, match=message):
            register_artifact(copy)
    copy = tmp_path / "direction"
    shutil.copytree(art, copy, symlinks=True)
    _edit(copy, lambda body: body.update(variants=[body["variants"][fwd]]))
    _describe_as(copy, {**_body(copy)["variants"][0]["fields"], "direction": "bwd"})
    _assert_one_line(_maskc("verify", str(copy), cache=cache), r"variants\[0\].object .*attn_bwd_\w+\.o does not export attn_bwd")


@pytest.mark.slow
def test_compiling_other_heads_into_a_real_artifact_is_refused_unless_replacing(compiled: tuple[Path, Path], tmp_path: Path) -> None:
    art, cache = compiled
    out = tmp_path / "art"
    shutil.copytree(art, out, symlinks=True)
    before = (out / "manifest.json").read_bytes()
    _assert_one_line(_maskc(*COMPILE, "--heads", "2:2", "-o", str(out), cache=cache), "already holds another artifact")
    assert (out / "manifest.json").read_bytes() == before
    replaced = _maskc(*COMPILE, "--heads", "2:2", "-o", str(out), "--overwrite", cache=cache)
    assert replaced.returncode == 0, replaced.stderr
    variants = _body(out)["variants"]
    assert {(v["fields"]["direction"], v["fields"]["num_heads_q"]) for v in variants} == {("fwd", 2), ("bwd", 2)}
    assert {p.name for p in (out / "kernels").iterdir()} == {Path(v["object"]).parent.name for v in variants}
    assert not any("_h4x4_" in p.name for p in out.rglob("*"))
    assert _maskc("verify", str(out), cache=cache).returncode == 0
