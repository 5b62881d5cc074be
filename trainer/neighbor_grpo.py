"""Neighbor GRPO (He et al., CVPR 2026, arXiv 2511.16955), one iteration at a time.

The deterministic ODE sampler stays deterministic; the group's diversity comes from a
neighborhood of initial noises, and the policy whose ratio is clipped is a softmax over the
group members' latents of their distance to a one-step prediction from an anchor:

    1. perturb_noise        eps_i = sqrt(1 - sigma^2) eps* + sigma delta_i
    2. rollout              old policy, no gradient, every latent x_{t_k}^(i) kept
    3. group_advantages     z-score per group, optional quasi-norm reweighting (p < 2)
    4. leaping_log_probs    log pi(i) = log_softmax_i(-||x_{t_k}^(i) - x_theta||^2 / temperature)
    5. clipped_objective    -mean_i min(A_i rho_i, A_i clip(rho_i, 1 - eps, 1 + eps))
    6. symmetric anchors    B anchors x K timesteps; one optimizer step per anchor

Where this departs from the paper, and why:
- pi_old is the *rollout weights'* one-step Euler prediction from the anchor (computed before
  the first update, detached), not the anchor's stored next latent. With DPM-Solver++ rollouts
  the stored latent is not what an Euler step predicts, so the paper's literal choice starts
  with log-ratios of ~3.5 and training collapses; ours gives ratio exactly 1 at the first
  update, as PPO intends. The literal choice is kept as `old_policy="rollout"`.
- The softmax has a temperature (default: the latent dimension). Raw squared distances in a
  3,072-dimensional latent are in the hundreds, which makes the paper's temperature-1 softmax
  nearly one-hot. Everything is computed in log space in float32.
- Advantages are scaled by sqrt(G) in the quasi-norm reweighting so that p = 2 equals the
  plain z-score.
- An optional KL penalty to the base model (`kl_coefficient`, off by default as in the paper),
  for rewards a policy can exploit away from the base model's images, such as one learned from
  votes (`reference_penalty`).
- Several prompts per iteration are batched: each anchor slot's optimizer step averages the
  loss over the prompts' groups and the K timesteps (the paper's gradient accumulation).

What the update can move (a property of the leaping policy, not of this code): at ratio 1 the
gradient on the one-step prediction is proportional to sum_i A_i x_{t_{k+1}}^(i), one linear
combination of the group's latents for every anchor; the temperature only scales it. Where
objects sit and how many there are survive such a blend and do move. How large and crisp they
are does not: a blend of neighbours with big objects in different places is a faint smear.
Trained on the `size` attribute itself, size fell, where the SDE baseline raised it
(docs/benchmarks.md, "What the trainer can move").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer.config import TrainConfig
from trainer.models.base import FlowModel, index_cond, repeat_cond
from trainer.rewards import compute_rewards
from trainer.solvers import euler_step, rollout


# ---------------------------------------------------------------------------------------
# 1. The neighborhood of initial noises
# ---------------------------------------------------------------------------------------
def perturb_noise(base_noise: torch.Tensor, group_size: int, sigma: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """G perturbed copies of one noise, (G, *base_noise.shape), each still N(0, I)."""
    if not 0.0 <= sigma <= 1.0:
        raise ValueError(f"sigma must be in [0, 1], got {sigma}")
    delta = torch.randn((group_size, *base_noise.shape), generator=generator,
                        device=base_noise.device, dtype=base_noise.dtype)  # (G, *D)
    return math.sqrt(1.0 - sigma**2) * base_noise.unsqueeze(0) + sigma * delta


# ---------------------------------------------------------------------------------------
# 3. Group-relative advantages
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


# ---------------------------------------------------------------------------------------
# 4. The surrogate leaping policy
# ---------------------------------------------------------------------------------------
def _neighbor_log_probs(candidates: torch.Tensor, predictions: torch.Tensor,
                        temperature: float) -> torch.Tensor:
    """candidates (M, G, F), predictions (M, F) -> (M, G) log-probabilities, float32."""
    candidates, predictions = candidates.float(), predictions.float()
    sq_dist = (candidates - predictions.unsqueeze(1)).pow(2).sum(-1)  # (M, G)
    return torch.log_softmax(-sq_dist / temperature, dim=-1)


def leaping_log_probs(candidates: torch.Tensor, anchor: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """log pi(i) over the G candidates of their distance to `anchor` (the one-step prediction).

    candidates: (G, *D); anchor: (*D) -> (G,), or (N, *D) -> (N, G).
    """
    single = anchor.dim() == candidates.dim() - 1
    anchors = anchor.unsqueeze(0) if single else anchor  # (N, *D)
    n, g = anchors.shape[0], candidates.shape[0]
    flat_candidates = candidates.reshape(1, g, -1).expand(n, g, -1)  # (N, G, F)
    log_probs = _neighbor_log_probs(flat_candidates, anchors.reshape(n, -1), temperature)
    return log_probs[0] if single else log_probs


# ---------------------------------------------------------------------------------------
# 5. The clipped objective
# ---------------------------------------------------------------------------------------
def clipped_objective(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      clip_range: float) -> torch.Tensor:
    """Scalar loss to minimise: -mean(min(A rho, A clip(rho, 1 - eps, 1 + eps)))."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = advantages * ratio
    clipped = advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return -torch.minimum(unclipped, clipped).mean()


# ---------------------------------------------------------------------------------------
# Rewards shared with the SDE baseline
# ---------------------------------------------------------------------------------------
def blended_group_rewards(raw: dict[str, np.ndarray], weights: dict[str, float],
                          group_shape: tuple[int, int]) -> torch.Tensor:
    """Weighted sum of named rewards, each z-scored per group first (scale never sets weight)."""
    total = torch.zeros(group_shape)
    for name, weight in weights.items():
        total += float(weight) * group_advantages(torch.as_tensor(raw[name]).view(group_shape))
    return total  # (P, G)


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


def group_noises(noise_seeds: list[int], group_size: int, sigma: float,
                 latent_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(P, G, *D): each prompt's neighborhood, reproducible from its seed alone."""
    noises = []
    for seed in noise_seeds:
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(latent_shape, generator=gen)  # eps*
        noises.append(perturb_noise(base, group_size, sigma, generator=gen))
    return torch.stack(noises).to(device)


def score_groups(model: FlowModel, final_latents: torch.Tensor, prompts: list[str],
                 config: TrainConfig, generator: torch.Generator,
                 reward_fns: dict[str, Any] | None = None) -> tuple[np.ndarray, dict, torch.Tensor]:
    """Decode, score, blend and normalise. Returns images (P,G,...), raw rewards, advantages."""
    p_count, g = final_latents.shape[:2]
    images = model.decode(final_latents.flatten(0, 1))  # (P*G, H, W, 3)
    member_prompts = [text for text in prompts for _ in range(g)]
    raw = compute_rewards(list(config.reward_weights), images, member_prompts)
    blended = blended_group_rewards(raw, config.reward_weights, (p_count, g))
    advantages = group_advantages(blended, p=config.quasi_norm_p)  # (P, G)
    if config.shuffle_advantages:  # the control: same magnitudes, no reward signal
        perm = torch.argsort(torch.rand(advantages.shape, generator=generator), dim=-1)
        advantages = torch.gather(advantages, -1, perm)
    raw = {name: r.reshape(p_count, g) for name, r in raw.items()}
    return images.reshape(p_count, g, *images.shape[1:]), raw, advantages


def reward_metrics(raw: dict[str, np.ndarray], weights: dict[str, float]) -> dict[str, float]:
    total_weight = sum(abs(w) for w in weights.values()) or 1.0
    combined = sum(w * raw[n] for n, w in weights.items()) / total_weight
    metrics = {"reward_mean": float(combined.mean()), "reward_std": float(combined.std())}
    metrics.update({f"reward/{name}": float(r.mean()) for name, r in raw.items()})
    return metrics


# ---------------------------------------------------------------------------------------
# One iteration (Algorithm 1)
# ---------------------------------------------------------------------------------------
def neighbor_grpo_iteration(model: FlowModel, optimizer: torch.optim.Optimizer,
                            prompts: list[str], config: TrainConfig,
                            generator: torch.Generator,
                            reference: FlowModel | None = None) -> IterationResult:
    """One iteration; with `config.kl_coefficient` > 0, `reference` (the frozen base model)
    anchors the policy (see `reference_penalty`)."""
    start = time.perf_counter()
    device = next(model.parameters()).device
    P, G, B, K, T = (len(prompts), config.group_size, config.num_anchors,
                     config.num_train_timesteps, config.rollout_steps)
    cond = model.encode_prompts(prompts)
    latent_dim = math.prod(model.latent_shape)
    temperature = config.temperature or float(latent_dim)

    # 1-2. Neighborhood of noises, deterministic rollouts with the old policy.
    noise_seeds = torch.randint(0, 2**62, (P,), generator=generator).tolist()
    noises = group_noises(noise_seeds, G, config.sigma, model.latent_shape, device)  # (P, G, *D)
    model.eval()
    traj = rollout(config.rollout_solver, model, noises.flatten(0, 1), repeat_cond(cond, G), T)
    latents = traj.latents.view(T + 1, P, G, latent_dim)  # (T+1, P, G, F)
    timesteps = traj.timesteps  # (T+1,)
    rollout_seconds = time.perf_counter() - start

    # 3. Rewards -> advantages.
    images, raw_rewards, advantages = score_groups(model, traj.final.view(P, G, *model.latent_shape),
                                                   prompts, config, generator)
    advantages = advantages.to(device)

    # 6. Symmetric anchor sampling: B anchors per group, K steps per prompt.
    anchors = torch.stack([torch.randperm(G, generator=generator)[:B] for _ in range(P)])  # (P, B)
    steps = torch.stack([torch.randperm(T, generator=generator)[:K] for _ in range(P)])  # (P, K)
    prompt_idx = torch.arange(P)[:, None, None].expand(P, B, K)
    step_idx = steps[:, None, :].expand(P, B, K)
    anchor_idx = anchors[:, :, None].expand(P, B, K)
    x_src = latents[step_idx, prompt_idx, anchor_idx]  # (P, B, K, F) the anchor at t_k
    t_src, t_dst = timesteps[step_idx], timesteps[step_idx + 1]  # (P, B, K)
    candidates = latents[steps + 1, torch.arange(P)[:, None]]  # (P, K, G, F) members at t_{k+1}
    cond_pk = index_cond(cond, torch.arange(P).repeat_interleave(K))  # (P*K, ...)

    def one_step_prediction(b: int, net: FlowModel = model) -> torch.Tensor:
        """x_theta for anchor slot b: one Euler step of `net` (the current weights), (P*K, F)."""
        x = x_src[:, b].reshape(P * K, *model.latent_shape)
        t_from, t_to = t_src[:, b].reshape(-1), t_dst[:, b].reshape(-1)
        return euler_step(x, net(x, t_from, cond_pk), t_from, t_to).reshape(P * K, latent_dim)

    use_reference = config.kl_coefficient > 0
    if use_reference and reference is None:
        raise ValueError("kl_coefficient > 0 needs the reference (base) model")
    # pi_old: computed from the rollout weights, before any update of this iteration.
    with torch.no_grad():
        if use_reference:
            ref_pred = torch.stack([one_step_prediction(b, reference) for b in range(B)], 1)
        if config.old_policy == "one_step":
            old_pred = torch.stack([one_step_prediction(b) for b in range(B)], 1)  # (P*K, B, F)
        else:  # the paper's literal choice: the anchor's own next latent
            old_pred = latents[step_idx + 1, prompt_idx, anchor_idx].permute(0, 2, 1, 3)
            old_pred = old_pred.reshape(P * K, B, latent_dim)
    cand_pk = candidates.reshape(P * K, G, latent_dim)  # (P*K, G, F)
    adv_pk = advantages.repeat_interleave(K, dim=0)  # (P*K, G)

    # 4-5. Leaping policy and clipped objective; one optimizer step per anchor slot.
    model.train()
    stats = UpdateStats(config.clip_range)
    for b in range(B):
        logp_old = _neighbor_log_probs(cand_pk, old_pred[:, b], temperature)  # (P*K, G)
        optimizer.zero_grad(set_to_none=True)
        new_pred = one_step_prediction(b)
        logp_new = _neighbor_log_probs(cand_pk, new_pred, temperature)
        loss = clipped_objective(logp_new, logp_old, adv_pk, config.clip_range)
        if use_reference:
            kl = reference_penalty(new_pred, ref_pred[:, b], temperature)
            loss = loss + config.kl_coefficient * kl
            stats.kls.append(kl.item())
        stats.step(model, optimizer, loss, logp_new, logp_old, config.max_grad_norm)

    metrics = reward_metrics(raw_rewards, config.reward_weights)
    metrics.update(stats.metrics())
    metrics.update({
        "advantage_abs_mean": float(advantages.abs().mean()),
        "seconds": time.perf_counter() - start, "rollout_seconds": rollout_seconds,
        # per-sample network evaluations: rollouts, pi_old predictions, trained predictions
        # (and the reference model's predictions when the KL penalty is on)
        "forward_passes": P * G * T + (P * B * K if config.old_policy == "one_step" else 0)
        + P * B * K + (P * B * K if use_reference else 0),
        "backward_passes": P * B * K,
        "optimizer_steps": B,
    })
    return IterationResult(prompts, noise_seeds, images, raw_rewards,
                           advantages.cpu().numpy(), anchors.numpy(), metrics)


def reference_penalty(prediction: torch.Tensor, reference_prediction: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """KL(pi_theta || pi_ref) of the leaping policies' kernels, averaged over the anchors.

    Both policies score a candidate by exp(-||x - prediction||^2 / temperature), a Gaussian of
    variance temperature / 2 around their one-step prediction, and the KL of two such Gaussians
    is ||prediction - reference_prediction||^2 / temperature. It keeps the policy near the base
    model, where a learned reward (fitted on the base model's samples) can be trusted.
    """
    diff = prediction.float() - reference_prediction.float()
    return diff.pow(2).sum(-1).mean() / temperature


class UpdateStats:
    """Backward, clip, optimizer step; and the PPO statistics of each step, averaged."""

    def __init__(self, clip_range: float) -> None:
        self.clip_range = clip_range
        self.losses: list[float] = []
        self.clip_fractions: list[float] = []
        self.abs_log_ratios: list[float] = []
        self.grad_norms: list[float] = []
        self.kls: list[float] = []

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
             logp_new: torch.Tensor, logp_old: torch.Tensor, max_grad_norm: float) -> None:
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        else:
            grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params])))
        optimizer.step()
        with torch.no_grad():
            log_ratio = logp_new - logp_old
            self.losses.append(loss.item())
            self.abs_log_ratios.append(log_ratio.abs().mean().item())
            clipped = (log_ratio.exp() - 1).abs() > self.clip_range
            self.clip_fractions.append(clipped.float().mean().item())
            self.grad_norms.append(grad_norm)

    def metrics(self) -> dict[str, float]:
        out = {"loss": float(np.mean(self.losses)),
               "clip_fraction": float(np.mean(self.clip_fractions)),
               "abs_log_ratio": float(np.mean(self.abs_log_ratios)),
               "grad_norm": float(np.mean(self.grad_norms))}
        if self.kls:
            out["kl_to_reference"] = float(np.mean(self.kls))
        return out
