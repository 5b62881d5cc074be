"""`python -m app migrate`, `python -m app create-user NAME --role admin|annotator` and
`python -m app serve` (migrations, seed data, a worker and the server: app/serve.py)."""

from __future__ import annotations

import argparse
import os
import sys

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
    sv.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")),
                    help="port to listen on (default $PORT or 8000)")
    sv.add_argument("--no-worker", action="store_true", help="do not start a worker process")
    sv.add_argument("--no-demo-job", action="store_true",
                    help="do not launch the quick demo training job on the first start")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "serve":
        from app.serve import serve

        return serve(args.host, args.port, worker=not args.no_worker,
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
