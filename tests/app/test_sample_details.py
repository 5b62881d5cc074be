"""rollouts.sample_details: where each sample came from (the arena's reveal, the rollouts page)."""

from __future__ import annotations

from sqlalchemy import select

from app.db import session_scope
from app.models import Sample
from app.services import rollouts
from app.services.checkpoints import record_checkpoint


def test_sample_details(settings, make_group):
    with session_scope() as s:
        ckpt = record_checkpoint(s, None, 7, "c.safetensors", name="ckpt-7")
    gid = make_group(checkpoint_id=ckpt, iteration=3, seed=11, g=3)
    base = make_group(seed=12, g=2)
    with session_scope() as s:
        ids = list(s.scalars(select(Sample.id).order_by(Sample.id)))
        d = rollouts.sample_details(s, [*ids, 10**6])
    assert set(d) == set(ids)
    first = d[ids[0]]
    assert first["group_id"] == gid and first["checkpoint"] == "ckpt-7"
    assert first["iteration"] == 3 and first["seed"] == 11 and first["member_index"] == 0
    assert first["solver"] == "dpm++" and first["sigma"] == 0.3 and first["is_anchor"]
    assert first["rewards"] == {"count": 0.0}
    assert d[ids[-1]]["group_id"] == base and d[ids[-1]]["checkpoint"] == "base model"
    with session_scope() as s:
        assert rollouts.sample_details(s, []) == {}


def test_source_labels_name_the_job_that_made_each_image(settings, make_group):
    """The arena's reveal: a train job's own rollouts are "training job N iteration I" (not
    "base model"), a checkpoint's samples name the checkpoint's training job (not the evaluate
    or rollout job that sampled them), a base-model rollout is "base model"."""
    from app.models import Job

    with session_scope() as s:
        train = Job(kind="train", status="running", config={})
        evaluate = Job(kind="evaluate", status="running", config={})
        rollout = Job(kind="rollout", status="running", config={})
        s.add_all([train, evaluate, rollout])
        s.flush()
        train_id, eval_id, rollout_id = train.id, evaluate.id, rollout.id
        ckpt = record_checkpoint(s, train_id, 20, "c.safetensors", name="ckpt-20")
    own = make_group(train_id, iteration=10, purpose="train")
    evaluated = make_group(eval_id, checkpoint_id=ckpt, purpose="evaluate")
    base = make_group(rollout_id, purpose="rollout")
    with session_scope() as s:
        by_group = {}
        for sid, gid in s.execute(select(Sample.id, Sample.group_id)):
            by_group.setdefault(gid, sid)
        d = rollouts.sample_details(s, list(by_group.values()))
    assert d[by_group[own]]["source"] == f"training job {train_id} iteration 10"
    assert d[by_group[evaluated]]["source"] == f"checkpoint ckpt-20 (#{ckpt}) of job {train_id}"
    assert d[by_group[base]]["source"] == "base model"


def test_reveal_shows_the_sources(settings, make_group):
    from app.ui.arena import reveal_html

    with session_scope() as s:
        from app.models import Job

        train = Job(kind="train", status="running", config={})
        s.add(train)
        s.flush()
        train_id = train.id
    make_group(train_id, iteration=10, purpose="train", g=2)
    with session_scope() as s:
        a, b = s.scalars(select(Sample.id).order_by(Sample.id)).all()
        sources = rollouts.sample_details(s, [a, b])
    html = reveal_html({"vote_id": 1, "outcome": "a", "a_id": a, "b_id": b,
                        "sources": {str(k): v for k, v in sources.items()}})
    assert html.count(f"training job {train_id} iteration 10") == 2
    assert "base model" not in html
