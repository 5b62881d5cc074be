"""A train job on several hosts (train_nnodes > 1), emulated on this machine: two Celery
worker processes, each advertising its own loopback address (WORKER_HOST 127.0.0.2 and
127.0.0.1), meet in torchrun's c10d rendezvous and train one job over gloo. Then the same job
on one host with two processes gives the same metrics; a job whose other host never comes
fails with the reason within a bounded time; a warm shutdown of the host that does not hold
the job saves and requeues it, and it resumes with a fresh host (~60 s in all on 2 cores)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from worker_helpers import checkpoint_iterations, create_train_job, job_row, wait_for

ROOT = Path(__file__).resolve().parents[2]
NODE = re.compile(r"job (\d+): node (\d) of 2 started on (\S+)")
# every metric that does not measure time: equal when the same ranks do the same work
TIMED = ("second", "time", "per_s")


def _metrics(job_id: int) -> dict[int, dict]:
    from app.db import session_scope
    from app.services import jobs

    with session_scope() as s:
        return {m.iteration: dict(m.metrics) for m in jobs.metric_history(s, job_id)}


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not any(t in k for t in TIMED)}


def _worker_pid(job_id: int) -> int | None:
    worker = job_row(job_id).worker  # node:pid:nonce (worker.lease.worker_identity)
    return int(worker.rsplit(":", 2)[1]) if worker else None


@pytest.mark.parametrize("stack", ["postgres-redis"], indirect=True)  # as several hosts share
def test_two_workers_train_one_job_as_two_hosts_like_two_processes_on_one(stack):
    config = {"iterations": 2, "prompts_per_iteration": 2, "sample_every": 2,
              "checkpoint_every": 2}
    # the holder advertises the higher address: torchrun numbers nodes by address, so the
    # joining host runs global rank 0 and records (under the holder's name)
    holder = stack.start_worker("holder", queues="gpu",
                                extra_env={"WORKER_HOST": "127.0.0.2", "RDZV_JOIN_TIMEOUT": "90"})
    job_id = create_train_job(**config, train_nnodes=2)
    stack.send(job_id)
    wait_for(lambda: _worker_pid(job_id) == holder.pid, 30, "the holder's claim", stack)
    # the other "host" comes up only now: the join waits for it in the queue
    stack.start_worker("joiner", queues="gpu", extra_env={"WORKER_HOST": "127.0.0.1"})
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 120,
                   "the two-host job", stack)
    assert job.status == "succeeded", (job.error, stack.log_text())
    history = _metrics(job_id)
    assert sorted(history) == [1, 2]  # recorded once per iteration, by one rank
    assert all(m["world_size"] == 2 for m in history.values())
    assert checkpoint_iterations(job_id) == [2]

    def nodes() -> list[list[tuple[int, str]]]:  # each worker's log: the nodes it ran
        return [[(int(rank), host) for jid, rank, host in NODE.findall(log.read_text(
            errors="replace")) if int(jid) == job_id] for log in stack.logs]

    wait_for(lambda: all(nodes()), 20, "both workers to log their node", stack)
    assert nodes() == [[(1, "127.0.0.2")], [(0, "127.0.0.1")]], stack.log_text()
    logs = [log.read_text(errors="replace") for log in stack.logs]
    assert "rendezvous at 127.0.0.2:" in logs[0] and "joining the rendezvous" in logs[1]

    # the same job on one host with two processes: the same global ranks do the same work
    from datetime import timedelta

    from app.db import session_scope
    from app.services import jobs

    stack.stop_all()  # their reapers would requeue the reference job (it has no heartbeat)
    reference = create_train_job(**config)
    with session_scope() as s:  # what the train task does before launching torchrun
        assert jobs.claim(s, reference, "w-one-host", timedelta(minutes=5)) is not None
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "worker.distributed_train", str(reference), "w-one-host"],
        cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    one_host = _metrics(reference)
    assert sorted(one_host) == [1, 2]
    for it in (1, 2):
        a, b = _untimed(history[it]), _untimed(one_host[it])
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (it, key)


def test_a_job_whose_other_host_never_joins_fails_saying_so(stack):
    # one worker: it holds the job and cannot take the join itself (one task at a time)
    stack.start_worker("alone", queues="gpu", extra_env={"WORKER_HOST": "127.0.0.1",
                                                         "RDZV_JOIN_TIMEOUT": "5"})
    job_id = create_train_job(iterations=2, train_nnodes=2)
    start = time.monotonic()
    stack.send(job_id)
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 60,
                   "the job to fail", stack)
    elapsed = time.monotonic() - start
    assert job.status == "failed"
    assert job.error.startswith("waited 5 s for 1 more host(s) to join the rendezvous at "
                                "127.0.0.1:"), job.error
    assert "no training process started" in job.error
    assert elapsed < 45, elapsed
    # freed, the worker drops the join (it expired with the rendezvous) and starts nothing
    wait_for(lambda: "Discarding revoked task: worker.tasks.join_train" in stack.logs[0]
             .read_text(errors="replace"), 20, "the worker to drop the join", stack)
    assert "joining the rendezvous" not in stack.logs[0].read_text(errors="replace")
    assert job_row(job_id).status == "failed"


def test_a_job_cancelled_while_waiting_for_its_other_host_stops_at_once(stack):
    """No rank runs before every host has joined, so none reads the stop flag: the holder
    itself stops the rendezvous (it held the only worker for RDZV_JOIN_TIMEOUT, then failed)."""
    from app.db import session_scope
    from app.services import jobs

    holder = stack.start_worker("alone", queues="gpu", extra_env={"WORKER_HOST": "127.0.0.1",
                                                                  "RDZV_JOIN_TIMEOUT": "300"})
    job_id = create_train_job(iterations=2, train_nnodes=2)
    stack.send(job_id)
    wait_for(lambda: _worker_pid(job_id) == holder.pid, 30, "the holder's claim", stack)
    wait_for(lambda: "asking 1 more host(s) to join" in stack.logs[0].read_text(errors="replace"),
             30, "the rendezvous to start", stack)
    start = time.monotonic()
    with session_scope() as s:
        jobs.request_cancel(s, job_id)
    job = wait_for(lambda: (j := job_row(job_id)).status != "running" and j, 60,
                   "the cancel", stack)
    assert job.status == "cancelled", (job.status, job.error)
    assert time.monotonic() - start < 45
    assert "cancelled while its rendezvous waited" in stack.logs[0].read_text(errors="replace")


def test_each_host_gets_the_same_command_and_the_world_must_divide_the_prompts(monkeypatch):
    from app.config import get_settings
    from trainer.config import TrainConfig
    from worker.lease import JobError
    from worker.torchrun import Rendezvous, check_world, processes_per_node, torchrun_command

    monkeypatch.setenv("WORKER_HOST", "10.0.0.7")
    get_settings.cache_clear()
    rdzv = Rendezvous(job_id=7, holder="h:1:x", endpoint="10.0.0.5:29400", nnodes=3, nproc=4,
                      deadline=time.time() + 60)
    host, other = (torchrun_command(7, "h:1:x", 4, rdzv, is_host=flag) for flag in (True, False))
    assert host[3:] == ["--nproc-per-node=4", "--nnodes=3", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=10.0.0.5:29400", "--rdzv-id=job-7",
                        host[8], "--local-addr=10.0.0.7", "-m", "worker.distributed_train",
                        "7", "h:1:x"]
    assert re.fullmatch(r"--rdzv-conf=is_host=1,join_timeout=(59|60)", host[8])
    assert other[8].startswith("--rdzv-conf=is_host=0,") and other[9:] == host[9:]
    get_settings.cache_clear()
    config = TrainConfig.from_dict({"prompts_per_iteration": 6, "train_nnodes": 3})
    check_world(config, 3, 2)
    with pytest.raises(JobError, match=r"train_nnodes \(3\) x this worker's TRAIN_NPROC \(4\)"):
        check_world(config, 3, 4)
    # so a node gives a job as many processes as split its prompts evenly, one at least
    assert processes_per_node(config, 4) == 2 and processes_per_node(config, 2) == 2
    for prompts, nproc, nnodes, expected in ((3, 2, 1, 1), (8, 8, 1, 8), (12, 8, 1, 6),
                                             (7, 4, 1, 1), (4, 4, 2, 2), (6, 8, 2, 3)):
        config = TrainConfig.from_dict({"prompts_per_iteration": prompts,
                                        "train_nnodes": nnodes})
        assert processes_per_node(config, nproc) == expected, (prompts, nproc, nnodes)
    # but never a sharded job: fewer processes would load the model whole; check_world says it
    config = TrainConfig.from_dict({"prompts_per_iteration": 3, "parallelism": "fsdp"})
    assert processes_per_node(config, 2) == 2
    with pytest.raises(JobError, match=r"prompts_per_iteration \(3\) must be a multiple"):
        check_world(config, 1, 2)


@pytest.mark.parametrize("stack", ["postgres-redis"], indirect=True)
def test_a_warm_shutdown_of_the_joining_host_requeues_and_another_host_resumes(stack):
    import signal

    from app.db import session_scope
    from app.services import jobs, workers

    fast = {"RDZV_JOIN_TIMEOUT": "60"}
    holder = stack.start_worker("holder", queues="gpu",
                                extra_env={**fast, "WORKER_HOST": "127.0.0.2"})
    job_id = create_train_job(iterations=12, prompts_per_iteration=2, sample_every=12,
                              checkpoint_every=12, train_nnodes=2)
    stack.send(job_id)
    wait_for(lambda: _worker_pid(job_id) == holder.pid, 30, "the holder's claim", stack)
    leaving = stack.start_worker("leaving", queues="gpu",
                                 extra_env={**fast, "WORKER_HOST": "127.0.0.1"})
    wait_for(lambda: job_row(job_id).iteration >= 1, 60, "the first iteration", stack)
    os.kill(leaving.pid, signal.SIGTERM)  # warm shutdown of the host not holding the job
    requeued = wait_for(lambda: (j := job_row(job_id)).status == "queued" and j, 60,
                        "the requeue", stack)
    assert "shut down at iteration" in requeued.error
    saved = checkpoint_iterations(job_id)
    assert saved and saved[-1] < 12
    assert leaving.wait(timeout=60) == 0  # the leaving worker finished its node and exited
    # the holder takes the job again, at its checkpoint: its fresh rendezvous waits for a host,
    # and the job says so (the leaving worker's row went with it)
    wait_for(lambda: job_row(job_id).status == "running", 30, "the holder's new claim", stack)
    with session_scope() as s:
        waiting = workers.waiting_for(s, [jobs.get_job(s, job_id)]).get(job_id)
    assert waiting == ("waiting for 2 hosts (train_nnodes): 1 live worker(s) on queue 'gpu'; "
                       "start one on each other host"), waiting
    # a fresh host joins, it resumes
    stack.start_worker("fresh", queues="gpu", extra_env={**fast, "WORKER_HOST": "127.0.0.1"})
    job = wait_for(lambda: (j := job_row(job_id)).status in ("succeeded", "failed") and j, 120,
                   "the resumed job", stack)
    assert job.status == "succeeded", (job.error, stack.log_text())
    assert sorted(_metrics(job_id)) == list(range(1, 13))
    assert checkpoint_iterations(job_id) == [saved[-1], 12]


@pytest.mark.parametrize("stack", ["postgres-redis"], indirect=True)
def test_two_multihost_jobs_on_two_hosts_run_one_after_the_other(stack):
    """Two jobs of train_nnodes 2 and two hosts: each worker held one job and waited for the
    other's join, which no worker was free to take, until both failed after
    RDZV_JOIN_TIMEOUT. The later claim gives way (requeued), its worker joins the other job,
    and both succeed."""
    fast = {"RDZV_JOIN_TIMEOUT": "90"}
    first, second = (create_train_job(iterations=1, prompts_per_iteration=2, sample_every=1,
                                      checkpoint_every=1, train_nnodes=2) for _ in range(2))
    stack.send(first)
    stack.send(second)
    stack.start_worker("h1", queues="gpu", extra_env={**fast, "WORKER_HOST": "127.0.0.1"})
    stack.start_worker("h2", queues="gpu", extra_env={**fast, "WORKER_HOST": "127.0.0.2"})
    wait_for(lambda: all(job_row(j).status in ("succeeded", "failed", "cancelled")
                         for j in (first, second)), 240, "both jobs to finish", stack)
    for job_id in (first, second):
        job = job_row(job_id)
        assert job.status == "succeeded", (job_id, job.error)
        assert checkpoint_iterations(job_id) == [1]
    logs = "".join(log.read_text(errors="replace") for log in stack.logs)
    assert re.search(r"job \d+: job \d+ gathers its hosts first; requeued", logs), logs[-3000:]
