"""benchmarks/shapes_base_samples.py: the README's figure of what the shipped base draws."""

from __future__ import annotations

import numpy as np
from benchmark_scripts import load_benchmark
from PIL import Image


def test_figure_holds_a_render_then_the_base_samples_of_every_fifth_prompt(tmp_path):
    from trainer.evaluation import sample_images
    from trainer.models import SHAPES_BASE
    from trainer.models.shapes_dit import ShapesDiT
    from trainer.shapes.world import all_prompts

    figure = load_benchmark("shapes_base_samples")
    out = tmp_path / "samples.png"
    figure.main(["--out", str(out), "--seeds", "2"])
    image = np.asarray(Image.open(out).convert("RGB"))
    side, gap = 32 * figure.SCALE, figure.GAP
    prompts = all_prompts()[::5]
    assert image.shape == (len(prompts) * (side + gap), 3 * (side + gap) + 4 * gap, 3)
    # the cell of prompt 5's seed 1 is the base's sample of it, upscaled without blur
    sample = sample_images(ShapesDiT.load(SHAPES_BASE, "cpu"), [prompts[1]], [1])[0]
    x, y = 2 * (side + gap) + 4 * gap, side + gap
    cell = image[y:y + side, x:x + side]
    assert np.array_equal(cell[::figure.SCALE, ::figure.SCALE], sample)
