"""The package as it installs: pyproject.toml's package list names every package of the tree
(the wheel's contents are checked file by file in CI, from a built wheel: .ci/wheel), every
public name of the lazily imported `maskc` still loads, the declared dependencies are what the
runtime imports (torch and numpy) and the extras what the rest imports, and every import of an
optional dependency says which pip command installs it when it is missing."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maskc.lazy import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"maskc": ROOT / "maskc", "maskc.runtime": ROOT / "runtime"}


def test_every_package_of_the_tree_is_listed() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    # A package mapped to its own folder (maskc.runtime -> runtime/) is not also one under maskc/.
    assert set(setuptools["packages"]) == found
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


@pytest.mark.slow
def test_every_public_name_and_subpackage_loads_on_first_use() -> None:
    """`import maskc` imports little (tests/test_cli.py checks that --help needs no torch); the
    public names and the subpackages (`maskc.runtime.register_artifact` after a plain `import
    maskc`) load on first use, in a fresh process where nothing imported them before."""
    code = (
        "import maskc\n"
        "assert callable(maskc.runtime.register_artifact) and callable(maskc.dist.make_plan)\n"
        "assert all(getattr(maskc, name) is not None for name in maskc.__all__)\n"
        "assert maskc.ir.Mask is maskc.Mask and maskc.attention is maskc.runtime.attention\n"
        "try:\n"
        "    maskc.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('maskc.no_such_name did not raise')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _name(requirement: str) -> str:
    """The distribution a requirement names, as written ("maskc[compiler,dist]" -> "maskc")."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group()


def test_the_dependencies_are_the_runtime_and_each_extra_its_optional_packages() -> None:
    """torch and numpy only (the runtime: test_the_runtime_needs_only_torch_and_numpy); each extra
    the distributions maskc.lazy.OPTIONAL gives it, so an error naming an extra names one that
    brings the package; `test` every extra."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(map(_name, project["dependencies"])) == ["numpy", "torch"]
    extras = project["optional-dependencies"]
    test = extras.pop("test")
    wanted: dict[str, set[str]] = {}
    for distribution, extra in OPTIONAL.values():
        wanted.setdefault(extra, set()).add(distribution)
    assert {extra: set(map(_name, requirements)) for extra, requirements in extras.items()} == wanted
    assert f"maskc[{','.join(sorted(extras))}]" in test and {"pytest", "hypothesis"} <= set(map(_name, test))


def _unguarded_imports(path: Path) -> list[tuple[int, str]]:
    """The imports of optional packages in `path` outside a `with optional_imports(...)` block
    (and outside `if TYPE_CHECKING:`, which never runs): (line, module)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.With):
            calls = [item.context_expr for item in node.items if isinstance(item.context_expr, ast.Call)]
            guarded = guarded or any(getattr(call.func, "id", None) == "optional_imports" for call in calls)
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        found.extend((node.lineno, n) for n in names if n.partition(".")[0] in OPTIONAL and not guarded)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


#: Imports of optional packages guarded where they are used: maskc.codegen.compile imports
#: maskc.codegen.render (jinja2) inside `optional_imports`, and imports the CUTLASS DSL after
#: `require_dsl()`, which says the same before any work (tests/test_cli.py).
GUARDED_ELSEWHERE = {"maskc/codegen/render.py": "jinja2", "maskc/codegen/compile.py": "cutlass"}


def test_every_import_of_an_optional_package_says_how_to_install_it() -> None:
    """Each runs inside `with optional_imports(...)`, which turns a missing package into a
    MissingExtraError naming its pip command."""
    found = {}
    for folder in SOURCES.values():
        for path in sorted(folder.rglob("*.py")):
            name = str(path.relative_to(ROOT))
            exempt = GUARDED_ELSEWHERE.get(name)
            unguarded = [(line, m) for line, m in _unguarded_imports(path) if m.partition(".")[0] != exempt]
            if unguarded:
                found[name] = unguarded
    assert not found


#: The optional packages imported with a module, and the one line each one's absence gives: (the
#: module that imports it and those between, imported afresh; the package made missing; the line).
MISSING = [
    (("maskc.frontend.parser",), "lark", "the mask language needs lark: pip install 'maskc[compiler]'"),
    (("maskc.codegen.compile", "maskc.codegen.render"), "jinja2", "rendering kernels needs jinja2: pip install 'maskc[compiler]'"),
    (("maskc.dist.stages",), "networkx", "maskc.dist (attention over many GPUs) needs networkx: pip install 'maskc[dist]'"),
    (("maskc.integrations.transformers",), "transformers",
     "maskc.integrations.transformers needs transformers: pip install 'maskc[transformers]'"),
]  # fmt: skip


@pytest.mark.parametrize("modules,package,message", MISSING, ids=[m[1] for m in MISSING])
def test_a_missing_optional_package_names_the_extra_that_installs_it(
    modules: tuple[str, ...], package: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maskc.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, package, None)  # import `package` raises ModuleNotFoundError
    for module in modules:
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingExtraError) as raised:
        importlib.import_module(modules[0])
    assert str(raised.value) == message
    assert raised.value.__suppress_context__  # raised from None: one line, no chain


def test_pictures_and_maskc_compile_without_their_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """matplotlib and tqdm are imported where they are used: a picture, `maskc compile`'s
    progress bar (one line and exit status 2 on the command line)."""
    from maskc import cli, picture
    from maskc.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=re.escape("drawing masks and plans needs matplotlib: pip install 'maskc[pictures]'")):
        picture.subplots()
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert cli.main(["compile", str(ROOT / "examples" / "causal.mask"), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "maskc: error: `maskc compile` needs tqdm: pip install 'maskc[compiler]'\n"


#: Run in a fresh interpreter where no optional package can be found, as on a machine that
#: installed maskc with its dependencies only: torch and numpy.
WITHOUT_EXTRAS = """
import importlib.machinery, sys

HIDDEN = set(sys.argv[2].split(","))


class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)


sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Hidden
assert not HIDDEN & {m.partition(".")[0] for m in sys.modules}
import pickle, numpy, torch

before = {m.partition(".")[0] for m in sys.modules}
import maskc

mask = maskc.Mask.from_position_ids(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3]), causal=True)
q, kv = torch.randn(2, 9, 4, 16, requires_grad=True), torch.randn(2, 9, 2, 16, requires_grad=True)
out, _ = maskc.attention(q, kv, kv, mask, attention_mask=torch.tensor([[1] * 9, [1] * 6 + [0] * 3]))
out.sum().backward()
shipped = pickle.loads(pickle.dumps(maskc.prepare(mask, None)))
assert torch.equal(maskc.attention(q, kv, kv, shipped)[0][0], out[0]) and q.grad is not None
documents = maskc.Mask.from_cu_seqlens(torch.tensor([0, 3, 9]), causal=True)
assert torch.equal(maskc.reference_attention(q[0], kv[0], kv[0], documents)[0], maskc.attention(q[0], kv[0], kv[0], documents)[0])


@maskc.mask
def two_documents(b: maskc.Builder, docs: maskc.SeqLens = (3, 6)) -> None:
    b.seqlen(docs.end)
    b.causal(q=(docs.starts, docs.ends), k=(docs.starts, docs.ends))


assert two_documents.lower().equivalent(documents)
maskc.runtime.register_artifact(sys.argv[1])
assert maskc.runtime.load_artifact(sys.argv[1]).masks["causal"].shape == (4096, 4096)
imported = {m.partition(".")[0] for m in sys.modules} - before - set(sys.stdlib_module_names)
assert imported == {"maskc"}, f"the runtime imported {sorted(imported)}"
for use in ("maskc.frontend.load('mask m(n: int = 2):\\\\n    seqlen(n)\\\\n')", "maskc.dist.make_plan(mask, 2)"):
    try:
        eval(use)
    except maskc.errors.MissingExtraError as exc:
        print(exc)
"""


@pytest.mark.slow
def test_the_runtime_needs_only_torch_and_numpy(tmp_path: Path) -> None:
    """With every optional package missing, `import maskc`, masks from what a data loader gives
    or from `@maskc.mask`, `maskc.attention` on the CPU (forward, backward, a prepared mask) and
    an artifact directory's masks all work and import nothing beyond torch and numpy; the mask
    language and maskc.dist say which extra they need, and so does `maskc compile`, in one line."""
    from maskc import cli

    artifact = tmp_path / "artifact"
    assert cli.main(["compile", str(ROOT / "examples" / "causal.mask"), "-o", str(artifact), "--ir-only"]) == 0
    hidden = ",".join(OPTIONAL)
    result = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, str(artifact), hidden], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "the mask language needs lark: pip install 'maskc[compiler]'",
        "maskc.dist (attention over many GPUs) needs networkx: pip install 'maskc[dist]'",
    ]
    code = "import sys\n" + WITHOUT_EXTRAS.split("import pickle")[0] + "from maskc.cli import main\nsys.exit(main(sys.argv[3:]))\n"
    command = ["compile", str(ROOT / "examples" / "causal.mask"), "-o", str(tmp_path / "out")]
    result = subprocess.run([sys.executable, "-c", code, "", hidden, *command], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "maskc: error: the mask language needs lark: pip install 'maskc[compiler]'\n"
