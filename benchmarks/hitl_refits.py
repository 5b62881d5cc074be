"""Online refits from scratch against warm starts (FitConfig.warm_start_epochs), side by side.

A campaign as the studio runs one: a simulated annotator (10% flipped votes, 5% tie band) votes
on uniformly random within-group pairs of rollout groups from the shipped base, --start votes
first, then rounds of --round-votes more (a train job's online refit sees about one round:
`preference_refit_every` iterations of annotators voting). After every round the model is
refitted on all the votes so far, twice from the same votes:
- `scratch`: a new ensemble trained `epochs` (what every refit did before warm starts);
- `warm`: the previous round's warm model trained `warm_start_epochs` more on all the votes
  (the chain the studio runs: each refit starts from the one before).
Votes are keyed by their index, as the studio keys them by vote id, so both hold out the same
votes (by a hash of the key) in every round. Each fit is scored on fixed test pairs from other
noises against the noise-free preference (`clean`, as benchmarks/hitl_simulated.py), with its
fit seconds; the summary gives the means over rounds and seeds, and the speed-up.

    python benchmarks/hitl_refits.py --device cuda --preferences upper left larger --seeds 0 1 2
    python benchmarks/hitl_refits.py --device cpu --start 40 --round-votes 20 --rounds 2 \
        --pool-seeds 1 --prompts 8 --preferences upper --seeds 0 --epochs 2 --ensemble 2 \
        --warm-start-epochs 1
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch
from hitl_simulated import Campaign, make_groups, pair_metrics, test_pairs  # this directory

from trainer.config import TrainConfig
from trainer.loop import load_model
from trainer.rewards.attributes import PREFERENCES
from trainer.rewards.preference import FitConfig, PreferenceModel, fit_preference_model
from trainer.shapes.world import all_prompts


def keyed_votes(campaign: Campaign) -> list:
    """The campaign's votes keyed by their index (the studio keys them by vote id)."""
    return [replace(vote, key=str(index)) for index, vote in enumerate(campaign.votes)]


def timed_fit(votes: list, config: FitConfig, version: int,
              warm_start: PreferenceModel | None = None) -> tuple[PreferenceModel, float]:
    if config.device.startswith("cuda"):
        torch.cuda.synchronize()
    began = time.perf_counter()
    model = fit_preference_model(votes, config, version=version, warm_start=warm_start)
    if config.device.startswith("cuda"):
        torch.cuda.synchronize()
    return model, time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0: torch's default)")
    ap.add_argument("--preferences", nargs="+", default=["upper", "left", "larger"],
                    choices=sorted(PREFERENCES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--start", type=int, default=1000, help="votes before the first refit")
    ap.add_argument("--round-votes", type=int, default=150, help="votes a round adds")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=FitConfig.epochs)
    ap.add_argument("--warm-start-epochs", type=int, default=3)
    ap.add_argument("--ensemble", type=int, default=FitConfig.ensemble)
    ap.add_argument("--pool-seeds", type=int, default=8, help="groups per prompt in the pool")
    ap.add_argument("--prompts", type=int, default=0,
                    help="the first N of the shapes world's 48 prompts (0: all)")
    ap.add_argument("--tie-band", type=float, default=0.05)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    torch.manual_seed(0)
    base = load_model(TrainConfig()).to(dev)
    prompts = all_prompts()[:args.prompts or None]
    pool_prompts = [p for p in prompts for _ in range(args.pool_seeds)]
    pool = make_groups(base, pool_prompts, list(range(len(pool_prompts))), 8, dev)
    test_prompts = prompts * 2
    test_groups = make_groups(base, test_prompts, [10**6 + i for i in range(len(test_prompts))],
                              8, dev)
    device_name = torch.cuda.get_device_name() if dev.startswith("cuda") else \
        f"cpu, {torch.get_num_threads()} threads"
    rows = []
    for pref in args.preferences:
        images_a, images_b, t_prompts, truth, decisive = test_pairs(
            test_groups, test_prompts, PREFERENCES[pref], args.tie_band)
        for seed in args.seeds:
            config = FitConfig(epochs=args.epochs, warm_start_epochs=args.warm_start_epochs,
                               ensemble=args.ensemble, device=dev, seed=seed)
            campaign = Campaign(pref, seed, args.tie_band)
            campaign.set_pool(pool, pool_prompts, None)
            campaign.collect(args.start, active=False)
            warm, _ = timed_fit(keyed_votes(campaign), config, version=0)
            for round_ in range(1, args.rounds + 1):
                campaign.collect(args.round_votes, active=False)
                votes = keyed_votes(campaign)
                scratch, scratch_s = timed_fit(votes, config, version=round_)
                warm, warm_s = timed_fit(votes, config, version=round_, warm_start=warm)
                assert warm.report.extra["warm_start"], warm.report.extra
                row = {"preference": pref, "seed": seed, "round": round_, "votes": len(votes)}
                for name, model, seconds in (("scratch", scratch, scratch_s),
                                             ("warm", warm, warm_s)):
                    p = model.prob_a_beats_b(images_a, images_b, t_prompts)
                    metrics = pair_metrics(p, truth, decisive)
                    row[name] = {"clean": metrics["clean"],
                                 "log_loss_clean": metrics["log_loss_clean"],
                                 "heldout": model.report.heldout_accuracy,
                                 "seconds": round(seconds, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary: dict = {"device": device_name, "args": vars(args)}
    for pref in args.preferences:
        mine = [r for r in rows if r["preference"] == pref]
        last = [r for r in mine if r["round"] == args.rounds]
        summary[pref] = {
            name: {"clean_mean": round(float(np.mean([r[name]["clean"] for r in mine])), 4),
                   "clean_last_round": round(float(np.mean([r[name]["clean"] for r in last])), 4),
                   "log_loss_mean": round(float(np.mean([r[name]["log_loss_clean"]
                                                         for r in mine])), 4),
                   "seconds_mean": round(float(np.mean([r[name]["seconds"] for r in mine])), 2)}
            for name in ("scratch", "warm")}
        summary[pref]["speedup"] = round(summary[pref]["scratch"]["seconds_mean"]
                                         / summary[pref]["warm"]["seconds_mean"], 2)
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
