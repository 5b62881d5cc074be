"""Crash recovery and concurrency with real worker processes: kill -9 mid-run, then the reaper
resumes the job from its newest checkpoint and every iteration is recorded once; a job that
keeps losing its worker ends failed with the reason; two workers on one queue never run the
same job twice, even with duplicate messages."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from worker_helpers import (
    checkpoint_iterations,
    create_train_job,
    groups_per_iteration,
    job_row,
    metric_iterations,
    wait_for,
)


def _status(job_id: int, *statuses: str):
    job = job_row(job_id)
    return job if job.status in statuses else None


def _waiting(job_id: int) -> str:
    """What the job's page says it waits for ("" for nothing)."""
    from app.db import session_scope
    from app.services import jobs, workers

    with session_scope() as s:
        return workers.waiting_for(s, [jobs.get_job(s, job_id)]).get(job_id, "")


def _holding() -> list[str | None]:
    """Why each live worker takes no job for now (None: it takes jobs)."""
    from app.db import session_scope
    from app.services import workers

    with session_scope() as s:
        return [w.holding for w in workers.live(s)]


def _kill9(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("stack", ["sqlite-fs", "postgres-redis"], indirect=True)
def test_kill9_then_the_reaper_resumes_and_each_iteration_is_recorded_once(stack):
    first = stack.start_worker("first")
    total = 16
    job_id = create_train_job(iterations=total, sample_every=1, checkpoint_every=4)
    stack.send(job_id)
    wait_for(lambda: job_row(job_id).iteration >= 6, 90, "six iterations", stack)
    _kill9(first)
    killed_at = job_row(job_id)
    assert killed_at.status == "running"  # nobody has noticed yet
    recorded_before = metric_iterations(job_id)
    assert recorded_before == list(range(1, killed_at.iteration + 1))  # nothing lost

    stack.start_worker("second")  # its reaper finds the stale heartbeat and requeues
    job = wait_for(lambda: _status(job_id, "succeeded", "failed", "cancelled"), 120,
                   "the resumed job", stack)
    assert job.status == "succeeded", job.error
    assert job.attempts == 2
    assert job.error is None  # the requeue's reason went when the second worker took it
    assert metric_iterations(job_id) == list(range(1, total + 1))
    assert checkpoint_iterations(job_id) == list(range(4, total + 1, 4))
    # iterations redone after the checkpoint drew the same prompts and seeds: no duplicates
    assert groups_per_iteration(job_id) == {it: 2 for it in range(1, total + 1)}
    assert "stale heartbeat -> queued" in stack.logs[1].read_text()


@pytest.mark.slow
def test_a_job_that_keeps_losing_its_worker_ends_failed_with_the_reason(stack):
    job_id = create_train_job(iterations=400, sample_every=1000, checkpoint_every=2)
    for attempt in (1, 2):
        worker = stack.start_worker(f"doomed{attempt}",
                                    extra_env={"JOB_MAX_ATTEMPTS": "2"})
        if attempt == 1:
            stack.send(job_id)
        wait_for(lambda a=attempt: (j := job_row(job_id)).status == "running"
                 and j.attempts == a and j.iteration >= 1, 90, f"attempt {attempt}", stack)
        _kill9(worker)
    stack.start_worker("reaper", extra_env={"JOB_MAX_ATTEMPTS": "2"})
    job = wait_for(lambda: _status(job_id, "failed"), 60, "the job to fail", stack)
    assert "stopped heartbeating" in job.error and "gave up after 2 attempt" in job.error
    assert job.finished_at is not None


@pytest.mark.parametrize("stack", ["sqlite-fs"], indirect=True)
def test_a_workers_own_shutdown_does_not_count_against_max_attempts(stack):
    """JOB_MAX_ATTEMPTS=2: a SIGTERM'd worker hands the job back without spending an attempt,
    so the kill -9 of the next run is the first lost worker: the reaper requeues the job
    instead of failing it, and a third worker takes it."""
    env = {"JOB_MAX_ATTEMPTS": "2"}
    job_id = create_train_job(iterations=400, sample_every=1000, checkpoint_every=2)
    polite = stack.start_worker("polite", extra_env=env)
    stack.send(job_id)
    wait_for(lambda: (j := job_row(job_id)).status == "running" and j.iteration >= 1, 90,
             "the first run", stack)
    os.kill(polite.pid, signal.SIGTERM)
    requeued = wait_for(lambda: (j := job_row(job_id)).status == "queued" and j, 60,
                        "the requeue", stack)
    assert requeued.attempts == 0 and "shut down at iteration" in requeued.error
    assert polite.wait(timeout=60) == 0
    doomed = stack.start_worker("doomed", extra_env=env)
    wait_for(lambda: (j := job_row(job_id)).status == "running" and j.attempts == 1
             and j.error is None and j.iteration > requeued.iteration, 90, "the second run",
             stack)
    _kill9(doomed)
    stack.start_worker("third", extra_env=env)
    job = wait_for(lambda: j if (j := job_row(job_id)).status in ("failed", "succeeded")
                   or (j.status == "running" and j.attempts == 2) else None, 90,
                   "the third run", stack)
    assert job.status == "running" and job.attempts == 2, job.error


@pytest.mark.parametrize("stack", ["postgres-redis", "sqlite-fs"], indirect=True)
def test_two_workers_on_one_queue_never_run_the_same_job_twice(stack):
    a = stack.start_worker("a", queues="gpu", wait=False)
    b = stack.start_worker("b", queues="gpu", wait=False)
    stack.wait_log(stack.logs[0], "ready.", a)
    stack.wait_log(stack.logs[1], "ready.", b)
    ids = [create_train_job(iterations=3, sample_every=3, checkpoint_every=3) for _ in range(4)]
    for job_id in ids:  # every job twice: duplicates must be harmless
        stack.send(job_id)
        stack.send(job_id)
    for job_id in ids:
        job = wait_for(lambda j=job_id: _status(j, "succeeded", "failed"), 120, f"job {job_id}", stack)
        assert job.status == "succeeded", job.error
    time.sleep(1.0)  # let the duplicate messages drain
    ran = {name: log.read_text() for name, log in zip("ab", stack.logs, strict=True)}
    for job_id in ids:
        job = job_row(job_id)
        assert job.attempts == 1, f"job {job_id} was claimed {job.attempts} times"
        assert metric_iterations(job_id) == [1, 2, 3]
        assert checkpoint_iterations(job_id) == [3]
    assert all("worker.tasks.train" in text for text in ran.values()), "both workers worked"


def test_a_worker_that_could_run_no_job_refuses_to_start(stack, tmp_path):
    """No database, a storage directory it cannot write, a queue no job is sent to: the
    worker exits at start naming each setting, before it takes (and loses) a message; a
    queued job stays for a worker that can run it, which then does."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    missing_db = "postgresql+psycopg://postgres@127.0.0.1:5432/ngrpo_no_such_database"
    job_id = create_train_job(iterations=2, sample_every=2, checkpoint_every=2)
    stack.send(job_id)
    for name, queues, env, expected in [
        ("bad-queue", "gpu,gpux", {}, "-Q: no job is sent to queue(s) ['gpux']"),
        ("bad-storage", "gpu", {"STORAGE_DIR": str(blocked)}, f"STORAGE_DIR: {blocked}"),
        ("bad-db", "gpu", {"DATABASE_URL": missing_db}, "DATABASE_URL: the database cannot"),
    ]:
        proc = stack.start_worker(name, queues=queues, extra_env=env, wait=False)
        assert proc.wait(timeout=90) == 1, stack.log_text()
        text = stack.logs[-1].read_text(errors="replace")
        assert f"worker not started: {expected}" in text, text
        assert "ready." not in text
    # a setting out of its range stops the worker as it loads, one line and no traceback
    proc = stack.start_worker("bad-setting", queues="gpu", wait=False,
                              extra_env={"TRAIN_NPROC": "0", "JOB_MAX_ATTEMPTS": "0"})
    assert proc.wait(timeout=90) == 1, stack.log_text()
    text = stack.logs[-1].read_text(errors="replace")
    assert ("error: JOB_MAX_ATTEMPTS: Input should be greater than or equal to 1; TRAIN_NPROC: "
            "Input should be greater than or equal to 1") in text, text
    assert "Traceback" not in text and "ready." not in text
    assert job_row(job_id).status == "queued"  # its message is still in the queue
    stack.start_worker("good", queues="gpu")
    job = wait_for(lambda: _status(job_id, "succeeded", "failed"), 90, "the job", stack)
    assert job.status == "succeeded", job.error


class _TcpProxy:
    """A TCP relay to PostgreSQL that can be cut (the listener and every open connection
    closed, as when the database host goes away) and restored on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        import socket

        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._sockets: list = []
        self._listener = None

    def start(self) -> None:
        import socket
        import threading

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.close()

    def cut(self) -> None:
        import socket

        with contextlib.suppress(OSError):  # wakes the accept() blocked on it (Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self._sockets.clear()


@pytest.mark.parametrize("stack", ["postgres-fs"], indirect=True)
def test_a_database_outage_loses_no_job_and_logs_one_line_not_tracebacks(stack):
    """The database goes away under a worker mid-job, and a job's message arrives meanwhile.
    The running job is interrupted and requeued by the reaper once the database is back; the
    message that came during the outage is not dropped (it went back to the queue); and the
    worker logs the outage in single lines naming DATABASE_URL, not a traceback each
    heartbeat, reaper round and job (before: the new job stayed queued for ever, and every
    round logged a traceback)."""
    from sqlalchemy.engine import make_url

    url = make_url(stack.env["DATABASE_URL"])
    proxy = _TcpProxy((url.host, url.port or 5432))
    proxy.start()
    try:
        worker = stack.start_worker("outage", extra_env={
            "DATABASE_URL": url.set(host="127.0.0.1", port=proxy.port)
                               .render_as_string(hide_password=False)})
        first = create_train_job(iterations=40, sample_every=1000, checkpoint_every=2)
        stack.send(first)
        wait_for(lambda: job_row(first).iteration >= 3, 90, "the first job to run", stack)
        proxy.cut()
        second = create_train_job(iterations=2, sample_every=1000, checkpoint_every=2)
        stack.send(second)  # taken by the worker while it cannot reach the database
        stack.wait_log(stack.logs[0], f"job {second} not started", worker, timeout=60)
        time.sleep(4)  # several heartbeats and reaper rounds into the outage
        proxy.start()
        for job_id in (first, second):
            job = wait_for(lambda j=job_id: _status(j, "succeeded", "failed", "cancelled"), 180,
                           f"job {job_id} after the outage", stack)
            assert job.status == "succeeded", job.error
        assert job_row(first).attempts == 2  # the interrupted run, then the resumed one
        assert metric_iterations(first) == list(range(1, 41))
        # read before the cut below, which the reaper's next round would log as an outage
        text = stack.logs[0].read_text(errors="replace")
    finally:
        proxy.cut()
    assert "Traceback" not in text, text[-6000:]
    assert "raised unexpected" not in text, text[-6000:]
    assert "the database (DATABASE_URL) cannot be reached" in text
    # the reaper says it once for the outage, however many rounds it lasts
    assert text.count("reaper round: the database (DATABASE_URL) cannot be reached") == 1, text
    assert "reaper round: working again" in text


@pytest.mark.parametrize("stack", ["sqlite-redis"], indirect=True)
def test_a_requeue_the_broker_could_not_take_is_sent_once_it_is_back(stack):
    """The reaper requeues a lost job while the worker cannot reach Redis: the requeue is
    committed but its message cannot be sent. The reaper sends it again every round until
    the broker is back, and the job runs (before: it stayed queued, with no message, for
    ever, and the round logged a traceback)."""
    from datetime import timedelta

    from sqlalchemy import update
    from sqlalchemy.engine import make_url

    from app.db import session_scope
    from app.models import Job, utcnow
    from app.services import jobs

    url = make_url(stack.env["BROKER_URL"])
    proxy = _TcpProxy((url.host, url.port or 6379))
    proxy.start()
    try:
        worker = stack.start_worker("reaper", extra_env={
            "BROKER_URL": f"redis://127.0.0.1:{proxy.port}/{url.database or 0}"})
        job_id = create_train_job(iterations=2, sample_every=2, checkpoint_every=2)
        proxy.cut()
        with session_scope() as s:  # a worker that died holding it, long ago
            jobs.mark_running(s, job_id, "ghost:1:dead")
            s.execute(update(Job).where(Job.id == job_id).values(
                heartbeat_at=utcnow() - timedelta(hours=1)))
        stack.wait_log(stack.logs[0], f"reaper: job {job_id} (train) had a stale heartbeat",
                       worker)
        stack.wait_log(stack.logs[0], "reaper round: the job queue (BROKER_URL) cannot be "
                       "reached", worker)
        assert job_row(job_id).status == "queued"
        proxy.start()
        job = wait_for(lambda: _status(job_id, "succeeded", "failed"), 120, "the requeued job",
                       stack)
        assert job.status == "succeeded", job.error
    finally:
        proxy.cut()
    text = stack.logs[0].read_text(errors="replace")
    assert "reaper round failed" not in text, text[-6000:]


@contextlib.contextmanager
def _unwritable(directory):
    """`directory` and everything under it cannot be written while inside: a read-only bind
    mount as root (root writes through any mode bits), else mode 0555 on every directory."""
    import shutil
    import subprocess

    if os.geteuid() == 0:
        mount = shutil.which("mount")
        if mount is None or subprocess.run([mount, "--bind", str(directory), str(directory)],
                                           capture_output=True).returncode:
            pytest.skip("running as root without mount privileges: nothing makes a "
                        "directory unwritable for root")
        try:
            subprocess.run([mount, "-o", "remount,bind,ro", str(directory)], check=True)
            yield
        finally:
            subprocess.run([shutil.which("umount") or "umount", str(directory)], check=True)
        return
    dirs = [directory, *(p for p in directory.rglob("*") if p.is_dir())]
    for d in dirs:
        d.chmod(0o555)
    try:
        yield
    finally:
        for d in dirs:
            d.chmod(0o755)


@pytest.mark.parametrize("stack", ["postgres-redis"], indirect=True)
def test_an_unwritable_storage_dir_requeues_the_job_and_holds_the_worker(stack):
    """The storage turning read-only under a running worker is an outage, not the job's fault:
    one line naming STORAGE_DIR and why, the job requeued with its attempt given back, no job
    taken until the storage can be written again; then the job resumes and finishes."""
    worker = stack.start_worker()
    job_id = create_train_job(iterations=40, prompts_per_iteration=2, checkpoint_every=2,
                              sample_every=1000)
    stack.send(job_id)
    wait_for(lambda: job_row(job_id).iteration >= 2, 60, "two iterations", stack)
    storage = stack.tmp / "storage"
    with _unwritable(storage):
        job = wait_for(lambda: _status(job_id, "queued", "failed", "succeeded"), 60,
                       "the job to leave running", stack)
        assert job.status == "queued", job.error
        assert job.error.startswith(f"STORAGE_DIR {storage} could not be written"), job.error
        assert job.attempts == 0  # given back: an outage is no lost run
        time.sleep(3)  # the requeued message is there: the held worker does not take it
        assert job_row(job_id).status == "queued"
        log = stack.logs[0].read_text(errors="replace")
        lines = [line for line in log.splitlines() if "cannot be written" in line]
        assert len(lines) == 1 and f"STORAGE_DIR {storage}" in lines[0], log
        assert "Traceback" not in log
        # the job's page says why nothing takes it (it said nothing: a queued job with a
        # live, idle-looking worker), as would any other job queued meanwhile
        said = wait_for(lambda: "takes no job for now" in (w := _waiting(job_id)) and w, 30,
                        "the hold on the job's page", stack)
        assert f"STORAGE_DIR {storage} cannot be written" in said, said
    job = wait_for(lambda: _status(job_id, "succeeded", "failed"), 120, "the resumed job", stack)
    assert job.status == "succeeded", job.error
    assert _holding() == [None]  # taking jobs again: the row says so
    assert metric_iterations(job_id) == list(range(1, 41))
    assert "can be written again" in stack.logs[0].read_text(errors="replace")
    assert worker.poll() is None


@pytest.mark.parametrize("stack", ["sqlite-redis"], indirect=True)
def test_a_queued_job_whose_message_redis_lost_runs_once_a_worker_has_idled(stack):
    """Redis keeps nothing on disk: restarted while a job was queued, it lost the job's
    message, and the job stayed queued for ever beside an idle worker. Now a worker that has
    run nothing for JOB_STALE_SECONDS (5 s here) while the job was queued sends the message
    again from its reaper round, says why in one line, and the job runs."""
    import redis

    job_id = create_train_job(iterations=1, sample_every=1, checkpoint_every=1)
    stack.send(job_id)
    client = redis.Redis.from_url(stack.env["BROKER_URL"])
    try:  # the restart: every key of this deployment gone, the message with them
        keys = list(client.scan_iter(match=f"{stack.env['BROKER_KEY_PREFIX']}*"))
        assert keys, "the message never reached Redis"
        client.delete(*keys)
    finally:
        client.close()
    worker = stack.start_worker("idle")
    job = wait_for(lambda: _status(job_id, "succeeded", "failed"), 90, "the lost job", stack)
    assert job.status == "succeeded", job.error
    stack.wait_log(stack.logs[0], f"reaper: job {job_id} (train) has been queued for over 5 s "
                   "while worker idle@", worker)
    assert "its message was lost" in stack.logs[0].read_text(errors="replace")


@contextlib.contextmanager
def _small_filesystem(directory, megabytes: int):
    """`directory` on a file system of its own of `megabytes` (a tmpfs: as root alone), so
    that a job's checkpoints fill it as they would a full disk."""
    import shutil
    import subprocess

    mount = shutil.which("mount")
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or mount is None or subprocess.run(
            [mount, "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(directory)],
            capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root with mount privileges")
    try:
        yield
    finally:
        subprocess.run([shutil.which("umount") or "umount", "-l", str(directory)], check=True)


@pytest.mark.parametrize("stack", ["postgres-redis"], indirect=True)
def test_a_full_disk_requeues_the_job_and_holds_the_worker_until_room_is_freed(stack):
    """The disk fills while a checkpoint is written (safetensors reports ENOSPC as a
    SafetensorError, not an OSError): the job was failed with that traceback. Now it is a
    storage outage as a read-only one is: the half-written checkpoint removed, the job
    requeued with its attempt given back, and the worker holds until more room is free than
    when it failed (a 64 KiB probe still fits on a disk the next checkpoint does not: it took
    the job again at once, over and over); then the job resumes and finishes."""
    storage = stack.tmp / "storage"
    with _small_filesystem(storage, 50):  # a tiny run's checkpoint: 22 MB; two fit
        stack.start_worker()
        job_id = create_train_job(iterations=3, checkpoint_every=1, sample_every=1000)
        stack.send(job_id)
        wait_for(lambda: job_row(job_id).iteration >= 1, 90, "an iteration", stack)
        job = wait_for(lambda: _status(job_id, "queued", "failed", "succeeded"), 90,
                       "the job to leave running", stack)
        assert job.status == "queued", job.error
        assert job.error.startswith(f"STORAGE_DIR {storage} could not be written (No space "
                                    "left on device)"), job.error
        assert job.attempts == 0
        checkpoints = storage / "checkpoints" / f"job-{job_id}"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["iter-000001",
                                                                  "iter-000002"]
        time.sleep(4)  # the worker holds: it does not take the job again on a full disk
        assert job_row(job_id).status == "queued"
        log = stack.logs[0].read_text(errors="replace")
        assert len([line for line in log.splitlines() if "cannot be written" in line]) == 1, log
        assert "Traceback" not in log
        import shutil

        shutil.rmtree(checkpoints / "iter-000001")  # room for one more
        job = wait_for(lambda: _status(job_id, "succeeded", "failed"), 90, "the resumed job",
                       stack)
        assert job.status == "succeeded", job.error
        assert metric_iterations(job_id) == [1, 2, 3]
        assert "can be written again" in stack.logs[0].read_text(errors="replace")


@pytest.mark.parametrize("stack", ["postgres-redis"], indirect=True)
def test_a_worker_on_another_database_than_the_servers_refuses_to_start(stack, tmp_path):
    """A worker started with another DATA_DIR than the server's and no DATABASE_URL (another
    working directory, a variable not exported) created an empty DATA_DIR/studio.db, started
    "ready", took none of the server's jobs and logged a traceback every reaper round; one
    pointed at a database never migrated did the same. Each now exits at start naming the
    setting, and creates no database."""
    import uuid

    import psycopg
    from conftest import PG_ADMIN, _pg_url

    wrong = tmp_path / "wrong-data"
    stack.env.pop("DATABASE_URL")
    try:
        proc = stack.start_worker("wrong-data-dir", queues="gpu", wait=False,
                                  extra_env={"DATA_DIR": str(wrong)})
        assert proc.wait(timeout=90) == 1, stack.log_text()
    finally:
        stack.env["DATABASE_URL"] = os.environ["DATABASE_URL"]
    text = stack.logs[-1].read_text(errors="replace")
    assert (f"worker not started: DATABASE_URL (unset: DATA_DIR {wrong}/studio.db): there is "
            f"no database at {wrong / 'studio.db'}") in text, text
    assert "ready." not in text and "Traceback" not in text
    assert not (wrong / "studio.db").exists()

    empty = f"ngrpo_wtest_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{empty}"')
    try:
        proc = stack.start_worker("empty-db", queues="gpu", wait=False,
                                  extra_env={"DATABASE_URL": _pg_url(empty)})
        assert proc.wait(timeout=90) == 1, stack.log_text()
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{empty}" WITH (FORCE)')
    text = stack.logs[-1].read_text(errors="replace")
    assert ("worker not started: DATABASE_URL: the database has no tables: it is not the "
            "server's, or was never migrated") in text, text
    assert "ready." not in text and "Traceback" not in text


@pytest.mark.parametrize("stack", ["postgres-redis"], indirect=True)
def test_a_worker_on_another_storage_than_the_servers_says_so_at_start(stack, tmp_path):
    """A worker sharing the database and the broker but started with another STORAGE_DIR (or
    DATA_DIR: a shared volume not mounted) ran its jobs to `succeeded` with every file where
    the server never looks, without a word. It now says so at start, naming STORAGE_DIR and
    a file the database records that it lacks; a worker on the right storage says nothing."""
    first = stack.start_worker("right")
    job_id = create_train_job(iterations=2, sample_every=2, checkpoint_every=2)
    stack.send(job_id)
    job = wait_for(lambda: _status(job_id, "succeeded", "failed"), 90, "the job", stack)
    assert job.status == "succeeded", job.error
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    assert "holds none of the" not in stack.logs[0].read_text(errors="replace")

    other = tmp_path / "other-storage"
    stack.start_worker("elsewhere", extra_env={"STORAGE_DIR": str(other)})
    text = stack.logs[-1].read_text(errors="replace")
    assert f"STORAGE_DIR {other} holds none of the 5 newest files the database records " \
           f"(such as checkpoints/job-{job_id}/iter-000002/model.safetensors)" in text, text
    stack.start_worker("right-again")
    assert "holds none of the" not in stack.logs[-1].read_text(errors="replace")


@pytest.mark.parametrize("stack", ["sqlite-redis"], indirect=True)
def test_a_disk_that_fills_with_rollout_images_requeues_the_job(stack):
    """Python's write to an open file on a full disk raises an OSError that names no file,
    so the storage's images (app.services.storage.write_bytes) failed a rollout job with a
    traceback where a full disk is an outage: now the job is requeued, the worker holds until
    there is room, and the job then stores the rest of its groups."""
    import subprocess

    from app.db import session_scope
    from app.services import datasets, jobs, rollouts
    from trainer.shapes.world import all_prompts

    storage = stack.tmp / "storage"
    with _small_filesystem(storage, 1):
        # a tmpfs page (4 KiB) a PNG: 8 prompts x 4 members do not fit in 64 KiB
        subprocess.run(["mount", "-o", "remount,size=64k", str(storage)], check=True)
        stack.start_worker()
        with session_scope() as s:
            data = ("\n".join(all_prompts()[:8]) + "\n").encode()
            ds = datasets.import_dataset(s, filename="p.txt", data=data).dataset.id
            job_id = jobs.create_job(s, "rollout", {"dataset_id": ds, "group_size": 4,
                                                    "steps": 2}).id
        stack.send(job_id, "rollout")
        wait_for(lambda: job_row(job_id).status == "running", 60, "the job to start", stack)
        job = wait_for(lambda: _status(job_id, "queued", "failed", "succeeded"), 90,
                       "the job to leave running", stack)
        assert job.status == "queued", job.error
        assert job.error.startswith(f"STORAGE_DIR {storage} could not be written (No space "
                                    "left on device)"), job.error
        subprocess.run(["mount", "-o", "remount,size=4m", str(storage)], check=True)
        job = wait_for(lambda: _status(job_id, "succeeded", "failed"), 90, "the resumed job",
                       stack)
        assert job.status == "succeeded", job.error
        with session_scope() as s:
            assert rollouts.list_groups(s, job_id=job_id)[1] == 8
        log = stack.logs[0].read_text(errors="replace")
        assert "Traceback" not in log and "can be written again" in log
