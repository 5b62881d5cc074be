"""Found by a new user's walk through the UI, checked at the handlers: a token shown once and
"Launched train job 3." stayed on screen after the page had moved on; Revoke access and Cancel
of a running job acted on one click; the job buttons offered actions the picked job cannot
take; the arena's totals were stale when its tab came back; a blank name was called too long
or short."""

from __future__ import annotations

import re

import pytest

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, as in
# tests/app/test_ui_handlers.py


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def _page_in_tab(build) -> tuple:
    """`build(user, tab)` in a tab of the UI's root Blocks: the page and the login's state."""
    import gradio as gr

    from app.ui import StudioBlocks

    with StudioBlocks() as page:
        user = gr.State(None)
        with gr.Tabs(), gr.Tab("Page") as tab:
            build(user, tab)
    return page, user


def _by_id(page, elem_id: str):
    return next(b for b in page.blocks.values() if getattr(b, "elem_id", None) == elem_id)


def _triggers(page, fn) -> set[tuple[str, str]]:
    """(elem_id or class name, event) of every trigger of the events of `page` running `fn`."""
    out = set()
    for f in page.fns.values():
        if f.fn is fn:
            for block_id, event in f.targets:
                block = page.blocks[block_id]
                out.add((block.elem_id or type(block).__name__, event))
    return out


# --- 1: a token shown once goes with the next action; so does "Launched train job 3." ----------
def test_a_new_users_token_goes_with_any_other_action_of_the_page(settings):
    """The token of a user just created stayed on screen beside them once revoked, after a
    Refresh, and for whoever logged in next in that tab."""
    from app.ui import annotators

    page, _ = _page_in_tab(lambda user, tab: annotators.build_annotators(user, tab))
    clears = _triggers(page, annotators.forget_token)
    assert {("users-revoke", "click"), ("annotators-refresh", "click"),
            ("annotators-apply", "click"), ("preference-fit", "click"),
            ("Tab", "select"), ("State", "change")} <= clears, clears
    assert ("users-create", "click") not in clears  # it shows the next one's
    forget = next(f for f in page.fns.values() if f.fn is annotators.forget_token)
    assert [o.elem_id for o in forget.outputs] == ["users-created"]
    assert annotators.forget_token() == ""


def test_launchs_message_goes_once_another_job_is_picked_or_acted_on(settings):
    """"Launched train job 3." stayed under whatever was done next on the Jobs page."""
    import gradio as gr

    from app.ui import jobs

    launched = '<div class="ngs-notice ngs-ok" id="launched" data-job="3">Launched train job 3.</div>'
    assert jobs.launch_update(launched, 3) == gr.skip()  # the launch picks its own job
    assert jobs.launch_update(launched, 4) == ""
    assert jobs.launch_update(launched) == ""  # Cancel, Resume or Send
    # the form's own errors stay: they are about its values, still as they were
    assert jobs.launch_update('<div class="ngs-notice ngs-error">bad</div>', 4) == gr.skip()

    page, _ = _page_in_tab(lambda user, tab: jobs.build_jobs(user, tab))
    assert _triggers(page, jobs.launch_update) == {
        ("job-cancel", "click"), ("job-resume", "click"), ("job-send", "click")}
    picked = [f for f in page.fns.values() if f.targets and f.outputs
              and page.blocks[f.targets[0][0]].elem_id == "jobs-pick"
              and f.outputs[0].elem_id == "jobs-launch-status"]
    assert len(picked) == 1 and [i.elem_id for i in picked[0].inputs] == [
        "jobs-pick", "jobs-launch-status"]


# --- 2: Revoke access and Cancel of a running job take a ticked confirmation -------------------
def test_revoke_takes_a_ticked_confirmation(settings, admin, make_user):
    import gradio as gr

    from app.db import session_scope
    from app.services import auth
    from app.ui import annotators

    make_user("eve", "annotator")
    make_user("mallory", "annotator")
    alice = _token(admin)
    eve_id, mallory_id = (next(i for label, i in annotators.account_choices(alice)
                               if label.startswith(name)) for name in ("eve", "mallory"))
    msg = _text(annotators.revoke_account(alice, eve_id, False))
    assert f"tick “{annotators.CONFIRM_REVOKE}” first, then Revoke access" in msg
    with session_scope() as s:
        assert not next(r for r in auth.list_users(s) if r["id"] == eve_id)["revoked"]
    assert "eve can no longer log in" in annotators.revoke_account(alice, eve_id, True)

    page, _ = _page_in_tab(lambda user, tab: annotators.build_annotators(user, tab))
    confirm = _by_id(page, "users-revoke-confirm")
    assert confirm.label == annotators.CONFIRM_REVOKE and confirm.value is False
    revoke = next(f for f in page.fns.values()
                  if ("users-revoke", "click") in {(page.blocks[b].elem_id, e)
                                                   for b, e in f.targets}
                  and f.outputs[0].elem_id == "users-revoked")
    assert confirm in revoke.inputs and revoke.outputs[-1] is confirm
    assert revoke.outputs[-2].elem_id == "users-revoke-pick"
    # unticked: the pick and the box stay as they are, to tick and click again
    out = revoke.fn(alice, mallory_id, False)
    assert "first, then Revoke access" in out[0] and out[-2:] == (gr.skip(), gr.skip())
    # done: the picker is emptied and the box unticked for the next one
    out = revoke.fn(alice, mallory_id, True)
    assert "mallory can no longer log in" in out[0] and out[-1] is False
    assert out[-2].value is None
    # another pick takes a new confirmation
    assert any(f.outputs == [confirm] and page.blocks[f.targets[0][0]].elem_id
               == "users-revoke-pick" for f in page.fns.values())


def test_cancel_of_a_running_job_takes_a_ticked_confirmation(settings, admin):
    from app.db import session_scope
    from app.models import Job
    from app.ui import jobs

    with session_scope() as s:
        running = Job(kind="train", status="running", config={})
        queued = Job(kind="train", status="queued", config={})
        s.add_all([running, queued])
        s.flush()
        running_id, queued_id = running.id, queued.id
    msg = _text(jobs.act(None, "cancel", _token(admin), running_id))
    assert msg == (f"job {running_id} is running: tick “{jobs.CONFIRM_CANCEL}” first, "
                   "then Cancel")
    with session_scope() as s:
        job = s.get(Job, running_id)
        assert job.status == "running" and not job.cancel_requested
    assert "Cancel requested" in jobs.act(None, "cancel", _token(admin), running_id, True)
    # a queued job loses nothing: cancelled at once
    assert f"Cancel requested for job {queued_id} (cancelled)" in _text(
        jobs.act(None, "cancel", _token(admin), queued_id))

    page, _ = _page_in_tab(lambda user, tab: jobs.build_jobs(user, tab))
    confirm = _by_id(page, "job-cancel-confirm")
    assert confirm.label == jobs.CONFIRM_CANCEL and confirm.value is False
    cancel = next(f for f in page.fns.values()
                  if [(page.blocks[b].elem_id, e) for b, e in f.targets]
                  == [("job-cancel", "click")] and f.outputs[0].elem_id == "job-action-status")
    assert confirm in cancel.inputs and cancel.outputs[-1] is confirm
    assert any(confirm in f.outputs and page.blocks[f.targets[0][0]].elem_id == "jobs-pick"
               for f in page.fns.values())


# --- 5: the job buttons that cannot apply to the picked job are not clickable -----------------
@pytest.mark.parametrize(("kind", "status", "clickable"), [
    ("train", "running", (True, False, True)),
    ("train", "queued", (True, True, True)),
    ("train", "succeeded", (False, False, True)),
    ("train", "failed", (False, True, True)),
    ("fit_preference", "succeeded", (False, False, False)),
    ("rollout", "cancelled", (False, True, False)),
])
def test_the_job_buttons_follow_the_picked_job(settings, admin, kind, status, clickable):
    """Send on a fit_preference job, Cancel on a finished one, Resume on a succeeded one
    answered with errors: they are not clickable for such a job."""
    from app.db import session_scope
    from app.models import Job
    from app.ui import jobs

    with session_scope() as s:
        job = Job(kind=kind, status=status, config={})
        s.add(job)
        s.flush()
        job_id = job.id
    out = jobs.job_view(_token(admin), job_id, {})
    cancel, resume, send = out[5:8]
    assert (cancel.interactive, resume.interactive, send.interactive) == clickable
    # the next tick, the job as it was: nothing sent again
    again = jobs.job_view(_token(admin), job_id, out[4])
    assert again[5:8] == tuple({"__type__": "update"} for _ in range(3))
    # nothing picked: each says to pick a job
    none = jobs.job_view(_token(admin), None, out[4])[5:8]
    assert all(b.interactive for b in none)
    with session_scope() as s:  # the job moved on: the buttons follow
        s.get(Job, job_id).status = "running" if status != "running" else "succeeded"
    moved = jobs.job_view(_token(admin), job_id, out[4])[5:8]
    assert any(b != {"__type__": "update"} for b in moved)


def test_the_job_page_wires_the_buttons_to_the_view(settings):
    from app.ui import jobs

    page, _ = _page_in_tab(lambda user, tab: jobs.build_jobs(user, tab))
    for f in page.fns.values():
        if f.fn is jobs.job_view:  # the timer's tick
            assert [o.elem_id for o in f.outputs[5:8]] == ["job-cancel", "job-resume",
                                                           "job-send"]


# --- 4: the arena's totals are read again when its tab is shown --------------------------------
def test_arena_totals_are_read_again_when_the_tab_is_shown(settings, annotator, make_group):
    """Votes made in another tab (or device) left "yours in total" behind until the next
    vote here."""
    from arena_helpers import arena_vote

    from app.ui import arena

    make_group(g=4)
    make_group(g=4, prompt="one blue square")
    bob = _token(annotator)
    here = arena.load(bob, None)[3]
    assert 'data-total="0"' in arena.counters_html(here)
    other = arena.load(bob, None)[3]
    for _ in range(50):  # another pair than the one shown here
        if {other["current"]["a_id"], other["current"]["b_id"]} != {
                here["current"]["a_id"], here["current"]["b_id"]}:
            break
        other = arena.load(bob, None)[3]
    arena_vote(arena, bob, other, "a", "elsewhere")
    pair, reveal, counters, state, _ = arena.poll(bob, here)  # the Arena tab selected
    assert pair == reveal == {"__type__": "update"}  # the pair on screen stays
    assert 'data-total="1"' in counters and "all annotators: <b>1</b>" in counters
    assert state["my_total"] == 1 and 'data-session="0"' in counters
    # another user's login racing the tab's showing: their totals are not put in this arena
    assert arena.poll({"token": "ngs_wrong"}, here)[2] == {"__type__": "update"}


# --- 6: a blank name is called blank ----------------------------------------------------------
@pytest.mark.parametrize("typed", ["   ", ""])
def test_a_blank_name_is_called_blank(settings, admin, typed):
    from app.ui import annotators

    msg, field = annotators.create_from_form(_token(admin), typed, "annotator")
    assert "name cannot be blank or only spaces" in msg and "1-100" not in msg
    assert field == {"__type__": "update"}  # left as typed, to be corrected
    too_long, _ = annotators.create_from_form(_token(admin), "x" * 101, "annotator")
    assert "name must be at most 100 characters" in too_long
