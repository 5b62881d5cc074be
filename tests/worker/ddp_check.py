"""Run under `torchrun --nproc_per_node 2` (gloo) or as one process: trains the tiny config and
prints one JSON line per iteration from rank 0, plus the DDP gradient check and a parameter
checksum per rank. Used by test_worker_distributed.py."""

from __future__ import annotations

import json
import os
import sys

import torch


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def main() -> int:
    from trainer.config import TrainConfig
    from trainer.loop import Trainer, load_model

    iterations = int(sys.argv[1])
    config = TrainConfig.from_dict({"iterations": iterations, "prompts_per_iteration": 4,
                                    "group_size": 4, "num_anchors": 2, "num_train_timesteps": 2,
                                    "rollout_steps": 4, "learning_rate": 1e-5, "device": "cpu",
                                    "sample_every": 3})
    distributed = "RANK" in os.environ
    if not distributed:
        trainer = Trainer(config)
        trainer.run(lambda tr, r: print(json.dumps({"metrics": r.metrics, "prompts": r.prompts}),
                                        flush=True))
        print(json.dumps({"checksum": checksum(trainer.model), "rank": 0}), flush=True)
        return 0

    import torch.distributed as dist

    from trainer.distributed import (
        DistributedFlowModel,
        init_from_env,
        load_distributed_model,
        make_distributed,
    )

    rank, world = init_from_env()
    # 1. DDP averages gradients: each rank's half-batch gradient, reduced, equals the
    #    full-batch gradient of one process
    base = load_model(config)
    ref = load_model(config)
    wrapped = DistributedFlowModel(base, "cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((4, *ref.latent_shape), generator=gen)
    t = torch.rand(4, generator=gen)
    cond = ref.encode_prompts(["one red circle", "two blue squares", "three green triangles",
                               "one blue circle"])
    (ref(x, t, cond) ** 2).mean().backward()
    half = slice(rank * 2, rank * 2 + 2)
    (wrapped(x[half], t[half], cond[half]) ** 2).mean().backward()
    diff = max(float((a.grad - b.grad).abs().max())
               for a, b in zip(wrapped.inner.parameters(), ref.parameters(), strict=True))
    # 2. training: metrics over the whole batch, identical weights on every rank
    trainer = make_distributed(Trainer(config, model=load_distributed_model(config)))

    def on_iteration(tr, result):
        # each rank's noise seeds (one per prompt of its own): every group's members share
        # their prompt's eps*, and no two ranks may draw the same one. On a sampling
        # iteration rank 0's result holds every rank's groups (its own: every world-th)
        gathered = rank == 0 and len(result.prompts) == config.prompts_per_iteration
        own = result.noise_seeds[rank::world] if gathered else result.noise_seeds
        seeds: list = [None] * world
        dist.all_gather_object(seeds, [int(x) for x in own])
        if rank == 0:
            print(json.dumps({"metrics": result.metrics, "prompts": result.prompts,
                              "noise_seeds": [int(x) for x in result.noise_seeds],
                              "groups": len(result.images), "noise_seeds_by_rank": seeds,
                              "rewards": {k: len(v) for k, v in result.rewards.items()}}),
                  flush=True)
        return False

    trainer.run(on_iteration)
    sums = torch.tensor([checksum(trainer.model)], dtype=torch.float64)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, sums)
    if rank == 0:
        print(json.dumps({"grad_max_diff": diff, "checksums": [float(g) for g in gathered],
                          "world": world}), flush=True)
    del trainer, wrapped
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a normal interpreter exit ("terminate called ...")


if __name__ == "__main__":
    sys.exit(main())
