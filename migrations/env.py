"""Alembic environment: the URL comes from app settings (or `config.attributes["url"]`)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from app.config import get_settings
from app.db import make_engine
from app.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def url() -> str:
    return config.attributes.get("url") or get_settings().resolved_database_url


def run_migrations_offline() -> None:
    context.configure(url=url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def _sqlite_foreign_keys(connection: Connection, on: bool) -> None:
    """SQLite rebuilds a table to change it (copy, drop, rename): with foreign keys enforced,
    dropping the old table would run its ON DELETE actions (a dataset's rebuild would delete
    every prompt). So migrations run with enforcement off, as SQLite's documentation asks for
    schema changes, and the references are checked once they are done. The pragma is a no-op
    inside a transaction, hence the commits around it."""
    connection.exec_driver_sql(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")
    connection.commit()


def run_migrations_online() -> None:
    engine = make_engine(url())
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            _sqlite_foreign_keys(connection, on=False)
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        if sqlite:
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise RuntimeError(f"migrations left rows whose references are broken: {broken[:5]}")
            _sqlite_foreign_keys(connection, on=True)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
