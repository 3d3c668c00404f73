"""The `maskc` command, end to end, as a user runs it (a separate process)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maskc import __version__ as VERSION
from maskc.ir import Mask
from maskc.runtime import load_artifact

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.mask"))


def maskc(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maskc", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def assert_user_error(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 2 and one line on stderr matching `message`, no traceback."""
    assert result.returncode == 2, result
    assert len(result.stderr.splitlines()) == 1 and re.search(message, result.stderr), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_shows_with_its_defaults(example: Path, tmp_path: Path) -> None:
    result = maskc("show", str(example), "--png-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "density" in result.stdout
    for name in re.findall(r"^mask (\S+)$", result.stdout, flags=re.M):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_show_reports_exact_numbers(tmp_path: Path) -> None:
    result = maskc(
        "show", "examples/varlen_causal.mask", "--param", "docs=4,6", "--no-png", cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"area\s+31\b", result.stdout)  # 4*5/2 + 6*7/2
    assert re.search(r"seqlen\s+10 x 10", result.stdout)


@pytest.mark.slow
def test_compile_writes_a_loadable_artifact(tmp_path: Path) -> None:
    pytest.importorskip("cutlass", reason="compiling kernels needs the CUTLASS DSL")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100 200\n50\n")
    out = tmp_path / "art"
    result = maskc(
        "compile", "examples/varlen_block_causal.mask", "-o", str(out), "--param", f"docs=@{lengths}", "-p", "block=64"
    )
    assert result.returncode == 0, result.stderr
    artifact = load_artifact(out)
    (name,) = artifact.masks
    assert artifact.masks[name].shape == (350, 350)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["masks"][name]["params"]["docs"] == [100, 200, 50]
    assert manifest["masks"][name]["params"]["block"] == 64


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "examples/no_such.mask"], "no_such.mask"),
        (["show", "examples/causal.mask", "--param", "bogus=3"], "unknown parameter.*bogus"),
        (["show", "examples/causal.mask", "--param", "n=abc"], "expects an integer"),
        (["show", "examples/causal.mask", "--param", "n"], "NAME=VALUE"),
        (["show", "examples/varlen_causal.mask", "--param", "docs=1,x"], "list of integers"),
        (["show", "examples/varlen_causal.mask", "--param", "docs=@/nonexistent"], "cannot read"),
        (["show", "examples/causal.mask", "--mask", "nope"], "no mask 'nope'"),
        (["compile", "examples/causal.mask"], "-o/--output"),
        (["compile", "examples/causal.mask", "-o", "README.md", "--ir-only"], "README.md: a file of that name exists"),
        (["compile", "examples/causal.mask", "-o", "x", "--heads", "3:2"], "multiple of kv heads"),
        (["compile", "examples/causal.mask", "-o", "x", "--head-dim", "64,x"], "list of head dims"),
        (["show", "examples", "--no-png"], "examples is a directory, not a mask file"),
        (["show", "README.md", "--no-png"], r"README.md:\d+:\d+: unexpected"),
        (["plan", "examples/causal.mask", "--cp", "0"], "positive integer"),
        (["plan", "examples/causal.mask", "--cp", "2", "--algorithm", "best"], "unknown dispatch algorithm 'best'"),
        (["show", "examples/causal.mask", "-p", "n=99999999999999999999", "--no-png"], "99999999999999999999 is outside"),
        (["show", "examples/causal.mask", "-p", "n=4294967296", "--no-png"], "q tokens: 4,294,967,296 is more than maskc supports"),
        (["plan", "examples/causal.mask", "--cp", "100000"], "context-parallel ranks: 100,000 is more than maskc supports"),
        (["compile", "examples/causal.mask", "-p", "n=4294967296", "-o", "x"], "q tokens: 4,294,967,296 is more than"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_input_is_one_clear_line_with_exit_code_2(args: list[str], message: str) -> None:
    assert_user_error(maskc(*args), message)


@pytest.mark.slow
def test_a_file_that_is_not_text_is_a_clear_error(tmp_path: Path) -> None:
    binary = tmp_path / "model.mask"
    binary.write_bytes(b"mask m(n: int = 4):\n\x00\xff\xfe\x80")
    assert_user_error(maskc("show", str(binary)), rf"{re.escape(str(binary))}:2:2: .*not UTF-8")


@pytest.mark.slow
def test_an_unwritable_output_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert_user_error(maskc("show", "examples/causal.mask", "--png-dir", str(tmp_path / "file" / "sub")), "file/sub")


def test_a_bug_shows_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only user errors become one line: anything else propagates, traceback and all."""
    from maskc import cli

    def broken(args: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "_show", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["show", "examples/causal.mask"])


@pytest.mark.slow
def test_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mask"
    bad.write_text("mask m(n: int = 4):\n    seqlen(n)\n    full(q=0:n k=0:n)\n")
    assert_user_error(maskc("show", str(bad), "--no-png"), rf"{re.escape(str(bad))}:3:\d+")


def test_help_documents_every_option() -> None:
    for command, options in {
        "show": ["--mask", "--param", "--png-dir", "--no-png", "--size"],
        "compile": ["--mask", "--param", "--output", "--overwrite"],
    }.items():
        result = maskc(command, "--help")
        assert result.returncode == 0
        for option in options:
            assert option in result.stdout


@pytest.mark.slow
def test_readme_main_job_works(tmp_path: Path) -> None:
    """The README's first command, minus the environment set-up this test already runs in."""
    pytest.importorskip("cutlass", reason="the README's set-up installs the CUTLASS DSL")
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("python3 -m venv"))
    steps = [s.strip() for s in command.split("&&") if s.strip().startswith(".venv/bin/maskc")]
    assert steps, command
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    for step in steps:
        result = maskc(*shlex.split(step)[1:], cwd=tmp_path)
        assert result.returncode == 0, (step, result.stderr)
    assert (tmp_path / "build" / "varlen_block_causal" / "manifest.json").is_file()
    assert list((tmp_path / "build").glob("*.png"))


def test_compile_without_the_dsl_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from maskc import cli
    from maskc.codegen import compile as compiler

    real = compiler.importlib.util.find_spec
    monkeypatch.setattr(compiler.importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    monkeypatch.setenv("MASKC_CACHE", str(tmp_path / "cache"))
    assert cli.main(["compile", str(ROOT / "examples" / "causal.mask"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "maskc: error: compiling kernels needs the CUTLASS DSL: pip install 'maskc[compiler]';" in err
    assert cli.main(["compile", str(ROOT / "examples" / "causal.mask"), "-o", str(tmp_path / "ir"), "--ir-only"]) == 0
    assert not (tmp_path / "ir" / "kernels").exists()


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_compiles_to_sm90_kernels_using_wgmma_and_tma(example: Path, tmp_path: Path) -> None:
    pytest.importorskip("cutlass", reason="compiling kernels needs the CUTLASS DSL")
    out = tmp_path / "art"
    result = maskc("compile", str(example), "-o", str(out), "--arch", "sm_90a")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["archs"] == ["sm_90a"] and manifest["variants"]
    for variant in manifest["variants"]:
        ptx = "".join(p.read_text() for p in (out / variant["object"]).parent.rglob("*.ptx"))
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx


def test_the_backward_without_line_masks_is_built_for_masks_that_need_it() -> None:
    """A mask whose backward has no partial block (full, or documents on k tile edges) also gets
    the unmasked backward, in each deterministic mode; a causal mask only the masked one."""
    from maskc.cli import _kernel_requests, build_parser

    args = build_parser().parse_args(["compile", "x.mask", "-o", "out", "--deterministic", "--heads", "8:2,8:8"])

    def backward(masks):
        return sorted((r["num_heads_kv"], r["deterministic"], r["unmasked"]) for r in _kernel_requests(args, masks)
                      if r["direction"] == "bwd")  # fmt: skip

    causal, full = Mask.from_cu_seqlens([0, 1000], causal=True), Mask.from_cu_seqlens([0, 1000])
    assert backward([causal]) == [(h, d, False) for h in (2, 8) for d in (False, True)]
    assert backward([causal, full]) == backward([Mask.from_cu_seqlens([0, 1024, 1100])]) == [
        (h, d, u) for h in (2, 8) for d in (False, True) for u in (False, True)
    ]


def test_an_arch_without_kernels_of_its_own_gets_the_portable_kernels() -> None:
    """sm_80 gets the portable forward and backward only (no PackGQA, no unmasked backward);
    sm_90a its own kernels (at d=128 the forward in both tile shapes), plus the portable ones
    with --portable; sm_100a both."""
    from maskc.cli import _kernel_requests, build_parser

    def requests(*flags):
        args = build_parser().parse_args(["compile", "x.mask", "-o", "out", "--heads", "8:2", *flags])
        return sorted((r["arch"], r["direction"], r.get("pack_gqa"), r.get("tall", False), r.get("deterministic", False),
                       r.get("portable", False))
                      for r in _kernel_requests(args, [Mask.from_cu_seqlens([0, 1000], causal=True)]))  # fmt: skip

    portable = [(arch, d, False, False, det, True) for arch in ("sm_120a", "sm_80")
                for d, det in (("bwd", False), ("bwd", True), ("fwd", False))]  # fmt: skip
    assert requests("--arch", "sm_80,sm_120a", "--deterministic") == portable
    native = [("sm_90a", "bwd", False, False, False, False),
              *(("sm_90a", "fwd", pack, tall, False, False) for pack in (False, True) for tall in (False, True))]  # fmt: skip
    assert requests() == native
    assert requests("--head-dim", "96") == [r for r in native if not r[3]]
    assert requests("--portable") == sorted(native + [("sm_90a", d, False, False, False, True) for d in ("bwd", "fwd")])
    # sm_100a: the portable kernels, and its own (experimental) ones without PackGQA.
    blackwell = [("sm_100a", d, False, False, det, own) for d, det in (("bwd", False), ("bwd", True), ("fwd", False))
                 for own in (False, True)]  # fmt: skip
    assert requests("--arch", "sm_100a", "--deterministic") == blackwell
    assert requests("--arch", "sm_100a") == [r for r in blackwell if not r[4]]


@pytest.mark.slow
def test_python_dash_m_maskc_is_the_maskc_command(tmp_path: Path) -> None:
    """`python -m maskc` and the installed `maskc` script run the same command line."""
    script = Path(sys.executable).with_name("maskc")
    if not script.is_file():
        pytest.skip("the maskc script is not installed next to this Python")
    args = ["show", str(ROOT / "examples" / "varlen_causal.mask"), "--no-png"]
    direct = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    module = maskc(*args, cwd=tmp_path)
    assert direct.returncode == module.returncode == 0, (direct.stderr, module.stderr)
    assert direct.stdout == module.stdout and "mask varlen_causal" in module.stdout
    assert maskc("--version").stdout.strip() == f"maskc {VERSION}"


@pytest.mark.parametrize("args", [["--help"], ["show", "--help"], ["compile", "--help"], ["plan", "--help"], ["--version"]])
def test_help_and_version_import_neither_torch_nor_the_compiler(args: list[str]) -> None:
    code = (
        "import sys\n"
        "from maskc.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "heavy = {'torch', 'numpy', 'lark', 'jinja2', 'cutlass', 'matplotlib'} & {m.split('.')[0] for m in sys.modules}\n"
        "print('heavy:', sorted(heavy), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stderr
    assert "usage: maskc" in result.stdout or result.stdout.startswith("maskc ")


@pytest.mark.slow
def test_plan_skips_what_context_parallelism_cannot_take_and_plans_the_rest(tmp_path: Path) -> None:
    """examples/primitives.mask holds a non-square family and a square one."""
    result = maskc("plan", "examples/primitives.mask", "--cp", "2")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "maskc: skipping mask primitives: context parallelism deals queries and keys together: "
        "the mask must be square, got 2048 x 1024"
    ]
    assert re.search(r"^plan varlen_inv_causal: 6656 tokens", result.stdout, flags=re.M)
    assert "plan primitives" not in result.stdout
    only = maskc("plan", "examples/primitives.mask", "--cp", "2", "--mask", "primitives")
    assert_user_error(only, "cannot plan mask primitives: .*must be square")


@pytest.mark.slow
def test_plan_png_writes_exactly_the_path_given(tmp_path: Path) -> None:
    target = tmp_path / "pictures" / "my plan.image"
    result = maskc("plan", str(ROOT / "examples" / "primitives.mask"), "--cp", "2", "--png", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert target.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["pictures", "pictures/my plan.image"]
    assert f"picture         {target}" in result.stdout
    both = tmp_path / "both.mask"
    both.write_text((ROOT / "examples" / "causal.mask").read_text() + (ROOT / "examples" / "full.mask").read_text())
    assert_user_error(maskc("plan", str(both), "--cp", "2", "--png", "p.png"), "--png takes one plan; .* pick one with --mask")
    assert maskc("plan", str(both), "--cp", "2", "--png", "p.png", "--mask", "full", cwd=tmp_path).returncode == 0
    assert (tmp_path / "p.png").is_file() and not list(tmp_path.glob("*_p.png"))


@pytest.mark.slow
def test_show_writes_pictures_only_where_asked_and_says_where(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "causal.mask")
    default = maskc("show", example, cwd=tmp_path)
    assert default.returncode == 0, default.stderr
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["build", "build/causal.png"]
    assert re.search(r"picture\s+build/causal.png$", default.stdout, flags=re.M)
    chosen = maskc("show", example, "--png-dir", str(tmp_path / "pics"), cwd=tmp_path)
    assert chosen.returncode == 0, chosen.stderr
    assert (tmp_path / "pics" / "causal.png").read_bytes()[:4] == b"\x89PNG"
    assert f"picture    {tmp_path / 'pics' / 'causal.png'}" in chosen.stdout
    assert maskc("show", example, "--no-png", cwd=tmp_path / "pics").returncode == 0
    assert sorted(p.name for p in (tmp_path / "pics").iterdir()) == ["causal.png"]


@pytest.mark.slow
def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`maskc ... | head`: the reader is gone before maskc writes; no traceback, no message."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "maskc", "show", "examples/varlen_causal.mask", "--no-png"],
            cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
        )  # fmt: skip
    finally:
        os.close(write)
    assert result.returncode == 141
    assert result.stderr == ""


@pytest.mark.slow
def test_verify_prints_the_digest_that_pins_a_directory(tmp_path: Path) -> None:
    out = tmp_path / "art"
    assert maskc("compile", "examples/causal.mask", "-o", str(out), "--ir-only").returncode == 0
    digest = hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    result = maskc("verify", str(out), "--sha256", digest)
    assert result.returncode == 0, result.stderr
    assert f"manifest sha256  {digest}" in result.stdout and "every file matches its manifest (2 files)" in result.stdout
    assert_user_error(maskc("verify", str(out), "--sha256", "ab" * 32), f"has sha256 {digest}, not the pinned abab")
    (out / "causal.ir.json").write_text("{}")
    assert_user_error(maskc("verify", str(out)), "causal.ir.json was modified")
    assert_user_error(maskc("verify", str(tmp_path / "none")), "is not a directory")


@pytest.mark.slow
def test_verify_rebuild_finds_an_object_its_publisher_swapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher who replaces an object and rehashes the manifest passes the hash check;
    recompiling the recorded variant shows the object is not what maskc builds, and where."""
    pytest.importorskip("cutlass", reason="rebuilding kernels needs the CUTLASS DSL")
    monkeypatch.setenv("MASKC_CACHE", str(tmp_path / "cache"))  # built here, by this Python and DSL
    from maskc.artifact.manifest import write_manifest
    from maskc.artifact.variant import variant_for
    from maskc.codegen import LoweredMask, write_artifact
    from maskc.codegen.cache import cached_kernel

    request = {"arch": "sm_90a", "direction": "fwd", "head_dim": 64, "dtype": "fp16", "num_heads_q": 4, "num_heads_kv": 4,
               "has_softcap": False, "has_sink": False, "has_max_logits": False, "pack_gqa": False}  # fmt: skip
    out = tmp_path / "art"
    write_artifact(out, [LoweredMask("m", {}, Mask.from_cu_seqlens([0, 8]))], kernels=[cached_kernel(variant_for(request))])
    honest = maskc("verify", str(out), "--rebuild")
    assert honest.returncode == 0, honest.stderr
    assert re.search(r"attn_fwd_\S+: identical", honest.stdout) and "1 identical, 0 different" in honest.stdout
    body = json.loads((out / "manifest.json").read_text())
    obj = out / body["variants"][0]["object"]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    body["toolchain"]["python"] = "3.0.0"
    write_manifest(out, body)
    swapped = maskc("verify", str(out), "--rebuild")
    assert swapped.returncode == 1, swapped.stderr
    assert re.search(r"attn_fwd_\S+: DIFFERS: object differs \(1 of [\d,]+ bytes.*\) in ELF sections \.\w+", swapped.stdout), swapped.stdout
    assert "; built with python 3.0.0, rebuilt with " in swapped.stdout


def test_head_dims_only_the_next_portable_kernels_have_get_them_and_portable_next_adds_them() -> None:
    """On sm_80, d=96 and d=256 exist only as the experimental next portable kernels (both
    directions), their forward with and without PackGQA;
    `--portable-next` adds them beside the verified ones; on sm_86 (99 KiB a CTA) d=128's next
    backward takes 32-query blocks and one stage."""
    from maskc.artifact.variant import variant_for
    from maskc.cli import _kernel_requests, build_parser

    def requests(*flags):
        args = build_parser().parse_args(["compile", "x.mask", "-o", "out", "--heads", "8:2", *flags])
        return sorted((r["head_dim"], r["direction"], r.get("portable_next", False), r["pack_gqa"])
                      for r in _kernel_requests(args, [Mask.from_cu_seqlens([0, 1000], causal=True)]))  # fmt: skip

    def next_kernels(d: int, backward: bool = True) -> list[tuple]:
        return [(d, "bwd", True, False)] * backward + [(d, "fwd", True, pack) for pack in (False, True)]

    verified = [(d, direction, False, False) for d in (64, 128) for direction in ("bwd", "fwd")]
    assert requests("--arch", "sm_80", "--head-dim", "64,96,128,256") == sorted(
        verified + next_kernels(96) + next_kernels(256)
    )
    assert requests("--arch", "sm_80", "--portable-next") == sorted([(128, d, False, False) for d in ("bwd", "fwd")]
                                                                    + next_kernels(128))  # fmt: skip
    args = build_parser().parse_args(["compile", "x.mask", "-o", "out", "--arch", "sm_86", "--portable-next"])
    shapes = {(r["direction"], r.get("portable_next", False), r["pack_gqa"]): variant_for(r)
              for r in _kernel_requests(args, [Mask.from_cu_seqlens([0, 1000])])}  # fmt: skip
    assert (shapes["bwd", True, False].tile_m, shapes["bwd", True, False].num_stages) == (32, 1)
