"""The database or the broker away for a while, seen from a worker's background loops.

An outage is not a bug: the heartbeat and the reaper keep trying, and a job it interrupted is
requeued by a reaper once its heartbeat has gone stale. So each loop logs one line naming the
cause when the outage begins and one when it ends, instead of a traceback every round (a
reaper every `REAPER_INTERVAL_SECONDS`, a heartbeat every `JOB_HEARTBEAT_SECONDS`, for as long
as the database is down). Any other error keeps its traceback: that one is a bug to find.
"""

from __future__ import annotations

import logging

from app.db import database_unreachable
from app.queue import broker_unreachable


def outage(exc: BaseException) -> str | None:
    """One line naming the service that cannot be reached and why, or None for other errors
    (an error raised `from` such an outage counts: the outage is its cause)."""
    seen: BaseException | None = exc
    while seen is not None:
        reason = database_unreachable(seen) or broker_unreachable(seen)
        if reason is not None:
            return reason
        seen = seen.__cause__
    return None


class OutageLog:
    """Logs a loop's failures: an outage once when it begins (its first cause: a connection
    dropped, then refused, is one outage) and once when the loop next succeeds; any other
    error with its traceback, every time."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log = log
        self.what = what
        self.current: str | None = None

    def failed(self, exc: BaseException, retry: str) -> None:
        reason = outage(exc)
        if reason is None:
            self.log.exception("%s failed", self.what)
            return
        if self.current is None:
            self.log.warning("%s: %s; %s", self.what, reason, retry)
        self.current = reason

    def succeeded(self) -> None:
        if self.current is not None:
            self.log.info("%s: working again", self.what)
        self.current = None
