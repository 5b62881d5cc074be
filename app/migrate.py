"""Run Alembic programmatically (the URL comes from app settings in migrations/env.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config

ROOT = Path(__file__).resolve().parent.parent


def alembic_config(url: str | None = None) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    if url:
        cfg.attributes["url"] = url
    return cfg


# the PostgreSQL advisory lock every upgrade holds: one number for the project ("ngrp")
MIGRATION_LOCK_KEY = 0x6E677270


@contextmanager
def _migration_lock(url: str | None) -> Iterator[None]:
    """Hold the database's migration lock (PostgreSQL: a session advisory lock, released when
    its connection closes, a crash included). Two upgrades at once on a fresh database (`docker
    compose up --scale api=2`, each api container migrates) both created alembic_version, and
    the second crashed on its unique key; now the second waits, then finds the database at
    the newest migration. SQLite needs none: its one writer at a time keeps the studio's
    single-machine starts (one serve) apart."""
    from sqlalchemy import create_engine, make_url, text
    from sqlalchemy.pool import NullPool

    from app.config import get_settings

    url = url or get_settings().resolved_database_url
    if make_url(url).get_backend_name() != "postgresql":
        yield
        return
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            conn.commit()  # the lock is the session's: no transaction kept open beside Alembic's
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"),
                             {"key": MIGRATION_LOCK_KEY})
                conn.commit()
    finally:
        engine.dispose()


def upgrade(url: str | None = None, revision: str = "head", *, quiet: bool = False) -> None:
    """Migrate to `revision`, under the migration lock (one upgrade at a time per database).
    `quiet`: Alembic's own INFO lines (each migration's description, its plugins being set up)
    are not printed: a server's start shows its token and address, not a screenful of schema
    history; its warnings still show."""
    with _migration_lock(url):
        _upgrade(url, revision, quiet=quiet)


def _upgrade(url: str | None, revision: str, *, quiet: bool) -> None:
    cfg = alembic_config(url)
    if not quiet:
        command.upgrade(cfg, revision)
        return
    cfg.attributes["configure_logger"] = False  # migrations/env.py: leave logging as it is
    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    alembic_log.setLevel(logging.WARNING)
    try:
        command.upgrade(cfg, revision)
    finally:
        alembic_log.setLevel(level)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def migrations_current() -> bool:
    """Whether the database (the settings' DATABASE_URL) is at the newest Alembic revision:
    the server and every worker check it before they start."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from app import db

    heads = set(ScriptDirectory.from_config(alembic_config()).get_heads())
    with db.get_engine().connect() as conn:
        current = set(MigrationContext.configure(conn).get_current_heads())
    return current == heads
