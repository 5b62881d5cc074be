"""Run Alembic programmatically (the URL comes from app settings in migrations/env.py)."""

from __future__ import annotations

import logging
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


def upgrade(url: str | None = None, revision: str = "head", *, quiet: bool = False) -> None:
    """Migrate to `revision`. `quiet`: Alembic's own INFO lines (each migration's description,
    its plugins being set up) are not printed: a server's start shows its token and address,
    not a screenful of schema history; its warnings still show."""
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
