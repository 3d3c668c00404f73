"""CI: maskc as users install it, checked with the Python of a fresh venv that installed the
built wheel (non-editable, with the compiler and pictures extras), from a directory outside the
checkout:

    python -I .ci/check_wheel.py REPO WHEEL RUNTIME_PYTHON

1. The wheel holds every tracked file of maskc/, runtime/ and templates/ (where the package
   maps them) and the LICENSE, and nothing else.
2. `maskc` is the installed package; `maskc --version` and `python -m maskc --version` work,
   and --help imports neither torch nor the compiler.
3. The README's main job: `maskc show` draws the example mask, and `maskc compile` builds
   kernels for sm_90a, sm_80 (portable) and sm_100a from the wheel's templates, into files
   readable by others (0644 / 0755 under umask 022).
4. In a second venv that installed the wheel with its declared dependencies and no extra
   (RUNTIME_PYTHON), where no package of an extra is installed but jinja2 and networkx (they
   come with torch, and are not imported), `maskc.runtime` registers that artifact directory,
   made read-only, with the runtime library named by $MASKC_CUTE_RUNTIME, and `maskc.attention`
   runs on the CPU: a padded batch of packed documents, forward and backward, and a prepared
   mask. There `maskc compile` stops with one line naming the pip command of the compiler
   extra (exit status 2), and that command would install the compiler beside the maskc there.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO, WHEEL, RUNTIME_PYTHON = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
BIN = Path(sys.executable).parent
FOLDERS = {"maskc/": "maskc/", "runtime/": "maskc/runtime/", "templates/": "maskc/templates/"}
HEAVY = ("torch", "numpy", "lark", "jinja2", "cutlass", "matplotlib")
EXAMPLE = REPO / "examples" / "varlen_block_causal.mask"

# The optional dependencies (maskc.lazy.OPTIONAL) but those that come with torch: jinja2, networkx.
RUNTIME_ONLY = """
import importlib.util, sys
present = [name for name in ("lark", "cutlass", "tqdm", "matplotlib", "transformers") if importlib.util.find_spec(name)]
assert not present, f"the runtime venv has {present}"
import maskc.runtime
keys = maskc.runtime.register_artifact(sys.argv[1])
masks = maskc.runtime.load_artifact(sys.argv[1]).masks
import pickle, torch, maskc
mask = maskc.Mask.from_position_ids(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3]), causal=True)
q, kv = torch.randn(2, 9, 4, 16, requires_grad=True), torch.randn(2, 9, 2, 16, requires_grad=True)
out, _ = maskc.attention(q, kv, kv, mask, attention_mask=torch.tensor([[1] * 9, [1] * 6 + [0] * 3]))
out.sum().backward()
shipped = pickle.loads(pickle.dumps(maskc.prepare(mask, None)))
assert torch.equal(maskc.attention(q, kv, kv, shipped)[0][0], out[0]) and q.grad is not None
imported = sorted({"jinja2", "networkx"} & {m.split(".")[0] for m in sys.modules})
assert not imported, f"the runtime imported {imported}"
print(len(keys), sorted(masks), masks["varlen_block_causal"].shape)
"""


def run(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"wheel check: `{' '.join(args)}` failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result.stdout


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"wheel check failed: {what}")


def contents() -> None:
    tracked = run("git", "-C", str(REPO), "ls-files", *FOLDERS).split()
    expected = {FOLDERS[next(f for f in FOLDERS if name.startswith(f))] + name.split("/", 1)[1] for name in tracked}
    names = zipfile.ZipFile(WHEEL).namelist()
    package = {n for n in names if ".dist-info/" not in n}
    check(not expected - package, f"the wheel lacks {sorted(expected - package)}")
    check(not package - expected, f"the wheel holds files the tree does not track: {sorted(package - expected)}")
    check(any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the wheel carries no LICENSE")
    print(f"wheel check: {WHEEL.name}, {WHEEL.stat().st_size / 1024:.0f} KiB, {len(package)} package files")


def command() -> None:
    import maskc

    check(Path(maskc.__file__).is_relative_to(sys.prefix), f"maskc imported from {maskc.__file__}, not the venv")
    version = f"maskc {maskc.__version__}"
    check(run(str(BIN / "maskc"), "--version").strip() == version, "maskc --version")
    check(run(sys.executable, "-m", "maskc", "--version").strip() == version, "python -m maskc --version")
    start = time.perf_counter()
    run(str(BIN / "maskc"), "--help")
    seconds = time.perf_counter() - start
    code = (
        "import sys\n"
        "from maskc.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    check(result.stderr.strip() == "[]", f"maskc --help imports {result.stderr.strip()}")
    print(f"wheel check: `maskc --help` in {seconds:.2f} s, importing none of {', '.join(HEAVY)}")


def main_job(out: Path) -> None:
    os.umask(0o022)
    run(str(BIN / "maskc"), "show", str(EXAMPLE), "--png-dir", str(Path.cwd() / "pictures"))
    check((Path.cwd() / "pictures" / "varlen_block_causal.png").stat().st_size > 0, "maskc show drew no picture")
    os.environ["MASKC_CACHE"] = str(Path.cwd() / "cache")  # empty: every kernel renders from the wheel's templates
    run(str(BIN / "maskc"), "compile", str(EXAMPLE), "-o", str(out), "--arch", "sm_90a,sm_80,sm_100a", "--heads", "8:8")
    manifest = json.loads((out / "manifest.json").read_text())
    kinds = sorted({(v["fields"]["arch"], v["fields"].get("portable", False)) for v in manifest["variants"]})
    check(kinds == [("sm_100a", False), ("sm_100a", True), ("sm_80", True), ("sm_90a", False)], f"kernel families {kinds}")
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    wrong = {str(p): oct(m) for p, m in modes.items() if m != (0o755 if p.is_dir() else 0o644)}
    check(not wrong, f"artifact files not readable by others: {wrong}")
    print(f"wheel check: drew the mask; compiled {len(manifest['variants'])} kernels for {', '.join(manifest['archs'])}; "
          "modes 0644 / 0755")  # fmt: skip


def runtime_without_compiler(out: Path) -> None:
    from maskc.artifact.toolchain import ENV_LIBRARY, installed_library

    for path in [out, *out.rglob("*")]:
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)
    os.environ[ENV_LIBRARY] = str(installed_library())
    loaded = run(RUNTIME_PYTHON, "-I", "-c", RUNTIME_ONLY, str(out)).strip()
    print(f"wheel check: maskc.runtime with torch and numpy only registered the read-only artifact: {loaded}")
    runtime_bin = Path(RUNTIME_PYTHON).parent
    result = subprocess.run([str(runtime_bin / "maskc"), "compile", str(EXAMPLE), "-o", str(Path.cwd() / "no-compiler")],
                            capture_output=True, text=True)  # fmt: skip
    install = "pip install 'maskc[compiler]'"
    told = (result.returncode, result.stdout, result.stderr)
    check(told == (2, "", f"maskc: error: the mask language needs lark: {install}\n"), f"maskc compile without the compiler: {told}")
    # The command the error names: pip keeps the maskc installed from the wheel and adds the extra.
    report = json.loads(run(str(runtime_bin / "pip"), "install", "--dry-run", "--quiet", "--report", "-", "maskc[compiler]"))
    adds = sorted(item["metadata"]["name"].lower() for item in report["install"])
    check("maskc" not in adds and {"lark", "nvidia-cutlass-dsl", "tqdm"} <= set(adds), f"`{install}` would install {adds}")
    print(f"wheel check: without the compiler, `maskc compile` names `{install}`, which would add {', '.join(adds)}")


if __name__ == "__main__":
    contents()
    command()
    artifact = Path.cwd() / "artifact"
    main_job(artifact)
    runtime_without_compiler(artifact)
