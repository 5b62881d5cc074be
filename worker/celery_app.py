"""The Celery app: queues `gpu` (sampling, training, evaluation) and `cpu` (preference fitting,
the reaper), late acks, one message at a time per process.

Broker and result backend come from the app settings, read the way the app's sending side
reads them (`app.queue.broker_settings`: Redis with BROKER_URL, else the filesystem transport
under DATA_DIR/broker), so the two always meet on one broker. Jobs are sent with
`app.queue.enqueue`, by the API and by workers alike.

Run a worker: `celery -A worker.celery_app worker -Q gpu,cpu --pool solo` (see README).
"""

from __future__ import annotations

import warnings
from datetime import UTC, datetime, timedelta

from celery import Celery
from celery.exceptions import SecurityWarning
from kombu import Queue
from pydantic import ValidationError

from app.config import Settings, get_settings, settings_problem
from app.job_kinds import KINDS, QUEUE_NAMES
from app.queue import MESSAGE_SETTINGS, broker_settings

QUEUES = QUEUE_NAMES
# not a job kind (no row, nobody launches it): another host's part of a multi-host train job,
# sent by the worker holding the job to the train kind's queue (worker/torchrun.py)
JOIN_TRAIN_TASK = "worker.tasks.join_train"
REAP_TASK = "worker.tasks.reap"  # requeues jobs whose worker went silent (worker/reaper.py)

# Celery warns on every start as root (a container's default user, `make demo` on a root
# shell). The danger it names is unpickling broker messages as root; this app accepts JSON
# only (accept_content in app.queue.MESSAGE_SETTINGS; with pickle Celery refuses to start as root, which still
# happens), so that one warning goes. Every other warning, security ones included, stays.
warnings.filterwarnings("ignore", message="You're running the worker with superuser privileges",
                        category=SecurityWarning)


def make_celery(settings: Settings | None = None) -> Celery:
    if settings is None:
        try:
            settings = get_settings()
        except ValidationError as exc:
            # a worker started with a malformed setting stops with one line naming it, as the
            # server's commands do, not with Celery's "unable to load" and a traceback
            raise SystemExit(f"error: {settings_problem(exc)}") from None
    app = Celery("worker", include=["worker.tasks"])
    app.conf.update(broker_settings(settings))
    app.conf.update(
        task_queues=[Queue(name, routing_key=name) for name in QUEUES],
        task_default_queue="gpu",
        task_routes={**{k.task: {"queue": k.queue} for k in KINDS.values()},
                     REAP_TASK: {"queue": "cpu"},
                     JOIN_TRAIN_TASK: {"queue": KINDS["train"].queue}},
        # a job is acknowledged only when it has finished; a worker that dies mid-job leaves
        # it to the broker (Redis: after visibility_timeout) and to the reaper (at once)
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        result_expires=timedelta(days=7),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        # `celery beat` (docker-compose's beat service) runs the reaper on a schedule too;
        # every worker also runs it in a thread (worker/reaper.py), so beat is optional
        beat_schedule={"reap-stale-jobs": {
            "task": REAP_TASK, "schedule": settings.reaper_interval_seconds,
            "options": {"queue": "cpu", "expires": settings.reaper_interval_seconds}}},
        **MESSAGE_SETTINGS,
    )
    return app


celery_app = make_celery()


def send_join(kwargs: dict, deadline: float) -> None:
    """Ask a worker on another host to join a multi-host train job's rendezvous
    (worker.torchrun.Rendezvous's fields); the message expires with the rendezvous, so a worker
    that frees up later drops it."""
    celery_app.send_task(JOIN_TRAIN_TASK, kwargs=kwargs, queue=KINDS["train"].queue,
                         expires=datetime.fromtimestamp(deadline, UTC))
