"""Annotator quality: votes per annotator, median decision time, agreement with the majority
of the other annotators on the pairs they share, agreement with the automatic reward, and the
switch that excludes an annotator's votes from fitting (`set_excluded`).

Agreement uses clean votes only (a, b, tie; not both_bad or skip). A vote's label is relative to
the pair's lower sample id, so sides do not matter. Majority: for each vote on a pair that
other annotators also judged, the most common label among the others (a tie for most common
is skipped). Reward: for a and b votes whose two samples have different automatic rewards
(`total` if recorded, else the sum of the named rewards), whether the preferred one has the
higher reward.

Outliers (FastChat-style): an annotator whose agreement with the majority is not significantly
above chance (one-sided binomial test against 0.5, p >= FLAG_ALPHA, over at least
FLAG_MIN_SHARED shared votes) looks random and is `flagged` for an admin; nothing is dropped:
excluding is the admin's decision (`set_excluded`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.errors import NotFound
from app.limits import SQL_BATCH
from app.models import Sample, User, Vote
from app.services import auth
from app.services.votes import automatic_reward
from trainer.rewards.outcomes import LABELLED_OUTCOMES, Outcome

FLAG_ALPHA = 0.05
FLAG_MIN_SHARED = 20


def binomial_p_above_half(successes: int, n: int) -> float:
    """One-sided exact binomial test: P(X >= successes) for X ~ Binomial(n, 0.5)."""
    if n <= 0:
        return 1.0
    return min(1.0, sum(math.comb(n, k) for k in range(successes, n + 1)) / 2.0 ** n)


def _label(outcome: str, a_id: int, lo: int) -> str:
    """'lo', 'hi' or 'tie': which sample of the pair won, independent of the sides."""
    if not Outcome(outcome).decisive:
        return "tie"
    winner_is_a = outcome == Outcome.A
    return "lo" if (a_id == lo) == winner_is_a else "hi"


def stats(session: Session, *, annotator_id: int | None = None) -> list[dict[str, Any]]:
    """One row per user who voted (or is an annotator): name, role, excluded, votes, clean
    votes, median latency (ms), majority agreement and the number of votes it is over, reward
    agreement and its count. `annotator_id` limits the rows (not the data) to one user."""
    users = {u.id: u for u in session.scalars(select(User))}
    rows = session.execute(select(Vote.annotator_id, Vote.sample_a_id, Vote.sample_b_id,
                                  Vote.pair_lo_id, Vote.pair_hi_id, Vote.outcome,
                                  Vote.latency_ms)).all()
    by_pair: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
    per: dict[int, dict[str, Any]] = defaultdict(lambda: {"votes": 0, "clean": 0,
                                                          "latencies": []})
    sample_ids: set[int] = set()
    for uid, a, b, lo, hi, outcome, latency in rows:
        p = per[uid]
        p["votes"] += 1
        if latency is not None:
            p["latencies"].append(latency)
        if outcome in LABELLED_OUTCOMES:
            p["clean"] += 1
            by_pair[(lo, hi)].append((uid, _label(outcome, a, lo)))
            if Outcome(outcome).decisive:
                sample_ids.update((a, b))
    rewards: dict[int, float | None] = {}
    ids = sorted(sample_ids)
    for start in range(0, len(ids), SQL_BATCH):
        for sid, rw in session.execute(select(Sample.id, Sample.rewards)
                                       .where(Sample.id.in_(ids[start:start + SQL_BATCH]))):
            rewards[sid] = automatic_reward(rw)
    maj = defaultdict(lambda: [0, 0])  # uid -> [agree, total]
    rew = defaultdict(lambda: [0, 0])
    for (lo, hi), labels in by_pair.items():
        for i, (uid, label) in enumerate(labels):
            others = Counter(lab for j, (u2, lab) in enumerate(labels) if j != i and u2 != uid)
            if others:
                top = others.most_common(2)
                if len(top) == 1 or top[0][1] > top[1][1]:
                    maj[uid][1] += 1
                    maj[uid][0] += int(label == top[0][0])
            if label != "tie":
                r_lo, r_hi = rewards.get(lo), rewards.get(hi)
                if r_lo is not None and r_hi is not None and r_lo != r_hi:
                    rew[uid][1] += 1
                    rew[uid][0] += int((label == "lo") == (r_lo > r_hi))
    out = []
    for uid, user in sorted(users.items()):
        if annotator_id is not None and uid != annotator_id:
            continue
        if uid not in per and user.role != "annotator":
            continue
        p = per.get(uid, {"votes": 0, "clean": 0, "latencies": []})
        m, r = maj.get(uid, [0, 0]), rew.get(uid, [0, 0])
        p_value = binomial_p_above_half(m[0], m[1]) if m[1] else None
        out.append({
            "user_id": uid, "name": user.name, "role": user.role, "excluded": user.excluded,
            "votes": p["votes"], "clean_votes": p["clean"],
            "median_latency_ms": statistics.median(p["latencies"]) if p["latencies"] else None,
            "majority_agreement": m[0] / m[1] if m[1] else None, "majority_n": m[1],
            "reward_agreement": r[0] / r[1] if r[1] else None, "reward_n": r[1],
            "agreement_p_value": p_value,
            "flagged": bool(m[1] >= FLAG_MIN_SHARED and p_value is not None
                            and p_value >= FLAG_ALPHA),
        })
    return out


def set_excluded(session: Session, user_id: int, excluded: bool) -> int:
    """Exclude (or include again) a user's votes from fitting and the leaderboard: the flag on
    the user (future votes) and on every vote they cast. Returns the votes changed. Flushes."""
    # the user's row locked first: a vote being recorded holds it shared while it copies the
    # flag (votes.record_vote), so a vote is either in the update below or copies the new flag
    user = session.get(User, user_id, with_for_update=True)
    if user is None:
        raise NotFound(f"user {user_id} not found")
    user.excluded = bool(excluded)
    session.flush()
    result = session.execute(update(Vote).where(Vote.annotator_id == user_id,
                                                Vote.excluded.is_not(bool(excluded)))
                             .values(excluded=bool(excluded))
                             .execution_options(synchronize_session=False))
    session.flush()
    auth.forget_after_commit(session)  # cached users carry the flag (the annotator pages)
    return int(result.rowcount or 0)
