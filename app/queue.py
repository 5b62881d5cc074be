"""The application's side of the broker: where job messages go and how one is sent.

The app sends a job as a Celery message by task name (`app.job_kinds`: each kind's task and
queue), so it needs the broker's address and options, never the worker's code: `app/` does not
import `worker/` (a test in tests/app/test_jobs.py holds it to that). The worker builds its Celery app from the same
`broker_settings`, so both ends always agree on the broker.

Broker and result backend come from the settings:
- `BROKER_URL=redis://host:6379/0` (production, docker-compose): Redis for both, with a
  `visibility_timeout` (`BROKER_VISIBILITY_TIMEOUT`, default a week) longer than the longest
  job, so Redis never hands a running job's message to a second worker; `BROKER_KEY_PREFIX`
  prefixes every key (several deployments, or test runs, on one Redis).
- unset (a fresh machine, `make demo`): kombu's filesystem transport under
  `DATA_DIR/broker`, taking messages in the order they were sent (`app.fs_broker`; tasks,
  remote control/inspect and revoke all work on it) and a SQLite result backend
  `DATA_DIR/broker/results.sqlite`. Every process that shares `DATA_DIR` shares the queue.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from celery import Celery
from kombu.exceptions import OperationalError as BrokerOperationalError

from app.config import Settings, get_settings
from app.fs_broker import TRANSPORT
from app.job_kinds import KINDS

# Celery's own settings both ends share: JSON only (no pickled messages), UTC
MESSAGE_SETTINGS = {"task_serializer": "json", "result_serializer": "json",
                    "accept_content": ["json"], "timezone": "UTC"}


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
        # kombu's filesystem transport, taking messages in the order they were sent
        "broker_transport": TRANSPORT,
        "broker_transport_options": {
            "data_folder_in": str(folders["queue"]), "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]), "store_processed": False,
            "control_folder": str(folders["control"]),
        },
        "result_backend": settings.result_backend or f"db+sqlite:///{root / 'results.sqlite'}",
    }


_clients: dict[str, Celery] = {}
_lock = threading.Lock()


def client(settings: Settings | None = None) -> Celery:
    """A Celery app that only sends, on the broker the settings name (one per broker: a
    process that changes DATA_DIR or BROKER_URL, as tests do, sends to the new one)."""
    conf = broker_settings(settings or get_settings())
    key = json.dumps(conf, sort_keys=True, default=str)
    with _lock:
        if key not in _clients:
            app = Celery("studio-client")
            app.conf.update(conf, broker_connection_retry_on_startup=True, **MESSAGE_SETTINGS)
            _clients[key] = app
        return _clients[key]


def enqueue(job_id: int, kind: str, countdown: float = 0) -> None:
    """The application's enqueuer (`create_app`, the demo, a worker's requeue or reaper): the
    kind's task with args [job_id], to the kind's queue (`app.job_kinds`), runnable after
    `countdown` seconds."""
    job_kind = KINDS[kind]
    delay = {"countdown": countdown} if countdown else {}
    # ignore_result: the job's state lives in its row, and nobody reads Celery's result; with
    # a Redis result backend, asking for one also subscribes the sender to it, which retries
    # an unreachable Redis for another 20 s before the send can fail
    client().send_task(job_kind.task, args=[job_id], queue=job_kind.queue,
                       retry_policy=PUBLISH_RETRY, ignore_result=True, **delay)


def broker_unreachable(exc: BaseException) -> str | None:
    """One line naming the cause when `exc` says the broker cannot be reached (kombu's
    connection error after its retries, or the socket's own), else None: the caller reports
    that line (a 503, a worker's warning), not a traceback, since it is an outage, not a bug."""
    if not isinstance(exc, BrokerOperationalError | ConnectionError | TimeoutError):
        return None
    lines = str(exc).strip().splitlines()
    return (f"the job queue (BROKER_URL) cannot be reached: {type(exc).__name__}: "
            f"{lines[0] if lines else ''}")


# how long a send waits for an unreachable broker before it gives up: a few tries over about
# two seconds, where Celery's default (three tries over up to a minute) held a job submission
# for 25 s before it answered
PUBLISH_RETRY = {"max_retries": 3, "interval_start": 0, "interval_step": 0.5,
                 "interval_max": 1}
