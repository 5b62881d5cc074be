"""`python -m app serve`'s stop: a second Ctrl-C while the worker finishes its iteration (a
warm shutdown that can take a while) printed a KeyboardInterrupt traceback; it now stops the
worker at once."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.serve import WorkerKeeper, stop_process

# a worker that takes its time over a warm shutdown: it ignores SIGTERM
SLOW_TO_STOP = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"


def test_a_second_ctrl_c_while_the_worker_stops_kills_it_without_a_traceback(capsys):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TO_STOP])
    time.sleep(0.5)  # the child's SIGTERM handler in place

    def second_ctrl_c(signum, frame):
        raise KeyboardInterrupt

    before_int, before_alarm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)
    signal.signal(signal.SIGALRM, second_ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    began = time.monotonic()
    try:
        stop_process(proc, timeout=60)  # returns, rather than raising the interrupt
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before_alarm)
        signal.signal(signal.SIGINT, before_int)
        if proc.poll() is None:
            proc.kill()
    assert proc.poll() == -signal.SIGKILL and time.monotonic() - began < 30
    assert "stopping the worker at once" in capsys.readouterr().out


# the embedded worker's stand-in: a process that runs until it is stopped
LONG_RUNNING = [sys.executable, "-c", "import time; time.sleep(120)"]


def _gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts: the reaper may be a container's init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _until(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.mark.subprocess
def test_a_worker_that_dies_is_restarted_with_one_line_and_stop_lets_it_go(caplog):
    keeper = WorkerKeeper(LONG_RUNNING, restarts=3)
    first = keeper.start()
    try:
        first.kill()  # kill -9 of just the worker: serve went on without one, silently
        second = _until(lambda: keeper.proc if keeper.proc is not first else None)
        assert second.poll() is None
        lines = [r.getMessage() for r in caplog.records if "exited unexpectedly" in r.message]
        assert lines == [f"the worker (pid {first.pid}) exited unexpectedly (killed by SIGKILL); "
                         f"restarted it as pid {second.pid} (restart 1 of 3 in a row)"]
    finally:
        keeper.stop()
    assert second.poll() == -signal.SIGTERM and keeper.proc is second and not keeper.gave_up
    time.sleep(0.5)
    assert keeper.proc is second  # a stopped worker is not restarted


@pytest.mark.subprocess
def test_a_worker_that_keeps_dying_is_given_up_loudly(caplog):
    gave_up = threading.Event()
    keeper = WorkerKeeper([sys.executable, "-c", "raise SystemExit(3)"], restarts=2,
                          on_give_up=gave_up.set)
    keeper.start()
    assert gave_up.wait(60) and keeper.gave_up
    lines = [r.getMessage() for r in caplog.records if "exited unexpectedly" in r.message]
    assert len(lines) == 3 and "restart 2 of 2" in lines[1]
    assert "exit code 3), 3 times in a row: not restarting it; stopping the server" in lines[2]
    keeper.stop()


@pytest.mark.subprocess
def test_the_worker_stops_when_serve_is_killed():
    """kill -9 of serve left its worker (a session of its own) training as an orphan, beside
    the worker of the next start."""
    code = ("import sys, time; from app.serve import WorkerKeeper; "
            f"print(WorkerKeeper({LONG_RUNNING!r}).start().pid, flush=True); time.sleep(120)")
    serve = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        worker_pid = int(serve.stdout.readline())
        assert not _gone(worker_pid)
        serve.kill()
        serve.wait()
        _until(lambda: _gone(worker_pid), 15)
    finally:
        if serve.poll() is None:
            serve.kill()
        if not _gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)
