"""Checkpoints: recorded by workers, listed and downloaded through the API."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.errors import Invalid, NotFound
from app.limits import NAME_LENGTH
from app.models import Checkpoint, Job, utcnow
from app.schemas import utc_text
from app.services import storage

# A base model's row: not a file a job wrote but the pretrained model itself (the shipped
# shapes base, or a model directory under MODELS_DIR), so that an evaluate job scores it and
# the arena pairs it with fine-tuned checkpoints like any other (`include_base`). Its format
# names the model ("base:flux"), its path the model directory relative to MODELS_DIR ("" for
# shapes); it has no job, no files and no download.
BASE_FORMAT = "base:"


def is_base(ckpt: Checkpoint) -> bool:
    return ckpt.format.startswith(BASE_FORMAT)


def base_model(ckpt: Checkpoint) -> tuple[str, str]:
    """(model, model_path) of a base model's row."""
    return ckpt.format.removeprefix(BASE_FORMAT), ckpt.path


def base_name(model: str, model_path: str) -> str:
    return f"base {model} ({model_path or 'shipped'})"


def base_spec(ckpt: Checkpoint) -> Any:
    """The trainer.models.ModelSpec a base model's row samples: the model at its directory
    (relative to MODELS_DIR, as a job's model_path), no weights on top."""
    from trainer.models import ModelSpec

    model, path = base_model(ckpt)
    return ModelSpec.base(model, path)


def base_checkpoint(session: Session, model: str, model_path: str) -> Checkpoint:
    """The row of the base model `model` (at `model_path`, relative to MODELS_DIR; "" for
    shapes), recorded the first time it is asked for (flush, no commit)."""
    format = f"{BASE_FORMAT}{model}"
    found = session.scalar(select(Checkpoint).where(
        Checkpoint.format == format, Checkpoint.path == model_path, Checkpoint.job_id.is_(None))
        .order_by(Checkpoint.id).limit(1))
    if found is not None:
        return found
    ckpt = Checkpoint(job_id=None, iteration=0, path=model_path, format=format,
                      name=base_name(model, model_path)[:NAME_LENGTH])
    session.add(ckpt)
    session.flush()
    return ckpt


def record_checkpoint(session: Session, job_id: int | None, iteration: int, path: str,
                      format: str = "safetensors", parent_id: int | None = None,
                      name: str | None = None) -> int:
    """Record a checkpoint file (path inside the storage dir, relative or absolute) and return
    its id. Idempotent: the same (job, iteration) again updates and returns the same row."""
    if job_id is not None and session.get(Job, job_id) is None:
        raise NotFound(f"job {job_id} not found")
    if parent_id is not None and session.get(Checkpoint, parent_id) is None:
        raise Invalid(f"parent checkpoint {parent_id} not found", field="parent_id")
    rel = storage.relative(path)
    name = name or (f"job{job_id}-it{iteration}" if job_id is not None else Path(rel).stem)
    existing = None
    if job_id is not None:
        existing = session.scalar(
            select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.iteration == iteration)
        )
    if existing is not None:
        existing.path, existing.format, existing.parent_id = rel, format, parent_id
        session.flush()
        return existing.id
    ckpt = Checkpoint(job_id=job_id, iteration=iteration, path=rel, format=format,
                      parent_id=parent_id, name=name[:NAME_LENGTH])
    session.add(ckpt)
    session.flush()
    return ckpt.id


def latest_checkpoint(session: Session, job_id: int) -> Checkpoint | None:
    """The newest checkpoint of a job (highest iteration): where resume starts."""
    return session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.iteration.desc(), Checkpoint.id.desc()).limit(1)
    )


def newest_paths(session: Session, limit: int) -> list[str]:
    """The storage paths of the `limit` newest recorded checkpoints, newest first."""
    return list(session.scalars(select(Checkpoint.path)
                                .where(Checkpoint.format.not_like(f"{BASE_FORMAT}%"))
                                .order_by(Checkpoint.id.desc())
                                .limit(limit)))


def get_checkpoint(session: Session, checkpoint_id: int) -> Checkpoint:
    ckpt = session.get(Checkpoint, checkpoint_id)
    if ckpt is None:
        raise NotFound(f"checkpoint {checkpoint_id} not found")
    return ckpt


def list_checkpoints(session: Session, *, job_id: int | None = None, limit: int = 100,
                     offset: int = 0) -> tuple[list[Checkpoint], int]:
    stmt = select(Checkpoint)
    if job_id is not None:
        # a 404, as GET /api/rollouts?job_id= answers: an empty page reads as "none yet"
        if session.get(Job, job_id) is None:
            raise NotFound(f"job {job_id} not found")
        stmt = stmt.where(Checkpoint.job_id == job_id)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(Checkpoint.id.desc()).limit(limit).offset(offset))
    return list(rows), total


def checkpoint_file(session: Session, checkpoint_id: int) -> Path:
    """The checkpoint's file, only if it lies inside the storage directory; NotFound saying
    that its files are gone when the row outlived them (moved or deleted on disk)."""
    return stored_file(get_checkpoint(session, checkpoint_id))


def stored_file(ckpt: Checkpoint) -> Path:
    """`ckpt`'s weights file inside the storage directory (checkpoint_file's NotFound; a
    base model's row has none)."""
    if is_base(ckpt):
        model, path = base_model(ckpt)
        raise NotFound(f"checkpoint {ckpt.id} ({ckpt.name}) is the base model {model!r} "
                       + (f"in {path!r} under MODELS_DIR" if path else "the project ships")
                       + ": it has no files of its own to download", field="checkpoint_id")
    try:
        return storage.resolve(ckpt.path)
    except NotFound:
        raise NotFound(files_missing(ckpt), field="checkpoint_id") from None


def files_missing(ckpt: Checkpoint) -> str:
    """What is said of a checkpoint whose row outlived its files."""
    return (f"checkpoint {ckpt.id} ({ckpt.name}) has lost its files: {ckpt.path} is not in "
            "the storage directory (moved or deleted); put it back, or use another checkpoint")


def files_problem(ckpt: Checkpoint) -> str | None:
    """files_missing's message when the checkpoint's weights file is gone, else None:
    submission and resume say it rather than a worker failing on it. None for a base
    model's row (its model directory is checked as a model_path is)."""
    if is_base(ckpt):
        return None
    try:
        stored_file(ckpt)
    except NotFound as exc:
        return exc.message
    return None


# what a checkpoint directory holds for resuming this trainer only (the optimizer's moments, the
# RNG): twice the weights' size for full fine-tuning, and of no use to anyone taking it away
RESUME_ONLY = "trainer_state.safetensors"
ARCHIVE_CHUNK = 1024 * 1024


class _Chunks(io.RawIOBase):
    """A write-only sink the zip is written into and drained from as it goes (no tell(), so
    zipfile writes data descriptors: nothing is held beyond a chunk)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def checkpoint_archive(session: Session, checkpoint_id: int) -> tuple[str, Iterator[bytes]]:
    """The checkpoint's whole directory as a zip streamed in chunks, for taking it away: the
    weights (a LoRA, the shapes model, or a full fine-tune's transformer/ with its config),
    the model card (README.md), without the resume-only state. Returns the download's name
    and the chunks."""
    from trainer.models import checkpoint_directory

    ckpt = get_checkpoint(session, checkpoint_id)
    root = storage.storage_root()
    directory = checkpoint_directory(stored_file(ckpt)).resolve()
    if directory == root or root not in directory.parents:
        raise NotFound(f"checkpoint {checkpoint_id} has no directory of its own")
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and not p.is_symlink() and p.name != RESUME_ONLY)

    def chunks() -> Iterator[bytes]:
        sink = _Chunks()
        with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for path in files:
                arcname = f"{ckpt.name}/{path.relative_to(directory).as_posix()}"
                with zf.open(arcname, "w", force_zip64=True) as out, path.open("rb") as src:
                    while block := src.read(ARCHIVE_CHUNK):
                        out.write(block)
                        yield sink.take()
                yield sink.take()
        yield sink.take()

    return ckpt.name, chunks()


def record_scores(session: Session, checkpoint_id: int, scores: dict[str, dict[str, Any]],
                  **about: Any) -> dict[str, Any]:
    """Merge one evaluation's reward scores into the checkpoint's `scores`: {reward: {"mean",
    "std", "n", ...}} plus `about` (job_id, prompts, seeds) and the time, on every reward given.
    Rewards it does not name keep their earlier result; a reward it names is replaced (the
    newer evaluation wins). The row is locked first (PostgreSQL) so that two evaluate jobs
    finishing together do not drop each other's rewards. Returns the merged scores."""
    ckpt = session.get(Checkpoint, checkpoint_id, with_for_update=True, populate_existing=True)
    if ckpt is None:
        raise NotFound(f"checkpoint {checkpoint_id} not found")
    at = utc_text(utcnow())
    merged = dict(ckpt.scores or {})
    merged.update({name: {**entry, **about, "at": at} for name, entry in scores.items()})
    ckpt.scores = merged  # a new dict: SQLAlchemy does not see in-place JSON changes
    session.flush()
    return merged


def score_means(ckpt: Checkpoint) -> dict[str, float]:
    """{reward: mean} of a checkpoint's evaluation scores (empty before its first)."""
    return {name: float(entry["mean"]) for name, entry in (ckpt.scores or {}).items()
            if isinstance(entry, dict) and entry.get("mean") is not None}


def score_sources(ckpt: Checkpoint) -> dict[str, str]:
    """{reward: what its mean was computed on} ("4 of dataset 1 (eval split), 2 seeds,
    n=8"): two checkpoints' means compare only when these agree."""
    out = {}
    for name, entry in (ckpt.scores or {}).items():
        if not isinstance(entry, dict) or entry.get("mean") is None:
            continue
        seeds = entry.get("seeds")
        parts = [str(entry["prompts"]) if entry.get("prompts") else "prompts not recorded",
                 *([f"{seeds} seed{'s' if seeds != 1 else ''}"] if seeds else []),
                 *([f"n={entry['n']}"] if entry.get("n") is not None else []),
                 # preference scores of two models' versions do not compare either
                 *([f"preference model {entry['preference_model']}"]
                   if entry.get("preference_model") else [])]
        out[name] = ", ".join(parts)
    return out
