"""Neighbor GRPO against the SDE baseline at FLUX.1-dev scale on one GPU (issue 20): seconds
per iteration split into rollout, reward and update, forward and backward passes, peak memory,
and the update phase's model FLOPs utilisation against the card's bf16 matmul peak measured in
the same run.

FLUX.1-dev's transformer at full size with random bf16 weights, 512x512 (1,024 image tokens),
random prompt embeddings of the real sizes (T5 512 x 4096, pooled CLIP 768) in the adapter's
prompt cache, LoRA rank 64, the jpeg_compressibility reward: the model is built once by
benchmarks/real_models.py's `build_model` and every case gets a fresh Trainer around it.

    python benchmarks/flux_scale.py                              # the four cases, on CUDA
                                       # (compiled, a quarter of the blocks checkpointed)
    python benchmarks/flux_scale.py --cases neighbor-8,sde-25    # a subset
    python benchmarks/flux_scale.py --tiny --device cpu          # the same code at toy size (CI)

Cases run in the order given (default: the headline pair first, so that a run cut short by a
time limit keeps them); the JSON (--out) is rewritten after every case. One warm-up iteration
of the first case warms kernels and the allocator for all of them (same shapes throughout).

What the FLOPs are: torch.utils.flop_counter.FlopCounterMode (matmuls, convolutions, SDPA)
over one sample's transformer forward (no grad) and one sample's forward + backward with
gradient checkpointing off, through the adapter's own forward, untimed. FLOPs are linear in
the batch (every sample has the same tokens), so an update's model FLOPs are
(update forwards without gradient) x forward + (trained predictions) x (forward + backward).
Gradient checkpointing's recomputation is not model work: it is in `update_hfu` alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import real_models  # noqa: E402  (this folder is not a package)

from trainer.config import PRESETS, TrainConfig  # noqa: E402
from trainer.loop import Trainer  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "figures" / "flux_scale.json"
# the setting that met both single-card targets (docs/benchmarks.md), the flux-lora preset's
FLUX_LORA_FRACTION = PRESETS["flux-lora"].get("gradient_checkpointing_fraction", 1.0)

# case -> TrainConfig fields. Neighbor GRPO at the paper's cheapest setting (DPM++ rollouts,
# B = 4 anchors, K = 4); the SDE baseline at DanceGRPO's (the paper's Table 5: K = 14 trained
# steps of every member). num_anchors is the number of optimizer steps for the SDE method
# (trainer/sde_grpo.py splits the members into that many); B = G gives one member per step.
CASES: dict[str, dict[str, Any]] = {
    "neighbor-8": dict(method="neighbor", rollout_solver="dpm++", rollout_steps=8,
                       num_anchors=4, num_train_timesteps=4),
    "sde-25": dict(method="sde", rollout_solver="euler", rollout_steps=25,
                   num_anchors="G", num_train_timesteps=14, clip_range=1e-4),
    "neighbor-16": dict(method="neighbor", rollout_solver="dpm++", rollout_steps=16,
                        num_anchors=4, num_train_timesteps=4),
    "sde-16": dict(method="sde", rollout_solver="euler", rollout_steps=16,
                   num_anchors="G", num_train_timesteps=14, clip_range=1e-4),
}
HEADLINE_NEIGHBOR, HEADLINE_SDE = "neighbor-8", "sde-25"
PROMPTS = [f"prompt {i}" for i in range(4)]


def case_config(name: str, args: argparse.Namespace) -> TrainConfig:
    """The flux-lora preset with the case's algorithm settings (steps scaled in smoke runs)."""
    fields = dict(CASES[name])
    group = args.group_size
    steps = max(2, round(fields["rollout_steps"] * args.steps_scale))
    fields["rollout_steps"] = steps
    fields["num_train_timesteps"] = min(fields["num_train_timesteps"], steps)
    fields["num_anchors"] = group if fields["num_anchors"] == "G" else min(fields["num_anchors"],
                                                                            group)
    sde = fields["method"] == "sde"
    config = dict(PRESETS["flux-lora"])
    config.update(fields)
    config.update(lora_rank=args.lora_rank, device=args.device,
                  model_path="(random weights)", resolution=args.resolution, prompts=PROMPTS,
                  prompts_per_iteration=1, group_size=group, rollout_batch_size=group,
                  train_batch_size=args.sde_train_batch_size if sde else args.train_batch_size,
                  mixed_precision="bf16" if args.device.startswith("cuda") else "no",
                  gradient_checkpointing=args.checkpointing, torch_compile=args.compile,
                  gradient_checkpointing_fraction=args.checkpoint_fraction,
                  iterations=args.iterations + 1)
    return TrainConfig.from_dict(config)


# ---------------------------------------------------------------------------------------
# The card's limit and the model's work
# ---------------------------------------------------------------------------------------
def matmul_peak(device: torch.device, size: int, reps: int = 50) -> dict[str, Any]:
    """The card's dense peak as a large square matrix product reaches it (bf16 on CUDA, timed
    with CUDA events after a warm-up, best of three runs); fp32 and wall clock on a CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(5):
        torch.mm(a, b, out=out)
    best = math.inf
    for _ in range(3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            seconds = time.perf_counter() - began
        best = min(best, seconds / reps)
    del a, b, out
    return {"tflops": 2 * size**3 / best / 1e12, "size": size, "reps": reps,
            "dtype": str(dtype).removeprefix("torch."), "seconds_per_matmul": best}


def count_sample_flops(adapter: torch.nn.Module, prompt: str) -> dict[str, Any]:
    """FlopCounterMode over one sample through the adapter's forward: a forward pass without
    gradient (rollouts, pi_old) and a forward + backward with gradient checkpointing off (a
    trained prediction's model FLOPs; the recomputation is hardware work, not model work).
    Counted through eager blocks where they are compiled (torch_compile): the model's FLOPs do
    not depend on how kernels are fused, and the counter sees eager operators only."""
    from torch.utils.flop_counter import FlopCounterMode

    device = adapter.device
    x = torch.randn(1, *adapter.latent_shape, device=device)
    t = torch.full((1,), 0.5, device=device)
    cond = adapter.encode_prompts([prompt])
    transformer = adapter.transformer
    checkpointing = bool(getattr(transformer, "is_gradient_checkpointing", False))
    with torch.compiler.set_stance("force_eager"):
        with torch.no_grad(), FlopCounterMode(display=False) as forward_counter:
            adapter(x, t, cond)
        if checkpointing:
            adapter.set_gradient_checkpointing(False)
        try:
            with FlopCounterMode(display=False) as counter:
                adapter(x, t, cond).square().mean().backward()
        finally:
            if checkpointing:
                adapter.set_gradient_checkpointing(True)  # the same share of blocks again
            for param in adapter.parameters():  # the next Trainer's optimizer starts clean
                param.grad = None
    forward = forward_counter.get_total_flops()
    both = counter.get_total_flops()
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return {"counted": "torch.utils.flop_counter.FlopCounterMode (matmul, conv, SDPA) over one "
                       "sample (batch 1) through the adapter's forward: forward without "
                       "gradient, and forward + backward with gradient checkpointing off",
            "forward_flops_per_sample": int(forward),
            "forward_backward_flops_per_sample": int(both),
            "backward_factor": (both - forward) / forward if forward else None,
            # FlopCounterMode knows the CUDA SDPA kernels, not the CPU one
            "attention_counted": any("attention" in op for op in by_op),
            "forward_backward_flops_by_op": by_op}


def add_flops(row: dict[str, Any], flops: dict[str, Any], peak_tflops: float) -> None:
    """The case's model FLOPs per phase and their utilisation of the measured peak."""
    forward = flops["forward_flops_per_sample"]
    both = flops["forward_backward_flops_per_sample"]
    trained = row["backward_passes"]
    rollout_forwards = row["rollout_forwards"]
    # forwards without gradient in the update (the KL reference; pi_old comes from the rollout)
    update_forwards = row["forward_passes"] - rollout_forwards - trained
    update = update_forwards * forward + trained * both
    # the recomputed share of the blocks' forwards (blocks taken as equal in cost)
    recompute = (trained * forward * row["gradient_checkpointing_fraction"]
                 if row["gradient_checkpointing"] else 0)
    peak = peak_tflops * 1e12
    row.update({
        "update_forward_only_passes": update_forwards,
        "update_model_flops": update,
        "update_model_tflops_per_s": update / row["update_seconds"] / 1e12,
        "update_mfu": update / row["update_seconds"] / peak,
        "update_hfu": (update + recompute) / row["update_seconds"] / peak,
        "rollout_mfu": rollout_forwards * forward / row["rollout_seconds"] / peak,
        "iteration_mfu": (rollout_forwards * forward + update) / row["seconds"] / peak,
    })


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------
def peak_memory(device: torch.device) -> float:
    """Bytes: the CUDA allocator's peak since the last reset; on a CPU the process's max RSS
    (the whole process, so only a sanity figure)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def peak_reserved(device: torch.device) -> float | None:
    """Bytes the CUDA caching allocator held at its peak (what the card must have free,
    fragmentation included); None off CUDA."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_reserved(device))
    return None


def cap_memory(device: torch.device, cap_gb: float) -> dict[str, float]:
    """Let this process allocate at most `cap_gb` (1e9 bytes) on the card, so a run on a
    larger card shows what fits on a smaller one (an 80 GB H100 from a 141 GB H200): the
    caching allocator raises out-of-memory past the cap as the smaller card would."""
    # an index: set_per_process_memory_fraction refuses a bare "cuda" device
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, cap_gb * 1e9 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return {"memory_cap_gb": cap_gb, "card_total_gb": total / 1e9,
            "memory_fraction": fraction}


def run_case(name: str, adapter: torch.nn.Module, args: argparse.Namespace,
             warmup: bool) -> dict[str, Any]:
    """One case's timed iterations (after one warm-up iteration when `warmup`), the median
    of each phase's seconds."""
    config = case_config(name, args)
    device = torch.device(args.device)
    began = time.perf_counter()
    trainer = Trainer(config, model=adapter)
    row: dict[str, Any] = {
        "case": name, "method": config.method, "rollout_solver": config.rollout_solver,
        "rollout_steps": config.rollout_steps, "group_size": config.group_size,
        "num_anchors": config.num_anchors, "num_train_timesteps": config.num_train_timesteps,
        "train_batch_size": config.train_batch_size,
        "rollout_batch_size": config.rollout_batch_size,
        "gradient_checkpointing": config.gradient_checkpointing,
        "gradient_checkpointing_fraction": config.gradient_checkpointing_fraction,
        "prompts_per_iteration": config.prompts_per_iteration, "iterations": args.iterations}
    try:
        if warmup:
            start = time.perf_counter()
            trainer.step()
            row["warmup_seconds"] = time.perf_counter() - start
            print(f"  warm-up iteration ({name}): {row['warmup_seconds']:.2f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        metrics = []
        for i in range(args.iterations):
            metrics.append(trainer.step().metrics)
            m = metrics[-1]
            print(f"  {name} iteration {i + 1}: {m['seconds']:.2f} s (rollout "
                  f"{m['rollout_seconds']:.2f}, reward {m['score_seconds']:.2f}, update "
                  f"{m['update_seconds']:.2f})", flush=True)
    finally:
        del trainer
        gc.collect()

    def median(key: str) -> float:
        return statistics.median(float(m[key]) for m in metrics)

    peak = peak_memory(device)
    reserved = peak_reserved(device)
    P, G, T = config.prompts_per_iteration, config.group_size, config.rollout_steps
    row.update({
        "seconds": median("seconds"), "rollout_seconds": median("rollout_seconds"),
        "reward_seconds": median("score_seconds"),  # decode + jpeg_compressibility
        "update_seconds": median("update_seconds"),
        "iterations_per_second": 1 / median("seconds"),
        "forward_passes": int(metrics[0]["forward_passes"]),
        "backward_passes": int(metrics[0]["backward_passes"]),
        "optimizer_steps": int(metrics[0]["optimizer_steps"]),
        "rollout_forwards": P * G * T,
        "peak_memory_gb": peak / 1e9, "peak_memory_gib": peak / 2**30,
        "peak_reserved_gb": reserved / 1e9 if reserved is not None else None,
        "case_wall_seconds": time.perf_counter() - began})
    return row


def sync_report(name: str, adapter: torch.nn.Module, args: argparse.Namespace
                ) -> dict[str, Any]:
    """One iteration of the case under torch.cuda.set_sync_debug_mode('warn'): every
    operation that makes the host wait for the GPU warns, and each warning is traced to the
    innermost frames of this project's code (trainer/, benchmarks/) that led to it."""
    import traceback as tb
    import warnings

    root = str(Path(__file__).resolve().parents[1])
    sites: dict[str, int] = {}

    shown = warnings.showwarning

    def note(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" not in str(message):  # torch: "called a synchronizing CUDA operation"
            shown(message, category, filename, lineno, *rest)
            return
        frames = [f for f in tb.extract_stack()[:-1] if f.filename.startswith(root)]
        where = " < ".join(f"{Path(f.filename).relative_to(root)}:{f.lineno} {f.name}"
                           for f in reversed(frames[-3:])) or f"{filename}:{lineno}"
        sites[where] = sites.get(where, 0) + 1

    trainer = Trainer(case_config(name, args), model=adapter)
    trainer.step()  # warm (the first step of a fresh optimizer allocates its state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.step()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = shown
        del trainer
        gc.collect()
    ordered = sorted(sites.items(), key=lambda item: -item[1])
    return {"case": name, "how": "torch.cuda.set_sync_debug_mode('warn') over one iteration "
            "after a warm-up; each warning traced to the innermost three frames of this "
            "project's code", "total": sum(sites.values()),
            "sites": [{"where": where, "count": count} for where, count in ordered]}


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------
TABLE_HEAD = ("| case | T | G | B | K | s/iter | rollout | reward | update | fwd | bwd | "
              "peak GiB | update TFLOP/s | update MFU |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"| {row['case']} | error: {row['error'][:80]} |"
    tflops = row.get("update_model_tflops_per_s")
    mfu = row.get("update_mfu")
    return (f"| {row['case']} | {row['rollout_steps']} | {row['group_size']} | "
            f"{row['num_anchors']} | {row['num_train_timesteps']} | {row['seconds']:.2f} | "
            f"{row['rollout_seconds']:.2f} | {row['reward_seconds']:.2f} | "
            f"{row['update_seconds']:.2f} | {row['forward_passes']} | "
            f"{row['backward_passes']} | {row['peak_memory_gib']:.1f} | "
            f"{'-' if tflops is None else f'{tflops:.3g}'} | "
            f"{'-' if mfu is None else f'{mfu:.1%}'} |")


PEAK_AND_SCALING_NOTE = (
    "peak_memory_gb is the largest case's peak (the SDE baseline's at its setting), "
    "neighbor_peak_memory_gb Neighbor GRPO's own; scaling maps a GPU count to one-prompt "
    "iterations per second (prompts per second: each GPU runs one prompt's group a step; "
    "scaling_runs has the seconds), so its ratios are the data-parallel speed-up")


def summary(report: dict[str, Any]) -> None:
    """The headline keys, from the cases that finished (None where one did not)."""
    rows = {r["case"]: r for r in report["cases"] if "error" not in r}
    neighbor, sde = rows.get(HEADLINE_NEIGHBOR), rows.get(HEADLINE_SDE)
    report["neighbor_s_per_iteration"] = neighbor["seconds"] if neighbor else None
    report["sde_s_per_iteration"] = sde["seconds"] if sde else None
    report["speedup"] = sde["seconds"] / neighbor["seconds"] if neighbor and sde else None
    report["update_mfu"] = neighbor.get("update_mfu") if neighbor else None
    report["peak_memory_gb"] = max((r["peak_memory_gb"] for r in rows.values()), default=None)
    report["peak_memory_gib"] = max((r["peak_memory_gib"] for r in rows.values()), default=None)
    # the headline peak is the largest case's (the SDE's); the method's own is beside it
    report["neighbor_peak_memory_gb"] = neighbor["peak_memory_gb"] if neighbor else None
    if len(report.get("scaling") or {}) < 2:  # not the data-parallel run's (kept, see write)
        report["scaling"] = {"1": neighbor["iterations_per_second"]} if neighbor else {}


def write(report: dict[str, Any], out: Path) -> None:
    """Whole-file replace, so that a run killed mid-write leaves the previous version. The
    previous file's `scaling` over several GPUs (benchmarks/flux_ddp_scaling.py --figures,
    its GPU counts measured side by side in one run) is kept with its `scaling_runs`: this
    benchmark runs on one card and cannot re-measure it."""
    if out.is_file() and "scaling" not in report:
        try:
            previous = json.loads(out.read_text())
        except (OSError, ValueError):
            previous = {}
        if len(previous.get("scaling") or {}) > 1:
            report["scaling"] = previous["scaling"]
            report["scaling_runs"] = previous.get("scaling_runs", {})
    summary(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("diffusers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "missing"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"any of {', '.join(CASES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="toy-size model (CPU smoke run)")
    parser.add_argument("--resolution", type=int, help="pixels (default 512; --tiny: 32)")
    parser.add_argument("--group-size", type=int, default=12)
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=1, help="timed iterations per case")
    parser.add_argument("--warmup", type=int, default=1, choices=(0, 1),
                        help="one warm-up iteration of the first case (shared by all; "
                             "with --compile, one per case)")
    parser.add_argument("--train-batch-size", type=int, default=4,
                        help="Neighbor GRPO: trained predictions per forward-backward pass "
                             "(one anchor slot has P x K = 4)")
    parser.add_argument("--sde-train-batch-size", type=int, default=7,
                        help="SDE: trained predictions per forward-backward pass (one member's "
                             "K = 14 steps in two passes)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="turn gradient checkpointing off (more memory, no recompute)")
    parser.add_argument("--checkpoint-fraction", type=float, default=FLUX_LORA_FRACTION,
                        help="gradient_checkpointing_fraction: the share of the blocks "
                             "recomputed (1: all; 0.5: every other block; default "
                             f"{FLUX_LORA_FRACTION}, the flux-lora preset's)")
    parser.add_argument("--sync-report", action="store_true",
                        help="after the cases, one more iteration of the first case with "
                             "torch.cuda.set_sync_debug_mode('warn'): where the host waits "
                             "for the GPU, by phase and source line (CUDA only)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch_compile: compile the transformer's blocks (the warm-up "
                             "iteration then includes the compilation; default: on for a "
                             "full-size run on CUDA, as the flux-lora preset, off otherwise)")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply every case's rollout steps (K capped at the steps); "
                             "for smoke runs only")
    parser.add_argument("--matmul-size", type=int, help="side of the peak-measuring matmul "
                        "(default 8192; --tiny: 256)")
    parser.add_argument("--memory-cap-gb", type=float,
                        help="CUDA: allocate at most this many GB (1e9 bytes), to show what "
                             "fits a smaller card (80 for an 80 GB H100) on a larger one")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    args.resolution = args.resolution or (32 if args.tiny else 512)
    if args.compile is None:
        args.compile = bool(PRESETS["flux-lora"].get("torch_compile")) and not args.tiny \
            and torch.device(args.device).type == "cuda"
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    device = torch.device(args.device)
    if args.memory_cap_gb is not None and device.type != "cuda":
        parser.error("--memory-cap-gb needs a CUDA device")
    out = Path(args.out)
    card = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu")
    report: dict[str, Any] = {
        "benchmark": "benchmarks/flux_scale.py", "card": card, "device": str(device),
        **versions(), "tiny": args.tiny, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime()),
        "settings": {"model": "FLUX.1-dev architecture, random bf16 weights" if not args.tiny
                     else "tiny FLUX", "resolution": args.resolution,
                     "group_size": args.group_size, "lora_rank": args.lora_rank,
                     "prompts_per_iteration": 1, "reward": "jpeg_compressibility",
                     "gradient_checkpointing": args.checkpointing,
                     "gradient_checkpointing_fraction": args.checkpoint_fraction,
                     "torch_compile": args.compile,
                     "train_batch_size": args.train_batch_size,
                     "steps_scale": args.steps_scale, "iterations": args.iterations,
                     "warmup": f"{args.warmup} iteration per case" if args.compile else
                     f"{args.warmup} iteration of {names[0]}, shared by all cases"},
        "notes": "seconds are medians of the timed iterations; reward_seconds = VAE decode + "
                 "reward; peak memory is torch.cuda.max_memory_allocated over the timed "
                 "iterations (CPU: the process's max RSS; peak_reserved_gb: "
                 "max_memory_reserved, the allocator's hold); update_mfu = update model FLOPs / "
                 "update seconds / matmul_peak_tflops (see flops_counted); speedup = "
                 f"{HEADLINE_SDE} / {HEADLINE_NEIGHBOR} seconds per iteration; "
                 + PEAK_AND_SCALING_NOTE,
        "cases": []}
    print(f"device: {card}; torch {report['torch']}, diffusers {report['diffusers']}, peft "
          f"{report['peft']}, Python {report['python']}; {args.resolution}px, G="
          f"{args.group_size}, LoRA rank {args.lora_rank}, cases {names}", flush=True)
    began = time.perf_counter()

    peak = matmul_peak(device, args.matmul_size or (256 if args.tiny else 8192))
    report["matmul_peak_tflops"] = peak["tflops"]
    report["matmul"] = peak
    if args.memory_cap_gb is not None:  # after the matmul, which measures the card itself
        report["settings"].update(cap_memory(device, args.memory_cap_gb))
        print(f"memory capped at {args.memory_cap_gb:g} GB of the card's "
              f"{report['settings']['card_total_gb']:.1f} GB", flush=True)
    print(f"matmul peak: {peak['tflops']:.1f} TFLOP/s ({peak['size']}^3 {peak['dtype']})",
          flush=True)
    write(report, out)

    start = time.perf_counter()
    try:
        build_config = case_config(names[0], args)
        adapter = real_models.build_model("flux", "lora", args.checkpointing, device,
                                          args.tiny, build_config)
    except Exception as exc:  # nothing can run; say why in the figures file
        report["error"] = f"model build failed: {type(exc).__name__}: {exc}"[:2000]
        write(report, out)
        traceback.print_exc()
        return 1
    report["build_seconds"] = time.perf_counter() - start
    report["transformer_params"] = sum(p.numel() for p in adapter.transformer.parameters())
    report["trainable_params"] = sum(p.numel() for p in adapter.trainable_parameters())
    print(f"model built in {report['build_seconds']:.1f} s: "
          f"{report['transformer_params'] / 1e9:.2f}B parameters, "
          f"{report['trainable_params'] / 1e6:.1f}M trained", flush=True)
    write(report, out)

    flops: dict[str, Any] | None = None
    warmed = args.warmup == 0  # the warm-up moves to the next case when a case fails
    print(TABLE_HEAD.replace("|\n", f"|  ({card})\n", 1), flush=True)
    for name in names:
        try:
            # compiled blocks compile again for each new batch shape (the SDE's micro-batch
            # of 7): every case then warms up on its own
            row = run_case(name, adapter, args, warmup=not warmed or (args.compile and
                                                                      args.warmup == 1))
            warmed = True
        except Exception as exc:  # record it and go on: the next case may still fit
            row = {"case": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            traceback.print_exc()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if flops is None and "error" not in row:
            # counted once, after the first case's timed iterations (its peak memory is
            # already read; the counted backward runs without checkpointing)
            try:
                flops = count_sample_flops(adapter, PROMPTS[0])
                report["flops_counted"] = flops
                print(f"  counted: {flops['forward_flops_per_sample'] / 1e12:.2f} TFLOP per "
                      f"sample forward, backward factor {flops['backward_factor']:.2f}",
                      flush=True)
                for earlier in report["cases"]:
                    if "error" not in earlier:
                        add_flops(earlier, flops, peak["tflops"])
            except Exception as exc:
                flops = {}
                report["flops_counted"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                traceback.print_exc()
        if flops and "error" not in row:
            add_flops(row, flops, peak["tflops"])
        report["cases"].append(row)
        report["elapsed_seconds"] = time.perf_counter() - began
        write(report, out)
        print(f"{table_row(row)}  ({report['elapsed_seconds']:.0f} s so far)", flush=True)

    if args.sync_report:  # on a CPU nothing waits: the report is empty
        report["host_syncs"] = sync_report(names[0], adapter, args)
        write(report, out)
        for site in report["host_syncs"]["sites"]:
            print(f"  sync x{site['count']}: {site['where']}", flush=True)

    print(f"\n{TABLE_HEAD}", flush=True)
    for row in report["cases"]:
        print(table_row(row))
    speedup = report["speedup"]
    mfu = report["update_mfu"]
    print(f"\n{card}: {HEADLINE_SDE} / {HEADLINE_NEIGHBOR} = "
          f"{'-' if speedup is None else f'{speedup:.2f}x'}; update MFU ({HEADLINE_NEIGHBOR}) "
          f"{'-' if mfu is None else f'{mfu:.1%}'} of {peak['tflops']:.0f} TFLOP/s; "
          f"{report['elapsed_seconds']:.0f} s in all; figures in {out}", flush=True)
    return 0 if all("error" not in r for r in report["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
