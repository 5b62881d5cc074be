from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import select


def test_fit_bt_recovers_order():
    from app.services.leaderboard import elo, fit_bt

    wins = np.array([[0, 30, 45], [20, 0, 35], [5, 15, 0]], dtype=float)
    r = elo(fit_bt(wins))
    assert r[0] > r[1] > r[2]
    assert r.mean() == pytest.approx(1000.0, abs=1e-6)


def test_leaderboard_ratings_cis_and_win_rates(client, admin, annotator, make_user, make_group,
                                               session):
    from app.models import RolloutGroup, Sample, User
    from app.services.checkpoints import record_checkpoint
    from app.services.votes import record_vote

    ck = [record_checkpoint(session, None, 0, f"ck/{i}.safetensors", name=f"ckpt{i}")
          for i in range(3)]
    session.commit()
    for c in ck:
        for seed in range(3):
            make_group(None, prompt="p", g=2, checkpoint_id=c, seed=seed, purpose="evaluate")
    samples = session.execute(
        select(Sample.id, RolloutGroup.checkpoint_id, RolloutGroup.seed, Sample.member_index)
        .join(RolloutGroup)).all()
    rank = {c: i for i, c in enumerate(ck)}
    for u in range(4):
        make_user(f"ann{u}", "annotator")
    users = session.scalars(select(User).where(User.name.like("ann%"))).all()
    n = 0
    for user in users:
        for a in samples:
            for b in samples:
                if a[1] < b[1] and a[2:] == b[2:]:
                    # the higher checkpoint wins, except ckpt0 vs ckpt1 on seed 0: a tie
                    tie = {rank[a[1]], rank[b[1]]} == {0, 1} and a[2] == 0
                    outcome = "tie" if tie else ("a" if rank[a[1]] > rank[b[1]] else "b")
                    record_vote(session, user, client_vote_id=f"{user.id}-{a[0]}-{b[0]}",
                                sample_a_id=a[0], sample_b_id=b[0], outcome=outcome)
                    n += 1
    # a within-group vote does not count
    train = client.get(f"/api/rollouts/{make_group(None, g=2)}", headers=annotator).json()
    assert client.post("/api/votes", json={"client_vote_id": "w", "outcome": "a",
                                           "sample_a_id": train["samples"][0]["id"],
                                           "sample_b_id": train["samples"][1]["id"]},
                       headers=annotator).status_code == 201

    board = client.get("/api/leaderboard", params={"bootstrap": 100}, headers=annotator).json()
    names = [c["name"] for c in board["checkpoints"]]
    assert names == ["ckpt2", "ckpt1", "ckpt0"]
    assert n == 4 * 3 * 3 * 2 and board["num_votes"] == n
    for c in board["checkpoints"]:
        assert c["ci_low"] <= c["rating"] <= c["ci_high"]
    pairs = {(p["checkpoint_id"], p["opponent_id"]): p for p in board["pairs"]}
    assert pairs[(ck[2], ck[0])]["win_rate"] == 1.0
    # ckpt1 vs ckpt0: 6 seeds-members per annotator; 2 of them (seed 0) ties -> (4 + 1) / 6
    assert pairs[(ck[1], ck[0])]["win_rate"] == pytest.approx(5 / 6)
    assert pairs[(ck[0], ck[1])]["win_rate"] == pytest.approx(1 / 6)
    top = board["checkpoints"][0]
    assert top["win_rate"] == 1.0 and top["num_votes"] == 2 * 4 * 6
