"""The model-backed rewards (trainer/rewards/models.py) on tiny random-weight models of each
architecture, built here and saved in the layout each loader expects: open_clip (HPS v2.1's
checkpoint, the aesthetic predictor's CLIP and MLP head) and transformers CLIP (PickScore,
CLIP score). Nothing is downloaded.

open_clip needs a torchvision built for the installed torch; where it does not import (the
CPU torch of `make setup`, see pyproject.toml's rewards extra) its rewards' tests skip and say
why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.rewards import compute_rewards, get_reward, reward_names
from trainer.rewards import models as reward_models
from trainer.rewards.models import (
    AESTHETIC_HEAD,
    HPS_CHECKPOINT,
    OPEN_CLIP_CONFIG,
    AestheticHead,
    RewardWeightsMissing,
    check_reward_models,
    configure_reward_models,
    weights_problem,
)

MODEL_REWARDS = ["aesthetic", "clip_score", "hpsv2", "imagereward", "pickscore"]
OPEN_CLIP_REASON = reward_models._open_clip_unavailable()
needs_open_clip = pytest.mark.skipif(OPEN_CLIP_REASON is not None,
                                     reason=f"open_clip unavailable: {OPEN_CLIP_REASON}")

# a tiny open_clip CLIP: the real text vocabulary (open_clip's SimpleTokenizer, shipped in the
# package, emits ids up to 49407), one layer per tower, 32 px images
TINY_OPEN_CLIP = {"embed_dim": 16,
                  "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16,
                                 "patch_size": 8},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32,
                               "heads": 2, "layers": 1}}


def _tiny_open_clip(quick_gelu: bool):
    from open_clip.model import CLIP

    torch.manual_seed(0)
    cfg = {**TINY_OPEN_CLIP, "quick_gelu": quick_gelu}
    return cfg, CLIP(**cfg).eval()


def save_tiny_hpsv2(directory: Path) -> Path:
    """HPS v2.1's layout: HPS_v2.1_compressed.pt holding {"state_dict": open_clip state dict},
    with open_clip's open_clip_config.json giving the tiny architecture instead of ViT-H-14."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg, model = _tiny_open_clip(quick_gelu=False)
    (directory / OPEN_CLIP_CONFIG).write_text(json.dumps({"model_cfg": cfg}))
    torch.save({"state_dict": model.state_dict()}, directory / HPS_CHECKPOINT)
    return directory


def save_tiny_aesthetic(directory: Path) -> Path:
    """The aesthetic predictor's layout: the CLIP as an open_clip safetensors state dict and
    the MLP head's state dict (torch.save) under its published name."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg, model = _tiny_open_clip(quick_gelu=True)
    (directory / OPEN_CLIP_CONFIG).write_text(json.dumps({"model_cfg": cfg}))
    save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()},
              str(directory / "open_clip_model.safetensors"))
    head = AestheticHead(cfg["embed_dim"])
    for p in head.parameters():  # the default init gives near-constant outputs through 5 layers
        torch.nn.init.normal_(p, std=0.3)
    torch.save(head.state_dict(), directory / AESTHETIC_HEAD)
    return directory


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, tiny_clip_path) -> Path:
    """A REWARD_MODELS_DIR with a tiny model for every reward that can load here."""
    root = tmp_path_factory.mktemp("reward_models")
    for name in ("pickscore", "clip_score"):  # transformers CLIP + CLIPProcessor
        shutil.copytree(tiny_clip_path, root / name)
    if OPEN_CLIP_REASON is None:
        save_tiny_hpsv2(root / "hpsv2")
        save_tiny_aesthetic(root / "aesthetic")
    return root


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch, weights_root):
    monkeypatch.setenv("REWARD_MODELS_DIR", str(weights_root))
    configure_reward_models({}, "cpu")
    yield
    configure_reward_models({}, "cpu")
    reward_models.clear_cache()


def _images(n: int, seed: int = 0, size: tuple[int, int] = (40, 48)) -> np.ndarray:
    # not square and not the models' size: the resize and centre crop run
    return np.random.default_rng(seed).integers(0, 256, (n, *size, 3), dtype=np.uint8)


PROMPTS = ["three red squares", "a blue circle", "two green triangles", "one red circle",
           "four blue squares"]


def test_every_model_reward_is_registered_without_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "empty"))
    assert set(MODEL_REWARDS) <= set(reward_names())


@pytest.mark.parametrize("name", [
    "pickscore", "clip_score",
    pytest.param("hpsv2", marks=needs_open_clip), pytest.param("aesthetic", marks=needs_open_clip)])
def test_scores_are_finite_and_batched_equals_one_by_one(name):
    images = _images(len(PROMPTS))
    batched = get_reward(name)(images, PROMPTS)
    assert batched.shape == (len(PROMPTS),) and batched.dtype == np.float64
    assert np.isfinite(batched).all()
    single = np.concatenate([get_reward(name)(images[i:i + 1], PROMPTS[i:i + 1])
                             for i in range(len(PROMPTS))])
    np.testing.assert_allclose(batched, single, rtol=1e-4, atol=1e-5)
    assert np.ptp(batched) > 0  # the images and prompts differ, so do the scores
    if name == "clip_score":
        assert (batched >= 0).all() and (batched <= 100).all()


def test_pickscore_is_logit_scale_times_clip_score_cosine(tiny_clip_path):
    """The same CLIP under both names: PickScore = exp(logit_scale) cos, CLIPScore =
    100 max(cos, 0); where the cosine is positive they are proportional."""
    images = _images(len(PROMPTS), seed=1)
    scores = compute_rewards(["pickscore", "clip_score"], images, PROMPTS)
    from transformers import CLIPModel

    scale = CLIPModel.from_pretrained(tiny_clip_path).logit_scale.exp().item()
    positive = scores["clip_score"] > 0
    np.testing.assert_allclose(scores["pickscore"][positive] / scale,
                               scores["clip_score"][positive] / 100, rtol=1e-4)


def test_missing_directory_names_reward_setting_and_files(monkeypatch, tmp_path):
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(RewardWeightsMissing) as error:
        get_reward("pickscore")(_images(1), PROMPTS[:1])
    message = str(error.value)
    assert "'pickscore'" in message and "REWARD_MODELS_DIR" in message
    assert str(tmp_path / "nowhere" / "pickscore") in message
    for expected in ("config.json", "model.safetensors", "preprocessor_config.json"):
        assert expected in message
    assert not isinstance(error.value, KeyError)
    # the open_clip rewards name their files too, whether or not open_clip imports here
    assert HPS_CHECKPOINT in weights_problem("hpsv2")
    aesthetic = weights_problem("aesthetic")
    assert AESTHETIC_HEAD in aesthetic and "open_clip_model.safetensors" in aesthetic


def test_incomplete_directory_from_config_names_what_it_lacks(tmp_path, tiny_clip_path):
    partial = tmp_path / "pick"
    partial.mkdir()
    shutil.copy(tiny_clip_path / "config.json", partial / "config.json")
    configure_reward_models({"pickscore": str(partial)}, "cpu")
    with pytest.raises(RewardWeightsMissing) as error:
        get_reward("pickscore")(_images(1), PROMPTS[:1])
    message = str(error.value)
    assert "reward_model_paths['pickscore']" in message and "lacks" in message
    assert "model.safetensors or pytorch_model.bin" in message
    assert error.value.reward == "pickscore"


def test_reward_model_paths_point_a_reward_elsewhere(tmp_path, tiny_clip_path, monkeypatch):
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "empty"))
    assert weights_problem("clip_score") is not None
    configure_reward_models({"clip_score": str(tiny_clip_path)}, "cpu")
    assert weights_problem("clip_score") is None
    assert np.isfinite(get_reward("clip_score")(_images(2), PROMPTS[:2])).all()
    with pytest.raises(ValueError, match="not model-backed"):
        configure_reward_models({"count": str(tmp_path)})


def test_imagereward_is_registered_and_says_what_is_missing():
    problem = weights_problem("imagereward")
    assert "image-reward" in problem and "ImageReward.pt" in problem
    with pytest.raises(RewardWeightsMissing, match="image-reward"):
        get_reward("imagereward")(_images(1), PROMPTS[:1])


def test_config_validates_reward_model_paths():
    from trainer.config import ConfigErrors, TrainConfig

    TrainConfig.from_dict({"reward_model_paths": {"hpsv2": "/weights/hps"}})
    for bad in ({"count": "/x"}, {"hpsv2": ""}, {"hpsv2": 3}):
        with pytest.raises(ConfigErrors) as error:
            TrainConfig.from_dict({"reward_model_paths": bad})
        assert error.value.field == "reward_model_paths"


def test_trainer_init_fails_on_missing_weights(tmp_path, tiny_model):
    from trainer.config import TrainConfig, load_config
    from trainer.loop import Trainer

    config = load_config("tiny", {"device": "cpu", "reward_weights": {"pickscore": 1.0,
                                                                      "count": 1.0},
                                  "reward_model_paths": {"pickscore": str(tmp_path / "none")}})
    assert isinstance(config, TrainConfig)
    with pytest.raises(RewardWeightsMissing, match=r"reward_model_paths\['pickscore'\]"):
        Trainer(config, model=tiny_model)


@pytest.mark.parametrize("name", ["pickscore", pytest.param("hpsv2", marks=needs_open_clip)])
def test_trainer_step_blends_a_model_reward_with_count(name, tiny_model):
    """A step on the shapes model with reward_weights {name: 2, count: 1}: each reward's raw
    mean is logged, and the logged blend is the config's weighting of them."""
    from trainer.config import load_config
    from trainer.loop import Trainer

    weights = {name: 2.0, "count": 1.0}
    config = load_config("tiny", {"device": "cpu", "reward_weights": weights})
    metrics = Trainer(config, model=tiny_model).step().metrics
    assert np.isfinite(metrics[f"reward/{name}"]) and np.isfinite(metrics["reward/count"])
    assert metrics["reward_weights"] == weights
    expected = (2.0 * metrics[f"reward/{name}"] + metrics["reward/count"]) / 3.0
    assert metrics["reward_mean"] == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_group_blend_uses_the_config_weights():
    """Each reward z-scored per group, then weighted (trainer.grpo.blended_group_rewards)."""
    from trainer.grpo import blended_group_rewards, group_advantages

    images = _images(4, seed=2, size=(32, 32))
    prompts = ["three red squares"] * 4
    raw = compute_rewards(["pickscore", "clip_score"], images, prompts)
    blended = blended_group_rewards(raw, {"pickscore": 3.0, "clip_score": 0.5}, (1, 4))
    expected = (3.0 * group_advantages(torch.as_tensor(raw["pickscore"]).view(1, 4))
                + 0.5 * group_advantages(torch.as_tensor(raw["clip_score"]).view(1, 4)))
    torch.testing.assert_close(blended, expected.to(blended.dtype))


def test_check_reward_models_ignores_other_rewards(monkeypatch, tmp_path):
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "none"))
    check_reward_models({"count": 1.0, "jpeg_compressibility": 1.0})
    with pytest.raises(RewardWeightsMissing):
        check_reward_models({"count": 1.0, "clip_score": 1.0})


@needs_open_clip
@pytest.mark.parametrize("shape", [(512, 512, 3), (300, 500, 3), (501, 299, 3), (32, 32, 3)])
def test_aesthetic_preprocessing_is_the_clip_eval_transform(shape):
    """aesthetic's preprocessing equals open_clip.image_transform's eval transform (the same
    Resize + CenterCrop on a PIL image as OpenAI's clip.load preprocess) bit for bit."""
    import open_clip
    from PIL import Image

    image = np.random.default_rng(3).integers(0, 256, shape, dtype=np.uint8)
    reference = open_clip.image_transform(224, is_train=False)(Image.fromarray(image))
    torch.testing.assert_close(reward_models._openai_clip_pixels(image[None], 224)[0], reference,
                               rtol=0, atol=0)


@needs_open_clip
@pytest.mark.parametrize("shape", [(512, 512, 3), (300, 500, 3), (501, 299, 3), (224, 224, 3)])
def test_hpsv2_preprocessing_is_hpsv2s_preprocess_val(shape):
    """hpsv2's batched preprocessing equals HPSv2's preprocess_val (light_augmentation=True:
    ToTensor, ResizeMaxSize(224, fill=0), Normalize), here rebuilt from the torchvision calls
    of hpsv2/src/open_clip/transform.py."""
    import torchvision.transforms.functional as TF
    from PIL import Image
    from torchvision.transforms import InterpolationMode, Normalize, ToTensor

    image = np.random.default_rng(4).integers(0, 256, shape, dtype=np.uint8)
    x = ToTensor()(Image.fromarray(image).convert("RGB"))
    height, width = x.shape[1:]
    scale = 224 / float(max(height, width))
    if scale != 1.0:
        new_size = tuple(round(dim * scale) for dim in (height, width))
        x = TF.resize(x, new_size, InterpolationMode.BICUBIC)
        pad_h, pad_w = 224 - new_size[0], 224 - new_size[1]
        x = TF.pad(x, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2],
                   fill=0)
    reference = Normalize(reward_models.OPENAI_MEAN, reward_models.OPENAI_STD)(x)
    torch.testing.assert_close(reward_models._hpsv2_pixels(image[None], 224)[0], reference,
                               rtol=0, atol=1e-6)


def test_transformers_rewards_preprocess_with_pil_as_the_reference():
    """PickScore's reference used the PIL image processor; transformers picks its torchvision
    one wherever torchvision is installed unless told otherwise."""
    import transformers

    from trainer.rewards.models import _load_hf_clip, reward_model_dir

    _, processor = _load_hf_clip(reward_model_dir("pickscore")[0], torch.device("cpu"))
    name = type(processor.image_processor).__name__
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert name == "CLIPImageProcessorPil"  # 5's plain CLIPImageProcessor is torchvision's
    else:
        assert name == "CLIPImageProcessor"  # 4's slow (PIL) one; "...Fast" is torchvision's
