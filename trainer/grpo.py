"""GRPO for flow models: the parts Neighbor GRPO and the SDE baseline share.

Both methods roll out a group of G samples per prompt, score them, turn the rewards into
group-relative advantages, and maximise a PPO-style clipped objective; they differ in where the
group's randomness lives and in the policy whose ratio is clipped. The shared parts live here,
so that trainer/neighbor_grpo.py is the algorithm alone and trainer/sde_grpo.py needs nothing
from it:

    group noises         each prompt's G initial noises, from one seed (sigma = 1: independent)
    score_groups         decode, reward, blend, group-normalised advantages (+ the control)
    clipped_objective    -mean min(A rho, A clip(rho, 1 - eps, 1 + eps))
    optimizer_step       zero, backward (micro-batch by micro-batch), clip the gradient norm, step
    UpdateStats          the PPO statistics of each optimizer step (records only)
    IterationResult      what one iteration hands back, with `iteration_metrics`
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sized
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch

from trainer.config import TrainConfig
from trainer.models.base import FlowModel, micro_batches, to_uint8
from trainer.rewards.remote import ScoringStopped, reward_scorer


# ---------------------------------------------------------------------------------------
# Group noises
# ---------------------------------------------------------------------------------------
def perturb_noise(base_noise: torch.Tensor, group_size: int, sigma: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """G perturbed copies of one noise, (G, *base_noise.shape), each still N(0, I):
    eps_i = sqrt(1 - sigma^2) eps* + sigma delta_i (Neighbor GRPO's neighborhood)."""
    if not 0.0 <= sigma <= 1.0:
        raise ValueError(f"sigma must be in [0, 1], got {sigma}")
    delta = torch.randn((group_size, *base_noise.shape), generator=generator,
                        device=base_noise.device, dtype=base_noise.dtype)  # (G, *D)
    return math.sqrt(1.0 - sigma**2) * base_noise.unsqueeze(0) + sigma * delta


def group_noises(noise_seeds: list[int], group_size: int, sigma: float,
                 latent_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(P, G, *D): each prompt's neighborhood, reproducible from its seed alone.
    sigma = 1 gives independent noises (the SDE baseline's groups)."""
    noises = []
    for seed in noise_seeds:
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(latent_shape, generator=gen)  # eps*
        noises.append(perturb_noise(base, group_size, sigma, generator=gen))
    return torch.stack(noises).to(device)


# seeds are drawn below 2**62: they fit a signed 64-bit column (rollout_groups.seed) and leave
# room for small offsets (a rank's stream is seed + rank) without overflow
SEED_LIMIT = 2**62


def draw_noise_seeds(prompt_count: int, generator: torch.Generator) -> list[int]:
    """One seed per prompt for its shared noise eps* (stored with rollout groups)."""
    return torch.randint(0, SEED_LIMIT, (prompt_count,), generator=generator).tolist()


# ---------------------------------------------------------------------------------------
# Rewards -> group-relative advantages
# ---------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, p: float = 2.0, eps: float = 1e-4) -> torch.Tensor:
    """Per-group z-score along the last axis; for p != 2, sqrt(G) * z / ||z||_p.

    A flat group (all rewards equal) gets zeros. p < 2 shrinks flat groups (many similar
    z's) more than sparse ones (one outlier), keeping sign and order.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    group = rewards.shape[-1]
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, unbiased=False, keepdim=True)  # population std
    z = torch.where(std > 0, (rewards - mean) / (std + eps), torch.zeros_like(rewards))
    if p == 2.0:
        return z
    norm = z.abs().pow(p).sum(-1, keepdim=True).pow(1.0 / p)  # ||z||_p
    return torch.where(norm > 0, math.sqrt(group) * z / norm.clamp_min(1e-12), torch.zeros_like(z))


def blended_group_rewards(raw: dict[str, np.ndarray], weights: dict[str, float],
                          group_shape: tuple[int, int]) -> torch.Tensor:
    """Weighted sum of named rewards, each z-scored per group first (scale never sets weight)."""
    total = torch.zeros(group_shape)
    for name, weight in weights.items():
        total += float(weight) * group_advantages(torch.as_tensor(raw[name]).view(group_shape))
    return total  # (P, G)


def score_groups(model: FlowModel, final_latents: torch.Tensor, prompts: list[str],
                 config: TrainConfig, generator: torch.Generator,
                 stop_requested: Callable[[], bool] | None = None,
                 agree_stop: Callable[[bool], bool] | None = None
                 ) -> tuple[np.ndarray, dict[str, np.ndarray], torch.Tensor]:
    """Decode, score, blend and normalise final latents (P, G, *D).
    Returns images (P, G, H, W, 3), raw rewards {name: (P, G)}, advantages (P, G).
    `stop_requested` True while the reward server scores gives the scoring up: ScoringStopped
    (trainer.rewards.remote). `agree_stop`, in a run over several processes
    (trainer.distributed): every process calls it once its scoring ended, with whether its own
    was given up, and it answers whether any process's was; then all give the iteration up or
    none does (one that went on to its update would wait for the others in the gradient
    all-reduce for ever)."""
    p_count, g = final_latents.shape[:2]
    flat = final_latents.flatten(0, 1)  # (P*G, *D)
    # decoded in the rollouts' micro-batches (a VAE at 512 px is large), then quantised to
    # the 8-bit images that are stored, shown in the arena and sent to a reward server: every
    # reward scores the picture a person judges, not a float image nobody sees (the model
    # rewards move their batch back to their device; 12 images of 512 px are 9 MB)
    with torch.no_grad():
        images = np.concatenate([to_uint8(model.decode(flat[rows])) for rows in
                                 micro_batches(flat.shape[0], config.rollout_batch_size)])
    member_prompts = [text for text in prompts for _ in range(g)]
    # in this process, or on the reward server the config names (one choice, reward_scorer)
    try:
        raw = reward_scorer(config.reward_server_url, stop_requested)(
            list(config.reward_weights), images, member_prompts)
    except ScoringStopped:
        if agree_stop is not None:
            agree_stop(True)
        raise
    if agree_stop is not None and agree_stop(False):
        raise ScoringStopped("scoring stopped on request in another process of the run")
    blended = blended_group_rewards(raw, config.reward_weights, (p_count, g))
    advantages = group_advantages(blended, p=config.quasi_norm_p)  # (P, G)
    if config.shuffle_advantages:  # the control: same magnitudes, no reward signal
        perm = torch.argsort(torch.rand(advantages.shape, generator=generator), dim=-1)
        advantages = torch.gather(advantages, -1, perm)
    raw = {name: r.reshape(p_count, g) for name, r in raw.items()}
    return images.reshape(p_count, g, *images.shape[1:]), raw, advantages


# ---------------------------------------------------------------------------------------
# The clipped objective and the optimizer step
# ---------------------------------------------------------------------------------------
def clipped_objective(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      clip_range: float) -> torch.Tensor:
    """Scalar loss to minimise: -mean(min(A rho, A clip(rho, 1 - eps, 1 + eps)))."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = advantages * ratio
    clipped = advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return -torch.minimum(unclipped, clipped).mean()


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss: torch.Tensor | Iterable[torch.Tensor], max_grad_norm: float,
                   parts: int | None = None) -> torch.Tensor:
    """Zero the gradients, backward, clip their norm (when max_grad_norm > 0), step.
    `loss` may be the parts of one micro-batched loss (each weighted by its share of the rows,
    so they sum to the whole): a generator is consumed one part at a time, each part's
    backward done before the next is computed, so only one micro-batch's activations live.
    `parts`: how many parts `loss` holds (a list or tuple tells by itself). A model trained
    over several processes then averages its gradients over them once per step, in the last
    part's backward, not once per part (`no_gradient_sync`); without it every part's backward
    averages (the same gradients, at one all-reduce per micro-batch).
    Returns the gradient norm before clipping, a 0-dim tensor on the model's device: reading
    it would make the host wait for the GPU, which the update loop never does (UpdateStats
    reads everything once, after the last step)."""
    optimizer.zero_grad(set_to_none=True)
    if isinstance(loss, torch.Tensor):
        loss, parts = [loss], 1
    elif isinstance(loss, Sized):
        parts = len(loss)
    remaining = iter(loss)
    # drawn inside the context too: a part's forward runs as it is drawn from a generator,
    # and DDP decides there whether that part's backward all-reduces
    with no_gradient_sync(model):
        for part in islice(remaining, max((parts or 0) - 1, 0)):
            part.backward()
    synced = 0
    for part in remaining:  # the last part (all of them, when `parts` is unknown)
        part.backward()
        synced += 1
    if parts and not synced:
        # the accumulated gradients were never averaged: the processes would step apart
        raise ValueError(f"loss had fewer parts than the {parts} announced")
    params = [p for p in model.parameters() if p.grad is not None]
    # clip_grad_norm_ also totals sharded gradients (FSDP's DTensors: full_tensor() then
    # reads the norm every shard agrees on); an infinite bound only measures
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach()


def no_gradient_sync(model: torch.nn.Module) -> AbstractContextManager[None]:
    """The model's `no_gradient_sync()` where it is trained over several processes
    (trainer.distributed.DistributedFlowModel): backwards inside leave the gradients
    unaveraged until one outside; a context that does nothing for a single process."""
    skip = getattr(model, "no_gradient_sync", None)
    return skip() if callable(skip) else nullcontext()


class UpdateStats:
    """The PPO statistics of each optimizer step of one iteration, averaged by `metrics()`.
    They stay 0-dim tensors on the device until then, so recording one costs no wait for the
    GPU inside the update loop; `metrics()` reads them all in one transfer."""

    def __init__(self, clip_range: float) -> None:
        self.clip_range = clip_range
        self.steps: dict[str, list[torch.Tensor]] = {
            "loss": [], "clip_fraction": [], "abs_log_ratio": [], "grad_norm": [],
            "kl_to_reference": []}

    @torch.no_grad()
    def record(self, loss: torch.Tensor, logp_new: torch.Tensor, logp_old: torch.Tensor,
               grad_norm: torch.Tensor | float, kl: torch.Tensor | None = None) -> None:
        log_ratio = logp_new - logp_old
        clipped = (log_ratio.exp() - 1).abs() > self.clip_range
        device = log_ratio.device
        values = {"loss": loss, "abs_log_ratio": log_ratio.abs().mean(),
                  "clip_fraction": clipped.float().mean(), "grad_norm": grad_norm,
                  "kl_to_reference": kl}
        for name, value in values.items():
            if value is not None:
                self.steps[name].append(torch.as_tensor(value, dtype=torch.float32).to(device))

    def metrics(self) -> dict[str, float]:
        recorded = {name: values for name, values in self.steps.items() if values}
        if not recorded:  # no optimizer step this iteration
            return {name: math.nan for name in self.steps if name != "kl_to_reference"}
        means = torch.stack([torch.stack(v).mean() for v in recorded.values()]).tolist()
        return dict(zip(recorded, means, strict=True))


# ---------------------------------------------------------------------------------------
# What an iteration hands back
# ---------------------------------------------------------------------------------------
@dataclass
class IterationResult:
    """What one iteration produced: for metrics, sample grids and stored rollout groups."""

    prompts: list[str]
    noise_seeds: list[int]  # seed of each prompt's shared noise eps*
    images: np.ndarray  # (P, G, H, W, 3) uint8
    rewards: dict[str, np.ndarray]  # name -> (P, G)
    advantages: np.ndarray  # (P, G)
    anchors: np.ndarray  # (P, B) member indices trained as anchors (all members for SDE)
    metrics: dict[str, float] = field(default_factory=dict)


def wall_clock(device: torch.device) -> float:
    """perf_counter after the device's queued work is done, so that phase times are true on a
    GPU (kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reward_metrics(raw: dict[str, np.ndarray], weights: dict[str, float]) -> dict[str, float]:
    """The weighted mean reward (weights normalised by their absolute sum), its std, and
    each named reward's mean."""
    total_weight = sum(abs(w) for w in weights.values()) or 1.0
    combined = sum(w * raw[n] for n, w in weights.items()) / total_weight
    metrics = {"reward_mean": float(combined.mean()), "reward_std": float(combined.std())}
    metrics.update({f"reward/{name}": float(r.mean()) for name, r in raw.items()})
    return metrics


def iteration_metrics(raw_rewards: dict[str, np.ndarray], config: TrainConfig,
                      stats: UpdateStats, advantages: torch.Tensor, *, seconds: float,
                      rollout_seconds: float, score_seconds: float, forward_passes: int,
                      backward_passes: int, optimizer_steps: int) -> dict[str, Any]:
    """One iteration's metrics: rewards, PPO statistics, advantage size, time (in total and
    split into rollout, scoring (decode + rewards) and update) and work (per-sample network
    evaluations and optimizer steps)."""
    metrics: dict[str, Any] = reward_metrics(raw_rewards, config.reward_weights)
    metrics.update(stats.metrics())
    metrics.update({
        "advantage_abs_mean": float(advantages.abs().mean()),
        "seconds": seconds, "rollout_seconds": rollout_seconds,
        "score_seconds": score_seconds,
        "update_seconds": seconds - rollout_seconds - score_seconds,
        "forward_passes": forward_passes, "backward_passes": backward_passes,
        "optimizer_steps": optimizer_steps,
    })
    return metrics
