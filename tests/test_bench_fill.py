"""bench/fill.py: the share of the touched tiles' elements a mask keeps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from maskc.ir import Mask
from maskc.ir.schedule import build_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fill  # noqa: E402


def test_the_kept_share_counts_every_element_of_the_touched_tiles() -> None:
    causal = Mask.from_cu_seqlens([0, 256], causal=True)
    # 256 causal tokens on 128 x 128 tiles: three tiles touched, 256 * 257 / 2 elements kept.
    assert fill.kept_share(causal, build_schedule(causal, 128, 128)) == pytest.approx(256 * 257 / 2 / (3 * 128 * 128))
    full = Mask.from_cu_seqlens([0, 1000])
    assert fill.kept_share(full, build_schedule(full, 128, 128)) == pytest.approx(1000**2 / 1024**2)


def test_the_table_has_every_mask_and_head_dim(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # 4608 tokens: whole backward tiles of 64, 96 and 128 keys.
    monkeypatch.setattr(sys, "argv", ["fill.py", "--seqlens", "4608"])
    fill.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| seqlen | mask | d=64 fwd / bwd |") and "d=192/128 fwd / bwd" in lines[0]
    assert len(lines) == 2 + len(fill.MASKS)
    full = lines[2].split(" | ")
    assert full[:2] == ["| 4608", "full"] and all(cell.endswith("/ 1.000") for cell in full[2:-1])


def test_tiles_per_document_keep_more_of_the_packed_documents(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    shares = {}
    for flags in ([], ["--per-document"]):
        monkeypatch.setattr(sys, "argv", ["fill.py", "--seqlens", "4608", *flags])
        fill.main()
        rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
        shares[bool(flags)] = {row[1]: [float(x) for cell in row[2:] for x in cell.strip(" |").split(" / ")] for row in rows}
    kernels, per_document = shares[False], shares[True]
    # The packed documents' forward q tiles start at each document too: nothing of a neighbour
    # in them. The backward's q blocks already do (forward / backward alternate in a row).
    for mask in ("varlen_full", "varlen_causal", "varlen_block_causal"):
        assert all(p > k for p, k in zip(per_document[mask][::2], kernels[mask][::2])), mask
        assert per_document[mask][1::2] == kernels[mask][1::2], mask
    # One document (full, the window): the same tiles.
    assert per_document["full"] == kernels["full"] and per_document["sliding_window_causal"] == kernels["sliding_window_causal"]
