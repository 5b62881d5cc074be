"""The SDE-based baseline (DanceGRPO / Flow-GRPO style), for comparison with Neighbor GRPO.

The ODE sampler becomes an SDE with the same marginals (Flow-GRPO's form):

    x_s = x_t + [v + sigma_t^2 / (2t) (x_t + (1 - t) v)] (s - t) + sigma_t sqrt(t - s) z,
    sigma_t = eta * sqrt(t / (1 - t))

so each step is a Gaussian policy with a likelihood. Every group member is trained on K of the
T steps with the clipped ratio of Gaussian log-likelihoods: G x K forward-backward passes per
group, against Neighbor GRPO's B x K. Noises, rewards, advantages, the clipped objective and
the optimizer step are shared with Neighbor GRPO (trainer/grpo.py). Group members start from
independent noises (Flow-GRPO).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.config import TrainConfig
from trainer.grpo import (
    IterationResult,
    UpdateStats,
    clipped_objective,
    draw_noise_seeds,
    group_noises,
    iteration_metrics,
    optimizer_step,
    score_groups,
    wall_clock,
)
from trainer.models.base import (
    FlowModel,
    index_cond,
    micro_batch_count,
    micro_batches,
    repeat_cond,
)


def sde_step_distribution(x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor,
                          s: torch.Tensor, eta: float, t_cap: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of x_s given x_t. t, s: (N,). sigma_t uses min(t, t_cap) (finite at t=1)."""
    shape = (-1,) + (1,) * (x_t.dim() - 1)
    t, s = t.view(shape), s.view(shape)
    t_noise = t.clamp(max=t_cap)
    sigma_t = eta * torch.sqrt(t_noise / (1 - t_noise))
    drift = velocity + sigma_t**2 / (2 * t) * (x_t + (1 - t) * velocity)
    mean = x_t + drift * (s - t)
    std = sigma_t * torch.sqrt(t - s)
    return mean, std.expand_as(mean)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over dimensions of log N(x; mean, std^2), float32 (N,)."""
    x, mean, std = x.float(), mean.float(), std.float()
    log_prob = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return log_prob.flatten(1).mean(1)


@torch.no_grad()
def sde_rollout(model: FlowModel, noise: torch.Tensor, cond: Any, steps: int, eta: float,
                generator: torch.Generator, batch_size: int = 0,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents (T+1, N, *D), timesteps (T+1,) on the model's shifted schedule, old log-probs
    (T, N) of each step taken. The model runs `batch_size` rows at a time (0: all), each step
    over every micro-batch in turn; each step's noise is drawn for all N rows at once, so the
    trajectories do not depend on how the rows are split (rollout_batch_size's promise)."""
    timesteps = model.sigmas(steps).to(noise.device, torch.float32)
    t_cap = float(timesteps[1])
    x, latents, log_probs = noise, [noise], []
    for k in range(steps):
        z = torch.randn(x.shape, generator=generator).to(x.device)
        step, step_log_probs = [], []
        for rows in micro_batches(x.shape[0], batch_size):
            part = x[rows]
            t = timesteps[k].expand(part.shape[0])
            s = timesteps[k + 1].expand(part.shape[0])
            mean, std = sde_step_distribution(part, model(part, t, index_cond(cond, rows)),
                                              t, s, eta, t_cap)
            step.append(mean + std * z[rows])
            step_log_probs.append(gaussian_log_prob(step[-1], mean, std))
        x = torch.cat(step)
        log_probs.append(torch.cat(step_log_probs))
        latents.append(x)
    return torch.stack(latents), timesteps, torch.stack(log_probs)


@dataclass
class SDEGroups:
    """Every group member's stochastic trajectory under the old policy, members flattened."""

    noise_seeds: list[int]  # (P,)
    member_cond: Any  # (P*G, ...) each member's prompt conditioning
    latents: torch.Tensor  # (T+1, P*G, *D)
    timesteps: torch.Tensor  # (T+1,)
    old_log_probs: torch.Tensor  # (T, P*G) log-likelihood of each step taken

    def final(self, prompt_count: int) -> torch.Tensor:
        """The samples, (P, G, *D)."""
        return self.latents[-1].view(prompt_count, -1, *self.latents.shape[2:])


def rollout_sde_groups(model: FlowModel, prompts: list[str], config: TrainConfig,
                       generator: torch.Generator) -> SDEGroups:
    """Independent noises (sigma = 1), stochastic steps, old log-probs recorded."""
    device = next(model.parameters()).device
    P, G, T = len(prompts), config.group_size, config.rollout_steps
    cond = model.encode_prompts(prompts)
    noise_seeds = draw_noise_seeds(P, generator)
    noises = group_noises(noise_seeds, G, 1.0, model.latent_shape, device).flatten(0, 1)
    model.eval()
    member_cond = repeat_cond(cond, G)
    latents, timesteps, old_log_probs = sde_rollout(  # (T+1, P*G, *D), (T+1,), (T, P*G)
        model, noises, member_cond, T, config.eta, generator, config.rollout_batch_size)
    return SDEGroups(noise_seeds, member_cond, latents, timesteps, old_log_probs)


def update_sde_policy(model: FlowModel, optimizer: torch.optim.Optimizer, groups: SDEGroups,
                      advantages: torch.Tensor, config: TrainConfig,
                      generator: torch.Generator) -> tuple[UpdateStats, int]:
    """Train every member (advantages: (P*G,)) on K random steps; members are split into
    num_anchors optimizer steps so both methods take the same number of optimizer steps per
    iteration. Returns the statistics and the number of optimizer steps."""
    latents, timesteps, old_log_probs = groups.latents, groups.timesteps, groups.old_log_probs
    N, K, T = latents.shape[1], config.num_train_timesteps, config.rollout_steps
    steps = torch.stack([torch.randperm(T, generator=generator)[:K] for _ in range(N)])  # (P*G, K)
    t_cap = float(timesteps[1])
    chunks = torch.randperm(N, generator=generator).chunk(min(config.num_anchors, N))
    model.train()
    stats = UpdateStats(config.clip_range)
    for members in chunks:
        m_steps = steps[members]  # (M, K)
        rows = members[:, None].expand_as(m_steps).reshape(-1)  # (M*K,)
        ks = m_steps.reshape(-1)
        logp_old = old_log_probs[ks, rows]
        step = _StepLoss(rows, ks)
        grad_norm = optimizer_step(model, optimizer,
                                   step.parts(model, groups, advantages, logp_old, config, t_cap),
                                   config.max_grad_norm,
                                   parts=micro_batch_count(len(rows), config.train_batch_size))
        stats.record(step.loss, torch.cat(step.logp_new), logp_old, grad_norm)
    return stats, len(chunks)


class _StepLoss:
    """One optimizer step's loss over (member, timestep) rows, computed and backpropagated in
    micro-batches of `train_batch_size` rows; detached pieces kept for the statistics."""

    def __init__(self, rows: torch.Tensor, ks: torch.Tensor) -> None:
        self.rows, self.ks = rows, ks  # (M*K,) member and step of each row
        self.logp_new: list[torch.Tensor] = []
        self.loss = torch.zeros(())

    def parts(self, model: FlowModel, groups: SDEGroups, advantages: torch.Tensor,
              logp_old: torch.Tensor, config: TrainConfig, t_cap: float):
        latents, timesteps = groups.latents, groups.timesteps
        for part in micro_batches(len(self.rows), config.train_batch_size):
            share = (part.stop - part.start) / len(self.rows)
            rows, ks = self.rows[part], self.ks[part]
            x_t, x_s = latents[ks, rows], latents[ks + 1, rows]
            t, s = timesteps[ks], timesteps[ks + 1]
            velocity = model(x_t, t, index_cond(groups.member_cond, rows))
            mean, std = sde_step_distribution(x_t, velocity, t, s, config.eta, t_cap)
            logp_new = gaussian_log_prob(x_s, mean, std)
            loss = clipped_objective(logp_new, logp_old[part], advantages[rows],
                                     config.clip_range)
            self.loss = self.loss + share * loss.detach()  # stays on the device: no wait
            self.logp_new.append(logp_new.detach())
            yield share * loss


def sde_grpo_iteration(model: FlowModel, optimizer: torch.optim.Optimizer, prompts: list[str],
                       config: TrainConfig, generator: torch.Generator,
                       stop_requested: Callable[[], bool] | None = None,
                       agree_stop: Callable[[bool], bool] | None = None) -> IterationResult:
    """One iteration: SDE rollouts, rewards -> advantages, clipped update of every member.
    `stop_requested`, `agree_stop`: as for score_groups (the iteration then ends before its
    update)."""
    device = next(model.parameters()).device
    start = wall_clock(device)
    P, G, K, T = len(prompts), config.group_size, config.num_train_timesteps, config.rollout_steps
    groups = rollout_sde_groups(model, prompts, config, generator)
    rollout_seconds = wall_clock(device) - start
    images, rewards, advantages = score_groups(model, groups.final(P), prompts, config, generator,
                                               stop_requested, agree_stop)
    score_seconds = wall_clock(device) - start - rollout_seconds
    advantages = advantages.to(groups.latents.device).flatten()  # (P*G,)
    stats, optimizer_steps = update_sde_policy(model, optimizer, groups, advantages, config,
                                               generator)
    metrics = iteration_metrics(rewards, config, stats, advantages,
                                seconds=wall_clock(device) - start,
                                rollout_seconds=rollout_seconds, score_seconds=score_seconds,
                                forward_passes=P * G * T + P * G * K,
                                backward_passes=P * G * K, optimizer_steps=optimizer_steps)
    all_members = np.tile(np.arange(G), (P, 1))
    return IterationResult(prompts, groups.noise_seeds, images, rewards,
                           advantages.view(P, G).cpu().numpy(), all_members, metrics)
