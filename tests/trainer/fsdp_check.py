"""Run under `torchrun --nproc_per_node 2` (gloo): the same run with parallelism 'ddp' and
'fsdp' (the shapes model, full fine-tuning), a sharded checkpoint saved, read back by one
process and resumed by a fresh sharded trainer. Prints one JSON line from rank 0. Used by
test_fsdp.py. With a second argument `kl`: the same two runs with a KL penalty to the base
(kl_coefficient 0.1), compared, and nothing saved."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    from trainer.config import TrainConfig
    from trainer.distributed import DistributedFlowModel, init_from_env, make_distributed
    from trainer.loop import Trainer, load_model
    from trainer.models.shapes_dit import ShapesDiT

    out = Path(sys.argv[1])
    kl = sys.argv[2:] == ["kl"]
    rank, world = init_from_env()
    config = TrainConfig.from_dict({
        "iterations": 3, "prompts_per_iteration": 4, "group_size": 4, "num_anchors": 2,
        "num_train_timesteps": 2, "rollout_steps": 4, "learning_rate": 1e-4, "device": "cpu",
        "parallelism": "fsdp", "kl_coefficient": 0.1 if kl else 0.0})

    def trainer_for(parallelism: str) -> Trainer:
        model = DistributedFlowModel(load_model(config), "cpu", parallelism=parallelism,
                                     with_reference=kl)
        return make_distributed(Trainer(config, model=model))

    def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        inner = trainer.model.inner
        if trainer.model.parallelism == "ddp":
            return {k: v.detach().clone() for k, v in inner.state_dict().items()}
        return get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True))

    ddp, fsdp = trainer_for("ddp"), trainer_for("fsdp")
    # before any forward: FSDP keeps its root unit (here the embeddings and final layers)
    # gathered after a forward without backward, so count the shards now
    reference_shards = [p.to_local() if hasattr(p, "to_local") else None
                        for p in fsdp.reference.parameters()] if kl else []
    total = sum(p.numel() for p in ddp.model.inner.parameters())
    local = sum(p.to_local().numel() for p in fsdp.model.inner.parameters())
    initial = full_weights(fsdp)
    metrics = {"ddp": [], "fsdp": []}
    for _ in range(2):
        metrics["ddp"].append(ddp.step().metrics)
        metrics["fsdp"].append(fsdp.step().metrics)
    a, b = full_weights(ddp), full_weights(fsdp)
    ddp_vs_fsdp = max(float((a[k] - b[k]).abs().max()) for k in a)
    trained_by = max(float((initial[k] - b[k]).abs().max()) for k in b)
    if kl:  # the penalty's run: compared with DDP, nothing saved
        if rank == 0:
            print(json.dumps({
                "world": world, "ddp_vs_fsdp": ddp_vs_fsdp, "trained_by": trained_by,
                # sharded like the policy, and not among the policy's parameters
                "reference_sharded": all(t is not None for t in reference_shards),
                "reference_local_params": sum(t.numel() for t in reference_shards),
                "total_params": total,
                "policy_params": sum(1 for _ in fsdp.model.inner.parameters()),
                "optimized_params": sum(len(g["params"]) for g in fsdp.optimizer.param_groups),
                "kl": [[m["kl_to_reference"] for m in metrics[k]] for k in ("ddp", "fsdp")]}),
                flush=True)
        return _exit()

    saved = fsdp.save_checkpoint(out)  # every rank: gathers; rank 0 writes
    dist.barrier()
    resumed = trainer_for("fsdp")
    # the ranks load one after the other (as the worker's ranks do): loading takes no
    # collective, each rank slices its shard from the file
    for turn in range(world):
        if turn == rank:
            resumed.load_checkpoint(saved)
        dist.barrier()
    fsdp.step()
    resumed.step()
    c, d = full_weights(fsdp), full_weights(resumed)
    resume_diff = max(float((c[k] - d[k]).abs().max()) for k in c)
    third_step_moved = max(float((c[k] - b[k]).abs().max()) for k in c)
    if rank == 0:
        on_disk = ShapesDiT.load(saved / "model.safetensors").state_dict()
        disk_diff = max(float((on_disk[k] - b[k]).abs().max()) for k in b)
        print(json.dumps({
            "world": world, "total_params": total, "local_params": local,
            "ddp_vs_fsdp": ddp_vs_fsdp, "trained_by": trained_by,
            "third_step_moved": third_step_moved, "disk_vs_gathered": disk_diff,
            "resume_diff": resume_diff, "resumed_iteration": resumed.iteration,
            "files": sorted(p.name for p in saved.iterdir()),
            "grad_norms": [[m["grad_norm"] for m in metrics[k]] for k in ("ddp", "fsdp")],
            "losses": [[m["loss"] for m in metrics[k]] for k in ("ddp", "fsdp")]}), flush=True)
    return _exit()


def _exit() -> int:
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a normal interpreter exit


if __name__ == "__main__":
    sys.exit(main())
