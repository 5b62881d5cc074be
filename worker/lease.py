"""Holding a job: claim it atomically, keep its heartbeat fresh, notice when it is lost.

`JobLease.claim()` takes the job (False when another worker holds it or it is finished);
`start_heartbeat()` runs a daemon thread that touches the heartbeat every
`JOB_HEARTBEAT_SECONDS` (so a long iteration never looks like a dead worker); `stop()` stops
that thread (worker.tasks.run_job calls it however the job ends).
"""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

from app.config import get_settings
from app.db import session_scope
from app.services import jobs, workers
from worker.outage import OutageLog

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

# this worker's Celery node name (`-n gpu0@%h`), set as it starts (worker.tasks), before its
# pool forks: the name it reports in the workers table
_node_name: str | None = None


def set_node_name(name: str) -> None:
    global _node_name
    _node_name = name


def node_name() -> str:
    """This worker's node name; the host's name outside a Celery worker."""
    return _node_name or socket.gethostname()


def worker_identity() -> str:
    """node:pid:nonce (app.services.workers.lease_name): a job's `worker` names the worker
    that runs it as the workers table does, so a queued job can tell which live worker is
    busy with which job; the nonce tells apart two claims by one process."""
    return workers.lease_name(node_name())


class TaskOutcome(StrEnum):
    """What a task did with its message when it did not take the job to a status of its own
    (a job it ran returns its JobStatus): the task's Celery result, and what the log says."""

    NOT_STARTED = "not started"  # the database was down and the message names no kind to resend
    DEFERRED = "deferred"  # back to the queue: the database was down, or this worker is leaving
    PASSED_ON = "passed on"  # to the queue's workers that have the device it asks for
    SKIPPED = "skipped"  # finished, cancelled or held elsewhere; or a join that came too late
    LOST = "lost"  # another worker took the job over mid-run; nothing written
    INTERRUPTED = "interrupted"  # the database went away mid-job; a reaper requeues it
    DONE = "done"  # a joining host's share of a multi-host job ended cleanly
    GAVE_WAY = "gave way"  # a multi-host job requeued while another one gathers its hosts


class LeaseLost(Exception):
    """The job is no longer ours (a reaper handed it on, or it was deleted)."""


def require_lease(session: Session, job_id: int, worker_name: str) -> None:
    """LeaseLost unless `worker_name` still holds the job: asked in the transaction that writes
    for the job, so nothing is written for one that a reaper handed on (or that was deleted)."""
    if not jobs.holds(session, job_id, worker_name):
        raise LeaseLost(f"job {job_id} is no longer held by {worker_name}")


class JobError(Exception):
    """The job cannot run, for a reason its message says in full (a model directory gone or
    incomplete): the job fails with that message alone, no traceback."""


class JobLease:
    def __init__(self, job_id: int, worker_name: str | None = None) -> None:
        self.job_id = job_id
        self.worker_name = worker_name or worker_identity()
        self.settings = get_settings()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim(self) -> bool:
        stale = timedelta(seconds=self.settings.job_stale_seconds)
        with session_scope() as s:
            return jobs.claim(s, self.job_id, self.worker_name, stale) is not None

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.job_id}",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        failures = OutageLog(log, f"heartbeat of job {self.job_id}")
        while not self._stop.wait(self.settings.job_heartbeat_seconds):
            try:
                with session_scope() as s:
                    if not jobs.holds(s, self.job_id, self.worker_name):
                        return
                    jobs.heartbeat(s, self.job_id)
            except Exception as exc:  # a database hiccup must not kill the job; the next beat retries
                failures.failed(exc, "the next beat tries again")
            else:
                failures.succeeded()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
