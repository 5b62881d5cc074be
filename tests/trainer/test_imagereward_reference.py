"""benchmarks/imagereward_reference.py's `compare` stage on the tiny ImageReward checkpoint,
without the image-reward package: a stand-in for what its `original` stage writes (scores of
the adapter's own network, one image at a time, and the inputs it was fed) must compare as
equal, the mixed image sizes going through the registry in their order, and a reference that
differs must show as the difference. The real comparison (the package at full size, in its own
venv) is docs/benchmarks.md's."""

from __future__ import annotations

import json

import numpy as np
import torch
from benchmark_scripts import load_benchmark
from test_reward_models import save_tiny_imagereward

from trainer.rewards import models as reward_models


def _write_reference(bench, directory, pair_shift: float = 0.0) -> None:
    images, prompts = bench.make_images(), bench.PROMPTS
    model = reward_models.load_imagereward_model(directory)
    tokenizer = reward_models._imagereward_tokenizer(directory)
    pixels = torch.cat([reward_models._openai_clip_pixels(a[None], model.image_size)
                        for a in images])
    ids, mask = reward_models._imagereward_tokens(tokenizer, prompts)

    def one(i: int, prompt: int) -> float:
        with torch.no_grad():
            return float(model.reward(model.features(pixels[i:i + 1], ids[prompt:prompt + 1],
                                                     mask[prompt:prompt + 1])))

    pair = [one(i, i) for i in range(len(images))]
    pair[3] += pair_shift
    (directory / "original_scores.json").write_text(json.dumps({
        "prompts": prompts, "rank_prompt": prompts[0], "pair_scores": pair,
        "rank_scores": [one(i, 0) for i in range(len(images))], "versions": {}}))
    np.savez(directory / "inputs.npz", pixels=pixels.numpy(), input_ids=ids.numpy(),
             attention_mask=mask.numpy(), **{f"image_{i}": a for i, a in enumerate(images)})


def test_compare_matches_a_reference_of_the_same_network_and_sees_a_different_one(tmp_path):
    bench = load_benchmark("imagereward_reference")
    directory = save_tiny_imagereward(tmp_path / "imagereward", tokenizer_dir=True)
    assert len({a.shape for a in bench.make_images()}) > 1  # one registry call per size
    try:
        _write_reference(bench, directory)
        result = bench.run_compare(directory, tmp_path / "comparison.json")
        assert result["n_scores"] == 2 * len(bench.PROMPTS)
        assert result["score_scale"]["std"] > 0.05  # the tiny network tells the inputs apart
        assert result["max_abs_diff"] < 1e-4 and result["max_rel_diff"] < 1e-4
        assert result["spearman_pairs"] == result["spearman_rank_prompt"] == 1.0
        assert result["pixels_max_abs_diff"] == 0.0 and result["token_ids_equal"]
        assert result["network_on_package_inputs_max_abs_diff"] < 1e-4
        assert json.loads((tmp_path / "comparison.json").read_text()) == result

        _write_reference(bench, directory, pair_shift=0.5)
        shifted = bench.run_compare(directory, None)
        assert abs(shifted["max_abs_diff"] - 0.5) < 1e-4
        assert abs(shifted["network_on_package_inputs_max_abs_diff"] - 0.5) < 1e-4
    finally:
        reward_models.configure_reward_models({}, "cpu")
        reward_models.clear_cache()
