"""Workers as they report themselves: the queues they consume and the devices they have.

Each worker process calls `report` when it starts and every reaper round (worker/tasks.py),
so `live` is everyone seen within `live_seconds`; a worker that stops cleanly `forget`s
itself. A worker is named by its Celery node name (`-n gpu0@host`); a job it claims names it
too, in the job's `worker` (`lease_name`, read back by `worker_of`). Submission uses the live
ones to reject a config that no live worker could run (`device: "cuda"` where every live
worker of the queue is CPU-only, or a 'fsdp' job whose prompts no live worker's TRAIN_NPROC
splits evenly), and a queued job whose queue has no live worker at all is
accepted but says what it waits for (`waiting_for`): workers may simply not have started yet.
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.config import get_settings
from app.job_kinds import KINDS
from app.limits import HOLDING_LENGTH, NAME_LENGTH
from app.models import Job, JobMetric, JobStatus, WorkerRow, utcnow


def stored_name(worker_name: str) -> str:
    """A worker's name, or a job's lease name, as the workers and jobs tables hold it: cut to
    NAME_LENGTH, so that a long host name still compares equal to what was stored."""
    return worker_name[:NAME_LENGTH]


def lease_name(worker_name: str) -> str:
    """What a job's `worker` says while `worker_name` (the worker's node name, its row here)
    runs it: that name, this process's pid and a nonce that tells apart two claims by one
    process (a lease is held by one claim: app.services.jobs.holds)."""
    return f"{worker_name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def worker_of(lease: str) -> str:
    """The worker's name in a job's `worker` (a `lease_name`): what its workers row is named."""
    return lease.rsplit(":", 2)[0]


def live_seconds() -> float:
    """A worker unseen for longer than this is not counted: three reaper rounds, and never
    less than the time after which its jobs count as stale."""
    s = get_settings()
    return max(3 * s.reaper_interval_seconds, s.job_stale_seconds)


def report(session: Session, name: str, queues: list[str], cuda_devices: int,
           device_names: list[str], holding: str | None = None,
           train_nproc: int = 1) -> WorkerRow:
    """Insert or refresh this worker's row (flush, no commit). `holding`: why it takes no job
    for now (its STORAGE_DIR cannot be written), None when it takes jobs; `train_nproc`: its
    TRAIN_NPROC."""
    row = session.get(WorkerRow, stored_name(name))
    now = utcnow()
    if row is None:
        row = WorkerRow(name=stored_name(name), started_at=now)
        session.add(row)
    row.queues, row.cuda_devices = sorted(set(queues)), int(cuda_devices)
    row.device_names, row.last_seen_at = list(device_names), now
    row.holding = holding[:HOLDING_LENGTH] if holding else None
    row.train_nproc = int(train_nproc)
    session.flush()
    return row


def forget(session: Session, name: str) -> None:
    """Remove this worker's row (flush, no commit): it stopped cleanly, so no queued job
    should count on it, as it would for `live_seconds` after its last report."""
    session.execute(delete(WorkerRow).where(WorkerRow.name == stored_name(name)))
    session.flush()


def live(session: Session) -> list[WorkerRow]:
    cutoff = utcnow() - timedelta(seconds=live_seconds())
    return list(session.scalars(select(WorkerRow).where(WorkerRow.last_seen_at >= cutoff)
                                .order_by(WorkerRow.name)))


def wants_cuda(config: dict[str, Any]) -> bool:
    return config.get("device") == "cuda"


def device_problem(session: Session, kind: str, config: dict[str, Any]) -> str | None:
    """Why no live worker could run this config, when live workers of its queue exist and
    none has what it needs; None when one can, or when none has reported yet (then the job
    waits, see `waiting_for`)."""
    if not wants_cuda(config):
        return None
    queue = KINDS[kind].queue
    on_queue = [w for w in live(session) if queue in w.queues]
    if not on_queue or any(w.cuda_devices > 0 for w in on_queue):
        return None
    names = ", ".join(w.name for w in on_queue[:5])
    return (f"'cuda' but no live worker on queue {queue!r} has a CUDA device (CPU only: "
            f"{names}); use 'auto' or 'cpu', or start a worker on a GPU machine")


def world_problem(session: Session, kind: str, config: dict[str, Any]) -> str | None:
    """Why no live worker could start this 'fsdp' train job: it shards over train_nnodes x
    the holder's TRAIN_NPROC processes, all of them (worker/torchrun.py: fewer would load the
    whole model on each card), and prompts_per_iteration must split evenly over them. None
    when a live worker of its queue (with the device it asks for) reports a TRAIN_NPROC that
    fits, when none has reported (the job waits), and for every other job ('ddp' runs on as
    many processes as split the prompts evenly)."""
    if kind != "train" or config.get("parallelism") != "fsdp":
        return None
    prompts, nnodes = config.get("prompts_per_iteration"), config.get("train_nnodes", 1)
    if not (isinstance(prompts, int) and isinstance(nnodes, int) and prompts > 0 < nnodes):
        return None  # the config's own checks report these
    reported = [w for w in able(session, kind, config) if w.train_nproc is not None]
    if not reported or any(prompts % (nnodes * w.train_nproc) == 0 for w in reported):
        return None
    sizes = ", ".join(f"{w.name} ({w.train_nproc})" for w in reported[:5])
    return (f"must be a multiple of train_nnodes ({nnodes}) x the TRAIN_NPROC of the worker "
            f"that holds the job: 'fsdp' shards over all of its processes, and no live worker "
            f"on queue {KINDS[kind].queue!r} fits {prompts} (TRAIN_NPROC: {sizes}); "
            "use such a multiple, or parallelism 'ddp'")


def able(session: Session, kind: str, config: dict[str, Any],
         workers: list[WorkerRow] | None = None) -> list[WorkerRow]:
    """The live workers (or `workers`) that consume this kind's queue and have the device
    its config asks for."""
    queue, cuda = KINDS[kind].queue, wants_cuda(config)
    return [w for w in (live(session) if workers is None else workers)
            if queue in w.queues and (w.cuda_devices > 0 or not cuda)]


def idle_seconds(session: Session, rows: list[WorkerRow], now: datetime) -> dict[str, float]:
    """For each of `rows` that runs no job now: seconds since it last did, from its start or
    its last job's end, whichever is later (absent: it runs one)."""
    out = {}
    for row in rows:
        held = Job.worker.startswith(f"{row.name}:", autoescape=True)  # its leases
        if session.scalar(select(Job.id).where(held, Job.status == JobStatus.RUNNING)
                          .limit(1)) is not None:
            continue
        ends = [_aware(t) for t in (row.started_at, session.scalar(
            select(func.max(Job.finished_at)).where(held))) if t is not None]
        out[row.name] = (now - max(ends)).total_seconds()
    return out


def _aware(moment: datetime) -> datetime:
    """`moment` with its time zone: SQLite returns naive datetimes, which are UTC here."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def heartbeat_age(job: Job, now: datetime | None = None) -> float | None:
    """Seconds since the job's last heartbeat (None without one)."""
    if job.heartbeat_at is None:
        return None
    return ((now or datetime.now(UTC)) - _aware(job.heartbeat_at)).total_seconds()


def waiting_for(session: Session, jobs: list[Job]) -> dict[int, str]:
    """For queued jobs that no live worker can take (or only workers busy with other jobs),
    multi-host train jobs that fewer live workers than their hosts could start (queued, or
    (re)starting: `starting_on_hosts`), and running jobs whose worker stopped heartbeating (it
    died; a live worker's reaper requeues the job, or cancels it when a cancel was requested):
    job id -> what it waits for."""
    stale_after = get_settings().job_stale_seconds
    lost = {j.id: age for j in jobs if j.status == JobStatus.RUNNING
            and (age := heartbeat_age(j)) is not None and age > stale_after}
    starting = starting_on_hosts(session, jobs)
    waiting = [j for j in jobs if j.status == JobStatus.QUEUED or j.id in lost
               or j.id in starting]
    if not waiting:
        return {}
    workers = live(session)
    # what each live worker is running now: a queued job that only busy workers could take
    # waits behind their jobs (the embedded worker runs one job at a time). A job's `worker`
    # is its lease's name, which begins with its worker's
    names = {w.name for w in workers}
    running: dict[str, list[int]] = {}
    for job_id, lease in session.execute(select(Job.id, Job.worker).where(
            Job.status == JobStatus.RUNNING, Job.worker.is_not(None)).order_by(Job.id)):
        if (name := worker_of(lease)) in names:
            running.setdefault(name, []).append(job_id)
    out = {}
    for job in waiting:
        if job.id in lost:
            out[job.id] = (f"its worker {job.worker or '?'} has not heartbeated for "
                           f"{lost[job.id]:.0f} s (JOB_STALE_SECONDS {stale_after:.0f}): it "
                           "is lost; a live worker's reaper "
                           + ("cancels the job (a cancel was requested)" if job.cancel_requested
                              else "requeues the job")
                           + ("" if workers else ", and no worker is live now: start one"))
            continue
        queue = KINDS[job.kind].queue
        cuda = wants_cuda(job.config or {})
        can = able(session, job.kind, job.config or {}, workers)
        free = [w for w in can if not w.holding]  # the others take no job for now
        need = " with a CUDA device" if cuda else ""
        if not can and job.status == JobStatus.QUEUED:
            out[job.id] = (f"waiting for a worker{need} on queue {queue!r}: none has reported "
                           f"in the last {live_seconds():.0f} s")
        elif len(can) < (hosts := hosts_wanted(job)):
            # one worker a host (worker/torchrun.py); the job starts or fails (after
            # RDZV_JOIN_TIMEOUT) once its holder's rendezvous is over
            out[job.id] = (f"waiting for {hosts} hosts (train_nnodes): {len(can)} live worker(s)"
                           f"{need} on queue {queue!r}; start one on each other host")
        elif job.status == JobStatus.QUEUED and not free:
            # every worker that could take it holds (worker.tasks.wait_for_storage): without
            # this the job sat queued with nothing said, as if it waited for no reason
            out[job.id] = (f"waiting: every live worker{need} on queue {queue!r} takes no job "
                           "for now (" + "; ".join(f"{w.name}: {w.holding}" for w in can)
                           + "); it starts once one takes jobs again")
        elif job.status == JobStatus.QUEUED and (ahead := _ahead_of(job.id, free, running)):
            out[job.id] = (f"queued behind job{'s' if len(ahead) > 1 else ''} "
                           f"{', '.join(f'#{i}' for i in ahead)}: every live worker{need} on "
                           f"queue {queue!r} is running one; it starts when one is free (or "
                           "start another worker)")
    return out


def _ahead_of(job_id: int, can: list[WorkerRow], running: dict[str, list[int]]) -> list[int]:
    """The jobs a queued job waits behind: the first each of `can` runs, when every one runs
    one; else none. Never the job itself: `jobs` was read before `running`, so a job read as
    queued may be running by now (it said it was "queued behind job #6", itself)."""
    ahead = []
    for w in can:
        others = [i for i in running.get(w.name, []) if i != job_id]
        if not others:
            return []
        ahead.append(others[0])
    return sorted(set(ahead))


def starting_on_hosts(session: Session, jobs: list[Job]) -> set[int]:
    """The running multi-host train jobs among `jobs` that have recorded no iteration since
    their claim: the holder's rendezvous may still wait for hosts (worker/torchrun.py), on a
    fresh start or a resume alike (the job then records nothing until every host has joined
    and an iteration is done). One claimed before claims were timed (no `claimed_at`): while
    at iteration 0."""
    multi = [j for j in jobs if j.status == JobStatus.RUNNING and hosts_wanted(j) > 1]
    if not multi:
        return set()
    progressed = set(session.scalars(
        select(JobMetric.job_id).join(Job, Job.id == JobMetric.job_id)
        .where(JobMetric.job_id.in_([j.id for j in multi]),
               JobMetric.created_at >= Job.claimed_at)))
    return {j.id for j in multi if j.id not in progressed
            and (j.claimed_at is not None or j.iteration == 0)}


def gathering_ahead(session: Session, job_id: int) -> Job | None:
    """Another multi-host train job that gathers its hosts (`starting_on_hosts`) and was
    claimed before `job_id` (the lower id on a tie), if any. Two holders that wait for each
    other's hosts at once wait for ever (every worker holds one job and none takes a join): the
    later claim gives way (worker/torchrun.py)."""
    job = session.get(Job, job_id)
    if job is None:
        return None
    running = list(session.scalars(select(Job).where(
        Job.status == JobStatus.RUNNING, Job.kind == "train", Job.id != job_id)))
    gathering = starting_on_hosts(session, running)
    epoch = datetime.min.replace(tzinfo=UTC)

    def order(j: Job) -> tuple[datetime, int]:
        return (_aware(j.claimed_at) if j.claimed_at else epoch, j.id)

    ahead = [j for j in running if j.id in gathering and order(j) < order(job)]
    return min(ahead, key=order) if ahead else None


def hosts_wanted(job: Job) -> int:
    """How many hosts a job runs on: a train job's train_nnodes, else one."""
    nnodes = (job.config or {}).get("train_nnodes", 1) if job.kind == "train" else 1
    return nnodes if isinstance(nnodes, int) and not isinstance(nnodes, bool) else 1
