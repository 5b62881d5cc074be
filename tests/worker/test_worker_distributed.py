"""The distributed path on two CPU processes (torchrun, gloo): DDP averages the gradients of
the two half batches into exactly the full-batch gradient, the ranks keep identical weights,
and a run gives the same metrics as one process with the same total batch (the same prompts
every iteration, the same work counts, reward means within tolerance: each rank draws its
own noises, so per-iteration values differ by sampling noise). The one-process reference runs
the same code (trainer/distributed.py) on a world of one. Then a real train job with
TRAIN_NPROC=2 through the worker, rank 0 recording."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from worker_helpers import (
    checkpoint_iterations,
    create_train_job,
    job_row,
    metric_iterations,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("ddp_check.py")
ITERATIONS = 6


def _run(cmd: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_two_gloo_processes_match_one_process_with_the_same_total_batch():
    # the reference is the same code on a world of one process: the shared RNG then advances
    # identically, so both runs see the same prompts in every iteration
    single = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "1", str(SCRIPT), str(ITERATIONS)])
    ddp = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", str(SCRIPT), str(ITERATIONS)])
    one = [r for r in single if "metrics" in r]
    two = [r for r in ddp if "metrics" in r]
    check = next(r for r in ddp if "grad_max_diff" in r)
    assert len(one) == len(two) == ITERATIONS
    # DDP: the reduced half-batch gradients are the full-batch gradient
    assert check["grad_max_diff"] < 1e-5
    # every rank holds the same weights after training
    assert check["checksums"][0] == pytest.approx(check["checksums"][1], abs=1e-9)
    for a, b in zip(one, two, strict=True):
        # the same global prompts (rank 0 shows its half: every other one)
        assert b["prompts"] == a["prompts"][0::2]
        for key in ("forward_passes", "backward_passes", "optimizer_steps", "iteration"):
            assert b["metrics"][key] == a["metrics"][key], key
        assert b["metrics"]["world_size"] == 2
    reward_one = np.mean([r["metrics"]["reward_mean"] for r in one])
    reward_two = np.mean([r["metrics"]["reward_mean"] for r in two])
    assert abs(reward_one - reward_two) < 0.1, (reward_one, reward_two)
    for key in ("abs_log_ratio", "clip_fraction"):
        assert np.mean([r["metrics"][key] for r in two]) < 0.05
    assert abs(np.mean([r["metrics"]["advantage_abs_mean"] for r in one])
               - np.mean([r["metrics"]["advantage_abs_mean"] for r in two])) < 0.25


@pytest.mark.slow
def test_a_train_job_with_train_nproc_2_runs_under_torchrun(stack):
    stack.start_worker(extra_env={"TRAIN_NPROC": "2", "OMP_NUM_THREADS": "1"})
    job_id = create_train_job(iterations=4, prompts_per_iteration=4, sample_every=2,
                              checkpoint_every=2)
    stack.send(job_id)
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 180,
                   "the distributed job", stack)
    assert job.status == "succeeded", job.error
    assert metric_iterations(job_id) == [1, 2, 3, 4]
    assert checkpoint_iterations(job_id) == [2, 4]
    assert job.metrics["world_size"] == 2
