"""What the trainer writes is readable as the process's umask allows, as any file open()
makes: safetensors writes through a temporary file created 0600 (its issue #782), so a
checkpoint's weights, a LoRA, train-base's base and a fitted preference model were readable
by their writer alone (the CLI audit, 2026-12-07), and the model card's load_lora_weights
failed for anyone else."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode)
            for p in directory.rglob("*") if p.is_file()}


def test_a_checkpoint_and_a_saved_model_are_readable_by_others(tmp_path, umask_022):
    from trainer import PRESETS, TrainConfig, Trainer
    from trainer.models.shapes_dit import ShapesDiT, ShapesDiTConfig

    config = TrainConfig.from_dict({**PRESETS["tiny"], "iterations": 1, "device": "cpu"})
    trainer = Trainer(config)
    checkpoint = trainer.save_checkpoint(tmp_path / "checkpoints")
    modes = _modes(checkpoint)
    assert {"model.safetensors", "trainer_state.safetensors", "README.md"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes
    base = tmp_path / "base.safetensors"
    ShapesDiT(ShapesDiTConfig(width=16, depth=1, heads=2)).save(base)
    assert stat.S_IMODE(base.stat().st_mode) == 0o644


def test_a_fitted_preference_model_is_readable_by_others(tmp_path, umask_022):
    from trainer.rewards.preference import FitConfig, PreferenceModel

    path = tmp_path / "pref.safetensors"
    PreferenceModel(FitConfig(ensemble=1, width=8, device="cpu")).save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
