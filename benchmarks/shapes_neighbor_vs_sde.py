"""Neighbor GRPO against the SDE baseline against a shuffled-advantage control, on shapes.

From the shipped base: DPM++ 8-step rollouts, G=12, B=4, K=4, several seeds each; evaluation
reward and exact-count accuracy (48 prompts x 20 seeds) against iteration and against
training wall-clock; seconds per iteration measured alone (not while other runs share the
device); forward/backward passes per iteration; optional sigma, p, learning-rate and KL-penalty ablations.

    python benchmarks/shapes_neighbor_vs_sde.py --out runs/bench --iterations 1000 \
        --seeds 0 1 --parallel 8 [--ablations]

Writes OUT/results.json, OUT/summary.md and OUT/curves.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = {
    "neighbor": {"method": "neighbor", "rollout_solver": "dpm++"},
    "sde": {"method": "sde", "rollout_solver": "euler", "clip_range": 1e-4},
    "shuffled": {"method": "neighbor", "rollout_solver": "dpm++", "shuffle_advantages": True},
    # DanceGRPO's own defaults: 16 SDE steps, 60% of them trained (K = 10)
    "sde-16step": {"method": "sde", "rollout_solver": "euler", "clip_range": 1e-4,
                   "rollout_steps": 16, "num_train_timesteps": 10},
}
ABLATIONS = {
    "neighbor-sigma0.1": {"method": "neighbor", "sigma": 0.1},
    "neighbor-sigma0.6": {"method": "neighbor", "sigma": 0.6},
    "neighbor-p0.8": {"method": "neighbor", "quasi_norm_p": 0.8},
    # a KL penalty to the base: does it hold a long run's gains (issue 18)?
    "neighbor-kl0.03": {"method": "neighbor", "kl_coefficient": 0.03},
    "neighbor-kl0.3": {"method": "neighbor", "kl_coefficient": 0.3},
    "neighbor-lr1e-5": {"method": "neighbor", "learning_rate": 1e-5},
    "shuffled-lr1e-5": {"method": "neighbor", "shuffle_advantages": True, "learning_rate": 1e-5},
}
COMMON = {"prompts_per_iteration": 4, "group_size": 12, "num_anchors": 4,
          "num_train_timesteps": 4, "rollout_steps": 8, "sample_every": 10**6,
          "checkpoint_every": 10**6}


def run_one(name: str, overrides: dict, seed: int, iterations: int, eval_every: int,
            out: Path, eval_prompts: int = 48, eval_seeds: int = 20) -> dict:
    import torch

    from trainer.config import TrainConfig
    from trainer.evaluation import EVAL_SEEDS, evaluate
    from trainer.loop import Trainer
    from trainer.shapes.world import all_prompts

    torch.set_num_threads(1)
    config = TrainConfig.from_dict({**COMMON, **overrides, "seed": seed, "iterations": iterations})
    trainer = Trainer(config)
    curve, train_seconds, metrics = [], 0.0, []

    def summary() -> dict:
        return {"name": name, "seed": seed, "config": config.to_dict(), "curve": curve,
                "forward_passes": metrics[-1]["forward_passes"] if metrics else None,
                "backward_passes": metrics[-1]["backward_passes"] if metrics else None,
                "train_reward_first50": float(np.mean([m["reward_mean"] for m in metrics[:50]] or [0])),
                "train_reward_last50": float(np.mean([m["reward_mean"] for m in metrics[-50:]] or [0]))}

    prompts = all_prompts()
    # evenly spaced over the list (which runs through counts, colours and shapes in order)
    prompts = [prompts[i * len(prompts) // eval_prompts] for i in range(eval_prompts)]

    def record() -> None:
        result = evaluate(trainer.model, prompts, seeds=tuple(EVAL_SEEDS[:eval_seeds]))
        curve.append({"iteration": trainer.iteration, "train_seconds": train_seconds,
                      "exact_count_accuracy": result["exact_count_accuracy"],
                      "count_reward": result["count_reward"],
                      "combined_reward": result["combined_reward"]})
        print(name, seed, curve[-1], flush=True)
        # written at every evaluation so a run cut short still leaves its curve
        (out / f"{name}-seed{seed}.json").write_text(json.dumps(summary()))

    record()
    while trainer.iteration < iterations:
        start = time.perf_counter()
        m = trainer.step().metrics
        train_seconds += time.perf_counter() - start
        metrics.append(m)
        if trainer.iteration % eval_every == 0 or trainer.iteration == iterations:
            record()
    return summary()


def time_alone(iterations: int, names: list[str]) -> dict:
    """Seconds per iteration of each method with the device to itself."""
    import torch

    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    out = {}
    for name in names:
        trainer = Trainer(TrainConfig.from_dict({**COMMON, **METHODS[name], "iterations": 10**6}))
        trainer.step()  # warm-up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps = [trainer.step().metrics for _ in range(iterations)]
        seconds = [m["seconds"] for m in steps]
        out[name] = {"seconds_per_iteration": float(np.median(seconds)),
                     "rollout_seconds": float(np.median([m["rollout_seconds"] for m in steps])),
                     "forward_passes": steps[-1]["forward_passes"],
                     "backward_passes": steps[-1]["backward_passes"],
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        print("alone", name, out[name], flush=True)
    for name in names:
        out[name]["relative_to_neighbor"] = (out[name]["seconds_per_iteration"]
                                             / out["neighbor"]["seconds_per_iteration"])
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {}
    for r in results:
        color = colors.setdefault(r["name"], f"C{len(colors)}")
        xs_it = [c["iteration"] for c in r["curve"]]
        xs_s = [c["train_seconds"] for c in r["curve"]]
        ys = [c["exact_count_accuracy"] for c in r["curve"]]
        label = r["name"] if r["seed"] == min(x["seed"] for x in results) else None
        axes[0].plot(xs_it, ys, color=color, label=label, alpha=0.8)
        axes[1].plot(xs_s, ys, color=color, label=label, alpha=0.8)
    axes[0].set_xlabel("iteration")
    axes[1].set_xlabel("training wall-clock seconds (runs shared the device)")
    for ax in axes:
        ax.set_ylabel("exact-count accuracy (48 prompts x 20 seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--ablations", nargs="*", choices=list(ABLATIONS), default=None,
                        help="also run these ablations (with no names: all of them) on "
                        "--ablation-seeds")
    parser.add_argument("--ablation-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--timing-iterations", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=48, choices=range(1, 49),
                        metavar="1..48", help="evaluate on this many of the 48 prompts "
                        "(fewer: a smoke run only; the reported accuracies use all 48)")
    parser.add_argument("--eval-seeds", type=int, default=20, choices=range(1, 21),
                        metavar="1..20", help="evaluation seeds per prompt (as above: 20)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (subprocesses)")
    parser.add_argument("--summarize-only", action="store_true", help="rebuild the summary")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: NAME:SEED
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = {k: METHODS[k] for k in args.methods}
    if args.ablations is not None:
        variants.update({k: ABLATIONS[k] for k in args.ablations or ABLATIONS})
    if args.learning_rate is not None:
        variants = {k: {**v, "learning_rate": args.learning_rate} for k, v in variants.items()}

    if args.run:
        name, seed = args.run.split(":")
        run_one(name, variants[name], int(seed), args.iterations, args.eval_every, out,
                args.eval_prompts, args.eval_seeds)
        return

    if args.summarize_only:
        timing = json.loads((out / "timing.json").read_text()) if (out / "timing.json").exists() else {}
        return summarize(out, timing)
    timed = ["neighbor", *[m for m in ("sde", "sde-16step") if m in METHODS]]
    timing = time_alone(args.timing_iterations, timed) if args.timing_iterations else {}
    (out / "timing.json").write_text(json.dumps(timing))
    jobs = [(name, seed) for name in variants
            for seed in (args.ablation_seeds if name in ABLATIONS else args.seeds)]
    running: list[subprocess.Popen] = []
    base_cmd = [sys.executable, __file__, "--out", str(out), "--iterations", str(args.iterations),
                "--eval-every", str(args.eval_every), "--methods", *args.methods,
                "--eval-prompts", str(args.eval_prompts), "--eval-seeds", str(args.eval_seeds)]
    if args.ablations is not None:
        base_cmd += ["--ablations", *args.ablations]
    if args.learning_rate is not None:
        base_cmd += ["--learning-rate", str(args.learning_rate)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    while jobs or running:
        while jobs and len(running) < args.parallel:
            name, seed = jobs.pop(0)
            running.append(subprocess.Popen(base_cmd + ["--run", f"{name}:{seed}"], env=env))
        time.sleep(1)
        running = [p for p in running if p.poll() is None]
    summarize(out, timing)


def summarize(out: Path, timing: dict) -> None:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*-seed*.json"))]
    lines = ["| run | seed | acc start | acc end | best acc | count reward end | train s | fwd/it | bwd/it |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["curve"]
        lines.append(f"| {r['name']} | {r['seed']} | {c[0]['exact_count_accuracy']:.3f} | "
                     f"{c[-1]['exact_count_accuracy']:.3f} | "
                     f"{max(x['exact_count_accuracy'] for x in c):.3f} | {c[-1]['count_reward']:.3f} | "
                     f"{c[-1]['train_seconds']:.0f} | {r['forward_passes']} | {r['backward_passes']} |")
    if timing:
        lines += ["", f"Each method alone on {timing['neighbor']['device']} (median of the timed iterations):",
                  "", "| method | s / iteration | rollout s | x neighbor | forward / it | backward / it |",
                  "|---|---|---|---|---|---|"]
        for name, t in timing.items():
            lines.append(f"| {name} | {t['seconds_per_iteration']:.3f} | {t['rollout_seconds']:.3f} | "
                         f"{t['relative_to_neighbor']:.2f} | {t['forward_passes']} | {t['backward_passes']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"timing": timing, "runs": results}))
    plot(results, out / "curves.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
