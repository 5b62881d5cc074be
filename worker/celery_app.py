"""The Celery app: queues `gpu` (sampling, training, evaluation) and `cpu` (preference fitting,
imports, reward scoring), late acks, one message at a time per process.

Broker and result backend come from the app settings:
- `BROKER_URL=redis://host:6379/0` (production, docker-compose): Redis for both, with a
  `visibility_timeout` (`BROKER_VISIBILITY_TIMEOUT`, default a week) longer than the longest
  job, so Redis never hands a running job's message to a second worker; `BROKER_KEY_PREFIX`
  prefixes every key (several deployments, or test runs, on one Redis).
- unset (a fresh machine, `make demo`): kombu's filesystem transport under
  `DATA_DIR/broker` (tasks, remote control/inspect and revoke all work on it) and a SQLite
  result backend `DATA_DIR/broker/results.sqlite`. Every process that shares `DATA_DIR`
  shares the queue.

Run a worker: `celery -A worker.celery_app worker -Q gpu,cpu --pool solo` (see README).
"""

from __future__ import annotations

import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path

from celery import Celery
from celery.exceptions import SecurityWarning
from kombu import Queue

from app.config import Settings, get_settings
from app.job_kinds import KINDS, QUEUE_NAMES

QUEUES = QUEUE_NAMES
# not a job kind (no row, nobody launches it): another host's part of a multi-host train job,
# sent by the worker holding the job to the train kind's queue (worker/torchrun.py)
JOIN_TRAIN_TASK = "worker.tasks.join_train"

# Celery warns on every start as root (a container's default user, `make demo` on a root
# shell). The danger it names is unpickling broker messages as root; this app accepts JSON
# only (accept_content below; with pickle Celery refuses to start as root, which still
# happens), so that one warning goes. Every other warning, security ones included, stays.
warnings.filterwarnings("ignore", message="You're running the worker with superuser privileges",
                        category=SecurityWarning)


def broker_settings(settings: Settings) -> dict:
    """The Celery config keys that depend on the settings (broker, backend, options)."""
    url = settings.broker_url
    if url:
        transport: dict = {"visibility_timeout": settings.broker_visibility_timeout}
        if settings.broker_key_prefix:
            transport["global_keyprefix"] = settings.broker_key_prefix
        backend = settings.result_backend or (url if url.startswith(("redis", "rediss")) else None)
        conf = {"broker_url": url, "broker_transport_options": transport,
                "result_backend": backend}
        if backend and backend.startswith(("redis", "rediss")):
            conf["result_backend_transport_options"] = dict(transport)
        return conf
    root = (Path(settings.data_dir) / "broker").resolve()
    folders = {name: root / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return {
        # the filesystem transport ignores the host; naming the one kombu would assume keeps
        # it from warning "No hostname was supplied" on every connection
        "broker_url": "filesystem://localhost//",
        "broker_transport_options": {
            "data_folder_in": str(folders["queue"]), "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]), "store_processed": False,
            "control_folder": str(folders["control"]),
        },
        "result_backend": settings.result_backend or f"db+sqlite:///{root / 'results.sqlite'}",
    }


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("worker", include=["worker.tasks"])
    app.conf.update(broker_settings(settings))
    app.conf.update(
        task_queues=[Queue(name, routing_key=name) for name in QUEUES],
        task_default_queue="gpu",
        task_routes={**{k.task: {"queue": k.queue} for k in KINDS.values()},
                     "worker.tasks.reap": {"queue": "cpu"},
                     JOIN_TRAIN_TASK: {"queue": KINDS["train"].queue}},
        # a job is acknowledged only when it has finished; a worker that dies mid-job leaves
        # it to the broker (Redis: after visibility_timeout) and to the reaper (at once)
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        result_expires=timedelta(days=7),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        # `celery beat` (docker-compose's beat service) runs the reaper on a schedule too;
        # every worker also runs it in a thread (worker/reaper.py), so beat is optional
        beat_schedule={"reap-stale-jobs": {
            "task": "worker.tasks.reap", "schedule": settings.reaper_interval_seconds,
            "options": {"queue": "cpu", "expires": settings.reaper_interval_seconds}}},
        timezone="UTC",
    )
    return app


celery_app = make_celery()


def enqueue(job_id: int, kind: str) -> None:
    """The application's default enqueuer (`create_app`, the demo, the reaper, a requeue):
    the kind's task with args [job_id], to the kind's queue (`app.job_kinds`)."""
    job_kind = KINDS[kind]
    celery_app.send_task(job_kind.task, args=[job_id], queue=job_kind.queue)


def send_join(kwargs: dict, deadline: float) -> None:
    """Ask a worker on another host to join a multi-host train job's rendezvous
    (worker.torchrun.Rendezvous's fields); the message expires with the rendezvous, so a worker
    that frees up later drops it."""
    celery_app.send_task(JOIN_TRAIN_TASK, kwargs=kwargs, queue=KINDS["train"].queue,
                         expires=datetime.fromtimestamp(deadline, UTC))
