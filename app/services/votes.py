"""Pairwise votes: choosing the next pair for an annotator, recording votes, exporting them.

Pair selection is a list of strategies, each `(session, annotator_id, rng, exclude) ->
PairChoice | None`, registered by name in `STRATEGIES` and tried in a random order weighted
by `WEIGHTS`; the name goes on the vote as `selection`. Active selection (`active`, issue 6)
goes first for all but `Settings.vote_random_share` of the requests once a preference model
has scored the samples; its reason (`active_uncertain`, `active_disagree`) is the selection. Every strategy must return only pairs the annotator
has not judged; the unique index (annotator, pair_lo_id, pair_hi_id) enforces it on insert.

Pairs whose two stored images are nearly identical (`near_identical`: neighbours of one noise
often draw the same picture, and two close checkpoints the same picture from one noise) are
never offered: a person's vote on them is a coin toss, and active selection, whose least-sure pair is often such a pair (equal images, equal
scores), passes over them too while keeping its share. A pick that had to pass over such pairs
says so in its selection: `within_group_skipped_near_identical`,
`cross_checkpoint_skipped_near_identical`, `active_uncertain_skipped_near_identical`,
`active_disagree_skipped_near_identical`.
Every vote keeps the distance of its pair (`pixel_difference`, measured from the stored images
when it is recorded) beside its selection, so the rule's threshold can be checked and tuned
from the votes themselves.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy import and_, case, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from app.errors import Conflict, Invalid
from app.limits import CLIENT_VOTE_ID_PATTERN, MAX_ID, SELECTION_LENGTH, SQL_BATCH
from app.models import RolloutGroup, Sample, User, Vote
from app.schemas import (
    CROSS_CHECKPOINT,
    CROSS_SELECTIONS,
    SKIPPED_SUFFIX,
    refuse_hidden,
    refuse_nul,
    selection_problem,
    shown_at_problem,
    utc_text,
)
from trainer.rewards.outcomes import OUTCOMES, TARGET_A
from trainer.rewards.shapes import PictureObject, picture_objects, same_objects

log = logging.getLogger(__name__)


@dataclass
class PairChoice:
    a_id: int  # shown on the left
    b_id: int  # shown on the right
    prompt: str
    selection: str
    a_path: str = ""
    b_path: str = ""


Strategy = Callable[[Session, int, random.Random, set[int]], PairChoice | None]
_TRIES = 6


def _judged(session: Session, annotator_id: int, ids: list[int]) -> set[tuple[int, int]]:
    if not ids:
        return set()
    rows = session.execute(
        select(Vote.pair_lo_id, Vote.pair_hi_id).where(
            Vote.annotator_id == annotator_id, Vote.pair_lo_id.in_(ids), Vote.pair_hi_id.in_(ids)
        )
    )
    return {(r[0], r[1]) for r in rows}


class _IdRange:
    """min/max rollout group id per filter, cached briefly (groups only ever get added)."""

    def __init__(self, ttl: float = 2.0) -> None:
        self.ttl = ttl
        self._items: dict[str, tuple[int | None, int | None, float]] = {}

    def get(self, session: Session, key: str, *conds: Any) -> tuple[int | None, int | None]:
        item = self._items.get(key)
        if item is not None and item[2] > time.monotonic():
            return item[0], item[1]
        lo, hi = session.execute(select(func.min(RolloutGroup.id), func.max(RolloutGroup.id))
                                 .where(*conds)).one()
        self._items[key] = (lo, hi, time.monotonic() + self.ttl)
        return lo, hi

    def clear(self) -> None:
        self._items.clear()


_id_range = _IdRange()


def _random_group_id(session: Session, rng: random.Random, key: str = "all",
                     *conds: Any) -> int | None:
    lo, hi = _id_range.get(session, key, *conds)
    if lo is None or hi is None:
        return None
    pivot = rng.randint(lo, hi)
    gid = session.scalar(
        select(RolloutGroup.id).where(RolloutGroup.id >= pivot, *conds)
        .order_by(RolloutGroup.id).limit(1)
    )
    if gid is None:  # the cached range is stale (a group was deleted)
        _id_range._items.pop(key, None)
    return gid


# --- near-identical images ---------------------------------------------------------------
# Images are compared at the shapes world's 32x32 (larger ones are box-downsampled to it).
COMPARE_SIZE = 32
# A pixel counts as different when one of its channels differs by more than this (of 255):
# smaller shifts are a faint tint change nobody can judge on a screen.
PIXEL_TOLERANCE = 24
# Two images are nearly identical when fewer than this fraction of their pixels differ: 1% is
# about 10 of 1,024 pixels, a third of the smallest object the shapes world draws (6x6, ~28
# pixels for a circle), so any added, removed, moved or recoloured object clears it while
# neighbours of one noise that drew the same picture (a few edge pixels apart) do not.
NEAR_IDENTICAL_FRACTION = 0.01


class _ImageCache:
    """image path -> its (32, 32, 3) int16 array and, for a shapes-world picture (drawn at
    32x32 itself, not downsampled to it), its objects; bounded (rollout images never change)."""

    def __init__(self, max_size: int = 8192) -> None:
        self.max_size = max_size
        self._items: dict[str, tuple[np.ndarray, list[PictureObject] | None] | None] = {}
        self._lock = threading.Lock()

    def get(self, rel_path: str) -> np.ndarray | None:
        entry = self._entry(rel_path)
        return entry[0] if entry is not None else None

    def objects(self, rel_path: str) -> list[PictureObject] | None:
        """The shapes-world objects of the image (None: not a 32x32 shapes picture
        (`picture_objects`), or unreadable)."""
        entry = self._entry(rel_path)
        return entry[1] if entry is not None else None

    def _entry(self, rel_path: str) -> tuple[np.ndarray, list[PictureObject] | None] | None:
        from PIL import Image

        from app.services import storage

        try:
            path = storage.resolve(rel_path)
        except Exception as exc:  # noqa: BLE001 - a path outside storage is never "identical"
            log.warning("cannot compare image %s: %s", rel_path, exc)
            return None
        key = str(path)  # absolute: one process may serve several storage roots (tests)
        if key in self._items:
            return self._items[key]
        entry: tuple[np.ndarray, list[PictureObject] | None] | None
        try:
            with Image.open(path) as img:
                img = img.convert("RGB")
                native = img.size == (COMPARE_SIZE, COMPARE_SIZE)
                if not native:
                    img = img.resize((COMPARE_SIZE, COMPARE_SIZE), Image.Resampling.BOX)
                arr = np.asarray(img, dtype=np.int16)
            # a real model's image downsampled has blobs of a palette colour by chance: only
            # the shapes world's own canvases are read as objects
            entry = (arr, picture_objects(arr.astype(np.uint8)) if native else None)
        except Exception as exc:  # noqa: BLE001 - a missing or broken file is never "identical"
            log.warning("cannot compare image %s: %s", rel_path, exc)
            entry = None
        with self._lock:
            if len(self._items) >= self.max_size:
                self._items.clear()
            self._items[key] = entry
        return entry

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_images = _ImageCache()


def differing_fraction(a_path: str, b_path: str) -> float | None:
    """The fraction of pixels whose colour differs by more than PIXEL_TOLERANCE in some
    channel (None when an image cannot be read)."""
    a, b = _images.get(a_path), _images.get(b_path)
    if a is None or b is None:
        return None
    return float((np.abs(a - b).max(axis=-1) > PIXEL_TOLERANCE).mean())  # (32, 32) -> scalar


def near_identical(a_path: str, b_path: str) -> bool:
    """Whether two images look the same: fewer than NEAR_IDENTICAL_FRACTION of their pixels
    differ, or they are shapes-world pictures of the same objects in the same places
    (trainer.rewards.shapes.same_objects: a few edge pixels apart can be more than 1%)."""
    frac = differing_fraction(a_path, b_path)
    if frac is None:
        return False
    if frac < NEAR_IDENTICAL_FRACTION:
        return True
    return same_objects(_images.objects(a_path), _images.objects(b_path))


def _pick(session: Session, annotator_id: int, rng: random.Random,
          pairs: list[tuple[tuple[int, str], tuple[int, str]]], exclude: set[int], prompt: str,
          selection: str, *, distinct: bool = False) -> PairChoice | None:
    """A random unjudged pair; with `distinct`, never one of nearly identical images (the
    selection then says whether any had to be passed over)."""
    pairs = [(x, y) for x, y in pairs if x[0] not in exclude and y[0] not in exclude]
    if not pairs:
        return None
    ids = sorted({x[0] for p in pairs for x in p})
    judged = _judged(session, annotator_id, ids)
    fresh = [(x, y) for x, y in pairs if (min(x[0], y[0]), max(x[0], y[0])) not in judged]
    if not fresh:
        return None
    rng.shuffle(fresh)
    skipped = 0
    for x, y in fresh:
        if distinct and near_identical(x[1], y[1]):
            skipped += 1
            continue
        if rng.random() < 0.5:
            x, y = y, x
        return PairChoice(x[0], y[0], prompt, selection + SKIPPED_SUFFIX if skipped else selection,
                          x[1], y[1])
    return None


def _group_pairs(session: Session, group_id: Any) -> tuple[str, list]:
    """(prompt, all member pairs) of a group; `group_id` may be a scalar subquery."""
    rows = session.execute(
        select(Sample.id, Sample.image_path, RolloutGroup.prompt_text)
        .join(RolloutGroup, RolloutGroup.id == Sample.group_id)
        .where(Sample.group_id == group_id)
    ).all()
    prompt = rows[0][2] if rows else ""
    members = [(r[0], r[1]) for r in rows]
    return prompt, list(itertools.combinations(members, 2))


def within_group(session: Session, annotator_id: int, rng: random.Random,
                 exclude: set[int]) -> PairChoice | None:
    """Two members of one rollout group (same prompt, neighbouring noises)."""
    for _ in range(_TRIES):
        lo, hi = _id_range.get(session, "all")
        if lo is None or hi is None:
            return None
        pivot = rng.randint(lo, hi)
        gid = (select(RolloutGroup.id).where(RolloutGroup.id >= pivot)
               .order_by(RolloutGroup.id).limit(1).scalar_subquery())
        prompt, pairs = _group_pairs(session, gid)
        choice = _pick(session, annotator_id, rng, pairs, exclude, prompt, "within_group",
                       distinct=True)
        if choice:
            return choice
    return _scan(session, annotator_id, rng, exclude, cross=False)


# Rows one _scan query reads at a time; it pages on until a page has a pair to offer.
SCAN_PAGE = 200


def _scan(session: Session, annotator_id: int, rng: random.Random, exclude: set[int], *,
          cross: bool) -> PairChoice | None:
    """When random probing finds nothing (nearly everything judged): unjudged pairs read page
    by page (keyset on the pair's ids) from a random start, wrapping round once, so a pair
    that exists is always found, however many nearly identical pairs come before it."""
    s1, s2 = aliased(Sample), aliased(Sample)
    g1, g2 = aliased(RolloutGroup), aliased(RolloutGroup)
    lo = case((s1.id < s2.id, s1.id), else_=s2.id)
    hi = case((s1.id < s2.id, s2.id), else_=s1.id)
    stmt = (select(s1.id, s1.image_path, s2.id, s2.image_path, g1.prompt_text)
            .join(g1, g1.id == s1.group_id))
    if cross:
        stmt = (stmt.join(g2, and_(g2.purpose == "evaluate", g2.prompt_text == g1.prompt_text,
                                   g2.seed == g1.seed, g2.checkpoint_id > g1.checkpoint_id))
                .join(s2, and_(s2.group_id == g2.id, s2.member_index == s1.member_index))
                .where(g1.purpose == "evaluate", g1.checkpoint_id.is_not(None)))
    else:
        stmt = stmt.join(s2, and_(s2.group_id == s1.group_id, s2.id > s1.id))
    stmt = stmt.outerjoin(Vote, and_(Vote.annotator_id == annotator_id, Vote.pair_lo_id == lo,
                                     Vote.pair_hi_id == hi)).where(Vote.id.is_(None))
    if exclude:
        stmt = stmt.where(s1.id.not_in(exclude), s2.id.not_in(exclude))
    stmt = stmt.order_by(s1.id, s2.id)
    lo_id, hi_id = session.execute(select(func.min(Sample.id), func.max(Sample.id))).one()
    start = rng.randint(lo_id, hi_id) if lo_id is not None and hi_id is not None else 0
    skipped = 0
    # [start, end) then [0, start): the random start spreads annotators over the pool
    for lower, upper in ((start, None), (0, start)) if start else ((0, None),):
        after: tuple[int, int] | None = None
        while True:
            page = stmt.where(s1.id >= lower) if lower else stmt
            page = page.where(s1.id < upper) if upper is not None else page
            if after is not None:  # keyset: the rows after the last one read
                page = page.where((s1.id > after[0]) | and_(s1.id == after[0], s2.id > after[1]))
            rows = session.execute(page.limit(SCAN_PAGE)).all()
            if not rows:
                break
            after = (rows[-1][0], rows[-1][2])
            # nearly identical images are never offered (a coin toss for the annotator; for
            # two checkpoints, a picture both draw alike says nothing about which is better)
            kept = [r for r in rows if not near_identical(r[1], r[3])]
            skipped += len(rows) - len(kept)
            if kept:
                return _scanned(rng, kept, cross, skipped)
            if len(rows) < SCAN_PAGE:
                break
    return None


def _scanned(rng: random.Random, rows: list, cross: bool, skipped: int) -> PairChoice:
    a_id, a_path, b_id, b_path, prompt = rng.choice(rows)
    if rng.random() < 0.5:
        a_id, a_path, b_id, b_path = b_id, b_path, a_id, a_path
    selection = (CROSS_CHECKPOINT if cross else "within_group") + (
        SKIPPED_SUFFIX if skipped else "")
    return PairChoice(a_id, b_id, prompt, selection, a_path, b_path)


def cross_checkpoint(session: Session, annotator_id: int, rng: random.Random,
                     exclude: set[int]) -> PairChoice | None:
    """The same prompt and seed (and member) from two checkpoints: evaluation groups."""
    is_eval = and_(RolloutGroup.purpose == "evaluate", RolloutGroup.checkpoint_id.is_not(None))
    for _ in range(_TRIES):
        gid = _random_group_id(session, rng, "evaluate", is_eval)
        if gid is None:
            return None
        g = session.get(RolloutGroup, gid)
        assert g is not None
        other = aliased(RolloutGroup)
        rows = session.execute(
            select(Sample.id, Sample.image_path, Sample.member_index, other.checkpoint_id)
            .join(other, other.id == Sample.group_id)
            .where(other.purpose == "evaluate", other.prompt_text == g.prompt_text,
                   other.seed == g.seed, other.checkpoint_id.is_not(None))
        ).all()
        by_ckpt: dict[int, dict[int, tuple[int, str]]] = {}
        for sid, path, member, ckpt in rows:
            by_ckpt.setdefault(ckpt, {})[member] = (sid, path)
        mine = by_ckpt.pop(g.checkpoint_id, {})  # type: ignore[arg-type]
        pairs = [(s, theirs[m]) for theirs in by_ckpt.values() for m, s in mine.items()
                 if m in theirs]
        choice = _pick(session, annotator_id, rng, pairs, exclude, g.prompt_text,
                       CROSS_CHECKPOINT, distinct=True)
        if choice:
            return choice
    return _scan(session, annotator_id, rng, exclude, cross=True)


STRATEGIES: dict[str, Strategy] = {"within_group": within_group,
                                   "cross_checkpoint": cross_checkpoint}
WEIGHTS: dict[str, float] = {"within_group": 1.0, "cross_checkpoint": 1.0}


# --- active selection (issue 6) --------------------------------------------------------------
class _PreferenceVersion:
    """The newest preference model's version, cached briefly (a tiny table, read per request)."""

    def __init__(self, ttl: float = 2.0) -> None:
        self.ttl = ttl
        self._value: tuple[int | None, float] = (None, 0.0)

    def get(self, session: Session) -> int | None:
        value, until = self._value
        if until > time.monotonic():
            return value
        from app.models import PreferenceModelRow

        value = session.scalar(select(func.max(PreferenceModelRow.version)))
        self._value = (value, time.monotonic() + self.ttl)
        return value

    def clear(self) -> None:
        self._value = (None, 0.0)


_pref_version = _PreferenceVersion()
ACTIVE_GROUPS = 4  # consecutive rollout groups from a random pivot: the candidate pool
ACTIVE_DISAGREE_SHARE = 0.25  # of active picks: where automatic reward and preference disagree


def automatic_reward(rewards: dict[str, Any] | None) -> float | None:
    """A sample's automatic reward: its `total` if stored, else the sum of its named rewards."""
    if not rewards:
        return None
    if "total" in rewards:
        return float(rewards["total"])
    vals = [float(v) for v in rewards.values() if isinstance(v, int | float)]
    return sum(vals) if vals else None


def active(session: Session, annotator_id: int, rng: random.Random,
           exclude: set[int]) -> PairChoice | None:
    """A within-group pair the current preference model is least sure about
    (|P(a beats b) - 0.5| smallest: `active_uncertain`) or, for a share of picks, one where the
    automatic reward and the preference model disagree (`active_disagree`), among the
    unjudged pairs of a few rollout groups, nearly identical images never. Reads the scores
    the fit_preference job cached on the samples; never runs the network. None until a model
    has scored the samples."""
    version = _pref_version.get(session)
    if version is None:
        return None
    for _ in range(2):
        lo, hi = _id_range.get(session, "all")
        if lo is None or hi is None:
            return None
        pivot = rng.randint(lo, hi)
        gids = (select(RolloutGroup.id).where(RolloutGroup.id >= pivot)
                .order_by(RolloutGroup.id).limit(ACTIVE_GROUPS))
        rows = session.execute(
            select(Sample.id, Sample.image_path, Sample.group_id, Sample.preference_score,
                   Sample.rewards, RolloutGroup.prompt_text)
            .join(RolloutGroup, RolloutGroup.id == Sample.group_id)
            .where(Sample.group_id.in_(gids), Sample.preference_version == version)
        ).all()
        rows = [r for r in rows if r[0] not in exclude]
        by_group: dict[int, list] = {}
        for r in rows:
            by_group.setdefault(r[2], []).append(r)
        judged = _judged(session, annotator_id, sorted(r[0] for r in rows))
        uncertain: list[tuple[float, Any, Any]] = []
        disagree: list[tuple[Any, Any]] = []
        for members in by_group.values():
            for x, y in itertools.combinations(members, 2):
                if (min(x[0], y[0]), max(x[0], y[0])) in judged:
                    continue
                margin = float(x[3]) - float(y[3])  # logit of P(x beats y)
                uncertain.append((abs(margin), x, y))
                rx, ry = automatic_reward(x[4]), automatic_reward(y[4])
                if rx is not None and ry is not None and rx != ry and margin != 0 \
                        and (rx > ry) != (margin > 0):
                    disagree.append((x, y))
        if not uncertain:
            continue
        if disagree and rng.random() < ACTIVE_DISAGREE_SHARE:
            candidates, reason = rng.sample(disagree, len(disagree)), "active_disagree"
        else:
            uncertain.sort(key=lambda t: (t[0], rng.random()))
            candidates, reason = [(x, y) for _, x, y in uncertain], "active_uncertain"
        # never nearly identical images, as the other strategies: such a pair's margin is
        # near 0, so the least-sure pair would often be one, and its vote a coin toss
        passed_over = 0
        for x, y in candidates:
            if not near_identical(x[1], y[1]):
                break
            passed_over += 1
        else:
            continue
        if passed_over:  # said on the vote, as within-group picks say it
            reason += SKIPPED_SUFFIX
        if rng.random() < 0.5:
            x, y = y, x
        return PairChoice(x[0], y[0], x[5], reason, x[1], y[1])
    return None


def _default_order(session: Session, rng: random.Random
                   ) -> tuple[dict[str, Strategy], dict[str, float]] | None:
    """Active first (once a preference model exists), except for the configured uniformly
    random share; None: the random strategies only."""
    from app.config import get_settings

    settings = get_settings()
    if not settings.vote_active or _pref_version.get(session) is None:
        return None
    if rng.random() < settings.vote_random_share:
        return None
    return {"active": active, **STRATEGIES}, {"active": 1e9, **WEIGHTS}


def next_pair(session: Session, annotator_id: int, *, rng: random.Random | None = None,
              exclude: Iterable[int] = (), strategies: dict[str, Strategy] | None = None,
              weights: dict[str, float] | None = None) -> PairChoice | None:
    """A pair this annotator has not judged, sides randomised; None when none is left.
    `exclude`: sample ids not to use (e.g. the pair on screen, when prefetching)."""
    rng = rng or random.Random()
    if strategies is None:
        chosen = _default_order(session, rng)
        if chosen is not None:
            strategies, weights = chosen
    strategies = strategies or STRATEGIES
    weights = weights or WEIGHTS
    names = list(strategies)
    # weighted random order without replacement
    order = sorted(names, key=lambda n: rng.random() ** (1.0 / max(weights.get(n, 1.0), 1e-9)),
                   reverse=True)
    ex = set(exclude)
    for name in order:
        choice = strategies[name](session, annotator_id, rng, ex)
        if choice is not None:
            return choice
    return None


# --- recording -----------------------------------------------------------------------------
def _valid_pair(session: Session, a_id: int, b_id: int) -> tuple[str, str, bool]:
    """Raise Invalid unless a and b may be compared; return their image paths and whether
    they are a cross-checkpoint pair (else two members of one group)."""
    if a_id == b_id:
        raise Invalid("sample_a_id and sample_b_id must differ", field="sample_b_id")
    rows = {r[0]: r for r in session.execute(
        select(Sample.id, RolloutGroup.id, RolloutGroup.purpose, RolloutGroup.prompt_text,
               RolloutGroup.checkpoint_id, Sample.image_path, RolloutGroup.seed,
               Sample.member_index)
        .join(RolloutGroup, RolloutGroup.id == Sample.group_id)
        .where(Sample.id.in_([a_id, b_id]))
    )}
    # both named when both are missing: every problem of the request at once
    missing = [{"field": field, "message": f"sample {sid} not found"}
               for field, sid in (("sample_a_id", a_id), ("sample_b_id", b_id))
               if sid not in rows]
    if missing:
        raise Invalid("; ".join(f"{m['field']}: {m['message']}" for m in missing),
                      field=missing[0]["field"], errors=missing)
    a, b = rows[a_id], rows[b_id]
    if a[1] == b[1]:
        return a[5], b[5], False
    # the pair cross_checkpoint offers: one starting noise (prompt, seed and member) from two
    # checkpoints, so the vote judges the checkpoints and not two draws of the noise
    if (a[2] == b[2] == "evaluate" and a[3] == b[3] and a[4] is not None
            and b[4] is not None and a[4] != b[4] and a[6:] == b[6:]):
        return a[5], b[5], True
    raise Invalid("the samples are neither from one rollout group nor the same prompt, seed "
                  "and member from two checkpoints", field="sample_b_id")


def _selection_mismatch(selection: str | None, cross: bool) -> str | None:
    """Why `selection` cannot be how this pair was chosen: GET /api/votes/next gives
    `cross_checkpoint` for two checkpoints' samples and the within-group or active reasons
    for two members of one group. A wrong one would count the vote under a strategy that
    did not pick it (the selection-bias checks the export is for)."""
    if selection is None or (selection in CROSS_SELECTIONS) == cross:
        return None
    if cross:
        return (f"{selection!r} is not how a pair from two checkpoints is chosen; "
                f"{' or '.join(map(repr, CROSS_SELECTIONS))} is, or leave it out")
    return (f"{selection!r} is not how two members of one rollout group are chosen; "
            "give the selection GET /api/votes/next gave, or leave it out")


def pair_problems(session: Session, a_id: int, b_id: int,
                  selection: str | None = None) -> list[dict[str, str]]:
    """What is wrong with voting on the pair (a, b) under `selection` (a well-formed one, or
    None), every problem as {field, message}; [] for a pair that may be voted on. Read only:
    said beside a vote's other problems (a shown_at in the future), so that one answer names
    them all."""
    try:
        _, _, cross = _valid_pair(session, a_id, b_id)
    except Invalid as exc:
        return list(exc.details.get("errors") or [  # type: ignore[arg-type]
            {"field": str(exc.details.get("field", "sample_b_id")), "message": exc.message}])
    if (mismatch := _selection_mismatch(selection, cross)) is not None:
        return [{"field": "selection", "message": mismatch}]
    return []


def pair_problems_beside(body: object, invalid: set[str]) -> list[tuple[str, str]]:
    """The pair's problems (pair_problems) of a POST /api/votes body that failed validation
    elsewhere, as (field, message), for the same 422; none where the ids themselves, or the
    selection, are among the invalid fields (their own problem is said already)."""
    if not isinstance(body, dict):
        return []
    a_id, b_id, selection = (body.get(k) for k in ("sample_a_id", "sample_b_id", "selection"))
    ids_usable = all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_ID
                     for v in (a_id, b_id))
    if not ids_usable or invalid & {"sample_a_id", "sample_b_id"}:
        return []
    usable_selection = (selection if isinstance(selection, str) and "selection" not in invalid
                        else None)
    from app.db import new_session

    with new_session() as session:
        return [(p["field"], p["message"])
                for p in pair_problems(session, a_id, b_id, usable_selection)]


def record_vote(session: Session, annotator: User, *, client_vote_id: str, sample_a_id: int,
                sample_b_id: int, outcome: str, session_id: str | None = None,
                shown_at: datetime | None = None, latency_ms: int | None = None,
                selection: str | None = None) -> tuple[Vote, bool]:
    """Record one vote and COMMIT. Returns (vote, created). The same client_vote_id again
    with the same vote (pair, sides and outcome) is a retry: the first vote with created=False;
    with a different vote it is a Conflict, as is a pair already judged."""
    if outcome not in OUTCOMES:
        raise Invalid(f"outcome must be one of {list(OUTCOMES)}", field="outcome")
    # the API's schema checks it too; the UI's comes from the browser as it is
    if not isinstance(client_vote_id, str) or not re.fullmatch(CLIENT_VOTE_ID_PATTERN,
                                                               client_vote_id):
        raise Invalid("client_vote_id must be 1-64 of A-Z a-z 0-9 . _ : -",
                      field="client_vote_id")
    for name, text in (("session_id", session_id), ("selection", selection)):
        refuse_nul(name, text)
    # an id that looks like another (a zero-width space, a direction mark) would split one
    # annotator's session in the export without anyone seeing why
    refuse_hidden("session_id", session_id)
    problems = [{"field": field, "message": problem} for field, problem in (
        ("selection", selection_problem(selection)), ("shown_at", shown_at_problem(shown_at)))
        if problem is not None]
    if problems:
        # the pair's problems too, in the same answer (a selection of its own problem is
        # not judged against the pair)
        valid_selection = None if any(p["field"] == "selection" for p in problems) else selection
        problems += pair_problems(session, sample_a_id, sample_b_id, valid_selection)
        raise Invalid("; ".join(f"{p['field']}: {p['message']}" for p in problems),
                      field=problems[0]["field"], errors=problems)

    def existing() -> Vote | None:
        found = session.scalar(select(Vote).where(Vote.annotator_id == annotator.id,
                                                  Vote.client_vote_id == client_vote_id))
        # session_id, shown_at, latency_ms may differ on a retry; what was judged may not
        if found is not None and (found.sample_a_id, found.sample_b_id, found.outcome) != (
                sample_a_id, sample_b_id, outcome):
            raise Conflict(
                f"client_vote_id {client_vote_id}: already used for a different vote "
                f"(sample_a_id {found.sample_a_id}, sample_b_id {found.sample_b_id}, outcome "
                f"{found.outcome}); a new vote needs a new client_vote_id",
                field="client_vote_id", vote_id=found.id)
        return found

    try:
        a_path, b_path, cross = _valid_pair(session, sample_a_id, sample_b_id)
    except Invalid:
        found = existing()  # a retry of a vote whose samples were since deleted
        if found is not None:
            return found, False
        raise
    if (mismatch := _selection_mismatch(selection, cross)) is not None:
        raise Invalid(f"selection: {mismatch}", field="selection")
    difference = differing_fraction(a_path, b_path)
    lo, hi = min(sample_a_id, sample_b_id), max(sample_a_id, sample_b_id)
    vote = Vote(client_vote_id=client_vote_id, annotator_id=annotator.id, session_id=session_id,
                sample_a_id=sample_a_id, sample_b_id=sample_b_id, pair_lo_id=lo, pair_hi_id=hi,
                outcome=outcome, shown_at=shown_at, latency_ms=latency_ms,
                selection=(selection or "unknown")[:SELECTION_LENGTH],
                pixel_difference=difference, excluded=annotator.excluded)
    session.add(vote)
    try:
        session.flush()
        # the flag as the database has it once the vote is written: `annotator` may be a
        # cached copy from before an admin excluded them. Read after the insert, so that
        # annotators.set_excluded either committed before (PostgreSQL: it locks the user's
        # row, which the vote's foreign key and this read hold shared; SQLite: the insert
        # holds the one write lock) or waits for this vote and updates it with the rest
        vote.excluded = bool(session.scalar(
            select(User.excluded).where(User.id == annotator.id).with_for_update(read=True)))
        session.commit()
    except IntegrityError:
        session.rollback()
        found = existing()
        if found is not None:
            return found, False
        # the vote that holds the pair, so that a client retrying under a new
        # client_vote_id can find what it sent before (as the reused-id conflict names it)
        judged = session.scalar(select(Vote.id).where(
            Vote.annotator_id == annotator.id, Vote.pair_lo_id == lo, Vote.pair_hi_id == hi))
        raise Conflict(f"you already judged the pair ({lo}, {hi}) in vote {judged}",
                       field="sample_b_id", vote_id=judged) from None
    return vote, True


# --- export --------------------------------------------------------------------------------
# the vote export's columns and their parquet types, in order (README: "Vote export schema");
# export_votes writes exactly these keys, export_parquet types them
EXPORT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("vote_id", "int64"), ("client_vote_id", "string"), ("annotator", "string"),
    ("session_id", "string"), ("prompt", "string"),
    ("image_0_uid", "int64"), ("image_1_uid", "int64"),
    ("image_0_path", "string"), ("image_1_path", "string"),
    ("checkpoint_0_id", "int64"), ("checkpoint_1_id", "int64"),
    ("rollout_group_0_id", "int64"), ("rollout_group_1_id", "int64"),
    ("outcome", "string"), ("label_0", "float64"), ("label_1", "float64"),
    ("has_label", "bool_"), ("selection", "string"), ("pixel_difference", "float64"),
    ("excluded", "bool_"),
    ("shown_at", "string"), ("created_at", "string"), ("latency_ms", "int64"),
)


def _utc_iso(value: datetime | None) -> str | None:
    return None if value is None else utc_text(value)


def export_votes(session: Session, batch: int = SQL_BATCH, *, annotator_id: int | None = None
                 ) -> Iterator[dict[str, Any]]:
    """All votes (or one annotator's), Pick-a-Pic style: image_0 is the sample shown on the left (a), image_1 the
    right (b); label_0/label_1 are 1/0, 0/1 or 0.5/0.5 (tie); both_bad and skip have null
    labels and has_label false. Image paths are relative to the storage dir."""
    sa, sb = aliased(Sample), aliased(Sample)
    ga, gb = aliased(RolloutGroup), aliased(RolloutGroup)
    stmt = (
        select(Vote, User.name, ga.prompt_text, sa.image_path, sb.image_path,
               ga.checkpoint_id, gb.checkpoint_id, ga.id, gb.id)
        .join(User, User.id == Vote.annotator_id)
        .join(sa, sa.id == Vote.sample_a_id).join(sb, sb.id == Vote.sample_b_id)
        .join(ga, ga.id == sa.group_id).join(gb, gb.id == sb.group_id)
        .order_by(Vote.id)
    )
    if annotator_id is not None:
        stmt = stmt.where(Vote.annotator_id == annotator_id)
    last = 0
    while True:
        rows = session.execute(stmt.where(Vote.id > last).limit(batch)).all()
        if not rows:
            return
        for v, annotator, prompt, pa, pb, ca, cb, gida, gidb in rows:
            l0 = TARGET_A.get(v.outcome)  # the Bradley-Terry target of the left image
            l1 = None if l0 is None else 1.0 - l0
            yield {
                "vote_id": v.id, "client_vote_id": v.client_vote_id, "annotator": annotator,
                "session_id": v.session_id, "prompt": prompt,
                "image_0_uid": v.sample_a_id, "image_1_uid": v.sample_b_id,
                "image_0_path": pa, "image_1_path": pb,
                "checkpoint_0_id": ca, "checkpoint_1_id": cb,
                "rollout_group_0_id": gida, "rollout_group_1_id": gidb,
                "outcome": v.outcome, "label_0": l0, "label_1": l1, "has_label": l0 is not None,
                "selection": v.selection, "pixel_difference": v.pixel_difference,
                "excluded": v.excluded,
                "shown_at": _utc_iso(v.shown_at), "created_at": _utc_iso(v.created_at),
                "latency_ms": v.latency_ms,
            }
        last = rows[-1][0].id


def export_parquet(session: Session, *, annotator_id: int | None = None) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in EXPORT_COLUMNS])
    rows = list(export_votes(session, annotator_id=annotator_id))
    table = pa.Table.from_pylist(rows, schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def count_votes(session: Session, annotator_id: int | None = None) -> int:
    stmt = select(func.count()).select_from(Vote)
    if annotator_id is not None:
        stmt = stmt.where(Vote.annotator_id == annotator_id)
    return session.scalar(stmt) or 0
