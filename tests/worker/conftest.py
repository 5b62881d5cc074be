"""Fixtures for the worker tests: real Celery worker processes on a real broker (the embedded
filesystem transport, or the Redis at 127.0.0.1:6379 under a key prefix unique to the run) and
a real database (a SQLite file, or a PostgreSQL database created for the run and dropped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
PG_ADMIN = os.environ.get("NGRPO_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("NGRPO_TEST_REDIS", "redis://127.0.0.1:6379/0")

# how fast the workers notice things in tests (production defaults are 10 s / 120 s / 30 s)
FAST = {"JOB_HEARTBEAT_SECONDS": "0.5", "JOB_STALE_SECONDS": "5",
        "REAPER_INTERVAL_SECONDS": "1", "JOB_MAX_ATTEMPTS": "3"}


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{dbname}"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """One migrated PostgreSQL database for the worker tests, dropped at the end."""
    from app.migrate import upgrade

    name = f"ngrpo_wtest_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        upgrade(_pg_url(name))
        yield _pg_url(name)
    finally:
        from app import db

        if db._engine is not None:
            db._engine.dispose()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _redis_cleanup(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@dataclass
class Stack:
    """The environment one test's processes share, and the workers it started."""

    env: dict[str, str]
    tmp: Path
    workers: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start_worker(self, name: str | None = None, queues: str = "gpu,cpu",
                     extra_env: dict[str, str] | None = None,
                     wait: bool = True) -> subprocess.Popen:
        name = name or f"w{len(self.workers)}"
        log = self.tmp / f"{name}.log"
        env = {**self.env, **(extra_env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "-Q", queues,
             "--pool", "solo", "-n", f"{name}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-l", "INFO"],
            cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.workers.append(proc)
        self.logs.append(log)
        if wait:
            self.wait_log(log, "ready.", proc)
        return proc

    def wait_log(self, log: Path, text: str, proc: subprocess.Popen, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in log.read_text(errors="replace"):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"worker never logged {text!r}:\n{log.read_text(errors='replace')}")

    def log_text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}"
                         for p in self.logs)

    def send(self, job_id: int, kind: str = "train") -> None:
        """Enqueue as the API does (a fresh Celery app on this test's settings)."""
        from app.config import get_settings
        from app.job_kinds import KINDS
        from worker.celery_app import make_celery

        app = make_celery(get_settings())
        try:
            app.send_task(KINDS[kind].task, args=[job_id], queue=KINDS[kind].queue)
        finally:
            app.close()

    def stop_all(self) -> None:
        """The tests are done with them (a clean stop is test_worker_serve's subject)."""
        for proc in self.workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


BACKENDS = {
    "sqlite-fs": ("sqlite", "filesystem"),
    "postgres-redis": ("postgres", "redis"),
    "postgres-fs": ("postgres", "filesystem"),
    "sqlite-redis": ("sqlite", "redis"),
}


@pytest.fixture
def stack(request, tmp_path, monkeypatch) -> Iterator[Stack]:
    """Parametrize indirectly with a key of BACKENDS (default sqlite-fs)."""
    from app import db
    from app.config import get_settings

    db_kind, broker = BACKENDS[getattr(request, "param", "sqlite-fs")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "BROKER"))}
    env.update(FAST)
    env.update({"DATA_DIR": str(tmp_path / "data"), "STORAGE_DIR": str(tmp_path / "storage"),
                "PYTHONPATH": str(ROOT), "TRAIN_NPROC": "1", "OMP_NUM_THREADS": "1"})
    if db_kind == "sqlite":
        from app.migrate import upgrade

        env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'studio.db'}"
        upgrade(env["DATABASE_URL"])
    else:
        env["DATABASE_URL"] = request.getfixturevalue("pg_database")
    prefix = None
    if broker == "redis":
        prefix = f"ngrpo-test-{uuid.uuid4().hex[:10]}:"
        env.update({"BROKER_URL": REDIS_URL, "BROKER_KEY_PREFIX": prefix})
    for key in ("DATABASE_URL", "BROKER_URL", "BROKER_KEY_PREFIX"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        if key in FAST or key in ("DATA_DIR", "STORAGE_DIR", "DATABASE_URL", "BROKER_URL",
                                  "BROKER_KEY_PREFIX", "TRAIN_NPROC"):
            monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    engine = db.configure(get_settings())
    if db_kind == "postgres":
        from sqlalchemy import text

        with engine.begin() as conn:
            conn.execute(text("TRUNCATE votes, preference_models, samples, rollout_groups, "
                              "job_metrics, checkpoints, jobs, prompts, datasets, api_tokens, "
                              "users, workers RESTART IDENTITY CASCADE"))
    s = Stack(env=env, tmp=tmp_path)
    try:
        yield s
    finally:
        s.stop_all()
        if prefix:
            _redis_cleanup(prefix)
        engine.dispose()
        get_settings.cache_clear()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call" and rep.failed and "stack" in item.fixturenames:
        stack = item.funcargs.get("stack")
        if stack is not None:
            rep.sections.append(("worker logs", stack.log_text()))
    return rep
