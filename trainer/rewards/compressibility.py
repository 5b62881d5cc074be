"""Weight-free rewards from JPEG file size, as in DDPO (Black et al., 2023).

- jpeg_compressibility: minus the size in kilobytes of the image saved as a JPEG at quality 95,
  so flat, smooth images score higher.
- jpeg_incompressibility: plus that size, so detailed, noisy images score higher.

They need no model and no prompt, which makes them a quick end-to-end check of a training run
on any image model: the reward moves within a few steps when the method works.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from trainer.rewards.registry import register_builtin_reward

# DDPO's setting: high enough that the size follows the image content, not the quantiser.
JPEG_QUALITY = 95
BYTES_PER_KB = 1000.0  # DDPO divides by 1000, not 1024


def jpeg_size_kb(images: np.ndarray) -> np.ndarray:
    """(N,) size in kilobytes of each (H, W, 3) uint8 image encoded as a quality-95 JPEG."""
    sizes = []
    for image in images:
        buffer = io.BytesIO()
        # (H, W, 3) uint8 is what PIL reads as RGB; another dtype would give another mode
        Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buffer, format="JPEG",
                                                                 quality=JPEG_QUALITY)
        sizes.append(buffer.tell() / BYTES_PER_KB)
    return np.asarray(sizes, dtype=np.float64)


@register_builtin_reward("jpeg_compressibility")
def jpeg_compressibility_reward(images: np.ndarray, prompts: list[str]) -> np.ndarray:
    return -jpeg_size_kb(images)


@register_builtin_reward("jpeg_incompressibility")
def jpeg_incompressibility_reward(images: np.ndarray, prompts: list[str]) -> np.ndarray:
    return jpeg_size_kb(images)
