"""The shipped shapes base's samples as one figure (docs/figures/shapes_base_samples.png): a
row for every 5th of the 48 prompts, first a render of the prompt by the world itself, then
the base's samples for seeds 0..7 (DPM++ 8 steps, as `trainer evaluate` samples), each image
upscaled without blur. CPU is enough (80 images).

    python benchmarks/shapes_base_samples.py [--checkpoint PATH] [--out PNG]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCALE = 4  # 32x32 -> 128x128 per image
GAP = 2  # pixels between images (black), and a wider bar after the render column


def main(argv: list[str] | None = None) -> None:
    from PIL import Image

    from trainer.evaluation import sample_images
    from trainer.models import SHAPES_BASE
    from trainer.models.shapes_dit import ShapesDiT
    from trainer.shapes.world import all_prompts, render

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(SHAPES_BASE), help="shapes model.safetensors")
    parser.add_argument("--out", default="docs/figures/shapes_base_samples.png")
    parser.add_argument("--seeds", type=int, default=8, help="samples per prompt")
    args = parser.parse_args(argv)

    prompts = all_prompts()[::5]
    model = ShapesDiT.load(args.checkpoint, "cpu")
    images = sample_images(model, [p for p in prompts for _ in range(args.seeds)],
                           [s for _ in prompts for s in range(args.seeds)])
    rng = np.random.default_rng(0)
    side = 32 * SCALE
    width = (args.seeds + 1) * (side + GAP) + 4 * GAP
    canvas = Image.new("RGB", (width, len(prompts) * (side + GAP)), "black")
    for row, prompt in enumerate(prompts):
        cells = [render(prompt, rng)[0]] + [images[row * args.seeds + s] for s in range(args.seeds)]
        for col, cell in enumerate(cells):
            x = col * (side + GAP) + (4 * GAP if col else 0)
            tile = Image.fromarray(np.asarray(cell, dtype=np.uint8)).resize((side, side),
                                                                             Image.NEAREST)
            canvas.paste(tile, (x, row * (side + GAP)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    canvas.save(args.out)
    print(f"wrote {args.out}: {len(prompts)} prompts x {args.seeds} seeds from {args.checkpoint}")


if __name__ == "__main__":
    main()
