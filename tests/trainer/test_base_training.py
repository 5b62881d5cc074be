"""The shapes base model's architecture options and its training (`train-base`)."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from trainer.models.shapes_dit import DiTBlock, ShapesDiT, ShapesDiTConfig, sincos_positions
from trainer.shapes.base_training import BaseTrainingConfig, render_pool, train_base
from trainer.shapes.world import all_prompts, tokenize


def _neighbour_response(block: DiTBlock, grid: int, token: int) -> torch.Tensor:
    """How much each image token of the MLP's output moves when one image token's input does."""
    torch.manual_seed(0)
    h = torch.randn(1, 3 + grid * grid, block.norm1.normalized_shape[0])
    bumped = h.clone()
    bumped[0, 3 + token] += 1.0
    with torch.no_grad():
        delta = (block.feed_forward(bumped) - block.feed_forward(h)).abs().sum(-1)[0, 3:]
    return delta.reshape(grid, grid)


def test_mlp_conv_mixes_neighbouring_patches_and_nothing_further():
    """The first bases' samples were patch-sized specks: each patch drawn from its own noise.
    mlp_conv makes every block's MLP reach the 8 neighbouring patches (and only those)."""
    grid, token = 8, 3 * 8 + 4  # row 3, column 4
    plain = _neighbour_response(DiTBlock(32, 4, 4.0), grid, token)
    local = _neighbour_response(DiTBlock(32, 4, 4.0, grid=grid), grid, token)
    assert plain[3, 4] > 0 and plain.sum() == plain[3, 4]  # a plain MLP: the token alone
    rows, cols = np.nonzero(local.numpy() > 0)
    assert sorted(set(rows)) == [2, 3, 4] and sorted(set(cols)) == [3, 4, 5]
    assert len(rows) == 9


def test_every_gradient_is_laid_out_like_its_weight():
    """DDP copies a gradient whose strides differ from its parameter's into its bucket every
    step ("Grad strides do not match bucket view strides"); mlp_conv's depthwise weight got a
    channels-last gradient from a channels-last view of its input."""
    block = DiTBlock(32, 4, 4.0, grid=4)
    block.feed_forward(torch.randn(2, 3 + 16, 32)).square().sum().backward()
    assert {name: p.grad.stride() for name, p in block.named_parameters() if p.grad is not None
            } == {name: p.stride() for name, p in block.named_parameters() if p.grad is not None}


def test_sincos_positions_are_fixed_and_closer_for_neighbours():
    pos = sincos_positions(8, 64)
    assert pos.shape == (64, 64)
    distance = lambda a, b: float((pos[a] - pos[b]).norm())  # noqa: E731
    assert distance(0, 1) < distance(0, 7) and distance(0, 8) < distance(0, 56)
    model = ShapesDiT(ShapesDiTConfig(width=64, depth=1, position_embedding="sincos"))
    assert "patch_pos" not in dict(model.named_parameters())  # not trained
    assert "patch_pos" not in model.state_dict()  # nor stored: rebuilt from the config


def test_bad_position_embedding_is_refused():
    with pytest.raises(ValueError, match="position_embedding"):
        ShapesDiT(ShapesDiTConfig(position_embedding="rope"))


def test_render_pool_matches_its_prompts():
    images, tokens = render_pool(40, np.random.default_rng(0), "cpu")
    assert images.shape == (40, 3, 32, 32) and images.dtype == torch.uint8
    assert tokens.shape == (40, 3)
    known = {tuple(t) for t in tokenize(all_prompts())}
    assert {tuple(t) for t in tokens.tolist()} <= known
    assert (images < 250).any(dim=(1, 2, 3)).all()  # every image has an object on it


@pytest.mark.parametrize("pool_size", [0, 64])
def test_train_base_writes_a_loadable_checkpoint_with_its_recipe(tmp_path, pool_size):
    """A few steps of the shipped recipe (mlp_conv, xavier, sincos) from the pool or from fresh
    renders: the loss is logged and falls from the first steps, the EMA checkpoint loads with its
    architecture, and its training config rides in the metadata."""
    config = BaseTrainingConfig(steps=12, batch_size=16, warmup_steps=2, log_every=4,
                                save_every=6, pool_size=pool_size, ema_decay=0.5)
    model_config = ShapesDiTConfig(width=32, depth=2, mlp_conv=True, xavier_init=True,
                                   position_embedding="sincos")
    path = train_base(tmp_path, config, model_config, device="cpu", log=lambda _: None)
    lines = [json.loads(x) for x in (tmp_path / "train_base_log.jsonl").read_text().splitlines()]
    assert lines[0]["config"]["pool_size"] == pool_size and lines[0]["model"]["mlp_conv"] is True
    losses = [r["loss"] for r in lines[1:]]
    assert [r["step"] for r in lines[1:]] == [4, 8, 12]
    assert losses[-1] < losses[0], losses
    model = ShapesDiT.load(path)
    assert model.config.mlp_conv and model.config.position_embedding == "sincos"
    assert (tmp_path / "base-step6.safetensors").exists()
    out = model(torch.randn(2, 3, 32, 32), torch.rand(2), model.encode_prompts(["one red circle"] * 2))
    assert out.shape == (2, 3, 32, 32) and torch.isfinite(out).all()


def test_a_checkpoint_from_before_the_options_loads_as_it_was_trained(tmp_path):
    """The first base's checkpoints carry no position_embedding / mlp_conv / xavier_init in
    their metadata: they load with a learned position table and plain MLPs."""
    from safetensors.torch import save_file

    from trainer.models.shapes_dit import LEGACY_CONFIG

    old = ShapesDiT(ShapesDiTConfig(width=32, depth=1, **LEGACY_CONFIG))
    config = {k: v for k, v in asdict(old.config).items() if k not in LEGACY_CONFIG}
    path = tmp_path / "old.safetensors"
    save_file({k: v.contiguous() for k, v in old.state_dict().items()}, str(path),
              metadata={"format": "shapes-dit", "config": json.dumps(config)})
    loaded = ShapesDiT.load(path)
    assert (loaded.config.position_embedding, loaded.config.mlp_conv) == ("learned", False)
    assert torch.equal(loaded.patch_pos, old.patch_pos)


def test_train_base_defaults_to_the_shipped_recipe(tmp_path):
    from trainer.cli import main

    assert main(["train-base", "--out", str(tmp_path / "a"), "--steps", "2", "--batch-size", "4",
                 "--pool-size", "8", "--width", "32", "--depth", "1", "--device", "cpu"]) == 0
    made = ShapesDiT.load(tmp_path / "a" / "base.safetensors").config
    assert (made.position_embedding, made.mlp_conv, made.xavier_init) == ("sincos", True, True)
    assert BaseTrainingConfig().steps == 8000 and BaseTrainingConfig().pool_size == 300_000
    # every option not given is the dataclasses' default, as the log's first line records it
    logged = json.loads((tmp_path / "a" / "train_base_log.jsonl").read_text().splitlines()[0])
    given = {"steps": 2, "batch_size": 4, "pool_size": 8}
    assert logged["config"] == {**asdict(BaseTrainingConfig()), **given}
    assert logged["model"] == {**asdict(ShapesDiTConfig()), "width": 32, "depth": 1}
    assert main(["train-base", "--out", str(tmp_path / "b"), "--steps", "2", "--batch-size", "4",
                 "--pool-size", "0", "--width", "32", "--depth", "1", "--device", "cpu",
                 "--no-mlp-conv", "--position-embedding", "learned"]) == 0
    made = ShapesDiT.load(tmp_path / "b" / "base.safetensors").config
    assert (made.position_embedding, made.mlp_conv, made.xavier_init) == ("learned", False, True)


def test_train_base_help_states_the_dataclasses_defaults():
    """The parser cannot import the dataclasses (building it must not import torch), so its
    help repeats their defaults as text: each stated default is the one a run gets."""
    import re

    from trainer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["train-base"]
    defaults = {**asdict(BaseTrainingConfig()), **asdict(ShapesDiTConfig())}
    field = {"lr": "learning_rate"}
    checked = set()
    for action in sub._actions:
        stated = re.search(r"default ([^):;]+)", action.help or "")
        if not stated or action.dest in ("help", "device"):
            continue
        text = stated.group(1).strip().replace(",", "")
        value = defaults[field.get(action.dest, action.dest)]
        expected = {"on": True, "off": False}.get(text, text)
        if isinstance(value, bool) or isinstance(expected, bool):
            assert value is expected, action.dest
        elif isinstance(value, int | float):
            assert float(expected) == value, (action.dest, text, value)
        else:
            assert expected == value, (action.dest, text, value)
        checked.add(action.dest)
    assert {"steps", "batch_size", "lr", "width", "depth", "seed", "patch_size", "ema_decay",
            "time_sampling", "save_every", "position_embedding", "mlp_conv", "xavier_init",
            "pool_size"} <= checked
