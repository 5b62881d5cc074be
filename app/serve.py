"""`python -m app serve` (what `make demo` runs): everything on one machine, on the embedded
defaults (SQLite under DATA_DIR, the filesystem broker, one worker process, the shipped
shapes model) or on whatever the settings name.

1. migrations; 2. the shapes prompt dataset (all 48 prompts; once); 3. an `admin` user whose
API token is printed once, on the first start; 4. on the first start a rollout job of the
shipped shapes base on the shapes prompts (queued first, so the worker takes it first: pairs to
vote on within a minute), then a "shapes quick demo" training job, so there are curves to
watch; 5. a Celery worker as a
child process; 6. uvicorn. Ctrl-C (or SIGTERM, or SIGHUP: the terminal closed) stops uvicorn,
then the worker (a running training job saves a checkpoint and goes back to the queue; the next
start resumes it), then exits. The worker stops when serve dies however it dies (on Linux), and
serve restarts a worker that exits on its own (WorkerKeeper).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from app.config import Settings
from app.errors import Unavailable
from app.parent_death import die_with_parent
from app.services.jobs import SHAPES_DATASET, Enqueuer

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent


# The demo's first job: base-model rollout groups for the arena. Small enough to finish in
# seconds on a CPU (16 prompts x 8 members of the 32x32 shapes DiT, 8 solver steps), and 28
# pairs a group, 448 in all: a newcomer's first hundred votes.
DEMO_ARENA_ROLLOUT = {"max_prompts": 16, "group_size": 8, "sigma": 0.3, "steps": 8, "seed": 0}


@dataclass
class Bootstrap:
    dataset_id: int
    admin_token: str | None  # only on the start that created the admin
    demo_job_id: int | None
    arena_job_id: int | None = None


def bootstrap(demo_job: bool = True, enqueuer: Enqueuer | None = None) -> Bootstrap:
    """Migrate, seed the shapes dataset and the admin, and on the first start launch the
    arena's base-model rollout job, then the demo training job (each once). Each launch
    commits and enqueues before the next, so the worker (one message at a time, in order)
    takes the rollouts first."""
    from app.db import session_scope
    from app.migrate import upgrade
    from app.models import Job, User
    from app.services import auth, jobs

    upgrade(quiet=True)
    token = job_id = arena_id = None
    with session_scope() as s:
        ds_id = jobs.ensure_shapes_dataset(s)
        if s.scalar(select(User.id).where(User.role == "admin").limit(1)) is None:
            _, token = auth.create_user(s, "admin", "admin")
        if demo_job and not s.scalar(select(func.count()).select_from(Job)):
            if enqueuer is None:
                from app.queue import enqueue as enqueuer
            try:
                arena_id = jobs.launch_job(s, enqueuer, "rollout",
                                           {"dataset_id": ds_id, **DEMO_ARENA_ROLLOUT}).id
                job_id = jobs.launch_job(s, enqueuer, "train", preset="shapes-quick-demo").id
            except Unavailable as exc:
                # the server still starts (the UI, the API); the next start, with no jobs yet,
                # queues them again
                log.warning("the demo jobs were not queued: %s", exc.message)
    return Bootstrap(ds_id, token, job_id, arena_id)


def worker_command(name: str = "local") -> list[str]:
    """The embedded worker: one process that takes every kind's queue (the registry's)."""
    from app.job_kinds import QUEUE_NAMES

    return [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
            # solo runs one job at a time; --concurrency 1 makes its banner say so (it printed
            # the CPU count)
            "-Q", ",".join(QUEUE_NAMES), "--pool", "solo", "--concurrency", "1",
            "-n", f"{name}@%h", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-l", "INFO"]


def stop_process(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (Celery's warm shutdown: the job ends its iteration at a checkpoint), then
    SIGKILL if it does not leave in time, or at once on a second Ctrl-C (the job goes back to
    the queue at its newest checkpoint at the next start, as after a crash)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third press must not cut this short
        print("stopping the worker at once (its job continues from its newest checkpoint at "
              "the next start) ...", flush=True)
        proc.kill()
        proc.wait()


def _how_it_ended(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


# a worker that exits on its own is restarted, at most this many times in a row: one that ran
# for WORKER_STABLE_SECONDS starts the count afresh
WORKER_RESTARTS = 3
WORKER_STABLE_SECONDS = 60.0


class WorkerKeeper:
    """serve's embedded worker, looked after. Started in a session of its own (Ctrl-C reaches
    serve only, which stops it after uvicorn) and told by the kernel to stop when serve dies
    (app.parent_death). A thread waits on it: when it exits and nobody called stop(), one line
    says so and a new worker starts, up to `restarts` times in a row; then `on_give_up` runs
    (serve: stop the server, exit 1). Killed, it had gone unnoticed: serve served jobs that
    nobody would run."""

    def __init__(self, command: list[str], *, restarts: int = WORKER_RESTARTS,
                 stable_seconds: float = WORKER_STABLE_SECONDS,
                 on_give_up: Callable[[], None] | None = None) -> None:
        self.command = command
        self.restarts = restarts
        self.stable_seconds = stable_seconds
        self.on_give_up = on_give_up or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self.proc: subprocess.Popen | None = None
        self.gave_up = False
        self._started = 0.0
        self._stopping = False
        self._lock = threading.Lock()

    def _spawn(self) -> subprocess.Popen:
        self._started = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=ROOT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=die_with_parent(os.getpid()))
        return self.proc

    def start(self) -> subprocess.Popen:
        proc = self._spawn()
        # one thread for all the restarts, alive until its worker has exited: the kernel's
        # parent-death signal follows the thread that started a child, not the process
        threading.Thread(target=self._watch, name="worker-keeper", daemon=True).start()
        return proc

    def _watch(self) -> None:
        in_a_row = 0
        while True:
            proc = self.proc
            assert proc is not None
            code = proc.wait()
            with self._lock:
                if self._stopping:
                    return
                if time.monotonic() - self._started >= self.stable_seconds:
                    in_a_row = 0
                if in_a_row >= self.restarts:
                    self.gave_up = True
                    log.error("the worker (pid %d) exited unexpectedly (%s), %d times in a row: "
                              "not restarting it; stopping the server", proc.pid,
                              _how_it_ended(code), in_a_row + 1)
                    break
                in_a_row += 1
                new = self._spawn()
                log.error("the worker (pid %d) exited unexpectedly (%s); restarted it as pid %d "
                          "(restart %d of %d in a row)", proc.pid, _how_it_ended(code), new.pid,
                          in_a_row, self.restarts)
        self.on_give_up()

    def stop(self) -> None:
        """Stop the worker (stop_process) and let it go: no restart."""
        with self._lock:
            self._stopping = True
            proc = self.proc
        if proc is not None:
            stop_process(proc)


# how long a stopping server lets open requests finish before it closes them
GRACEFUL_SHUTDOWN_SECONDS = 5


class _QuietCancelledStreams(logging.Filter):
    """Drop uvicorn's "Exception in ASGI application" for a request cancelled because the
    server is stopping (an open tab's event stream past GRACEFUL_SHUTDOWN_SECONDS): that is
    the shutdown working, and its traceback read like a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


class _RedactSessionIds(logging.Filter):
    """Write Gradio's session ids in the access log as `...` (`session_hash=...`,
    `/heartbeat/...`, `/stream/.../`): a UI session's events are named by it, so a log
    reader must not learn it (app/ui/sessions.py also binds a logged-in session to its
    browser's cookie, so that the id alone acts for no one)."""

    PATTERN = re.compile(r"(session_hash=|/heartbeat/|/stream/)[^&\s/?]+")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) >= 3 and \
                isinstance(record.args[2], str):
            args = list(record.args)
            args[2] = self.PATTERN.sub(r"\1...", args[2])
            record.args = tuple(args)
        return True


def settings_banner(settings: Settings) -> list[str]:
    """serve's first lines: where its data, database and broker are, with no password (a
    terminal's scrollback and a service's log keep them): the database's credentials are left
    out, the broker's password written as ** (kombu's own masking, as Celery's banner does)."""
    from kombu.utils.url import maybe_sanitize_url

    broker = (maybe_sanitize_url(settings.broker_url) if settings.broker_url
              else "embedded (filesystem, under DATA_DIR/broker)")
    return [f"data directory: {Path(settings.data_dir).resolve()}",
            f"database:       {settings.resolved_database_url.split('@')[-1]}",
            f"broker:         {broker}"]


def serve(host: str = "127.0.0.1", port: int = 8000, worker: bool = True,
          demo_job: bool = True) -> int:
    import uvicorn

    from app.config import get_settings

    for line in settings_banner(get_settings()):
        print(line)
    info = bootstrap(demo_job=demo_job)
    print(f"dataset:        '{SHAPES_DATASET}' (id {info.dataset_id}), the 48 shapes prompts")
    if info.admin_token:
        print("admin API token (shown once, store it now):")
        print(f"    {info.admin_token}")
    else:
        print("admin user exists (its token was shown on the first start; "
              "`python -m app create-user NAME --role admin` makes another)")
    if info.arena_job_id:
        print(f"arena:          rollout job {info.arena_job_id} (base model, "
              f"{DEMO_ARENA_ROLLOUT['max_prompts']} prompts) queued first: pairs to vote on "
              "within a minute")
    if info.demo_job_id:
        print(f"demo job:       train job {info.demo_job_id} (shapes-quick-demo) queued")
    keeper = None
    if worker:
        keeper = WorkerKeeper(worker_command())
        print(f"worker:         pid {keeper.start().pid} (queues gpu, cpu)")
    base = f"http://{host}:{port}"
    print(f"UI:             {base}/ui    API docs: {base}/docs    (Ctrl-C stops everything)",
          flush=True)
    def stop_on_sigterm(signum, frame):
        # uvicorn re-raises the signal after its own shutdown; SIGTERM's default action would
        # kill us before the `finally` below stops the worker (an orphan), so make it Ctrl-C.
        raise KeyboardInterrupt

    def stop_on_sighup(signum, frame):
        # the terminal closed: stop as on SIGTERM (uvicorn's handler while it runs, then ours);
        # SIGHUP's default action killed serve at once and left the worker running
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    signal.signal(signal.SIGHUP, stop_on_sighup)
    logging.getLogger("uvicorn.error").addFilter(_QuietCancelledStreams())
    logging.getLogger("uvicorn.access").addFilter(_RedactSessionIds())
    try:
        # an open UI tab holds event streams that never end on their own: without a bound,
        # a SIGTERM (docker stop, systemd) waited on them forever at "Waiting for connections
        # to close", and the worker ran on
        config = uvicorn.Config("app.main:create_app", factory=True, host=host, port=port,
                                log_level="info",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C after its own clean shutdown
        pass
    finally:
        if keeper is not None:
            _say("stopping the worker ...")
            keeper.stop()
        _say("stopped.")
    return 1 if keeper is not None and keeper.gave_up else 0


def _say(line: str) -> None:
    # the terminal may be gone (SIGHUP): stopping the worker matters, not the line
    with contextlib.suppress(OSError):
        print(line, flush=True)
