"""The model-backed rewards (trainer/rewards/models.py) on tiny random-weight models of each
architecture, built here and saved in the layout each loader expects: open_clip (HPS v2.1's
checkpoint, the aesthetic predictor's CLIP and MLP head), transformers CLIP (PickScore,
CLIP score) and ImageReward's own layout (ImageReward.pt with BLIP's original key names,
med_config.json, a BERT vocab.txt). Nothing is downloaded.

ImageReward's adapter is also checked against a forward written here from the equations, on
the original state dict, so a wrong key mapping fails on the numbers, not only on the names.

open_clip needs a torchvision built for the installed torch; `make test` and `make check` install
the pair and set REQUIRE_OPEN_CLIP=1, so there its rewards' tests run (and fail if open_clip does
not import). Run by hand without it, where open_clip does not import, they skip and say why."""

from __future__ import annotations

import json
import os
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
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    OPEN_CLIP_CONFIG,
    AestheticHead,
    RewardWeightsMissing,
    check_reward_models,
    configure_reward_models,
    imagereward_state_dict,
    load_imagereward_model,
    weights_problem,
)

MODEL_REWARDS = ["aesthetic", "clip_score", "hpsv2", "imagereward", "pickscore"]
# a plain environment variable, not a pytest option: the Makefile sets it for both test targets
OPEN_CLIP_REQUIRED = os.environ.get("REQUIRE_OPEN_CLIP") == "1"
# asked only where it may skip: the question imports open_clip (and torchvision, torch._dynamo:
# 8 s), which every test process would pay while collecting, whether it runs these or not
OPEN_CLIP_REASON = None if OPEN_CLIP_REQUIRED else reward_models._open_clip_unavailable()
needs_open_clip = pytest.mark.skipif(OPEN_CLIP_REASON is not None and not OPEN_CLIP_REQUIRED,
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


# a tiny ImageReward: BLIP's ViT with 128 wide tokens (2 heads of 64, BLIP's head width), one
# block, 16 px patches on 32 px images; a one-layer BERT 32 wide; the MLP head on its 32 features
IR_VISION = {"width": 128, "heads": 2, "depth": 1, "patch": 16, "image": 32, "mlp": 512}
IR_MED_CONFIG = {  # BLIP's med_config.json's keys, tiny; encoder_width as BLIP's file has it
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 64, "layer_norm_eps": 1e-12, "max_position_embeddings": 40,
    "model_type": "bert", "num_attention_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0,
    "type_vocab_size": 2, "encoder_width": 768, "add_cross_attention": True}
# a BERT vocabulary (vocab.txt: one token a line, the id is the line number) with PROMPTS' words
IR_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "one", "two", "three", "four",
            "red", "blue", "green", "circle", "square", "triangle", "##s"]


def imagereward_original_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random ImageReward.pt state dict with the original names and shapes (BLIP_Pretrain's
    visual_encoder as vit.py names it, text_encoder as med.py does, vision_proj / text_proj,
    the position_ids buffer; ImageReward.py's mlp), at the tiny sizes above."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.2, mean=0.0):
        return mean + std * torch.randn(*shape, generator=g)

    w, p, m = IR_VISION["width"], IR_VISION["patch"], IR_VISION["mlp"]
    patches = (IR_VISION["image"] // p) ** 2
    v = "blip.visual_encoder."
    sd = {v + "cls_token": normal(1, 1, w), v + "pos_embed": normal(1, patches + 1, w),
          v + "patch_embed.proj.weight": normal(w, 3, p, p, std=0.05),
          v + "patch_embed.proj.bias": normal(w), v + "norm.weight": normal(w, mean=1.0),
          v + "norm.bias": normal(w)}
    for i in range(IR_VISION["depth"]):
        b = f"{v}blocks.{i}."
        sd.update({b + "norm1.weight": normal(w, mean=1.0), b + "norm1.bias": normal(w),
                   b + "attn.qkv.weight": normal(3 * w, w, std=0.1),
                   b + "attn.qkv.bias": normal(3 * w),
                   b + "attn.proj.weight": normal(w, w, std=0.1), b + "attn.proj.bias": normal(w),
                   b + "norm2.weight": normal(w, mean=1.0), b + "norm2.bias": normal(w),
                   b + "mlp.fc1.weight": normal(m, w, std=0.1), b + "mlp.fc1.bias": normal(m),
                   b + "mlp.fc2.weight": normal(w, m, std=0.05), b + "mlp.fc2.bias": normal(w)})
    h, ff = IR_MED_CONFIG["hidden_size"], IR_MED_CONFIG["intermediate_size"]
    vocab = len(IR_VOCAB) + 2  # + BLIP's [DEC] and [ENC]
    t = "blip.text_encoder."
    sd.update({t + "embeddings.word_embeddings.weight": normal(vocab, h, std=1.0),
               t + "embeddings.position_embeddings.weight": normal(
                   IR_MED_CONFIG["max_position_embeddings"], h, std=0.5),
               t + "embeddings.LayerNorm.weight": normal(h, mean=1.0),
               t + "embeddings.LayerNorm.bias": normal(h),
               t + "embeddings.position_ids": torch.arange(
                   IR_MED_CONFIG["max_position_embeddings"]).expand(1, -1)})
    for i in range(IR_MED_CONFIG["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        for attention, kv_width in (("attention", h), ("crossattention", w)):
            a = f"{b}{attention}."
            sd.update({a + "self.query.weight": normal(h, h, std=0.3),
                       a + "self.query.bias": normal(h),
                       a + "self.key.weight": normal(h, kv_width, std=0.3),
                       a + "self.key.bias": normal(h),
                       a + "self.value.weight": normal(h, kv_width, std=0.3),
                       a + "self.value.bias": normal(h),
                       a + "output.dense.weight": normal(h, h, std=0.3),
                       a + "output.dense.bias": normal(h),
                       a + "output.LayerNorm.weight": normal(h, mean=1.0),
                       a + "output.LayerNorm.bias": normal(h)})
        sd.update({b + "intermediate.dense.weight": normal(ff, h, std=0.3),
                   b + "intermediate.dense.bias": normal(ff),
                   b + "output.dense.weight": normal(h, ff, std=0.3),
                   b + "output.dense.bias": normal(h),
                   b + "output.LayerNorm.weight": normal(h, mean=1.0),
                   b + "output.LayerNorm.bias": normal(h)})
    sd.update({"blip.vision_proj.weight": normal(256, w), "blip.vision_proj.bias": normal(256),
               "blip.text_proj.weight": normal(256, h), "blip.text_proj.bias": normal(256)})
    sizes = [h, 1024, 128, 64, 16, 1]
    for index, n_in, n_out in zip((0, 2, 4, 6, 7), sizes[:-1], sizes[1:], strict=True):
        sd[f"mlp.layers.{index}.weight"] = normal(n_out, n_in, std=n_in ** -0.5)
        sd[f"mlp.layers.{index}.bias"] = normal(n_out, std=0.1)
    return sd


def save_tiny_imagereward(directory: Path, tokenizer_dir: bool = False) -> Path:
    """ImageReward's layout: ImageReward.pt (torch.save of the state dict), med_config.json,
    and bert-base-uncased's vocabulary (here a tiny one) as vocab.txt, or in tokenizer/."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(imagereward_original_state_dict(), directory / "ImageReward.pt")
    med = {**IR_MED_CONFIG, "vocab_size": len(IR_VOCAB) + 2}
    (directory / "med_config.json").write_text(json.dumps(med, indent=2))
    vocab_dir = directory / "tokenizer" if tokenizer_dir else directory
    vocab_dir.mkdir(exist_ok=True)
    (vocab_dir / "vocab.txt").write_text("\n".join(IR_VOCAB) + "\n")
    return directory


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, tiny_clip_path) -> Path:
    """A REWARD_MODELS_DIR with a tiny model for every reward that can load here."""
    root = tmp_path_factory.mktemp("reward_models")
    for name in ("pickscore", "clip_score"):  # transformers CLIP + CLIPProcessor
        shutil.copytree(tiny_clip_path, root / name)
    if OPEN_CLIP_REASON is None or OPEN_CLIP_REQUIRED:
        save_tiny_hpsv2(root / "hpsv2")
        save_tiny_aesthetic(root / "aesthetic")
    save_tiny_imagereward(root / "imagereward")
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
    "pickscore", "clip_score", "imagereward",
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
    with pytest.raises(RewardWeightsMissing) as error:
        get_reward("imagereward")(_images(1), PROMPTS[:1])
    message = str(error.value)
    assert "'imagereward'" in message and str(tmp_path / "nowhere" / "imagereward") in message
    for expected in ("ImageReward.pt", "med_config.json", "tokenizer/vocab.txt", "vocab.txt"):
        assert expected in message
    assert "cannot load here" not in message  # transformers is all it needs, and it is here


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


def test_imagereward_directory_without_the_tokenizer_names_it(tmp_path):
    directory = save_tiny_imagereward(tmp_path / "ir")
    (directory / "vocab.txt").unlink()
    configure_reward_models({"imagereward": str(directory)}, "cpu")
    problem = weights_problem("imagereward")
    assert "lacks tokenizer/vocab.txt or tokenizer/tokenizer.json or vocab.txt" in problem


# ---------------------------------------------------------------------------------------------
# imagereward: the key conversion, the tokenizer, and the numbers against the equations

IR_UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


def test_imagereward_conversion_covers_every_original_key():
    """Every key of the original layout is renamed or one of the known unused ones; the result
    loads strictly (no missing, no unexpected key) and keeps every tensor as it is."""
    original = imagereward_original_state_dict()
    converted = imagereward_state_dict(original)
    used = [k for k in original if not k.startswith(IR_UNUSED)]
    assert len(converted) == len(used)
    assert sorted(id(v) for v in converted.values()) == sorted(id(original[k]) for k in used)
    model = load_imagereward_model(reward_models.reward_model_dir("imagereward")[0])
    result = model.load_state_dict(converted, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert set(model.state_dict()) == set(converted)
    # the shapes the mapping implies: the text encoder's cross-attention reads the ViT's width,
    # not med_config.json's encoder_width (BLIP_Pretrain overrides it)
    layer = model.text.encoder.layer[0]
    assert layer.crossattention.self.key.in_features == IR_VISION["width"]
    assert model.image_size == IR_VISION["image"]
    with pytest.raises(ValueError, match="not ImageReward's"):
        imagereward_state_dict({**original, "blip.text_decoder.cls.bias": torch.zeros(1)})


@pytest.mark.parametrize("tokenizer_dir", [False, True])
def test_imagereward_tokenizer_is_blips(tmp_path, tokenizer_dir):
    """bert-base-uncased's tokenizer from vocab.txt (or tokenizer/), lower-casing, [CLS] first
    (ImageReward does not put [ENC] there), padded and truncated to 35, with BLIP's [DEC] and
    [ENC] added after the vocabulary."""
    directory = save_tiny_imagereward(tmp_path / "ir", tokenizer_dir=tokenizer_dir)
    tokenizer = reward_models._imagereward_tokenizer(directory)
    ids = {token: i for i, token in enumerate(IR_VOCAB)}
    assert tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(IR_VOCAB),
                                                                  len(IR_VOCAB) + 1]
    input_ids, mask = reward_models._imagereward_tokens(tokenizer, ["Three RED squares",
                                                                    "blue " * 50])
    assert input_ids.shape == mask.shape == (2, 35)
    first = [ids[t] for t in ("[CLS]", "three", "red", "square", "##s", "[SEP]")]
    assert input_ids[0].tolist() == first + [ids["[PAD]"]] * (35 - len(first))
    assert mask[0].tolist() == [1] * len(first) + [0] * (35 - len(first))
    assert input_ids[1].tolist() == [ids["[CLS]"]] + [ids["blue"]] * 33 + [ids["[SEP]"]]
    assert mask[1].tolist() == [1] * 35


def _tokens_by_hand(prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT uncased WordPiece for prompts of whole vocabulary words and '<word>s', to 35."""
    ids = {token: i for i, token in enumerate(IR_VOCAB)}
    tokens = ["[CLS]"]
    for word in prompt.lower().split():
        tokens += [word] if word in ids else [word[:-1], "##s"]
    tokens.append("[SEP]")
    row = [ids[t] for t in tokens] + [ids["[PAD]"]] * (35 - len(tokens))
    return torch.tensor([row]), (torch.tensor([row]) != ids["[PAD]"]).long()


def _imagereward_by_the_equations(sd: dict[str, torch.Tensor], pixels: torch.Tensor,
                                  input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ImageReward's score from the original state dict, written from the architecture: BLIP's
    ViT (patch conv, [cls] + positions, pre-norm blocks with fused qkv, LayerNorm eps 1e-6),
    BLIP's BERT (word + position embeddings, post-norm layers: self-attention with the padding
    mask, cross-attention to every image token, GELU feed-forward), the first token through the
    linear MLP, standardised."""
    F = torch.nn.functional

    def linear(x, prefix):
        return x @ sd[prefix + ".weight"].T + sd[prefix + ".bias"]

    def norm(x, prefix, eps):
        return F.layer_norm(x, x.shape[-1:], sd[prefix + ".weight"], sd[prefix + ".bias"], eps)

    def attend(q, k, v, heads, bias=None):
        b, n, c = q.shape
        q, k, v = (t.reshape(b, t.shape[1], heads, c // heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (c // heads) ** 0.5
        if bias is not None:
            scores = scores + bias
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)

    v = "blip.visual_encoder."
    x = F.conv2d(pixels, sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"],
                 stride=IR_VISION["patch"]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[v + "cls_token"].expand(len(x), 1, -1), x], 1) + sd[v + "pos_embed"]
    for i in range(IR_VISION["depth"]):
        b = f"{v}blocks.{i}."
        q, k, val = linear(norm(x, b + "norm1", 1e-6), b + "attn.qkv").chunk(3, dim=-1)
        x = x + linear(attend(q, k, val, IR_VISION["heads"]), b + "attn.proj")
        x = x + linear(F.gelu(linear(norm(x, b + "norm2", 1e-6), b + "mlp.fc1")), b + "mlp.fc2")
    image = norm(x, v + "norm", 1e-6)

    t, heads, eps = "blip.text_encoder.", IR_MED_CONFIG["num_attention_heads"], 1e-12
    h = (sd[t + "embeddings.word_embeddings.weight"][input_ids]
         + sd[t + "embeddings.position_embeddings.weight"][: input_ids.shape[1]])
    h = norm(h, t + "embeddings.LayerNorm", eps)
    padding = (1.0 - mask[:, None, None, :].float()) * -10000.0  # med.py's extended mask
    for i in range(IR_MED_CONFIG["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        for attention, source, bias in (("attention", None, padding),
                                        ("crossattention", image, None)):
            a = f"{b}{attention}."
            kv = h if source is None else source
            context = attend(linear(h, a + "self.query"), linear(kv, a + "self.key"),
                             linear(kv, a + "self.value"), heads, bias)
            h = norm(linear(context, a + "output.dense") + h, a + "output.LayerNorm", eps)
        ff = linear(F.gelu(linear(h, b + "intermediate.dense")), b + "output.dense")
        h = norm(ff + h, b + "output.LayerNorm", eps)
    r = h[:, 0]
    for index in (0, 2, 4, 6, 7):
        r = linear(r, f"mlp.layers.{index}")
    return (r.squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


def test_imagereward_matches_the_equations_on_the_original_weights():
    """The adapter's score equals the forward above on ImageReward.pt's own tensors (fp32,
    CPU): a transposed, swapped or misnamed tensor in the conversion changes the numbers."""
    images = _images(len(PROMPTS), seed=5)
    scores = get_reward("imagereward")(images, PROMPTS)
    original = torch.load(reward_models.reward_model_dir("imagereward")[0] / "ImageReward.pt",
                          weights_only=True)
    pixels = reward_models._openai_clip_pixels(images, IR_VISION["image"])
    expected = []
    for i, prompt in enumerate(PROMPTS):
        ids, mask = _tokens_by_hand(prompt)
        with torch.no_grad():
            expected.append(_imagereward_by_the_equations(original, pixels[i:i + 1], ids, mask))
    expected = torch.cat(expected).double().numpy()
    assert np.ptp(expected) > 0.1  # the tiny model tells the inputs apart
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4)


def test_config_validates_reward_model_paths():
    from trainer.config import ConfigErrors, TrainConfig

    TrainConfig.from_dict({"reward_weights": {"hpsv2": 1.0},
                           "reward_model_paths": {"hpsv2": "/weights/hps"}})
    for bad in ({"count": "/x"}, {"hpsv2": ""}, {"hpsv2": 3}):
        with pytest.raises(ConfigErrors) as error:
            TrainConfig.from_dict({"reward_weights": {"hpsv2": 1.0}, "reward_model_paths": bad})
        assert error.value.field == "reward_model_paths"


def test_a_reward_model_path_for_a_reward_the_run_does_not_score_is_refused():
    """reward_model_paths {"pickscore": ...} beside reward_weights {"hpsv2": 1} was taken and
    never read: the run scored hpsv2 from REWARD_MODELS_DIR while the path looked applied."""
    from trainer.config import ConfigErrors, TrainConfig

    with pytest.raises(ConfigErrors) as error:
        TrainConfig.from_dict({"reward_weights": {"hpsv2": 1.0, "count": 1.0},
                               "reward_model_paths": {"pickscore": "/weights/pick"}})
    assert [(e.field, e.message) for e in error.value.errors] == [(
        "reward_model_paths", "'pickscore' is not among reward_weights (hpsv2, count): its "
        "weights would never load; add it to reward_weights or take its path out")]


def test_trainer_init_fails_on_missing_weights(tmp_path, tiny_model):
    from trainer.config import TrainConfig, load_config
    from trainer.loop import Trainer

    config = load_config("tiny", {"device": "cpu", "reward_weights": {"pickscore": 1.0,
                                                                      "count": 1.0},
                                  "reward_model_paths": {"pickscore": str(tmp_path / "none")}})
    assert isinstance(config, TrainConfig)
    with pytest.raises(RewardWeightsMissing, match=r"reward_model_paths\['pickscore'\]"):
        Trainer(config, model=tiny_model)


@pytest.mark.parametrize("name", ["pickscore", "imagereward",
                                  pytest.param("hpsv2", marks=needs_open_clip)])
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


@pytest.mark.parametrize("name", ["pickscore", "imagereward"])
def test_the_preference_model_blends_with_a_model_reward(name, tiny_model):
    """The votes' preference model is one more reward in the paper's blend: a step with
    {preference: 1, <model reward>: 2} logs both raw means and the config's weighting."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.rewards.preference import FitConfig, PreferenceModel

    torch.manual_seed(0)
    weights = {"preference": 1.0, name: 2.0}
    config = load_config("tiny", {"device": "cpu", "reward_weights": weights})
    trainer = Trainer(config, model=tiny_model)
    trainer.set_preference_model(PreferenceModel(FitConfig(ensemble=2)), version=3)
    metrics = trainer.step().metrics
    assert np.isfinite(metrics["reward/preference"]) and np.isfinite(metrics[f"reward/{name}"])
    assert metrics["reward_weights"] == weights and metrics["preference_model_version"] == 3
    expected = (metrics["reward/preference"] + 2.0 * metrics[f"reward/{name}"]) / 3.0
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


def test_the_iterations_advantages_weight_each_reward_as_the_config_says(tiny_model):
    """What training does with reward_weights (trainer.grpo.score_groups): the advantages are
    the group normalisation of the config's weighting of the per-group z-scored rewards, and
    a different weighting gives different advantages (the logged reward_mean alone could not
    tell)."""
    from trainer.config import load_config
    from trainer.grpo import blended_group_rewards, group_advantages, score_groups

    weights = {"count": 3.0, "jpeg_compressibility": 0.5}
    config = load_config("tiny", {"device": "cpu", "reward_weights": weights})
    latents = torch.randn(2, 4, *tiny_model.latent_shape,
                          generator=torch.Generator().manual_seed(1))
    prompts = ["three red squares", "one blue circle"]
    _, raw, advantages = score_groups(tiny_model, latents, prompts, config,
                                      torch.Generator().manual_seed(0))
    assert set(raw) == set(weights)
    flat = {name: r.reshape(-1) for name, r in raw.items()}
    expected = group_advantages(blended_group_rewards(flat, weights, (2, 4)),
                                p=config.quasi_norm_p)
    torch.testing.assert_close(advantages, expected)
    even = group_advantages(blended_group_rewards(flat, dict.fromkeys(weights, 1.0), (2, 4)),
                            p=config.quasi_norm_p)
    assert not torch.allclose(advantages, even, atol=1e-3)


def test_check_reward_models_ignores_other_rewards(monkeypatch, tmp_path):
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "none"))
    check_reward_models({"count": 1.0, "jpeg_compressibility": 1.0})
    with pytest.raises(RewardWeightsMissing):
        check_reward_models({"count": 1.0, "clip_score": 1.0})
    # every missing one at once, not one per attempt
    with pytest.raises(RewardWeightsMissing) as missing:
        check_reward_models({"hpsv2": 1.0, "count": 1.0, "clip_score": 1.0})
    assert missing.value.reward == "hpsv2"
    assert "'hpsv2'" in str(missing.value) and "'clip_score'" in str(missing.value)


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
@pytest.mark.parametrize(("name", "save", "trained_with"), [
    ("aesthetic", save_tiny_aesthetic, True), ("hpsv2", save_tiny_hpsv2, False)])
def test_the_activation_is_the_weights_whatever_a_config_file_says(tmp_path, name, save,
                                                                   trained_with):
    """QuickGELU (OpenAI's CLIP under the aesthetic head) or GELU (HPSv2's ViT-H-14) belongs
    to the weights: a config file beside them that leaves quick_gelu out, or says otherwise,
    scores as the right one does."""
    loader = {"aesthetic": reward_models._load_aesthetic, "hpsv2": reward_models._load_hpsv2}
    directory = save(tmp_path / name)
    images = _images(3, seed=5)
    right = loader[name](directory, torch.device("cpu"))(images, PROMPTS[:3])
    config_file = directory / OPEN_CLIP_CONFIG
    written = json.loads(config_file.read_text())
    assert written["model_cfg"]["quick_gelu"] is trained_with
    for cfg in ({k: v for k, v in written["model_cfg"].items() if k != "quick_gelu"},
                {**written["model_cfg"], "quick_gelu": not trained_with}):
        config_file.write_text(json.dumps({"model_cfg": cfg}))
        again = loader[name](directory, torch.device("cpu"))(images, PROMPTS[:3])
        np.testing.assert_allclose(again, right, rtol=0, atol=1e-6)


@needs_open_clip
@pytest.mark.parametrize("shape", [(512, 512, 3), (300, 500, 3), (501, 299, 3), (224, 224, 3),
                                   (224, 160, 3), (100, 224, 3)])
def test_hpsv2_preprocessing_is_hpsv2s_preprocess_val(shape):
    """hpsv2's batched preprocessing equals HPSv2's preprocess_val (light_augmentation=True:
    ToTensor, ResizeMaxSize(224, fill=0), Normalize), here rebuilt from the torchvision calls
    of hpsv2/src/open_clip/transform.py - except that a non-square image whose longest side
    is already 224 is padded too (the reference leaves it non-square, which its ViT fails on)."""
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
    pad_h, pad_w = 224 - x.shape[1], 224 - x.shape[2]
    x = TF.pad(x, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2],
               fill=0)
    assert x.shape[1:] == (224, 224)
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


@pytest.mark.parametrize("name", [
    "pickscore", "clip_score", "imagereward",
    pytest.param("hpsv2", marks=needs_open_clip), pytest.param("aesthetic", marks=needs_open_clip)])
@pytest.mark.parametrize("size", [(1, 300), (32, 20)])
def test_thin_images_score_finitely(name, size):
    """A 1x300 image rounded its short side to 0 pixels in hpsv2's resize (a 500 on the
    reward server); a 32x20 one, its longest side already the tiny models' 32, was handed
    to the ViT unpadded; every reward scores such images."""
    thin = _images(2, seed=3, size=size)
    assert np.isfinite(get_reward(name)(thin, PROMPTS[:2])).all()


def test_hpsv2_resize_keeps_a_pixel_of_a_thin_image():
    pixels = reward_models._hpsv2_pixels(_images(1, size=(1, 600)), 224)
    assert pixels.shape == (1, 3, 224, 224)
    row = (224 - 1) // 2  # the one row the image becomes (padding: half above, rest below)
    assert not torch.allclose(pixels[0, :, row], pixels[0, :, 0])


@pytest.mark.parametrize("size", [(1, 300), (3, 300), (40, 48)])
def test_transformers_rewards_read_thin_arrays_as_channels_last(size):
    """transformers guesses the channel axis from an array's shape and took a 1- or 3-pixel
    high (H, W, 3) image for channels-first; PIL images carry no such doubt, so the scores
    of the arrays must equal the scores of the same images handed over as PIL."""
    from PIL import Image

    from trainer.rewards.models import _hf_clip_cosine, _load_hf_clip, reward_model_dir

    model, processor = _load_hf_clip(reward_model_dir("clip_score")[0], torch.device("cpu"))

    class FedAsPil:  # the same processor, given PIL images
        def __call__(self, images=None, **kwargs):
            kwargs.pop("input_data_format", None)
            if images is not None:
                images = [Image.fromarray(image) for image in images]
            return processor(images=images, **kwargs) if images is not None \
                else processor(**kwargs)

    images = _images(2, seed=5, size=size)
    torch.testing.assert_close(
        _hf_clip_cosine(model, processor, torch.device("cpu"), images, PROMPTS[:2]),
        _hf_clip_cosine(model, FedAsPil(), torch.device("cpu"), images, PROMPTS[:2]))
