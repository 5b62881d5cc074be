"""Humans in the loop with simulated annotators (issue 6), in-process (no HTTP), CPU or GPU.

For each preference (larger, upper; attributes the verifiable rewards ignore):
1. Held-out pair accuracy of the preference model against the number of votes (100, 300,
   1000, 3000) with uniformly random vs active pair selection (as GET /api/votes/next does it:
   80% the least-sure pair, |P(a beats b) - 0.5| smallest, among the pairs of 8 random
   rollout groups; 20% uniformly random). Votes come from a SimulatedAnnotator with a 10% flip.
   Accuracy is measured on a fixed test set of within-group pairs from other noises, against
   the noise-free preference (`clean`) and against fresh noisy votes (`noisy`, ceiling 0.90).
2. Training from the shipped base on count alone vs count + preference (the model fitted on
   the largest active budget), then the attribute and the count reward on a fixed eval set,
   with the issue's target: base mean + half the distance to the mean of the base's best decile.

    python benchmarks/hitl_simulated.py --device cuda --iterations 200
    python benchmarks/hitl_simulated.py --device cpu --budgets 100 300 --iterations 20 --epochs 30
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from trainer.config import TrainConfig
from trainer.evaluation import sample_images
from trainer.loop import Trainer, load_model
from trainer.models.base import repeat_cond
from trainer.neighbor_grpo import group_noises
from trainer.rewards import compute_rewards, register_reward
from trainer.rewards.attributes import PREFERENCES, SimulatedAnnotator, attribute_values
from trainer.rewards.preference import FitConfig, PreferencePair, fit_preference_model
from trainer.shapes.world import all_prompts
from trainer.solvers import rollout


@torch.no_grad()
def make_groups(model, prompts: list[str], seeds: list[int], g: int, device: str) -> np.ndarray:
    """(len(seeds), G, H, W, 3): one group per (prompt, seed) entry."""
    out = []
    for i in range(0, len(prompts), 64):
        ps, ss = prompts[i:i + 64], seeds[i:i + 64]
        noises = group_noises(ss, g, 0.3, model.latent_shape, torch.device(device))
        cond = repeat_cond(model.encode_prompts(ps), g)
        images = model.decode(rollout("dpm++", model, noises.flatten(0, 1), cond, 8).final)
        out.append(images.reshape(len(ps), g, *images.shape[1:]))
    return np.concatenate(out)


def run_selection(kind: str, pref: str, pool, pool_prompts, test, budgets, fit_cfg, seed):
    """Accuracy per budget; returns ({budget: row}, the last model)."""
    rng = np.random.default_rng(seed)
    annotator = SimulatedAnnotator(pref, flip=0.1, seed=seed)
    n_groups, g = pool.shape[:2]
    pairs_idx = [(gi, i, j) for gi in range(n_groups) for i in range(g) for j in range(i + 1, g)]
    used: set[tuple[int, int, int]] = set()
    votes: list[PreferencePair] = []
    scores = None
    rows, model = {}, None

    def add(choice):
        used.add(choice)
        gi, i, j = choice
        if rng.random() < 0.5:
            i, j = j, i
        a, b, p = pool[gi, i], pool[gi, j], pool_prompts[gi]
        votes.append(PreferencePair(a, b, p, annotator.vote(a, b, p)))

    for budget in budgets:
        while len(votes) < budget:
            if kind == "random" or scores is None or rng.random() < 0.2:
                while (c := pairs_idx[rng.integers(len(pairs_idx))]) in used:
                    pass
                add(c)
                continue
            start = int(rng.integers(n_groups))
            cands = [(abs(scores[gi, i] - scores[gi, j]), (gi, i, j))
                     for gi in range(start, min(start + 8, n_groups))
                     for i in range(g) for j in range(i + 1, g) if (gi, i, j) not in used]
            if cands:
                add(min(cands)[1])
        t = time.perf_counter()
        model = fit_preference_model(votes, fit_cfg, version=budget)
        if kind == "active":  # rescore the pool, as the fit job caches scores on samples
            flat = pool.reshape(-1, *pool.shape[2:])
            scores = model(flat, [p for p in pool_prompts for _ in range(g)]).reshape(n_groups, g)
        images_a, images_b, prompts, truth = test
        p = model.prob_a_beats_b(images_a, images_b, prompts)
        clean = float(((p > 0.5) == truth).mean())
        rows[budget] = {"clean": round(clean, 3), "noisy": round(0.9 * clean + 0.1 * (1 - clean), 3),
                        "report_heldout": model.report.heldout_accuracy,
                        "fit_s": round(time.perf_counter() - t, 1)}
        print(json.dumps({"preference": pref, "selection": kind, "votes": budget, **rows[budget]}),
              flush=True)
    return rows, model


def test_pairs(test_groups, prompts, attr):
    a_list, b_list, ps, truth = [], [], [], []
    g = test_groups.shape[1]
    for gi in range(test_groups.shape[0]):
        vals = attribute_values(attr, test_groups[gi], [prompts[gi]] * g)
        for i in range(g):
            for j in range(i + 1, g):
                if vals[i] != vals[j]:
                    a_list.append(test_groups[gi, i])
                    b_list.append(test_groups[gi, j])
                    ps.append(prompts[gi])
                    truth.append(vals[i] > vals[j])
    return np.stack(a_list), np.stack(b_list), ps, np.array(truth)


def train_images(weights, iterations, device, lr, eval_prompts, eval_seeds):
    cfg = TrainConfig(iterations=iterations, learning_rate=lr, device=device,
                      reward_weights=weights, prompts_per_iteration=4, group_size=12,
                      checkpoint_every=10**6, sample_every=10**6)
    trainer = Trainer(cfg)
    t = time.perf_counter()
    trainer.run()
    return sample_images(trainer.model, eval_prompts, eval_seeds), time.perf_counter() - t


def measure(images, eval_prompts, attr, seconds=None):
    out = {"attr": round(float(attribute_values(attr, images, eval_prompts).mean()), 4),
           "count": round(float(compute_rewards(["count"], images, eval_prompts)["count"]
                                .mean()), 4)}
    if seconds is not None:
        out["train_s"] = round(seconds, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preferences", nargs="+", default=["larger", "upper"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[100, 300, 1000, 3000])
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--width", type=int, default=32, help="preference network channels")
    ap.add_argument("--fit-learning-rate", type=float, default=2e-3)
    ap.add_argument("--selections", nargs="+", default=["random", "active"])
    ap.add_argument("--pool-seeds", type=int, default=8, help="groups per prompt in the pool")
    ap.add_argument("--iterations", type=int, default=200, help="0 skips training")
    ap.add_argument("--learning-rate", type=float, default=3e-6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev = args.device
    base = load_model(TrainConfig()).to(dev)
    prompts = all_prompts()
    pool_prompts = [p for p in prompts for _ in range(args.pool_seeds)]
    pool = make_groups(base, pool_prompts, list(range(len(pool_prompts))), 8, dev)
    test_prompts = prompts * 2
    test_groups = make_groups(base, test_prompts, [10**6 + i for i in range(len(test_prompts))],
                              8, dev)
    eval_prompts = [p for p in prompts for _ in range(8)]
    eval_seeds = [5000 + i for i in range(len(eval_prompts))]
    base_images = sample_images(base, eval_prompts, eval_seeds)
    fit_cfg = FitConfig(epochs=args.epochs, device=dev, seed=args.seed, width=args.width,
                        learning_rate=args.fit_learning_rate)
    summary: dict = {"device": dev, "args": vars(args)}
    count_only = None
    for pref in args.preferences:
        attr = PREFERENCES[pref]
        test = test_pairs(test_groups, test_prompts, attr)
        out: dict = {"test_pairs": len(test[3])}
        models = {}
        for kind in args.selections:
            out[kind], models[kind] = run_selection(kind, pref, pool, pool_prompts, test,
                                                    args.budgets, fit_cfg, args.seed)
        if args.iterations:
            base_vals = attribute_values(attr, base_images, eval_prompts)
            decile = float(np.sort(base_vals)[-max(1, len(base_vals) // 10):].mean())
            out["base"] = {"attr": float(base_vals.mean()), "count": float(
                compute_rewards(["count"], base_images, eval_prompts)["count"].mean()),
                "best_decile_attr": decile,
                "target_attr": float(base_vals.mean() + 0.5 * (decile - base_vals.mean()))}
            if count_only is None:
                count_only = train_images({"count": 1.0}, args.iterations, dev,
                                          args.learning_rate, eval_prompts, eval_seeds)
            out["count_only"] = measure(count_only[0], eval_prompts, attr, count_only[1])
            register_reward("preference", models["active"])
            images, secs = train_images({"count": 1.0, "preference": 1.0}, args.iterations, dev,
                                        args.learning_rate, eval_prompts, eval_seeds)
            out["count+preference"] = measure(images, eval_prompts, attr, secs)
            print(json.dumps({"preference": pref, "base": out["base"],
                              "count_only": out["count_only"],
                              "count+preference": out["count+preference"]}), flush=True)
        summary[pref] = out
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main()
