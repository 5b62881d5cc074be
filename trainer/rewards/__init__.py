"""Rewards by name. The built-in rewards (the shapes world's, the attribute probes, the
compressibility rewards, the published reward models) register themselves on the registry's
first use (`registry._load_builtins`), so importing this package loads no torch."""

from trainer.rewards.registry import (
    compute_rewards,
    get_reward,
    register_reward,
    reward_names,
    shapes_only_problem,
    shapes_only_rewards,
)

__all__ = ["compute_rewards", "get_reward", "register_reward", "reward_names",
           "shapes_only_problem", "shapes_only_rewards"]
