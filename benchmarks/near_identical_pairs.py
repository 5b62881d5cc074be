"""How many within-group pairs of the shipped shapes base show one picture twice, and how many
of them the arena's near-identical rule keeps from annotators (issue 18: "pairs from one group
often look the same to the eye").

Rollout groups as the demo's base rollouts draw them (G = 12, sigma 0.3, DPM++ 8 steps), one per
(prompt, seed) for the 48 shapes prompts and --seeds seeds. A pair shows "the same picture"
when its two images hold the same objects, each of one colour and shape, within 1.5 pixels and
30% of its area (trainer.rewards.shapes.same_objects). For each pixel threshold (the share of
pixels differing by more than PIXEL_TOLERANCE in a channel, the server's first test) it prints
the pairs skipped, the same-picture pairs still offered, and the different pictures skipped;
then the server's rule as it is (app.services.votes.near_identical: the pixel test, or the same
objects for 32x32 shapes pictures).

    python benchmarks/near_identical_pairs.py --seeds 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from app.services.votes import NEAR_IDENTICAL_FRACTION, PIXEL_TOLERANCE
from trainer.grpo import group_noises
from trainer.models import ModelSpec, load_flow_model
from trainer.models.base import repeat_cond, to_uint8
from trainer.rewards.shapes import picture_objects, same_objects
from trainer.shapes.world import all_prompts
from trainer.solvers import rollout

THRESHOLDS = (0.01, 0.015, 0.02, 0.03, 0.04, 0.05)


def base_groups(seeds: int, group_size: int, device: str, prompt_count: int = 0) -> np.ndarray:
    """(groups, G, 32, 32, 3) uint8 from the shipped base, for the first `prompt_count` shapes
    prompts (0: all 48)."""
    model = load_flow_model(ModelSpec(name="shapes"), device=device)
    prompts = all_prompts()[:prompt_count or None]
    out = []
    for round_ in range(seeds):
        noise_seeds = [1000 + 500 * round_ + i for i in range(len(prompts))]
        noises = group_noises(noise_seeds, group_size, 0.3, model.latent_shape,
                              torch.device(device))
        cond = repeat_cond(model.encode_prompts(prompts), group_size)
        with torch.no_grad():
            final = rollout("dpm++", model, noises.flatten(0, 1), cond, 8).final
        images = to_uint8(model.decode(final))
        out.append(images.reshape(len(prompts), group_size, *images.shape[1:]))
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="groups per prompt")
    parser.add_argument("--group-size", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=0,
                        help="the first N of the 48 shapes prompts (default 0: all of them)")
    args = parser.parse_args()
    start = time.perf_counter()
    groups = base_groups(args.seeds, args.group_size, args.device, args.prompts)
    fractions, same = [], []
    for group in groups:
        pixels = group.astype(np.int16)
        objects = [picture_objects(image) for image in group]
        for i, j in itertools.combinations(range(len(group)), 2):
            differs = np.abs(pixels[i] - pixels[j]).max(-1) > PIXEL_TOLERANCE
            fractions.append(float(differs.mean()))
            same.append(same_objects(objects[i], objects[j]))
    frac, same_ = np.array(fractions), np.array(same)
    rows = []
    for threshold in THRESHOLDS:
        skipped = frac < threshold
        rows.append({"pixel_threshold": threshold, "skipped": round(float(skipped.mean()), 4),
                     "same_picture_share_of_offered": round(float(
                         (same_ & ~skipped).sum() / max(1, (~skipped).sum())), 4),
                     "different_pictures_skipped": round(float(
                         (~same_ & skipped).sum() / max(1, (~same_).sum())), 4)})
        print(json.dumps(rows[-1]), flush=True)
    server = (frac < NEAR_IDENTICAL_FRACTION) | same_
    summary = {"groups": len(groups), "pairs": len(frac),
               "same_picture_share": round(float(same_.mean()), 4),
               "server_rule_skipped": round(float(server.mean()), 4),
               "server_rule_same_picture_share_of_offered": round(float(
                   (same_ & ~server).sum() / max(1, (~server).sum())), 4),
               "seconds": round(time.perf_counter() - start, 1), "thresholds": rows}
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main()
