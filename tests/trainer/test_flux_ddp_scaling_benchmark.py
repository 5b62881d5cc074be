"""benchmarks/flux_ddp_scaling.py at toy size: one process without DDP, then two CPU processes
under torchrun (gloo) against it, the same code path as the multi-GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "flux_ddp_scaling.py"
TINY = ["--tiny", "--device", "cpu", "--group-size", "4", "--lora-rank", "4",
        "--steps-scale", "0.5", "--iterations", "1", "--warmup", "1"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", **os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_two_processes_train_in_step_and_report_their_scaling(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    figures = tmp_path / "flux_scale.json"
    figures.write_text(json.dumps({"card": "x", "scaling": {"1": 0.5}}))
    _run([sys.executable, str(SCRIPT), *TINY, "--out", str(one), "--figures", str(figures)])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          str(SCRIPT), *TINY, "--baseline", str(one), "--out", str(two),
          "--figures", str(figures)])
    single, double = json.loads(one.read_text()), json.loads(two.read_text())
    assert (single["processes"], single["ddp"], single["prompts_per_iteration"]) == (1, False, 1)
    assert (double["processes"], double["ddp"], double["prompts_per_iteration"]) == (2, True, 2)
    # every rank ran Neighbor GRPO on its own prompt: G x T rollout forwards plus B x K
    # trained predictions each (G = 4, T = 4 after --steps-scale 0.5, B = K = 4)
    assert single["forward_passes"] == 4 * 4 + 4 * 4 and single["backward_passes"] == 16
    assert double["forward_passes"] == 2 * single["forward_passes"]
    assert double["backward_passes"] == 2 * single["backward_passes"]
    # DDP averaged the LoRA gradients: both ranks hold the same trained weights afterwards
    first, second = double["trained_weights_checksum_per_rank"]
    assert first == pytest.approx(second, rel=1e-6, abs=1e-9)
    assert double["scaling"] == pytest.approx(
        double["prompts_per_second"] / single["prompts_per_second"])
    # both runs land in the FLUX-scale figures file's scaling, the rest of it kept
    recorded = json.loads(figures.read_text())
    assert recorded["card"] == "x"
    assert recorded["scaling"] == {"1": single["prompts_per_second"],
                                   "2": double["prompts_per_second"]}
    assert recorded["scaling_runs"]["2"]["processes"] == 2
    for report in (single, double):
        assert report["seconds"] > 0 and report["peak_memory_gib_max_rank"] > 0


def test_full_fine_tuning_sharded_over_two_processes(tmp_path):
    out = tmp_path / "fsdp.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          str(SCRIPT), *TINY, "--finetune", "full", "--parallelism", "fsdp",
          "--mixed-precision", "bf16", "--out", str(out)])
    report = json.loads(out.read_text())
    assert (report["processes"], report["parallelism"], report["finetune"]) == (2, "fsdp", "full")
    # each process keeps half of the fp32 master weights and gathers them in bf16 for compute
    assert report["local_params"] <= 0.51 * report["trained_params"]
    assert report["master_dtype"] == "torch.float32"
    assert report["forward_weights_dtype"] == "torch.bfloat16"
    assert report["backward_passes"] == 2 * 16  # both ranks trained their prompt
    # full fine-tuning: every transformer weight trains; the gathered weights agree on both ranks
    assert report["trained_params"] > 10_000
    first, second = report["trained_weights_checksum_per_rank"]
    assert first == pytest.approx(second, rel=1e-9)


def test_full_fine_tuning_sharded_with_a_kl_penalty(tmp_path):
    """FSDP with kl_coefficient > 0 on the FLUX adapter: the frozen base (a copy of the
    transformer) is sharded like the policy and the penalty is measured against it. The
    weights are built in CPU memory and sharded from there, as the worker loads them."""
    out = tmp_path / "fsdp_kl.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          str(SCRIPT), *TINY, "--finetune", "full", "--parallelism", "fsdp",
          "--mixed-precision", "bf16", "--kl-coefficient", "0.1", "--stage-on-cpu",
          "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["kl_coefficient"] == 0.1 and report["stage_on_cpu"] is True
    assert report["setup_peak_memory_gib_max_rank"] > 0
    # warm-up then the timed iteration: the policy has moved off the reference by then
    assert report["kl_to_reference"][-1] > 0
    # half of the frozen copy on each process, as of the trained weights, each rank's half
    # copied from its shards of the policy as they were before any training
    assert report["reference_local_params"] <= 0.51 * report["trained_params"]
    assert report["reference_vs_initial_policy_max_abs"] == 0.0
    # staged in bf16, the weights train as fp32 masters, gathered in bf16 for compute
    assert report["master_dtype"] == "torch.float32"
    assert report["forward_weights_dtype"] == "torch.bfloat16"
    assert len(report["setup_host_peak_gb_per_rank"]) == 2
    first, second = report["trained_weights_checksum_per_rank"]
    assert first == pytest.approx(second, rel=1e-9)


def test_full_fine_tuning_sharded_and_compiled_trains_like_eager(tmp_path):
    """FSDP with torch_compile: each block is marked for compilation before FSDP shards it.
    In fp32 on two processes the compiled run moves the weights as the eager run does, and
    its ranks stay in step."""
    moved = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / f"{name}.json"
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node", "2", str(SCRIPT), *TINY, "--finetune", "full",
              "--parallelism", "fsdp", "--mixed-precision", "no", *extra, "--out", str(out)])
        report = json.loads(out.read_text())
        assert report["torch_compile"] is (name == "compiled")
        first, second = report["trained_weights_checksum_per_rank"]
        assert first == pytest.approx(second, rel=1e-9)
        moved[name] = first - report["weights_checksum_before_training"]
    assert moved["eager"] != 0
    assert moved["compiled"] == pytest.approx(moved["eager"], rel=1e-3), moved
