from __future__ import annotations

import io
import json
import uuid
from itertools import combinations

import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select


def vote(client, headers, pair, outcome="a", vid=None, **extra):
    body = {"client_vote_id": vid or uuid.uuid4().hex, "sample_a_id": pair["a"]["sample_id"],
            "sample_b_id": pair["b"]["sample_id"], "outcome": outcome,
            "selection": pair.get("selection"), "session_id": "s1", "latency_ms": 1234,
            "shown_at": "2026-01-01T12:00:00Z", **extra}
    return client.post("/api/votes", json=body, headers=headers)


def test_next_pairs_never_repeat_and_sides_randomised(client, annotator, make_user, make_group):
    g1 = make_group(g=4)
    make_group(g=3, prompt="one blue square")
    seen, left_is_lower = set(), []
    for _ in range(6 + 3):
        r = client.get("/api/votes/next", headers=annotator)
        assert r.status_code == 200, r.text
        pair = r.json()
        key = frozenset((pair["a"]["sample_id"], pair["b"]["sample_id"]))
        assert key not in seen, "a pair was offered twice"
        seen.add(key)
        assert pair["selection"] == "within_group"
        assert pair["a"]["image_url"].startswith("/api/media/rollouts/")
        left_is_lower.append(pair["a"]["sample_id"] < pair["b"]["sample_id"])
        assert vote(client, annotator, pair, "tie").status_code == 201
    assert client.get("/api/votes/next", headers=annotator).status_code == 204
    assert len(left_is_lower) == 9
    # another annotator still gets pairs
    other = make_user("dora", "annotator")
    assert client.get("/api/votes/next", headers=other).status_code == 200
    assert g1


def test_exclude_for_prefetch(client, annotator, make_group):
    make_group(g=3)
    first = client.get("/api/votes/next", headers=annotator).json()
    ids = [first["a"]["sample_id"], first["b"]["sample_id"]]
    for _ in range(5):
        nxt = client.get("/api/votes/next", params={"exclude": ids[:1]}, headers=annotator)
        assert ids[0] not in (nxt.json()["a"]["sample_id"], nxt.json()["b"]["sample_id"])


def test_vote_is_idempotent_by_client_id_and_pairs_unique(client, annotator, make_group,
                                                          session):
    from app.models import Vote

    make_group(g=3)
    pair = client.get("/api/votes/next", headers=annotator).json()
    r1 = vote(client, annotator, pair, "b", vid="vote-1")
    assert r1.status_code == 201
    v = r1.json()
    assert (v["outcome"], v["latency_ms"], v["session_id"], v["selection"]) == \
        ("b", 1234, "s1", "within_group")
    assert v["sample_a_id"] == pair["a"]["sample_id"] and v["excluded"] is False
    r2 = vote(client, annotator, pair, "b", vid="vote-1")
    assert r2.status_code == 200 and r2.json()["id"] == v["id"] and r2.json()["duplicate"]
    assert session.scalar(select(func.count()).select_from(Vote)) == 1
    # the same pair again (new client id, sides swapped) is refused
    swapped = {"a": pair["b"], "b": pair["a"], "selection": "within_group"}
    r3 = vote(client, annotator, swapped, "a", vid="vote-2")
    assert r3.status_code == 409
    # naming the vote that holds the pair, for a client that retries under a new id
    lo, hi = sorted((pair["a"]["sample_id"], pair["b"]["sample_id"]))
    assert r3.json()["vote_id"] == v["id"], r3.json()
    assert r3.json()["detail"] == f"you already judged the pair ({lo}, {hi}) in vote {v['id']}"
    assert session.scalar(select(func.count()).select_from(Vote)) == 1


def test_vote_validation(client, annotator, make_group):
    g1 = client.get(f"/api/rollouts/{make_group(g=2)}", headers=annotator).json()["samples"]
    g2 = client.get(f"/api/rollouts/{make_group(g=2, prompt='x')}",
                    headers=annotator).json()["samples"]

    def pair(a, b):
        return {"a": {"sample_id": a}, "b": {"sample_id": b}}

    assert vote(client, annotator, pair(g1[0]["id"], g2[0]["id"])).status_code == 422
    assert vote(client, annotator, pair(g1[0]["id"], g1[0]["id"])).status_code == 422
    assert vote(client, annotator, pair(g1[0]["id"], 99999)).status_code == 422
    assert vote(client, annotator, pair(g1[0]["id"], g1[1]["id"]), "meh").status_code == 422
    # ids and the latency as strings, floats or booleans are a client's bug, not converted
    a, b = g1[0]["id"], g1[1]["id"]
    for wrong, said in (({"a": {"sample_id": str(a)}, "b": {"sample_id": b}}, "integer"),
                        ({"a": {"sample_id": a}, "b": {"sample_id": float(b)}},
                         f"whole number written without a decimal point ({b}, not {b}.0)")):
        r = vote(client, annotator, wrong)
        assert r.status_code == 422 and said in r.text, r.text
    r = vote(client, annotator, pair(a, b), latency_ms="12")
    assert r.status_code == 422 and "latency_ms" in r.text
    assert vote(client, annotator, pair(g1[0]["id"], g1[1]["id"]), "both_bad").status_code == 201


def _eval_setup(client, admin, make_group, session):
    from stored_checkpoints import stored_checkpoint

    from app.services.storage import write_bytes

    ck = []
    for i in range(3):
        write_bytes(f"ck/{i}.safetensors", b"w")
        ck.append(stored_checkpoint(session, None, 0, f"ck/{i}.safetensors", name=f"ckpt{i}"))
    session.commit()
    job = client.post("/api/jobs", json={"kind": "evaluate", "config": {"checkpoint_ids": ck}},
                      headers=admin).json()
    for c in ck:
        for seed in (0, 1):
            make_group(job["id"], prompt="two red circles", g=2, checkpoint_id=c, seed=seed)
    return ck


def test_cross_checkpoint_pairs(client, admin, annotator, make_group, session):
    ck = _eval_setup(client, admin, make_group, session)
    from app.models import RolloutGroup, Sample

    groups = {s.id: (g.checkpoint_id, g.seed, s.member_index) for s, g in session.execute(
        select(Sample, RolloutGroup).join(RolloutGroup))}
    kinds = set()
    n = 0
    while True:
        r = client.get("/api/votes/next", headers=annotator)
        if r.status_code == 204:
            break
        p = r.json()
        a, b = groups[p["a"]["sample_id"]], groups[p["b"]["sample_id"]]
        kinds.add(p["selection"])
        if p["selection"] == "cross_checkpoint":
            assert a[0] != b[0] and a[1:] == b[1:]  # same seed and member, two checkpoints
        else:
            assert a[:2] == b[:2]
        assert vote(client, annotator, p, "a").status_code == 201
        n += 1
    # within: 6 groups x 1 pair; cross: 3 checkpoint pairs x 2 seeds x 2 members
    assert n == 6 + 12 and kinds == {"within_group", "cross_checkpoint"}
    assert len(ck) == 3


def test_export_jsonl_and_parquet(client, admin, annotator, make_group, settings, tmp_path):
    make_group(g=3)
    outcomes = ["a", "b", "tie"]
    sent = []
    for o in outcomes:
        p = client.get("/api/votes/next", headers=annotator).json()
        sent.append((p, o))
        assert vote(client, annotator, p, o).status_code == 201
    jl = client.get("/api/votes/export", headers=admin)
    assert jl.status_code == 200
    rows = [json.loads(line) for line in jl.text.splitlines()]
    pq_rows = pq.read_table(io.BytesIO(client.get("/api/votes/export?format=parquet",
                                                  headers=admin).content)).to_pylist()
    assert [r["vote_id"] for r in pq_rows] == [r["vote_id"] for r in rows]
    from app.services.votes import EXPORT_COLUMNS

    assert all(list(r) == [name for name, _ in EXPORT_COLUMNS] for r in rows + pq_rows)
    for (p, o), row, prow in zip(sent, rows, pq_rows, strict=True):
        assert row["prompt"] == "two red circles" and row["annotator"] == "bob"
        assert row["image_0_uid"] == p["a"]["sample_id"]
        assert "/api/media/" + row["image_0_path"] == p["a"]["image_url"]
        assert "/api/media/" + row["image_1_path"] == p["b"]["image_url"]
        assert (row["label_0"], row["label_1"]) == {"a": (1, 0), "b": (0, 1),
                                                    "tie": (0.5, 0.5)}[o]
        assert row["outcome"] == o and row["has_label"] is True and row["latency_ms"] == 1234
        assert prow["label_0"] == row["label_0"] and prow["image_1_path"] == row["image_1_path"]
    # the export is what `python -m trainer fit-preference --votes` reads, images from storage
    from trainer.cli import read_votes

    (tmp_path / "votes.jsonl").write_text(jl.text)
    pairs = read_votes(tmp_path / "votes.jsonl", settings.resolved_storage_dir)
    assert [(q.key, q.outcome) for q in pairs] == [(str(r["vote_id"]), r["outcome"])
                                                   for r in rows]
    assert pairs[0].image_a.shape[-1] == 3 and pairs[0].prompt == "two red circles"


def test_an_annotator_exports_only_their_own_votes(client, admin, annotator, make_user,
                                                   make_group):
    """Who voted, when and how fast is per-person data: an admin exports everyone's votes, an
    annotator only their own (both formats)."""
    make_group(g=4)
    carol = make_user("carol", "annotator")
    for who in (annotator, carol, annotator):
        assert vote(client, who, client.get("/api/votes/next", headers=who).json(),
                    "a").status_code == 201

    def voters(headers: dict[str, str]) -> list[str]:
        jl = client.get("/api/votes/export", headers=headers).text.splitlines()
        parquet = pq.read_table(io.BytesIO(client.get(
            "/api/votes/export?format=parquet", headers=headers).content)).to_pylist()
        assert [json.loads(line)["vote_id"] for line in jl] == [r["vote_id"] for r in parquet]
        return [r["annotator"] for r in parquet]

    assert voters(admin) == ["bob", "carol", "bob"]
    assert voters(annotator) == ["bob", "bob"]
    assert voters(carol) == ["carol"]


def test_all_pairs_of_group_are_reachable(client, annotator, make_group):
    gid = make_group(g=5)
    ids = [s["id"] for s in client.get(f"/api/rollouts/{gid}", headers=annotator).json()["samples"]]
    got = set()
    while (r := client.get("/api/votes/next", headers=annotator)).status_code == 200:
        p = r.json()
        got.add(frozenset((p["a"]["sample_id"], p["b"]["sample_id"])))
        vote(client, annotator, p, "skip")
    assert got == {frozenset(c) for c in combinations(ids, 2)}


def test_sides_are_randomised(session, make_group, annotator):
    import random

    from app.services.votes import next_pair

    make_group(g=2)
    rng = random.Random(1)
    lefts = [next_pair(session, 1, rng=rng).a_id for _ in range(200)]
    assert 60 < lefts.count(min(lefts)) < 140  # both orders, about half each


def test_reused_client_vote_id_for_a_different_vote_is_a_conflict(client, annotator, make_group,
                                                                   make_user, session):
    from app.models import Vote

    make_group(g=3)
    pair = client.get("/api/votes/next", headers=annotator).json()
    a, b = pair["a"]["sample_id"], pair["b"]["sample_id"]
    first = vote(client, annotator, pair, "a", vid="vote-1")
    assert first.status_code == 201
    expected = (f"client_vote_id vote-1: already used for a different vote (sample_a_id {a}, "
                f"sample_b_id {b}, outcome a); a new vote needs a new client_vote_id")
    other = client.get("/api/votes/next", headers=annotator).json()
    swapped = {"a": pair["b"], "b": pair["a"], "selection": "within_group"}
    for p, outcome in ((pair, "b"), (pair, "tie"), (other, "a"), (swapped, "b")):
        r = vote(client, annotator, p, outcome, vid="vote-1")
        assert r.status_code == 409, r.text
        assert r.json() == {"detail": expected, "field": "client_vote_id",
                            "vote_id": first.json()["id"],
                            "errors": [{"field": "client_vote_id", "message": expected}]}
    # the same vote again is a retry, even if its timing fields differ
    r = vote(client, annotator, pair, "a", vid="vote-1", latency_ms=99, session_id="s2")
    assert r.status_code == 200 and r.json()["id"] == first.json()["id"]
    assert r.json()["latency_ms"] == 1234 and r.json()["duplicate"] is True
    assert session.scalar(select(func.count()).select_from(Vote)) == 1
    # another annotator may use the same client id
    assert vote(client, make_user("carl", "annotator"), pair, "b", vid="vote-1").status_code \
        == 201


def test_vote_datetimes_carry_utc(client, admin, annotator, make_group):
    make_group(g=3)
    pair = client.get("/api/votes/next", headers=annotator).json()
    created = vote(client, annotator, pair, "a", vid="t-1", shown_at="2026-01-01T14:00:00+02:00")
    again = vote(client, annotator, pair, "a", vid="t-1")  # read back from the database
    assert (created.status_code, again.status_code) == (201, 200)
    for body in (created.json(), again.json()):
        assert body["shown_at"] == "2026-01-01T12:00:00.000000Z"
        assert body["created_at"].endswith("Z")
    assert created.json()["created_at"] == again.json()["created_at"]
    row = json.loads(client.get("/api/votes/export", headers=admin).text.splitlines()[0])
    assert row["shown_at"] == "2026-01-01T12:00:00.000000Z"
    assert row["created_at"] == created.json()["created_at"]


def _red_squares(corners: list[tuple[int, int]]) -> bytes:
    """A 32x32 PNG: 7x7 red squares at the given top-left corners on white."""
    from PIL import Image

    im = Image.new("RGB", (32, 32), "white")
    for x, y in corners:
        im.paste((220, 38, 38), (x, y, x + 7, y + 7))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def test_two_checkpoints_drawing_one_picture_are_not_offered(client, annotator, session):
    """Two checkpoints' images of one noise that are nearly identical say nothing about which
    checkpoint is better: the cross-checkpoint pick passes over them, and says so."""
    import random

    from stored_checkpoints import stored_checkpoint

    from app.db import session_scope
    from app.models import Sample
    from app.services import votes as svc
    from app.services.rollouts import record_rollout_group
    from app.services.storage import write_bytes

    write_bytes("ck/x.safetensors", b"w")
    ck = [stored_checkpoint(session, None, it, "ck/x.safetensors", name=f"c{it}")
          for it in (1, 2)]
    session.commit()
    one, two, moved = (_red_squares([(4, 4)]), _red_squares([(4, 4), (20, 20)]),
                       _red_squares([(12, 12)]))
    # member 0: both checkpoints draw one picture; member 1: they differ
    with session_scope() as s:
        for c, pictures in zip(ck, ((one, two), (one, moved)), strict=True):
            record_rollout_group(s, job_id=None, iteration=0, prompt_text="one red square",
                                 solver="dpm++", steps=8, sigma=0.3, seed=5, checkpoint_id=c,
                                 purpose="evaluate",
                                 samples=[{"png": p, "member_index": i, "rewards": {}}
                                          for i, p in enumerate(pictures)])
    with session_scope() as s:
        member = {sid: m for sid, m in s.execute(select(Sample.id, Sample.member_index))}
    cross = []
    while (r := client.get("/api/votes/next", headers=annotator)).status_code == 200:
        pair = r.json()
        if pair["selection"].startswith("cross_checkpoint"):
            cross.append((member[pair["a"]["sample_id"]], member[pair["b"]["sample_id"]]))
            assert pair["pixel_difference"] > svc.NEAR_IDENTICAL_FRACTION
        assert vote(client, annotator, pair, "a").status_code == 201
    assert cross == [(1, 1)], cross  # member 1's pair only
    with session_scope() as s:
        picks = {svc.cross_checkpoint(s, 10**6, random.Random(seed), set()).selection
                 for seed in range(20)}
    assert picks == {"cross_checkpoint", "cross_checkpoint_skipped_near_identical"}, picks


def test_nearly_identical_pairs_are_skipped(client, admin, annotator, settings):
    """Within-group pairs whose images are nearly identical are never offered; a pick that
    passed over some says so in its selection (stored on the vote)."""
    import random

    from PIL import Image

    from app.db import session_scope
    from app.models import Sample, Vote
    from app.schemas import SKIPPED_NEAR_IDENTICAL
    from app.services import votes as svc
    from app.services.rollouts import record_rollout_group

    same = _red_squares([(4, 4)])
    almost = Image.open(io.BytesIO(same)).copy()
    almost.putpixel((20, 20), (0, 0, 0))  # one pixel of 1,024 differs
    buf = io.BytesIO()
    almost.save(buf, format="PNG")
    nearly = buf.getvalue()
    other = _red_squares([(4, 4), (20, 20)])  # one more object: clearly different
    with session_scope() as s:
        record_rollout_group(s, job_id=None, iteration=0, prompt_text="one red square",
                             solver="dpm++", steps=8, sigma=0.3, seed=1, purpose="rollout",
                             samples=[{"png": p, "member_index": i, "rewards": {}}
                                      for i, p in enumerate([same, nearly, other])])
    with session_scope() as s:
        paths = [r.image_path for r in s.scalars(select(Sample).order_by(Sample.id))]
    assert svc.near_identical(paths[0], paths[1])
    assert not svc.near_identical(paths[0], paths[2])
    assert svc.differing_fraction(paths[0], paths[1]) == 1 / 1024
    offered, selections = set(), set()
    for _ in range(4):
        r = client.get("/api/votes/next", headers=annotator)
        if r.status_code == 204:
            break
        pair = r.json()
        offered.add(frozenset((pair["a"]["sample_id"], pair["b"]["sample_id"])))
        selections.add(pair["selection"])
        # the pair's distance comes with it: 49 pixels of 1,024 (the second square) differ
        assert pair["pixel_difference"] == 49 / 1024 > svc.NEAR_IDENTICAL_FRACTION
        posted = vote(client, annotator, pair, "a")
        assert posted.status_code == 201 and posted.json()["pixel_difference"] == 49 / 1024
    with session_scope() as s:
        ids = list(s.scalars(select(Sample.id).order_by(Sample.id)))
        stored = set(s.scalars(select(Vote.selection)))
        # measured again from the stored images when the vote was recorded, not taken on trust
        distances = list(s.scalars(select(Vote.pixel_difference)))
    assert offered == {frozenset((ids[0], ids[2])), frozenset((ids[1], ids[2]))}
    assert frozenset((ids[0], ids[1])) not in offered
    assert stored == selections <= {"within_group", SKIPPED_NEAR_IDENTICAL}
    assert distances == [49 / 1024] * 2
    exported = [json.loads(line) for line in
                client.get("/api/votes/export", headers=admin).text.splitlines()]
    assert [row["pixel_difference"] for row in exported] == [49 / 1024] * 2
    # the strategy alone, seeded so it meets the identical pair first: it says it skipped it
    with session_scope() as s:
        choices = {svc.within_group(s, 10**6, random.Random(seed), set()).selection
                   for seed in range(20)}
    assert SKIPPED_NEAR_IDENTICAL in choices and choices <= {
        "within_group", SKIPPED_NEAR_IDENTICAL}
    # posted by hand (a script voting every pair of a group), the pair is kept with how far
    # apart it is, so an export can drop it: refusing it would break such scripts mid-run
    r = client.post("/api/votes", headers=annotator, json={
        "client_vote_id": "by-hand", "sample_a_id": ids[0], "sample_b_id": ids[1],
        "outcome": "a"})
    assert r.status_code == 201, r.text
    assert 0 < r.json()["pixel_difference"] < svc.NEAR_IDENTICAL_FRACTION


def test_a_pair_is_found_behind_many_nearly_identical_ones(session):
    """More nearly identical pairs than one scan page (22 copies of one image: 231 pairs)
    come before the only pair worth a vote: the scan pages past them, from any start."""
    import random

    from app.services import votes as svc
    from app.services.rollouts import record_rollout_group

    copies = 22
    assert copies * (copies - 1) // 2 > svc.SCAN_PAGE
    for prompt, images in (("one red square", [_red_squares([(4, 4)])] * copies),
                           ("two red squares", [_red_squares([(4, 4)]), _red_squares([(4, 4), (20, 20)])])):
        record_rollout_group(session, job_id=None, iteration=0, prompt_text=prompt,
                             solver="dpm++", steps=8, sigma=0.3, seed=1, purpose="rollout",
                             samples=[{"png": p, "member_index": i, "rewards": {}}
                                      for i, p in enumerate(images)])
    session.commit()
    for seed in range(12):
        choice = svc._scan(session, 10**6, random.Random(seed), set(), cross=False)
        assert choice is not None and choice.prompt == "two red squares", seed
    # and through the strategies, as the arena asks
    for seed in range(4):
        choice = svc.next_pair(session, 10**6, rng=random.Random(seed))
        assert choice is not None and choice.prompt == "two red squares", seed


def test_active_selection_passes_over_nearly_identical_images(session):
    """The least-sure pair by the model's margin is often two images that look the same (their
    scores are equal too); active selection offers the next least-sure pair instead."""
    import random

    from PIL import Image

    from app.models import PreferenceModelRow, Sample
    from app.services import votes as svc
    from app.services.rollouts import record_rollout_group

    same = _red_squares([(4, 4)])
    almost = Image.open(io.BytesIO(same)).copy()
    almost.putpixel((20, 20), (0, 0, 0))  # one pixel of 1,024 differs
    buf = io.BytesIO()
    almost.save(buf, format="PNG")
    other = _red_squares([(4, 4), (20, 20)])
    record_rollout_group(session, job_id=None, iteration=0, prompt_text="one red square",
                         solver="dpm++", steps=8, sigma=0.3, seed=1, purpose="rollout",
                         samples=[{"png": p, "member_index": i, "rewards": {}}
                                  for i, p in enumerate([same, buf.getvalue(), other])])
    session.add(PreferenceModelRow(version=1, path="pref-v1.safetensors"))
    samples = list(session.scalars(select(Sample).order_by(Sample.id)))
    # the identical pair is the least sure (margin 0.01); then (same, other) at margin 2.0
    for sample, score in zip(samples, (0.0, 0.01, 2.0), strict=True):
        sample.preference_score, sample.preference_version = score, 1
    session.commit()
    svc._pref_version.clear()
    ids = [x.id for x in samples]
    assert svc.near_identical(samples[0].image_path, samples[1].image_path)
    for seed in range(8):
        choice = svc.active(session, 10**6, random.Random(seed), set())
        # the pick says it passed over the nearly identical pair, as within-group picks do
        assert choice is not None, seed
        assert choice.selection == "active_uncertain" + svc.SKIPPED_SUFFIX, seed
        assert {choice.a_id, choice.b_id} == {ids[1], ids[2]}, seed  # margin 1.99, not 0.01
    # with the nearly identical pair out of reach the least-sure pair is first: a plain reason
    choice = svc.active(session, 10**6, random.Random(0), {ids[0]})
    assert choice is not None and choice.selection == "active_uncertain"
    # with every other pair judged or excluded, nothing is offered rather than the coin toss
    assert svc.active(session, 10**6, random.Random(0), {ids[2]}) is None


def test_a_vote_names_only_a_selection_the_server_makes_and_a_past_shown_at(
        client, annotator, make_group, session):
    """The export's selection and timing feed selection-bias and latency checks: a made-up
    selection or a shown_at after the vote would pass for the server's own. Every 422 names
    its field and records nothing."""
    from datetime import UTC, datetime, timedelta

    from app.models import Vote
    from app.schemas import SELECTIONS

    make_group(g=3)
    pair = client.get("/api/votes/next", headers=annotator).json()
    r = vote(client, annotator, pair, selection="made_up")
    assert r.status_code == 422 and r.json()["field"] == "selection", r.text
    assert "within_group" in r.json()["detail"]
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    r = vote(client, annotator, pair, shown_at=future)
    assert r.status_code == 422 and r.json()["field"] == "shown_at", r.text
    r = vote(client, annotator, pair, shown_at="0001-01-01T00:00:00Z")
    assert r.status_code == 422 and "before 2000" in r.json()["errors"][0]["message"], r.text
    # every problem at once: the outcome's, the selection's and the time's in one 422
    r = vote(client, annotator, pair, outcome="zz", selection="made_up", shown_at=future)
    assert r.status_code == 422, r.text
    assert {e["field"] for e in r.json()["errors"]} == {"outcome", "selection", "shown_at"}
    assert session.scalar(select(func.count()).select_from(Vote)) == 0
    # a clock a minute ahead is drift, not a future; the server's own selection is taken
    ahead = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    r = vote(client, annotator, pair, shown_at=ahead)
    assert r.status_code == 201 and r.json()["selection"] in SELECTIONS, r.text


def test_a_vote_names_both_missing_samples_and_a_selection_that_fits_its_pair(
        client, admin, annotator, make_group, session):
    """Two unknown samples were answered one at a time (sample_a_id's, then after a fix
    sample_b_id's); a within-group pair said to be `cross_checkpoint` (or the reverse) was
    recorded, counting the vote under a strategy that never picked it; two checkpoints'
    images of different seeds were taken as a cross-checkpoint pair."""
    from app.models import RolloutGroup, Sample, Vote

    r = vote(client, annotator, {"a": {"sample_id": 99998}, "b": {"sample_id": 99999}})
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["sample_a_id", "sample_b_id"], r.text
    assert "99998" in r.json()["detail"] and "99999" in r.json()["detail"]

    ck = _eval_setup(client, admin, make_group, session)
    rows = session.execute(select(Sample.id, RolloutGroup.checkpoint_id, RolloutGroup.seed,
                                  Sample.member_index).join(RolloutGroup)).all()
    mine = [r for r in rows if r[1] == ck[0] and r[2] == 0]
    theirs = next(r for r in rows if r[1] == ck[1] and r[2] == 0 and r[3] == mine[0][3])
    within = {"a": {"sample_id": mine[0][0]}, "b": {"sample_id": mine[1][0]}}
    cross = {"a": {"sample_id": mine[0][0]}, "b": {"sample_id": theirs[0]}}
    for pair, wrong in ((within, "cross_checkpoint"), (cross, "within_group"),
                        (cross, "active_uncertain")):
        r = vote(client, annotator, {**pair, "selection": wrong})
        assert r.status_code == 422 and r.json()["field"] == "selection", r.text
    # two checkpoints' images of another seed or member are no pair the server offers: the
    # vote would judge two draws of the noise as much as the checkpoints
    other_seed = next(r for r in rows if r[1] == ck[1] and r[2] == 1 and r[3] == mine[0][3])
    other_member = next(r for r in rows if r[1] == ck[1] and r[2] == 0 and r[3] != mine[0][3])
    for sid in (other_seed[0], other_member[0]):
        r = vote(client, annotator, {"a": {"sample_id": mine[0][0]}, "b": {"sample_id": sid},
                                     "selection": "cross_checkpoint"})
        assert r.status_code == 422 and "seed and member" in r.json()["detail"], r.text
    assert session.scalar(select(func.count()).select_from(Vote)) == 0
    for pair, right in ((within, "within_group"), (cross, "cross_checkpoint")):
        r = vote(client, annotator, {**pair, "selection": right})
        assert r.status_code == 201 and r.json()["selection"] == right, r.text


def test_a_pairs_problems_are_named_beside_a_bad_shown_at_or_selection(
        client, admin, annotator, make_group, session):
    """A shown_at in the future (or a made-up selection) was the whole 422, and the pair's
    own problem (a sample not found, two groups' samples) came only once that was fixed;
    one answer names them all, through the API and through the service the UI calls."""
    from datetime import UTC, datetime, timedelta

    from app.errors import Invalid
    from app.models import Sample, User, Vote
    from app.services import votes as svc

    first, second = make_group(g=2), make_group(g=2, prompt="one blue square")
    a = session.scalar(select(Sample.id).where(Sample.group_id == first))
    b = session.scalar(select(Sample.id).where(Sample.group_id == second))
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    r = vote(client, annotator, {"a": {"sample_id": a}, "b": {"sample_id": b}},
             shown_at=future)
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["shown_at", "sample_b_id"], r.text
    assert "neither from one rollout group" in r.json()["detail"]
    r = vote(client, annotator, {"a": {"sample_id": a}, "b": {"sample_id": 999999}},
             selection="bogus")
    assert r.status_code == 422, r.text
    assert {e["field"] for e in r.json()["errors"]} == {"selection", "sample_b_id"}, r.text
    assert "sample 999999 not found" in r.json()["detail"]
    # an id that is itself invalid is named once, as its own problem
    r = vote(client, annotator, {"a": {"sample_id": a}, "b": {"sample_id": "x"}},
             shown_at=future)
    assert [e["field"] for e in r.json()["errors"]] == ["sample_b_id", "shown_at"], r.text
    annotator_row = session.scalar(select(User).where(User.role == "annotator"))
    with pytest.raises(Invalid) as refused:
        svc.record_vote(session, annotator_row, client_vote_id="ui-1", sample_a_id=a,
                        sample_b_id=b, outcome="a", selection="bogus")
    assert [e["field"] for e in refused.value.details["errors"]] == ["selection",
                                                                     "sample_b_id"]
    assert session.scalar(select(func.count()).select_from(Vote)) == 0


def test_a_session_id_with_hidden_characters_is_refused(client, annotator, make_group, session):
    """A session id that looks like another (a zero-width space, a direction mark, a line
    break) would split an annotator's session in the export without anyone seeing why."""
    from app.models import Vote

    make_group(g=3)
    pair = client.get("/api/votes/next", headers=annotator).json()
    for hidden in ("a\u200bb", "a\u202eb", "a\nb"):
        r = vote(client, annotator, pair, session_id=hidden)
        assert r.status_code == 422 and r.json()["field"] == "session_id", r.text
    assert session.scalar(select(func.count()).select_from(Vote)) == 0
    assert vote(client, annotator, pair, session_id="tab-7").status_code == 201


def test_a_shapes_picture_of_the_same_objects_a_pixel_over_is_nearly_identical(settings):
    """Neighbours of one noise that drew one picture differ in edge pixels: over 1% of them
    for a square a pixel over, which the pixel rule alone offered as a pair. A shapes-world
    picture (32x32 as drawn) of the same objects in the same places is not offered; one
    object recoloured or moved further is; a larger image (another model's, downsampled to
    compare) is judged by its pixels alone."""
    from PIL import Image

    from app.db import session_scope
    from app.models import Sample
    from app.services import votes as svc
    from app.services.rollouts import record_rollout_group

    def png(image: Image.Image) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    def large(corner: int) -> bytes:
        image = Image.new("RGB", (64, 64), "white")
        image.paste((220, 38, 38), (8, corner, 22, corner + 14))
        return png(image)

    blue = Image.new("RGB", (32, 32), "white")
    blue.paste((37, 99, 235), (4, 5, 11, 12))
    images = [_red_squares([(4, 4)]), _red_squares([(4, 5)]), _red_squares([(4, 8)]),
              png(blue), large(8), large(10)]
    with session_scope() as s:
        record_rollout_group(s, job_id=None, iteration=0, prompt_text="one red square",
                             solver="dpm++", steps=8, sigma=0.3, seed=1, purpose="rollout",
                             samples=[{"png": p, "member_index": i, "rewards": {}}
                                      for i, p in enumerate(images)])
    with session_scope() as s:
        paths = [r.image_path for r in s.scalars(select(Sample).order_by(Sample.id))]
    assert svc.differing_fraction(paths[0], paths[1]) == 14 / 1024 > svc.NEAR_IDENTICAL_FRACTION
    assert svc.near_identical(paths[0], paths[1])  # the same square, a pixel over
    assert not svc.near_identical(paths[0], paths[2])  # four pixels over: moved
    assert not svc.near_identical(paths[1], paths[3])  # the same place, another colour
    assert svc.differing_fraction(paths[4], paths[5]) > svc.NEAR_IDENTICAL_FRACTION
    assert not svc.near_identical(paths[4], paths[5])  # 64 px: pixels alone decide
