"""The interface every model adapter implements (shapes DiT, diffusers FLUX / SD3).

Flow matching convention used throughout: x_t = (1 - t) x_0 + t * noise, t = 1 is pure noise
and t = 0 is data; the network predicts the velocity v = noise - x_0, so an ODE step from t to
s is x_s = x_t + (s - t) v.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


class FlowModel(nn.Module):
    """A velocity model with its prompt encoder and latent decoder."""

    latent_shape: tuple[int, ...]

    def encode_prompts(self, prompts: list[str]) -> Any:
        """Conditioning for `forward`; indexable along dim 0 (tensor or tuple of tensors)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        """Velocity v(x_t, t, c). x: (N, *latent_shape), t: (N,) in [0, 1]."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """(N, H, W, 3) uint8 images."""
        raise NotImplementedError


def repeat_cond(cond: Any, repeats: int) -> Any:
    """Repeat each conditioning row `repeats` times (prompt p -> its group of G members)."""
    if isinstance(cond, tuple):
        return tuple(repeat_cond(c, repeats) for c in cond)
    return cond.repeat_interleave(repeats, dim=0)


def index_cond(cond: Any, index: torch.Tensor) -> Any:
    if isinstance(cond, tuple):
        return tuple(index_cond(c, index) for c in cond)
    return cond[index]
