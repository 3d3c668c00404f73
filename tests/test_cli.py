"""The `maskc` command, end to end, as a user runs it (a separate process)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maskc.ir import Mask
from maskc.runtime import load_artifact

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.mask"))


def maskc(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "maskc.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


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
    ],
)
def test_bad_input_is_a_clear_error_with_exit_code_2(args: list[str], message: str) -> None:
    result = maskc(*args)
    assert result.returncode == 2
    assert re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.stderr


def test_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mask"
    bad.write_text("mask m(n: int = 4):\n    seqlen(n)\n    full(q=0:n k=0:n)\n")
    result = maskc("show", str(bad), "--no-png")
    assert result.returncode == 2
    assert re.search(rf"{re.escape(str(bad))}:3:\d+", result.stderr), result.stderr


def test_help_documents_every_option() -> None:
    for command, options in {
        "show": ["--mask", "--param", "--png-dir", "--no-png", "--size"],
        "compile": ["--mask", "--param", "--output"],
    }.items():
        result = maskc(command, "--help")
        assert result.returncode == 0
        for option in options:
            assert option in result.stdout


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
    assert "needs the CUTLASS DSL" in capsys.readouterr().err
    assert cli.main(["compile", str(ROOT / "examples" / "causal.mask"), "-o", str(tmp_path / "ir"), "--ir-only"]) == 0
    assert not (tmp_path / "ir" / "kernels").exists()


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
    sm_90a its own kernels, plus the portable ones with --portable; sm_100a both."""
    from maskc.cli import _kernel_requests, build_parser

    def requests(*flags):
        args = build_parser().parse_args(["compile", "x.mask", "-o", "out", "--heads", "8:2", *flags])
        return sorted((r["arch"], r["direction"], r.get("pack_gqa"), r.get("deterministic", False), r.get("portable", False))
                      for r in _kernel_requests(args, [Mask.from_cu_seqlens([0, 1000], causal=True)]))  # fmt: skip

    portable = [(arch, d, False, det, True) for arch in ("sm_120a", "sm_80") for d, det in (("bwd", False), ("bwd", True), ("fwd", False))]
    assert requests("--arch", "sm_80,sm_120a", "--deterministic") == portable
    native = [("sm_90a", "bwd", False, False, False), ("sm_90a", "fwd", False, False, False), ("sm_90a", "fwd", True, False, False)]
    assert requests() == native
    assert requests("--portable") == sorted(native + [("sm_90a", d, False, False, True) for d in ("bwd", "fwd")])
    # sm_100a: the portable kernels, and its own (experimental) ones without PackGQA.
    blackwell = [("sm_100a", d, False, det, own) for d, det in (("bwd", False), ("bwd", True), ("fwd", False)) for own in (False, True)]
    assert requests("--arch", "sm_100a", "--deterministic") == blackwell
    assert requests("--arch", "sm_100a") == [r for r in blackwell if not r[3]]
