"""Neighbor GRPO (He et al., CVPR 2026, arXiv 2511.16955), one iteration at a time.

The deterministic ODE sampler stays deterministic; the group's diversity comes from a
neighborhood of initial noises, and the policy whose ratio is clipped is a softmax over the
group members' latents of their distance to a one-step prediction from an anchor:

    1. perturb_noise          eps_i = sqrt(1 - sigma^2) eps* + sigma delta_i             [grpo]
    2. rollout_neighborhoods  old policy, no gradient, every latent x_{t_k}^(i) kept
    3. score_groups           z-score per group, optional quasi-norm reweighting (p < 2) [grpo]
    4. leaping_log_probs      log pi(i) = log_softmax_i(-||x_{t_k}^(i) - x_theta||^2 / temperature)
    5. clipped_objective      -mean_i min(A_i rho_i, A_i clip(rho_i, 1 - eps, 1 + eps))  [grpo]
    6. sample_anchor_steps    B anchors x K timesteps; update_policy: one optimizer step per anchor

`neighbor_grpo_iteration` composes them (Algorithm 1). Steps marked [grpo] are shared with the
SDE baseline and live in trainer/grpo.py, with the optimizer step and the iteration's metrics.

Where this departs from the paper, and why:
- pi_old is the *rollout weights'* one-step Euler prediction from the anchor, not the
  anchor's stored next latent. With DPM-Solver++ rollouts the stored latent is not what an
  Euler step predicts, so the paper's literal choice starts with log-ratios of ~3.5 and
  training collapses; ours gives ratio 1 at the first update, as PPO intends. It costs no
  forward pass: the rollout already evaluated the old weights' velocity at every (x_{t_k},
  t_k), and an Euler step with that stored velocity is the prediction (as the SDE peers keep
  the sampler's log-probabilities instead of recomputing them). The literal choice is kept as
  `old_policy="rollout"`.
- The softmax has a temperature (default: the latent dimension). Raw squared distances in a
  3,072-dimensional latent are in the hundreds, which makes the paper's temperature-1 softmax
  nearly one-hot. Everything is computed in log space in float32.
- Advantages are scaled by sqrt(G) in the quasi-norm reweighting so that p = 2 equals the
  plain z-score.
- An optional KL penalty to the base model (`kl_coefficient`, off by default as in the paper),
  for rewards a policy can exploit away from the base model's images, such as one learned from
  votes (`reference_penalty`).
- Several prompts per iteration are batched: each anchor slot's optimizer step averages the
  loss over the prompts' groups and the K timesteps (the paper's gradient accumulation), in
  micro-batches of `train_batch_size` predictions when a large model needs them.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
from trainer.solvers import euler_step, rollout


# ---------------------------------------------------------------------------------------
# 1-2. The neighborhood of initial noises, rolled out deterministically
# ---------------------------------------------------------------------------------------
@dataclass
class Neighborhoods:
    """Every group member's ODE trajectory under the old policy."""

    noise_seeds: list[int]  # (P,) seed of each prompt's shared noise eps*
    cond: Any  # the prompts' conditioning, (P, ...)
    latents: torch.Tensor  # (T+1, P, G, F) every latent, flattened
    velocities: torch.Tensor  # (T, P, G, F) the old weights' velocity at each latent
    timesteps: torch.Tensor  # (T+1,) from ~1 (noise) to 0 (data)
    latent_shape: tuple[int, ...]  # (*D), F = prod(D)

    @property
    def final(self) -> torch.Tensor:
        """The samples, (P, G, *D)."""
        p_count, g = self.latents.shape[1:3]
        return self.latents[-1].view(p_count, g, *self.latent_shape)


def rollout_neighborhoods(model: FlowModel, prompts: list[str], config: TrainConfig,
                          generator: torch.Generator) -> Neighborhoods:
    """Per prompt G noises around a fresh eps* (sigma), rolled out with no gradient by the
    current (old) weights with the configured solver, every latent kept."""
    device = next(model.parameters()).device
    P, G, T = len(prompts), config.group_size, config.rollout_steps
    cond = model.encode_prompts(prompts)
    noise_seeds = draw_noise_seeds(P, generator)
    noises = group_noises(noise_seeds, G, config.sigma, model.latent_shape, device)  # (P, G, *D)
    model.eval()
    traj = rollout(config.rollout_solver, model, noises.flatten(0, 1), repeat_cond(cond, G), T,
                   shift=model.flow_shift, batch_size=config.rollout_batch_size,
                   timesteps=model.sigmas(T))
    features = math.prod(model.latent_shape)
    latents = traj.latents.view(T + 1, P, G, features)  # (T+1, P, G, F)
    velocities = traj.velocities.view(T, P, G, features)  # (T, P, G, F)
    return Neighborhoods(noise_seeds, cond, latents, velocities, traj.timesteps,
                         tuple(model.latent_shape))


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


# ---------------------------------------------------------------------------------------
# 6. Symmetric anchor sampling
# ---------------------------------------------------------------------------------------
@dataclass
class AnchorSteps:
    """What the update trains on, by anchor slot b: each prompt's b-th anchor at its K
    timesteps, and every group member one step later (the leaping policy's candidates)."""

    anchors: torch.Tensor  # (P, B) member index of each prompt's anchors
    steps: torch.Tensor  # (P, K) the timesteps k trained for each prompt
    x_src: torch.Tensor  # (P, B, K, F) the anchor at t_k
    x_next: torch.Tensor  # (P, B, K, F) the anchor's own rollout latent at t_{k+1}
    v_src: torch.Tensor  # (P, B, K, F) the rollout weights' velocity at the anchor at t_k
    t_src: torch.Tensor  # (P, B, K) t_k
    t_dst: torch.Tensor  # (P, B, K) t_{k+1}
    candidates: torch.Tensor  # (P*K, G, F) the members at t_{k+1}
    cond: Any  # (P*K, ...) each row's prompt conditioning
    latent_shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        """P*K: the predictions of one anchor slot."""
        return self.candidates.shape[0]

    def one_step_prediction(self, net: FlowModel, b: int, rows: slice = slice(None)
                            ) -> torch.Tensor:
        """x_theta for anchor slot b: one Euler step of `net` from each anchor, (P*K, F), or
        from the anchors of `rows` alone."""
        p_count, _, k, features = self.x_src.shape
        x = self.x_src[:, b].reshape(p_count * k, *self.latent_shape)[rows]
        t_from = self.t_src[:, b].reshape(-1)[rows]
        t_to = self.t_dst[:, b].reshape(-1)[rows]
        velocity = net(x, t_from, index_cond(self.cond, rows))
        return euler_step(x, velocity, t_from, t_to).reshape(x.shape[0], features)

    def predictions(self, net: FlowModel, batch_size: int = 0) -> torch.Tensor:
        """Every slot's one-step prediction by `net`, (P*K, B, F), `batch_size` rows at a time."""
        return torch.stack([
            torch.cat([self.one_step_prediction(net, b, rows)
                       for rows in micro_batches(self.rows, batch_size)])
            for b in range(self.anchors.shape[1])], 1)

    def rollout_predictions(self) -> torch.Tensor:
        """Every slot's one-step prediction by the rollout (old) weights, (P*K, B, F): the
        Euler step from each anchor with the velocity the rollout evaluated there, the same
        number a forward of the old weights would give, without the forward."""
        p_count, b, k, features = self.x_src.shape
        x = self.x_src.permute(0, 2, 1, 3).reshape(p_count * k, b, features)
        velocity = self.v_src.permute(0, 2, 1, 3).reshape(p_count * k, b, features)
        t_from = self.t_src.permute(0, 2, 1).reshape(p_count * k, b)
        t_to = self.t_dst.permute(0, 2, 1).reshape(p_count * k, b)
        dt = (t_to - t_from).to(x.dtype).unsqueeze(-1)
        return x + dt * velocity

    def stored_next_latents(self) -> torch.Tensor:
        """Every slot's anchor latent at t_{k+1} as the rollout left it, (P*K, B, F)."""
        p_count, b, k, features = self.x_next.shape
        return self.x_next.permute(0, 2, 1, 3).reshape(p_count * k, b, features)


def sample_anchor_steps(groups: Neighborhoods, config: TrainConfig,
                        generator: torch.Generator) -> AnchorSteps:
    """Any member can be the anchor: per prompt B of the G members and K of the T steps."""
    latents, timesteps = groups.latents, groups.timesteps  # (T+1, P, G, F), (T+1,)
    P, G = latents.shape[1:3]
    B, K, T = config.num_anchors, config.num_train_timesteps, config.rollout_steps
    anchors = torch.stack([torch.randperm(G, generator=generator)[:B] for _ in range(P)])  # (P, B)
    steps = torch.stack([torch.randperm(T, generator=generator)[:K] for _ in range(P)])  # (P, K)
    prompt_idx = torch.arange(P)[:, None, None].expand(P, B, K)
    step_idx = steps[:, None, :].expand(P, B, K)
    anchor_idx = anchors[:, :, None].expand(P, B, K)
    candidates = latents[steps + 1, torch.arange(P)[:, None]]  # (P, K, G, F)
    return AnchorSteps(
        anchors=anchors, steps=steps,
        x_src=latents[step_idx, prompt_idx, anchor_idx],
        x_next=latents[step_idx + 1, prompt_idx, anchor_idx],
        v_src=groups.velocities[step_idx, prompt_idx, anchor_idx],
        t_src=timesteps[step_idx], t_dst=timesteps[step_idx + 1],
        candidates=candidates.reshape(P * K, G, -1),
        cond=index_cond(groups.cond, torch.arange(P).repeat_interleave(K)),
        latent_shape=groups.latent_shape)


# ---------------------------------------------------------------------------------------
# 4-6. The update: one optimizer step per anchor slot
def policy_temperature(configured: float, latent_dim: int) -> float:
    """The leaping policy's temperature: the configured one, or for 0 the flattened latent
    dimension (the logits are then mean squared differences per element, alike in size for
    every model and resolution)."""
    return configured or float(latent_dim)


# ---------------------------------------------------------------------------------------
def update_policy(model: FlowModel, optimizer: torch.optim.Optimizer, batch: AnchorSteps,
                  advantages: torch.Tensor, config: TrainConfig,
                  reference: FlowModel | None = None) -> UpdateStats:
    """pi_old (from the rollout) and the reference's predictions before any update; then per
    anchor slot the clipped objective of the leaping policy, averaged over the prompts' groups
    and their K timesteps (plus the KL penalty), and one optimizer step."""
    K = config.num_train_timesteps
    temperature = policy_temperature(config.temperature, batch.candidates.shape[-1])
    use_reference = config.kl_coefficient > 0
    with torch.no_grad():
        ref_pred = (batch.predictions(reference, config.train_batch_size)
                    if use_reference else None)  # (P*K, B, F)
        if config.old_policy == "one_step":
            old_pred = batch.rollout_predictions()  # (P*K, B, F)
        else:  # the paper's literal choice: the anchor's own next latent
            old_pred = batch.stored_next_latents()
    adv_pk = advantages.repeat_interleave(K, dim=0)  # (P*K, G)

    model.train()
    stats = UpdateStats(config.clip_range)
    for b in range(batch.anchors.shape[1]):
        logp_old = _neighbor_log_probs(batch.candidates, old_pred[:, b], temperature)  # (P*K, G)
        slot = _SlotLoss(logp_old, ref_pred[:, b] if use_reference else None)
        grad_norm = optimizer_step(
            model, optimizer, slot.parts(model, batch, b, adv_pk, temperature, config),
            config.max_grad_norm,
            parts=micro_batch_count(batch.rows, config.train_batch_size))
        stats.record(slot.loss, torch.cat(slot.logp_new), logp_old, grad_norm, slot.kl)
    return stats


class _SlotLoss:
    """One anchor slot's loss, computed and backpropagated in micro-batches of rows; the
    detached pieces are kept for the statistics."""

    def __init__(self, logp_old: torch.Tensor, ref_pred: torch.Tensor | None) -> None:
        self.logp_old, self.ref_pred = logp_old, ref_pred  # (P*K, G), (P*K, F) or None
        self.logp_new: list[torch.Tensor] = []
        self.loss = torch.zeros(())
        self.kl: torch.Tensor | None = None if ref_pred is None else torch.zeros(())

    def parts(self, model: FlowModel, batch: AnchorSteps, b: int, adv_pk: torch.Tensor,
              temperature: float, config: TrainConfig) -> Iterator[torch.Tensor]:
        for rows in micro_batches(batch.rows, config.train_batch_size):
            share = (rows.stop - rows.start) / batch.rows  # chunk means add up to the mean
            new_pred = batch.one_step_prediction(model, b, rows)  # (M, F)
            logp_new = _neighbor_log_probs(batch.candidates[rows], new_pred, temperature)
            loss = clipped_objective(logp_new, self.logp_old[rows], adv_pk[rows],
                                     config.clip_range)
            if self.ref_pred is not None:
                kl = reference_penalty(new_pred, self.ref_pred[rows], temperature)
                loss = loss + config.kl_coefficient * kl
                self.kl = self.kl + share * kl.detach()  # stays on the device: no wait
            self.loss = self.loss + share * loss.detach()
            self.logp_new.append(logp_new.detach())
            yield share * loss


def neighbor_work(config: TrainConfig, prompt_count: int) -> dict[str, int]:
    """Per-sample network evaluations and optimizer steps of one iteration: rollouts, trained
    predictions (and the reference's, with the KL penalty on); pi_old comes from the rollout."""
    P, G, B = prompt_count, config.group_size, config.num_anchors
    K, T = config.num_train_timesteps, config.rollout_steps
    ref = P * B * K if config.kl_coefficient > 0 else 0
    return {"forward_passes": P * G * T + P * B * K + ref,
            "backward_passes": P * B * K, "optimizer_steps": B}


# ---------------------------------------------------------------------------------------
# One iteration (Algorithm 1)
# ---------------------------------------------------------------------------------------
def neighbor_grpo_iteration(model: FlowModel, optimizer: torch.optim.Optimizer,
                            prompts: list[str], config: TrainConfig,
                            generator: torch.Generator,
                            reference: FlowModel | None = None,
                            stop_requested: Callable[[], bool] | None = None,
                            agree_stop: Callable[[bool], bool] | None = None
                            ) -> IterationResult:
    """One iteration; with `config.kl_coefficient` > 0, `reference` (the frozen base model)
    anchors the policy (see `reference_penalty`). `stop_requested`, `agree_stop`: as for
    score_groups (the iteration then ends before its update)."""
    if config.kl_coefficient > 0 and reference is None:
        raise ValueError("kl_coefficient > 0 needs the reference (base) model")
    device = next(model.parameters()).device
    start = wall_clock(device)
    groups = rollout_neighborhoods(model, prompts, config, generator)  # 1-2
    rollout_seconds = wall_clock(device) - start
    images, rewards, advantages = score_groups(model, groups.final, prompts, config, generator,
                                               stop_requested, agree_stop)  # 3
    score_seconds = wall_clock(device) - start - rollout_seconds
    advantages = advantages.to(groups.latents.device)  # (P, G)
    batch = sample_anchor_steps(groups, config, generator)  # 6
    stats = update_policy(model, optimizer, batch, advantages, config, reference)  # 4-5
    metrics = iteration_metrics(rewards, config, stats, advantages,
                                seconds=wall_clock(device) - start,
                                rollout_seconds=rollout_seconds, score_seconds=score_seconds,
                                **neighbor_work(config, len(prompts)))
    return IterationResult(prompts, groups.noise_seeds, images, rewards,
                           advantages.cpu().numpy(), batch.anchors.numpy(), metrics)
