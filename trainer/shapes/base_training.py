"""Training the shapes base model with plain flow matching on rendered images.

The shipped base (`trainer/shapes/assets/`) came from here: it draws the prompt's shapes and
colour and gets the count right about half the time, leaving RL on the count reward room.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.models.shapes_dit import (
    ShapesDiT,
    ShapesDiTConfig,
    images_to_latents,
    pixels_to_latents,
)
from trainer.shapes.world import all_prompts, render_batch, tokenize


@dataclass
class BaseTrainingConfig:
    # the defaults are the shipped base's recipe (trainer/shapes/assets/train_base_log.jsonl;
    # the shipped weights are this run's step-6000 EMA checkpoint, kept with save_every=1000)
    steps: int = 8000
    batch_size: int = 256
    # 1e-3: at 3e-4 the same recipe drew squares with round corners (shape reward 0.16 for
    # squares against 0.74 here; docs/benchmarks.md, "Shapes base model")
    learning_rate: float = 1e-3
    warmup_steps: int = 200
    seed: int = 0
    log_every: int = 100
    ema_decay: float = 0.999  # samples come from the EMA weights, as is usual for diffusion
    time_sampling: str = "uniform"  # "uniform" or "logit_normal"
    save_every: int = 0  # also keep base-step{N}.safetensors every N steps (0: only the end)
    bf16: bool = False  # bf16 autocast for the forward pass (GPU); weights stay fp32
    # images rendered once before training and drawn from at random for every batch, kept on
    # the training device (0: every batch is rendered afresh). Rendering in the loop and
    # copying each batch to the GPU held a GPU run to 5-15 steps/s; 300,000 images (0.9 GB)
    # render in about 20 s and cover a 4,000-step run at batch 256 less than 4 times.
    pool_size: int = 300_000


def render_pool(size: int, rng: np.random.Generator, device: str | torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` rendered training images, prompts drawn uniformly: (size, 3, 32, 32) uint8
    images and (size, 3) prompt token ids, both on `device`."""
    prompts = all_prompts()
    chosen = rng.integers(0, len(prompts), size)
    texts = [prompts[i] for i in chosen]
    images = torch.from_numpy(render_batch(texts, rng)).permute(0, 3, 1, 2).contiguous()
    return images.to(device), torch.from_numpy(tokenize(texts)).to(device)


def train_base(out: str | Path, config: BaseTrainingConfig, model_config: ShapesDiTConfig | None = None,
               device: str = "cpu", log: Callable[[dict], None] = print) -> Path:
    """Train from scratch; writes out/base.safetensors and out/train_base_log.jsonl. A
    KeyboardInterrupt saves the EMA of the steps done as out/base-step{N}.safetensors (the
    exception's `partial`) before it is raised again."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    model = ShapesDiT(model_config).to(device)
    ema = ShapesDiT(model.config).to(device)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)

    def lr_factor(step: int) -> float:  # linear warmup, then cosine decay to zero
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    prompts = all_prompts()
    pool = render_pool(config.pool_size, rng, device) if config.pool_size else None
    sampler = torch.Generator(device=device).manual_seed(config.seed)
    model_params, ema_params = list(model.parameters()), list(ema.parameters())
    log_path = out / "train_base_log.jsonl"
    start = time.perf_counter()
    with log_path.open("w") as log_file:
        log_file.write(json.dumps({"config": asdict(config), "model": asdict(model.config)}) + "\n")
        running = torch.zeros((), device=device)  # summed on the device: no sync per step
        done = 0  # the steps whose update reached the EMA
        try:
            for step in range(1, config.steps + 1):
                if pool is not None:
                    rows = torch.randint(0, config.pool_size, (config.batch_size,), device=device,
                                         generator=sampler)
                    x0, tokens = pixels_to_latents(pool[0][rows]), pool[1][rows]
                else:
                    texts = [prompts[i] for i in rng.integers(0, len(prompts), config.batch_size)]
                    x0 = images_to_latents(render_batch(texts, rng)).to(device)
                    tokens = model.encode_prompts(texts)
                noise = torch.randn_like(x0)
                if config.time_sampling == "logit_normal":
                    t = torch.sigmoid(torch.randn(x0.shape[0], device=device))
                else:  # uniform: the high-noise steps, where layout and count are decided, get their share
                    t = torch.rand(x0.shape[0], device=device)
                x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                                    enabled=config.bf16):
                    velocity = model(x_t, t, tokens)
                loss = (velocity.float() - (noise - x0)).pow(2).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                with torch.no_grad():
                    torch._foreach_lerp_(ema_params, model_params, 1 - config.ema_decay)
                done = step
                running += loss.detach()
                if step % config.log_every == 0 or step == config.steps:
                    steps_logged = step - (step - 1) // config.log_every * config.log_every
                    record = {"step": step, "loss": running.item() / steps_logged,
                              "seconds": round(time.perf_counter() - start, 1)}
                    running.zero_()
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                    log(record)
                if config.save_every and step % config.save_every == 0 and step != config.steps:
                    ema.save(out / f"base-step{step}.safetensors",
                               extra_metadata={"base_training": json.dumps({**asdict(config), "steps": step})})
        except KeyboardInterrupt as exc:
            # a Ctrl-C kept nothing of hours of training: the EMA so far is saved as the
            # checkpoint of the last step done (usable as a base_checkpoint), and named
            if done:
                partial = out / f"base-step{done}.safetensors"
                ema.save(partial, extra_metadata={"base_training": json.dumps(
                    {**asdict(config), "steps": done, "interrupted": True})})
                exc.partial = partial  # type: ignore[attr-defined]
            raise
    path = out / "base.safetensors"
    ema.save(path, extra_metadata={"base_training": json.dumps(asdict(config))})
    return path
