"""Helpers shared by the worker tests (imported as `worker_helpers`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import func, select


def create_train_job(**overrides) -> int:
    from app.db import session_scope
    from app.services import jobs

    with session_scope() as s:
        return jobs.create_job(s, "train", {"device": "cpu", **overrides}, preset="tiny").id


def resume_with_iterations(job_id: int, iterations: int) -> None:
    """Set a stopped job's iteration budget, then resume it as the API does."""
    from app.db import session_scope
    from app.services import jobs

    with session_scope() as s:
        row = jobs.get_job(s, job_id)
        row.config = {**row.config, "iterations": iterations}
        row.total_iterations = iterations
        jobs.resume_job(s, job_id)


def job_row(job_id: int):
    from app.db import session_scope
    from app.services import jobs

    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        s.expunge(job)
        return job


def wait_for(predicate: Callable[[], object], timeout: float, what: str, stack) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{stack.log_text()}")


def metric_iterations(job_id: int) -> list[int]:
    from app.db import session_scope
    from app.models import JobMetric

    with session_scope() as s:
        return list(s.scalars(select(JobMetric.iteration).where(JobMetric.job_id == job_id)
                              .order_by(JobMetric.iteration)))


def checkpoint_iterations(job_id: int) -> list[int]:
    from app.db import session_scope
    from app.models import Checkpoint

    with session_scope() as s:
        return list(s.scalars(select(Checkpoint.iteration).where(Checkpoint.job_id == job_id)
                              .order_by(Checkpoint.iteration)))


def groups_per_iteration(job_id: int) -> dict[int, int]:
    from app.db import session_scope
    from app.models import RolloutGroup

    with session_scope() as s:
        rows = s.execute(select(RolloutGroup.iteration, func.count()).where(
            RolloutGroup.job_id == job_id).group_by(RolloutGroup.iteration))
        return {it: n for it, n in rows}
