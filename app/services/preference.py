"""Human-preference models (issue 6): the persisted versions, the votes a fit reads, and the
per-sample preference scores that active pair selection uses.

The fitting itself is `trainer.rewards.preference` (pure PyTorch); the worker
(`worker/preference.py`) reads votes through `fit_votes`, writes the file under
`STORAGE_DIR/preference/vN.safetensors`, records it with `record_model` and caches every stored
sample's score with `set_scores`. Functions take a Session first and flush; no commits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session, aliased

from app.errors import NotFound
from app.limits import MAX_ID
from app.models import PreferenceModelRow, RolloutGroup, Sample, Vote
from app.services import storage

# ASCII digits only: str.isdigit() is also true of "²" and other digits int() refuses
_VERSION = re.compile(r"v?([0-9]+)")


@dataclass(frozen=True)
class PreferenceSpec:
    """What a train config's `preference_model` names: the newest fitted model, version N,
    or a safetensors file (a path, resolved by `storage.job_path`)."""

    kind: Literal["latest", "version", "path"]
    version: int = 0  # kind "version"
    path: str = ""  # kind "path"


def parse_spec(spec: str) -> PreferenceSpec:
    """The one reading of `preference_model` (submission and the worker both use it): "" or
    "latest" -> the newest model; "vN" or "N" (ASCII digits) -> version N; else a path."""
    spec = spec.strip()
    if spec in ("", "latest"):
        return PreferenceSpec("latest")
    if (match := _VERSION.fullmatch(spec)) is not None:
        return PreferenceSpec("version", version=int(match.group(1)))
    return PreferenceSpec("path", path=spec)


def list_models(session: Session, limit: int = 100, offset: int = 0
                ) -> tuple[list[PreferenceModelRow], int]:
    """Newest first, and the total."""
    total = session.scalar(select(func.count()).select_from(PreferenceModelRow)) or 0
    rows = session.scalars(select(PreferenceModelRow).order_by(PreferenceModelRow.version.desc())
                           .limit(limit).offset(offset))
    return list(rows), total


def latest_model(session: Session) -> PreferenceModelRow | None:
    return session.scalar(select(PreferenceModelRow)
                          .order_by(PreferenceModelRow.version.desc()).limit(1))


def get_model(session: Session, version: int) -> PreferenceModelRow:
    # one message however the version was spelled (3, v3, 0003); out of range there is no
    # such row, and PostgreSQL would refuse the query
    row = (session.scalar(select(PreferenceModelRow).where(PreferenceModelRow.version == version))
           if 1 <= version <= MAX_ID else None)
    if row is None:
        raise NotFound(f"preference model v{version} not found")
    return row


def next_version(session: Session) -> int:
    return (session.scalar(select(func.max(PreferenceModelRow.version))) or 0) + 1


def version_exists(session: Session, version: int) -> bool:
    """Whether a preference model row holds `version`."""
    return session.scalar(select(func.count()).select_from(PreferenceModelRow)
                          .where(PreferenceModelRow.version == version)) > 0


def model_path(version: int) -> str:
    """Where version N's file goes, relative to the storage directory."""
    return f"preference/v{version}.safetensors"


def record_model(session: Session, *, version: int, path: str, report: dict[str, Any],
                 job_id: int | None = None, votes_used: int = 0, last_vote_id: int = 0,
                 checkpoint_ids: list[int | None] | None = None) -> PreferenceModelRow:
    """Write the row for a saved model file (path relative to the storage dir). Flushes."""
    row = PreferenceModelRow(
        version=version, path=path, job_id=job_id, votes_used=votes_used,
        last_vote_id=last_vote_id, checkpoint_ids=list(checkpoint_ids or []), report=report,
        heldout_accuracy=report.get("heldout_accuracy"),
        heldout_log_loss=report.get("heldout_log_loss"))
    session.add(row)
    session.flush()
    return row


def settled_vote_id(session: Session) -> int:
    """The newest vote id at or below which no vote is still being written (0: no votes): a
    fit that reads the votes up to it has read every vote it will ever have, so that it can
    record it as its `last_vote_id` and an online refit counts what came after it
    (`votes_since`) without missing any.

    PostgreSQL draws a vote's id at its insert, and two annotators' votes commit in either
    order: the newest committed id alone could be above one still in flight, which a fit
    reading then never saw and no refit would count. A SHARE lock on the table waits for the
    votes being written (their inserts hold ROW EXCLUSIVE) and keeps new ones out while the
    newest id is read; it is taken in a transaction of its own, so that voting waits only for
    that read, never for a fit's. `session` must not have written votes in its open
    transaction (the lock would wait for it). SQLite writes one transaction at a time and
    gives each vote the next id under that lock: ids commit in order, and the newest is it."""
    newest = select(func.max(Vote.id))
    engine = session.get_bind().engine
    if engine.dialect.name != "postgresql":
        return session.scalar(newest) or 0
    with engine.connect() as conn, conn.begin():
        conn.execute(text("LOCK TABLE votes IN SHARE MODE"))
        return conn.scalar(newest) or 0


def fit_votes(session: Session, *, include_excluded: bool = False,
              up_to: int | None = None) -> list[dict[str, Any]]:
    """Every vote (not excluded unless asked; with `up_to`, those with an id at or below it)
    with what a fit needs: the left (a) and right (b) image paths, the prompt, the outcome,
    and the checkpoints the samples came from."""
    sa, sb = aliased(Sample), aliased(Sample)
    ga, gb = aliased(RolloutGroup), aliased(RolloutGroup)
    stmt = (select(Vote.id, Vote.outcome, sa.image_path, sb.image_path, ga.prompt_text,
                   ga.checkpoint_id, gb.checkpoint_id)
            .join(sa, sa.id == Vote.sample_a_id).join(sb, sb.id == Vote.sample_b_id)
            .join(ga, ga.id == sa.group_id).join(gb, gb.id == sb.group_id)
            .order_by(Vote.id))
    if not include_excluded:
        stmt = stmt.where(Vote.excluded.is_(False))
    if up_to is not None:
        stmt = stmt.where(Vote.id <= up_to)
    return [{"vote_id": vid, "outcome": outcome, "a_path": pa, "b_path": pb, "prompt": prompt,
             "checkpoint_ids": (ca, cb)}
            for vid, outcome, pa, pb, prompt, ca, cb in session.execute(stmt)]


def readable_votes(rows: list[dict[str, Any]], features: str,
                   image_shape: Callable[[str], tuple[int, ...]]
                   ) -> tuple[list[dict[str, Any]], int]:
    """The votes (fit_votes rows) whose two images a fit with `features` reads, and how many
    were left out: trainer.rewards.preference.readable_votes, the rule `fit-preference` applies
    too. `image_shape(path)`: an image's (H, W, ...), asked only once its prompt passed."""
    from trainer.rewards.preference import readable_votes as readable

    return readable(rows, features, lambda row: row["prompt"],
                    lambda row: (image_shape(row[side]) for side in ("a_path", "b_path")))


def stored_image_shape(rel_path: str) -> tuple[int, int]:
    """(height, width) of a stored image from its header alone; (0, 0) when it cannot be
    read. Kept by file (path, modification time and size): a fit's submission asks for every
    voted image, and most were asked for by the one before."""
    try:
        path = storage.resolve(rel_path)
        stat = path.stat()
    except (OSError, ValueError, NotFound):
        return 0, 0
    return _image_shape(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=100_000)
def _image_shape(path: str, _mtime_ns: int, _size: int) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.height, image.width
    except (OSError, ValueError):
        return 0, 0


def readable_clean_vote_count(session: Session, features: str) -> tuple[int, int]:
    """(clean votes a fit with `features` learns from, clean votes it would leave out)."""
    from trainer.rewards.outcomes import LABELLED_OUTCOMES

    if features != "shapes":
        return clean_vote_count(session), 0
    rows = [r for r in fit_votes(session) if r["outcome"] in LABELLED_OUTCOMES]
    readable, unreadable = readable_votes(rows, features, stored_image_shape)
    return len(readable), unreadable


def clean_vote_count(session: Session) -> int:
    """Votes a fit learns from: not excluded, with a preference (a, b or tie)."""
    from trainer.rewards.outcomes import LABELLED_OUTCOMES

    return session.scalar(select(func.count()).select_from(Vote).where(
        Vote.excluded.is_(False), Vote.outcome.in_(LABELLED_OUTCOMES))) or 0


def votes_short_of_a_fit(clean: int, min_votes: int = 0) -> int | None:
    """The votes a fit needs when `clean` clean votes are too few to start one (fewer than
    MIN_FIT_VOTES or the job's `min_votes`), else None: the rule of submission and of the
    fit job alike."""
    from trainer.rewards.fit_config import MIN_FIT_VOTES

    needed = max(min_votes, MIN_FIT_VOTES)
    return needed if clean < needed else None


def votes_since(session: Session, vote_id: int, up_to: int | None = None) -> int:
    """Clean (not excluded) labelled votes newer than `vote_id` (and at most `up_to`): what an
    online refit would add, or did add (a skip or both_bad vote gives a fit nothing to
    learn)."""
    from trainer.rewards.outcomes import LABELLED_OUTCOMES

    stmt = select(func.count()).select_from(Vote).where(
        Vote.id > vote_id, Vote.excluded.is_(False), Vote.outcome.in_(LABELLED_OUTCOMES))
    if up_to is not None:
        stmt = stmt.where(Vote.id <= up_to)
    return session.scalar(stmt) or 0


def iter_samples(session: Session, batch: int = 2000) -> Iterator[list[tuple[int, str, str]]]:
    """Batches of (sample id, image path, prompt) over every stored sample."""
    last = 0
    while True:
        rows = session.execute(
            select(Sample.id, Sample.image_path, RolloutGroup.prompt_text)
            .join(RolloutGroup, RolloutGroup.id == Sample.group_id)
            .where(Sample.id > last).order_by(Sample.id).limit(batch)).all()
        if not rows:
            return
        yield [(r[0], r[1], r[2]) for r in rows]
        last = rows[-1][0]


def set_scores(session: Session, scores: dict[int, float], version: int) -> None:
    """Cache preference scores (model `version`) on samples. Flushes."""
    if not scores:
        return
    session.execute(update(Sample), [{"id": sid, "preference_score": float(score),
                                      "preference_version": version}
                                     for sid, score in scores.items()])
    session.flush()


def to_dict(row: PreferenceModelRow) -> dict[str, Any]:
    return {"id": row.id, "version": row.version, "path": row.path, "job_id": row.job_id,
            "votes_used": row.votes_used, "last_vote_id": row.last_vote_id,
            "checkpoint_ids": row.checkpoint_ids, "heldout_accuracy": row.heldout_accuracy,
            "heldout_log_loss": row.heldout_log_loss, "report": row.report,
            "created_at": row.created_at}
