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
from pathlib import Path

from celery import signals
from sqlalchemy import inspect, make_url, text

from app.config import get_settings
from app.db import get_engine
from app.job_kinds import QUEUE_NAMES
from app.services.storage import unwritable

log = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def database_problem() -> str | None:
    """Why this worker cannot use its database, naming the setting: unreachable, or not the
    studio's. DATABASE_URL unset names DATA_DIR/studio.db, and a worker started with another
    DATA_DIR than the server's (another working directory, a variable not exported) created
    an empty database there, started "ready", ran none of the server's jobs and logged a
    traceback every reaper round. So a SQLite file is looked for before connecting (SQLite
    creates the file it connects to), and a database without the studio's tables refused."""
    settings = get_settings()
    where = ("DATABASE_URL" if settings.database_url
             else f"DATABASE_URL (unset: DATA_DIR {settings.data_dir}/studio.db)")
    url = make_url(settings.resolved_database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
            and not Path(url.database).exists():
        return (f"{where}: there is no database at {url.database}; give the worker the "
                "server's (or run `python -m app migrate` to create it)")
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
            migrated = inspect(conn).has_table("jobs")
    except Exception as exc:  # noqa: BLE001 - every driver raises its own
        return f"DATABASE_URL: the database cannot be reached ({_first_line(exc)})"
    if not migrated:
        return (f"{where}: the database has no tables: it is not the server's, or was never "
                "migrated (`python -m app migrate`)")
    return None


def preflight_problems(queues: list[str]) -> list[str]:
    """Every reason this worker could not run a job, each naming its setting."""
    from app.migrate import migrations_current

    problems = []
    unknown = [q for q in queues if q not in QUEUE_NAMES]
    if unknown:
        problems.append(f"-Q: no job is sent to queue(s) {unknown}; the queues are "
                        f"{list(QUEUE_NAMES)}")
    if (problem := database_problem()) is not None:
        problems.append(problem)
    else:
        try:
            if not migrations_current():
                log.warning("the database is not at the newest migration: run "
                            "`python -m app migrate` (jobs fail until it is)")
        except Exception as exc:  # noqa: BLE001
            log.warning("could not check the database's migrations: %s", _first_line(exc))
    storage = get_settings().resolved_storage_dir
    # the check `python -m app serve` makes too (app.services.storage.unwritable)
    if (problem := unwritable(storage, "this worker")) is not None:
        problems.append(f"STORAGE_DIR: {problem}")
    elif not problems:
        warn_of_foreign_storage(storage)
    return problems


# how many of the newest recorded checkpoints and images are looked for in STORAGE_DIR
RECORDED_FILES_LOOKED_FOR = 4


def warn_of_foreign_storage(storage: Path) -> None:
    """Log it when STORAGE_DIR holds none of the newest files the database records: a worker
    started with another STORAGE_DIR or DATA_DIR than the server's (a shared volume not
    mounted) ran its jobs to `succeeded` with every image and checkpoint where the server
    never looks (404s, checkpoints that "lost their files"). Not refused: a storage wiped on
    purpose looks the same, and no worker could then ever start again."""
    from app.db import session_scope
    from app.services import checkpoints, rollouts

    try:
        with session_scope() as s:
            recorded = [*checkpoints.newest_paths(s, RECORDED_FILES_LOOKED_FOR),
                        *rollouts.newest_image_paths(s, RECORDED_FILES_LOOKED_FOR)]
    except Exception as exc:  # noqa: BLE001 - a check that informs; the worker may still run
        log.warning("could not compare STORAGE_DIR with the database's files: %s",
                    _first_line(exc))
        return
    if recorded and not any((storage / path).exists() for path in recorded):
        log.warning("STORAGE_DIR %s holds none of the %d newest files the database records "
                    "(such as %s): it is not the storage the server and the other workers "
                    "use, and what this worker's jobs write there the server will not find; "
                    "set STORAGE_DIR (or DATA_DIR) as the server has it", storage,
                    len(recorded), recorded[0])


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
