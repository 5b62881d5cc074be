"""Annotator statistics and the exclude switch (app/services/annotators.py)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from app.db import session_scope
from app.models import Sample, User
from app.services import annotators, auth, leaderboard, votes


def _users(*names):
    with session_scope() as s:
        return [auth.create_user(s, n, "annotator")[0].id for n in names]


def _vote(uid, a, b, outcome, cid, latency=100):
    with session_scope() as s:
        user = s.get(User, uid)
        votes.record_vote(s, user, client_vote_id=cid, sample_a_id=a, sample_b_id=b,
                          outcome=outcome, latency_ms=latency)


def _samples(gid):
    with session_scope() as s:
        return list(s.scalars(select(Sample.id).where(Sample.group_id == gid)
                              .order_by(Sample.member_index)))


def test_stats_majority_reward_and_latency(settings, make_group):
    # rewards of members 0..3 are 0, .25, .5, .75 (seed_group)
    ids = _samples(make_group(g=4))
    u1, u2, u3 = _users("ann1", "ann2", "ann3")
    # pair (m0, m3): m3 has the higher reward. u1 and u2 prefer m3 (sides swapped for u2),
    # u3 prefers m0
    _vote(u1, ids[0], ids[3], "b", "x1", 100)
    _vote(u2, ids[3], ids[0], "a", "x2", 300)
    _vote(u3, ids[0], ids[3], "a", "x3", 500)
    _vote(u1, ids[1], ids[2], "skip", "x4", 900)
    with session_scope() as s:
        rows = {r["name"]: r for r in annotators.stats(s)}
    assert rows["ann1"]["votes"] == 2 and rows["ann1"]["clean_votes"] == 1
    assert rows["ann1"]["median_latency_ms"] == 500
    # u1: the others are u2 (m3) and u3 (m0): a tie for most common, skipped
    assert rows["ann1"]["majority_n"] == 0 and rows["ann1"]["majority_agreement"] is None
    assert rows["ann1"]["reward_agreement"] == 1.0 and rows["ann1"]["reward_n"] == 1
    assert rows["ann2"]["reward_agreement"] == 1.0
    assert rows["ann3"]["reward_agreement"] == 0.0
    # u3 disagrees with u1 and u2, who agree with each other
    assert rows["ann3"]["majority_agreement"] == 0.0 and rows["ann3"]["majority_n"] == 1
    with session_scope() as s:
        only = annotators.stats(s, annotator_id=u3)
    assert [r["name"] for r in only] == ["ann3"]


def test_set_excluded_flags_old_and_new_votes(settings, make_group):
    ids = _samples(make_group(g=4))
    (u,) = _users("ann")
    _vote(u, ids[0], ids[1], "a", "y1")
    with session_scope() as s:
        assert annotators.set_excluded(s, u, True) == 1
    _vote(u, ids[0], ids[2], "a", "y2")
    with session_scope() as s:
        assert all(v["excluded"] for v in votes.export_votes(s))
        assert annotators.stats(s)[0]["excluded"] is True
    with session_scope() as s:
        assert annotators.set_excluded(s, u, False) == 2
        assert not any(v["excluded"] for v in votes.export_votes(s))


def test_an_admin_excludes_an_annotator_through_the_api(client, admin, annotator, make_group):
    """Excluding was the Annotators page's alone, though GET /api/users shows `excluded`:
    PATCH /api/users/{id} flips it (the same service call), for admins only."""
    ids = _samples(make_group(g=4))
    r = client.post("/api/votes", json={"client_vote_id": "p1", "sample_a_id": ids[0],
                                        "sample_b_id": ids[1], "outcome": "a"}, headers=annotator)
    assert r.status_code in (200, 201), r.text
    bob = next(u for u in client.get("/api/users", headers=admin).json() if u["name"] == "bob")
    assert bob["excluded"] is False
    path = f"/api/users/{bob['id']}"
    r = client.patch(path, json={"excluded": True}, headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": bob["id"], "excluded": True, "votes_changed": 1}
    listed = {u["name"]: u["excluded"] for u in client.get("/api/users", headers=admin).json()}
    assert listed["bob"] is True
    stats = {a["name"]: a["excluded"] for a in client.get("/api/annotators", headers=admin).json()}
    assert stats["bob"] is True
    exported = client.get("/api/votes/export", headers=admin).text.splitlines()
    assert [json.loads(line)["excluded"] for line in exported] == [True]
    r = client.patch(path, json={"excluded": False}, headers=admin)
    assert r.status_code == 200 and r.json()["votes_changed"] == 1, r.text
    # annotators may not; an unknown user is a 404; the body is strict
    assert client.patch(path, json={"excluded": True}, headers=annotator).status_code == 403
    assert client.patch(path, json={"excluded": True}).status_code == 401
    r = client.patch("/api/users/99999", json={"excluded": True}, headers=admin)
    assert r.status_code == 404, r.text
    for body in ({"exclude": True}, {"excluded": "true"}, {}):
        r = client.patch(path, json=body, headers=admin)
        assert r.status_code == 422, (body, r.text)
    assert client.get("/api/users", headers=admin).json()[1]["excluded"] is False



def test_a_vote_from_a_stale_copy_of_an_excluded_annotator_is_excluded(settings, make_group):
    """The request that records a vote may hold its user from before the admin excluded them
    (the token cache keeps users a few seconds): the vote takes the flag the database has."""
    ids = _samples(make_group(g=4))
    (u,) = _users("ann")
    with session_scope() as s:
        stale = s.get(User, u)
        s.expunge(stale)
    with session_scope() as s:
        annotators.set_excluded(s, u, True)
    assert stale.excluded is False
    with session_scope() as s:
        vote, created = votes.record_vote(s, stale, client_vote_id="late", sample_a_id=ids[0],
                                          sample_b_id=ids[1], outcome="a")
        assert created and vote.excluded is True


# row locks are PostgreSQL's; SQLite runs one writer at a time
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_vote_recorded_while_its_annotator_is_being_excluded_is_excluded(settings,
                                                                           make_group):
    """Excluding an annotator and one of their votes, at once: the vote waits for the
    exclusion to commit and takes its flag (PostgreSQL row locks; SQLite has one writer at a
    time), so no vote of an excluded annotator is left counted."""
    import threading

    from app import db

    assert db.get_engine().dialect.name == "postgresql"
    ids = _samples(make_group(g=4))
    (u,) = _users("ann")
    result: dict[str, object] = {}

    def vote() -> None:
        with session_scope() as s:
            user = s.get(User, u)  # read before the exclusion commits: not excluded
            result["seen"] = user.excluded
            started.set()
            result["vote"] = votes.record_vote(s, user, client_vote_id="racing",
                                               sample_a_id=ids[0], sample_b_id=ids[1],
                                               outcome="a")[0].excluded

    started = threading.Event()
    admin = db.new_session()
    try:
        annotators.set_excluded(admin, u, True)  # flushed, row locked, not yet committed
        thread = threading.Thread(target=vote)
        thread.start()
        assert started.wait(30)
        thread.join(timeout=1.0)
        assert thread.is_alive()  # the vote waits for the exclusion's transaction
        admin.commit()
    finally:
        admin.close()
    thread.join(timeout=30)
    assert result == {"seen": False, "vote": True}


def test_a_revoke_reaches_a_token_read_while_it_was_being_committed(settings):
    """A request that reads a token while its revoke is flushed but not committed sees it
    still valid; the commit then drops what that request cached, so the next request is
    refused at once rather than for the token cache's ttl."""
    from app import db
    from app.errors import Unauthorized

    with session_scope() as s:
        user, token = auth.create_user(s, "ann", "annotator")
        uid = user.id
    admin = db.new_session()
    try:
        assert auth.revoke_user(admin, uid) == 1  # flushed, not committed
        with db.new_session() as s:
            assert auth.authenticate(s, token).id == uid  # still valid to everyone else
        admin.commit()
    finally:
        admin.close()
    with db.new_session() as s:
        try:
            auth.authenticate(s, token)
        except Unauthorized:
            pass
        else:
            raise AssertionError("a revoked token still authenticates from the cache")


def test_a_token_read_before_a_cache_clear_is_not_cached_after_it():
    """The token cache's generation: a user read before a clear() (the change it was for may
    not be in that read) is not put back after it."""
    cache = auth._TokenCache()
    user = User(name="ann", role="annotator")
    before = cache.generation
    cache.clear()
    cache.put("k", user, False, before)
    assert cache.get("k") is None
    cache.put("k", user, False, cache.generation)
    assert cache.get("k") == (user, False)

def test_excluded_votes_leave_the_leaderboard(settings, make_group):
    from app.services.checkpoints import record_checkpoint

    with session_scope() as s:
        c1 = record_checkpoint(s, None, 0, "c1.safetensors", name="c1")
        c2 = record_checkpoint(s, None, 0, "c2.safetensors", name="c2")
    g1 = make_group(checkpoint_id=c1, purpose="evaluate", seed=5)
    g2 = make_group(checkpoint_id=c2, purpose="evaluate", seed=5)
    (u,) = _users("ann")
    _vote(u, _samples(g1)[0], _samples(g2)[0], "a", "z1")
    with session_scope() as s:
        assert leaderboard.compute(s, bootstrap=0)["num_votes"] == 1
        annotators.set_excluded(s, u, True)
    with session_scope() as s:
        assert leaderboard.compute(s, bootstrap=0)["num_votes"] == 0


def test_binomial_p_value_hand_computed():
    assert annotators.binomial_p_above_half(20, 20) == 0.5**20
    # P(X >= 2 | n = 3) = (3 + 1) / 8
    assert abs(annotators.binomial_p_above_half(2, 3) - 0.5) < 1e-12


def test_an_annotator_who_votes_at_random_is_flagged_not_dropped(settings, make_group):
    import itertools
    import random

    ids = _samples(make_group(g=8))  # 28 pairs, all shared by everyone
    honest = _users("h1", "h2", "h3")
    (noisy,) = _users("coin")
    rng = random.Random(1)
    for n, (i, j) in enumerate(itertools.combinations(range(8), 2)):
        for uid in honest:  # everyone honest prefers the later member
            _vote(uid, ids[i], ids[j], "b", f"h{uid}-{n}")
        _vote(noisy, ids[i], ids[j], rng.choice("ab"), f"c-{n}")
    with session_scope() as s:
        rows = {r["name"]: r for r in annotators.stats(s)}
    coin = rows["coin"]
    assert coin["majority_n"] == 28 and coin["flagged"], coin
    assert coin["agreement_p_value"] >= annotators.FLAG_ALPHA
    assert coin["votes"] == 28 and not coin["excluded"]  # flagged for an admin, nothing dropped
    for name in ("h1", "h2", "h3"):
        assert rows[name]["majority_agreement"] == 1.0 and not rows[name]["flagged"], rows[name]


def test_an_exclusion_that_commits_while_a_vote_is_being_recorded_reaches_it(settings,
                                                                            make_group,
                                                                            monkeypatch):
    """The exclusion commits after the vote's request read its user and before the vote is
    written (here: while its row is built): the vote still ends excluded, on SQLite as on
    PostgreSQL, since the flag is read once the vote is written."""
    import threading

    ids = _samples(make_group(g=4))
    (u,) = _users("ann")
    build = votes.Vote

    def exclusion_meanwhile(**fields):
        def exclude() -> None:
            with session_scope() as s:
                annotators.set_excluded(s, u, True)

        thread = threading.Thread(target=exclude)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
        return build(**fields)

    monkeypatch.setattr(votes, "Vote", exclusion_meanwhile)
    with session_scope() as s:
        user = s.get(User, u)
        assert user.excluded is False
        vote, created = votes.record_vote(s, user, client_vote_id="mid", sample_a_id=ids[0],
                                          sample_b_id=ids[1], outcome="a")
        assert created and vote.excluded is True
