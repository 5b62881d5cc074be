"""Bradley-Terry ratings of checkpoints from cross-checkpoint votes, as arenas compute them.

Only clean votes count: outcome a, b or tie (a tie is half a win each), not excluded, the two
samples from different checkpoints. Ratings are fitted by the MM algorithm (Hunter 2004) on
the win matrix, with a small symmetric pseudo-count (0.1 wins each way per compared pair) so a
checkpoint that never won still gets a finite rating, and reported on the Elo scale
(1000 + 400 log10 strength, mean strength 1). The 95% interval is the 2.5-97.5 percentile of
ratings refitted on bootstrap resamples of the votes, widened where needed to the normal
approximation (1.96 standard errors from the fitted model's Fisher information, pseudo-counts
included): with few votes, all one way, every resample holds the same votes, and the
percentile interval alone had zero width ("1208 – 1208" after one vote), certainty from
nothing. With many votes the bootstrap is the wider of the two and stands as it was.

Beside each rating stand the checkpoint's automatic-reward means from evaluate jobs
(`Checkpoint.scores`). A checkpoint evaluated but never voted on is listed too, below the rated
ones with a null rating, so a reward evaluation shows before anyone has voted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from app.limits import DEFAULT_BOOTSTRAP
from app.models import Checkpoint, RolloutGroup, Sample, Vote
from app.services.checkpoints import score_means, score_sources
from trainer.rewards.outcomes import LABELLED_OUTCOMES, TARGET_A

PSEUDO = 0.1


def _cross_votes(session: Session) -> list[tuple[int, int, str]]:
    sa, sb = aliased(Sample), aliased(Sample)
    ga, gb = aliased(RolloutGroup), aliased(RolloutGroup)
    rows = session.execute(
        select(ga.checkpoint_id, gb.checkpoint_id, Vote.outcome)
        .join(sa, sa.id == Vote.sample_a_id).join(sb, sb.id == Vote.sample_b_id)
        .join(ga, ga.id == sa.group_id).join(gb, gb.id == sb.group_id)
        .where(Vote.excluded.is_(False), Vote.outcome.in_(LABELLED_OUTCOMES),
               ga.checkpoint_id.is_not(None), gb.checkpoint_id.is_not(None),
               ga.checkpoint_id != gb.checkpoint_id)
    ).all()
    return [(int(a), int(b), o) for a, b, o in rows]


def with_pseudo_counts(wins: np.ndarray) -> np.ndarray:
    """`wins` with PSEUDO wins each way added for every pair that met: what the fit and its
    standard errors both read."""
    return wins + PSEUDO * ((wins + wins.T) > 0)


def fit_bt(wins: np.ndarray, iters: int = 200, tol: float = 1e-9) -> np.ndarray:
    """Strengths p (geometric mean 1) from wins[i, j] = wins of i over j (ties as 0.5 each)."""
    n = wins.shape[0]
    w = with_pseudo_counts(wins)
    games = w + w.T
    total_wins = w.sum(axis=1)
    p = np.ones(n)
    for _ in range(iters):
        denom = (games / (p[:, None] + p[None, :] + 1e-300)).sum(axis=1)
        new = np.where(denom > 0, total_wins / np.maximum(denom, 1e-300), 1.0)
        new = np.maximum(new, 1e-12)
        new /= np.exp(np.mean(np.log(new)))
        if np.max(np.abs(new - p)) < tol:
            p = new
            break
        p = new
    return p


def elo(p: np.ndarray) -> np.ndarray:
    return 1000.0 + 400.0 * np.log10(p)


ELO_PER_LOG_STRENGTH = 400.0 / np.log(10.0)


def normal_half_widths(wins: np.ndarray, p: np.ndarray, z: float = 1.96) -> np.ndarray:
    """z standard errors of each Elo rating of `fit_bt(wins)` = p, from the observed Fisher
    information of the log-strengths under the same pseudo-counts (a graph Laplacian with
    weights games_ij * P(i beats j) * P(j beats i)); its pseudo-inverse is the covariance with
    the ratings' mean held fixed, as fit_bt holds it."""
    w = with_pseudo_counts(wins)
    games = w + w.T
    beats = p[:, None] / (p[:, None] + p[None, :])  # P(i beats j)
    info = games * beats * beats.T
    laplacian = np.diag(info.sum(axis=1)) - info
    variance = np.clip(np.diag(np.linalg.pinv(laplacian)), 0.0, None)
    return z * ELO_PER_LOG_STRENGTH * np.sqrt(variance)


def _scored(session: Session) -> dict[int, tuple[str, dict[str, float], dict[str, str]]]:
    """{checkpoint id: (name, {reward: mean}, {reward: prompt set it was scored on})} of
    every checkpoint an evaluate job scored."""
    rows = session.scalars(select(Checkpoint).where(Checkpoint.scores.is_not(None)))
    return {c.id: (c.name, means, score_sources(c)) for c in rows if (means := score_means(c))}


def compute(session: Session, *, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0
            ) -> dict[str, Any]:
    votes = _cross_votes(session)
    ids = sorted({x for a, b, _ in votes for x in (a, b)})
    scored = _scored(session)
    names = dict(session.execute(select(Checkpoint.id, Checkpoint.name)
                                 .where(Checkpoint.id.in_(ids))).all()) if ids else {}
    unrated = [{"checkpoint_id": c, "name": name, "rating": None, "ci_low": None,
                "ci_high": None, "num_votes": 0, "win_rate": None, "scores": means,
                "score_sources": sources}
               for c, (name, means, sources) in sorted(scored.items(), reverse=True)
               if c not in names]
    rewards = sorted({r for _, means, _ in scored.values() for r in means})
    if not ids:
        return {"checkpoints": unrated, "rewards": rewards, "pairs": [], "num_votes": 0,
                "bootstrap": bootstrap}
    index = {c: i for i, c in enumerate(ids)}
    n = len(ids)
    # each vote as a (winner-row, loser-col, weight) triple list; ties add 0.5 both ways
    ia = np.array([index[a] for a, _, _ in votes])
    ib = np.array([index[b] for _, b, _ in votes])
    score_a = np.array([TARGET_A[o] for _, _, o in votes])

    def wins_of(weights: np.ndarray) -> np.ndarray:
        w = np.zeros((n, n))
        np.add.at(w, (ia, ib), weights * score_a)
        np.add.at(w, (ib, ia), weights * (1.0 - score_a))
        return w

    ones = np.ones(len(votes))
    wins = wins_of(ones)
    strength = fit_bt(wins)
    rating = elo(strength)
    rng = np.random.default_rng(seed)
    boots = np.empty((bootstrap, n))
    for k in range(bootstrap):
        counts = rng.multinomial(len(votes), np.full(len(votes), 1.0 / len(votes)))
        boots[k] = elo(fit_bt(wins_of(counts.astype(float))))
    if bootstrap > 0:
        lo, hi = np.percentile(boots, [2.5, 97.5], axis=0)
        half = normal_half_widths(wins, strength)
        lo, hi = np.minimum(lo, rating - half), np.maximum(hi, rating + half)
    else:  # no resamples asked for: no interval
        lo, hi = rating, rating
    games = wins + wins.T
    out = []
    for c, i in index.items():
        g = games[i].sum()
        out.append({
            "checkpoint_id": c, "name": names.get(c, str(c)), "rating": float(rating[i]),
            "ci_low": float(lo[i]), "ci_high": float(hi[i]), "num_votes": int(round(g)),
            "win_rate": float(wins[i].sum() / g) if g else None,
            "scores": scored[c][1] if c in scored else {},
            "score_sources": scored[c][2] if c in scored else {},
        })
    out.sort(key=lambda r: r["rating"], reverse=True)
    out += unrated  # newest first, after every rated one
    pairs = []
    for i in range(n):
        for j in range(n):
            if i != j and games[i, j] > 0:
                pairs.append({"checkpoint_id": ids[i], "opponent_id": ids[j],
                              "num_votes": int(round(games[i, j])),
                              "win_rate": float(wins[i, j] / games[i, j])})
    return {"checkpoints": out, "rewards": rewards, "pairs": pairs, "num_votes": len(votes),
            "bootstrap": bootstrap}
