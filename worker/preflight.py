"""What a worker checks before it takes its first message.

A worker that cannot run any job would otherwise start "ready" and then fail every job it
takes (no database: the job's message is acknowledged and gone, the job stays queued; a
storage directory it cannot write: each job fails with a traceback), or sit on a queue no
job is ever sent to. Each of these stops the worker at start, naming the setting and what
is wrong, before it consumes anything. A database not yet at the newest migration is only
logged, as the API does: in docker-compose the API migrates while the workers start.
"""

from __future__ import annotations

import logging
import tempfile

from celery import signals
from sqlalchemy import text

from app.config import get_settings
from app.db import get_engine
from app.job_kinds import QUEUE_NAMES

log = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def preflight_problems(queues: list[str]) -> list[str]:
    """Every reason this worker could not run a job, each naming its setting."""
    from app.migrate import migrations_current

    problems = []
    unknown = [q for q in queues if q not in QUEUE_NAMES]
    if unknown:
        problems.append(f"-Q: no job is sent to queue(s) {unknown}; the queues are "
                        f"{list(QUEUE_NAMES)}")
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - every driver raises its own
        problems.append(f"DATABASE_URL: the database cannot be reached ({_first_line(exc)})")
    else:
        try:
            if not migrations_current():
                log.warning("the database is not at the newest migration: run "
                            "`python -m app migrate` (jobs fail until it is)")
        except Exception as exc:  # noqa: BLE001
            log.warning("could not check the database's migrations: %s", _first_line(exc))
    storage = get_settings().resolved_storage_dir
    try:
        storage.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=storage):
            pass
    except OSError as exc:
        problems.append(f"STORAGE_DIR: {storage} is not a directory this worker can write "
                        f"({_first_line(exc)})")
    return problems


@signals.celeryd_after_setup.connect
def _check_before_consuming(sender=None, instance=None, **_kwargs) -> None:
    """After -Q is applied, before the consumer starts: stop the worker on any problem."""
    consume = getattr(getattr(getattr(instance, "app", None), "amqp", None), "queues", None)
    queues = list(getattr(consume, "consume_from", None) or QUEUE_NAMES)
    problems = preflight_problems(queues)
    if problems:
        for problem in problems:
            log.error("worker not started: %s", problem)
        # SystemExit: Celery's signal dispatch logs and swallows an Exception, not this
        raise SystemExit("worker not started: " + "; ".join(problems))
