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
    weights_file_problem,
)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_checkpoint_rebuilds_from_its_weights_file(tmp_path, finetune):
    flux = write_tiny_flux(tmp_path / "flux")
    config = TrainConfig.from_dict({
        **PRESETS["tiny"], "device": "cpu", "model": "flux", "model_path": str(flux), "prompts": ["a red apple"],
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


def test_damaged_weights_files_are_found_from_their_headers(tmp_path):
    """`weights_file_problem` finds what a truncated copy or download leaves (the tensors run
    past the file's end, a torch zip without its closing directory, an empty file, JSON cut
    short) without loading anything; whole files pass. A model directory holding one is
    named incomplete in the same words, before a job would load it."""
    from safetensors.torch import save_file

    tensors = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(64, 64), "b": torch.ones(8)}, str(tensors))
    torch.save({"a": torch.zeros(64, 64)}, tmp_path / "w.pt")
    (tmp_path / "c.json").write_text('{"hidden_size": 8}')
    for name in ("w.safetensors", "w.pt", "c.json"):
        assert weights_file_problem(tmp_path / name) is None, name
    whole = {name: (tmp_path / name).read_bytes() for name in ("w.safetensors", "w.pt", "c.json")}
    for name, data in whole.items():
        (tmp_path / name).write_bytes(data[: len(data) - 100 if len(data) > 200 else 5])
    problem = weights_file_problem(tensors)
    assert problem.startswith(f"{tensors} is truncated: its header describes "), problem
    assert "is truncated: a torch checkpoint" in weights_file_problem(tmp_path / "w.pt")
    assert str(tmp_path / "c.json") in weights_file_problem(tmp_path / "c.json")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert weights_file_problem(tmp_path / "empty.bin") == f"{tmp_path / 'empty.bin'} is empty"

    flux = write_tiny_flux(tmp_path / "flux")
    assert model_dir_problem("flux", flux) is None
    shard = sorted((flux / "transformer").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    problem = model_dir_problem("flux", flux)
    assert problem.startswith(f"model directory {flux} has damaged files: {shard} is truncated")


def test_a_file_deleted_while_its_directory_is_checked_is_said_missing(tmp_path, monkeypatch):
    """A model file removed between the presence check and the reading of the files was
    said "damaged: cannot be read (No such file)" without the files a directory holds; it is
    missing, said as a missing file is."""
    import trainer.models as models

    flux = write_tiny_flux(tmp_path / "flux")
    vae_config = flux / "vae" / "config.json"
    reads = models.weights_file_problem

    def vanishing(path):
        if path == vae_config:
            path.unlink()  # gone just as it is read
        return reads(path)

    monkeypatch.setattr(models, "weights_file_problem", vanishing)
    problem = model_dir_problem("flux", flux)
    assert problem.startswith(f"model directory {flux} is incomplete for 'flux': missing "
                              "vae/config.json (a diffusers-format directory holds "
                              "model_index.json"), problem


def test_a_weights_file_is_read_a_tensor_at_a_time(tmp_path):
    """`WeightsFile` names a file's tensors (with a prefix) and reads each when asked, cast
    to its dtype; `copy_weights` fills a module from it holding one tensor of the file at a
    time (a sharded FLUX.1 checkpoint is 48 GB that every rank reads), and names the
    missing and unexpected keys of a file that does not fit."""
    import weakref
    from collections.abc import Mapping

    from safetensors.torch import save_file

    from trainer.models.base import WeightsFile, copy_weights

    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    weights = WeightsFile(tmp_path / "w.safetensors", prefix="net.", dtype=torch.bfloat16)
    assert sorted(weights) == sorted(f"net.{k}" for k in state) and len(weights) == 4
    assert weights["net.0.weight"].dtype == torch.bfloat16
    with pytest.raises(KeyError):
        weights["0.weight"]  # without the prefix

    class Watched(Mapping):
        """The file's tensors, noting how many handed-out ones are alive at each read."""

        def __init__(self) -> None:
            self.file, self.alive, self.most_alive = WeightsFile(tmp_path / "w.safetensors"), [], 0

        def __getitem__(self, key):
            self.alive = [ref for ref in self.alive if ref() is not None]
            self.most_alive = max(self.most_alive, len(self.alive) + 1)
            tensor = self.file[key]
            self.alive.append(weakref.ref(tensor))
            return tensor

        def __iter__(self):
            return iter(self.file)

        def __len__(self):
            return len(self.file)

    watched = Watched()
    copy_weights(module, watched, "w.safetensors")
    assert all(torch.equal(module.state_dict()[k], v) for k, v in state.items())
    assert watched.most_alive == 1
    # load_state_dict gathers its argument first: every tensor alive at once
    gathering = Watched()
    module.load_state_dict(dict(gathering))
    assert gathering.most_alive == 4
    with pytest.raises(ValueError, match=r"w.safetensors does not fit this model: missing "
                                         r"\['0.bias', '0.weight'.*unexpected \['net.0.bias'"):
        copy_weights(module, WeightsFile(tmp_path / "w.safetensors", prefix="net."),
                     "w.safetensors")


def test_a_resume_places_each_optimizer_tensor_before_reading_the_next(tmp_path):
    """The trainer state's Adam moments are read one at a time and handed to the model's
    placement (a sharded model keeps its shard) at once: never the whole file in memory."""
    import weakref

    from safetensors.torch import save_file

    from trainer.loop import _optimizer_state
    from trainer.models.base import WeightsFile

    moments = {f"state.{i}.{key}": torch.randn(8, 4) for i in range(3)
               for key in ("exp_avg", "exp_avg_sq")}
    save_file({**moments, "state.0.step": torch.tensor(5.0), "rng_state": torch.zeros(4,
               dtype=torch.uint8)}, str(tmp_path / "state.safetensors"))
    read = WeightsFile(tmp_path / "state.safetensors")
    alive: list[weakref.ref] = []
    most_alive = 0

    def place(tensor: torch.Tensor, index: int) -> torch.Tensor:
        nonlocal most_alive
        alive[:] = [ref for ref in alive if ref() is not None]
        alive.append(weakref.ref(tensor))
        most_alive = max(most_alive, len(alive))
        return tensor[:2].clone()  # "this rank's shard"

    state = _optimizer_state(read, {"param_groups": []}, place)
    assert most_alive == 1
    assert sorted(state["state"]) == [0, 1, 2]
    assert torch.equal(state["state"][1]["exp_avg"], moments["state.1.exp_avg"][:2])
    assert float(state["state"][0]["step"]) == 5.0


def test_a_file_of_another_format_is_named_by_its_format_not_its_metadata(tmp_path):
    """A preference model given where a shapes checkpoint goes printed its whole metadata (a
    kilobyte of JSON) in the error."""
    from safetensors.torch import save_file

    from trainer.models.shapes_dit import checkpoint_config

    path = tmp_path / "pref.safetensors"
    save_file({"w": torch.zeros(1)}, str(path),
              metadata={"format": "preference-model", "config": "x" * 1000})
    with pytest.raises(ValueError) as refused:
        checkpoint_config(path)
    message = str(refused.value)
    assert "its format is 'preference-model'" in message and len(message) < 200 + len(str(path))
