"""The run directory's sample grids (trainer/run_dir.py): small shapes canvases are doubled to
stay legible, real-model images (FLUX / SD3 at 512 px) are laid out at their own size."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.run_dir import GRID_UPSCALE_MAX_SIDE, image_grid


def _distinct_images(rows: int, cols: int, side: int) -> np.ndarray:
    """(rows, cols, side, side, 3): every tile a different flat colour, none of them white."""
    values = np.arange(rows * cols, dtype=np.uint8).reshape(rows, cols, 1, 1, 1) * 10
    return np.broadcast_to(values, (rows, cols, side, side, 3)).copy()


@pytest.mark.parametrize(("side", "scale"), [(32, 2), (GRID_UPSCALE_MAX_SIDE, 2),
                                             (GRID_UPSCALE_MAX_SIDE + 16, 1), (512, 1)])
def test_grid_doubles_small_images_only(side, scale):
    images = _distinct_images(2, 3, side)
    grid = image_grid(images)
    assert grid.dtype == np.uint8
    assert grid.shape == (2 * (side + 1) * scale, 3 * (side + 1) * scale, 3)
    # each tile lands where it belongs, at that scale, with white gutters between
    for r in range(2):
        for c in range(3):
            top, left = r * (side + 1) * scale, c * (side + 1) * scale
            tile = grid[top:top + side * scale, left:left + side * scale]
            assert (tile == images[r, c, 0, 0]).all(), (r, c)
            gutter = grid[top + side * scale:top + (side + 1) * scale,
                          left:left + side * scale]
            assert (gutter == 255).all(), (r, c)


def test_an_explicit_scale_is_kept():
    images = _distinct_images(1, 2, 512)
    assert image_grid(images, scale=2).shape == (2 * 513, 2 * 2 * 513, 3)
    assert image_grid(_distinct_images(1, 1, 32), scale=1).shape == (33, 33, 3)
