"""One Neighbor GRPO iteration of FLUX.1-dev and SD3.5-medium at full size: seconds per
iteration (split into rollout, scoring, update) and peak GPU memory (issue 16's GPU check).

Real weights are not needed for speed and memory, only the architecture: the transformers and
VAEs are built from the published configs with random bf16 weights, and the prompt embeddings
are random tensors of the real sizes (FLUX: T5 512 x 4096 + pooled CLIP 768; SD3: 333 x 4096 +
pooled 2048) put in the adapter's prompt cache, so the text encoders never run. Everything
else is the production path: the trainer.models adapters, peft LoRA, the Trainer, the
jpeg_compressibility reward (weight-free).

    python benchmarks/real_models.py                      # every case, on CUDA
    python benchmarks/real_models.py --cases flux-lora    # one
    python benchmarks/real_models.py --tiny --device cpu  # the same code at toy size (CI)

Prints one table row per case (and writes them as JSON with --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import PRESETS, TrainConfig  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.models import ModelSpec  # noqa: E402

# diffusers configs of the published checkpoints (transformer/config.json, vae/config.json)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                   pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                   qk_norm="rms_norm")
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
           block_out_channels=(128, 256, 512, 512),
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           use_quant_conv=False, use_post_quant_conv=False)
VAE_FACTORS = {"flux": (0.3611, 0.1159), "sd3": (1.5305, 0.0609)}
# text lengths and widths of the cached embeddings
TEXT = {"flux": dict(tokens=512, width=4096, pooled=768),
        "sd3": dict(tokens=77 + 256, width=4096, pooled=2048)}

TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
TINY_SD3 = dict(sample_size=32, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                pooled_projection_dim=32, out_channels=4)
TINY_VAE = dict(VAE, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
                down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4)
TINY_TEXT = {"flux": dict(tokens=8, width=32, pooled=32), "sd3": dict(tokens=8, width=32, pooled=32)}

# case -> (model, finetune, method, gradient checkpointing, micro-batch of trained predictions)
CASES = {
    "flux-lora": ("flux", "lora", "neighbor", True, 4),
    "sd3-lora": ("sd3", "lora", "neighbor", False, 4),
    "sd3-full": ("sd3", "full", "neighbor", True, 4),
    # the SDE baseline at the same budget (8 Euler-SDE steps, G = 12, K = 4, every member
    # trained): a first look at the cost gap the scale issue measures in full
    "flux-lora-sde": ("flux", "lora", "sde", True, 4),
}


def build_model(model: str, finetune: str, checkpointing: bool, device: torch.device,
                tiny: bool, config: TrainConfig, stage_on_cpu: bool = False):
    """The adapter around a random-weight pipeline whose prompt cache holds random embeddings
    of the real sizes (no text encoders: none would run). `stage_on_cpu`: set up for `device`
    with the transformer built and left in CPU memory, as `load_flow_model(...,
    stage_on_cpu=True)` leaves a sharded run's model."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    from trainer.models.diffusers_flow import FluxFlowModel, SD3FlowModel, _weight_dtype

    spec = ModelSpec.from_config(config)
    spec.gradient_checkpointing = checkpointing
    dtype = _weight_dtype(spec, device)  # what `from_pretrained` would load the files in
    scaling, shift = VAE_FACTORS[model]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: a 12B fp32 copy would not fit
    try:
        with torch.device("cpu" if stage_on_cpu else device):
            vae = AutoencoderKL(**(TINY_VAE if tiny else VAE), scaling_factor=scaling,
                                shift_factor=shift)
            if model == "flux":
                transformer = FluxTransformer2DModel(**(TINY_FLUX if tiny else FLUX_DEV))
                scheduler = FlowMatchEulerDiscreteScheduler(
                    shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                    base_image_seq_len=256, max_image_seq_len=4096)
                pipeline = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=None,
                                        tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                        transformer=transformer)
            else:
                transformer = SD3Transformer2DModel(**(TINY_SD3 if tiny else SD35_MEDIUM))
                scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
                pipeline = StableDiffusion3Pipeline(
                    scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                    text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                    tokenizer_3=None, transformer=transformer)
    finally:
        torch.set_default_dtype(previous)
    cls = FluxFlowModel if model == "flux" else SD3FlowModel
    adapter = cls(pipeline, spec, device, staged=stage_on_cpu)  # the VAE goes to `device` here
    if not stage_on_cpu:
        adapter = adapter.to(device)
    text = (TINY_TEXT if tiny else TEXT)[model]
    for prompt in config.prompts:  # what encode_prompts would have cached
        adapter._prompt_cache[prompt] = {
            "prompt_embeds": torch.randn(text["tokens"], text["width"], dtype=dtype),
            "pooled_prompt_embeds": torch.randn(text["pooled"], dtype=dtype)}
    if model == "flux":
        adapter._shared["txt_ids"] = torch.zeros(text["tokens"], 3, dtype=dtype)
    else:
        adapter._shared["negative_prompt_embeds"] = torch.randn(text["tokens"], text["width"],
                                                                dtype=dtype)
        adapter._shared["negative_pooled_prompt_embeds"] = torch.randn(text["pooled"],
                                                                       dtype=dtype)
    return adapter


def run_case(name: str, args: argparse.Namespace) -> dict:
    model, finetune, method, checkpointing, train_batch = CASES[name]
    device = torch.device(args.device)
    preset = dict(PRESETS["flux-lora" if model == "flux" else "sd3-lora"])
    preset.update(method=method, finetune=finetune, lora_rank=args.lora_rank, device=args.device,
                  model_path="(random weights)", resolution=args.resolution,
                  prompts=[f"prompt {i}" for i in range(4)], train_batch_size=train_batch,
                  rollout_batch_size=args.group_size, group_size=args.group_size,
                  mixed_precision="bf16" if device.type == "cuda" else "no",
                  gradient_checkpointing=checkpointing, iterations=args.iterations + 1,
                  torch_compile=args.compile)  # eager by default: the uncompiled reference
    config = TrainConfig.from_dict(preset)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    adapter = build_model(model, finetune, checkpointing, device, args.tiny, config)
    trainer = Trainer(config, model=adapter)
    params = sum(p.numel() for p in adapter.transformer.parameters())
    trainable = sum(p.numel() for p in trainer.model.trainable_parameters())
    start = time.perf_counter()
    trainer.step()  # warm-up: allocator, cuBLAS handles, autotuning
    warmup = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    metrics = [trainer.step().metrics for _ in range(args.iterations)]

    def median(key: str) -> float:
        return float(torch.tensor([m[key] for m in metrics]).median())

    row = {"case": name, "model": model, "finetune": finetune, "method": method,
           "torch_compile": args.compile, "gradient_checkpointing": checkpointing, "train_batch_size": train_batch,
           "transformer_params": params, "trainable_params": trainable,
           "resolution": args.resolution, "group_size": args.group_size,
           "seconds": median("seconds"), "rollout_seconds": median("rollout_seconds"),
           "score_seconds": median("score_seconds"), "update_seconds": median("update_seconds"),
           "forward_passes": metrics[0]["forward_passes"],
           "backward_passes": metrics[0]["backward_passes"], "warmup_seconds": warmup,
           "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                               if device.type == "cuda" else None)}
    del trainer, adapter
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"any of {', '.join(CASES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="toy-size models (CPU smoke run)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=12)
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=2, help="timed, after one warm-up")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--compile", action="store_true",
                        help="torch_compile: compile the transformer's blocks (the warm-up "
                             "iteration then includes the compilation)")
    parser.add_argument("--attention", default="auto", choices=["auto", "no-cudnn", "flash"],
                        help="SDPA backends: PyTorch's choice, all but cuDNN, or flash only")
    args = parser.parse_args(argv)
    if args.attention != "auto":  # (the adapters turn cuDNN attention off on CUDA anyway)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.attention == "flash":
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device: {card}, torch {torch.__version__}, resolution {args.resolution}, "
          f"G={args.group_size}, LoRA rank {args.lora_rank}, attention {args.attention}",
          flush=True)
    rows = []
    for name in args.cases.split(","):
        try:
            rows.append(run_case(name, args))
        except torch.cuda.OutOfMemoryError as exc:  # report it and go on with the next case
            rows.append({"case": name, "error": f"out of memory: {str(exc)[:200]}"})
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| case | params | trainable | s/iter | rollout | score | update | fwd | bwd | "
          f"peak GiB |  ({card})\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['error'][:60]} |")
            continue
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"| {r['case']} | {r['transformer_params'] / 1e9:.2f}B | "
              f"{r['trainable_params'] / 1e6:.1f}M | {r['seconds']:.2f} | "
              f"{r['rollout_seconds']:.2f} | {r['score_seconds']:.2f} | "
              f"{r['update_seconds']:.2f} | {r['forward_passes']} | {r['backward_passes']} | "
              f"{peak} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": card, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
