"""Mask pictures: the downsampled coverage is exact where no rows are sampled away."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from maskc.ir import AttnSlice, Mask
from maskc.picture import ROWS_PER_CELL, coverage, save_picture


def test_coverage_equals_block_means_of_the_dense_mask() -> None:
    mask = Mask(
        [AttnSlice((0, 40), (0, 60), "causal"), AttnSlice((10, 30), (5, 50), "bi_causal"), AttnSlice((0, 40), (0, 3))],
        40,
        60,
    )
    image = coverage(mask, size=10)
    assert image.shape == (10, 10)
    assert 40 // 10 <= ROWS_PER_CELL  # every row is sampled, so the image is exact
    dense = mask.to_dense().numpy().astype(float)
    expected = dense.reshape(10, 4, 10, 6).mean(axis=(1, 3))
    np.testing.assert_allclose(image, expected)


def test_small_masks_keep_one_cell_per_element_and_png_is_written(tmp_path: Path) -> None:
    mask = Mask.sliding_window([0, 7], left=2)
    np.testing.assert_array_equal(coverage(mask, size=512), mask.to_dense().numpy())
    png = save_picture(mask, tmp_path / "pics" / "w.png", title="window")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_huge_mask_draws_without_dense_memory() -> None:
    n = 1 << 20
    image = coverage(Mask.sliding_window([0, n], left=4096), size=256)
    assert image.shape == (256, 256)
    assert image[100, 100] > 0 and image[200, 10] == 0
