"""examples/train_tiny.py as a CPU smoke test: it trains with the reference attention."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_model_learns_on_cpu_with_the_reference_attention() -> None:
    losses = _example().train("reference", "cpu", steps=40, seqlen=256, seed=0, dtype=torch.float32)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert all(torch.isfinite(torch.tensor(losses)))
    assert last < first - 0.8, (first, last)


def test_batches_pack_documents_exactly() -> None:
    lengths, tokens, positions = _example().batch(300, torch.Generator().manual_seed(1))
    assert sum(lengths) == 300 == tokens.numel() == positions.numel()
    assert positions.max() < max(lengths)
