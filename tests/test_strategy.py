"""The forward strategy pass (maskc.ir.strategy) on CPU: PackGQA where it measured faster on an
H200 (heads 64:8 and 8:1, d=128, bf16), the plain kernel where it measured faster; the tall
tile where it measured faster on an H100."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from maskc.artifact.kernel_families import pack_gqa_supported
from maskc.frontend import load
from maskc.ir import AttnSlice, Mask, strategy
from maskc.ir.schedule import build_forward_schedule, build_schedule
from maskc.ir.strategy import estimated_time, select_forward, select_pack_gqa


def _docs(total: int, count: int, seed: int = 0) -> Mask:
    rng = np.random.default_rng(seed)
    cu = np.r_[0, np.sort(rng.choice(np.arange(1, total), count - 1, replace=False)), total]
    return Mask.from_cu_seqlens(cu, causal=True)


def _decode(tq: int, kind: str) -> Mask:
    return Mask([AttnSlice((0, tq), (0, 16384), kind)], tq, 16384)


@pytest.mark.parametrize("hq,hkv,ok", [(64, 8, True), (8, 1, True), (8, 8, False), (12, 4, False), (128, 1, False), (6, 2, False)])
def test_pack_gqa_needs_a_power_of_two_group(hq, hkv, ok):
    assert pack_gqa_supported(hq, hkv) is ok
    if not ok:
        assert not select_pack_gqa(_docs(4096, 500), hq, hkv, 128, 128)


@pytest.mark.parametrize("heads", [(64, 8), (8, 1)])
@pytest.mark.parametrize("count", [2000, 500, 100])
def test_short_documents_choose_pack(heads, count):
    # measured: 2.5x / 1.5x / 1.3x (64:8) and 2.15x / 1.43x / 1.09x (8:1) faster packed
    assert select_pack_gqa(_docs(16384, count), *heads, 128, 128, 132)


@pytest.mark.parametrize("heads", [(64, 8), (8, 1)])
def test_long_causal_masks_choose_pack(heads):
    # measured: 16k causal 1.07x / 1.01x, 8 causal documents 1.10x / 1.04x packed
    assert select_pack_gqa(Mask([AttnSlice((0, 16384), (0, 16384), "causal")], 16384, 16384), *heads, 128, 128, 132)
    assert select_pack_gqa(_docs(16384, 8), *heads, 128, 128, 132)


@pytest.mark.parametrize("heads", [(64, 8), (8, 1)])
@pytest.mark.parametrize("tq", [128, 256, 512, 1024])
def test_full_masks_keep_the_plain_kernel(heads, tq):
    # measured: 16k full 0.96x / 0.91x, decode full Tq=1024 0.94x (64:8) when packed
    assert not select_pack_gqa(Mask([AttnSlice((0, 16384), (0, 16384), "full")], 16384, 16384), *heads, 128, 128, 132)
    assert not select_pack_gqa(_decode(tq, "full"), *heads, 128, 128, 132)


def test_estimate_counts_the_waste_of_tiles_spanning_documents():
    mask = _docs(16384, 2000)
    plain = estimated_time(build_schedule(mask, 128, 128), 64, 132)
    packed = estimated_time(build_schedule(mask, 16, 128), 8, 132)
    assert packed < 0.8 * plain


# ---- The tall forward tile (d=128: 192x128 against 128x128) ---------------------------------

TILES, TALL = (128, 128), (192, 128)


def _window(n: int, window: int) -> Mask:
    """Each query sees the `window` keys up to itself (the shipped example)."""
    example = load(Path(__file__).resolve().parent.parent / "examples" / "sliding_window_causal.mask")
    return example["sliding_window_causal"].lower(n=n, window=window - 1)


@pytest.mark.parametrize("heads", [(64, 8), (8, 8)])
def test_the_tall_tile_takes_masks_of_long_full_items(heads):
    # measured (H100, 16k, 64:8): full +7%, causal +7% with the tall tile
    full = Mask([AttnSlice((0, 16384), (0, 16384), "full")], 16384, 16384)
    assert select_forward(full, *heads, TILES, TALL) == (True, False)
    assert select_forward(Mask([AttnSlice((0, 16384), (0, 16384), "causal")], 16384, 16384), 64, 8, TILES, TALL)[0]


def test_masks_of_many_partial_blocks_keep_the_other_tile():
    # measured (H100, 16k, 64:8): the 1024-key window -5%, short causal documents -1%
    assert select_forward(_window(16384, 1024), 64, 8, TILES, TALL) == (False, True)
    assert select_forward(_docs(16384, 20), 64, 8, TILES, TALL) == (False, True)


def test_masks_of_many_partial_blocks_do_not_build_the_tall_schedule(monkeypatch):
    """The tall tile's schedule is a new mask's host time: built only where it can win."""
    built = []

    def counted(mask, tile_m, tile_n, *args):
        built.append(tile_m)
        return build_forward_schedule(mask, tile_m, tile_n, *args)

    monkeypatch.setattr(strategy, "build_forward_schedule", counted)
    select_forward(_window(16384, 1024), 64, 8, TILES, TALL)
    assert sorted(set(built)) == [16, 128]  # the other tile, plain and packed
    built.clear()
    select_forward(Mask([AttnSlice((0, 16384), (0, 16384), "causal")], 16384, 16384), 64, 8, TILES, TALL)
    assert sorted(set(built)) == [16, 24, 128]  # and the tall tile with the strategy chosen (PackGQA)


def test_without_a_tall_tile_the_choice_is_the_gqa_strategy():
    for mask in (_docs(16384, 500), Mask([AttnSlice((0, 4096), (0, 4096), "full")], 4096, 4096)):
        assert select_forward(mask, 64, 8, TILES, None) == (False, select_pack_gqa(mask, 64, 8, *TILES))


def test_a_fixed_gqa_strategy_is_kept_and_the_chosen_schedule_is_kept_for_the_runtime():
    full = Mask([AttnSlice((0, 16384), (0, 16384), "full")], 16384, 16384)
    assert select_forward(full, 64, 8, TILES, TALL, packs=(True,)) == (True, True)
    assert select_forward(_docs(16384, 500), 64, 8, TILES, TALL, packs=(False,))[1] is False
    mask = Mask([AttnSlice((0, 8192), (0, 8192), "full")], 8192, 8192)
    assert select_forward(mask, 64, 8, TILES, TALL, keep=True) == (True, False)
    kept = [key[2:] for key in mask.memo if isinstance(key, tuple) and key[:2] == ("kept schedule", "forward")]
    assert kept == [(192, 128, False, False)]


def test_tiles_per_document_make_documents_of_full_blocks_take_the_tall_tile():
    """Packed documents on the grid cross q tiles and k blocks, whose partial blocks the tall
    tile pays 1.75 times for; where the kernels' tiles start at each document (`documents`)
    their blocks are full and the tall tile is estimated faster, with one query head a K/V
    head (plain tiles per document) and with eight (PackGQA: k blocks per document)."""
    mask = Mask.from_cu_seqlens(np.cumsum([0, 809, 4096, 4096, 4096, 119, 2008, 322, 359, 479]).tolist())
    assert select_forward(mask, 64, 64, TILES, TALL) == (False, False)
    assert select_forward(mask, 64, 64, TILES, TALL, documents=True) == (True, False)
    assert select_forward(mask, 64, 8, TILES, TALL) == (False, True)
    assert select_forward(mask, 64, 8, TILES, TALL, documents=True) == (True, True)
