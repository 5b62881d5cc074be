"""Images per second of each weight-loaded reward at full size (issue 17's GPU check).

Real weights are not needed for speed, only the architectures: each reward's network is built
at its published size with random weights, written into a REWARD_MODELS_DIR in the layout its
adapter loads (trainer/rewards/models.py), and then scored through the registry exactly as a
training job scores (`compute_rewards`), at batch 48 (4 prompts x G = 12) of 512x512 images.

    python benchmarks/reward_models.py                          # every reward, on CUDA
    python benchmarks/reward_models.py --rewards pickscore      # one
    python benchmarks/reward_models.py --tiny --device cpu      # toy sizes (CI)

Architectures: hpsv2 = open_clip ViT-H-14 (HPS v2.1); aesthetic = open_clip ViT-L-14 with
QuickGELU + the LAION MLP; pickscore = transformers CLIP ViT-H/14 (laion/CLIP-ViT-H-14, which
PickScore fine-tunes); clip_score = transformers CLIP ViT-L/14 (openai/clip-vit-large-patch14).
The transformers tokenizers are character-level stand-ins (no vocabulary can be downloaded);
text costs little beside the 224 px image towers.
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.rewards import compute_rewards  # noqa: E402
from trainer.rewards import models as reward_models  # noqa: E402

REWARDS = ("hpsv2", "pickscore", "clip_score", "aesthetic")

# transformers CLIPConfig sizes of the published checkpoints (config.json)
HF_CLIP = {
    "pickscore": dict(  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K
        text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16),
        vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                    num_attention_heads=16, patch_size=14, image_size=224),
        projection_dim=1024, hidden_act="gelu"),
    "clip_score": dict(  # openai/clip-vit-large-patch14
        text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, patch_size=14, image_size=224),
        projection_dim=768, hidden_act="quick_gelu"),
}
TINY_HF_CLIP = dict(text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2),
                    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, patch_size=8, image_size=32),
                    projection_dim=16, hidden_act="gelu")
TINY_OPEN_CLIP = {"embed_dim": 16,
                  "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16,
                                 "patch_size": 8},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32,
                               "heads": 2, "layers": 1}}


def _write_hf_clip(directory: Path, sizes: dict, device: torch.device) -> None:
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(directory / "vocab.json"),
                                           str(directory / "merges.txt"))
    size = sizes["vision"]["image_size"]
    images = transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                             crop_size={"height": size, "width": size})
    transformers.CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    act = {"hidden_act": sizes["hidden_act"]}
    config = transformers.CLIPConfig(
        text_config={**sizes["text"], **act, "vocab_size": len(vocab),
                     "max_position_embeddings": 77, "bos_token_id": 0, "eos_token_id": 1,
                     "pad_token_id": 1},
        vision_config={**sizes["vision"], **act}, projection_dim=sizes["projection_dim"])
    with torch.device(device):  # random init on the card: minutes on a CPU at ViT-H size
        model = transformers.CLIPModel(config)
    model.save_pretrained(directory)


def _write_open_clip(name: str, directory: Path, tiny: bool, device: torch.device) -> None:
    import open_clip
    from open_clip.model import CLIP
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    quick_gelu = name == "aesthetic"
    if tiny:
        cfg = {**TINY_OPEN_CLIP, "quick_gelu": quick_gelu}
        (directory / reward_models.OPEN_CLIP_CONFIG).write_text(json.dumps({"model_cfg": cfg}))
    else:
        cfg = {**open_clip.get_model_config("ViT-H-14" if name == "hpsv2" else "ViT-L-14"),
               "quick_gelu": quick_gelu}
    with torch.device(device):
        model = CLIP(**cfg)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if name == "hpsv2":  # HPS v2.1's layout: a torch checkpoint holding "state_dict"
        torch.save({"state_dict": state}, directory / reward_models.HPS_CHECKPOINT)
    else:
        save_file(state, str(directory / "open_clip_model.safetensors"))
        head = reward_models.AestheticHead(cfg["embed_dim"])
        torch.save(head.state_dict(), directory / reward_models.AESTHETIC_HEAD)


def write_reward(name: str, root: Path, tiny: bool, device: torch.device) -> None:
    """The reward's network, random weights, in the layout its adapter loads."""
    if name in HF_CLIP:
        _write_hf_clip(root / name, TINY_HF_CLIP if tiny else HF_CLIP[name], device)
    else:
        _write_open_clip(name, root / name, tiny, device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, root: Path, args: argparse.Namespace) -> dict:
    """Write, load (timed: a job's cold start) and score `--repeats` batches (timed)."""
    device = torch.device(args.device)
    started = time.perf_counter()
    write_reward(name, root, args.tiny, device)
    written = time.perf_counter() - started
    reward_models.configure_reward_models({}, device)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.batch, args.image_size, args.image_size, 3), np.uint8)
    prompts = [f"a photo of {i % 4} red squares on a table" for i in range(args.batch)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    compute_rewards([name], images[:1], prompts[:1])  # loads the model
    _sync(device)
    load_seconds = time.perf_counter() - started
    compute_rewards([name], images, prompts)  # warm-up at the measured batch
    _sync(device)
    started = time.perf_counter()
    for _ in range(args.repeats):
        scores = compute_rewards([name], images, prompts)[name]
    _sync(device)
    seconds = (time.perf_counter() - started) / args.repeats
    row = {"reward": name, "batch": args.batch, "image_size": args.image_size,
           "seconds_per_batch": seconds, "images_per_second": args.batch / seconds,
           "load_seconds": load_seconds, "write_seconds": written,
           "finite": bool(np.isfinite(scores).all())}
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    reward_models.clear_cache()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rewards", default=",".join(REWARDS), help=f"any of {', '.join(REWARDS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="toy-size networks (CPU smoke run)")
    parser.add_argument("--batch", type=int, default=48, help="images per scored batch")
    parser.add_argument("--image-size", type=int, default=512, help="generated image side")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches, after a warm-up")
    parser.add_argument("--out", help="write the rows as JSON here (after every reward)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    unknown = sorted(set(names) - set(REWARDS))
    if unknown:
        parser.error(f"--rewards: unknown {unknown}; known: {', '.join(REWARDS)}")
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print("| reward | card | batch | images/s | s/batch | load s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[reward_models.ENV_DIR] = tmp  # the adapters find tmp/<reward>/
        for name in names:
            try:
                row = measure(name, Path(tmp), args)
            except Exception as error:  # one reward failing must not lose the others' rows
                row = {"reward": name, "error": f"{type(error).__name__}: {error}"}
            row["card"] = card
            rows.append(row)
            if "error" in row:
                print(f"| {name} | {card} | error: {row['error']} |", flush=True)
            else:
                print(f"| {name} | {card} | {row['batch']} | {row['images_per_second']:.1f} | "
                      f"{row['seconds_per_batch']:.3f} | {row['load_seconds']:.1f} | "
                      f"{row.get('peak_memory_gb', float('nan')):.1f} |", flush=True)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"card": card, "rows": rows}, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
