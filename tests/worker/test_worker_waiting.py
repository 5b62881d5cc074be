"""What a queued job waits for (`waiting_for`), with real worker processes naming themselves:
the job a worker claims (worker/lease.py) and the row it reports (worker/tasks.py) name it
alike, and a worker that stops cleanly stops counting as live at once."""

from __future__ import annotations

import os
import signal

import pytest
from worker_helpers import create_train_job, job_row, wait_for


def _waiting_for(job_id: int) -> str | None:
    from app.db import session_scope
    from app.services import jobs, workers

    with session_scope() as s:
        return workers.waiting_for(s, [jobs.get_job(s, job_id)]).get(job_id)


def _worker_names() -> list[str]:
    from app.db import session_scope
    from app.services import workers

    with session_scope() as s:
        return [w.name for w in workers.live(s)]


@pytest.mark.parametrize("stack", ["sqlite-fs"], indirect=True)
def test_a_job_queued_behind_a_real_workers_job_says_so_until_the_worker_stops(stack):
    from app.services.workers import worker_of

    busy = stack.start_worker("busy", queues="gpu")
    running = create_train_job(iterations=400, sample_every=1000, checkpoint_every=2)
    stack.send(running)
    held = wait_for(lambda: (j := job_row(running)).status == "running" and j, 90,
                    "the first job to run", stack)
    # the worker reports itself from its reaper thread, which may come round after the job
    # has started
    (name,) = wait_for(lambda: _worker_names() or None, 60, "the worker's report", stack)
    assert name.startswith("busy@") and worker_of(held.worker) == name, (name, held.worker)
    queued = create_train_job()  # no message: the busy worker could take it only when free
    assert _waiting_for(queued) == (f"queued behind job #{running}: every live worker on queue "
                                    "'gpu' is running one; it starts when one is free (or start "
                                    "another worker)")
    os.kill(busy.pid, signal.SIGTERM)  # warm shutdown: the job goes back to the queue
    assert busy.wait(timeout=60) == 0
    assert job_row(running).status == "queued"
    # its row went with it: both jobs wait for a worker now, not for one that left (it
    # counted as live for JOB_STALE_SECONDS more)
    assert _worker_names() == []
    for job_id in (running, queued):
        assert _waiting_for(job_id).startswith("waiting for a worker on queue 'gpu': none has "
                                               "reported"), _waiting_for(job_id)
