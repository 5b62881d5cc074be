"""Every TrainConfig field is read somewhere: a field that nothing reads is a knob that does
nothing, and its help text a promise nobody keeps (issue 15)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import re
from pathlib import Path

import pytest

from trainer.config import PRESETS, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_FILE = ROOT / "app" / "config.py"


# what a config is called where it is read: `config.x`, `cfg.x`, `self.config.x`,
# `job.config["x"]`, `spec.x` (ModelSpec.from_config copies the model fields), `settings.x`.
# A read of the same name on anything else (`tensor.device`, `user.name`) does not count.
CONFIG_RECEIVER = re.compile(r"(^|_)(config|cfg|spec|settings)$", re.IGNORECASE)


def _receiver(node: ast.expr) -> str:
    """The name a read is made on: `cfg` in `cfg.x`, `config` in `self.config.x`,
    `get_settings` in `get_settings().x`."""
    if isinstance(node, ast.Call):
        return _receiver(node.func)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


@functools.cache  # parsed once for all the parametrized fields below (about 0.7 s a parse)
def _attributes_read() -> set[str]:
    """Names read from a config: as attributes (`cfg.name`) or as string keys
    (`config["name"]`, `config.get("name")`) anywhere in the code that runs jobs: trainer/,
    worker/, app/ (config.py itself excluded)."""
    seen: set[str] = set()
    for package in ("trainer", "worker", "app"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "trainer" / "config.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    name, receiver = node.attr, node.value
                elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                    name, receiver = str(node.slice.value), node.value
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "get" and node.args
                      and isinstance(node.args[0], ast.Constant)):
                    name, receiver = str(node.args[0].value), node.func.value
                else:
                    continue
                receiver_name = _receiver(receiver)
                # the settings' own resolved_* properties read their fields off `self`
                if CONFIG_RECEIVER.search(receiver_name) or (
                        path == SETTINGS_FILE and receiver_name == "self"):
                    seen.add(name)
    return seen


def test_a_name_read_on_something_else_does_not_count():
    """The rule above, on a field nothing reads: `device` read off a tensor is not a read of
    the config's `device`."""
    code = "x = tensor.device\ny = user.name\nz = self.config.seed\nw = spec.lora_rank\n"
    reads = {node.attr for node in ast.walk(ast.parse(code))
             if isinstance(node, ast.Attribute) and CONFIG_RECEIVER.search(_receiver(node.value))}
    assert reads == {"seed", "lora_rank"}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TrainConfig)])
def test_every_train_config_field_is_read(name):
    assert name in _attributes_read(), f"TrainConfig.{name} is read nowhere"


def _other_config_fields() -> list[str]:
    """Every field of the other configs a user sets: the sampling and fit jobs' configs, the
    preference fit's FitConfig, the server's Settings, and the shapes base model's training
    recipe and architecture (`python -m trainer train-base`)."""
    from app.config import Settings
    from app.job_kinds import EvaluateConfig, FitPreferenceConfig, RolloutConfig
    from trainer.models.shapes_dit import ShapesDiTConfig
    from trainer.rewards.preference import FitConfig
    from trainer.shapes.base_training import BaseTrainingConfig

    out = [f"{model.__name__}.{name}" for model in (RolloutConfig, EvaluateConfig,
                                                     FitPreferenceConfig, Settings)
           for name in model.model_fields]
    return out + [f"{config.__name__}.{f.name}"
                  for config in (FitConfig, BaseTrainingConfig, ShapesDiTConfig)
                  for f in dataclasses.fields(config)]


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


def test_the_papers_flux_objectives_are_presets_of_flux_loras_setting():
    """HPSv2.1 alone and HPSv2.1 + PickScore + ImageReward at equal weights (the paper's two
    FLUX.1-dev objectives), otherwise flux-lora's setting."""
    from trainer.config import load_config

    lora = load_config("flux-lora", {"model_path": "/models/flux"}).to_dict()
    for name, weights in (("flux-hpsv2", {"hpsv2": 1.0}),
                          ("flux-multi-reward", {"hpsv2": 1.0, "pickscore": 1.0,
                                                 "imagereward": 1.0})):
        config = load_config(name, {"model_path": "/models/flux"}).to_dict()
        assert config.pop("reward_weights") == weights, name
        assert config == {k: v for k, v in lora.items() if k != "reward_weights"}, name


def test_the_rollouts_record_how_each_method_samples():
    """The rollouts pages show a group's solver and sigma: the SDE baseline's are its own
    stochastic steps and independent noises, not the Neighbor GRPO fields it never reads."""
    from trainer.config import PRESETS, TrainConfig

    assert TrainConfig.from_dict({"sigma": 0.2}).rollout_sampler() == ("dpm++", 0.2)
    assert TrainConfig.from_dict(PRESETS["sde-baseline"]).rollout_sampler() == ("sde", 1.0)
    assert TrainConfig.from_dict({"method": "neighbor", "rollout_solver": "euler"}
                                 ).rollout_sampler() == ("euler", 0.3)


@pytest.mark.parametrize("field,value", [("torch_compile", 1), ("gradient_checkpointing", "yes"),
                                         ("finetune", "half"), ("mixed_precision", "fp8")])
def test_a_value_of_the_wrong_type_is_named_once(field, value):
    """`torch_compile=1` was two errors: its type, and "model 'shapes' is not compiled" as
    if the value had been taken; a field whose value is itself wrong is named by that alone."""
    problems = TrainConfig(**{**PRESETS["tiny"], field: value}).problems()
    assert [p.field for p in problems] == [field], problems


def test_cli_overrides_turning_checkpointing_off_drop_the_presets_fraction():
    """`train --set model=flux --set gradient_checkpointing=false` (load_config, as the CLI
    calls it) was refused naming gradient_checkpointing_fraction 0.25, flux-lora's."""
    from trainer.config import load_config

    assert PRESETS["flux-lora"]["gradient_checkpointing_fraction"] < 1
    config = load_config(None, {"model": "flux", "model_path": "/nowhere", "prompts": ["a"],
                                "gradient_checkpointing": False})
    assert not config.gradient_checkpointing
    assert config.gradient_checkpointing_fraction == 1.0
    assert load_config("flux-lora", {"model_path": "/nowhere", "prompts": ["a"]}
                       ).gradient_checkpointing_fraction == 0.25  # on: the preset's share


def test_prompts_that_are_not_strings_are_each_named():
    """`prompts: ["a", null, 5]` said "must be a list of strings", naming none of them."""
    from trainer.config import ConfigErrors, load_config

    with pytest.raises(ConfigErrors) as caught:
        load_config("tiny", {"prompts": ["one red circle", None, 5, ["x"]]})
    said = {e.field: e.message for e in caught.value.errors}
    assert said["prompts"] == ("must be a list of strings: prompt 2 is null; prompt 3 is 5; "
                               'prompt 4 is ["x"]'), said


def test_a_config_file_naming_flux_or_sd3_starts_from_its_lora_preset(tmp_path):
    """A JSON --config file naming "model": "flux" started from the field defaults (a full
    fine-tune of the 12B transformer at lr 1e-6, no checkpointing), where --set model=flux
    started from flux-lora; the file's own fields still win over the preset's."""
    from trainer.config import PRESETS, load_config

    for model in ("flux", "sd3"):
        file = tmp_path / f"{model}.json"
        file.write_text(json.dumps({"model": model, "model_path": "/models/m", "prompts": ["a"],
                                    "group_size": 6}))
        from_file = load_config(str(file))
        from_set = load_config(None, {"model": model, "model_path": "/models/m",
                                      "prompts": ["a"], "group_size": 6})
        assert from_file.to_dict() == from_set.to_dict()
        assert from_file.finetune == "lora" == PRESETS[f"{model}-lora"]["finetune"]
        assert from_file.learning_rate == PRESETS[f"{model}-lora"]["learning_rate"]
        assert from_file.group_size == 6
    # a preset named on the command line stays the base: the file is not read for one
    assert load_config("tiny", {"model": "shapes"}).iterations == PRESETS["tiny"]["iterations"]
