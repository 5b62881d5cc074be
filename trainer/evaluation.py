"""Deterministic ODE sampling and the fixed evaluation set (48 prompts x 20 seeds)."""

from __future__ import annotations

import numpy as np
import torch

from trainer.models.base import FlowModel, to_uint8
from trainer.rewards import compute_rewards
from trainer.shapes.world import all_prompts
from trainer.solvers import rollout

EVAL_SEEDS = tuple(range(20))


def seed_noise(seed: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The initial noise of one seed; the same seed gives the same noise for every prompt."""
    return torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def sample_images(model: FlowModel, prompts: list[str], seeds: list[int], solver: str = "dpm++",
                  steps: int = 8, batch_size: int = 256) -> np.ndarray:
    """(N, H, W, 3) uint8 for each (prompt, seed) pair, in the order given."""
    if len(prompts) != len(seeds):
        raise ValueError("prompts and seeds must have the same length")
    device = next(model.parameters()).device
    model.eval()
    images = []
    for i in range(0, len(prompts), batch_size):
        chunk_prompts, chunk_seeds = prompts[i:i + batch_size], seeds[i:i + batch_size]
        noise = torch.stack([seed_noise(s, model.latent_shape) for s in chunk_seeds]).to(device)
        traj = rollout(solver, model, noise, model.encode_prompts(chunk_prompts), steps,
                       shift=model.flow_shift)
        images.append(to_uint8(model.decode(traj.final)))
    return np.concatenate(images)


def evaluate(model: FlowModel, prompts: list[str] | None = None,
             seeds: tuple[int, ...] = EVAL_SEEDS, solver: str = "dpm++", steps: int = 8) -> dict:
    """Mean rewards and exact-count accuracy over every (prompt, seed)."""
    prompts = prompts or all_prompts()
    pairs = [(p, s) for p in prompts for s in seeds]
    images = sample_images(model, [p for p, _ in pairs], [s for _, s in pairs], solver, steps)
    texts = [p for p, _ in pairs]
    scores = compute_rewards(["count", "exact_count", "color", "shape", "combined"], images, texts)
    by_count: dict[str, list[float]] = {}
    for text, hit in zip(texts, scores["exact_count"], strict=True):
        by_count.setdefault(text.split()[0], []).append(float(hit))
    return {
        "samples": len(pairs), "solver": solver, "steps": steps,
        "exact_count_accuracy": float(scores["exact_count"].mean()),
        "count_reward": float(scores["count"].mean()),
        "color_reward": float(scores["color"].mean()),
        "shape_reward": float(scores["shape"].mean()),
        "combined_reward": float(scores["combined"].mean()),
        "exact_count_accuracy_by_count": {k: float(np.mean(v)) for k, v in by_count.items()},
    }
