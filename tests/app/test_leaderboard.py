from __future__ import annotations

import re

import numpy as np
import pytest
from sqlalchemy import select
from stored_checkpoints import stored_checkpoint


def test_fit_bt_recovers_order():
    from app.services.leaderboard import elo, fit_bt

    wins = np.array([[0, 30, 45], [20, 0, 35], [5, 15, 0]], dtype=float)
    r = elo(fit_bt(wins))
    assert r[0] > r[1] > r[2]
    assert r.mean() == pytest.approx(1000.0, abs=1e-6)


def test_leaderboard_ratings_cis_and_win_rates(client, admin, annotator, make_user, make_group,
                                               session):
    from app.models import RolloutGroup, Sample, User
    from app.services.votes import record_vote

    ck = [stored_checkpoint(session, None, 0, f"ck/{i}.safetensors", name=f"ckpt{i}")
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


def test_reward_scores_stand_beside_ratings(client, admin, annotator, make_group, session):
    """Evaluation scores recorded on checkpoints (a later evaluation merges: other rewards
    kept, the same reward replaced) come back from the checkpoints API and on the leaderboard
    beside the Bradley-Terry rating; a checkpoint scored but never voted on is listed below
    the rated ones with a null rating."""
    from app.services.checkpoints import record_scores
    from app.services.votes import record_vote
    from app.ui.leaderboard import ratings_html

    ck = [stored_checkpoint(session, None, 0, f"ck/{i}.safetensors", name=f"ckpt{i}")
          for i in range(4)]
    record_scores(session, ck[0], {"count": {"mean": 0.2, "std": 0.1, "n": 8},
                                   "clip_score": {"mean": 21.0, "std": 2.0, "n": 8}},
                  job_id=None, prompts="8 of the shapes prompts", seeds=2)
    # re-evaluated with count and aesthetic: count replaced, clip_score kept
    merged = record_scores(session, ck[0], {"count": {"mean": 0.4, "std": 0.1, "n": 4},
                                            "aesthetic": {"mean": 5.5, "std": 0.3, "n": 4}},
                           job_id=None, prompts="4 of dataset 1 (eval split)", seeds=1)
    assert {k: v["mean"] for k, v in merged.items()} == {"count": 0.4, "clip_score": 21.0,
                                                         "aesthetic": 5.5}
    assert merged["count"]["prompts"] == "4 of dataset 1 (eval split)"
    assert merged["clip_score"]["prompts"] == "8 of the shapes prompts"
    record_scores(session, ck[2], {"count": {"mean": 0.9, "std": 0.0, "n": 4}})
    session.commit()

    one = client.get(f"/api/checkpoints/{ck[0]}", headers=annotator)
    assert one.status_code == 200
    assert {k: v["mean"] for k, v in one.json()["scores"].items()} == {
        "count": 0.4, "clip_score": 21.0, "aesthetic": 5.5}
    assert one.json()["scores"]["count"]["n"] == 4
    # a UTC time spelt as every other timestamp of the API (it carried +00:00)
    at = one.json()["scores"]["count"]["at"]
    assert at.endswith("Z") and "+" not in at and one.json()["created_at"].endswith("Z"), at
    assert client.get("/api/checkpoints/999999", headers=annotator).status_code == 404
    listed = {c["id"]: c for c in client.get("/api/checkpoints", headers=annotator).json()["items"]}
    assert listed[ck[1]]["scores"] == {} and listed[ck[2]]["scores"]["count"]["mean"] == 0.9

    board = client.get("/api/leaderboard", params={"bootstrap": 0}, headers=annotator).json()
    assert board["checkpoints"][0]["rating"] is None and board["num_votes"] == 0
    assert [c["checkpoint_id"] for c in board["checkpoints"]] == [ck[2], ck[0]]  # newest first
    assert board["rewards"] == ["aesthetic", "clip_score", "count"]
    # no checkpoint has met another: a line says so, not a win-rate table with no rows
    unmet = ratings_html(board)
    assert "No checkpoint has met another in a vote yet" in unmet and "ngs-matrix" not in unmet

    # votes between ckpt0 and ckpt1 (ckpt1 wins): both rated, ckpt2 scored but unrated
    ga = make_group(None, prompt="p", g=1, checkpoint_id=ck[0], seed=0, purpose="evaluate")
    gb = make_group(None, prompt="p", g=1, checkpoint_id=ck[1], seed=0, purpose="evaluate")
    sa = client.get(f"/api/rollouts/{ga}", headers=annotator).json()["samples"][0]["id"]
    sb = client.get(f"/api/rollouts/{gb}", headers=annotator).json()["samples"][0]["id"]
    from app.models import User

    voter = session.scalars(select(User).where(User.role == "annotator")).first()
    record_vote(session, voter, client_vote_id="x", sample_a_id=sa, sample_b_id=sb, outcome="b")
    session.commit()
    board = client.get("/api/leaderboard", params={"bootstrap": 0}, headers=annotator).json()
    rows = {c["checkpoint_id"]: c for c in board["checkpoints"]}
    assert [c["checkpoint_id"] for c in board["checkpoints"]] == [ck[1], ck[0], ck[2]]
    assert rows[ck[1]]["scores"] == {} and rows[ck[1]]["rating"] > rows[ck[0]]["rating"]
    assert rows[ck[0]]["scores"] == {"count": 0.4, "clip_score": 21.0, "aesthetic": 5.5}
    assert rows[ck[2]]["rating"] is None and rows[ck[2]]["num_votes"] == 0
    assert ck[3] not in rows  # neither scored nor voted on

    page = ratings_html(board)
    assert 'data-n="3" data-rated="2"' in page
    # no resamples, no interval: said so, and no column without a heading
    assert "no intervals (0 bootstrap resamples)" in page and "<th></th>" not in page
    assert "ngs-matrix" in page
    resampled = ratings_html(client.get("/api/leaderboard", params={"bootstrap": 50},
                                        headers=annotator).json())
    assert "intervals from 50 bootstrap resamples" in resampled
    # each rated row's interval cell holds its numbers and the bar drawing them
    cells = re.findall(r"<td>(-?\d+ – -?\d+)<div style=", resampled)
    assert len(cells) == 2, resampled
    assert all(f"<th>{r}</th>" in page for r in ("aesthetic", "clip_score", "count"))
    assert "no votes" in page
    # each mean says what it was computed on; count's two means come from different prompt
    # sets, so its column says they do not compare (clip_score's one mean does not)
    assert rows[ck[0]]["score_sources"] == {
        "count": "4 of dataset 1 (eval split), 1 seed, n=4",
        "aesthetic": "4 of dataset 1 (eval split), 1 seed, n=4",
        "clip_score": "8 of the shapes prompts, 2 seeds, n=8"}
    assert rows[ck[2]]["score_sources"] == {"count": "prompts not recorded, n=4"}
    assert ('<span data-reward="clip_score" title="8 of the shapes prompts, 2 seeds, n=8">'
            '21.000</span>') in page
    assert "not comparable down the column: count (" in page
    assert '<small class="ngs-score-source">4 of dataset 1 (eval split), 1 seed, n=4' in page
    assert '<small class="ngs-score-source">8 of the shapes' not in page


def test_leaderboard_launches_an_evaluate_job_with_the_named_rewards(admin, enqueuer, session):
    """One checkpoint may be scored alone; the rewards typed on the page go into the job's
    config, and a model-backed reward without weights is refused, naming it."""
    from app.models import Job
    from app.ui.leaderboard import evaluate

    ck = stored_checkpoint(session, None, 0, "ck/a.safetensors", name="a")
    session.commit()
    user = {"token": admin["Authorization"].split(" ", 1)[1]}
    out = evaluate(enqueuer, user, [ck], 2, " count, jpeg_compressibility ")
    assert 'id="evaluate-launched"' in out, out
    job = session.scalars(select(Job)).one()
    assert job.config["checkpoint_ids"] == [ck] and job.config["seeds"] == [0, 1]
    assert job.config["reward_names"] == ["count", "jpeg_compressibility"]
    assert enqueuer.calls == [(job.id, "evaluate")]
    refused = evaluate(enqueuer, user, [ck], 2, "hpsv2")
    assert "reward &#x27;hpsv2&#x27;" in refused and "HPS_v2.1" in refused
    assert "evaluate-launched" not in refused


def test_leaderboard_evaluates_on_a_datasets_held_out_split(admin, enqueuer, session):
    """The page's prompt set: a dataset and its split go into the evaluate job (as the paper
    evaluates on HPDv2's test set); 0 is the shapes world's prompts; a dataset gone since the
    page loaded is refused naming the field."""
    from app.models import Job
    from app.services.datasets import import_dataset
    from app.ui.leaderboard import dataset_choices, evaluate

    ck = stored_checkpoint(session, None, 0, "ck/a.safetensors", name="a")
    ds = import_dataset(session, filename="test.txt", data=b"one red circle\ntwo blue squares\n",
                        name="held-out").dataset
    session.commit()
    assert (f"#{ds.id} held-out (2 prompts)", ds.id) in dataset_choices()
    assert dataset_choices()[0][1] == 0
    user = {"token": admin["Authorization"].split(" ", 1)[1]}
    out = evaluate(enqueuer, user, [ck], 1, "", ds.id, "all")
    assert 'id="evaluate-launched"' in out, out
    job = session.scalars(select(Job).order_by(Job.id.desc())).first()
    assert (job.config["dataset_id"], job.config["split"]) == (ds.id, "all")
    out = evaluate(enqueuer, user, [ck], 1, "", 0, "eval")
    job = session.scalars(select(Job).order_by(Job.id.desc())).first()
    assert 'id="evaluate-launched"' in out and job.config.get("dataset_id") is None
    refused = evaluate(enqueuer, user, [ck], 1, "", 999_999, "eval")
    assert "dataset_id" in refused and "evaluate-launched" not in refused


def test_an_interval_from_one_or_two_unanimous_votes_is_wide_not_zero():
    """With votes all one way every bootstrap resample holds the same votes, and the
    percentile interval alone read "1208 – 1208" after one vote (the UI walk, 2026-12-07):
    certainty from one vote. The normal approximation's width is the floor; it narrows as
    votes come in, and with many votes the bootstrap's percentile interval stands."""
    from app.services.leaderboard import elo, fit_bt, normal_half_widths

    def half_width(wins: list[list[float]]) -> np.ndarray:
        w = np.array(wins, dtype=float)
        return normal_half_widths(w, fit_bt(w))

    one, two = half_width([[0, 1], [0, 0]]), half_width([[0, 2], [0, 0]])
    assert one[0] > 300 and two[0] > 200, (one, two)  # hundreds of Elo points either way
    assert two[0] < one[0]
    many = half_width([[0, 600], [400, 0]])
    assert 10 < many[0] < 40, many  # 1,000 votes 60/40: about +-22 points
    assert np.allclose(many, many[0])  # two checkpoints: the same uncertainty each
    # a third checkpoint met only once is the least sure (the ratings are centred on their
    # mean, so its uncertainty moves the others' too, as in the bootstrap)
    three = half_width([[0, 600, 1], [400, 0, 0], [0, 0, 0]])
    assert three[2] > 1.5 * max(three[0], three[1]) and three[2] > 600, three
    assert elo(fit_bt(np.array([[0, 1], [0, 0]], float)))[0] > 1000


def test_the_board_widens_a_unanimous_vote_s_interval(client, annotator, make_group, session):
    from app.models import User
    from app.services.votes import record_vote

    ck = [stored_checkpoint(session, None, 0, f"ck/{i}.safetensors", name=f"ckpt{i}")
          for i in range(2)]
    session.commit()
    ga = make_group(None, prompt="p", g=1, checkpoint_id=ck[0], seed=0, purpose="evaluate")
    gb = make_group(None, prompt="p", g=1, checkpoint_id=ck[1], seed=0, purpose="evaluate")
    sa = client.get(f"/api/rollouts/{ga}", headers=annotator).json()["samples"][0]["id"]
    sb = client.get(f"/api/rollouts/{gb}", headers=annotator).json()["samples"][0]["id"]
    voter = session.scalars(select(User).where(User.role == "annotator")).first()
    record_vote(session, voter, client_vote_id="one", sample_a_id=sa, sample_b_id=sb,
                outcome="b")
    session.commit()
    board = client.get("/api/leaderboard", params={"bootstrap": 50}, headers=annotator).json()
    for row in board["checkpoints"]:
        assert row["ci_high"] - row["ci_low"] > 600, row  # was 0: every resample the same
        assert row["ci_low"] < row["rating"] < row["ci_high"]
    # no resamples asked for: still no interval
    plain = client.get("/api/leaderboard", params={"bootstrap": 0}, headers=annotator).json()
    assert all(r["ci_low"] == r["rating"] == r["ci_high"] for r in plain["checkpoints"])
