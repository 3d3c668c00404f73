"""What the A/B scripts (`tiles.py`, `trees.py`) share: their `run` options, and the loop that
times every arm in turn with `bench/kernel.py --no-baselines`, round after round (only ratios
within one call compare: measuring.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple


class Arm(NamedTuple):
    """One side of an A/B: its name (its rows' folder), its artifact directory, and the
    environment its processes run in (None: this one's)."""

    name: str
    artifacts: Path
    env: dict[str, str] | None = None


def add_run_command(commands: argparse._SubParsersAction, folders: str, what: str, out: str) -> None:
    """An A/B script's `run` command: the folders `build` wrote (argument `folders`: `what`), its
    scratch folder (default `out`), rounds and cases."""
    parser = commands.add_parser("run", help="time them in turn on this GPU")
    parser.add_argument(folders, type=Path, nargs="+", help=what)
    parser.add_argument("--out", type=Path, default=Path(out), help=f"scratch folder of the rows (default: {out})")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--head-dims", default="128", help="as bench/kernel.py's (default: 128)")
    parser.add_argument("--heads", default="64:8", help="as bench/kernel.py's (default: 64:8)")
    parser.add_argument("--seqlens", default="16384", help="as bench/kernel.py's (default: 16384)")
    parser.add_argument("--masks", default="full,causal,varlen_causal", help="as bench/kernel.py's")
    parser.add_argument("--backward", action="store_true", help="also time the backward")


def alternate(arms: list[Arm], args: argparse.Namespace, bench: Path) -> Path:
    """bench/kernel.py of the folder `bench` on each arm, `args.rounds` times in turn, the cases
    `add_run_command` took; the rows of arm a's round r go to OUT/a.r. Returns OUT."""
    out = args.out.resolve()
    options = ["--head-dims", args.head_dims, "--heads", args.heads, "--seqlens", args.seqlens, "--masks", args.masks]
    for round_ in range(args.rounds):
        for arm in arms:
            subprocess.run([sys.executable, str(bench / "kernel.py"), "--artifacts", str(arm.artifacts), "--no-baselines",
                            "--no-host", "--out", str(out / f"{arm.name}.{round_}"), *options,
                            *(["--backward"] if args.backward else [])], env=arm.env, check=True)  # fmt: skip
    return out
