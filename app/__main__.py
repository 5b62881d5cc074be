"""`python -m app migrate`, `python -m app create-user NAME --role admin|annotator` and
`python -m app serve` (migrations, seed data, a worker and the server: app/serve.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from app.errors import ServiceError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app", description="The studio's server: "
                                     "its database, its users and the server itself.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("migrate", "upgrade the database (DATABASE_URL) to the newest migration"),
                       ("create-user", "create a user and print their API token once"),
                       ("serve", "migrate, seed, start a worker and the server (Ctrl-C stops "
                                 "all)")):
        sub.add_parser(name, help=text, description=text)
    cu = sub.choices["create-user"]
    cu.add_argument("name", help="the user's name (unique; shown on their votes)")
    cu.add_argument("--role", choices=("admin", "annotator"), default="annotator",
                    help="admins do everything; annotators vote and read (default annotator)")
    sv = sub.choices["serve"]
    sv.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"),
                    help="address to listen on (default $HOST or 127.0.0.1)")
    # the default is read when `serve` runs (`_port`), so that a bad $PORT stops only serve
    sv.add_argument("--port", type=int, default=None,
                    help="port to listen on (default $PORT or 8000)")
    sv.add_argument("--no-worker", action="store_true", help="do not start a worker process")
    sv.add_argument("--no-demo-job", action="store_true",
                    help="do not queue the demo jobs on the first start (the arena's "
                         "base-model rollouts and the quick demo training job)")
    return parser


def _port(parser: argparse.ArgumentParser, given: int | None) -> int:
    raw = os.environ.get("PORT", "8000") if given is None else str(given)
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 65535:
        parser.error(f"{'PORT' if given is None else '--port'} must be a port number "
                     f"(1-65535), got {raw!r}")
    return int(raw)


def setup_problem(exc: Exception) -> str | None:
    """One line for what stops a command before it does anything, naming the setting to fix
    (a traceback of the database driver says the same in a hundred lines); None for others."""
    from pydantic import ValidationError
    from sqlalchemy.exc import ArgumentError, OperationalError, ProgrammingError

    from app.config import settings_problem

    if isinstance(exc, ValidationError):  # a setting from the environment (app/config.py)
        return settings_problem(exc)
    if isinstance(exc, ArgumentError):
        return f"DATABASE_URL is not a database URL ({exc})"
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    if isinstance(exc, OperationalError | ProgrammingError) and (
            "no such table" in first or ("relation" in first and "does not exist" in first)):
        return f"the database has no tables yet ({first}): run `python -m app migrate` first"
    if isinstance(exc, OperationalError):
        return f"the database (DATABASE_URL) cannot be reached: {first}"
    if isinstance(exc, OSError):
        # Gradio's upload folder is the server's one path outside DATA_DIR and STORAGE_DIR
        gradio = os.environ.get("GRADIO_TEMP_DIR")
        failed = [str(f) for f in (exc.filename, exc.filename2) if f]
        if gradio and any(_under(f, gradio) for f in failed):
            return f"GRADIO_TEMP_DIR: {exc}"
        return f"{exc} (check DATA_DIR and STORAGE_DIR)"
    return None


def _under(path: str, folder: str) -> bool:
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, RuntimeError, ValueError):
        return False


def serve_problem() -> str | None:
    """One line for a directory serve must write and cannot, before it prints its banner and
    migrates: STORAGE_DIR (the lifespan's mkdir ended serve in a 70-line traceback) and a
    GRADIO_TEMP_DIR the operator named (Gradio's upload folder, made when the UI mounts). The
    worker checks STORAGE_DIR the same way (worker/preflight.py)."""
    from app.config import get_settings
    from app.services.storage import unwritable

    if (problem := unwritable(get_settings().resolved_storage_dir, "the server")) is not None:
        return f"STORAGE_DIR: {problem}"
    if (gradio := os.environ.get("GRADIO_TEMP_DIR")) and (
            problem := unwritable(Path(gradio), "the server")) is not None:
        return f"GRADIO_TEMP_DIR: {problem}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from app.config import get_settings

        # the settings first: a malformed one is said before anything starts, and a .env
        # key no setting reads is warned of (app.config) before Alembic configures logging
        get_settings()
        return _run(parser, args)
    except Exception as exc:
        problem = setup_problem(exc)
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr)
        return 1


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "serve":
        from app.serve import serve

        port = _port(parser, args.port)
        if (problem := serve_problem()) is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 1
        return serve(args.host, port, worker=not args.no_worker,
                     demo_job=not args.no_demo_job)

    if args.command == "migrate":
        from app.migrate import upgrade

        upgrade()
        print("database is at the newest migration")
        return 0
    if args.command == "create-user":
        from app.db import session_scope
        from app.services.auth import create_user

        try:
            with session_scope() as session:
                user, token = create_user(session, args.name, args.role)
                role = user.role
        except ServiceError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 1
        print(f"created {role} {args.name!r}. API token (shown once, store it now):")
        print(token)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
