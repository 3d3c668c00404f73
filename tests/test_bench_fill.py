"""bench/fill.py: the share of the touched tiles' elements a mask keeps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from maskc.artifact.kernel_families import HEAD_DIMS
from maskc.ir import Mask
from maskc.ir.schedule import build_schedule, document_tiles
from maskc.runtime import call_plan

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


def test_plain_forward_tiles_per_document_keep_more_of_the_packed_documents(capsys: pytest.CaptureFixture[str],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """With one query head a K/V head (64:64: no PackGQA) the forward's q tiles start at each
    document, so they keep more of the packed documents than q tiles on the grid would; on
    masks of one document the two are the same tiles."""
    monkeypatch.setattr(sys, "argv", ["fill.py", "--seqlens", "4608", "--heads", "64:64"])
    fill.main()
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    forward = {row[1]: [float(cell.strip(" |").split(" / ")[0]) for cell in row[2:]] for row in rows}
    masks, _ = fill.build_masks(4608)
    for name in ("full", "varlen_full", "varlen_causal", "varlen_block_causal"):
        mask = masks[name]
        for share, head_dim in zip(forward[name], HEAD_DIMS, strict=True):
            t = fill.target(head_dim, (64, 64))
            shape = call_plan.launch_shape_of(t, call_plan.forward_requests(mask, t)[0])
            assert shape.document_rows
            k_blocks = document_tiles(mask, shape.tile_m, shape.tile_n)[1]
            grid = fill.kept_share(mask, build_schedule(mask, shape.tile_m, shape.tile_n, col_starts=k_blocks))
            assert (share > round(grid, 3)) if name != "full" else share == round(grid, 3), (name, head_dim)
