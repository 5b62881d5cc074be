"""The ORM (SQLAlchemy 2.0 typed declarative). One file until it hurts.

Image files live under the storage directory; rows keep paths relative to it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from app.limits import FILENAME_LENGTH, HOLDING_LENGTH, NAME_LENGTH, SELECTION_LENGTH


def utcnow() -> datetime:
    return datetime.now(UTC)


NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ROLES = ("admin", "annotator")  # most trusted first (a job kind open to a role: to those above)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    role: Mapped[str] = mapped_column(String(20))
    # excluded annotators' votes are not used for fitting (issue 5's switch)
    excluded: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    tokens: Mapped[list[ApiToken]] = relationship(back_populates="user", cascade="all, delete-orphan")


class ApiToken(Base):
    """A bearer token, stored as its SHA-256 (tokens are 256 random bits: no salt needed)."""

    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(12))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]
    # a UI login's session (the ngs_session cookie), not an API token: expires, and logout
    # revokes it; the user's API tokens are never put in a cookie
    is_session: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    expires_at: Mapped[datetime | None]
    user: Mapped[User] = relationship(back_populates="tokens", lazy="joined")


class Dataset(Base):
    __tablename__ = "datasets"
    # unique: names pick datasets in the UI and the demo (0008 closed the race of two uploads);
    # AUTOINCREMENT: SQLite would hand a deleted dataset's id to the next one (0011)
    __table_args__ = (Index("ux_datasets_name", "name", unique=True), {"sqlite_autoincrement": True})
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    filename: Mapped[str] = mapped_column(String(FILENAME_LENGTH))
    format: Mapped[str] = mapped_column(String(10))
    num_prompts: Mapped[int] = mapped_column(Integer, default=0)
    num_eval: Mapped[int] = mapped_column(Integer, default=0)
    duplicates_dropped: Mapped[int] = mapped_column(Integer, default=0)
    blank_lines_skipped: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    eval_fraction: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    prompts: Mapped[list[Prompt]] = relationship(
        back_populates="dataset", cascade="all, delete-orphan", passive_deletes=True
    )


class Prompt(Base):
    __tablename__ = "prompts"
    id: Mapped[int] = mapped_column(primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    split: Mapped[str] = mapped_column(String(10), default="train")
    dataset: Mapped[Dataset] = relationship(back_populates="prompts")
    __table_args__ = (Index("ix_prompts_dataset_position", "dataset_id", "position"),
                      {"sqlite_autoincrement": True})


class JobStatus(StrEnum):
    """Where a job is in its life: queued -> running -> succeeded, failed or cancelled. A
    running job goes back to queued when its worker stops (warm shutdown) or is lost (the
    reaper), and a failed or cancelled one when it is retried. Stored as its plain value."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_JOB_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
"""A job in one of these has stopped for good (unless retried)."""
ACTIVE_JOB_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING)
"""A job in one of these is waiting for a worker or on one."""


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), default=JobStatus.QUEUED.value,
                                        index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    dataset_id: Mapped[int | None] = mapped_column(
        ForeignKey("datasets.id", ondelete="SET NULL"), index=True
    )
    # the dataset_id the job was submitted with, kept when the dataset is deleted (dataset_id
    # is then null): a stopped job that trained on it must not resume on other prompts
    submitted_dataset_id: Mapped[int | None] = mapped_column(Integer)
    created_by_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="SET NULL"))
    iteration: Mapped[int] = mapped_column(Integer, default=0)
    total_iterations: Mapped[int | None] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    # when the current run's worker claimed it (every claim; started_at keeps the first): an
    # iteration recorded since says a multi-host run is past its rendezvous
    claimed_at: Mapped[datetime | None]
    # when it last entered the queue (submitted, resumed, requeued): a job queued for long
    # while a worker that takes it sat idle lost its message (worker.reaper sends it again)
    queued_at: Mapped[datetime | None] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]

    @property
    def progress(self) -> float | None:
        """The share of its iterations done (0-1), for the API and the UI alike: 1 once it
        succeeded; None while a kind that counts no iterations runs."""
        if self.total_iterations:
            return min(1.0, self.iteration / self.total_iterations)
        return 1.0 if self.status == JobStatus.SUCCEEDED else None


class JobMetric(Base):
    """One row per (job, iteration): the metric history. Re-recording an iteration updates it."""

    __tablename__ = "job_metrics"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    iteration: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("job_id", "iteration"),)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    iteration: Mapped[int] = mapped_column(Integer, default=0)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    path: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(20), default="safetensors")
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # automatic-reward evaluation, {reward: {mean, std, n, job_id, prompts, seeds, at}}, written
    # by evaluate jobs (app.services.checkpoints.record_scores); NULL until the first. Nullable
    # so the migration adds it to existing rows without a server-side JSON default
    scores: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class RolloutGroup(Base):
    """G samples from one prompt whose initial noises are neighbours of one shared noise."""

    __tablename__ = "rollout_groups"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    iteration: Mapped[int] = mapped_column(Integer, default=0)
    # the job kind that made it: train, rollout or evaluate (evaluate feeds cross-checkpoint pairs)
    purpose: Mapped[str] = mapped_column(String(20), default="train")
    prompt_id: Mapped[int | None] = mapped_column(ForeignKey("prompts.id", ondelete="SET NULL"), index=True)
    prompt_text: Mapped[str] = mapped_column(Text)
    checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="SET NULL"), index=True
    )
    solver: Mapped[str] = mapped_column(String(20))
    steps: Mapped[int] = mapped_column(Integer)
    sigma: Mapped[float] = mapped_column(Float)
    # the trainer draws noise seeds below trainer.grpo.SEED_LIMIT (2**62): 64-bit
    seed: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    samples: Mapped[list[Sample]] = relationship(
        back_populates="group", cascade="all, delete-orphan", order_by="Sample.member_index"
    )
    __table_args__ = (
        Index("ix_rollout_groups_job_iteration", "job_id", "iteration"),
        Index("ix_rollout_groups_purpose_seed", "purpose", "seed"),
    )


class Sample(Base):
    __tablename__ = "samples"
    id: Mapped[int] = mapped_column(primary_key=True)
    group_id: Mapped[int] = mapped_column(ForeignKey("rollout_groups.id", ondelete="CASCADE"))
    member_index: Mapped[int] = mapped_column(Integer)
    image_path: Mapped[str] = mapped_column(Text)
    rewards: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    advantage: Mapped[float | None] = mapped_column(Float)
    is_anchor: Mapped[bool] = mapped_column(Boolean, default=False)
    # the newest preference model's reward r(image, prompt) for this sample and that model's
    # version (written by the fit_preference job): active pair selection reads it, so
    # GET /api/votes/next never runs the network
    preference_score: Mapped[float | None] = mapped_column(Float)
    preference_version: Mapped[int | None] = mapped_column(Integer)
    group: Mapped[RolloutGroup] = relationship(back_populates="samples")
    __table_args__ = (UniqueConstraint("group_id", "member_index"),)


class Vote(Base):
    """One pairwise judgement. `a` was shown on the left, `b` on the right.

    (annotator, client_vote_id) is unique: a retried POST records one vote. (annotator,
    pair_lo_id, pair_hi_id) is unique: an annotator never judges the same pair twice.
    """

    __tablename__ = "votes"
    id: Mapped[int] = mapped_column(primary_key=True)
    client_vote_id: Mapped[str] = mapped_column(String(64))
    annotator_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    session_id: Mapped[str | None] = mapped_column(String(64))
    sample_a_id: Mapped[int] = mapped_column(ForeignKey("samples.id", ondelete="CASCADE"), index=True)
    sample_b_id: Mapped[int] = mapped_column(ForeignKey("samples.id", ondelete="CASCADE"), index=True)
    pair_lo_id: Mapped[int] = mapped_column(Integer)
    pair_hi_id: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(10))  # an Outcome's value (trainer.rewards)
    shown_at: Mapped[datetime | None]
    latency_ms: Mapped[int | None] = mapped_column(Integer)
    selection: Mapped[str] = mapped_column(String(SELECTION_LENGTH), default="unknown")
    # the fraction of the two images' pixels that differ (app.services.votes.differing_fraction,
    # the distance pair selection's near-identical rule uses), measured when the vote is
    # recorded; None for votes from before migration 0007 and pairs with an unreadable image
    pixel_difference: Mapped[float | None] = mapped_column(Float)
    excluded: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (
        UniqueConstraint("annotator_id", "client_vote_id", name="uq_votes_annotator_client"),
        UniqueConstraint("annotator_id", "pair_lo_id", "pair_hi_id", name="uq_votes_annotator_pair"),
    )


class PreferenceModelRow(Base):
    """A fitted human-preference reward model (trainer/rewards/preference.py): the file under
    the storage directory, the votes it was fitted on and its fit report (held-out accuracy,
    log-loss, ...). The newest version is what training and active pair selection use."""

    __tablename__ = "preference_models"
    id: Mapped[int] = mapped_column(primary_key=True)
    version: Mapped[int] = mapped_column(Integer, unique=True)
    path: Mapped[str] = mapped_column(Text)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    votes_used: Mapped[int] = mapped_column(Integer, default=0)
    last_vote_id: Mapped[int] = mapped_column(Integer, default=0)  # the newest vote it saw
    # the checkpoints whose samples the votes were cast on (None = the base model)
    checkpoint_ids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    heldout_accuracy: Mapped[float | None] = mapped_column(Float)
    heldout_log_loss: Mapped[float | None] = mapped_column(Float)
    report: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WorkerRow(Base):
    """A Celery worker as it last reported itself (at start and every reaper round): which
    queues it consumes and which devices it has. Job submission checks a config's `device`
    against these, and a queued job with no live worker for it says what it waits for."""

    __tablename__ = "workers"
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    queues: Mapped[list[Any]] = mapped_column(JSON, default=list)
    cuda_devices: Mapped[int] = mapped_column(Integer, default=0)
    device_names: Mapped[list[Any]] = mapped_column(JSON, default=list)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    # why it takes no job for now (its STORAGE_DIR cannot be written), None when it takes jobs
    holding: Mapped[str | None] = mapped_column(String(HOLDING_LENGTH), nullable=True)
    # its TRAIN_NPROC: the processes a train job gets on it ('fsdp' jobs are checked against
    # it at submission); NULL when reported by a worker from before migration 0015
    train_nproc: Mapped[int | None] = mapped_column(Integer, nullable=True)
