"""A/B of maskc trees: the package and kernels of each revision, timed in turn on one GPU.

    python bench/trees.py build --out ab --rev c746db8 --rev worktree --head-dims 128,192   # any machine
    python bench/trees.py run ab/* --head-dims 128 --rounds 2 --backward                 # the GPU machine

`build` exports each revision (`git archive`; `worktree` is the checkout with the uncommitted
changes of its tracked files: `git add` a new file first), installs its package into
DIR/<sha>/package and compiles its bf16 kernels of the head dims and head counts (--heads,
default 64:8) into DIR/<sha>/kernels with that package, from outside the checkout (a process
started inside a checkout imports the checkout: measuring.md). `run` times every tree in turn
with its own package and kernels (`bench/kernel.py --no-baselines`, from a copy of this
checkout's bench/ outside it), round after round (only ratios within one call compare),
writes the rows under --out (a scratch folder; each row's commit is its tree's) and prints
each case's TFLOP/s per tree and round, with the mean's ratio to the first tree's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from ab import Arm, add_run_command, alternate  # noqa: E402
from record import read_results  # noqa: E402

#: The revision name `build` takes for the checkout with its uncommitted changes.
WORKTREE = "worktree"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The short sha of `rev`; for WORKTREE, of a commit object holding the checkout's tracked
    files as they are (`git stash create`, which touches neither the index nor the files), or
    HEAD's when nothing is changed."""
    if rev == WORKTREE:
        rev = git("stash", "create") or "HEAD"
    try:
        return git("rev-parse", "--short=7", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise ValueError(f"{rev!r} names no commit of {ROOT}") from None


def export(sha: str, dest: Path) -> Path:
    """The tree of commit `sha` written to `dest` (`git archive`, unpacked by tar)."""
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True, capture_output=True).stdout
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def build(out: Path, revs: Sequence[str], head_dims: str, heads: str = "64:8") -> list[Path]:
    """DIR/<sha>/{package, kernels} for each revision."""
    dirs = []
    for rev in revs:
        sha = resolve(rev)
        tree = out.resolve() / sha
        shutil.rmtree(tree, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            source = export(sha, Path(tmp) / "source")
            pip = [sys.executable, "-m", "pip", "--quiet"]
            subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", f"{tmp}/wheel", str(source)], check=True)
            wheel = next(Path(tmp, "wheel").glob("*.whl"))
            subprocess.run([*pip, "install", "--no-deps", "--target", str(tree / "package"), str(wheel)], check=True)
            subprocess.run([sys.executable, "-m", "maskc", "compile", str(source / "examples" / "full.mask"), "-o",
                            str(tree / "kernels"), "--head-dim", head_dims, "--heads", heads, "--dtype", "bf16"],
                           cwd=tmp, env=tree_env(tree), check=True)  # fmt: skip
        dirs.append(tree)
    return dirs


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process that runs `tree`'s package, and names its commit in rows."""
    path = os.pathsep.join(filter(None, [str(tree / "package"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "MASKC_BENCH_COMMIT": tree.name}


def run(trees: list[Path], args: argparse.Namespace) -> None:
    """Each tree's package and kernels timed in turn (`ab.alternate`) from a copy of this
    checkout's bench/ outside it; then the summary."""
    trees = [tree.resolve() for tree in trees]
    with tempfile.TemporaryDirectory() as tmp:
        for folder in ("bench", "examples"):
            shutil.copytree(ROOT / folder, Path(tmp) / folder)
        out = alternate([Arm(t.name, t / "kernels", tree_env(t)) for t in trees], args, Path(tmp) / "bench")
    print("\n".join(summary({t.name: [read_results(out / f"{t.name}.{r}") for r in range(args.rounds)] for t in trees})))


def summary(rows: dict[str, list[list[dict]]]) -> list[str]:
    """A line per (head dim, heads, length, mask, direction): each tree's TFLOP/s round by round, and
    after every tree but the first its mean's ratio to the first's. `rows`: per tree, each
    round's rows (failed measurements show as -)."""
    cells: dict[tuple, dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    for tree, rounds in rows.items():
        for round_rows in rounds:
            for row in round_rows:
                if row["kind"] == "kernel":
                    key = (row["head_dim"], row["heads"], row["seqlen"], row["mask"], row["direction"])
                    cells[key][tree].append(row.get("tflops"))
    lines = []
    first = next(iter(rows))
    for (head_dim, heads, seqlen, mask, direction), by_tree in cells.items():
        parts = []
        for tree in rows:
            values = by_tree.get(tree, [])
            text = " / ".join("-" if v is None else f"{v:.0f}" for v in values)
            measured, base = [v for v in values if v is not None], [v for v in by_tree.get(first, []) if v is not None]
            if tree != first and measured and base:
                text += f" ({sum(measured) / len(measured) / (sum(base) / len(base)):.3f})"
            parts.append(f"{tree} {text}")
        lines.append(f"d={head_dim} {heads} {seqlen // 1024}k {mask} {direction}: " + ", ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="each revision's package and kernels (no GPU needed)")
    b.add_argument("--out", type=Path, required=True, help="folder of the trees")
    b.add_argument("--rev", action="append", required=True, help=f"a git revision, or {WORKTREE}; the first is the base")
    b.add_argument("--head-dims", default="128", help="as maskc compile's --head-dim (default: 128)")
    b.add_argument("--heads", default="64:8", help="as maskc compile's --heads (default: 64:8)")
    add_run_command(sub, "trees", "folders `build` wrote, the base first", "tree_ab")
    args = parser.parse_args()
    if args.command == "build":
        try:
            shas = [resolve(rev) for rev in args.rev]
        except ValueError as e:
            parser.error(str(e))
        for tree in build(args.out, shas, args.head_dims, args.heads):
            print(tree)
    else:
        run(args.trees, args)


if __name__ == "__main__":
    main()
