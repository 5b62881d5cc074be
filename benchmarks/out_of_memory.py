"""What a FLUX LoRA run that does not fit its card does (trainer.loop.TrainingOutOfMemory): one
process, one model, trainers in turn, under a memory cap that stands for a smaller card.

1. The flux-lora preset's settings (a quarter of the blocks checkpointed, the whole group
   rolled out and decoded at once) at `--resolution` (default 1,024 px), where the preset
   needs more than an 80 GB card holds (docs/benchmarks.md). What is recorded: the error's
   type and message (where in the iteration, and the settings to turn with the run's values),
   the iteration count after it (not moved), and the memory still allocated once it was
   raised, against the memory held before the iteration (the model and its LoRA).
2. Each `--then FIELD=VALUE[,FIELD=VALUE]` on the same model in the same process: the
   changes the message names. The last must run, in the memory the failed ones gave back.

    python benchmarks/out_of_memory.py --memory-cap-gb 80 --out oom.json   # on CUDA
    python benchmarks/out_of_memory.py --tiny --device cpu --out oom.json   # the code path (CI)

On a CPU (`--tiny`) nothing runs out of memory: every trainer runs, and the figures say so.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
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
from trainer.loop import Trainer, TrainingOutOfMemory  # noqa: E402

GIB = 2**30


def allocated_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def attempt(adapter: torch.nn.Module, args: argparse.Namespace, changes: dict[str, Any],
            device: torch.device) -> dict[str, Any]:
    """One Trainer around `adapter`: the preset's settings with `changes`, one iteration."""
    config = TrainConfig.from_dict({**flux_scale.case_config("neighbor-8", args).to_dict(),
                                    **changes})
    # the blocks to recompute are the model's, chosen when it is loaded (a resumed job loads
    # it from the changed config); one model serves every attempt here, so it is told again
    adapter.spec.gradient_checkpointing_fraction = config.gradient_checkpointing_fraction
    adapter.set_gradient_checkpointing(config.gradient_checkpointing)
    gc.collect()
    row: dict[str, Any] = {"changes": changes,
                           "gradient_checkpointing_fraction":
                               config.gradient_checkpointing_fraction,
                           "rollout_batch_size": config.rollout_batch_size,
                           "train_batch_size": config.train_batch_size,
                           "allocated_before_gib": allocated_gib(device)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(config, model=adapter)
    start = time.perf_counter()
    try:
        metrics = trainer.step().metrics
        row.update(outcome="ran", seconds=metrics["seconds"])
    except TrainingOutOfMemory as exc:
        row.update(outcome="TrainingOutOfMemory", message=str(exc),
                   seconds_to_error=time.perf_counter() - start)
    row["iteration_after"] = trainer.iteration
    del trainer
    gc.collect()
    row["allocated_after_gib"] = allocated_gib(device)
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    print(json.dumps(row, indent=1), flush=True)
    return row


def parse_changes(text: str) -> dict[str, Any]:
    """"a=1,b=0.5" -> {"a": 1, "b": 0.5} (values as JSON, else as strings)."""
    out: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        name, _, value = pair.partition("=")
        try:
            out[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[name.strip()] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="toy-size model (CPU smoke run)")
    parser.add_argument("--resolution", type=int, help="pixels (default 1024; --tiny: 32)")
    parser.add_argument("--group-size", type=int, default=12)
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--train-batch-size", type=int, default=4)
    parser.add_argument("--then", action="append", type=parse_changes,
                        help="FIELD=VALUE[,FIELD=VALUE...]: a trainer after the preset's, with "
                             "these config changes (repeatable; default: "
                             "gradient_checkpointing_fraction=1.0)")
    parser.add_argument("--compile", action="store_true",
                        help="torch_compile (off: the failure comes in seconds, not after a "
                             "minute of compilation)")
    parser.add_argument("--memory-cap-gb", type=float,
                        help="CUDA: allocate at most this many GB (1e9 bytes): 80 for an 80 GB "
                             "card")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.memory_cap_gb is not None and device.type != "cuda":
        parser.error("--memory-cap-gb needs a CUDA device")
    args.resolution = args.resolution or (32 if args.tiny else 1024)
    # what flux_scale.case_config reads besides these
    args.steps_scale, args.iterations, args.sde_train_batch_size = 1.0, 1, 7
    args.checkpointing = True
    card = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu")
    report: dict[str, Any] = {"benchmark": "benchmarks/out_of_memory.py", "card": card,
                              "device": str(device), "tiny": args.tiny,
                              "resolution": args.resolution, "group_size": args.group_size,
                              "lora_rank": args.lora_rank, "compile": args.compile,
                              "torch": torch.__version__}
    if args.memory_cap_gb is not None:
        report.update(flux_scale.cap_memory(device, args.memory_cap_gb))
    args.checkpoint_fraction = flux_scale.FLUX_LORA_FRACTION  # the preset's
    adapter = real_models.build_model("flux", "lora", True, device, args.tiny,
                                      flux_scale.case_config("neighbor-8", args))
    report["model_allocated_gib"] = allocated_gib(device)
    report["attempts"] = [attempt(adapter, args, changes, device) for changes in
                          [{}, *(args.then or [{"gradient_checkpointing_fraction": 1.0}])]]
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for row in report["attempts"]:
        print(f"{card}, {args.resolution} px, {row['changes'] or 'the preset'}: "
              f"{row['outcome']}", flush=True)
    return 0 if report["attempts"][-1]["outcome"] == "ran" else 1


if __name__ == "__main__":
    raise SystemExit(main())
