"""Celery tasks. Each takes a job id, re-reads the row and is safe to run twice: it first
claims the job atomically (`app.services.jobs.claim`), so a duplicate message, a second worker
or a redelivery finds it taken or finished and does nothing.

    train           Neighbor GRPO or the SDE baseline (worker/training.py); with
                    TRAIN_NPROC > 1 under torchrun, DDP, rank 0 records (worker/distributed_train.py);
                    with train_nnodes > 1 this worker holds a job run by several hosts (worker/torchrun.py)
    join_train      another host's node of such a job (no job row of its own)
    rollout         groups from a checkpoint for a dataset's prompts (worker/sampling.py)
    evaluate        fixed prompts and seeds from checkpoints (worker/sampling.py)
    fit_preference  the human-preference reward model from clean votes (worker/preference.py)
    reap            settle jobs whose worker died (worker/reaper.py), for `celery beat`

A job's error (the exception and the end of its traceback; a `worker.lease.JobError`'s message
alone) lands on the row as `failed`; the task itself returns normally so the message is acknowledged and never retried by Celery: the
retry policy is the reaper's. The database or the broker out of reach is an outage, not a job's
failure (worker/outage.py): one line, the interrupted job left for the reaper, and a message
that arrives meanwhile sent back to the queue rather than dropped.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import socket
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import signals

from app.config import get_settings
from app.db import session_scope
from app.job_kinds import KINDS
from app.models import JobStatus
from app.queue import enqueue
from app.services import jobs, workers
from worker import preflight  # noqa: F401 - imported for its start check (a Celery signal)
from worker.celery_app import JOIN_TRAIN_TASK, REAP_TASK, celery_app, send_join
from worker.lease import JobError, JobLease, LeaseLost, TaskOutcome, node_name, set_node_name
from worker.outage import outage
from worker.reaper import ReaperThread, reap_once

log = logging.getLogger(__name__)

# set when this worker process begins a warm shutdown: a training job saves a checkpoint,
# goes back to the queue and the task returns, instead of holding the shutdown for hours
SHUTDOWN = threading.Event()
# set when this worker is ready (past its start checks) and reports itself
STARTED = threading.Event()


def traceback_tail(exc: BaseException, lines: int = 12) -> str:
    """The last `lines` lines of `exc`'s traceback."""
    return "\n".join("".join(traceback.format_exception(exc)).strip().splitlines()[-lines:])


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n\n{traceback_tail(exc)}"[:8000]


# a job this worker cannot run while another live worker of its queue can goes back to the
# queue after this long: time for the able worker to take it, no busy loop between CPU workers
PASS_ON_SECONDS = 5.0
# ... and while none can (no worker with a GPU has reported yet), after this long: the job
# waits queued, as its page says, until a GPU worker starts and takes it
WAIT_FOR_DEVICE_SECONDS = 30.0


def missing_device(config: dict) -> str | None:
    """Why this worker cannot run a config (it asks for CUDA and there is none here), or None.
    Submission refuses such configs while the queue's live workers report the same. A queued
    job is passed back to its queue (`_claim`): at once where a live worker of the queue can
    run it (CPU and GPU workers sharing a queue), every WAIT_FOR_DEVICE_SECONDS while none
    can (it was accepted before any worker reported, and its page says it waits for a GPU
    worker); a job that is no longer queued fails with this, not a traceback."""
    if config.get("device") != "cuda":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return ("the job asks for device 'cuda' but this worker has no CUDA device; resume it "
            "once a worker with a GPU serves its queue, or relaunch it with device 'auto'")


# how long a job's message waits before it is tried again when the database could not be
# reached to claim the job: no busy loop between the workers while the database is down
DATABASE_RETRY_SECONDS = 10.0


# the errors that say the storage itself cannot be written (a read-only remount, a full disk or
# quota, permissions changed under a running worker), not that the job is wrong
STORAGE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EDQUOT})
# how often a worker whose storage cannot be written tries it again before taking a job
STORAGE_RETRY_SECONDS = 5.0


def storage_outage(exc: BaseException) -> tuple[Path, str, int] | None:
    """(the path, the errno's text, the errno) when `exc`, or an error it was raised from, is
    an OSError of STORAGE_ERRNOS on a path under STORAGE_DIR; else None."""
    root = get_settings().resolved_storage_dir.resolve()
    seen: BaseException | None = exc
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            for name in (seen.filename, seen.filename2):
                if name and Path(os.fsdecode(name)).resolve().is_relative_to(root):
                    return Path(os.fsdecode(name)), os.strerror(seen.errno), seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


# errnos that say the storage is full: a small probe file may still fit where the job's
# checkpoint did not, so the worker also waits for more room than there was when it failed
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _existing_directory(path: Path) -> Path:
    directory = path if path.is_dir() else path.parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return directory


def free_bytes(path: Path) -> int | None:
    """The bytes free on the file system where `path` failed (None when it cannot be told)."""
    try:
        return shutil.disk_usage(_existing_directory(path)).free
    except OSError:
        return None


def storage_writable(path: Path, free_at_failure: int | None = None) -> bool:
    """Whether a file can be written where `path` failed: in its nearest existing directory
    (a file of some size: a full disk still takes an empty one), and the file itself; and,
    for a full disk (`free_at_failure`: its free bytes when the write failed), once more
    room than that is free: the probe fitting says nothing of the checkpoint that did not."""
    directory = _existing_directory(path)
    if free_at_failure is not None and (free := free_bytes(path)) is not None \
            and free <= free_at_failure:
        return False
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
            os.fsync(probe.fileno())
        if path.is_file():
            path.open("ab").close()
    except OSError:
        return False
    return True


# why this worker takes no job for now (`wait_for_storage`), None when it takes jobs; its
# reaper thread reports it with the worker's row (`report_worker`), so that the jobs queued
# behind the hold say what they wait for
HOLDING: str | None = None


def wait_for_storage(path: Path, free_at_failure: int | None = None) -> None:
    """Hold this worker (no job taken) until `path`'s directory can be written again (on a
    full disk: with more room free than `free_at_failure`), or until it shuts down: each
    job it took meanwhile would fail the same way (a full disk's job again and again, each
    resumed only to fail at its next checkpoint)."""
    global HOLDING
    root = get_settings().resolved_storage_dir
    HOLDING = (f"STORAGE_DIR {root} cannot be written"
               + (" (the disk is full)" if free_at_failure is not None else "")
               + f"; checked again every {STORAGE_RETRY_SECONDS:g} s")
    try:
        while not SHUTDOWN.is_set() and not storage_writable(path, free_at_failure):
            SHUTDOWN.wait(STORAGE_RETRY_SECONDS)
    finally:
        HOLDING = None
    if not SHUTDOWN.is_set():
        log.info("STORAGE_DIR %s can be written again: taking jobs",
                 get_settings().resolved_storage_dir)


def requeue_after_storage_outage(lease: JobLease, kind: str | None, path: Path,
                                 why: str) -> str:
    """The job could not write its files because the storage cannot be written: not its
    fault. Back to the queue, its attempt given back (jobs.requeue), and sent again; without
    a kind to send, left running with its heartbeat stopping for a reaper to requeue."""
    root = get_settings().resolved_storage_dir
    log.warning("job %s interrupted: STORAGE_DIR %s cannot be written (%s: %s); requeued, "
                "and this worker takes no job until it can", lease.job_id, root, why, path)
    if kind is None:
        return TaskOutcome.INTERRUPTED
    from worker.reaper import send_requeued

    with session_scope() as s:
        if not jobs.holds(s, lease.job_id, lease.worker_name):
            return TaskOutcome.LOST
        job = jobs.requeue(s, lease.job_id, reason=f"STORAGE_DIR {root} could not be written "
                           f"({why}); requeued")
        requeued = job.status == JobStatus.QUEUED
    if not requeued:  # a cancel asked meanwhile ended it
        return JobStatus.CANCELLED
    send_requeued(lease.job_id, kind, lease.worker_name)
    return TaskOutcome.DEFERRED


def run_job(job_id: int, body: Callable[[int, str], str], kind: str | None = None) -> str:
    """Claim the job, keep its heartbeat, run `body(job_id, worker_name)`, record failure.
    `kind`, the task's job kind, lets a message that arrives while the database cannot be
    reached go back to the queue rather than be lost."""
    lease = JobLease(int(job_id))
    try:
        taken = _claim(lease)
    except Exception as exc:
        reason = outage(exc)
        if reason is None:
            raise
        # the message is acknowledged when the task returns: dropped here, the job would stay
        # queued with no message for ever. Sent again, it waits for the database
        if kind is None:
            log.warning("job %s not started: %s", job_id, reason)
            return TaskOutcome.NOT_STARTED
        log.warning("job %s not started: %s; its message goes back to the queue for %g s",
                    job_id, reason, DATABASE_RETRY_SECONDS)
        enqueue(lease.job_id, kind, countdown=DATABASE_RETRY_SECONDS)
        return TaskOutcome.DEFERRED
    if taken is not None:
        return taken
    lease.start_heartbeat()
    storage_down: Path | None = None
    free_at_failure: int | None = None
    try:
        return body(lease.job_id, lease.worker_name)
    except LeaseLost as exc:
        log.warning("%s; stopping without touching the job", exc)
        return TaskOutcome.LOST
    except JobError as exc:  # a reason said in full: the message alone, no traceback
        log.warning("job %s cannot run: %s", job_id, exc)
        return record_failure(lease, str(exc))
    except Exception as exc:
        reason = outage(exc)
        if reason is not None:
            # the database (or broker) went away mid-job: not the job's fault, and its row
            # cannot be written now. Its heartbeat stops with this task, so a live worker's
            # reaper requeues it to resume from its newest checkpoint once the database is back
            log.warning("job %s interrupted: %s; a reaper requeues it once its heartbeat is "
                        "%g s old", job_id, reason, get_settings().job_stale_seconds)
            return TaskOutcome.INTERRUPTED
        if (down := storage_outage(exc)) is not None:
            storage_down = down[0]
            # measured now: the trainer removed its half-written checkpoint before raising
            free_at_failure = free_bytes(storage_down) if down[2] in SPACE_ERRNOS else None
            return requeue_after_storage_outage(lease, kind, down[0], down[1])
        log.exception("job %s failed", job_id)
        return record_failure(lease, describe_error(exc))
    finally:
        lease.stop()
        if storage_down is not None:  # after the requeue: --pool solo takes no job meanwhile
            wait_for_storage(storage_down, free_at_failure)


def record_failure(lease: JobLease, message: str) -> str:
    """Mark the held job failed with `message`. When the database cannot be reached to say
    so, one line instead of a traceback: the job stays running under this worker, its
    heartbeat stopped, and a reaper requeues it (the run fails again, and is recorded, then)."""
    try:
        with session_scope() as s:
            if jobs.holds(s, lease.job_id, lease.worker_name):
                jobs.mark_failed(s, lease.job_id, message)
    except Exception as exc:
        reason = outage(exc)
        if reason is None:
            raise
        log.warning("job %s failed and could not be marked so: %s; a reaper requeues it",
                    lease.job_id, reason)
    return JobStatus.FAILED


def _claim(lease: JobLease) -> str | None:
    """Claim the lease's job to run it (None), or the task's result when this worker does not
    run it (deferred, passed on, skipped, failed)."""
    job_id = lease.job_id
    if SHUTDOWN.is_set():  # leaving: hand the message on to the next worker, untouched
        with session_scope() as s:
            kind = jobs.get_job(s, job_id).kind
        enqueue(job_id, kind)
        return TaskOutcome.DEFERRED
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        config, kind, queued = dict(job.config or {}), job.kind, job.status == JobStatus.QUEUED
        problem = missing_device(config)
        if problem and queued:
            # left untouched for a worker that can run it: one of the queue's live workers,
            # or the first GPU worker to start (the job waits, as its page says)
            able = workers.able(s, kind, config)
            log.info("job %s: %s; %s", job_id, problem,
                     "passed on to the queue's able workers" if able else
                     f"no live worker has one: it waits, offered again in "
                     f"{WAIT_FOR_DEVICE_SECONDS:.0f} s")
            enqueue(job_id, kind, countdown=PASS_ON_SECONDS if able else WAIT_FOR_DEVICE_SECONDS)
            return TaskOutcome.PASSED_ON
    if not lease.claim():
        log.info("job %s is finished, cancelled or held by another worker: skipped", job_id)
        return TaskOutcome.SKIPPED
    if problem:
        return record_failure(lease, f"{lease.worker_name}: {problem}")
    return None


# --- the tasks ------------------------------------------------------------------------------
def _train(job_id: int, worker_name: str) -> str:
    from worker.torchrun import processes_per_node, run_torchrun
    from worker.training import run_training, train_config_of

    # a config the worker cannot run (a model directory gone) fails here, before any process
    with session_scope() as s:
        config = train_config_of(s, jobs.get_job(s, job_id))
    wanted = get_settings().train_nproc
    nproc = processes_per_node(config, wanted)
    if nproc < wanted:
        log.warning("job %s runs on %d process(es) a node, not TRAIN_NPROC=%d: its %d prompts "
                    "an iteration split evenly only so (train_nnodes %d)", job_id, nproc,
                    wanted, config.prompts_per_iteration, config.train_nnodes)
    if nproc > 1 or config.train_nnodes > 1:
        return run_torchrun(job_id, worker_name, config, nproc, SHUTDOWN)
    return run_training(job_id, worker_name, SHUTDOWN)


@celery_app.task(name=KINDS["train"].task)
def train(job_id: int) -> str:
    return run_job(job_id, _train, kind="train")


@celery_app.task(name=JOIN_TRAIN_TASK)
def join_train(**rendezvous: Any) -> str:
    """This worker's host as one more node of a multi-host train job (worker/torchrun.py):
    sent by the worker holding the job; nothing is claimed here."""
    from worker.torchrun import Rendezvous, run_join

    rdzv = Rendezvous(**rendezvous)
    if SHUTDOWN.is_set():  # leaving: another host may still take it in time
        send_join(rdzv.as_kwargs(), rdzv.deadline)
        return TaskOutcome.DEFERRED
    with session_scope() as s:
        problem = missing_device(dict(jobs.get_job(s, rdzv.job_id).config or {}))
    if problem:  # the rendezvous times out and says so, unless another host joins
        log.warning("job %s: not joining: %s", rdzv.job_id, problem)
        return TaskOutcome.SKIPPED
    return run_join(rdzv, SHUTDOWN)


@celery_app.task(name=KINDS["rollout"].task)
def rollout(job_id: int) -> str:
    from worker.sampling import run_rollout

    return run_job(job_id, run_rollout, kind="rollout")


@celery_app.task(name=KINDS["evaluate"].task)
def evaluate(job_id: int) -> str:
    from worker.sampling import run_evaluate

    return run_job(job_id, run_evaluate, kind="evaluate")


@celery_app.task(name=KINDS["fit_preference"].task)
def fit_preference(job_id: int) -> str:
    from worker.preference import run_fit_preference

    return run_job(job_id, run_fit_preference, kind="fit_preference")


@celery_app.task(name=REAP_TASK)
def reap() -> list:
    return reap_once()


# --- worker lifecycle -------------------------------------------------------------------------
def consumed_queues(consumer: Any) -> list[str]:
    """The queues this worker takes tasks from (`-Q`); all of them when it cannot tell."""
    from worker.celery_app import QUEUES

    try:
        names = [q.name for q in consumer.task_consumer.queues]
    except AttributeError:
        names = list((consumer.app.amqp.queues.consume_from or {}) if consumer else [])
    return names or list(QUEUES)


@functools.cache
def local_cuda_devices() -> tuple[str, ...]:
    """This process's CUDA device names (empty without CUDA); asked once, not every round."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return tuple(torch.cuda.get_device_name(i) for i in range(count))


def report_worker(name: str, queues: list[str]) -> None:
    """Record this worker's queues and devices (`app.services.workers`): submission checks a
    job's `device` against them, and a queued job says when no live worker can take it.
    Once its warm shutdown has begun, remove its row instead: it takes no more jobs."""
    devices = local_cuda_devices()
    with session_scope() as s:
        if SHUTDOWN.is_set():
            workers.forget(s, name)
        else:
            workers.report(s, name, queues, len(devices), list(devices), holding=HOLDING,
                           train_nproc=get_settings().train_nproc)


@signals.worker_init.connect
def hand_settings_to_trainer(**_kwargs) -> None:
    """REWARD_SERVER_TIMEOUT as the settings read it (a value in .env too, checked when the
    worker started) into this process's environment, where the trainer's reward client
    reads it (trainer/rewards/remote.py) and a train job's torchrun processes inherit it."""
    from trainer.rewards.remote import ENV_TIMEOUT

    os.environ[ENV_TIMEOUT] = repr(get_settings().reward_server_timeout)


@signals.worker_init.connect
def _name_leases(sender=None, **_kwargs) -> None:
    """The jobs this worker claims name it by its node name, the name it reports under."""
    set_node_name(getattr(sender, "hostname", None) or socket.gethostname())


@signals.worker_ready.connect
def _start_reaper(sender=None, **_kwargs) -> None:
    """Report this worker, then the reaper's startup check (first round at once) and every
    REAPER_INTERVAL_SECONDS both again (the report keeps the worker counted as live)."""
    STARTED.set()
    name = node_name()
    queues = consumed_queues(sender)
    thread = ReaperThread(get_settings().reaper_interval_seconds,
                          on_round=lambda: report_worker(name, queues))
    thread.start()


@signals.worker_shutting_down.connect
def _on_shutdown(**_kwargs) -> None:
    # in a signal handler, perhaps amid the job's own database work: only a flag here; the
    # next reaper round removes the worker's row, and `_forget_worker` when it has stopped
    SHUTDOWN.set()


@signals.worker_shutdown.connect
def _forget_worker(**_kwargs) -> None:
    """A worker that stops cleanly removes its row: it would count as live for
    `workers.live_seconds` more, and queued jobs would say they wait behind it or for nothing.
    One that its start checks refused (worker/preflight.py) never reported: nothing to
    remove, and its database may be one it must not touch (none there, or not the studio's)."""
    if not STARTED.is_set():
        return
    try:
        with session_scope() as s:
            workers.forget(s, node_name())
    except Exception as exc:
        reason = outage(exc)
        if reason is None:
            raise
        log.warning("this worker's row was not removed (%s): it stops counting as live once "
                    "its last report is %.0f s old", reason, workers.live_seconds())

