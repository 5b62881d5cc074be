"""Data-parallel Neighbor GRPO: one process against torchrun on N GPUs, same total batch.

    python benchmarks/ddp_scaling.py --prompts 16 --iterations 40 --out one.json
    torchrun --nproc_per_node 2 benchmarks/ddp_scaling.py --prompts 16 --iterations 40 --out two.json

Prints (rank 0) the median seconds per iteration after warm-up, the mean training reward over
the run, and the parameter checksum at the end (identical on every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from trainer.config import PRESETS, TrainConfig
    from trainer.loop import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = TrainConfig.from_dict({**PRESETS["shapes-benchmark"], "iterations": args.iterations,
                                    "prompts_per_iteration": args.prompts, "eval_every": 0})
    rank, world = 0, 1
    if "RANK" in os.environ:
        from trainer.distributed import init_from_env, load_distributed_model, make_distributed

        rank, world = init_from_env()
        trainer = make_distributed(Trainer(config, model=load_distributed_model(config)))
    else:
        trainer = Trainer(config)
    records = []
    trainer.run(lambda tr, r: records.append(r.metrics) and False)
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
    if rank == 0:
        result = {
            "world_size": world, "prompts_per_iteration": args.prompts,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "seconds_per_iteration": float(np.median([m["seconds"] for m in records[5:]])),
            "reward_mean_first10": float(np.mean([m["reward_mean"] for m in records[:10]])),
            "reward_mean_last10": float(np.mean([m["reward_mean"] for m in records[-10:]])),
            "forward_passes": records[-1]["forward_passes"], "checksum": checksum,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
    else:
        print(json.dumps({"rank": rank, "checksum": checksum}))


if __name__ == "__main__":
    main()
