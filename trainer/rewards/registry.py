"""Named reward functions. Anything with `(images, prompts) -> (N,) scores` plugs in by name.

images: (N, H, W, 3) uint8 numpy; prompts: list of N strings.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

RewardFn = Callable[[np.ndarray, list[str]], np.ndarray]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, fn: RewardFn | None = None):
    """Register `fn` under `name` (usable as a decorator). Re-registering replaces."""
    def deco(f: RewardFn) -> RewardFn:
        _REWARDS[name] = f
        return f
    return deco(fn) if fn is not None else deco


def get_reward(name: str) -> RewardFn:
    if name not in _REWARDS:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(_REWARDS)}")
    return _REWARDS[name]


def reward_names() -> list[str]:
    return sorted(_REWARDS)


def compute_rewards(names: list[str], images: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
    """{name: (N,) float64} for each requested reward."""
    out = {}
    for name in names:
        scores = np.asarray(get_reward(name)(images, prompts), dtype=np.float64)
        if scores.shape != (len(prompts),):
            raise ValueError(f"reward {name!r} returned shape {scores.shape}, expected ({len(prompts)},)")
        out[name] = scores
    return out
