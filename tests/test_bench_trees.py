"""bench/trees.py, the A/B of maskc trees: each tree holds its own revision's package and the
kernels that package compiled, and the summary sets the trees' rounds side by side."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import ab  # noqa: E402
import trees  # noqa: E402


def _row(tflops: float | None, mask: str = "full", direction: str = "fwd") -> dict:
    row = {"kind": "kernel", "head_dim": "128", "heads": "64:8", "seqlen": 16384, "mask": mask, "direction": direction}
    return {**row, "tflops": tflops} if tflops is not None else {**row, "error": "failed"}


def test_the_summary_sets_each_case_of_the_trees_side_by_side_with_ratios_to_the_first() -> None:
    rows = {
        "aaaaaaa": [[_row(500.0), _row(400.0, "causal")], [_row(510.0), _row(None, "causal")]],
        "bbbbbbb": [[_row(550.0), _row(380.0, "causal")], [_row(561.0), _row(420.0, "causal")]],
    }
    assert trees.summary(rows) == [
        "d=128 64:8 16k full fwd: aaaaaaa 500 / 510, bbbbbbb 550 / 561 (1.100)",
        "d=128 64:8 16k causal fwd: aaaaaaa 400 / -, bbbbbbb 380 / 420 (1.000)",
    ]


def test_the_arms_run_in_turn_round_after_round_each_in_its_environment(tmp_path: Path) -> None:
    """ab.alternate with a stand-in bench/kernel.py that logs which arm ran it, on what."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "kernel.py").write_text(
        "import json, os, sys\n"
        "a = sys.argv[1:]\n"
        "with open(os.environ['LOG'], 'a') as f:\n"
        "    f.write(json.dumps([os.environ['ARM'], a[a.index('--artifacts') + 1], a[a.index('--out') + 1], a[a.index('--heads') + 1], a[-1]]) + '\\n')\n"
    )
    log = tmp_path / "log"
    arms = [ab.Arm(name, tmp_path / name, {**os.environ, "ARM": name, "LOG": str(log)}) for name in ("base", "new")]
    args = argparse.Namespace(out=tmp_path / "out", rounds=2, head_dims="128", heads="64:1", seqlens="16384", masks="full",
                              backward=True)  # fmt: skip
    out = ab.alternate(arms, args, bench)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [call[0] for call in calls] == ["base", "new", "base", "new"]
    assert calls[2] == ["base", str(tmp_path / "base"), str(out / "base.1"), "64:1", "--backward"]


def test_revisions_resolve_to_commits_and_export_their_whole_tree(tmp_path: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=trees.ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    assert trees.resolve("HEAD") == head
    worktree = trees.resolve(trees.WORKTREE)  # HEAD itself, or a commit of the checkout's changes on top of it
    parent = subprocess.run(["git", "rev-parse", "--short=7", f"{worktree}^"], cwd=trees.ROOT, capture_output=True, text=True)
    assert worktree == head or parent.stdout.strip() == head
    with pytest.raises(ValueError, match="'no-such-rev' names no commit"):
        trees.resolve("no-such-rev")
    source = trees.export(head, tmp_path / "source")
    assert (source / "maskc" / "__init__.py").is_file() and (source / "templates").is_dir()
    assert (source / "examples" / "full.mask").is_file()


def test_a_process_of_a_tree_imports_its_package_and_names_its_commit(tmp_path: Path) -> None:
    tree = tmp_path / "abcdef1"
    (tree / "package" / "maskc").mkdir(parents=True)
    (tree / "package" / "maskc" / "__init__.py").write_text("WHERE = 'the tree'\n")
    probe = "import maskc, os; print(maskc.WHERE, os.environ['MASKC_BENCH_COMMIT'])"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=trees.tree_env(tree), capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stdout.split() == ["the", "tree", "abcdef1"]


@pytest.mark.slow
def test_a_built_tree_holds_its_revisions_package_and_kernels(tmp_path: Path) -> None:
    pytest.importorskip("cutlass")
    [tree] = trees.build(tmp_path, ["HEAD"], "64", "8:1")
    assert tree.name == trees.resolve("HEAD")
    assert (tree / "package" / "maskc" / "templates").is_dir()
    manifest = json.loads((tree / "kernels" / "manifest.json").read_text())
    assert {(v["fields"]["head_dim"], v["fields"]["num_heads_q"], v["fields"]["num_heads_kv"]) for v in manifest["variants"]} == {(64, 8, 1)}
