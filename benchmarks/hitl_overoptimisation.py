"""How fast a policy over-optimises a learned preference reward, with and without a KL penalty.

Fits a preference model on random votes of a simulated annotator (base-model samples only),
then trains count + preference from the shipped base at a deliberately high learning rate,
once per KL coefficient, and every few iterations reports on a fixed eval set: the annotator's
attribute, the count reward, the share of pixels that are not background (`foreground`), the
preference model's mean score on the eval images (`pref_score`) against the highest score of
any voted image (`voted_max`), and the KL to the base. A reward the policy has learned to fool
shows as a pref_score far above voted_max while the attribute falls.

    python benchmarks/hitl_overoptimisation.py --device cpu --kl-coefficients 0 0.03 0.3 10
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from hitl_simulated import Campaign, make_groups, measure  # this directory (run as a script)

from trainer.config import TrainConfig
from trainer.evaluation import sample_images
from trainer.loop import Trainer, load_model
from trainer.rewards.attributes import PREFERENCES
from trainer.rewards.preference import FitConfig, fit_preference_model
from trainer.shapes.world import all_prompts


def snapshot(model, reward_model, prompts, seeds, attr) -> dict:
    images = sample_images(model, prompts, seeds)
    return {**measure(images, prompts, attr),
            "pref_score": round(float(reward_model.scores(images, prompts).mean()), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preference", default="larger", choices=sorted(PREFERENCES))
    ap.add_argument("--votes", type=int, default=600, help="random votes on base samples")
    ap.add_argument("--ensemble", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--kl-coefficients", nargs="+", type=float, default=[0.0, 0.03, 0.3, 10.0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--every", type=int, default=8, help="report every N iterations")
    ap.add_argument("--learning-rate", type=float, default=2e-5)
    ap.add_argument("--preference-weight", type=float, default=1.0)
    args = ap.parse_args()
    dev, attr = args.device, PREFERENCES[args.preference]
    torch.manual_seed(0)
    base = load_model(TrainConfig()).to(dev)
    prompts = all_prompts()
    pool_prompts = [p for p in prompts for _ in range(2)]
    pool = make_groups(base, pool_prompts, list(range(len(pool_prompts))), 8, dev)
    campaign = Campaign(args.preference, seed=0, tie_band=0.05)
    campaign.set_pool(pool, pool_prompts, None)
    campaign.collect(args.votes, active=False)
    start = time.perf_counter()
    reward_model = fit_preference_model(campaign.votes, FitConfig(
        epochs=args.epochs, ensemble=args.ensemble, device=dev))
    voted = np.stack([v.image_a for v in campaign.votes] + [v.image_b for v in campaign.votes])
    voted_prompts = [v.prompt for v in campaign.votes] * 2
    voted_max = float(reward_model.scores(voted, voted_prompts).max())
    print(json.dumps({"fit_s": round(time.perf_counter() - start, 1),
                      "heldout_accuracy": reward_model.report.heldout_accuracy,
                      "voted_max": round(voted_max, 2)}), flush=True)
    eval_prompts = [p for p in prompts for _ in range(2)]
    eval_seeds = [5000 + i for i in range(len(eval_prompts))]
    print(json.dumps({"kl": None, "iteration": 0,
                      **snapshot(base, reward_model, eval_prompts, eval_seeds, attr)}), flush=True)
    for kl in args.kl_coefficients:
        config = TrainConfig(iterations=args.iterations, learning_rate=args.learning_rate,
                             device=dev, kl_coefficient=kl, checkpoint_every=10**6,
                             sample_every=10**6,
                             reward_weights={"count": 1.0, "preference": args.preference_weight})
        trainer = Trainer(config)
        trainer.set_preference_model(reward_model)

        def report(tr: Trainer, result) -> None:
            if tr.iteration % args.every == 0:
                row = {"kl": tr.config.kl_coefficient, "iteration": tr.iteration,
                       **snapshot(tr.model, reward_model, eval_prompts, eval_seeds, attr),
                       "kl_to_reference": result.metrics.get("kl_to_reference")}
                print(json.dumps(row), flush=True)

        trainer.run(report)


if __name__ == "__main__":
    main()
