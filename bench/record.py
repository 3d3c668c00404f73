"""Benchmark rows: JSON lines in bench/results/<kind>.jsonl, one measurement a row.

Every benchmark writes its rows through `Run`, and everything that reads them (bench/report.py,
the tests) goes through `read_results`, so a row always says where, when and how it was
measured: the run it belongs to (shared by every row of one invocation, so maskc and the
baselines of the same run can be set side by side), the date, the device, the commit of the
tree and the command. bench/README.md describes the fields of each kind.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class AnyOf:
    """A field that passes any of `checks`; `what` says what it may be, in errors."""

    checks: tuple[Check, ...]
    what: str


#: A field's type: a Python type (float also takes int), the tuple of the strings it may be, a
#: pattern the whole string matches, or AnyOf those.
Check = type | tuple[str, ...] | re.Pattern[str] | AnyOf
#: A head dim: D where q/k and v agree (every row before asymmetric head dims), else "Dqk/Dv".
HEAD_DIM = AnyOf((int, re.compile(r"\d+/\d+")), "an int or Dqk/Dv like '192/128'")


@dataclass(frozen=True)
class Kind:
    """The fields of one kind of row. `key` says what was measured: a later row with the same
    key, bench and device supersedes an earlier one. `values` are what was measured: all of
    them, or an `error` in their place when the measurement failed. `extra` is optional."""

    key: dict[str, Check]
    values: dict[str, Check]
    extra: dict[str, Check] = field(default_factory=dict)


ATTENTION = {"mask": str, "seqlen": int, "heads": str, "head_dim": HEAD_DIM, "dtype": str}

KINDS: dict[str, Kind] = {
    "kernel": Kind({"impl": str, **ATTENTION, "direction": DIRECTIONS}, {"tflops": float}, {"docs": int, "area": int, "max_err": float}),
    "memory": Kind({"impl": str, **ATTENTION}, {"peak_mib": float}, {"docs": int, "area": int}),
    "dist": Kind(
        {"impl": str, "mask": str, "gpus": int, "tokens_per_gpu": int, "heads": str, "head_dim": int, "dtype": str,
         "direction": DIRECTIONS},
        {"tflops": float},
        {"plan": str, "area": int},
    ),
    "link": Kind({"collective": str, "gpus": int}, {"gbps": float}, {"mbytes": float}),
    "host": Kind({"step": str}, {"ms": float}, {"min_ms": float}),
    "plan": Kind(
        {"mask": str, "gpus": int, "tokens": int, "algorithm": str},
        {"imbalance": float},
        {"chunk": int, "bound": float, "max_over_bound": float, "rows_moved": int, "ring_rows": int,
         "allgather_rows": int, "stages": int, "fused": bool, "model_fwd_ms": float, "model_bwd_ms": float,
         "plan_ms": float, "solve_ms": float},
    ),
    "stages": Kind(
        {"mask": str, "gpus": int, "tokens": int, "chunk": int, "stages": int, "fused": bool},
        {"model_fwd_ms": float, "model_bwd_ms": float},
        {"chosen": bool},
    ),
    "train": Kind(
        {"impl": str, "model": str, "tokens": int, "docs": int, "compiled": bool},
        {"ms": float, "tokens_per_s": float},
        {"peak_mib": float, "loss": float, "loss_diff": float, "hidden_diff": float},
    ),
}

#: What one call of each implementation is, at the start of its host rows' steps (bench/kernel.py).
HOST_IMPLS = {"maskc": "one maskc.attention call", "sdpa_cudnn": "one SDPA cuDNN call", "fa4": "one FA4 flash_attn_func call"}
#: What each host pass times, next in the steps.
HOST_PASSES = {"fwd": "forward", "fwd+bwd": "forward + backward through autograd"}

#: What every row carries, whatever its kind; `versions` and `note` are optional.
COMMON: dict[str, Check] = {"kind": tuple(KINDS), "bench": str, "run": str, "date": str, "device": str, "commit": str, "command": str}
OPTIONAL_COMMON: dict[str, Check] = {"versions": str, "note": str}
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(r"[0-9a-f]{7,40}(\+dirty)?")
#: Distributions whose versions a run records when they are installed.
PACKAGES = ("torch", "numpy", "nvidia-cutlass-dsl", "flash-attn-4", "flash-attn", "transformers")


class RowError(ValueError):
    """A row that is not well formed, or a tree whose commit cannot be told."""


def _check(name: str, value: Any, check: Check) -> str | None:
    if isinstance(check, AnyOf):
        if any(_check(name, value, each) is None for each in check.checks):
            return None
        return f"{name} must be {check.what}, got {value!r}"
    if isinstance(check, tuple):
        return None if value in check else f"{name} must be one of {', '.join(check)}, got {value!r}"
    if isinstance(check, re.Pattern):
        return None if isinstance(value, str) and check.fullmatch(value) else f"{name} must match {check.pattern}, got {value!r}"
    if check is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif check is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, check)
    if not ok:
        return f"{name} must be {check.__name__}, got {value!r}"
    if check is str and not value:
        return f"{name} is empty"
    return None


def validate(row: Any) -> None:
    """Raise RowError naming the first problem of `row`."""
    if not isinstance(row, dict):
        raise RowError(f"a row is a JSON object, got {type(row).__name__}")
    missing = [name for name in COMMON if name not in row]
    if missing:
        raise RowError(f"missing {', '.join(missing)}")
    for name, check in COMMON.items():
        if problem := _check(name, row[name], check):
            raise RowError(problem)
    if not DATE.fullmatch(row["date"]):
        raise RowError(f"date must be YYYY-MM-DD, got {row['date']!r}")
    if not COMMIT.fullmatch(row["commit"]):
        raise RowError(f"commit must be a git sha, with '+dirty' if the tree was modified, got {row['commit']!r}")
    kind = KINDS[row["kind"]]
    missing = [name for name in kind.key if name not in row]
    if "error" not in row:
        missing += [name for name in kind.values if name not in row]
    if missing:
        raise RowError(f"{row['kind']} row missing {', '.join(missing)}")
    allowed = {**COMMON, **OPTIONAL_COMMON, **kind.key, **kind.values, **kind.extra, "error": str}
    unknown = sorted(set(row) - set(allowed))
    if unknown:
        raise RowError(f"{row['kind']} rows have no field {', '.join(unknown)}")
    for name, value in row.items():
        if name not in COMMON and (problem := _check(name, value, allowed[name])):
            raise RowError(problem)
    if "error" in row and any(name in row for name in kind.values):
        raise RowError(f"a row with an error carries no {', '.join(kind.values)}")


def key(row: dict) -> tuple:
    """What a row measured: rows with the same key supersede one another, the later winning."""
    return (row["kind"], row["bench"], row["device"], *(row[name] for name in KINDS[row["kind"]].key))


def tree_commit() -> str:
    """The commit of this tree, with '+dirty' when a tracked file outside bench/results differs
    from it; $MASKC_BENCH_COMMIT where there is no git checkout (a copy of the tree)."""
    if commit := os.environ.get("MASKC_BENCH_COMMIT"):
        if not COMMIT.fullmatch(commit):
            raise RowError(f"MASKC_BENCH_COMMIT must be a git sha, with '+dirty' if the tree was modified, got {commit!r}")
        return commit
    try:
        git = ["git", "-C", str(ROOT)]
        sha = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RowError("this tree is no git checkout: set MASKC_BENCH_COMMIT to its commit (SHA, or SHA+dirty)") from exc
    return sha + ("+dirty" if changed else "")


def installed_versions() -> str:
    """Python and the versions of the PACKAGES installed here."""
    found = [f"Python {sys.version.split()[0]}"]
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def cpu_device() -> str:
    """The device of a run that uses only the CPU: its model, as /proc/cpuinfo names it, and cores."""
    name = "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def _command(launcher: str, argv: Sequence[str]) -> str:
    script = Path(argv[0])
    if script.is_absolute() and script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    return f"{launcher} {shlex.join([str(script), *argv[1:]])}"


@dataclass(frozen=True)
class Run:
    """One benchmark invocation: what its rows share, and where they go (`out` None: nowhere,
    e.g. on every rank but the first of a distributed run, which measures but does not write)."""

    bench: str
    run: str
    date: str
    device: str
    commit: str
    command: str
    versions: str
    out: Path | None

    @classmethod
    def start(
        cls,
        bench: str,
        device: str,
        out: Path | None = RESULTS,
        run: str | None = None,
        launcher: str = "python",
        argv: Sequence[str] | None = None,
        now: datetime | None = None,
    ) -> Run:
        """A new run of `bench` on `device` (or the run `run`, which other invocations joined: the
        runs of a scaling sweep), invoked as `launcher` + `argv` (default: this process's)."""
        now = now or datetime.now(timezone.utc)
        commit = tree_commit()
        return cls(
            bench=bench,
            run=run or f"{now:%Y-%m-%dT%H%M%SZ}-{commit}",
            date=f"{now:%Y-%m-%d}",
            device=device,
            commit=commit,
            command=_command(launcher, sys.argv if argv is None else argv),
            versions=installed_versions(),
            out=out,
        )

    def write(self, kind: str, **fields: Any) -> dict:
        """Validate the row of `kind` with `fields`, append it to OUT/<kind>.jsonl, return it."""
        row = {
            "kind": kind, "bench": self.bench, "run": self.run, "date": self.date, "device": self.device,
            "commit": self.commit, "command": self.command, "versions": self.versions, **fields,
        }
        validate(row)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            with (self.out / f"{kind}.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    def write_measured(self, specs: Sequence[tuple[str, dict]], measure: Callable[[], Sequence[dict]]) -> list[dict]:
        """The rows `specs` ((kind, fields) each) with the values `measure` returns, one dict per
        spec. If it raises, each row carries the error instead: a baseline that cannot run a case
        is recorded, not fatal."""
        try:
            values = list(measure())
        except Exception as exc:  # noqa: BLE001 (a failure of the measured library is a result)
            error = f"{type(exc).__name__}: {str(exc)[:160]}"
            return [self.write(kind, **fields, error=error) for kind, fields in specs]
        return [self.write(kind, **fields, **value) for (kind, fields), value in zip(specs, values, strict=True)]


def read_rows(path: Path) -> list[dict]:
    """The rows of one results file; an error names the file and line of a row that is not well
    formed or not of the file's kind."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            validate(row)
            if row["kind"] != path.stem:
                raise RowError(f"a {row['kind']} row in the {path.stem} file")
        except (json.JSONDecodeError, RowError) as exc:
            raise RowError(f"{path}:{number}: {exc}") from None
        rows.append(row)
    return rows


def read_results(folder: Path = RESULTS) -> list[dict]:
    """Every row under `folder`, kind by kind, in file order; the rows of one run must agree on
    what a run shares."""
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        if path.stem not in KINDS:
            raise RowError(f"{path}: no kind of row is called {path.stem!r} (kinds: {', '.join(KINDS)})")
        rows += read_rows(path)
    shared = ("bench", "date", "device", "commit", "command", "versions", "note")
    first: dict[str, dict] = {}
    for row in rows:
        seen = first.setdefault(row["run"], row)
        differ = [name for name in shared if row.get(name) != seen.get(name)]
        if differ:
            raise RowError(f"{folder}: the rows of run {row['run']} differ in {', '.join(differ)}")
    return rows
