from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, inspect, text

from app.migrate import downgrade, upgrade

EXPECTED = {"users", "api_tokens", "datasets", "prompts", "jobs", "job_metrics", "checkpoints",
            "rollout_groups", "samples", "votes", "preference_models", "workers"}


def _roundtrip(url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from app.models import Base

    upgrade(url)
    engine = create_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) >= EXPECTED
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        engine.dispose()
        downgrade(url, "base")
        assert not EXPECTED & set(inspect(engine).get_table_names())
        engine.dispose()
        upgrade(url)
        assert set(inspect(engine).get_table_names()) >= EXPECTED
    finally:
        engine.dispose()


def test_sqlite_up_down_up(tmp_path):
    _roundtrip(f"sqlite:///{tmp_path / 'm.db'}")


def test_postgres_up_down_up(fresh_pg_url):
    _roundtrip(fresh_pg_url)


def test_sqlite_default_uses_wal_and_foreign_keys(tmp_path, monkeypatch):
    from sqlalchemy import text

    from app.config import Settings
    from app.db import make_engine

    s = Settings(data_dir=tmp_path / "d")
    assert s.resolved_database_url.endswith("/d/studio.db")
    engine = make_engine(s.resolved_database_url)
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
    engine.dispose()
    assert s.resolved_storage_dir == (tmp_path / "d" / "storage").resolve()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_savepoint_commits_nothing_on_its_own(backend, tmp_path, request):
    """A row written inside a savepoint (an upload's dataset) is kept only if the session
    commits: on SQLite, a savepoint taken before any write was committed by its RELEASE, so
    a failure after it left the row half-written (a dataset without its prompts)."""
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from app.db import make_engine
    from app.models import Dataset

    url = _url(backend, tmp_path, request)
    upgrade(url)
    engine = make_engine(url)
    try:
        with Session(engine) as session:
            session.scalar(select(func.count()).select_from(Dataset))  # a read first, as uploads do
            with session.begin_nested():
                session.add(Dataset(name="half", filename="h.txt", format="txt", num_prompts=1,
                                    num_eval=0, duplicates_dropped=0, eval_fraction=0.0))
                session.flush()
            session.rollback()  # what a failure after the savepoint does
        with Session(engine) as session:
            assert session.scalar(select(func.count()).select_from(Dataset)) == 0
            with session.begin_nested():
                session.add(Dataset(name="whole", filename="w.txt", format="txt", num_prompts=1,
                                    num_eval=0, duplicates_dropped=0, eval_fraction=0.0))
            session.commit()
        with Session(engine) as session:
            assert session.scalars(select(Dataset.name)).all() == ["whole"]
    finally:
        engine.dispose()


def test_cli_migrate_creates_default_sqlite(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "STORAGE_DIR")}
    env["DATA_DIR"] = str(tmp_path / "d")
    out = subprocess.run([sys.executable, "-m", "app", "migrate"], env=env, capture_output=True,
                         text=True, check=True)
    assert "newest migration" in out.stdout
    engine = create_engine(f"sqlite:///{tmp_path / 'd' / 'studio.db'}")
    assert set(inspect(engine).get_table_names()) >= EXPECTED
    engine.dispose()


def test_cli_names_the_setting_to_fix_instead_of_a_traceback(tmp_path):
    """A database that cannot be reached or is not migrated, a malformed setting, a bad
    $PORT: one line naming what to fix, exit 1 (or argparse's 2), no traceback."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "STORAGE_DIR", "PORT", "JOB_MAX_ATTEMPTS",
                         "TRAIN_NPROC", "VOTE_RANDOM_SHARE", "JOB_STALE_SECONDS",
                         "JOB_HEARTBEAT_SECONDS", "REWARD_SERVER_TIMEOUT")}
    base["DATA_DIR"] = str(tmp_path / "d")
    cases = [
        ({"DATABASE_URL": "notaurl"}, ["migrate"], "DATABASE_URL is not a database URL"),
        ({"DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/ngrpo_no_such_db"},
         ["create-user", "zed"], "the database (DATABASE_URL) cannot be reached"),
        ({}, ["create-user", "zed"], "run `python -m app migrate` first"),
        ({"JOB_MAX_ATTEMPTS": "abc"}, ["create-user", "zed"], "JOB_MAX_ATTEMPTS: "),
        # read by the trainer's reward client: it failed a job at run time, not the start
        ({"REWARD_SERVER_TIMEOUT": "abc"}, ["migrate"], "REWARD_SERVER_TIMEOUT: "),
        # numbers out of their range stop the command too, every one named at once, rather
        # than a worker that never runs a job (TRAIN_NPROC=0) or reaps every running one
        ({"JOB_MAX_ATTEMPTS": "0", "TRAIN_NPROC": "-1", "VOTE_RANDOM_SHARE": "1.5"},
         ["create-user", "zed"], "JOB_MAX_ATTEMPTS: Input should be greater than or equal to 1; "
         "TRAIN_NPROC: Input should be greater than or equal to 1; VOTE_RANDOM_SHARE: Input "
         "should be less than or equal to 1"),
        ({"JOB_STALE_SECONDS": "5", "JOB_HEARTBEAT_SECONDS": "10"}, ["migrate"],
         "error: JOB_STALE_SECONDS (5) must be greater than JOB_HEARTBEAT_SECONDS (10)"),
        # the rule over two settings is said beside another setting's error, not after its fix
        ({"TRAIN_NPROC": "0", "JOB_STALE_SECONDS": "5"}, ["migrate"],
         "error: TRAIN_NPROC: Input should be greater than or equal to 1; JOB_STALE_SECONDS (5) "
         "must be greater than JOB_HEARTBEAT_SECONDS (10)"),
    ]
    for env, argv, expected in cases:
        out = subprocess.run([sys.executable, "-m", "app", *argv], env={**base, **env},
                             capture_output=True, text=True)
        assert out.returncode == 1, (env, out.stderr)
        assert expected in out.stderr and "Traceback" not in out.stderr, (env, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # a bad $PORT stops serve (before anything starts), not the other commands
    out = subprocess.run([sys.executable, "-m", "app", "serve"], env={**base, "PORT": "abc"},
                         capture_output=True, text=True)
    assert out.returncode == 2 and "PORT must be a port number (1-65535), got 'abc'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "app", "migrate"], env={**base, "PORT": "abc"},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _url(backend: str, tmp_path, request) -> str:
    return (f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite"
            else request.getfixturevalue("fresh_pg_url"))


@contextmanager
def _added_column(url: str, before: str, table: str, column: str, inserts: list[str],
                  kept: tuple[str, object]) -> Iterator:
    """A migration that adds `table.column`: rows inserted at revision `before`, then upgraded
    to the newest (the engine is yielded for the test's checks of the new column), then
    downgraded to `before`: the column is gone and the rows are kept (`kept`: a query and the
    value it must still give)."""
    upgrade(url, before)
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for sql in inserts:
                conn.execute(text(sql))
        engine.dispose()
        upgrade(url)
        yield engine
        engine.dispose()
        downgrade(url, before)
        assert column not in {c["name"] for c in inspect(engine).get_columns(table)}
        with engine.connect() as conn:
            assert conn.execute(text(kept[0])).scalar() == kept[1]
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_checkpoint_scores_column_keeps_existing_checkpoints(backend, tmp_path, request):
    """0005 adds checkpoints.scores to a database that already holds checkpoints (NULL: not
    evaluated yet) and its downgrade drops it without losing the rows."""
    with _added_column(_url(backend, tmp_path, request), "0004", "checkpoints", "scores", [
            "INSERT INTO checkpoints (id, iteration, name, path, format, created_at) VALUES "
            "(1, 3, 'old', 'c/1.safetensors', 'safetensors', CURRENT_TIMESTAMP)"],
            kept=("SELECT name FROM checkpoints", "old")) as engine:
        assert "scores" in {c["name"] for c in inspect(engine).get_columns("checkpoints")}
        with engine.begin() as conn:
            assert conn.execute(text("SELECT scores FROM checkpoints")).scalar() is None
            conn.execute(text("UPDATE checkpoints SET scores = :s"),
                         {"s": '{"count": {"mean": 0.5}}'})


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_blank_lines_column_keeps_existing_datasets(backend, tmp_path, request):
    """0006 adds datasets.blank_lines_skipped (0 for datasets uploaded before) and its
    downgrade drops it without losing the rows."""
    with _added_column(_url(backend, tmp_path, request), "0005", "datasets",
                       "blank_lines_skipped", [
            "INSERT INTO datasets (id, name, filename, format, num_prompts, num_eval, "
            "duplicates_dropped, eval_fraction, created_at) VALUES "
            "(1, 'old', 'old.txt', 'txt', 2, 0, 1, 0.0, CURRENT_TIMESTAMP)"],
            kept=("SELECT name FROM datasets", "old")) as engine, engine.begin() as conn:
        assert conn.execute(text("SELECT blank_lines_skipped FROM datasets")).scalar() == 0


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_pixel_difference_column_keeps_existing_votes(backend, tmp_path, request):
    """0007 adds votes.pixel_difference (null for votes recorded before) and its downgrade
    drops it without losing the votes."""
    with _added_column(_url(backend, tmp_path, request), "0006", "votes", "pixel_difference", [
            "INSERT INTO users (id, name, role, excluded, created_at) VALUES "
            "(1, 'ann', 'annotator', FALSE, CURRENT_TIMESTAMP)",
            "INSERT INTO rollout_groups (id, iteration, purpose, prompt_text, solver, steps, "
            "sigma, seed, created_at) VALUES (1, 0, 'rollout', 'one red circle', 'dpm++', 8, "
            "0.3, 1, CURRENT_TIMESTAMP)",
            "INSERT INTO samples (id, group_id, member_index, image_path, rewards, is_anchor) "
            "VALUES (1, 1, 0, 'a.png', '{}', FALSE), (2, 1, 1, 'b.png', '{}', FALSE)",
            "INSERT INTO votes (id, client_vote_id, annotator_id, sample_a_id, sample_b_id, "
            "pair_lo_id, pair_hi_id, outcome, selection, excluded, created_at) VALUES "
            "(1, 'v1', 1, 1, 2, 1, 2, 'a', 'within_group', FALSE, CURRENT_TIMESTAMP)"],
            kept=("SELECT client_vote_id FROM votes", "v1")) as engine, engine.begin() as conn:
        assert conn.execute(text("SELECT pixel_difference, outcome FROM votes")).one() == \
                (None, "a")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_unique_dataset_names_keep_every_dataset_that_shared_one(backend, tmp_path, request):
    """0008 makes datasets.name unique; datasets that shared a name before keep their prompts,
    the oldest its name, later ones their id beside it (never another dataset's name)."""
    url = _url(backend, tmp_path, request)
    upgrade(url, "0007")
    engine = create_engine(url)
    row = ("INSERT INTO datasets (id, name, filename, format, num_prompts, num_eval, "
           "duplicates_dropped, blank_lines_skipped, eval_fraction, created_at) VALUES "
           "({id}, '{name}', 'f.txt', 'txt', 1, 0, 0, 0, 0.0, CURRENT_TIMESTAMP)")
    try:
        with engine.begin() as conn:
            for id_, name in ((1, "mine"), (2, "mine (3)"), (3, "mine"), (4, "other"),
                              (5, "mine")):
                conn.execute(text(row.format(id=id_, name=name)))
            conn.execute(text("INSERT INTO prompts (id, dataset_id, position, text, split) "
                              "VALUES (1, 3, 0, 'one red circle', 'train')"))
        engine.dispose()
        upgrade(url)
        with engine.begin() as conn:
            names = dict(conn.execute(text("SELECT id, name FROM datasets")).all())
            assert names == {1: "mine", 2: "mine (3)", 3: "mine (3-2)", 4: "other",
                             5: "mine (5)"}
            assert conn.execute(text("SELECT dataset_id FROM prompts")).scalar() == 3
        with pytest.raises(Exception, match="(?i)unique"), engine.begin() as conn:
            conn.execute(text(row.format(id=6, name="other")))
        engine.dispose()
        downgrade(url, "0007")
        with engine.begin() as conn:  # the constraint is gone, the names stay
            conn.execute(text(row.format(id=6, name="other")))
            assert conn.execute(text("SELECT count(*) FROM datasets")).scalar() == 6
    finally:
        engine.dispose()


def test_sqlite_never_reuses_ids_that_other_rows_remember(tmp_path):
    """0011 rebuilds datasets and prompts with AUTOINCREMENT without losing a row or a
    reference (the rebuild drops the old table: with foreign keys enforced that would delete
    every prompt and unlink every job), and new ids start above every id another row still
    remembers (a job's deleted dataset)."""
    from app.db import make_engine

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0010")
    dataset = ("INSERT INTO datasets (id, name, filename, format, num_prompts, num_eval, "
               "duplicates_dropped, blank_lines_skipped, eval_fraction, created_at) VALUES "
               "({id}, 'd{id}', 'f.txt', 'txt', 1, 0, 0, 0, 0.0, CURRENT_TIMESTAMP)")
    prompt = ("INSERT INTO prompts ({id}dataset_id, position, text, split) "
              "VALUES ({values}{dataset}, 0, 'one red circle', 'train')")
    engine = make_engine(url)  # the app's engine: foreign keys enforced
    try:
        with engine.begin() as conn:
            for id_ in (1, 2):
                conn.execute(text(dataset.format(id=id_)))
            conn.execute(text(prompt.format(id="id, ", values="1, ", dataset=1)))
            conn.execute(text(prompt.format(id="id, ", values="2, ", dataset=2)))
            # job 2 ran on dataset 3, deleted since
            conn.execute(text("INSERT INTO jobs (id, kind, status, config, dataset_id, "
                              "submitted_dataset_id, iteration, cancel_requested, attempts, "
                              "created_at) VALUES (1, 'train', 'stopped', '{}', 2, 2, 0, FALSE, 0, "
                              "CURRENT_TIMESTAMP), (2, 'train', 'stopped', '{}', NULL, 3, 0, "
                              "FALSE, 0, CURRENT_TIMESTAMP)"))
        engine.dispose()
        upgrade(url)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT id, dataset_id FROM prompts ORDER BY id")).all() \
                == [(1, 1), (2, 2)]
            assert conn.execute(text("SELECT dataset_id FROM jobs WHERE id = 1")).scalar() == 2
            assert {i["name"] for i in inspect(conn).get_indexes("datasets")} >= {"ux_datasets_name"}
            conn.execute(text("INSERT INTO datasets (name, filename, format, num_prompts, "
                              "num_eval, duplicates_dropped, eval_fraction, created_at) VALUES "
                              "('new', 'f.txt', 'txt', 1, 0, 0, 0.0, CURRENT_TIMESTAMP)"))
            new = conn.execute(text("SELECT id FROM datasets WHERE name = 'new'")).scalar()
            assert new == 4  # not 3: job 2 remembers dataset 3
            conn.execute(text(prompt.format(id="", values="", dataset=new)))
            assert conn.execute(text("SELECT max(id) FROM prompts")).scalar() == 3
            # deleting the newest dataset and prompt does not give their ids back
            conn.execute(text("DELETE FROM datasets WHERE id = :i"), {"i": new})
            assert conn.execute(text("SELECT count(*) FROM prompts")).scalar() == 2  # cascade
            conn.execute(text(dataset.replace("({id}, 'd{id}'", "(NULL, 'again'").format()))
            assert conn.execute(text("SELECT max(id) FROM datasets")).scalar() == 5
            conn.execute(text(prompt.format(id="", values="", dataset=5)))
            assert conn.execute(text("SELECT max(id) FROM prompts")).scalar() == 4
            # references are enforced again after the migration
            with pytest.raises(Exception, match="(?i)foreign key"):
                conn.execute(text(prompt.format(id="", values="", dataset=99)))
        engine.dispose()
        downgrade(url, "0010")
        with engine.begin() as conn:
            assert conn.execute(text("SELECT id, dataset_id FROM prompts ORDER BY id")).all() \
                == [(1, 1), (2, 2), (4, 5)]
            assert conn.execute(text("SELECT dataset_id FROM jobs WHERE id = 1")).scalar() == 2
    finally:
        engine.dispose()


def test_the_server_and_workers_see_whether_the_database_is_migrated(tmp_path, monkeypatch):
    """`migrations_current`, which the server and every worker check at start (and warn on):
    False on an empty database, True once `upgrade` has run."""
    from app import db
    from app.config import get_settings
    from app.migrate import migrations_current

    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    # the module's engine goes back to what it was afterwards, for the tests after this one
    monkeypatch.setattr(db, "_engine", db._engine)
    monkeypatch.setattr(db, "_sessionmaker", db._sessionmaker)
    monkeypatch.setenv("DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        db.configure(get_settings())
        assert migrations_current() is False
        upgrade(url)
        assert migrations_current() is True
    finally:
        db.get_engine().dispose()
        get_settings.cache_clear()


def test_a_quiet_upgrade_prints_no_schema_history(tmp_path, capfd):
    """The server's start (app.serve.bootstrap) migrates quietly: a newcomer's first screen
    showed every migration's description and Alembic's plugin lines around the admin token.
    The `migrate` command still says what it ran."""
    import logging

    upgrade(f"sqlite:///{tmp_path / 'loud.db'}")
    loud = capfd.readouterr()
    alembic_log = logging.getLogger("alembic")
    before = alembic_log.level
    assert "Running upgrade" in loud.out + loud.err
    upgrade(f"sqlite:///{tmp_path / 'quiet.db'}", quiet=True)
    quiet = capfd.readouterr()
    assert "Running upgrade" not in quiet.out + quiet.err
    assert "setup plugin" not in quiet.out + quiet.err
    inspector = inspect(create_engine(f"sqlite:///{tmp_path / 'quiet.db'}"))
    assert "votes" in inspector.get_table_names()  # migrated all the same
    assert alembic_log.level == before  # the quiet upgrade put the level back


def test_the_embedded_worker_runs_one_job_at_a_time_and_says_so():
    from app.serve import worker_command

    command = worker_command()
    assert command[command.index("--pool") + 1] == "solo"
    assert command[command.index("--concurrency") + 1] == "1"  # its banner printed the CPUs


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_seed_beyond_32_bits_is_kept_or_the_downgrade_to_0001_refused(backend, tmp_path,
                                                                         request):
    """0002 widens rollout_groups.seed to 64 bits (seeds are drawn in [0, 2**62)). Its
    downgrade on PostgreSQL failed with a bare "integer out of range" on such a seed: it
    now refuses first, naming the revision and why, and changes nothing; SQLite's INTEGER
    holds 64 bits, so there the seed comes back down intact. Small seeds downgrade anywhere."""
    url = _url(backend, tmp_path, request)
    upgrade(url)
    engine = create_engine(url)
    group = ("INSERT INTO rollout_groups (id, iteration, purpose, prompt_text, solver, steps, "
             "sigma, seed, created_at) VALUES ({id}, 0, 'rollout', 'one red circle', 'dpm++', 8, "
             "0.3, {seed}, CURRENT_TIMESTAMP)")
    try:
        with engine.begin() as conn:
            conn.execute(text(group.format(id=1, seed=7)))
            conn.execute(text(group.format(id=2, seed=2**62 - 1)))
        engine.dispose()
        if backend == "postgres":
            with pytest.raises(RuntimeError, match=r"cannot downgrade revision 0002 to 0001: "
                               r"1 rollout group\(s\) have a seed beyond 32 bits"):
                downgrade(url, "0001")
            with engine.connect() as conn:  # nothing changed: still the newest revision
                assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() \
                    != "0001"
                assert conn.execute(text("SELECT seed FROM rollout_groups WHERE id = 2")
                                    ).scalar() == 2**62 - 1
            engine.dispose()
            with engine.begin() as conn:
                conn.execute(text("DELETE FROM rollout_groups WHERE id = 2"))
            engine.dispose()
        downgrade(url, "0001")
        with engine.connect() as conn:
            seeds = dict(conn.execute(text("SELECT id, seed FROM rollout_groups")).all())
        assert seeds == ({1: 7} if backend == "postgres" else {1: 7, 2: 2**62 - 1})
    finally:
        engine.dispose()
