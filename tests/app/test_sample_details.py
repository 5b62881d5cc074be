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
