"""Rewards by name. Importing this package registers the built-in shapes rewards."""

from trainer.rewards import shapes as _shapes  # noqa: F401  (registers count, color, shape, ...)
from trainer.rewards.registry import (
    compute_rewards,
    get_reward,
    register_reward,
    reward_names,
    shapes_only_problem,
)

__all__ = ["compute_rewards", "get_reward", "register_reward", "reward_names",
           "shapes_only_problem"]

from trainer.rewards import attributes as _attributes  # noqa: E402,F401  (registers attr_size, attr_upper)
from trainer.rewards import compressibility as _compressibility  # noqa: E402,F401  (registers jpeg_(in)compressibility)

# the published reward models (hpsv2, pickscore, clip_score, aesthetic, imagereward): registered
# here, loaded from local weights on first call (trainer/rewards/models.py)
from trainer.rewards import models as _models  # noqa: E402,F401
