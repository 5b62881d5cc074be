import pytest
import torch

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
