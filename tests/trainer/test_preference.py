"""The preference reward model and simulated annotators, on rendered shapes (exact attributes)."""

import numpy as np
import pytest

from trainer.rewards import compute_rewards
from trainer.rewards.attributes import SimulatedAnnotator, attribute_values
from trainer.rewards.preference import (
    FitConfig,
    PreferenceModel,
    PreferencePair,
    fit_preference_model,
)
from trainer.shapes.world import COLORS, all_prompts, parse_prompt, render, shape_mask


def _draw(prompt: str, row: int, col: int, size: int) -> np.ndarray:
    image = np.full((32, 32, 3), 250, dtype=np.uint8)
    p = parse_prompt(prompt)
    image[row:row + size, col:col + size][shape_mask(p.shape, size)] = COLORS[p.color]
    return image


def test_attributes_and_simulated_annotator():
    small, big = _draw("one red square", 10, 10, 6), _draw("one red square", 10, 10, 9)
    top, bottom = _draw("one red square", 0, 10, 6), _draw("one red square", 26, 10, 6)
    sizes = attribute_values("size", np.stack([small, big]), ["one red square"] * 2)
    np.testing.assert_allclose(sizes, [36, 81])
    upper = compute_rewards(["attr_upper"], np.stack([top, bottom]), ["one red square"] * 2)["attr_upper"]
    assert upper[0] > 0.8 and upper[1] < 0.2
    honest = SimulatedAnnotator("larger", flip=0.0)
    assert honest.vote(small, big, "one red square") == "b"
    assert honest.vote(big, small, "one red square") == "a"
    assert SimulatedAnnotator("larger", flip=0.0, tie_band=0.9).vote(small, big, "one red square") == "tie"
    liar = SimulatedAnnotator("upper", flip=1.0)
    assert liar.vote(top, bottom, "one red square") == "b"
    custom = SimulatedAnnotator(lambda image, prompt: -float(image.mean()), flip=0.0)
    assert custom.vote(big, small, "one red square") == "a"  # more red = darker mean
    with pytest.raises(ValueError, match="unknown preference"):
        SimulatedAnnotator("bluer")


def _pairs(n: int, preference: str, flip: float, seed: int) -> list[PreferencePair]:
    rng = np.random.default_rng(seed)
    annotator = SimulatedAnnotator(preference, flip=flip, seed=seed)
    prompts = all_prompts()
    pairs = []
    for _ in range(n):
        prompt = prompts[rng.integers(len(prompts))]
        a, _ = render(prompt, rng)
        b, _ = render(prompt, rng)
        pairs.append(PreferencePair(a, b, prompt, annotator.vote(a, b, prompt)))
    return pairs


@pytest.mark.slow
def test_fit_learns_an_unknown_preference_and_round_trips(tmp_path):
    pairs = _pairs(400, "upper", flip=0.0, seed=0)
    pairs += [PreferencePair(pairs[0].image_a, pairs[0].image_b, pairs[0].prompt, "skip")] * 3
    model = fit_preference_model(pairs, FitConfig(epochs=25))
    report = model.report
    assert report.votes_ignored == {"skip": 3} and report.votes_fitted == 400
    assert report.heldout_pairs == 80 and report.heldout_accuracy > 0.8, report
    fresh = _pairs(200, "upper", flip=0.0, seed=1)
    p = model.prob_a_beats_b(np.stack([q.image_a for q in fresh]), np.stack([q.image_b for q in fresh]),
                             [q.prompt for q in fresh])
    truth = np.array([q.outcome == "a" for q in fresh])
    assert ((p > 0.5) == truth).mean() > 0.8
    path = tmp_path / "pref.safetensors"
    model.save(path)
    loaded = PreferenceModel.load(path)
    images = np.stack([q.image_a for q in fresh[:5]])
    np.testing.assert_allclose(loaded(images, [q.prompt for q in fresh[:5]]),
                               model(images, [q.prompt for q in fresh[:5]]), rtol=1e-5)
    assert loaded.report.heldout_accuracy == report.heldout_accuracy


def test_fit_refuses_too_few_votes():
    pairs = _pairs(3, "larger", flip=0.0, seed=0)
    with pytest.raises(ValueError, match="at least 4 votes"):
        fit_preference_model(pairs + [PreferencePair(pairs[0].image_a, pairs[0].image_b, "one red circle", "both_bad")])
