"""Suite-wide settings (tests marked `gpu` skip cleanly on machines without CUDA) and the
compile helper of the codegen tests."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def compile_variants(tmp_path_factory: pytest.TempPathFactory, folder: str, variants: dict) -> dict:
    """Each named kernel variant compiled into one temporary folder (skips without the CUTLASS DSL)."""
    pytest.importorskip("cutlass.cute")
    from maskc.codegen.compile import compile_variant

    out = tmp_path_factory.mktemp(folder)
    return {name: compile_variant(v, out) for name, v in variants.items()}
