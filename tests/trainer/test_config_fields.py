"""Every TrainConfig field is read somewhere: a field that nothing reads is a knob that does
nothing, and its help text a promise nobody keeps (issue 15)."""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest

from trainer.config import PRESETS, TrainConfig

ROOT = Path(__file__).resolve().parents[2]


@functools.cache  # parsed once for all the parametrized fields below (about 0.7 s a parse)
def _attributes_read() -> set[str]:
    """Names read as attributes (`x.name`) or as string keys (`cfg["name"]`, `.get("name")`)
    anywhere in the code that runs jobs: trainer/, worker/, app/ (config.py itself excluded)."""
    seen: set[str] = set()
    for package in ("trainer", "worker", "app"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "trainer" / "config.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    seen.add(node.attr)
                elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                    seen.add(str(node.slice.value))
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "get" and node.args
                      and isinstance(node.args[0], ast.Constant)):
                    seen.add(str(node.args[0].value))
    return seen


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TrainConfig)])
def test_every_train_config_field_is_read(name):
    assert name in _attributes_read(), f"TrainConfig.{name} is read nowhere"


def _other_config_fields() -> list[str]:
    """Every field of the other configs a user sets: the sampling and fit jobs' configs, the
    preference fit's FitConfig, the server's Settings."""
    from app.config import Settings
    from app.job_kinds import EvaluateConfig, FitPreferenceConfig, RolloutConfig
    from trainer.rewards.preference import FitConfig

    out = [f"{model.__name__}.{name}" for model in (RolloutConfig, EvaluateConfig,
                                                     FitPreferenceConfig, Settings)
           for name in model.model_fields]
    return out + [f"FitConfig.{f.name}" for f in dataclasses.fields(FitConfig)]


@pytest.mark.parametrize("qualified", _other_config_fields())
def test_every_other_config_field_and_setting_is_read(qualified):
    """A job config's field or a setting that nothing reads does nothing, whatever its help
    text says (the same rule as TrainConfig's above, over the same code)."""
    name = qualified.split(".", 1)[1]
    assert name in _attributes_read(), f"{qualified} is read nowhere"


def test_eval_every_logs_evaluation_metrics_without_touching_training(tmp_path):
    from trainer.loop import Trainer

    base = {**PRESETS["tiny"], "device": "cpu", "iterations": 2}
    plain = Trainer(TrainConfig.from_dict(base))
    evaluated = Trainer(TrainConfig.from_dict({**base, "eval_every": 2, "eval_seeds": 1}))
    for it in (1, 2):
        a, b = plain.step(), evaluated.step()
        assert a.metrics["reward_mean"] == b.metrics["reward_mean"]  # same random stream
        assert ("eval_exact_count_accuracy" in b.metrics) == (it == 2)
    assert 0.0 <= b.metrics["eval_exact_count_accuracy"] <= 1.0
    assert 0.0 <= b.metrics["eval_count_reward"] <= 1.0


def test_configs_do_not_share_their_presets_lists_and_dicts():
    from trainer.config import load_config

    before = {name: dict(preset) for name, preset in PRESETS.items()}
    config = load_config("flux-lora", {"model_path": "/models/flux"})
    config.reward_weights["preference"] = 1.0
    config.lora_target_modules.append("proj_out")
    assert PRESETS["flux-lora"]["reward_weights"] == {"jpeg_compressibility": 1.0}
    assert PRESETS["sd3-lora"]["reward_weights"] == {"jpeg_compressibility": 1.0}
    assert load_config("flux-lora", {"model_path": "/m"}).lora_target_modules == \
        TrainConfig().lora_target_modules
    assert {name: dict(preset) for name, preset in PRESETS.items()} == before


def test_the_rollouts_record_how_each_method_samples():
    """The rollouts pages show a group's solver and sigma: the SDE baseline's are its own
    stochastic steps and independent noises, not the Neighbor GRPO fields it never reads."""
    from trainer.config import PRESETS, TrainConfig

    assert TrainConfig.from_dict({"sigma": 0.2}).rollout_sampler() == ("dpm++", 0.2)
    assert TrainConfig.from_dict(PRESETS["sde-baseline"]).rollout_sampler() == ("sde", 1.0)
    assert TrainConfig.from_dict({"method": "neighbor", "rollout_solver": "euler"}
                                 ).rollout_sampler() == ("euler", 0.3)
