"""Named reward functions. Anything with `(images, prompts) -> (N,) scores` plugs in by name.

images: (N, H, W, 3) uint8 numpy; prompts: list of N strings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar, overload

import numpy as np

RewardFn = Callable[[np.ndarray, list[str]], np.ndarray]
# the registered callable's own type (a function, a lambda, a PreferenceModel ...), which
# register_reward hands back unchanged
R = TypeVar("R", bound=RewardFn)

_REWARDS: dict[str, RewardFn] = {}
# rewards that read the shapes world's 32x32 canvases (counting components of exact colours):
# on another model's images they return numbers that mean nothing
_SHAPES_ONLY: set[str] = set()


@overload
def register_reward(name: str, fn: None = None, *,
                    shapes_only: bool = False) -> Callable[[R], R]: ...


@overload
def register_reward(name: str, fn: R, *, shapes_only: bool = False) -> R: ...


def register_reward(name: str, fn: R | None = None, *,
                    shapes_only: bool = False) -> R | Callable[[R], R]:
    """Register `fn` under `name` and return it; without `fn`, a decorator that does so.
    Re-registering replaces. `shapes_only`: it scores only the shapes model's images (see
    shapes_only_problem)."""
    _load_builtins()  # first, so that a user's reward of a built-in's name replaces it
    return register_builtin_reward(name, fn, shapes_only=shapes_only)


@overload
def register_builtin_reward(name: str, fn: None = None, *,
                            shapes_only: bool = False) -> Callable[[R], R]: ...


@overload
def register_builtin_reward(name: str, fn: R, *, shapes_only: bool = False) -> R: ...


def register_builtin_reward(name: str, fn: R | None = None, *,
                            shapes_only: bool = False) -> R | Callable[[R], R]:
    """register_reward for the built-in modules that _load_builtins imports: it does not load
    the built-ins itself. Were it to, a thread importing one of those modules directly (as
    trainer.config does models) would wait on _load_builtins' lock while the thread holding
    that lock waited on the same module's import: a deadlock."""
    def deco(f: R) -> R:
        _REWARDS[name] = f
        if shapes_only:
            _SHAPES_ONLY.add(name)
        else:
            _SHAPES_ONLY.discard(name)
        return f
    return deco(fn) if fn is not None else deco


_builtins_loaded = False
_builtins_lock = threading.Lock()


def _load_builtins() -> None:
    """Register the built-in rewards on first use, not when the package is imported: the
    published reward models' module imports torch, and the app imports trainer.rewards
    (outcomes, for the API's schemas) at start-up without needing either.

    Threads (the API's request threads, which validate reward names) may come here at once:
    the lock makes the others wait for the imports, and the flag is set only once they are
    done. Set before them, a second thread saw an empty registry ("unknown reward 'count';
    known: ") while the first was still importing."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _builtins_lock:
        if _builtins_loaded:
            return
        # each registers its rewards when imported: count, color, shape, combined,
        # exact_count; attr_*; jpeg_(in)compressibility; hpsv2, pickscore, clip_score,
        # aesthetic, imagereward
        from trainer.rewards import attributes, compressibility, models, shapes  # noqa: F401
        _builtins_loaded = True


def shapes_only_rewards(names: list[str]) -> list[str]:
    """Those of `names` that score only the shapes world's images and prompts."""
    _load_builtins()
    return [name for name in names if name in _SHAPES_ONLY]


def shapes_only_problem(names: list[str], model: str) -> str | None:
    """Why `names` cannot score `model`'s images (some read only the shapes world's), or None."""
    bad = shapes_only_rewards(names)
    if model == "shapes" or not bad:
        return None
    image_rewards = sorted(n for n in _REWARDS if n not in _SHAPES_ONLY)
    return (f"{bad} score only the shapes model's 32x32 images (they count exact-colour "
            f"shapes); for model {model!r} use image rewards: {image_rewards} (a train "
            "job's reward_weights may also blend 'preference', the model fitted on votes)")


def get_reward(name: str) -> RewardFn:
    _load_builtins()
    if name not in _REWARDS:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(_REWARDS)}")
    return _REWARDS[name]


def reward_names() -> list[str]:
    _load_builtins()
    return sorted(_REWARDS)


def shapes_image_problem(names: list[str], images: np.ndarray) -> str | None:
    """Why `images` cannot be scored by the shapes-only rewards among `names`, or None: they
    read the shapes world's 32x32 canvases, and on images of another size they returned
    numbers that meant nothing (count 0.5 on 64x64) without a word."""
    from trainer.shapes.world import IMAGE_SIZE

    bad = shapes_only_rewards(names)
    if not bad or images.ndim != 4 or tuple(images.shape[1:3]) == (IMAGE_SIZE, IMAGE_SIZE):
        return None
    return (f"{bad} score the shapes world's {IMAGE_SIZE}x{IMAGE_SIZE} images; these are "
            f"{images.shape[1]}x{images.shape[2]}")


def compute_rewards(names: list[str], images: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
    """{name: (N,) float64} for each requested reward; ValueError for shapes-only rewards on
    images that are not the shapes world's size (shapes_image_problem)."""
    if (problem := shapes_image_problem(names, np.asarray(images))) is not None:
        raise ValueError(problem)
    out = {}
    for name in names:
        scores = np.asarray(get_reward(name)(images, prompts), dtype=np.float64)
        if scores.shape != (len(prompts),):
            raise ValueError(f"reward {name!r} returned shape {scores.shape}, expected ({len(prompts)},)")
        out[name] = scores
    return out
