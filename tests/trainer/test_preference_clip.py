"""The preference model on CLIP features (features="clip"): a frozen transformers CLIP loaded
from a local path, with a small head fitted to the votes. The CLIP here is the tiny one of
tests/conftest.py (random weights, nothing downloaded), so the annotator prefers what its
embedding represents: a fixed direction in the image embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # the clip extra, which `make setup` installs

from trainer.config import TrainConfig
from trainer.loop import Trainer
from trainer.rewards.preference import (
    FitConfig,
    PreferenceModel,
    PreferencePair,
    fit_preference_model,
)
from trainer.shapes.world import all_prompts, render


@torch.no_grad()
def embedding_direction(clip_path: Path, images: np.ndarray) -> np.ndarray:
    """Each image's normalised CLIP image embedding along one fixed random direction."""
    processor = transformers.CLIPProcessor.from_pretrained(clip_path)
    model = transformers.CLIPModel.from_pretrained(clip_path).eval()
    pixels = processor(images=list(images), return_tensors="pt")["pixel_values"]
    features = model.get_image_features(pixel_values=pixels)
    if not torch.is_tensor(features):  # newer transformers return an output object
        features = features.pooler_output
    direction = torch.randn(features.shape[-1], generator=torch.Generator().manual_seed(5))
    return (torch.nn.functional.normalize(features, dim=-1) @ direction).numpy()


def votes(clip_path: Path, n: int, seed: int) -> list[PreferencePair]:
    """Noise-free votes of an annotator who prefers the larger embedding_direction."""
    rng = np.random.default_rng(seed)
    prompts = [all_prompts()[i] for i in rng.integers(len(all_prompts()), size=n)]
    images = np.stack([render(p, rng)[0] for p in prompts for _ in range(2)])
    value = embedding_direction(clip_path, images).reshape(n, 2)
    return [PreferencePair(images[2 * i], images[2 * i + 1], prompts[i],
                           "a" if value[i, 0] > value[i, 1] else "b") for i in range(n)]


def test_clip_head_learns_from_votes_round_trips_and_trains(tiny_clip_path, tmp_path):
    clip_path = tiny_clip_path
    config = FitConfig(features="clip", clip_path=str(clip_path), epochs=20, ensemble=2, seed=0)
    model = fit_preference_model(votes(clip_path, 300, seed=1), config, version=3)
    assert model.report.heldout_pairs == 60 and model.report.heldout_accuracy > 0.7, model.report
    test = votes(clip_path, 150, seed=2)
    p = model.prob_a_beats_b(np.stack([v.image_a for v in test]),
                             np.stack([v.image_b for v in test]), [v.prompt for v in test])
    accuracy = float(((p > 0.5) == np.array([v.outcome == "a" for v in test])).mean())
    assert accuracy > 0.75, accuracy  # chance is 0.5 (random-weight CLIP, unseen images)

    path = tmp_path / "clip-preference.safetensors"
    model.save(path)
    loaded = PreferenceModel.load(path)
    assert loaded.config.features == "clip" and loaded.report.version == 3
    images = np.stack([v.image_a for v in test[:16]])
    np.testing.assert_allclose(loaded.scores(images, [v.prompt for v in test[:16]]),
                               model.scores(images, [v.prompt for v in test[:16]]), atol=1e-5)

    # blended into a training run as the reward "preference", by path
    trainer = Trainer(TrainConfig(iterations=1, prompts_per_iteration=2, group_size=4,
                                  num_anchors=2, num_train_timesteps=2, rollout_steps=4,
                                  device="cpu", preference_model=str(path),
                                  reward_weights={"count": 1.0, "preference": 1.0}))
    metrics = trainer.step().metrics
    assert metrics["preference_model_version"] == 3
    assert np.isfinite(metrics["reward/preference"]), metrics


def test_clip_features_need_an_existing_local_path(tmp_path):
    pairs = [PreferencePair(*(render("one red square", np.random.default_rng(i))[0]
                              for i in range(2)), "one red square", "a")] * 4
    for missing in ("", str(tmp_path / "nowhere")):
        with pytest.raises(FileNotFoundError, match="clip_path"):
            fit_preference_model(pairs, FitConfig(features="clip", clip_path=missing, epochs=1))
