"""The weight-free JPEG rewards (trainer/rewards/compressibility.py): DDPO's compressibility and
incompressibility, registered by name."""

import io

import numpy as np
import pytest
from PIL import Image

from trainer.rewards import compute_rewards, get_reward, reward_names
from trainer.rewards.compressibility import jpeg_size_kb

NAMES = ["jpeg_compressibility", "jpeg_incompressibility"]


def _flat_and_noise(height: int, width: int) -> np.ndarray:
    flat = np.full((height, width, 3), 128, dtype=np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return np.stack([flat, noise])


def test_both_rewards_are_registered():
    assert set(NAMES) <= set(reward_names())


@pytest.mark.parametrize("size", [(32, 32), (64, 48), (48, 64)])
def test_flat_image_is_more_compressible_than_noise_at_any_size(size):
    images, prompts = _flat_and_noise(*size), ["a flat grey square", "static"]
    scores = compute_rewards(NAMES, images, prompts)
    compressibility, incompressibility = scores["jpeg_compressibility"], scores["jpeg_incompressibility"]
    assert compressibility.shape == incompressibility.shape == (2,)
    assert compressibility[0] > compressibility[1]
    assert incompressibility[1] > incompressibility[0]
    np.testing.assert_array_equal(compressibility, -incompressibility)
    assert (incompressibility > 0).all()


def test_size_is_the_quality_95_jpeg_in_kilobytes():
    images = _flat_and_noise(64, 48)
    buffer = io.BytesIO()
    Image.fromarray(images[1]).save(buffer, format="JPEG", quality=95)
    assert jpeg_size_kb(images)[1] == pytest.approx(len(buffer.getvalue()) / 1000)
    # noise barely compresses: 64 * 48 * 3 bytes raw, its JPEG is within a small factor of that
    assert jpeg_size_kb(images)[1] > 64 * 48 * 3 / 1000 / 4


def test_prompts_do_not_matter_and_the_result_is_deterministic():
    images = _flat_and_noise(32, 32)
    reward = get_reward("jpeg_incompressibility")
    np.testing.assert_array_equal(reward(images, ["a", "b"]), reward(images, ["c", "d"]))
    assert reward(images[:0], []).shape == (0,)
