"""`python -m app serve`'s stop: a second Ctrl-C while the worker finishes its iteration (a
warm shutdown that can take a while) printed a KeyboardInterrupt traceback; it now stops the
worker at once."""

import signal
import subprocess
import sys
import time

from app.serve import stop_process

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
