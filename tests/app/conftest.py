"""Fixtures for the server tests: every test runs on a real SQLite file AND the real PostgreSQL
(a database `ngrpo_test_<uuid>` created for the session and dropped after it)."""

from __future__ import annotations

import io
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy import text

PG_ADMIN = os.environ.get("NGRPO_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
TABLES = ["workers", "votes", "preference_models", "samples", "rollout_groups", "job_metrics",
          "checkpoints", "jobs", "prompts",
          "datasets", "api_tokens", "users"]


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{dbname}"


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def db_url(request, tmp_path_factory) -> Iterator[str]:
    """A migrated, empty database of each backend (migrations run through Alembic)."""
    from app.migrate import upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'test.db'}"
        upgrade(url)
        yield url
        return
    name = f"ngrpo_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _pg_url(name)
    try:
        upgrade(url)
        yield url
    finally:
        from app import db

        if db._engine is not None:
            db._engine.dispose()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def settings(db_url, tmp_path, monkeypatch):
    """Settings from the environment, as the app and the worker read them."""
    from app import db
    from app.config import get_settings

    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("STORAGE_DIR", str(tmp_path / "storage"))
    get_settings.cache_clear()
    s = get_settings()
    engine = db.configure(s)
    from app.services import auth, votes

    auth.token_cache.clear()
    votes._id_range.clear()
    votes._pref_version.clear()
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
        else:
            for t in TABLES:
                conn.execute(text(f"DELETE FROM {t}"))
    yield s
    get_settings.cache_clear()


@pytest.fixture
def session(settings):
    from app import db

    s = db.new_session()
    yield s
    s.close()


class RecordingEnqueuer:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(self, job_id: int, kind: str) -> None:
        self.calls.append((job_id, kind))


@pytest.fixture
def enqueuer() -> RecordingEnqueuer:
    return RecordingEnqueuer()


@pytest.fixture
def client(settings, enqueuer) -> Iterator[TestClient]:
    from app.main import create_app

    app = create_app(settings, enqueuer=enqueuer, mount_ui=False)
    with TestClient(app) as c:
        yield c


def _make_user(name: str, role: str) -> dict[str, str]:
    from app.db import session_scope
    from app.services.auth import create_user

    with session_scope() as s:
        _, token = create_user(s, name, role)
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def admin(settings) -> dict[str, str]:
    return _make_user("alice", "admin")


@pytest.fixture
def annotator(settings) -> dict[str, str]:
    return _make_user("bob", "annotator")


@pytest.fixture
def make_user(settings):
    return _make_user


def png(color: tuple[int, int, int] = (255, 0, 0), size: int = 4) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def png_bytes():
    return png


def seed_group(job_id=None, *, iteration=0, prompt="two red circles", g=4, checkpoint_id=None,
               seed=0, purpose=None) -> int:
    from app.db import session_scope
    from app.services.rollouts import record_rollout_group

    # each member its own colour, and each checkpoint its own shade of it: two checkpoints'
    # pictures from one noise differ, as the arena's cross-checkpoint pairs must
    # 32 px, the shapes model's size: what a preference fit on the shapes features reads
    samples = [{"png": png((40 * i % 256, 50 * (checkpoint_id or 0) % 256, 0), size=32),
                "member_index": i,
                "rewards": {"count": i / g}, "advantage": i - (g - 1) / 2,
                "is_anchor": i == 0} for i in range(g)]
    with session_scope() as s:
        return record_rollout_group(
            s, job_id=job_id, iteration=iteration, prompt_text=prompt, checkpoint_id=checkpoint_id,
            solver="dpm++", steps=8, sigma=0.3, seed=seed, samples=samples, purpose=purpose)


@pytest.fixture
def make_group(settings):
    return seed_group


def seed_votes(n: int = 4) -> None:
    """`n` (<= 10) clean votes on the pairs of one seeded group, by an annotator of their own:
    what a fit_preference job needs before it is accepted (MIN_FIT_VOTES)."""
    from itertools import combinations

    from sqlalchemy import select

    from app.db import session_scope
    from app.models import Sample, User
    from app.services import votes

    group = seed_group(g=5, prompt="one red circle")
    _make_user(f"voter-{group}", "annotator")  # one of its own each call (a pair is judged once)
    with session_scope() as s:
        voter = s.scalar(select(User).where(User.name == f"voter-{group}"))
        ids = list(s.scalars(select(Sample.id).where(Sample.group_id == group)
                             .order_by(Sample.id)))
    for i, (a, b) in enumerate(list(combinations(ids, 2))[:n]):
        with session_scope() as s:
            votes.record_vote(s, s.get(User, voter.id), client_vote_id=f"seed-{group}-{i}",
                              sample_a_id=a, sample_b_id=b, outcome="a")


@pytest.fixture
def vote_seeder(settings):
    """seed_votes: clean votes, so that fit_preference jobs are accepted."""
    return seed_votes


def storage_dir(settings) -> Path:
    return settings.resolved_storage_dir


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    """An empty PostgreSQL database for this test only."""
    name = f"ngrpo_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _pg_url(name)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def models(settings, tiny_flux_path) -> Path:
    """MODELS_DIR holding the tiny FLUX (tests/tiny_diffusers.py) as `tiny-flux`, the
    model_path a real-model job names."""
    root = settings.resolved_models_dir
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_flux_path, root / "tiny-flux")
    return root
