"""A checkpoint is named by its weights file (what the studio records and downloads): the
registry finds the checkpoint directory and the run's model from any of them, a full
fine-tune's transformer file (one folder down) included."""

from __future__ import annotations

import pytest
import torch
from tiny_diffusers import write_tiny_flux

from trainer import PRESETS, TrainConfig, Trainer
from trainer.models import (
    FULL_TRANSFORMER,
    LORA_WEIGHTS,
    checkpoint_directory,
    checkpoint_spec,
    checkpoint_weights_file,
    load_checkpoint_model,
    model_dir_problem,
)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_checkpoint_rebuilds_from_its_weights_file(tmp_path, finetune):
    flux = write_tiny_flux(tmp_path / "flux")
    config = TrainConfig.from_dict({
        **PRESETS["tiny"], "device": "cpu", "model": "flux", "model_path": str(flux),
        "finetune": finetune, "lora_rank": 4, "resolution": 32, "iterations": 1,
        "learning_rate": 1e-3, "reward_weights": {"jpeg_compressibility": 1.0}})
    trainer = Trainer(config)
    trainer.step()
    directory = trainer.save_checkpoint(tmp_path / "ckpts")
    weights = checkpoint_weights_file(directory)
    assert weights == directory / (LORA_WEIGHTS if finetune == "lora" else FULL_TRANSFORMER)
    assert checkpoint_directory(weights) == directory == checkpoint_directory(directory)
    spec = checkpoint_spec(weights)
    assert (spec.name, spec.finetune, spec.path, spec.resolution) == (
        "flux", finetune, str(flux), 32)
    model = load_checkpoint_model(weights)
    trained = dict(trainer.model.transformer.named_parameters())
    for name, param in model.transformer.named_parameters():  # the trained weights, not the base
        torch.testing.assert_close(param.float(), trained[name].detach().float())


def test_a_missing_model_directory_names_what_it_should_hold(tmp_path):
    problem = model_dir_problem("flux", tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in problem and "does not exist" in problem
    assert "model_index.json" in problem and "tokenizer_2" in problem
