"""What an operator gets wrong or loses: timing settings without a bound, a broker URL of no
transport, an unusable STORAGE_DIR or GRADIO_TEMP_DIR, a misspelt .env key, two migrations at
once, the database going away while the server runs, a password in serve's banner."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.config import MAX_PERIOD_SECONDS, Settings, settings_problem

ROOT = Path(__file__).resolve().parents[2]
PG_ADMIN = os.environ.get("NGRPO_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# every setting these tests set, taken out of the environment they inherit
SET_HERE = ("DATABASE_URL", "STORAGE_DIR", "BROKER_URL", "JOB_STALE_SECONDS",
            "JOB_HEARTBEAT_SECONDS", "REAPER_INTERVAL_SECONDS", "GRADIO_TEMP_DIR", "PORT")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SET_HERE}
    return {**env, "DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT), **extra}


def _app(tmp_path: Path, *argv: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *argv], env=_env(tmp_path, **env),
                          cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["JOB_STALE_SECONDS", "JOB_HEARTBEAT_SECONDS",
                                  "REAPER_INTERVAL_SECONDS"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e12", str(MAX_PERIOD_SECONDS + 1)])
def test_timing_settings_are_finite_and_at_most_a_week(name, value, monkeypatch):
    """inf or 1e12 overflowed every date computed from them (POST /api/jobs a 500 after its
    job was queued, the reaper a traceback a round, Event.wait(inf) killed its thread)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert settings_problem(caught.value).startswith(f"{name}: "), settings_problem(caught.value)


def test_a_week_is_taken():
    week = Settings(job_heartbeat_seconds=10, job_stale_seconds=MAX_PERIOD_SECONDS,
                    reaper_interval_seconds=MAX_PERIOD_SECONDS)
    assert week.job_stale_seconds == week.reaper_interval_seconds == MAX_PERIOD_SECONDS


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "rediss://h:6380/0",
                                 "redis://:pw@127.0.0.1:6379/9", "amqp://guest:guest@h//",
                                 "pyamqp://h//", "memory://", "filesystem://localhost//",
                                 "sqla+postgresql://u@h/db", "sentinel://h:26379", ""])
def test_broker_urls_of_a_transport_are_taken(url):
    assert Settings(broker_url=url).broker_url == url


@pytest.mark.parametrize("url", ["http://u:s3cret@broker:8080/", "localhost:6379", "redis"])
def test_a_broker_url_of_no_transport_is_a_setting_to_fix(url):
    """It was sent to at every submission and said to be an outage ("try again when it is
    back"): now the start refuses it, naming the schemes, never echoing the URL."""
    with pytest.raises(ValidationError) as caught:
        Settings(broker_url=url)
    said = settings_problem(caught.value)
    assert said.startswith("BROKER_URL: ") and "redis, rediss" in said and "amqp" in said
    assert "s3cret" not in said


@pytest.mark.subprocess
def test_each_start_refuses_them_in_one_line(tmp_path):
    """The server's commands and the worker stop with one line naming the setting."""
    for env in ({"JOB_STALE_SECONDS": "inf"}, {"REAPER_INTERVAL_SECONDS": "1e12"},
                {"JOB_HEARTBEAT_SECONDS": "nan"}, {"BROKER_URL": "http://u:s3cret@broker/"}):
        name = next(iter(env))
        out = _app(tmp_path, "migrate", **env)
        assert out.returncode == 1 and out.stderr.startswith(f"error: {name}: "), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "s3cret" not in out.stderr
    worker = subprocess.run([sys.executable, "-c", "import worker.celery_app"], cwd=ROOT,
                            env=_env(tmp_path, REAPER_INTERVAL_SECONDS="inf"),
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == 1, worker.stderr
    assert worker.stderr.strip() == "error: REAPER_INTERVAL_SECONDS: Input should be a finite " \
                                    "number", worker.stderr


@pytest.mark.subprocess
def test_serve_refuses_an_unusable_storage_or_gradio_dir_before_its_banner(tmp_path):
    """STORAGE_DIR under a file ended serve in a 70-line lifespan traceback after its banner;
    a GRADIO_TEMP_DIR there was blamed on DATA_DIR and STORAGE_DIR."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for name in ("STORAGE_DIR", "GRADIO_TEMP_DIR"):
        out = _app(tmp_path, "serve", "--no-worker", "--no-demo-job", "--port", "1",
                   **{name: str(a_file / "dir")})
        assert out.returncode == 1, (name, out.stdout, out.stderr)
        assert out.stdout == "", out.stdout  # no banner, nothing migrated or started
        assert out.stderr.startswith(f"error: {name}: {a_file / 'dir'} is not a directory the "
                                     "server can write (NotADirectoryError"), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "data" / "studio.db").exists()


def test_an_os_error_in_gradios_folder_names_gradio_temp_dir(tmp_path, monkeypatch):
    from app.__main__ import setup_problem

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    failed = NotADirectoryError(20, "Not a directory", str(tmp_path / "uploads" / "history"))
    assert setup_problem(failed).startswith("GRADIO_TEMP_DIR: [Errno 20] Not a directory")
    elsewhere = NotADirectoryError(20, "Not a directory", str(tmp_path / "data" / "x"))
    assert setup_problem(elsewhere).endswith("(check DATA_DIR and STORAGE_DIR)")


@pytest.mark.subprocess
def test_a_misspelt_env_file_key_is_warned_of_once_and_nothing_refused(tmp_path):
    """DATABSE_URL in .env was dropped without a word and the studio ran on SQLite. Only the
    file's keys are looked at (the environment holds PATH, HOME and the like), and docker
    compose's variables in it are no mistake."""
    (tmp_path / ".env").write_text("DATABSE_URL=postgresql://nowhere/x\nPOSTGRES_PASSWORD=pw\n"
                                   "job_stale_seconds=60\nCOMPOSE_PROJECT_NAME=studio\n")
    out = _app(tmp_path, "migrate", cwd=tmp_path, STORAGE_DRI="/typo/in/the/environment")
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if ".env" in line]
    assert warned == ["warning: .env holds key(s) no setting reads, ignored: DATABSE_URL "
                      "(did you mean DATABASE_URL?)"], out.stderr
    assert "STORAGE_DRI" not in out.stderr and "POSTGRES_PASSWORD" not in out.stderr
    assert (tmp_path / "data" / "studio.db").exists()  # the SQLite default, as before


def test_the_banner_masks_the_brokers_password():
    from app.serve import settings_banner

    lines = settings_banner(Settings(broker_url="redis://:s3cretpw@127.0.0.1:6379/9",
                                     database_url="postgresql+psycopg://u:dbpw@db:5432/s"))
    assert "s3cretpw" not in "\n".join(lines) and "dbpw" not in "\n".join(lines)
    assert lines[2].split() == ["broker:", "redis://:**@127.0.0.1:6379/9"]


@pytest.mark.subprocess
def test_two_migrations_at_once_on_a_fresh_database_take_turns(fresh_pg_url, tmp_path):
    """`docker compose up --scale api=2`: both migrated a fresh database at once and one
    crashed on alembic_version's unique key. Held here while both start, the migration lock
    keeps both waiting; released, one migrates and the other finds it done."""
    from alembic.script import ScriptDirectory

    from app.migrate import MIGRATION_LOCK_KEY, alembic_config

    dbname = fresh_pg_url.rsplit("/", 1)[1]
    holder = psycopg.connect(f"{PG_ADMIN.rsplit('/', 1)[0]}/{dbname}", autocommit=True)
    procs = []
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        procs = [subprocess.Popen([sys.executable, "-m", "app", "migrate"], cwd=ROOT,
                                  env=_env(tmp_path, DATABASE_URL=fresh_pg_url),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        deadline = time.monotonic() + 60
        waiting = 0
        while waiting < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            waiting = holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = %s)",
                (dbname,)).fetchone()[0]
            time.sleep(0.2)
        assert waiting == 2, "the migrations did not wait for the lock"
    finally:
        holder.close()  # releases the lock
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (stdout, stderr) in zip(procs, results, strict=True):
        assert proc.returncode == 0, stderr
        assert "database is at the newest migration" in stdout and "Traceback" not in stderr
    heads = set(ScriptDirectory.from_config(alembic_config()).get_heads())
    with psycopg.connect(f"{PG_ADMIN.rsplit('/', 1)[0]}/{dbname}") as conn:
        assert {r[0] for r in conn.execute("SELECT version_num FROM alembic_version")} == heads


def test_the_database_going_away_is_a_503_and_healthz_says_so(fresh_pg_url, tmp_path,
                                                              monkeypatch, caplog):
    """A database outage at run time: each API call was a plain-text 500 and a 220-line
    traceback while /healthz stayed 200 (docker compose's health check saw nothing)."""
    from app import db
    from app.config import get_settings
    from app.main import create_app
    from app.migrate import upgrade
    from app.services.auth import create_user

    upgrade(fresh_pg_url, quiet=True)
    monkeypatch.setenv("DATABASE_URL", fresh_pg_url)
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("STORAGE_DIR", raising=False)
    get_settings.cache_clear()
    settings = get_settings()
    try:
        with TestClient(create_app(settings, mount_ui=False)) as client:
            with db.session_scope() as s:
                _, token = create_user(s, "alice", "admin")
            headers = {"Authorization": f"Bearer {token}"}
            assert client.get("/healthz").json() == {"status": "ok"}
            assert client.get("/api/jobs", headers=headers).status_code == 200
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE "{fresh_pg_url.rsplit("/", 1)[1]}" WITH (FORCE)')
            caplog.clear()
            for _ in range(2):  # the dropped connection, then a new one refused
                r = client.get("/api/jobs", headers=headers)
                assert r.status_code == 503, r.text
                assert r.json()["field"] == "database"
                assert r.json()["detail"].startswith("the database (DATABASE_URL) cannot be "
                                                     "reached: ")
                assert r.json()["detail"].endswith("; try again when it is back")
            health = client.get("/healthz")  # no token: the health check has none
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert "cannot be reached" in health.json()["detail"]
        logged = [r for r in caplog.records if r.name == "app.main"]
        assert len(logged) == 3 and not any(r.exc_info for r in logged), logged
        assert logged[0].getMessage().startswith("GET /api/jobs: the database (DATABASE_URL)")
    finally:
        db.get_engine().dispose()
        get_settings.cache_clear()
