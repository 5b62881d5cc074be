"""Many annotators at once, on the real server (uvicorn in a thread) and both databases:

- annotators asking for pairs and voting together, each vote sent twice at once (a double
  click, a retry): no 5xx, one vote per client_vote_id (201 for one, 200 for the other), no
  annotator judging a pair twice, every annotator's count right, until every pair is judged;
- an admin excluding and including annotators while they vote: every vote ends with its
  annotator's flag, none left behind;
- a preference fit reading the votes while one is being written (its id drawn, not yet
  committed): the fit waits for it, so that every vote at or below the newest id it records
  (`last_vote_id`, from which an online refit counts the new votes) is one it read."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import httpx
import numpy as np
import pytest
from sqlalchemy import func, select

from app.db import session_scope
from trainer.rewards.serve import ServerThread

ANNOTATORS = 10
GROUPS, MEMBERS = 3, 5  # 30 pairs, each annotator judges them all
WAIT = 120  # seconds: the bound on any one wait (a loaded 2-core box is slow, never stuck)


@pytest.fixture
def server(settings):
    from app.main import create_app

    app = create_app(settings, enqueuer=lambda job_id, kind: None, mount_ui=False)
    with ServerThread(app) as running:
        yield running.url


def test_annotators_voting_at_once_each_judge_every_pair_once(server, make_user, make_group,
                                                               session):
    from app.models import User, Vote

    for i in range(GROUPS):
        make_group(prompt=f"{i + 1} red circles", g=MEMBERS, seed=i)
    pairs = GROUPS * MEMBERS * (MEMBERS - 1) // 2
    users = [make_user(f"ann{i}", "annotator") for i in range(ANNOTATORS)]
    admin = make_user("root", "admin")
    problems: list[tuple] = []
    recorded: Counter[str] = Counter()
    start = threading.Barrier(ANNOTATORS + 1, timeout=WAIT)
    voting = threading.Event()

    def annotate(k: int) -> None:
        with httpx.Client(base_url=server, headers=users[k], timeout=WAIT) as c, \
                ThreadPoolExecutor(2) as clicks:
            start.wait()
            for j in range(pairs + 1):
                r = c.get("/api/votes/next")
                if r.status_code == 204:
                    break
                if r.status_code != 200:
                    problems.append(("next", k, r.status_code, r.text))
                    continue
                p = r.json()
                body = {"client_vote_id": f"u{k}-{j}", "sample_a_id": p["a"]["sample_id"],
                        "sample_b_id": p["b"]["sample_id"], "outcome": "ab"[j % 2],
                        "selection": p["selection"]}
                # a double click: the same vote twice at once
                sent = [clicks.submit(c.post, "/api/votes", json=body) for _ in range(2)]
                answers = [f.result() for f in sent]
                if sorted(a.status_code for a in answers) != [200, 201]:
                    problems.append(("vote", k, [(a.status_code, a.text) for a in answers]))
                elif len({a.json()["id"] for a in answers}) != 1:
                    problems.append(("two votes", k, [a.text for a in answers]))
                else:
                    recorded[f"ann{k}"] += 1

    def exclude_while_they_vote() -> None:
        """Flips three annotators' exclusion until the voting is over; ends excluded."""
        with httpx.Client(base_url=server, headers=admin, timeout=WAIT) as c:
            ids = {u["name"]: u["id"] for u in c.get("/api/users").json()}
            start.wait()
            flag = True
            while voting.is_set() or flag:  # the last one applied: excluded
                for name in ("ann0", "ann1", "ann2"):
                    r = c.patch(f"/api/users/{ids[name]}", json={"excluded": flag})
                    if r.status_code != 200:
                        problems.append(("exclude", name, r.status_code, r.text))
                flag = not flag

    voting.set()
    with ThreadPoolExecutor(ANNOTATORS + 1) as pool:
        admin_flips = pool.submit(exclude_while_they_vote)
        for f in [pool.submit(annotate, k) for k in range(ANNOTATORS)]:
            f.result(timeout=WAIT * pairs)
        voting.clear()
        admin_flips.result(timeout=WAIT)

    assert not problems, problems[:5]
    assert recorded == Counter({f"ann{k}": pairs for k in range(ANNOTATORS)})
    counts = dict(session.execute(select(User.name, func.count(Vote.id))
                                  .join(Vote, Vote.annotator_id == User.id)
                                  .group_by(User.name)).all())
    assert counts == dict(recorded)
    assert session.scalar(select(func.count()).select_from(
        select(Vote.annotator_id, Vote.pair_lo_id, Vote.pair_hi_id).distinct().subquery())
    ) == ANNOTATORS * pairs
    # each vote carries its annotator's flag as it ended (excluded: ann0-2)
    flags = session.execute(select(User.name, Vote.excluded).join(
        Vote, Vote.annotator_id == User.id).distinct()).all()
    assert sorted(flags) == sorted((f"ann{k}", k < 3) for k in range(ANNOTATORS))


# PostgreSQL alone: SQLite writes one transaction at a time and gives each vote the next id
# under that lock, so its ids commit in order (settled_vote_id reads the newest)
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_fit_reads_every_vote_below_the_newest_it_records(settings, session):
    """A vote whose id is drawn but not yet committed when a fit reads the votes (PostgreSQL
    hands ids out at insert, and two annotators' votes commit in either order): the fit read
    the later vote and not it, recorded the later one's id as its last_vote_id, and an online
    refit, which counts the votes above that id, never counted it."""
    from test_preference_refits import _stored_group, _vote

    from app.db import new_session
    from app.models import Vote
    from app.services import preference as pref_svc
    from trainer.rewards.preference import FitConfig
    from worker.preference import fit_and_record

    voter_id, pairs = _stored_group(np.random.default_rng(0))
    for n in range(6):
        _vote(voter_id, pairs, n, "ab"[n % 2])
    with new_session() as held, ThreadPoolExecutor(1) as pool:
        # a vote being recorded (votes.record_vote between its insert and its commit)
        lo, hi = pairs[6]
        held.add(Vote(client_vote_id="in-flight", annotator_id=voter_id, sample_a_id=lo,
                      sample_b_id=hi, pair_lo_id=lo, pair_hi_id=hi, outcome="a"))
        held.flush()
        _vote(voter_id, pairs, 7, "b")  # another annotator's vote, committed first
        fit = pool.submit(fit_and_record, FitConfig(width=8, epochs=1, ensemble=1),
                          score_samples=False)
        with contextlib.suppress(FutureTimeout):  # done at once unless it waits for `held`
            fit.result(timeout=3)
        held.commit()
        _model, row = fit.result(timeout=WAIT)
    with session_scope() as s:
        clean_at_or_below = s.scalar(select(func.count()).select_from(Vote).where(
            Vote.id <= row["last_vote_id"]))
        assert row["votes_used"] == clean_at_or_below == 8, row
        assert pref_svc.votes_since(s, row["last_vote_id"]) == 0


def test_an_online_refit_reports_the_new_votes_it_used(settings, monkeypatch):
    """Votes keep arriving while a train job refits its preference model: the refit counted
    the new votes first and read them for the fit after, so a vote cast between the two was
    fitted on but missing from its `preference_refit_votes`."""
    from test_preference_refits import _claimed_refitting_job, _vote

    from app.services import preference as pref_svc
    from trainer.loop import Trainer
    from trainer.rewards.preference import FitConfig, PreferenceModel
    from worker.training import maybe_refit_preference

    voter_id, pairs, config, job_id = _claimed_refitting_job(3)
    trainer = Trainer(config)
    trainer.set_preference_model(PreferenceModel(FitConfig(width=8, ensemble=1, epochs=1)),
                                 None)
    settled = pref_svc.settled_vote_id

    def a_vote_arrives_first(session):
        _vote(voter_id, pairs, 8, "tie")  # after the refit counted 8 new votes
        return settled(session)

    monkeypatch.setattr(pref_svc, "settled_vote_id", a_vote_arrives_first)
    metrics, last = maybe_refit_preference(trainer, config, job_id, 0)
    with session_scope() as s:
        row = pref_svc.latest_model(s)
        assert row is not None and row.votes_used == 9 and row.last_vote_id == last
    assert metrics["preference_refit"] == 1 and metrics["preference_refit_votes"] == 9
