"""The UI's handlers without a browser: role checks on the server side, the launch form's
parsing and field errors, the arena's vote flow with prefetch and dedupe, the SVG plots."""

from __future__ import annotations

import pytest

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, so that collecting
# the suite (or a part of it that runs no UI test) does not pay for it


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def test_admin_handlers_refuse_annotators(settings, annotator):
    from app.ui import jobs

    user = _token(annotator)
    job_id, out = jobs.launch(None, user, None, *jobs.form_values("tiny"))
    assert job_id is None and "needs role admin" in out[0]
    assert "needs role admin" in jobs.act(None, "cancel", user, 1)
    assert "log in first" in jobs.act(None, "cancel", None, 1)


def test_launch_form_errors_beside_fields(settings, admin, enqueuer):
    from app.ui import jobs

    names = [d["name"] for d in jobs.describe()]
    values = jobs.form_values("tiny")
    values[names.index("num_anchors")] = 99
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    assert job_id is None
    errors = dict(zip(names, out[1:], strict=True))
    assert "group_size" in errors["num_anchors"]
    assert all(not v for k, v in errors.items() if k != "num_anchors")
    values[names.index("num_anchors")] = 2
    values[names.index("reward_weights")] = "{not json"
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    assert job_id is None and "not valid JSON" in out[1 + names.index("reward_weights")]
    values[names.index("reward_weights")] = '{"count": 1.0}'
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    assert job_id is not None and enqueuer.calls == [(job_id, "train")]


def test_launch_form_shows_every_error_at_once(settings, admin, enqueuer):
    from app.ui import jobs

    names = [d["name"] for d in jobs.describe()]
    values = jobs.form_values("tiny")
    values[names.index("num_anchors")] = 99
    values[names.index("reward_weights")] = '{"beauty": 1}'
    values[names.index("base_checkpoint")] = "/etc/passwd"
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    assert job_id is None and "3 field(s) need fixing" in out[0]
    errors = dict(zip(names, out[1:], strict=True))
    assert "group_size" in errors["num_anchors"] and "beauty" in errors["reward_weights"]
    assert "MODELS_DIR" in errors["base_checkpoint"]
    assert sum(bool(v) for v in errors.values()) == 3 and enqueuer.calls == []


def test_job_page_says_what_a_queued_job_waits_for(settings, admin, enqueuer):
    from app.ui import jobs

    values = jobs.form_values("tiny")
    values[[d["name"] for d in jobs.describe()].index("device")] = "cuda"
    job_id, _ = jobs.launch(enqueuer, _token(admin), None, *values)
    _, header, *_ = jobs.job_view(_token(admin), job_id, None)
    assert "waiting for a worker with a CUDA device on queue &#x27;gpu&#x27;" in header


def test_arena_vote_prefetch_and_dedupe(settings, annotator, make_group):
    import json

    from app.db import session_scope
    from app.services import votes
    from app.ui import arena

    make_group(g=4)
    user = _token(annotator)
    _, _, _, state = arena.load(user, None)
    first = state["current"]
    assert first is not None and state["next"] is not None
    meta = json.dumps({"client_vote_id": "v1", "nonce": first["nonce"], "outcome": "a"})
    steps = list(arena.dispatch(meta, user, state))
    assert len(steps) == 2  # the prefetched pair at once, then the prefetch after it
    shown = steps[0][3]["current"]
    assert (shown["a_id"], shown["b_id"]) != (first["a_id"], first["b_id"])
    state = steps[-1][3]
    assert state["session_votes"] == 1
    # the same click again (same nonce and id): nothing more is recorded
    list(arena.dispatch(meta, user, state))
    with session_scope() as s:
        assert votes.count_votes(s) == 1
        row = next(votes.export_votes(s))
    assert (row["image_0_uid"], row["image_1_uid"], row["outcome"]) == (
        first["a_id"], first["b_id"], "a")


@pytest.mark.parametrize("n", [0, 1, 5])
def test_line_plot_points(n):
    from app.ui.common import line_plot

    svg = line_plot("r", list(range(n)), {"r": [float(i) for i in range(n)]})
    assert f'data-points="{n}"' in svg and svg.endswith("</svg>")
