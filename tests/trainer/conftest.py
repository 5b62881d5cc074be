"""Models the trainer's tests share: the shipped shapes base, a tiny shapes DiT, and tiny
FLUX.1-dev, FLUX.1-schnell, SD3 and SD3.5 directories built in code (tests/tiny_diffusers.py),
written once per test module."""

import pytest
import torch
from tiny_diffusers import write_tiny_flux, write_tiny_sd3

from trainer.models import SHAPES_BASE
from trainer.models.shapes_dit import ShapesDiT, ShapesDiTConfig


@pytest.fixture(scope="session")
def base_model() -> ShapesDiT:
    return ShapesDiT.load(SHAPES_BASE)


@pytest.fixture
def tiny_model() -> ShapesDiT:
    torch.manual_seed(0)
    model = ShapesDiT(ShapesDiTConfig(width=32, depth=2, heads=2))
    # adaLN-Zero starts at zero velocity; give the tiny model a non-trivial field
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux_dev"))


@pytest.fixture(scope="module")
def flux_schnell(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux_schnell"), guidance_embeds=False)


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3"))


@pytest.fixture(scope="module")
def sd35(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd35"), sd35=True)
