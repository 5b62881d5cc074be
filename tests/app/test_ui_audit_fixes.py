"""The browser audit's findings, at the handlers: the Exclude box follows the picked
annotator, the Datasets page's preview field and messages follow an upload and a deletion and
its list follows the tab, a sampling job's group header names its checkpoint's job, action
messages go once out of date, and a model change resets the fields the new model refuses."""

from __future__ import annotations

import re

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, as in
# tests/app/test_ui_handlers.py


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html).replace("&middot;", "·")


def _wired(page, fn, trigger_id: str, event: str):
    """The event of `page` that runs `fn` when `trigger_id`'s `event` fires."""
    return next(f for f in page.fns.values() if f.fn is fn and any(
        page.blocks[block].elem_id == trigger_id and name == event
        for block, name in f.targets))


# --- 1: the Exclude box shows the picked annotator's state -----------------------------------
def test_picking_an_annotator_sets_the_exclude_box_from_the_database(settings, admin,
                                                                    annotator, make_user):
    """Picking carol (excluded) left the box unticked, and Apply then included her again."""
    import gradio as gr

    from app.db import session_scope
    from app.models import User
    from app.services import annotators as svc
    from app.ui import annotators

    make_user("carol", "annotator")
    with session_scope() as s:
        ids = {u.name: u.id for u in s.query(User)}
        svc.set_excluded(s, ids["carol"], True)
    assert annotators.excluded_of(_token(admin), ids["carol"], False) is True
    assert annotators.excluded_of(_token(admin), ids["bob"], True) is False
    # the box already right: left alone (a tick given meanwhile stays)
    assert annotators.excluded_of(_token(admin), ids["carol"], True) == gr.skip()
    assert annotators.excluded_of(_token(admin), None) == gr.skip()
    assert annotators.excluded_of(_token(annotator), ids["carol"]) == gr.skip()

    with gr.Blocks() as page:
        annotators.build_annotators(gr.State(None))
    event = _wired(page, annotators.excluded_of, "annotators-pick", "change")
    assert [c.elem_id for c in event.outputs] == ["annotators-exclude"]


# --- 5: a fit's message goes once the page shows its outcome ---------------------------------
def test_a_fit_message_is_replaced_by_its_outcome_on_refresh(settings, admin, enqueuer,
                                                             vote_seeder):
    """"Launched fit job 9 ... appears here when it finishes (Refresh)" stayed above v1."""
    import gradio as gr

    from app.db import session_scope
    from app.models import Job
    from app.services import preference as pref_svc
    from app.ui import annotators

    vote_seeder(4)
    launched = annotators.fit_now(enqueuer, _token(admin))
    job_id = int(launched.split('data-job="')[1].split('"')[0])
    assert annotators.fit_update(_token(admin), launched) == gr.skip()  # still queued
    with session_scope() as s:
        s.get(Job, job_id).status = "succeeded"
        pref_svc.record_model(s, version=1, path="preference/v1.safetensors", job_id=job_id,
                              votes_used=4, report={})
    done = annotators.fit_update(_token(admin), launched)
    assert f"Fit job {job_id} finished: version v1, listed below." in _text(done)
    assert annotators.fit_update(_token(admin), done) == gr.skip()
    with session_scope() as s:
        s.get(Job, job_id).status = "failed"
    assert "failed" in annotators.fit_update(_token(admin), launched)

    with gr.Blocks() as page:
        annotators.build_annotators(gr.State(None))
    refresh = _wired(page, annotators.fit_update, "annotators-refresh", "click")
    assert [c.elem_id for c in refresh.outputs] == ["preference-fit-status"]
