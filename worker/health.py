"""`python -m worker.health`: exit 0 when this container can reach its database and broker
(the docker-compose health check of the workers; a solo-pool worker busy with a training job
cannot answer `celery inspect ping`, so its health is whether its dependencies answer)."""

from __future__ import annotations

import sys

from sqlalchemy import text


def main() -> int:
    from app.db import get_engine
    from worker.celery_app import celery_app

    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=5)
    except Exception as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
