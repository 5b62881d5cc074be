"""A picture of what shapes checkpoints draw: one block per checkpoint, one row per prompt
(a reference render, then `--seeds` samples from the same noises in every block), stacked
top to bottom in the order given, 4x nearest-neighbour upscaled.

Usage: python benchmarks/shapes_grid.py OUT.png CHECKPOINT [CHECKPOINT ...] [--device cuda]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from trainer.evaluation import sample_images
from trainer.models.shapes_dit import ShapesDiT
from trainer.shapes.world import all_prompts, render_batch

# every count, colour and shape at least once: prompts 0, 5, 10, ... of the fixed order
PROMPT_STRIDE = 5
GAP = 4  # pixels of black between the reference column and the samples, and between blocks


def checkpoint_block(path: str, prompts: list[str], seeds: int, device: str, solver: str,
                     steps: int) -> np.ndarray:
    model = ShapesDiT.load(path, device=device)
    images = sample_images(model, [p for p in prompts for _ in range(seeds)],
                           [s for _ in prompts for s in range(seeds)], solver, steps)
    references = render_batch(prompts, np.random.default_rng(0))
    rows = []
    for i, reference in enumerate(references):
        samples = images[i * seeds:(i + 1) * seeds]
        rows.append(np.concatenate([reference, np.zeros((32, GAP, 3), np.uint8), *samples], axis=1))
    return np.concatenate(rows, axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--solver", default="dpm++")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    prompts = all_prompts()[::PROMPT_STRIDE]
    blocks = [checkpoint_block(c, prompts, args.seeds, args.device, args.solver, args.steps)
              for c in args.checkpoints]
    width = blocks[0].shape[1]
    separator = np.zeros((GAP, width, 3), np.uint8)
    grid = np.concatenate([part for block in blocks for part in (block, separator)][:-1], axis=0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(args.out)
    print(f"{args.out}: {len(blocks)} checkpoint(s) x {len(prompts)} prompts x {args.seeds} seeds")


if __name__ == "__main__":
    main()
