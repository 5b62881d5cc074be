"""A forked child gets a connection pool of its own (app.db): Celery's prefork pool, the CPU
worker's default, forks after the worker has used the database, and a child that reused the
parent's pooled connection interleaved its queries with the parent's on one socket."""

from __future__ import annotations

import os

from sqlalchemy import text


def test_a_forked_child_opens_its_own_connections_and_leaves_the_parents(settings):
    from app.db import get_engine, session_scope

    with session_scope() as s:
        assert s.execute(text("SELECT 1")).scalar() == 1
    assert get_engine().pool.checkedin() >= 1  # the parent's connection, pooled
    pid = os.fork()
    if pid == 0:  # the child: exit at once whatever happens (never back into pytest)
        code = 1
        try:
            fresh = get_engine().pool.checkedin() == 0
            with session_scope() as s:
                works = s.execute(text("SELECT 2")).scalar() == 2
            code = 0 if fresh and works else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # the child neither used nor closed the parent's connection: the parent's still works
    with session_scope() as s:
        assert s.execute(text("SELECT 3")).scalar() == 3
