"""Run under `torchrun --nproc_per_node 2`: a sharded full fine-tuning job with a KL penalty
loaded as the worker loads it (`load_distributed_model`: a tiny FLUX.1-dev directory written
here, its weights staged in CPU memory in bf16 and sharded onto each rank's device), two
iterations, a checkpoint, a fresh sharded model resumed from it, and a new job started from it
(`base_checkpoint`). Prints one JSON line from rank 0. Used by test_fsdp.py on two CPU
processes (gloo); on a machine with two GPUs it runs as it is (NCCL):

    torchrun --standalone --nproc_per_node 2 tests/trainer/staged_fsdp_check.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_diffusers


def main() -> int:
    from safetensors.torch import load_file
    from tiny_diffusers import write_tiny_flux
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trainer.config import PRESETS, TrainConfig
    from trainer.distributed import (
        init_from_env,
        load_distributed_model,
        make_distributed,
        tensor_local,
    )
    from trainer.loop import Trainer
    from trainer.models import FULL_TRANSFORMER

    out = Path(sys.argv[1])
    rank, world = init_from_env()
    model_dir = out / "flux"
    if rank == 0:
        write_tiny_flux(model_dir)
    dist.barrier()
    config = TrainConfig.from_dict({
        **PRESETS["tiny"], "model": "flux", "model_path": str(model_dir), "finetune": "full",
        "parallelism": "fsdp", "kl_coefficient": 0.1, "mixed_precision": "bf16",
        "resolution": 32, "prompts_per_iteration": 2, "iterations": 2, "learning_rate": 1e-3,
        "reward_weights": {"jpeg_compressibility": 1.0},
        "prompts": ["a red fox", "a blue boat"],
        "device": "cuda" if torch.cuda.is_available() else "cpu"})
    model = load_distributed_model(config)
    trainer = make_distributed(Trainer(config, model=model))
    policy = list(model.inner.parameters())
    reference = list(trainer.reference.parameters())
    # each rank's shards of the frozen reference against its shards of the policy, as loaded
    gap = max(float((tensor_local(r).detach().float()
                     - tensor_local(p).detach().to(r.dtype).float()).abs().max())
              for p, r in zip(policy, reference, strict=True))
    report = {"world": world, "device": str(policy[0].device),
              "master_dtypes": sorted({str(p.dtype) for p in policy}),
              "reference_dtypes": sorted({str(p.dtype) for p in reference}),
              "reference_vs_policy_at_start": gap,
              "local_share": sum(tensor_local(p).numel() for p in policy)
              / sum(p.numel() for p in policy)}
    kls = [float(trainer.step().metrics["kl_to_reference"]) for _ in range(2)]
    saved = trainer.save_checkpoint(out / "checkpoint")  # every rank gathers; rank 0 writes
    # whole on every rank (a tiny model): the ranks' copies must agree
    full = get_model_state_dict(model.inner, options=StateDictOptions(full_state_dict=True))
    # a fresh sharded model resumes from it: each rank reads the file a tensor at a time
    # and keeps its shard
    resumed = make_distributed(Trainer(config, model=load_distributed_model(config)))
    resumed.load_checkpoint(saved)
    resumed_iteration = resumed.iteration
    again = get_model_state_dict(resumed.model.inner,
                                 options=StateDictOptions(full_state_dict=True))
    resume_gap = max(float((again[k] - v).abs().max()) for k, v in full.items())
    # the next step is the same step: the optimizer's moments came back too
    trainer.step()
    resumed.step()
    stepped, stepped_resumed = (
        get_model_state_dict(t.model.inner, options=StateDictOptions(full_state_dict=True))
        for t in (trainer, resumed))
    next_step_gap = max(float((stepped[k] - v).abs().max()) for k, v in stepped_resumed.items())
    next_step_moved = max(float((stepped[k] - v).abs().max()) for k, v in full.items())
    # a new job that starts from the checkpoint (base_checkpoint): its shards are the saved
    # weights, read after sharding, and its KL reference is copied from them
    started = load_distributed_model(TrainConfig.from_dict(
        {**config.to_dict(), "base_checkpoint": str(saved)}))
    start = get_model_state_dict(started.inner, options=StateDictOptions(full_state_dict=True))
    start_gap = max(float((start[k] - v).abs().max()) for k, v in full.items())
    start_reference_gap = max(
        float((tensor_local(r).detach().float()
               - tensor_local(p).detach().to(r.dtype).float()).abs().max())
        for p, r in zip(started.inner.parameters(), started.reference_model().parameters(),
                        strict=True))
    checksum = torch.tensor([sum(float(v.double().sum()) for v in full.values())],
                            dtype=torch.float64, device=policy[0].device)
    sums = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(sums, checksum)
    if rank == 0:
        on_disk = load_file(str(saved / FULL_TRANSFORMER))
        report.update({
            "kl_to_reference": kls, "checksums": [float(s) for s in sums],
            "resumed_vs_saved": resume_gap, "resumed_iteration": resumed_iteration,
            "next_step_resumed_vs_uninterrupted": next_step_gap,
            "next_step_moved": next_step_moved,
            "started_vs_saved": start_gap, "started_reference_vs_policy": start_reference_gap,
            "started_master_dtypes": sorted({str(p.dtype) for p in started.inner.parameters()}),
            "disk_vs_gathered": max(float((on_disk[k.removeprefix("transformer.")].float()
                                           - v.float().cpu()).abs().max())
                                    for k, v in full.items()),
            "disk_dtypes": sorted({str(v.dtype) for v in on_disk.values()})})
        print(json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a normal interpreter exit


if __name__ == "__main__":
    sys.exit(main())
