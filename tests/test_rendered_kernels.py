"""The rendered kernels committed in docs/kernels/ are what the templates render today, so a
template change shows up in review as a diff of kernel code (rendering only: no compiler)."""

from __future__ import annotations

from pathlib import Path

import pytest

from maskc.codegen.render import reference_variants, render

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "docs" / "kernels"
REGENERATE = "python -m maskc.codegen.render docs/kernels"
VARIANTS = reference_variants()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_committed_kernel_is_what_the_templates_render(name: str) -> None:
    path = FOLDER / name
    committed = path.read_text() if path.is_file() else None
    assert committed == render(VARIANTS[name]), f"docs/kernels/{name} is out of date: run {REGENERATE}"


def test_the_folder_holds_those_kernels_and_names_each_with_its_key() -> None:
    assert sorted(p.name for p in FOLDER.glob("*.py")) == sorted(VARIANTS), f"run {REGENERATE} (and remove the others)"
    readme = (FOLDER / "README.md").read_text()
    missing = [f"{name}: {v.key()}" for name, v in VARIANTS.items() if f"`{name}`" not in readme or v.key() not in readme]
    assert not missing, f"docs/kernels/README.md does not name {missing}"
    assert REGENERATE in readme
