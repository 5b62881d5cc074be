import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.rewards import compute_rewards, get_reward, register_reward, reward_names
from trainer.rewards.shapes import classify_shape, color_mask, components, count_objects
from trainer.shapes.world import (
    BACKGROUND,
    COLORS,
    ShapesPrompt,
    all_prompts,
    parse_prompt,
    render,
    tokenize,
)


def test_prompts_are_the_48_with_plurals():
    prompts = all_prompts()
    assert len(prompts) == 48 and len(set(prompts)) == 48
    assert "one red circle" in prompts and "three blue squares" in prompts
    assert "four yellow triangles" in prompts and "one green triangles" not in prompts
    assert parse_prompt("Three  Blue Squares") == ShapesPrompt(3, "blue", "square")
    with pytest.raises(ValueError, match="not a shapes prompt"):
        parse_prompt("five red circles")
    assert tokenize(["one red circle", "four yellow triangles"]).shape == (2, 3)


@pytest.mark.parametrize("text", all_prompts())
def test_render_draws_exactly_what_the_prompt_asks(text):
    prompt = parse_prompt(text)
    image, boxes = render(prompt, np.random.default_rng(hash(text) % 1000))
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert len(boxes) == prompt.count
    assert all(6 <= size <= 9 for _, _, size in boxes)
    colors = {tuple(c) for c in image.reshape(-1, 3)}
    assert colors == {BACKGROUND, COLORS[prompt.color]}
    found = components(color_mask(image, prompt.color))
    assert len(found) == prompt.count
    assert all(classify_shape(px) == prompt.shape for px in found)


def test_rewards_score_renders_1_and_penalise_wrong_count_colour_shape():
    rng = np.random.default_rng(0)
    asked = "three red squares"
    right, _ = render(asked, rng)
    two, _ = render("two red squares", rng)
    blue, _ = render("three blue squares", rng)
    circles, _ = render("three red circles", rng)
    images = np.stack([right, two, blue, circles])
    scores = compute_rewards(["count", "exact_count", "color", "shape", "combined"], images, [asked] * 4)
    np.testing.assert_allclose(scores["count"], [1.0, 0.5, 0.25, 1.0])  # blue: 0 red found -> 1/(1+3)
    np.testing.assert_allclose(scores["exact_count"], [1, 0, 0, 1])
    np.testing.assert_allclose(scores["color"], [1.0, 1.0, 0.0, 1.0])
    np.testing.assert_allclose(scores["shape"], [1.0, 1.0, 0.0, 0.0])
    assert scores["combined"][0] == pytest.approx(1.0)
    assert all(0.0 <= s <= 1.0 for r in scores.values() for s in r)


def test_blank_image_scores_zero_and_specks_are_not_objects():
    blank = np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)
    speck = blank.copy()
    speck[5, 5] = COLORS["red"]
    assert count_objects(speck, "red") == 0
    scores = compute_rewards(["color", "shape", "exact_count"], np.stack([blank, speck]),
                             ["one red circle"] * 2)
    assert scores["color"][0] == 0.0 and scores["shape"][0] == 0.0 and scores["exact_count"][0] == 0.0


# 8 threads, released at once, ask a fresh process's registry for its names; one of them
# (the last) imports trainer.rewards.models directly, as trainer.config does, which must not
# deadlock against the others' loading of the built-ins
_CONCURRENT_FIRST_USE = """
import threading
from trainer.rewards import registry
out, barrier = [], threading.Barrier(8)
def ask(i):
    barrier.wait()
    if i == 7:
        import trainer.rewards.models  # noqa: F401
    out.append(len(registry.reward_names()))
threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sorted(out))
print(len(registry.reward_names()))
"""


@pytest.mark.subprocess
def test_registry_first_use_from_many_threads_sees_every_builtin():
    """Each thread of a fresh process sees the whole registry on its first use: the built-ins
    loaded before any thread reads it (the flag was set before the imports that register them,
    so all but one thread saw none, and a job's valid reward was 'unknown')."""
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _CONCURRENT_FIRST_USE], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[2], check=True,
                             timeout=120).stdout.split("\n")
        total = int(out[1])
        assert total >= 18 and out[0] == str([total] * 8)


def test_registry_plugs_in_by_name():
    assert {"count", "color", "shape", "combined", "exact_count"} <= set(reward_names())
    register_reward("test_constant", lambda images, prompts: np.full(len(prompts), 0.25))
    out = compute_rewards(["test_constant"], np.zeros((3, 32, 32, 3), np.uint8), ["one red circle"] * 3)
    np.testing.assert_allclose(out["test_constant"], 0.25)
    with pytest.raises(KeyError, match="unknown reward"):
        get_reward("no_such_reward")
