"""Suite-wide settings (tests marked `gpu` skip cleanly on machines without CUDA; tests that
compile kernels join the `slow` tier) and the compile helper of the codegen tests."""

from __future__ import annotations

import os

import pytest
import torch

# Prepared plans are signed with a key (maskc.runtime.signing); the suite's own, so that no test
# makes a key file in the home directory (the tests of the key file point it elsewhere).
os.environ["MASKC_PLAN_KEY"] = "5eed" * 16


#: Fixtures that compile kernels: every test using one is in the slow tier.
COMPILING_FIXTURES = {"compiled"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if COMPILING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


def compile_variants(tmp_path_factory: pytest.TempPathFactory, folder: str, variants: dict) -> dict:
    """Each named kernel variant compiled into one temporary folder (skips without the CUTLASS DSL),
    each with ptxas's report and none with its wgmma instructions serialised (a product left in
    flight across a branch once made ptxas serialise every one of the forward's: 0.67-0.78 of
    its speed)."""
    pytest.importorskip("cutlass.cute")
    from maskc.codegen.compile import compile_variant

    out = tmp_path_factory.mktemp(folder)
    compiled = {name: compile_variant(v, out) for name, v in variants.items()}
    for name, obj in compiled.items():
        assert obj.ptxas is not None and obj.ptxas.registers > 0, f"{name}: no ptxas report"
        assert obj.ptxas.serialized == "", f"{name}: {obj.ptxas.serialized}"
    return compiled
