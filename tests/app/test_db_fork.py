"""A forked child gets a connection pool of its own (app.db): Celery's prefork pool, the CPU
worker's default, forks after the worker has used the database, and a child that reused the
parent's pooled connection interleaved its queries with the parent's on one socket."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


# 8 threads, released at once, open the first sessions of a fresh process
_CONCURRENT_FIRST_USE = """
import threading
from app import db
binds, barrier = [], threading.Barrier(8)
def first_use():
    barrier.wait()
    with db.new_session() as s:
        binds.append(s.get_bind())
threads = [threading.Thread(target=first_use) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(binds), len({id(b) for b in binds}), all(b is db.get_engine() for b in binds))
"""


@pytest.mark.subprocess
def test_threads_first_use_binds_one_engine(tmp_path):
    """The first use from several request threads at once configures the engine once: each
    thread had built an engine (a connection pool) of its own, the later disposing the
    earlier's while its sessions still used it."""
    env = {**os.environ, "DATA_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _CONCURRENT_FIRST_USE], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[2], env=env,
                             check=True, timeout=120).stdout
        assert out.split() == ["8", "1", "True"]
