"""A child process that stops when the process that started it dies.

serve's embedded worker and a worker's torchrun run in processes of their own; killed with
SIGKILL (kill -9, the OOM killer, a crash), their parent would leave them running as orphans
re-parented to PID 1: a worker training beside the next start's, or torchrun's ranks training
on under a dead worker's lease while its restart takes another job onto the same cards."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A Popen `preexec_fn` that has the kernel send the child SIGTERM when the thread that
    started it ends; `parent` is that process's pid (os.getpid() at the call). SIGTERM, not
    SIGKILL: a Celery worker shuts down warm on it, and torchrun stops its ranks (a SIGKILLed
    torchrun would orphan them). Linux only (prctl PR_SET_PDEATHSIG); elsewhere None, so
    `preexec_fn=die_with_parent(os.getpid())` works on every platform. The starting thread
    must live as long as the parent: serve's main thread, a --pool solo worker's."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    # looked up here, before the fork: between fork and exec only async-signal-safe work
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os._exit(1)

    return preexec
