"""ODE solvers for flow matching that record every intermediate latent.

Convention (see models/base.py): t = 1 is noise, t = 0 is data, x_s = x_t + (s - t) v.
A rollout returns `latents` (T+1, N, *D) from the initial noise to the final sample, and the
timestep grid `timesteps` (T+1,) with timesteps[0] ~ 1 and timesteps[-1] = 0, so step k goes
from latents[k] at timesteps[k] to latents[k+1] at timesteps[k+1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.models.base import index_cond, micro_batches, shift_sigmas

if TYPE_CHECKING:
    from diffusers import DPMSolverMultistepScheduler

# velocity(x, t, cond) with t a (N,) tensor
VelocityFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass
class Rollout:
    latents: torch.Tensor  # (T+1, N, *D)
    timesteps: torch.Tensor  # (T+1,)
    # (T, N, *D): the velocity the solver evaluated at (latents[k], timesteps[k]); Neighbor
    # GRPO's pi_old is an Euler step with it, so the update needs no forward of its own
    velocities: torch.Tensor | None = None

    @property
    def final(self) -> torch.Tensor:
        return self.latents[-1]


def euler_step(x_t: torch.Tensor, velocity: torch.Tensor, t_from: torch.Tensor | float,
               t_to: torch.Tensor | float) -> torch.Tensor:
    """One Euler (flow DDIM) step: x_{t_to} = x_{t_from} + (t_to - t_from) * v.

    t_from / t_to may be scalars or (N,) tensors (one per sample).
    """
    dt = torch.as_tensor(t_to, dtype=x_t.dtype, device=x_t.device) - torch.as_tensor(
        t_from, dtype=x_t.dtype, device=x_t.device)
    if dt.dim() == 1:
        dt = dt.view(-1, *([1] * (x_t.dim() - 1)))
    return x_t + dt * velocity


def linear_timesteps(steps: int, device: torch.device | str = "cpu",
                     shift: float = 1.0) -> torch.Tensor:
    """(steps + 1,) evenly spaced from 1 to 0, then shifted (FlowMatchEulerDiscreteScheduler's
    grid for a model of that flow shift)."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, device=device), shift)


# Rollouts run under no_grad, not inference_mode: their latents are the update's inputs, and
# an inference tensor cannot be saved for backward ("Inference tensors cannot be saved for
# backward"), so inference_mode would cost a copy of every recorded latent for nothing.
@torch.no_grad()
def euler_rollout(velocity_fn: VelocityFn, noise: torch.Tensor, cond: Any, steps: int,
                  shift: float = 1.0, timesteps: torch.Tensor | None = None) -> Rollout:
    """`timesteps`: the (steps + 1,) grid (a model's `sigmas(steps)`); None: evenly spaced,
    then shifted by `shift`."""
    if timesteps is None:
        timesteps = linear_timesteps(steps, noise.device, shift)
    else:
        if timesteps.shape != (steps + 1,):
            raise ValueError(f"timesteps: expected {steps + 1} values, got {tuple(timesteps.shape)}")
        timesteps = timesteps.to(noise.device, torch.float32)
    latents, velocities = [noise], []
    x = noise
    for k in range(steps):
        t = timesteps[k].expand(x.shape[0])
        velocities.append(velocity_fn(x, t, cond))
        x = euler_step(x, velocities[-1], timesteps[k], timesteps[k + 1])
        latents.append(x)
    return Rollout(torch.stack(latents), timesteps, torch.stack(velocities))


def dpm_solver_scheduler(steps: int, shift: float = 1.0) -> DPMSolverMultistepScheduler:
    """diffusers' DPM-Solver++(2M) on flow sigmas with the model's shift (a dynamic shift mu is
    the static shift exp(mu), so FLUX's resolution-dependent schedule fits here too)."""
    # imported here: diffusers pulls in torch._dynamo (about 3 s), which only DPM rollouts need
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
        algorithm_type="dpmsolver++", solver_order=2, final_sigmas_type="zero",
    )
    scheduler.set_timesteps(steps)
    return scheduler


@torch.no_grad()
def dpm_rollout(velocity_fn: VelocityFn, noise: torch.Tensor, cond: Any, steps: int,
                shift: float = 1.0) -> Rollout:
    """DPM-Solver++(2M) with flow sigmas (diffusers), recording every latent."""
    scheduler = dpm_solver_scheduler(steps, shift)
    timesteps = scheduler.sigmas.to(noise.device, torch.float32)  # (T+1,), ends at 0
    latents, velocities = [noise], []
    x = noise
    for k, timestep in enumerate(scheduler.timesteps):
        t = timesteps[k].expand(x.shape[0])
        velocities.append(velocity_fn(x, t, cond))
        x = scheduler.step(velocities[-1], timestep, x).prev_sample
        latents.append(x)
    return Rollout(torch.stack(latents), timesteps, torch.stack(velocities))


SOLVERS = {"euler": euler_rollout, "dpm++": dpm_rollout}


def rollout(solver: str, velocity_fn: VelocityFn, noise: torch.Tensor, cond: Any,
            steps: int, shift: float = 1.0, batch_size: int = 0,
            timesteps: torch.Tensor | None = None) -> Rollout:
    """Solve from `noise` (N, *D) with `solver`, `batch_size` rows at a time (0: all at once;
    each row's trajectory is the same either way), the schedule shifted by `shift`. Euler
    steps on `timesteps` where given (the model's own pipeline grid, `model.sigmas(steps)`);
    DPM++ lays out its own grid from `shift`, as diffusers' DPM-Solver does."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; use 'euler' or 'dpm++'")
    grid = {"timesteps": timesteps} if solver == "euler" else {}
    parts = [SOLVERS[solver](velocity_fn, noise[rows], index_cond(cond, rows), steps, shift,
                             **grid)
             for rows in micro_batches(noise.shape[0], batch_size)]
    if len(parts) == 1:
        return parts[0]
    return Rollout(torch.cat([p.latents for p in parts], dim=1), parts[0].timesteps,
                   torch.cat([p.velocities for p in parts], dim=1))
