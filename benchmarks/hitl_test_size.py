"""The humans-in-the-loop end-to-end test's setting, in-process, over many vote seeds: how
reliably does training on a small campaign move the annotators' attribute?

tests/worker/test_worker_hitl.py runs one campaign per preference through the real API and
worker: 240 uniformly random within-group votes (3 annotators' worth, 10% flipped, no tie band)
on one rollout group per prompt of 12 prompts, a fit of 2 networks for 25 epochs, then training
on {"count": 1, "preference": W} for 100 iterations, and it asserts that the attribute rises on
a fixed eval set (the same noises before and after) by more than one standard error of the
paired difference, and that count stays within 0.02 of the base. This script runs the same
steps without the server, once per (preference, vote seed, KL coefficient), and prints one JSON
line each, so that the test's settings can be chosen by how often they pass rather than by one
lucky run.

    python benchmarks/hitl_test_size.py --preferences upper left --seeds 3 5 7 11 \
        --kl-coefficients 0 0.1 --preference-weights 1 0
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch
from hitl_simulated import Campaign, make_groups  # this directory (run as a script)

from trainer.config import TrainConfig
from trainer.evaluation import sample_images
from trainer.loop import Trainer, load_model
from trainer.rewards import compute_rewards
from trainer.rewards.attributes import PREFERENCES, attribute_values
from trainer.rewards.preference import FitConfig, fit_preference_model
from trainer.shapes.world import all_prompts


def paired_result(base_images: np.ndarray, images: np.ndarray, prompts: list[str],
                  attribute: str) -> dict:
    """The attribute's mean paired change (same noises), its standard error, and count."""
    moved = (attribute_values(attribute, images, prompts)
             - attribute_values(attribute, base_images, prompts))
    standard_error = float(moved.std(ddof=1) / np.sqrt(len(moved)))
    count = {name: float(compute_rewards(["count"], im, prompts)["count"].mean())
             for name, im in (("base", base_images), ("trained", images))}
    return {"attr_moved": round(float(moved.mean()), 4),
            "standard_errors": round(float(moved.mean()) / max(standard_error, 1e-12), 2),
            "base_count": round(count["base"], 4), "count": round(count["trained"], 4),
            "passes": bool(moved.mean() > standard_error
                           and count["trained"] >= count["base"] - 0.02)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preferences", nargs="+", default=["upper", "left"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[3, 5, 7, 11],
                    help="vote selection, annotator noise and fit seeds")
    ap.add_argument("--kl-coefficients", nargs="+", type=float, default=[0.0, 0.1])
    ap.add_argument("--prompts", type=int, default=12, help="every 4th shapes prompt")
    ap.add_argument("--votes", type=int, default=240)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--learning-rate", type=float, default=TrainConfig().learning_rate,
                    help="the e2e test trains at the default (1e-6)")
    ap.add_argument("--preference-weights", nargs="+", type=float, default=[1.0],
                    help="count's is 1; 0 is the control (count alone, with the same votes)")
    ap.add_argument("--eval-seeds", type=int, default=32, help="eval noises per prompt")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = load_model(TrainConfig())
    prompts = all_prompts()[::4][:args.prompts]
    pool = make_groups(base, prompts, list(range(1, len(prompts) + 1)), 8, "cpu")
    eval_prompts = [p for p in prompts for _ in range(args.eval_seeds)]
    eval_seeds = [1000 + i for i in range(len(eval_prompts))]
    base_images = sample_images(base, eval_prompts, eval_seeds)
    for preference in args.preferences:
        for seed in args.seeds:
            campaign = Campaign(preference, seed, tie_band=0.0)
            campaign.set_pool(pool, prompts, None)
            campaign.collect(args.votes, active=False)
            start = time.perf_counter()
            model = fit_preference_model(campaign.votes, FitConfig(
                epochs=25, ensemble=2, holdout_fraction=0.25, seed=seed), version=1)
            fit_s = time.perf_counter() - start
            for kl, weight in itertools.product(args.kl_coefficients, args.preference_weights):
                config = TrainConfig(
                    iterations=args.iterations, learning_rate=args.learning_rate,
                    kl_coefficient=kl, prompts=prompts, prompts_per_iteration=3, group_size=8,
                    num_anchors=4, num_train_timesteps=4, rollout_steps=8, device=args.device,
                    reward_weights={"count": 1.0, "preference": weight},
                    checkpoint_every=10**6, sample_every=10**6)
                trainer = Trainer(config)
                trainer.set_preference_model(model)
                start = time.perf_counter()
                trainer.run()
                images = sample_images(trainer.model.cpu(), eval_prompts, eval_seeds)
                print(json.dumps({
                    "preference": preference, "seed": seed, "kl": kl, "preference_weight": weight,
                    "heldout_accuracy": model.report.heldout_accuracy,
                    **paired_result(base_images, images, eval_prompts, PREFERENCES[preference]),
                    "fit_s": round(fit_s, 1),
                    "train_s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
