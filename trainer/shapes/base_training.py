"""Training the shapes base model with plain flow matching on rendered images.

Deliberately short: the base model should draw the right colour and shape but miscount
often, so that RL on the count reward has headroom.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.models.shapes_dit import ShapesDiT, ShapesDiTConfig, images_to_latents
from trainer.shapes.world import all_prompts, render_batch


@dataclass
class BaseTrainingConfig:
    steps: int = 3000
    batch_size: int = 256
    learning_rate: float = 3e-4
    warmup_steps: int = 200
    seed: int = 0
    log_every: int = 100
    ema_decay: float = 0.999  # samples come from the EMA weights, as is usual for diffusion
    time_sampling: str = "uniform"  # "uniform" or "logit_normal"
    save_every: int = 0  # also keep base-step{N}.safetensors every N steps (0: only the end)
    bf16: bool = False  # bf16 autocast for the forward pass (GPU); weights stay fp32
    # processes rendering training batches in the background (0: rendered in the loop). On a
    # GPU the renderer, not the model, is the bottleneck: about 5 steps/s from one process.
    render_processes: int = 0


class _RenderedBatches(torch.utils.data.IterableDataset):
    """Endless (prompts, images) batches, each rendering process with its own random stream."""

    def __init__(self, batch_size: int, seed: int) -> None:
        self.batch_size, self.seed = batch_size, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = np.random.default_rng([self.seed, info.id if info else 0])
        prompts = all_prompts()
        while True:
            texts = [prompts[i] for i in rng.integers(0, len(prompts), self.batch_size)]
            yield texts, render_batch(texts, rng)


def train_base(out: str | Path, config: BaseTrainingConfig, model_config: ShapesDiTConfig | None = None,
               device: str = "cpu", log=print) -> Path:
    """Train from scratch; writes out/base.safetensors and out/train_base_log.jsonl."""
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
    batches = None
    if config.render_processes:
        batches = iter(torch.utils.data.DataLoader(
            _RenderedBatches(config.batch_size, config.seed), batch_size=None,
            num_workers=config.render_processes, prefetch_factor=4))
    log_path = out / "train_base_log.jsonl"
    start = time.perf_counter()
    with log_path.open("w") as log_file:
        log_file.write(json.dumps({"config": asdict(config), "model": asdict(model.config)}) + "\n")
        running = 0.0
        for step in range(1, config.steps + 1):
            if batches is not None:
                texts, rendered = next(batches)
                rendered = np.asarray(rendered)
            else:
                texts = [prompts[i] for i in rng.integers(0, len(prompts), config.batch_size)]
                rendered = render_batch(texts, rng)
            x0 = images_to_latents(rendered).to(device)
            noise = torch.randn_like(x0)
            if config.time_sampling == "logit_normal":
                t = torch.sigmoid(torch.randn(x0.shape[0], device=device))
            else:  # uniform: the high-noise steps, where layout and count are decided, get their share
                t = torch.rand(x0.shape[0], device=device)
            x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                                enabled=config.bf16):
                velocity = model(x_t, t, model.encode_prompts(texts))
            loss = (velocity.float() - (noise - x0)).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            with torch.no_grad():
                for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
                    p_ema.lerp_(p, 1 - config.ema_decay)
            running += loss.item()
            if step % config.log_every == 0 or step == config.steps:
                record = {"step": step, "loss": running / min(step, config.log_every),
                          "seconds": round(time.perf_counter() - start, 1)}
                running = 0.0
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
                log(record)
            if config.save_every and step % config.save_every == 0 and step != config.steps:
                ema.save(out / f"base-step{step}.safetensors",
                           extra_metadata={"base_training": json.dumps({**asdict(config), "steps": step})})
    path = out / "base.safetensors"
    ema.save(path, extra_metadata={"base_training": json.dumps(asdict(config))})
    return path
