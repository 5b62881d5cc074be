"""The reaper: no job stays `running` after its worker died.

A running job whose heartbeat is older than `JOB_STALE_SECONDS` lost its worker (kill -9, a
lost host, an OOM kill). It goes back to the queue and is re-sent, resuming from its newest
checkpoint, until it has run `JOB_MAX_ATTEMPTS` times; then it is `failed` with the reason. A
stale job with a cancel request becomes `cancelled`. A queued job that waited as long while a
worker that takes it ran nothing lost its message, and it is sent again (jobs.lost_messages).

Every worker runs `reap_once` when it starts and then every `REAPER_INTERVAL_SECONDS` in a
daemon thread (a worker busy with a long job still reaps); `celery beat` can also schedule the
`worker.tasks.reap` task. The state changes are compare-and-set, so reapers never double-act.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from app.config import get_settings
from app.db import session_scope
from app.models import JobStatus
from app.queue import broker_unreachable, enqueue
from app.services import jobs
from worker.outage import OutageLog

log = logging.getLogger(__name__)


# requeued jobs whose message is not sent yet. The requeue is committed before the send, and
# a send that fails (the broker away) would leave the job queued with no message, waiting for
# ever: each round sends these again until the broker takes them (a duplicate is harmless)
_unsent: dict[int, str] = {}
_unsent_lock = threading.Lock()


def send_requeued(job_id: int, kind: str, worker_name: str) -> None:
    """Send the message of a job this worker has just requeued (a warm shutdown). When the
    broker cannot take it, the job must not stay queued with no message: it goes back to
    running with no heartbeat (jobs.leave_for_reaper), which a live worker's reaper requeues
    and sends, once the broker is back, and this says so in one line."""
    try:
        enqueue(job_id, kind)
    except Exception as exc:
        reason = broker_unreachable(exc)
        if reason is None:
            raise
        with session_scope() as s:
            left = jobs.leave_for_reaper(s, job_id, worker_name)
        log.warning("job %s: its requeue could not be sent (%s); %s", job_id, reason,
                    "left for a reaper, which requeues it once the broker is back" if left
                    else "it is no longer queued, nothing to do")


def reap_once() -> list[tuple[int, str, str]]:
    """Settle stale jobs and re-send the requeued ones, the queued ones whose message was lost
    (jobs.lost_messages) and those an earlier round could not send (an unreachable broker
    raises, the rest wait for the next round). Returns [(job_id, kind, status)] of the stale
    jobs."""
    settings = get_settings()
    stale = timedelta(seconds=settings.job_stale_seconds)
    with session_scope() as s:
        acted = jobs.reap_stale(s, stale, settings.job_max_attempts)
    with session_scope() as s:
        lost = jobs.lost_messages(s, stale)
    with _unsent_lock:
        for job_id, kind, status in acted:
            log.warning("reaper: job %s (%s) had a stale heartbeat -> %s", job_id, kind, status)
            if status == JobStatus.QUEUED:
                _unsent[job_id] = kind
        for job_id, kind, idle in lost:
            log.warning("reaper: job %s (%s) has been queued for over %.0f s while worker %s, "
                        "which takes it, ran nothing: its message was lost (a broker restart, "
                        "or a worker killed while it held it); sending it again", job_id, kind,
                        stale.total_seconds(), idle)
            _unsent[job_id] = kind
        for job_id, kind in list(_unsent.items()):
            enqueue(job_id, kind)
            del _unsent[job_id]
    return acted


class ReaperThread(threading.Thread):
    """`reap_once` every `interval` seconds, after `on_round` (the worker's liveness report)."""

    def __init__(self, interval: float, on_round: Callable[[], None] | None = None) -> None:
        super().__init__(name="job-reaper", daemon=True)
        self.interval = interval
        self.on_round = on_round
        self.stopped = threading.Event()

    def run(self) -> None:
        failures = OutageLog(log, "reaper round")
        while True:
            try:
                if self.on_round is not None:
                    self.on_round()
                reap_once()
            except Exception as exc:  # the database may be briefly away; try again next round
                failures.failed(exc, f"trying again every {self.interval:g} s")
            else:
                failures.succeeded()
            if self.stopped.wait(self.interval):
                return

    def stop(self) -> None:
        self.stopped.set()
