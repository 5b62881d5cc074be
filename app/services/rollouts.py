"""Rollout groups and their samples: recorded by workers, browsed through the API."""

from __future__ import annotations

import io
from pathlib import PurePosixPath
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from app.errors import Invalid, NotFound
from app.job_kinds import PURPOSES
from app.models import Checkpoint, Job, Prompt, RolloutGroup, Sample
from app.services import storage
from app.services.checkpoints import is_base

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# images larger than this (a real model's 512 px) get a WebP thumbnail of this side beside
# them, for grids (the UI shows members at 72 CSS pixels); the 32x32 shapes images need none
THUMBNAIL_SIDE = 160


def image_path_for(group_id: int, member_index: int) -> str:
    return f"rollouts/{group_id // 1000:04d}/{group_id}/{member_index:03d}.png"


def thumbnail_path_for(image_path: str) -> str:
    """Where the thumbnail of a stored image lies: `000.png` -> `000.thumb.webp` beside it."""
    return PurePosixPath(image_path).with_suffix(".thumb.webp").as_posix()


def thumbnail_bytes(png: bytes) -> bytes | None:
    """A WebP thumbnail (longest side THUMBNAIL_SIDE) of a PNG larger than that, else None
    (also for a PNG that does not decode: the grid then shows the image itself)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(png)) as image:
            if max(image.size) <= THUMBNAIL_SIDE:
                return None
            image = image.convert("RGB")
            image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE), Image.Resampling.LANCZOS)
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    out = io.BytesIO()
    image.save(out, format="WEBP", quality=85, method=4)
    return out.getvalue()


def thumbnail_of(image_path: str) -> str | None:
    """The stored thumbnail of an image (a path under STORAGE_DIR), or None when it has none
    (small images are their own thumbnail)."""
    thumb = thumbnail_path_for(image_path)
    try:
        storage.resolve(thumb)
    except NotFound:
        return None
    return thumb


def record_rollout_group(session: Session, *, job_id: int | None, iteration: int,
                         solver: str, steps: int, sigma: float, seed: int,
                         samples: list[dict[str, Any]], prompt_text: str | None = None,
                         prompt_id: int | None = None, checkpoint_id: int | None = None,
                         purpose: str | None = None) -> int:
    """Write a group's PNGs under the storage dir and its rows (flush; the caller commits, e.g.
    `with session_scope() as s:`). Returns the group id.

    `samples`: [{"png": bytes, "member_index": int, "rewards": {name: float},
    "advantage": float | None, "is_anchor": bool (optional)}]. An image larger than
    THUMBNAIL_SIDE also gets a WebP thumbnail beside it (`thumbnail_path_for`).
    `purpose` defaults to the job's kind ("train", "rollout" or "evaluate"); evaluate groups
    from different checkpoints with the same prompt and seed become cross-checkpoint pairs.
    Idempotent: the same (job, iteration, prompt, checkpoint, seed) again returns the
    existing group without writing.
    """
    job = session.get(Job, job_id) if job_id is not None else None
    if job_id is not None and job is None:
        raise NotFound(f"job {job_id} not found")
    if prompt_id is not None:
        prompt = session.get(Prompt, prompt_id)
        if prompt is None:
            raise Invalid(f"prompt {prompt_id} not found", field="prompt_id")
        prompt_text = prompt_text or prompt.text
    if not prompt_text:
        raise Invalid("prompt_text or prompt_id is required", field="prompt_text")
    if checkpoint_id is not None and session.get(Checkpoint, checkpoint_id) is None:
        raise Invalid(f"checkpoint {checkpoint_id} not found", field="checkpoint_id")
    purpose = purpose or (job.kind if job is not None and job.kind in PURPOSES else "train")
    if purpose not in PURPOSES:
        raise Invalid(f"purpose must be one of {list(PURPOSES)}", field="purpose")
    if not samples:
        raise Invalid("a group needs at least one sample", field="samples")
    indices = [int(s["member_index"]) for s in samples]
    if len(set(indices)) != len(indices):
        raise Invalid("member_index values must be unique within a group", field="samples")
    for s in samples:
        if not bytes(s["png"]).startswith(PNG_SIGNATURE):
            raise Invalid(f"sample {s['member_index']}: png is not PNG data", field="samples")

    if job_id is not None:
        stmt = select(RolloutGroup.id).where(
            RolloutGroup.job_id == job_id, RolloutGroup.iteration == iteration,
            RolloutGroup.prompt_text == prompt_text, RolloutGroup.seed == seed,
            (RolloutGroup.checkpoint_id == checkpoint_id) if checkpoint_id is not None
            else RolloutGroup.checkpoint_id.is_(None),
        )
        existing = session.scalar(stmt.limit(1))
        if existing is not None:
            return existing

    group = RolloutGroup(job_id=job_id, iteration=iteration, purpose=purpose,
                         prompt_id=prompt_id, prompt_text=prompt_text,
                         checkpoint_id=checkpoint_id, solver=solver, steps=steps,
                         sigma=float(sigma), seed=int(seed))
    session.add(group)
    session.flush()
    written = []
    try:
        for s in samples:
            rel = image_path_for(group.id, int(s["member_index"]))
            written.append(storage.write_bytes(rel, bytes(s["png"])))
            thumb = thumbnail_bytes(bytes(s["png"]))
            if thumb is not None:
                written.append(storage.write_bytes(thumbnail_path_for(rel), thumb))
            session.add(Sample(
                group_id=group.id, member_index=int(s["member_index"]), image_path=rel,
                rewards={k: float(v) for k, v in (s.get("rewards") or {}).items()},
                advantage=None if s.get("advantage") is None else float(s["advantage"]),
                is_anchor=bool(s.get("is_anchor", False)),
            ))
        session.flush()
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return group.id


def newest_image_paths(session: Session, limit: int) -> list[str]:
    """The storage paths of the `limit` newest recorded samples' images, newest first."""
    return list(session.scalars(select(Sample.image_path).order_by(Sample.id.desc())
                                .limit(limit)))


def prompts_done(session: Session, job_id: int) -> set[int]:
    """The ids of the prompts a job has recorded a rollout group for (a resumed rollout job
    skips them)."""
    return set(session.scalars(select(RolloutGroup.prompt_id).where(
        RolloutGroup.job_id == job_id, RolloutGroup.prompt_id.is_not(None))))


def list_groups(session: Session, *, job_id: int | None = None, iteration: int | None = None,
                prompt_id: int | None = None, prompt: str | None = None,
                checkpoint_id: int | None = None, purpose: str | None = None,
                limit: int = 50, offset: int = 0) -> tuple[list[RolloutGroup], int]:
    # a filter naming a job, prompt or checkpoint that does not exist is a 404 (every such
    # one named), not an empty page that reads as "none yet"
    missing = [{"field": field, "message": f"{what} {value} not found"}
               for field, what, model, value in (("job_id", "job", Job, job_id),
                                                 ("prompt_id", "prompt", Prompt, prompt_id),
                                                 ("checkpoint_id", "checkpoint", Checkpoint,
                                                  checkpoint_id))
               if value is not None and session.get(model, value) is None]
    if missing:
        raise NotFound("; ".join(m["message"] for m in missing), field=missing[0]["field"],
                       errors=missing)
    stmt = select(RolloutGroup)
    if job_id is not None:
        stmt = stmt.where(RolloutGroup.job_id == job_id)
    if iteration is not None:
        stmt = stmt.where(RolloutGroup.iteration == iteration)
    if prompt_id is not None:
        stmt = stmt.where(RolloutGroup.prompt_id == prompt_id)
    if prompt is not None:
        stmt = stmt.where(RolloutGroup.prompt_text == prompt)
    if checkpoint_id is not None:
        stmt = stmt.where(RolloutGroup.checkpoint_id == checkpoint_id)
    if purpose is not None:
        stmt = stmt.where(RolloutGroup.purpose == purpose)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(
        stmt.options(selectinload(RolloutGroup.samples))
        .order_by(RolloutGroup.id.desc()).limit(limit).offset(offset)
    )
    return list(rows), total


def get_group(session: Session, group_id: int) -> RolloutGroup:
    group = session.scalar(
        select(RolloutGroup).where(RolloutGroup.id == group_id)
        .options(selectinload(RolloutGroup.samples))
    )
    if group is None:
        raise NotFound(f"rollout group {group_id} not found")
    return group


def source_label(purpose: str, job_id: int | None, iteration: int,
                 checkpoint: Checkpoint | None, job_kind: str | None) -> str:
    """Where a sample's image came from, in words: "training job N iteration I" (a train
    job's own rollouts), "checkpoint C of job N" (sampled from a checkpoint by a rollout or
    evaluate job; N is the checkpoint's training job) or "base model"."""
    if checkpoint is not None and is_base(checkpoint):
        return f"base model: {checkpoint.name.removeprefix('base ')} (#{checkpoint.id})"
    if checkpoint is not None:
        owner = f" of job {checkpoint.job_id}" if checkpoint.job_id is not None else ""
        return f"checkpoint {checkpoint.name} (#{checkpoint.id}){owner}"
    if job_id is not None and (job_kind == "train" or (job_kind is None and purpose == "train")):
        return f"training job {job_id} iteration {iteration}"
    return "base model"


def sample_details(session: Session, sample_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Where each sample came from, for display: member index, rewards, advantage, anchor flag
    and its group's job, iteration, purpose, prompt, seed, sigma, solver, steps and
    checkpoint (id and name); `source` says it in words (`source_label`). Unknown ids are
    left out."""
    if not sample_ids:
        return {}
    rows = session.execute(
        select(Sample, RolloutGroup, Checkpoint, Job.kind)
        .join(RolloutGroup, RolloutGroup.id == Sample.group_id)
        .outerjoin(Checkpoint, Checkpoint.id == RolloutGroup.checkpoint_id)
        .outerjoin(Job, Job.id == RolloutGroup.job_id)
        .where(Sample.id.in_(sample_ids))
    ).all()
    out: dict[int, dict[str, Any]] = {}
    for s, g, ckpt, job_kind in rows:
        out[s.id] = {
            "sample_id": s.id, "member_index": s.member_index, "image_path": s.image_path,
            "rewards": dict(s.rewards or {}), "advantage": s.advantage,
            "is_anchor": s.is_anchor, "group_id": g.id, "job_id": g.job_id,
            "job_kind": job_kind, "iteration": g.iteration, "purpose": g.purpose,
            "prompt": g.prompt_text, "seed": g.seed, "sigma": g.sigma, "solver": g.solver,
            "steps": g.steps, "checkpoint_id": g.checkpoint_id,
            "checkpoint_job_id": ckpt.job_id if ckpt is not None else None,
            "checkpoint": ckpt.name if ckpt is not None else (
                "base model" if g.checkpoint_id is None else f"checkpoint {g.checkpoint_id}"),
            "source": source_label(g.purpose, g.job_id, g.iteration, ckpt, job_kind),
        }
    return out
