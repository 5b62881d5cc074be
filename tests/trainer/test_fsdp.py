"""parallelism='fsdp' on two CPU processes (torchrun, gloo): the fully sharded run trains what the
DDP run trains, each process holds half of the weights, and its checkpoint is the ordinary
single-process file set, which a fresh sharded trainer resumes from exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigErrors, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("fsdp_check.py")


@pytest.mark.subprocess
def test_fsdp_trains_like_ddp_on_half_the_memory_and_resumes_exactly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(SCRIPT), str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    assert report["world"] == 2
    # sharded: each process keeps half of the parameters (up to uneven shards)
    assert report["local_params"] <= 0.51 * report["total_params"]
    # the same training as DDP: the same losses, gradient norms and weights
    assert report["trained_by"] > 1e-5  # the weights did move
    assert report["ddp_vs_fsdp"] < 1e-6
    ddp_norms, fsdp_norms = report["grad_norms"]
    assert fsdp_norms == pytest.approx(ddp_norms, rel=1e-4)
    assert report["losses"][1] == pytest.approx(report["losses"][0], rel=1e-4, abs=1e-9)
    # rank 0 wrote the usual files with the full (gathered) weights
    assert report["files"] == ["README.md", "model.safetensors", "trainer_state.safetensors"]
    assert report["disk_vs_gathered"] == 0.0
    # a fresh sharded trainer resumes from them: the next step is the same step
    assert report["resumed_iteration"] == 3 and report["third_step_moved"] > 0
    assert report["resume_diff"] < 1e-7


@pytest.mark.subprocess
def test_fsdp_with_a_kl_penalty_trains_like_ddp_against_a_sharded_reference(tmp_path):
    """kl_coefficient > 0 under FSDP: the frozen base is copied before sharding and sharded
    like the policy (half of it on each process, outside the optimizer), and the run trains
    what DDP trains with the same penalty."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(SCRIPT), str(tmp_path), "kl"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    assert report["reference_sharded"]
    assert report["reference_local_params"] <= 0.51 * report["total_params"]
    assert report["optimized_params"] == report["policy_params"]
    ddp_kl, fsdp_kl = report["kl"]
    assert fsdp_kl[1] > 0  # the second step's policy has left the reference
    assert fsdp_kl == pytest.approx(ddp_kl, rel=1e-4, abs=1e-12)
    assert report["trained_by"] > 1e-5 and report["ddp_vs_fsdp"] < 1e-6


def test_fsdp_with_a_kl_penalty_is_a_valid_config():
    config = TrainConfig.from_dict({"parallelism": "fsdp", "kl_coefficient": 0.1})
    assert config.kl_coefficient == 0.1


def test_fsdp_with_torch_compile_is_a_valid_config():
    # the compiled blocks are sharded like eager ones (test_flux_ddp_scaling_benchmark.py)
    config = TrainConfig.from_dict({"model": "flux", "model_path": "/m", "finetune": "full",
                                    "parallelism": "fsdp", "torch_compile": True,
                                    "reward_weights": {"jpeg_compressibility": 1.0}})
    assert config.torch_compile and config.parallelism == "fsdp"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": "flux", "model_path": "/m", "finetune": "lora"}, "LoRA trains with 'ddp'"),
])
def test_fsdp_configs_that_cannot_run_are_rejected(overrides, message):
    TrainConfig.from_dict({"parallelism": "fsdp"})
    with pytest.raises(ConfigErrors) as info:
        TrainConfig.from_dict({"parallelism": "fsdp", **overrides})
    assert any(e.field == "parallelism" and message in e.message for e in info.value.errors)


@pytest.mark.subprocess
def test_a_sharded_job_loaded_as_the_worker_loads_it_stages_bf16_and_trains_fp32_masters(
        tmp_path):
    """`load_distributed_model` for an FSDP full fine-tuning job with a KL penalty, from a
    tiny FLUX.1-dev directory, mixed precision bf16: the weights are staged in CPU memory in
    bf16 and each rank makes fp32 masters from its half; its half of the frozen reference
    (bf16) is copied from its half of the policy; the run trains, its ranks agree, and the
    checkpoint holds the gathered fp32 weights, which a fresh sharded model resumes exactly."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(SCRIPT.with_name("staged_fsdp_check.py")),
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    assert report["world"] == 2 and report["local_share"] <= 0.51
    assert report["master_dtypes"] == ["torch.float32"]
    assert report["reference_dtypes"] == ["torch.bfloat16"]
    assert report["reference_vs_policy_at_start"] == 0.0
    assert report["kl_to_reference"][1] > 0  # the policy has left the reference
    first, second = report["checksums"]
    assert first == pytest.approx(second, rel=1e-12)
    assert report["disk_vs_gathered"] == 0.0 and report["disk_dtypes"] == ["torch.float32"]
    assert report["resumed_vs_saved"] == 0.0 and report["resumed_iteration"] == 2
    # its next step is the uninterrupted run's (weights, optimizer moments and RNG restored)
    assert report["next_step_moved"] > 1e-6
    assert report["next_step_resumed_vs_uninterrupted"] < 1e-6
    # a new job from the checkpoint (base_checkpoint): loaded into the shards exactly, fp32,
    # and its KL reference is the checkpoint, not the directory's base weights
    assert report["started_vs_saved"] == 0.0
    assert report["started_master_dtypes"] == ["torch.float32"]
    assert report["started_reference_vs_policy"] == 0.0
