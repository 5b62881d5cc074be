"""Our `imagereward` adapter against the real THUDM `image-reward` package, at full size.

Why: trainer/rewards/models.py rebuilds ImageReward on transformers' BLIP classes and converts
the published ImageReward.pt to them, because the `image-reward` package pins timm==0.6.13,
which clashes with open_clip's timm 1.x in the project venv. The unit tests
(tests/trainer/test_reward_models.py) compare the adapter with equations written in the test,
not with the package. This script compares it with the package itself: BLIP's ViT-L/16 at 224
px + the BERT-base med_config text encoder + the MLP, 447M parameters, random weights (no
weights can be downloaded here), same checkpoint file, same images, same prompts.

Two stages in two environments, since the package cannot import next to the project's timm:

    # 1. the original package, in its own venv (image-reward==1.5, timm 0.6.13, fairscale
    #    0.4.13, transformers 4.36.2, torch/torchvision as the project's), CPU, fp32:
    python3 -m venv /tmp/irvenv
    /tmp/irvenv/bin/pip install setuptools wheel
    /tmp/irvenv/bin/pip install --no-build-isolation image-reward==1.5 transformers==4.36.2 \\
        diffusers==0.30.3 torch==2.14.1 torchvision==0.29.1 pillow==12.3.0
    /tmp/irvenv/bin/python benchmarks/imagereward_reference.py original --out /tmp/irref

    # 2. our adapter, in the project venv, on the directory stage 1 wrote:
    .venv/bin/python benchmarks/imagereward_reference.py compare --dir /tmp/irref

Stage 1 builds `ImageReward.ImageReward(med_config)` with the package's own constructor under a
fixed seed (its init: trunc-normal 0.02 ViT, BERT normal 0.02, the MLP at std 1/769), then
perturbs what that init leaves trivial so a conversion mistake shows: every bias ~ N(0, 0.02),
every LayerNorm weight 1 + N(0, 0.1), and the MLP at std 1/sqrt(fan_in) (at the package's own
1/769 the head's output is ~1e-9 and every score is -mean/std). It saves the state dict as
ImageReward.pt (the published file is a plain state dict of blip.* and mlp.*) with BLIP's
med_config.json and a local 30,522-token bert-base-uncased-style vocab.txt in tokenizer/ (the
layout `expected_files("imagereward")` accepts), reloads it with the package's `ImageReward.load`
(its strict=False load, as users load the real file), and scores seeded images of mixed sizes
with its own `score(prompt, PIL image)` (8 image/prompt pairs) and `inference_rank(prompt,
[8 images])` (one prompt over all 8 images), its own torchvision preprocessing and tokenizer.
`BertTokenizer.from_pretrained('bert-base-uncased')` in BLIP's `init_tokenizer` is redirected to
the local vocabulary (the [DEC]/[ENC] additions stay the package's); the package's top-level
import needs OpenAI's `clip` for its CLIPScore/AestheticScore only, so a stub module stands in.
It also writes what it fed the network (the preprocessed pixels and token ids) so that stage 2
can tell preprocessing from conversion.

Stage 2 loads the same directory through the registry (`REWARD_MODELS_DIR`, then
`compute_rewards(["imagereward"], ...)` on CPU, fp32) and reports the largest absolute and
relative score differences, the score scale, Spearman rank agreement, and the two parts apart:
our pixels against the package's, our token ids against its, and our network on the package's
own pixels and ids (conversion alone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import string
import sys
import time
from pathlib import Path

import numpy as np

SEED = 0
# (height, width): square, landscape, portrait, the model's own size (no resize), odd ratios
SIZES = [(512, 512), (300, 500), (500, 300), (512, 512), (224, 224), (360, 640), (300, 500),
         (768, 512)]
PROMPTS = [
    "a red fox sitting in the snow",
    "an astronaut riding a horse on the moon, digital art",
    "a bowl of fruit on a wooden table",
    "portrait of an old man with a beard, oil painting",
    "a futuristic city at night with neon lights",
    "two cats sleeping on a blue sofa",
    "a lighthouse on a cliff during a storm, dramatic lighting, highly detailed, 4k, "
    "trending on artstation, by greg rutkowski and alphonse mucha, cinematic, volumetric fog",
    "Xylophone-shaped spaceship?!",  # words outside the vocabulary: WordPiece falls to pieces
]
# BLIP's configs/med_config.json (ImageReward ships the same file): BERT-base with
# cross-attention; vocab 30524 = bert-base-uncased's 30522 + [DEC] + [ENC]
MED_CONFIG = {
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
    "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
    "type_vocab_size": 2, "vocab_size": 30524, "encoder_width": 768, "add_cross_attention": True}
BERT_VOCAB_SIZE = 30522


def make_images(seed: int = SEED) -> list[np.ndarray]:
    """Seeded uint8 RGB images of SIZES: a random low-frequency colour field (so the images differ
    in content, not only in noise) plus pixel noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for height, width in SIZES:
        coarse = rng.integers(0, 256, (rng.integers(2, 9), rng.integers(2, 9), 3), dtype=np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR),
                           dtype=np.int16)
        noise = rng.integers(-40, 41, (height, width, 3))
        images.append(np.clip(field + noise, 0, 255).astype(np.uint8))
    return images


def bert_vocab() -> list[str]:
    """A bert-base-uncased-shaped vocab.txt of BERT_VOCAB_SIZE tokens: its special tokens at
    their ids ([PAD] 0, [unused0-98], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103), single
    characters and their ## continuations (every word tokenizes), the prompts' common words
    whole, then fillers; so BLIP's [DEC] and [ENC] land on 30522 and 30523 as with the real one."""
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab += list(chars) + ["##" + c for c in chars]
    words = ["a", "an", "the", "of", "on", "in", "with", "at", "and", "by", "red", "fox", "snow",
             "sitting", "astronaut", "riding", "horse", "moon", "digital", "art", "bowl", "fruit",
             "wooden", "table", "portrait", "old", "man", "beard", "oil", "painting", "city",
             "night", "neon", "lights", "two", "cats", "sleeping", "blue", "sofa", "lighthouse",
             "cliff", "during", "storm", "dramatic", "lighting", "highly", "detailed", "4k",
             "trending", "art", "##station", "futuristic", "ship", "##ship", "space"]
    for word in words:
        if word not in vocab:
            vocab.append(word)
    vocab += [f"filler{i}" for i in range(BERT_VOCAB_SIZE - len(vocab))]
    assert len(vocab) == BERT_VOCAB_SIZE and len(set(vocab)) == len(vocab)
    return vocab


def spearman(a, b) -> float:
    ra = np.argsort(np.argsort(np.asarray(a)))
    rb = np.argsort(np.argsort(np.asarray(b)))
    return float(np.corrcoef(ra, rb)[0, 1])


# ---------------------------------------------------------------------------------------------
# stage 1: the image-reward package


def run_original(out: Path, seed: int) -> None:
    import types

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, and would fail if tried
    # ImageReward/models/{CLIPScore,AestheticScore}.py `import clip` (OpenAI's, not a dependency
    # of the package on PyPI); the reward model does not use it
    sys.modules.setdefault("clip", types.ModuleType("clip"))
    import ImageReward as RM
    import torch
    from ImageReward.models.BLIP import blip
    from PIL import Image
    from transformers import BertTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = out / "tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)
    (tokenizer_dir / "vocab.txt").write_text("\n".join(bert_vocab()) + "\n")
    med_config = out / "med_config.json"
    med_config.write_text(json.dumps(MED_CONFIG, indent=2))

    class LocalBertTokenizer(BertTokenizer):
        """blip.init_tokenizer's BertTokenizer.from_pretrained('bert-base-uncased'), served from
        the local vocabulary; the rest of init_tokenizer ([DEC], [ENC]) runs as written."""

        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):
            assert name == "bert-base-uncased", name
            return BertTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)

    blip.BertTokenizer = LocalBertTokenizer

    torch.manual_seed(seed)
    started = time.time()
    built = RM.ImageReward(med_config=str(med_config), device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in built.named_parameters():
            if name.startswith("mlp.") and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1 and name.endswith("weight"):  # LayerNorms (vit norm*, BERT LayerNorm)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    checkpoint = out / "ImageReward.pt"
    torch.save(built.state_dict(), checkpoint)
    n_params = sum(p.numel() for p in built.parameters())
    del built
    build_s = time.time() - started

    started = time.time()
    # the package's own loader (utils.load): a fresh ImageReward, load_state_dict(strict=False),
    # eval(); a path and a med_config given, it downloads nothing
    model = RM.load(str(checkpoint), device="cpu", med_config=str(med_config))
    load_s = time.time() - started
    # strict=False would hide a key mismatch: check that the reload is the saved file
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = model.state_dict()
    assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in saved)
    del saved

    images = make_images(seed)
    pils = [Image.fromarray(a) for a in images]
    started = time.time()
    with torch.no_grad():
        pair_scores = [float(model.score(prompt, pil)) for prompt, pil in zip(PROMPTS, pils, strict=True)]
        ranking, rank_scores = model.inference_rank(PROMPTS[0], pils)
    score_s = time.time() - started
    # what the network was fed: the package's own preprocess and tokenizer call
    pixels = torch.stack([model.preprocess(pil) for pil in pils]).numpy()
    tokens = model.blip.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35,
                                  return_tensors="pt")

    np.savez(out / "inputs.npz", pixels=pixels, input_ids=tokens.input_ids.numpy(),
             attention_mask=tokens.attention_mask.numpy(),
             **{f"image_{i}": a for i, a in enumerate(images)})

    def version(name):
        from importlib.metadata import version as v
        return v(name)

    result = {
        "seed": seed, "prompts": PROMPTS, "sizes_hw": SIZES, "parameters": n_params,
        "pair_scores": pair_scores, "rank_prompt": PROMPTS[0],
        "rank_scores": [float(s) for s in rank_scores], "ranking": ranking,
        "dtype": "float32", "device": "cpu",
        "seconds": {"build_and_save": round(build_s, 1), "package_load": round(load_s, 1),
                    "score_16": round(score_s, 1)},
        "versions": {n: version(n) for n in ("image-reward", "torch", "torchvision",
                                             "transformers", "timm", "fairscale", "pillow",
                                             "numpy", "tokenizers")},
        "python": platform.python_version(),
    }
    (out / "original_scores.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("pair_scores", "rank_scores", "seconds",
                                             "versions")}, indent=2))


# ---------------------------------------------------------------------------------------------
# stage 2: our adapter, through the registry


def run_compare(directory: Path, out: Path | None) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trainer.rewards import compute_rewards
    from trainer.rewards import models as reward_models

    original = json.loads((directory / "original_scores.json").read_text())
    inputs = np.load(directory / "inputs.npz")
    images = [inputs[f"image_{i}"] for i in range(len(original["prompts"]))]
    prompts = original["prompts"]

    # the registry, as a job scores: a train config's reward_model_paths["imagereward"] is
    # `directory`, checked as a job start checks it (expected_files("imagereward"))
    paths = {"imagereward": str(directory)}
    problem = reward_models.weights_problem("imagereward", paths)
    if problem:
        raise SystemExit(problem)
    reward_models.configure_reward_models(paths, "cpu")

    def ours(images_, prompts_):
        # compute_rewards takes one (N, H, W, 3) array: one call per image size, order kept
        scores = np.empty(len(prompts_))
        for shape in dict.fromkeys(a.shape for a in images_):
            index = [i for i, a in enumerate(images_) if a.shape == shape]
            batch = np.stack([images_[i] for i in index])
            scores[index] = compute_rewards(["imagereward"], batch,
                                            [prompts_[i] for i in index])["imagereward"]
        return scores

    started = time.time()
    pair = ours(images, prompts)
    rank = ours(images, [original["rank_prompt"]] * len(images))
    score_s = time.time() - started

    # the parts apart: preprocessing (pixels), tokenization (ids), conversion (network on the
    # package's own inputs)
    model = reward_models.load_imagereward_model(directory)
    tokenizer = reward_models._imagereward_tokenizer(directory)
    our_pixels = torch.cat([reward_models._openai_clip_pixels(a[None], model.image_size)
                            for a in images])
    ids, mask = reward_models._imagereward_tokens(tokenizer, prompts)
    their_pixels = torch.from_numpy(inputs["pixels"])
    with torch.no_grad():
        on_their_inputs = model.reward(model.features(
            their_pixels, torch.from_numpy(inputs["input_ids"]),
            torch.from_numpy(inputs["attention_mask"]))).double().numpy()

    ref_pair = np.array(original["pair_scores"])
    ref_rank = np.array(original["rank_scores"])
    ref_all, ours_all = np.concatenate([ref_pair, ref_rank]), np.concatenate([pair, rank])
    diff = np.abs(ours_all - ref_all)
    result = {
        "directory": str(directory),
        "n_scores": int(len(ref_all)),
        "original_pair_scores": ref_pair.tolist(), "our_pair_scores": pair.tolist(),
        "original_rank_scores": ref_rank.tolist(), "our_rank_scores": rank.tolist(),
        "score_scale": {"min": float(ref_all.min()), "max": float(ref_all.max()),
                        "std": float(ref_all.std()), "mean_abs": float(np.abs(ref_all).mean())},
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float((diff / np.abs(ref_all)).max()),
        "max_abs_diff_over_score_std": float(diff.max() / ref_all.std()),
        "spearman_pairs": spearman(pair, ref_pair),
        "spearman_rank_prompt": spearman(rank, ref_rank),
        "same_ranking_rank_prompt": bool((np.argsort(-rank) == np.argsort(-ref_rank)).all()),
        "pixels_max_abs_diff": float((our_pixels - their_pixels).abs().max()),
        "token_ids_equal": bool(torch.equal(ids, torch.from_numpy(inputs["input_ids"]))
                                and torch.equal(mask, torch.from_numpy(inputs["attention_mask"]))),
        "network_on_package_inputs_max_abs_diff": float(np.abs(on_their_inputs - ref_pair).max()),
        "seconds_score_16": round(score_s, 1),
        "original_versions": original["versions"],
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "pillow": __import__("PIL").__version__},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    original = sub.add_parser("original", help="the image-reward package (its own venv)")
    original.add_argument("--out", type=Path, required=True, help="directory to write")
    original.add_argument("--seed", type=int, default=SEED)
    compare = sub.add_parser("compare", help="our adapter on what `original` wrote")
    compare.add_argument("--dir", type=Path, required=True)
    compare.add_argument("--out", type=Path, default=None,
                         help="JSON file (default: DIR/comparison.json)")
    args = parser.parse_args(argv)
    if args.stage == "original":
        run_original(args.out, args.seed)
    else:
        run_compare(args.dir, args.out or args.dir / "comparison.json")


if __name__ == "__main__":
    main()
