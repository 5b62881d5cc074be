"""Neighbor GRPO for flow-matching image models: a PyTorch library, usable without the server.

    from trainer import Trainer, load_config

    trainer = Trainer(load_config("tiny", {"device": "cpu"}))
    for _ in range(trainer.config.iterations):
        print(trainer.step().metrics["reward_mean"])
    trainer.save_checkpoint("runs/notebook/checkpoints")

The public API (`__all__`), by what it is for:

- Configuring a run: `TrainConfig` (one dataclass, help text on every field), `PRESETS`,
  `load_config(preset_or_json_path, overrides)`, `ConfigError` (one bad field, named) and
  `ConfigErrors` (every bad field at once: what `load_config` and `TrainConfig.from_dict`
  raise; `.errors` lists the `ConfigError`s).
- Training: `Trainer` (model, optimizer, RNG; `step()`, `run(on_iteration)`,
  `save_checkpoint` / `load_checkpoint`, `set_preference_model`, `track(directory, run_name)`:
  where `step()` and `run()` log for the config's `report_to` trackers, `finish_tracking()`:
  ends a run of `step()`s there), `latest_checkpoint`,
  `load_model`, the errors `step()` stops with, each message saying what to change
  (`TrainingDiverged`: a loss or gradient that is not finite; `TrainingOutOfMemory`: the
  accelerator's memory, naming the settings that size an iteration), and the iteration functions it calls, `neighbor_grpo_iteration` (the
  algorithm, trainer/neighbor_grpo.py) and `sde_grpo_iteration` (the SDE baseline), each
  returning an `IterationResult` (images, rewards, advantages, anchors, metrics).
- Models: `FlowModel`, the interface a model adapter implements (velocity, prompt encoder,
  decoder), `register_model(name, loader, weight_format, directory_files)` (what
  `TrainConfig.model` may name; the last two optional), and
  `ShapesDiT` / `ShapesDiTConfig`, the built-in tiny DiT of the shapes world.
- Rewards: `register_reward(name, fn)` (fn: (images, prompts) -> scores), `get_reward`,
  `reward_names`, `compute_rewards`; `PreferenceModel`, a reward fitted to human votes by
  `fit_preference_model(pairs, FitConfig(...))` from `PreferencePair`s (two images, the
  prompt, an `Outcome`: a, b, tie, or skip and both_bad, which carry no label).
- Evaluation: `sample_images` (deterministic ODE sampling), `evaluate` (the fixed 48 x 20
  set, or any prompts scored with any `rewards`), `all_prompts` (the shapes world's 48
  prompts).

Names are imported on first use (PEP 562), so `import trainer` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "TrainConfig": "trainer.config",
    "PRESETS": "trainer.config",
    "ConfigError": "trainer.config",
    "ConfigErrors": "trainer.config",
    "load_config": "trainer.config",
    "Trainer": "trainer.loop",
    "latest_checkpoint": "trainer.loop",
    "load_model": "trainer.loop",
    "TrainingDiverged": "trainer.loop",
    "TrainingOutOfMemory": "trainer.loop",
    "IterationResult": "trainer.grpo",
    "neighbor_grpo_iteration": "trainer.neighbor_grpo",
    "sde_grpo_iteration": "trainer.sde_grpo",
    "FlowModel": "trainer.models.base",
    "register_model": "trainer.models",
    "ShapesDiT": "trainer.models.shapes_dit",
    "ShapesDiTConfig": "trainer.models.shapes_dit",
    "register_reward": "trainer.rewards",
    "get_reward": "trainer.rewards",
    "reward_names": "trainer.rewards",
    "compute_rewards": "trainer.rewards",
    "PreferenceModel": "trainer.rewards.preference",
    "PreferencePair": "trainer.rewards.preference",
    "FitConfig": "trainer.rewards.preference",
    "fit_preference_model": "trainer.rewards.preference",
    "Outcome": "trainer.rewards.outcomes",
    "sample_images": "trainer.evaluation",
    "evaluate": "trainer.evaluation",
    "all_prompts": "trainer.shapes.world",
}

__all__ = [
    "TrainConfig", "PRESETS", "ConfigError", "ConfigErrors", "load_config",
    "Trainer", "latest_checkpoint", "load_model", "TrainingDiverged", "TrainingOutOfMemory",
    "IterationResult", "neighbor_grpo_iteration", "sde_grpo_iteration",
    "FlowModel", "register_model", "ShapesDiT", "ShapesDiTConfig",
    "register_reward", "get_reward", "reward_names", "compute_rewards",
    "PreferenceModel", "PreferencePair", "FitConfig", "fit_preference_model", "Outcome",
    "sample_images", "evaluate", "all_prompts",
]  # the keys of _EXPORTS, spelled out for linters and type checkers

if TYPE_CHECKING:
    from trainer.config import PRESETS, ConfigError, ConfigErrors, TrainConfig, load_config
    from trainer.evaluation import evaluate, sample_images
    from trainer.grpo import IterationResult
    from trainer.loop import (
        Trainer,
        TrainingDiverged,
        TrainingOutOfMemory,
        latest_checkpoint,
        load_model,
    )
    from trainer.models import register_model
    from trainer.models.base import FlowModel
    from trainer.models.shapes_dit import ShapesDiT, ShapesDiTConfig
    from trainer.neighbor_grpo import neighbor_grpo_iteration
    from trainer.rewards import compute_rewards, get_reward, register_reward, reward_names
    from trainer.rewards.outcomes import Outcome
    from trainer.rewards.preference import (
        FitConfig,
        PreferenceModel,
        PreferencePair,
        fit_preference_model,
    )
    from trainer.sde_grpo import sde_grpo_iteration
    from trainer.shapes.world import all_prompts


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once; later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
