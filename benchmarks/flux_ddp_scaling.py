"""Data-parallel Neighbor GRPO at FLUX.1-dev scale (issue 20): prompts per second on N GPUs of
one host against one GPU, each process training the same share of prompts.

    python benchmarks/flux_ddp_scaling.py --out one.json                        # one GPU, no DDP
    torchrun --standalone --nproc_per_node 2 benchmarks/flux_ddp_scaling.py \\
        --baseline one.json --out two.json                                       # two GPUs
    torchrun --standalone --nproc_per_node 2 benchmarks/flux_ddp_scaling.py --tiny --device cpu \\
        --out tiny.json                                                          # CI: gloo, toy size

The setting is flux_scale.py's headline case (`neighbor-8`: FLUX.1-dev's transformer with
random bf16 weights, 512x512, G = 12, DPM++ 8 steps, B = K = 4, LoRA rank 64, the
jpeg_compressibility reward), with `--prompts-per-rank` prompts per process and iteration (the
paper's cheapest setting is one prompt per GPU). Under torchrun every process builds the model,
wraps it in DDP (`trainer.distributed`: the LoRA gradients are averaged before each optimizer
step) and takes its slice of the iteration's prompts; without torchrun it is one process
without DDP, the baseline. Rank 0 writes the medians of the timed iterations, the peak memory
of the fullest card, and a checksum of every rank's trained weights (equal when the ranks stay
in step); with `--baseline` also the scaling: (prompts/s here) / (prompts/s there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux_scale  # noqa: E402  (this folder is not a package)
import real_models  # noqa: E402

from trainer.config import TrainConfig  # noqa: E402
from trainer.distributed import tensor_local  # noqa: E402
from trainer.loop import Trainer  # noqa: E402

CASE = flux_scale.HEADLINE_NEIGHBOR


def scaled_config(args: argparse.Namespace, world: int) -> TrainConfig:
    """flux_scale's case with prompts_per_iteration = prompts per rank x ranks."""
    prompts = args.prompts_per_rank * world
    base = flux_scale.case_config(CASE, args).to_dict()
    base.update(prompts_per_iteration=prompts, finetune=args.finetune,
                parallelism=args.parallelism, mixed_precision=args.mixed_precision,
                kl_coefficient=args.kl_coefficient,
                prompts=[f"prompt {i}" for i in range(max(prompts, len(flux_scale.PROMPTS)))])
    return TrainConfig.from_dict(base)


def local_numel(model: torch.nn.Module) -> int:
    """How many of `model`'s parameter elements this process stores (its shards, under FSDP)."""
    return sum(tensor_local(p).numel() for p in model.parameters())


def weights_checksum(model: torch.nn.Module) -> float:
    """The sum of every trained weight (a sharded one gathered whole: every rank calls it)."""
    # summed in float64 without a float64 copy of each weight (12B of them at FLUX size)
    return float(sum((p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                     .sum(dtype=torch.float64) for p in model.trainable_parameters()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="toy-size model (CPU smoke run)")
    parser.add_argument("--resolution", type=int, help="pixels (default 512; --tiny: 32)")
    parser.add_argument("--group-size", type=int, default=12)
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--prompts-per-rank", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--train-batch-size", type=int, default=4,
                        help="trained predictions per forward-backward pass")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--checkpoint-fraction", type=float, default=1.0,
                        help="gradient_checkpointing_fraction: the share of blocks recomputed")
    parser.add_argument("--compile", action="store_true", help="torch_compile the blocks")
    parser.add_argument("--finetune", choices=["lora", "full"], default="lora")
    parser.add_argument("--kl-coefficient", type=float, default=0.0,
                        help="KL penalty to the base (under FSDP: a sharded frozen copy)")
    parser.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp",
                        help="under torchrun: DDP, or FSDP2 sharding (needs --finetune full)")
    parser.add_argument("--stage-on-cpu", action="store_true",
                        help="build the weights in CPU memory and let FSDP move them to the "
                        "card unit by unit as it shards them (how the worker loads a sharded "
                        "job); default: built on the card")
    parser.add_argument("--mixed-precision", choices=["auto", "no", "bf16"], default="auto",
                        help="the config's mixed_precision (auto: bf16 on CUDA; bf16 on the CPU "
                        "checks a sharded run's bf16 gathers at toy size)")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply the rollout steps (smoke runs only)")
    parser.add_argument("--baseline", help="a one-GPU run's JSON: report the scaling against it")
    parser.add_argument("--out", required=True)
    parser.add_argument("--figures", help="a flux_scale.py figures file (docs/figures/"
                        "flux_scale.json): its `scaling` gets this run's prompts per second "
                        "under the number of processes")
    args = parser.parse_args(argv)
    args.resolution = args.resolution or (32 if args.tiny else 512)
    args.sde_train_batch_size = args.train_batch_size  # read by case_config; unused here

    rank, world, distributed = 0, 1, "RANK" in os.environ
    if distributed:
        from trainer.distributed import (
            DistributedFlowModel,
            init_from_env,
            local_device,
            make_distributed,
        )

        rank, world = init_from_env()
        device = torch.device(local_device() if args.device.startswith("cuda") else "cpu")
    else:
        device = torch.device(args.device)
    config = scaled_config(args, world)
    torch.manual_seed(0)  # the same random weights everywhere (DDP also copies rank 0's)
    started = time.perf_counter()
    adapter = real_models.build_model("flux", args.finetune, args.checkpointing, device,
                                      args.tiny, config, stage_on_cpu=args.stage_on_cpu)
    build_seconds = time.perf_counter() - started
    checksum_before = weights_checksum(adapter)  # before sharding: each rank's whole copy
    if distributed:
        model = DistributedFlowModel(adapter, device, parallelism=args.parallelism,
                                     with_reference=config.kl_coefficient > 0)
        trainer = make_distributed(Trainer(config, model=model))
    else:
        trainer = Trainer(config, model=adapter)
    # the card's peak while the weights were built, copied for the reference and sharded
    setup_peak = flux_scale.peak_memory(device)
    # and the host's: this process's peak resident memory so far (Linux counts KiB)
    setup_host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the frozen reference starts as the policy: its shards against the policy's, in its dtype
    reference_gap = None if trainer.reference is None else max(
        float((tensor_local(r).float() - tensor_local(p).to(r.dtype).float()).abs().max())
        for p, r in zip(adapter.parameters(), trainer.reference.parameters(), strict=True))
    # what this process keeps of the frozen KL reference, counted before any forward (FSDP
    # keeps the root unit's weights, the embeddings and final layers, gathered after a
    # forward without backward)
    reference_local = None if trainer.reference is None else local_numel(trainer.reference)
    forward_dtype: dict[str, str] = {}
    units = adapter.shard_units()
    if units:  # the dtype a unit's weights have inside its forward (gathered, under FSDP)
        def note_dtype(module: torch.nn.Module, _: Any) -> None:
            forward_dtype.setdefault("dtype", str(next(module.parameters()).dtype))

        units[0].register_forward_pre_hook(note_dtype)
    for _ in range(args.warmup):
        trainer.step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    metrics = []
    for i in range(args.iterations):
        metrics.append(trainer.step().metrics)  # seconds etc. averaged over ranks
        if rank == 0:
            print(f"iteration {i + 1}: {metrics[-1]['seconds']:.2f} s on {world} process(es)",
                  flush=True)

    peak = flux_scale.peak_memory(device)
    checksum = weights_checksum(adapter)
    if distributed:
        import torch.distributed as dist

        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"peak": peak, "checksum": checksum,
                                          "setup_peak": setup_peak,
                                          "setup_host_peak": setup_host_peak})
        peaks = [g["peak"] for g in gathered]
        setup_peaks = [g["setup_peak"] for g in gathered]
        host_peaks = [g["setup_host_peak"] for g in gathered]
        checksums = [g["checksum"] for g in gathered]
    else:
        peaks, setup_peaks, checksums = [peak], [setup_peak], [checksum]
        host_peaks = [setup_host_peak]

    def median(key: str) -> float:
        return statistics.median(float(m[key]) for m in metrics)

    seconds = median("seconds")
    report: dict[str, Any] = {
        "benchmark": "benchmarks/flux_ddp_scaling.py", "case": CASE,
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "processes": world, "ddp": distributed, "tiny": args.tiny,
        "resolution": args.resolution, "group_size": args.group_size,
        "lora_rank": args.lora_rank, "rollout_steps": config.rollout_steps,
        "prompts_per_rank": args.prompts_per_rank,
        "prompts_per_iteration": config.prompts_per_iteration,
        "iterations": args.iterations, "warmup": args.warmup, "torch_compile": args.compile,
        "finetune": args.finetune, "parallelism": args.parallelism if distributed else None,
        "trained_params": sum(p.numel() for p in adapter.trainable_parameters()),
        "mixed_precision": args.mixed_precision,
        # sharded: what this process keeps of the weights (FSDP), and in which dtype
        "local_params": local_numel(adapter),
        "master_dtype": str(next(adapter.parameters()).dtype),
        "forward_weights_dtype": forward_dtype.get("dtype"),
        "gradient_checkpointing": args.checkpointing,
        "gradient_checkpointing_fraction": args.checkpoint_fraction if args.checkpointing else 0.0,
        "build_seconds": build_seconds, "seconds": seconds,
        "rollout_seconds": median("rollout_seconds"), "update_seconds": median("update_seconds"),
        "prompts_per_second": config.prompts_per_iteration / seconds,
        "forward_passes": int(metrics[0]["forward_passes"]),  # summed over ranks
        "backward_passes": int(metrics[0]["backward_passes"]),
        "peak_memory_gib_max_rank": max(peaks) / 2**30,
        "stage_on_cpu": args.stage_on_cpu,
        # on a card: the allocator's peak up to the first iteration (on a CPU: the max RSS)
        "setup_peak_memory_gib_max_rank": max(setup_peaks) / 2**30,
        # host memory up to the first iteration, each process's peak resident set
        "setup_host_peak_gb_per_rank": [round(h / 1e9, 2) for h in host_peaks],
        "trained_weights_checksum_per_rank": checksums,
        "weights_checksum_before_training": checksum_before,
        "kl_coefficient": config.kl_coefficient,
        "kl_to_reference": [float(m.get("kl_to_reference", math.nan)) for m in metrics]}
    if reference_local is not None:
        report["reference_local_params"] = reference_local
        report["reference_vs_initial_policy_max_abs"] = reference_gap
    if args.baseline:
        one = json.loads(Path(args.baseline).read_text())
        report["baseline"] = args.baseline
        report["scaling"] = report["prompts_per_second"] / one["prompts_per_second"]
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        if args.figures:
            record_scaling(Path(args.figures), world, report)
        scaling = f", {report['scaling']:.2f}x the baseline" if "scaling" in report else ""
        print(f"{world} process(es), {report['card']}: {seconds:.2f} s per iteration of "
              f"{config.prompts_per_iteration} prompt(s), {report['prompts_per_second']:.3f} "
              f"prompts/s{scaling}; peak {report['peak_memory_gib_max_rank']:.1f} GiB "
              f"(setting up: {report['setup_peak_memory_gib_max_rank']:.1f}); "
              f"checksums {checksums}", flush=True)
    if distributed:
        del trainer
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # gloo's threads can abort a normal interpreter exit ("terminate called ...")
    return 0


def record_scaling(figures: Path, world: int, report: dict[str, Any]) -> None:
    """Put this run's prompts (iterations of one prompt) per second into the FLUX-scale
    figures file's `scaling` under the number of processes, with where it came from."""
    data = json.loads(figures.read_text()) if figures.is_file() else {}
    data.setdefault("scaling", {})[str(world)] = report["prompts_per_second"]
    data.setdefault("scaling_runs", {})[str(world)] = {
        k: report[k] for k in ("card", "processes", "seconds", "prompts_per_second",
                               "torch_compile", "gradient_checkpointing",
                               "gradient_checkpointing_fraction", "resolution")}
    tmp = figures.with_name(figures.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(figures)


if __name__ == "__main__":
    raise SystemExit(main())
