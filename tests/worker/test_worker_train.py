"""A real worker runs train jobs: metrics, rollout groups and checkpoints recorded; cancel ends a
job within one iteration after saving a checkpoint; a config that fails inside the worker ends
`failed` with the error on the row."""

from __future__ import annotations

import pytest
from worker_helpers import (
    checkpoint_iterations,
    create_train_job,
    groups_per_iteration,
    job_row,
    metric_iterations,
    resume_with_iterations,
    wait_for,
)


def _finished(job_id: int):
    job = job_row(job_id)
    return job if job.status in ("succeeded", "failed", "cancelled") else None


@pytest.mark.parametrize("stack", ["sqlite-fs", "postgres-redis"], indirect=True)
def test_tiny_train_job_succeeds(stack):
    from app.db import session_scope
    from app.services import checkpoints, jobs, rollouts, storage

    stack.start_worker()
    job_id = create_train_job(iterations=4, sample_every=2, checkpoint_every=2)
    stack.send(job_id)
    job = wait_for(lambda: _finished(job_id), 90, "the job to finish", stack)
    assert job.status == "succeeded", job.error
    assert job.iteration == 4 and job.total_iterations == 4 and job.attempts == 1
    assert job.started_at and job.finished_at and job.heartbeat_at and job.worker
    assert {"reward_mean", "reward_std", "loss", "clip_fraction", "seconds"} <= set(job.metrics)
    assert metric_iterations(job_id) == [1, 2, 3, 4]
    with session_scope() as s:
        history = jobs.metric_history(s, job_id)
        assert [m.metrics["iteration"] for m in history] == [1, 2, 3, 4]
    # one group per prompt (tiny: 2 prompts of G=4) every 2 iterations
    assert groups_per_iteration(job_id) == {2: 2, 4: 2}
    with session_scope() as s:
        groups, total = rollouts.list_groups(s, job_id=job_id)
        assert total == 4
        for group in groups:
            assert len(group.samples) == 4 and group.purpose == "train"
            assert sum(sm.is_anchor for sm in group.samples) == 2  # B = 2 anchors
            assert all("count" in sm.rewards and sm.advantage is not None
                       for sm in group.samples)
            assert storage.resolve(group.samples[0].image_path).read_bytes()[:4] == b"\x89PNG"
            assert group.seed >= 0
    assert checkpoint_iterations(job_id) == [2, 4]
    with session_scope() as s:
        newest = checkpoints.latest_checkpoint(s, job_id)
        assert newest.iteration == 4 and newest.parent_id is not None
        path = checkpoints.checkpoint_file(s, newest.id)
    assert path.name == "model.safetensors"
    assert (path.parent / "trainer_state.safetensors").is_file()


@pytest.mark.parametrize("stack", ["sqlite-fs", "postgres-redis"], indirect=True)
def test_cancel_ends_within_one_iteration_after_a_checkpoint(stack):
    from app.db import session_scope
    from app.services import jobs

    stack.start_worker()
    job_id = create_train_job(iterations=500, sample_every=1000, checkpoint_every=1000)
    stack.send(job_id)
    wait_for(lambda: job_row(job_id).iteration >= 3, 90, "three iterations", stack)
    with session_scope() as s:
        seen = jobs.request_cancel(s, job_id).iteration
    job = wait_for(lambda: _finished(job_id), 30, "the cancel", stack)
    assert job.status == "cancelled"
    # the iteration running when the flag was set finishes, then the job stops (one more may
    # have committed between reading the row and setting the flag)
    assert seen <= job.iteration <= seen + 2
    assert job.iteration < 500
    assert checkpoint_iterations(job_id) == [job.iteration]
    assert metric_iterations(job_id) == list(range(1, job.iteration + 1))


def test_resume_after_cancel_continues_the_metric_history(stack):
    from app.db import session_scope
    from app.services import jobs

    stack.start_worker()
    job_id = create_train_job(iterations=400, sample_every=1000, checkpoint_every=1000)
    stack.send(job_id)
    wait_for(lambda: job_row(job_id).iteration >= 2, 90, "two iterations", stack)
    with session_scope() as s:
        jobs.request_cancel(s, job_id)
    job = wait_for(lambda: _finished(job_id), 30, "the cancel", stack)
    stopped = job.iteration
    resume_with_iterations(job_id, stopped + 3)  # shortened, resumed as the API does
    stack.send(job_id)
    job = wait_for(lambda: _finished(job_id), 60, "the resumed job", stack)
    assert job.status == "succeeded", job.error
    assert job.attempts == 1  # the resume started a new budget of JOB_MAX_ATTEMPTS
    assert metric_iterations(job_id) == list(range(1, stopped + 4))
    assert checkpoint_iterations(job_id) == [stopped, stopped + 3]


def test_a_config_that_fails_in_the_worker_ends_failed_with_the_error(stack):
    import shutil

    from app.config import get_settings
    from trainer.models import SHAPES_BASE

    stack.start_worker()
    # a base checkpoint that passed the submission check, then was deleted before the run
    base = get_settings().resolved_models_dir / "gone" / "base.safetensors"
    base.parent.mkdir(parents=True)
    shutil.copy(SHAPES_BASE, base)
    missing = create_train_job(base_checkpoint="gone/base.safetensors")
    base.unlink()
    stack.send(missing)
    job = wait_for(lambda: _finished(missing), 60, "the failing job", stack)
    assert job.status == "failed"
    assert job.error.startswith("base_checkpoint: ") and "gone/base.safetensors" in job.error
    assert "does not exist" in job.error and "Traceback" not in job.error
    assert job.finished_at is not None
    # the worker survives a failed job and runs the next one
    ok = create_train_job(iterations=1)
    stack.send(ok)
    assert wait_for(lambda: _finished(ok), 60, "the next job", stack).status == "succeeded"


def test_a_finished_or_cancelled_job_is_not_run_again(stack):
    from app.db import session_scope
    from app.services import jobs

    stack.start_worker()
    job_id = create_train_job(iterations=1)
    stack.send(job_id)
    wait_for(lambda: _finished(job_id), 60, "the job", stack)
    cancelled = create_train_job(iterations=1)
    with session_scope() as s:
        jobs.request_cancel(s, cancelled)  # queued: cancelled at once
    stack.send(job_id)  # a duplicate message (e.g. a redelivery)
    stack.send(cancelled)
    stack.wait_log(stack.logs[0], "succeeded in", stack.workers[0])
    wait_for(lambda: stack.logs[0].read_text().count("succeeded in") >= 3, 30,
             "three task results", stack)
    assert job_row(job_id).attempts == 1 and job_row(job_id).status == "succeeded"
    assert job_row(cancelled).attempts == 0 and job_row(cancelled).status == "cancelled"
    assert metric_iterations(job_id) == [1]


def _eval_metrics(job_id: int, iteration: int) -> list[str]:
    from sqlalchemy import select

    from app.db import session_scope
    from app.models import JobMetric

    with session_scope() as s:
        metrics = s.scalars(select(JobMetric.metrics).where(
            JobMetric.job_id == job_id, JobMetric.iteration == iteration)).one()
    return [key for key in metrics if key.startswith("eval_")]


# a periodic evaluation pass at iteration 2 of 48 prompts x 100 seeds: minutes on one CPU
# thread, where the iteration before it takes a second
LONG_EVALUATION = {"iterations": 4, "eval_every": 2, "eval_seeds": 100, "sample_every": 1000,
                   "checkpoint_every": 1000}


@pytest.mark.parametrize("signal_kind", ["cancel", "shutdown"])
def test_a_cancel_or_a_shutdown_ends_a_periodic_evaluation_pass(stack, signal_kind):
    """The train loop checked cancel and shutdown only between iterations, so an evaluation
    pass (eval_seeds up to 1000: 48,000 samples) held a cancelled job running and a warm
    shutdown waiting. Now the pass ends at its next solver step: a cancel ends the job
    cancelled, a shutdown requeues it, each with a checkpoint of the iteration (whose eval_*
    metrics are left out)."""
    import os
    import signal
    import time

    from app.db import session_scope
    from app.services import jobs

    worker = stack.start_worker()
    job_id = create_train_job(**LONG_EVALUATION)
    stack.send(job_id)
    wait_for(lambda: job_row(job_id).iteration >= 1, 90, "the first iteration", stack)
    time.sleep(2)  # iteration 2 trains in about a second; its evaluation pass has begun
    assert job_row(job_id).iteration == 1  # still in iteration 2
    asked = time.monotonic()
    if signal_kind == "cancel":
        with session_scope() as s:
            jobs.request_cancel(s, job_id)
        job = wait_for(lambda: _finished(job_id), 30, "the cancel", stack)
        assert job.status == "cancelled"
    else:
        os.kill(worker.pid, signal.SIGTERM)
        job = wait_for(lambda: (j := job_row(job_id)).status == "queued" and j, 30,
                       "the requeue", stack)
        assert "shut down at iteration 2" in job.error
        assert worker.wait(timeout=30) == 0
    assert time.monotonic() - asked < 30
    assert job.iteration == 2 and checkpoint_iterations(job_id) == [2]
    assert metric_iterations(job_id) == [1, 2] and _eval_metrics(job_id, 2) == []
