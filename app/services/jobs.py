"""Jobs: validate and launch (API side), and the state transitions workers record.

Lifecycle: queued -> running -> succeeded | failed | cancelled; resume puts a failed or
cancelled job back to queued. Cancel is cooperative: `request_cancel` sets a flag that the
worker reads (`is_cancel_requested`, or the return value of `heartbeat`/`update_progress`)
between iterations, then calls `mark_cancelled`. A queued job is cancelled at once.

Worker usage (each call in its own short transaction):

    from app.db import session_scope
    from app.services import jobs
    with session_scope() as s:
        job = jobs.mark_running(s, job_id, worker_name)
    ...
    with session_scope() as s:
        stop = jobs.update_progress(s, job_id, it, total, {"reward_mean": 0.4})

Workers that may race (two workers on one queue, a redelivered message, a reaper) use
`claim` instead of `mark_running`: an atomic compare-and-set that only one of them wins, and
`holds` to check each iteration that the job is still theirs. `reap_stale` is the reaper's
half: a running job whose heartbeat is stale goes back to the queue (or to failed/cancelled).

Enqueueing happens after the commit, through a replaceable enqueuer: `create_app(enqueuer=...)`
(or `app.state.enqueuer`) in the API; the default sends a Celery task named
`worker.tasks.<kind>` with args [job_id] to the kind's queue.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from app.config import get_settings
from app.errors import Conflict, Invalid, NotFound
from app.models import JOB_KINDS, Checkpoint, Dataset, Job, JobMetric, User, utcnow
from app.services import storage, workers
from app.services.workers import QUEUES

log = logging.getLogger(__name__)

TERMINAL = ("succeeded", "failed", "cancelled")

Enqueuer = Callable[[int, str], None]
MAX_ID = 2**31 - 1


# --- configs of the non-train kinds --------------------------------------------------------
class _Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutConfig(_Cfg):
    """Sample groups for a dataset's prompts from a checkpoint and store them for voting."""

    dataset_id: int = Field(ge=1, le=MAX_ID, description="Dataset whose prompts are sampled.")
    checkpoint_id: int | None = Field(None, ge=1, le=MAX_ID,
                                      description="Checkpoint to sample; none = base model.")
    split: Literal["train", "eval", "all"] = "train"
    max_prompts: int | None = Field(None, ge=1, le=100_000)
    group_size: int = Field(8, ge=2, le=256, description="Samples per group (G).")
    sigma: float = Field(0.3, ge=0.0, le=1.0, description="Neighbourhood radius of the noises.")
    solver: Literal["dpm++", "euler"] = "dpm++"
    steps: int = Field(8, ge=2, le=1000)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    model: Literal["shapes"] = Field("shapes", description="Model adapter of the checkpoint.")
    reward_names: list[str] = Field(default_factory=list, max_length=32,
                                    description="Rewards scored on each sample (registry "
                                    "names); empty: count, color and shape.")


class EvaluateConfig(_Cfg):
    """Fixed prompts and seeds from checkpoints; images feed cross-checkpoint votes."""

    checkpoint_ids: list[Annotated[int, Field(ge=1, le=MAX_ID)]] = Field(
        min_length=2, max_length=64, description="Two or more distinct checkpoints to compare.")
    dataset_id: int | None = Field(None, ge=1, le=MAX_ID)
    split: Literal["train", "eval", "all"] = "eval"
    prompts: list[str] = Field(default_factory=list, max_length=10_000)
    max_prompts: int | None = Field(None, ge=1, le=100_000)
    seeds: list[Annotated[int, Field(ge=0, le=MAX_ID)]] = Field(default_factory=lambda: [0, 1, 2, 3], min_length=1, max_length=1000)
    solver: Literal["dpm++", "euler"] = "dpm++"
    steps: int = Field(8, ge=2, le=1000)
    model: Literal["shapes"] = Field("shapes", description="Model adapter of the checkpoints.")
    reward_names: list[str] = Field(default_factory=list, max_length=32,
                                    description="Rewards scored on each image (registry names); "
                                    "empty: count, color and shape.")


class FitPreferenceConfig(_Cfg):
    """Refit the human-preference reward model from clean votes (trainer.rewards.preference
    FitConfig's fields); the file goes to STORAGE_DIR/preference/vN.safetensors."""

    min_votes: int = Field(0, ge=0, le=10_000_000,
                           description="Fail unless at least this many clean votes exist.")
    features: Literal["shapes", "clip"] = Field(
        "shapes", description="'shapes': a small convolutional network on the pixels; 'clip': "
        "a frozen CLIP image-text embedding from clip_path with a small head.")
    clip_path: str = Field("", description="Local CLIP weights for features='clip'.")
    holdout_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of the votes kept "
                                    "out of the fit to report held-out pair accuracy and log-loss.")
    epochs: int = Field(60, ge=1, le=10_000, description="Passes over the training votes.")
    batch_size: int = Field(64, ge=1, le=65_536, description="Votes per optimizer step.")
    learning_rate: float = Field(2e-3, gt=0.0, le=1.0, description="Peak AdamW learning rate "
                                 "(one-cycle schedule).")
    weight_decay: float = Field(1e-3, ge=0.0, le=1.0, description="AdamW weight decay.")
    ensemble: int = Field(5, ge=1, le=32, description="Networks trained from different "
                          "initialisations and averaged; fewer fit faster, more rank close pairs "
                          "more reliably.")
    mirror_augment: bool = Field(False, description="Train on random left-right mirrors of the "
                                 "shapes images: more variety from few votes, but a preference "
                                 "for one side can then not be learned.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the held-out split and the "
                      "initialisations.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to fit; 'auto' "
                                                   "takes the GPU when there is one.")
    score_samples: bool = Field(True, description="Cache the new model's score on every "
                                "stored sample (active pair selection reads it).")


KIND_CONFIGS: dict[str, type[_Cfg]] = {
    "rollout": RolloutConfig, "evaluate": EvaluateConfig, "fit_preference": FitPreferenceConfig,
}


Problems = list[tuple[str, str]]  # (field, message), every one found


def _train_config(config: dict[str, Any], preset: str | None, problems: Problems
                  ) -> dict[str, Any]:
    from trainer.config import PRESETS, ConfigErrors, TrainConfig

    data: dict[str, Any] = {}
    if preset:
        if preset not in PRESETS:
            problems.append(("preset", f"unknown preset {preset!r}; one of {list(PRESETS)}"))
        else:
            data.update(PRESETS[preset])
    data.update(config)
    try:
        return TrainConfig.from_dict(data).to_dict()
    except ConfigErrors as exc:
        problems.extend((e.field, e.message) for e in exc.errors)
    return {**TrainConfig().to_dict(), **data}  # the server's own checks still run on it


def _kind_config(kind: str, config: dict[str, Any], problems: Problems) -> dict[str, Any]:
    try:
        return KIND_CONFIGS[kind].model_validate(config).model_dump()
    except ValidationError as exc:
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"][:1]) or "config"
            where = ".".join(str(p) for p in err["loc"][1:])
            problems.append((name, f"{where + ': ' if where else ''}{err['msg']}"))
    return dict(config)  # the server's own checks still run on it


def _check_paths_and_names(session: Session, kind: str, config: dict[str, Any],
                           problems: Problems) -> None:
    """What the worker would otherwise fail on: rewards it does not know, prompts longer than
    an upload may hold, paths outside the storage and models directories, missing rows, a
    device no live worker has. Fields already found malformed are not checked again."""
    from trainer.config import RUN_TIME_REWARDS
    from trainer.rewards import reward_names

    malformed = {field for field, _ in problems}
    expected = {"prompts": list, "reward_names": list, "base_checkpoint": str,
                "features": str, "clip_path": str, "reward_weights": dict,
                "preference_model": str, "dataset_id": int, "checkpoint_id": int,
                "checkpoint_ids": list, "device": str}
    out = {k: v for k, v in config.items()
           if k in expected and k not in malformed and isinstance(v, expected[k])
           and not isinstance(v, bool)}
    if "checkpoint_ids" in out and not all(isinstance(c, int) for c in out["checkpoint_ids"]):
        del out["checkpoint_ids"]

    limit = get_settings().max_prompt_length
    for i, prompt in enumerate(out.get("prompts") or []):
        if isinstance(prompt, str) and len(prompt) > limit:
            problems.append(("prompts", f"prompt {i} has {len(prompt)} characters; the limit "
                                        f"is {limit} (MAX_PROMPT_LENGTH)"))
        if isinstance(prompt, str) and ("\x00" in prompt or not prompt.strip()):
            problems.append(("prompts", f"prompt {i} is empty or contains a NUL character"))
    known = reward_names()
    for name in out.get("reward_names") or []:
        if name not in known:
            problems.append(("reward_names", f"unknown reward {name!r}; known: {known}"))
    if out.get("base_checkpoint"):
        try:
            storage.job_path(out["base_checkpoint"])
        except ValueError as exc:
            problems.append(("base_checkpoint", str(exc)))
    if out.get("features") == "clip":
        if not out.get("clip_path", "").strip():
            problems.append(("clip_path", "features 'clip' needs the local path of CLIP weights "
                                          "(a transformers save_pretrained directory) under "
                                          "MODELS_DIR"))
        else:
            try:
                storage.job_path(out["clip_path"], want="dir")
            except ValueError as exc:
                problems.append(("clip_path", str(exc)))
    if kind == "train" and any(n in RUN_TIME_REWARDS for n in out.get("reward_weights", {})):
        problem = preference_problem(session, out.get("preference_model", ""))
        if problem:
            problems.append(("preference_model", problem))
    ds_id = out.get("dataset_id")
    if ds_id is not None and session.get(Dataset, ds_id) is None:
        problems.append(("dataset_id", f"dataset {ds_id} not found"))
    if out.get("checkpoint_id") is not None and session.get(Checkpoint, out["checkpoint_id"]) is None:
        problems.append(("checkpoint_id", f"checkpoint {out['checkpoint_id']} not found"))
    ids = out.get("checkpoint_ids") or []
    if len(set(ids)) < len(ids):
        problems.append(("checkpoint_ids", "must not repeat a checkpoint"))
    missing = [cid for cid in dict.fromkeys(ids) if session.get(Checkpoint, cid) is None]
    if missing:
        problems.append(("checkpoint_ids", f"checkpoint(s) {missing} not found"))
    device = workers.device_problem(session, kind, out)
    if device:
        problems.append(("device", device))


def preference_problem(session: Session, spec: str) -> str | None:
    """Why the preference model a train config names cannot be loaded, or None."""
    from app.services import preference as pref_svc

    spec = spec.strip()
    if spec in ("", "latest"):
        if pref_svc.latest_model(session) is None:
            return ("reward_weights has 'preference' but no preference model has been fitted "
                    "yet: run a fit_preference job first")
        return None
    if spec.lstrip("v").isdigit():
        version = int(spec.lstrip("v"))
        try:
            if version > MAX_ID or pref_svc.get_model(session, version) is None:
                raise NotFound(spec)
        except NotFound:
            return f"preference model version {spec!r} not found"
        return None
    try:
        storage.job_path(spec)
    except ValueError as exc:
        return f"must be '', 'latest', 'vN' or a path: {exc}"
    return None


def validate_config(session: Session, kind: str, config: dict[str, Any] | None,
                    preset: str | None = None) -> dict[str, Any]:
    """The full validated config of a job (defaults filled in). Everything a worker would
    reject is rejected here, every problem at once: Invalid whose `errors` lists
    {field, message} for each (and `field` names the first)."""
    if kind not in JOB_KINDS:
        raise Invalid(f"kind must be one of {list(JOB_KINDS)}, got {kind!r}", field="kind")
    if config is not None and not isinstance(config, dict):
        raise Invalid("config: must be a JSON object", field="config")
    config = dict(config or {})
    problems: Problems = []
    if kind == "train":
        out = _train_config(config, preset, problems)
    else:
        if preset:
            problems.append(("preset", f"presets exist only for train jobs, not {kind}"))
        out = _kind_config(kind, config, problems)
    _check_paths_and_names(session, kind, out, problems)
    if problems:
        errors = [{"field": f, "message": m} for f, m in problems]
        summary = "; ".join(f"config.{f}: {m}" if f != "preset" else f"{f}: {m}"
                            for f, m in problems)
        raise Invalid(summary, field=problems[0][0], errors=errors)
    return out


# --- API side ------------------------------------------------------------------------------
def create_job(session: Session, kind: str, config: dict[str, Any] | None = None, *,
               preset: str | None = None, dataset_id: int | None = None,
               user: User | None = None) -> Job:
    """Validate and write a queued job (flush, no commit). Enqueue after the commit."""
    full = validate_config(session, kind, config, preset)
    ds = full.get("dataset_id") if kind != "train" else None
    ds = ds if ds is not None else dataset_id
    if ds is not None and session.get(Dataset, ds) is None:
        raise Invalid(f"dataset_id: dataset {ds} not found", field="dataset_id")
    total = full.get("iterations") if kind == "train" else None
    job = Job(kind=kind, status="queued", config=full, dataset_id=ds,
              created_by_id=user.id if user else None, total_iterations=total)
    session.add(job)
    session.flush()
    return job


def celery_enqueue(job_id: int, kind: str) -> None:
    """The default enqueuer: `worker.celery_app.celery_app.send_task` to the kind's queue.
    Without a worker package the job stays queued (and this logs why)."""
    try:
        module = importlib.import_module("worker.celery_app")
    except ImportError as exc:
        log.warning("job %s left queued: worker.celery_app is not importable (%s)", job_id, exc)
        return
    module.celery_app.send_task(f"worker.tasks.{kind}", args=[job_id], queue=QUEUES[kind])


def enqueue(enqueuer: Enqueuer | None, job: Job) -> None:
    """Call the enqueuer after commit; a broker failure leaves the job queued and is logged."""
    try:
        (enqueuer or celery_enqueue)(job.id, job.kind)
    except Exception:
        log.exception("could not enqueue job %s; it stays queued", job.id)


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def list_jobs(session: Session, *, status: str | None = None, kind: str | None = None,
              limit: int = 50, offset: int = 0) -> tuple[list[Job], int]:
    stmt = select(Job)
    if status:
        stmt = stmt.where(Job.status == status)
    if kind:
        stmt = stmt.where(Job.kind == kind)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(Job.id.desc()).limit(limit).offset(offset))
    return list(rows), total


def metric_history(session: Session, job_id: int) -> list[JobMetric]:
    return list(session.scalars(
        select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.iteration)
    ))


def request_cancel(session: Session, job_id: int) -> Job:
    """Ask a job to stop. Queued: cancelled now. Running: flag for the worker. Else Conflict."""
    job = get_job(session, job_id)
    if job.status in TERMINAL:
        raise Conflict(f"job {job_id} is already {job.status}")
    job.cancel_requested = True
    if job.status == "queued":
        job.status = "cancelled"
        job.finished_at = utcnow()
    session.flush()
    return job


def resume_job(session: Session, job_id: int) -> Job:
    """Put a failed or cancelled job back in the queue (the worker resumes from the newest
    checkpoint, `checkpoints.latest_checkpoint`). Enqueue after the commit."""
    job = get_job(session, job_id)
    if job.status not in ("failed", "cancelled"):
        raise Conflict(f"job {job_id} is {job.status}; only failed or cancelled jobs resume")
    job.status, job.cancel_requested, job.error, job.finished_at = "queued", False, None, None
    session.flush()
    return job


# --- worker side ---------------------------------------------------------------------------
def mark_running(session: Session, job_id: int, worker_name: str) -> Job:
    """queued (or running, after a crash/requeue) -> running. Conflict if the job is finished
    or was cancelled: the worker should then do nothing."""
    job = get_job(session, job_id)
    if job.status in TERMINAL:
        raise Conflict(f"job {job_id} is {job.status}; not starting it")
    now = utcnow()
    job.status, job.worker, job.heartbeat_at = "running", worker_name[:200], now
    job.started_at = job.started_at or now
    job.attempts += 1
    session.flush()
    return job


def heartbeat(session: Session, job_id: int, worker_name: str | None = None) -> bool:
    """Touch the heartbeat; returns whether cancel was requested."""
    job = get_job(session, job_id)
    job.heartbeat_at = utcnow()
    if worker_name:
        job.worker = worker_name[:200]
    session.flush()
    return job.cancel_requested


def update_progress(session: Session, job_id: int, iteration: int, total: int | None = None,
                    metrics: dict[str, Any] | None = None) -> bool:
    """Record an iteration: progress, latest metrics, one metric-history row per iteration
    (re-recording an iteration replaces it), heartbeat. Returns whether cancel was requested."""
    job = get_job(session, job_id)
    job.iteration = iteration
    if total is not None:
        job.total_iterations = total
    job.heartbeat_at = utcnow()
    if metrics is not None:
        metrics = dict(metrics)
        job.metrics = metrics
        row = session.scalar(
            select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.iteration == iteration)
        )
        if row is None:
            session.add(JobMetric(job_id=job_id, iteration=iteration, metrics=metrics))
        else:
            row.metrics = metrics
    session.flush()
    return job.cancel_requested


def is_cancel_requested(session: Session, job_id: int) -> bool:
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def _finish(session: Session, job_id: int, status: str, error: str | None = None) -> Job:
    job = get_job(session, job_id)
    job.status, job.finished_at, job.heartbeat_at = status, utcnow(), utcnow()
    if error is not None:
        job.error = error
    session.flush()
    return job


def mark_succeeded(session: Session, job_id: int, metrics: dict[str, Any] | None = None) -> Job:
    job = _finish(session, job_id, "succeeded")
    if metrics is not None:
        job.metrics = dict(metrics)
    return job


def mark_failed(session: Session, job_id: int, error: str) -> Job:
    return _finish(session, job_id, "failed", error=error or "failed")


def mark_cancelled(session: Session, job_id: int) -> Job:
    return _finish(session, job_id, "cancelled")


def requeue(session: Session, job_id: int, reason: str | None = None) -> Job:
    """running -> queued (for a reaper resubmitting a job whose worker died)."""
    job = get_job(session, job_id)
    job.status, job.worker = "queued", None
    if reason:
        job.error = reason
    session.flush()
    return job


def stale_jobs(session: Session, older_than: timedelta) -> list[Job]:
    """Running jobs whose heartbeat is older than `older_than` (or missing)."""
    cutoff = datetime.now(UTC) - older_than
    return list(session.scalars(
        select(Job).where(Job.status == "running")
        .where((Job.heartbeat_at.is_(None)) | (Job.heartbeat_at < cutoff))
    ))


def claim(session: Session, job_id: int, worker_name: str, stale_after: timedelta) -> Job | None:
    """Atomically take a job: queued -> running, or running with a heartbeat older than
    `stale_after` (its worker died) -> running for `worker_name`. Returns the job, or None
    when it is finished, cancelled, or held by a live worker (then do nothing)."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.cancel_requested.is_(False))
        .where((Job.status == "queued") | (
            (Job.status == "running")
            & (Job.heartbeat_at.is_(None) | (Job.heartbeat_at < now - stale_after))))
        .values(status="running", worker=worker_name[:200], heartbeat_at=now,
                started_at=func.coalesce(Job.started_at, now), attempts=Job.attempts + 1)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    return session.get(Job, job_id, populate_existing=True)


def holds(session: Session, job_id: int, worker_name: str) -> bool:
    """Whether `worker_name` still runs this job (a reaper may have handed it to another)."""
    row = session.execute(select(Job.status, Job.worker).where(Job.id == job_id)).one_or_none()
    return row is not None and row[0] == "running" and row[1] == worker_name[:200]


def truncate_history(session: Session, job_id: int, iteration: int) -> None:
    """Forget metric rows after `iteration` (a resume redoes them) and set the progress."""
    session.execute(delete(JobMetric).where(JobMetric.job_id == job_id,
                                            JobMetric.iteration > iteration))
    job = get_job(session, job_id)
    job.iteration = iteration
    last = session.scalar(select(JobMetric.metrics).where(JobMetric.job_id == job_id)
                          .order_by(JobMetric.iteration.desc()).limit(1))
    job.metrics = last
    session.flush()


def reap_stale(session: Session, older_than: timedelta, max_attempts: int
               ) -> list[tuple[int, str, str]]:
    """Settle running jobs whose heartbeat is older than `older_than`: cancelled if a cancel was
    requested, failed (with the reason) after `max_attempts` runs, else back to queued for a
    resume. Each change is a compare-and-set, so concurrent reapers act once. Returns
    [(job_id, kind, new_status)]; the caller enqueues the `queued` ones after the commit."""
    out = []
    now = utcnow()
    for job in stale_jobs(session, older_than):
        beat = job.heartbeat_at
        if beat is not None and beat.tzinfo is None:  # SQLite returns naive datetimes
            beat = beat.replace(tzinfo=UTC)
        age = f"{(now - beat).total_seconds():.0f}s" if beat else "ever"
        lost = f"worker {job.worker or '?'} stopped heartbeating (none for {age})"
        if job.cancel_requested:
            values: dict[str, Any] = {"status": "cancelled", "finished_at": now}
        elif job.attempts >= max_attempts:
            values = {"status": "failed", "finished_at": now,
                      "error": f"{lost}; gave up after {job.attempts} attempt(s)"}
        else:
            values = {"status": "queued", "worker": None,
                      "error": f"{lost}; requeued to resume from the newest checkpoint "
                               f"(attempt {job.attempts + 1} of {max_attempts})"}
        stmt = update(Job).where(Job.id == job.id, Job.status == "running")
        stmt = stmt.where(Job.heartbeat_at.is_(None) if job.heartbeat_at is None
                          else Job.heartbeat_at == job.heartbeat_at)
        result = session.execute(stmt.values(**values).execution_options(
            synchronize_session=False))
        if result.rowcount == 1:
            out.append((job.id, job.kind, values["status"]))
    session.flush()
    return out
