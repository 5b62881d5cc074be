"""`python -m app migrate` and `python -m app create-user NAME --role admin|annotator`."""

from __future__ import annotations

import argparse
import sys

from app.errors import ServiceError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("migrate", help="upgrade the database to the newest migration")
    cu = sub.add_parser("create-user", help="create a user and print their API token once")
    cu.add_argument("name")
    cu.add_argument("--role", choices=("admin", "annotator"), default="annotator")
    args = parser.parse_args(argv)

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
