"""Engine and sessions: the only place that turns a database URL into connections.

SQLite gets WAL mode, foreign keys and a busy timeout on every connection. Call
`configure(settings)` to (re)bind the module-level engine, e.g. in tests; otherwise the first
use binds it to `get_settings()`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event, false, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from app.config import Settings, get_settings

_engine: Engine | None = None
_sessionmaker: sessionmaker[Session] | None = None
# the first use's configure(), which the API's request threads may reach at once: without it
# each built an engine (a pool) of its own, the later disposing the earlier's
_first_use_lock = threading.Lock()


def _unicode_lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
            # SQLite's own lower() folds ASCII letters only, so a prompt search (lower(text)
            # LIKE the query lowered in Python) never found "Éclair" or "Über", typed exactly
            # as stored; Python's lower() on both sides, as PostgreSQL's lower() in a UTF-8
            # locale does it
            dbapi_conn.create_function("lower", 1, _unicode_lower, deterministic=True)

        @event.listens_for(engine, "savepoint")
        def _savepoint_inside_a_transaction(conn, _name):
            # Python's sqlite3 opens a transaction only before a write, never before a
            # SAVEPOINT; a SAVEPOINT outside one opens its own, whose RELEASE commits. So a
            # savepoint taken first (an upload's dataset row) was committed on its own, and a
            # failure after it left the row without its prompts. BEGIN first: the RELEASE then
            # ends the savepoint only, and the session's commit or rollback decides.
            dbapi_conn = conn.connection.dbapi_connection
            if not dbapi_conn.in_transaction:
                dbapi_conn.execute("BEGIN")

        return engine
    # no pre-ping (a round trip per checkout); stale connections are recycled instead
    return create_engine(url, pool_recycle=1800, pool_size=10, max_overflow=20)


def database_unreachable(exc: BaseException) -> str | None:
    """One line naming the cause when `exc` says the database cannot be reached (refused,
    gone mid-query, a dropped connection), else None. Such an outage is the network's or the
    server's, not a bug nor a job's fault: a worker logs this line and carries on (the reaper
    requeues what it interrupted), never a traceback every round. Only PostgreSQL's plain
    OperationalError counts (its subclasses, such as a cancelled statement, are a statement's
    own error), and any error SQLAlchemy saw invalidate the connection."""
    if not isinstance(exc, DBAPIError):
        return None
    if not (exc.connection_invalidated or type(exc.orig) is psycopg.OperationalError):
        return None
    lines = str(exc.orig).strip().splitlines()
    return (f"the database (DATABASE_URL) cannot be reached: {type(exc.orig).__name__}: "
            f"{lines[0] if lines else ''}")


def configure(settings: Settings | None = None) -> Engine:
    """Bind the module engine to `settings` (default: the environment's)."""
    global _engine, _sessionmaker
    settings = settings or get_settings()
    if _engine is not None:
        _engine.dispose()
    _engine = make_engine(settings.resolved_database_url)
    _sessionmaker = sessionmaker(_engine, expire_on_commit=False)
    return _engine


def _new_pool_in_forked_child() -> None:
    """A forked child (Celery's prefork pool, the CPU worker's default) starts with a pool of
    its own. It inherited the parent's pooled connections: two processes writing to one
    socket interleave their queries (ResourceClosedError, psycopg's "prepared statement
    already exists"), which failed jobs and the parent's reaper. close=False leaves those
    connections to the parent, which still uses them."""
    if _engine is not None:
        _engine.dispose(close=False)


os.register_at_fork(after_in_child=_new_pool_in_forked_child)


def _configure_on_first_use() -> None:
    # _sessionmaker, set after _engine, says configure() has finished
    if _sessionmaker is None:
        with _first_use_lock:
            if _sessionmaker is None:
                configure()


def get_engine() -> Engine:
    _configure_on_first_use()
    assert _engine is not None
    return _engine


def new_session() -> Session:
    _configure_on_first_use()
    assert _sessionmaker is not None
    return _sessionmaker()


@contextmanager
def session_scope() -> Iterator[Session]:
    """A session that commits on success and rolls back on error (for workers and CLIs)."""
    session = new_session()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def write_lock(session: Session, table: type[Any], row_id: int | None = None) -> None:
    """Hold until the session's transaction ends a lock that every other `write_lock` on
    `table` (or on its row `row_id`) waits for, so a check-then-write (a name still free, a
    dataset no job uses) cannot interleave with another's. PostgreSQL: the row's lock
    (an UPDATE of it, which also waits for readers holding it FOR SHARE), or an advisory lock
    named after the table. SQLite has one write lock for the whole database: a write that
    changes nothing takes it now (Python's sqlite3 begins the transaction before it), and the
    reads after it see every committed write."""
    key = getattr(table, "__tablename__", str(table))
    ident = table.__table__.c.id
    if row_id is not None:
        session.execute(update(table).where(ident == row_id).values(id=ident))
    elif session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": key})
    else:
        session.execute(update(table).where(false()).values(id=ident))
