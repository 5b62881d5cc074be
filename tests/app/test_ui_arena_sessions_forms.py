"""UI fixes found by a new user's probe, checked at the handlers: a new login starts a fresh
arena session, each vote's reveal takes the other of two fades (so that its animation runs
again), bold text and errored form fields have their CSS, and the Annotators page names users
and empties the Name field after creating one. The browser side is
tests/e2e/test_ui_reveal_sessions_fonts.py."""

from __future__ import annotations

import re

from arena_helpers import arena_vote

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, as in
# tests/app/test_ui_handlers.py


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


# --- 2: a login as someone else in the same tab starts a fresh arena session ---------------
def test_logout_then_login_as_another_user_starts_a_fresh_arena_session(settings, admin,
                                                                      annotator, make_group):
    from app.db import session_scope
    from app.services import votes
    from app.ui import arena

    for seed in range(3):
        make_group(g=4, seed=seed)
    alice, bob = _token(admin), _token(annotator)
    state = arena.load(alice, None)[3]
    for k in range(2):
        state = arena_vote(arena, alice, state, "tie", f"alice-{k}")[-1][3]
    assert state["session_votes"] == 2
    alice_session, alice_next = state["session_id"], state["next"]

    # Log out: the user state goes to None, which runs the arena's load
    pair, reveal, counters, state, timer = arena.load(None, state)
    assert state is None and pair == reveal == counters == "" and timer.active is False

    # bob logs in in the same tab
    pair, _, counters, state, _ = arena.load(bob, state)
    assert state["session_id"] != alice_session and state["session_votes"] == 0
    assert 'data-session="0"' in counters
    assert state["current"]["nonce"] != alice_next["nonce"]
    state = arena_vote(arena, bob, state, "a", "bob-0")[-1][3]
    with session_scope() as s:
        bobs = [v for v in votes.export_votes(s) if v["annotator"] == "bob"]
    assert [v["session_id"] for v in bobs] == [state["session_id"]]


def test_a_session_held_for_another_user_is_never_theirs(settings, admin, annotator,
                                                         make_group):
    """Without a logout in between (a login event racing another): bob's load and bob's vote
    both start bob's own session; alice's pair is never judged under bob's name."""
    from app.db import session_scope
    from app.services import votes
    from app.ui import arena

    make_group(g=4)
    alice, bob = _token(admin), _token(annotator)
    alices = arena.load(alice, None)[3]
    bobs = arena.load(bob, dict(alices))[3]
    assert bobs["session_id"] != alices["session_id"] and bobs["session_votes"] == 0

    steps = arena_vote(arena, bob, alices, "a", "bob-on-alices-pair")
    assert steps[-1][3]["session_id"] != alices["session_id"]
    with session_scope() as s:
        assert votes.count_votes(s) == 0  # a fresh session looks for a pair, records nothing


def test_the_same_user_logging_in_again_starts_a_new_session(settings, annotator, make_group):
    from app.ui import arena

    make_group(g=4)
    bob = _token(annotator)
    state = arena.load(bob, None)[3]
    state = arena_vote(arena, bob, state, "b", "bob-0")[-1][3]
    first = state["session_id"]
    state = arena.load(None, state)[3]  # Log out
    state = arena.load(bob, state)[3]
    assert state["session_id"] != first and state["session_votes"] == 0


# --- 1: every vote's reveal shows, not only the first one's ---------------------------------
def _fade(reveal: str) -> str:
    return re.search(r'class="ngs-reveal (ngs-reveal-\d)"', reveal).group(1)


def test_consecutive_reveals_alternate_between_two_identical_fades(settings, annotator,
                                                                   make_group):
    """Gradio patches the reveal in place: the same animation would not run again, a changed
    animation-name does."""
    from app.ui import arena
    from app.ui.common import CSS

    for seed in range(3):
        make_group(g=4, seed=seed)
    bob = _token(annotator)
    state = arena.load(bob, None)[3]
    fades = []
    for k in range(3):
        steps = arena_vote(arena, bob, state, "tie", f"v{k}")
        fades.append(_fade(steps[0][1]))
        state = steps[-1][3]
    assert fades[0] != fades[1] and fades[1] != fades[2]

    frames = dict(re.findall(r"@keyframes (ngs-fade-\d) (\{.*?\} \})", CSS, re.S))
    assert set(frames) == {"ngs-fade-0", "ngs-fade-1"}
    assert frames["ngs-fade-0"] == frames["ngs-fade-1"] and "visibility: hidden" in \
        frames["ngs-fade-0"]
    assert re.search(r"\.ngs-reveal \{[^}]*animation: ngs-fade-0 ", CSS)
    assert re.search(r"\.ngs-reveal\.ngs-reveal-1 \{ animation-name: ngs-fade-1; \}", CSS)


# --- 3 and 4: bold text in one font, errored text fields in red -----------------------------
def test_bold_text_and_errored_fields_have_their_css(settings):
    import gradio as gr

    from app.ui import jobs
    from app.ui.common import CSS

    font_rule = re.search(r"\.gradio-container :is\(([^)]*)\) \{\s*font-family: ui-sans-serif",
                          CSS)
    assert font_rule is not None
    covered = {part.strip() for part in font_rule.group(1).split(",")}
    assert {"button", "h2", "h3", "h4", "b", "strong", "th"} <= covered
    assert ".ngs-field:has(.ngs-field-error) :is(input, textarea)" in CSS

    # every field of the launch form, and the Dataset picker, sits in an ngs-field column
    # with its error box
    with gr.Blocks() as page:
        jobs.build_jobs(gr.State(None))
    fields = [b for b in page.blocks.values()
              if (getattr(b, "elem_id", None) or "").startswith("cfg-")
              or getattr(b, "elem_id", None) == "jobs-dataset"]
    assert len(fields) == len(jobs.describe()) + 1
    for field in fields:
        column = field.parent
        while not isinstance(column, gr.Column):  # Gradio wraps form fields in a gr.Form
            column = column.parent
        assert "ngs-field" in (column.elem_classes or []), field.elem_id
        name = (jobs.DATASET_FIELD if field.elem_id == "jobs-dataset"
                else field.elem_id.removeprefix("cfg-"))
        assert f"err-{name}" in {getattr(b, "elem_id", None) for b in column.children}, name


# --- 4: the Annotators page ---------------------------------------------------------------
def test_create_user_empties_the_name_field_only_on_success(settings, admin):
    from app.ui import annotators

    msg, name_field = annotators.create_from_form(_token(admin), "eve", "annotator")
    assert 'id="user-created"' in msg and name_field == ""
    msg, name_field = annotators.create_from_form(_token(admin), "eve", "annotator")
    assert "already exists" in msg and name_field == {"__type__": "update"}  # kept to fix


def test_create_button_writes_the_name_field(settings):
    import gradio as gr

    from app.ui import annotators

    with gr.Blocks() as page:
        annotators.build_annotators(gr.State(None))
    name_field = next(b for b in page.blocks.values()
                      if getattr(b, "elem_id", None) == "users-name")
    create = next(b for b in page.blocks.values() if getattr(b, "elem_id", None) == "users-create")
    events = [f for f in page.fns.values() if (create._id, "click") in f.targets]
    assert len(events) == 1 and name_field in events[0].outputs


def test_revoke_and_exclude_name_the_user(settings, admin, make_user):
    from app.ui import annotators

    make_user("eve", "annotator")
    alice = _token(admin)
    eve_id = next(i for label, i in annotators.account_choices(alice) if label.startswith("eve"))
    msg, _ = annotators.set_excluded(alice, eve_id, True)
    assert "eve excluded;" in msg and f"#{eve_id}" not in msg
    msg, _ = annotators.set_excluded(alice, eve_id, False)
    assert "eve included again;" in msg
    msg = annotators.revoke_account(alice, eve_id, True)
    assert "eve can no longer log in" in msg and f"#{eve_id}" not in msg


def test_the_arena_counter_says_pair_for_one_and_pairs_otherwise():
    from app.ui.arena import counters_html

    def text(n: int) -> str:
        html = counters_html({"session_votes": n, "my_total": n, "all_total": n})
        return re.sub(r"<[^>]+>", "", html)

    assert "This session: 1 pair answered" in text(1)
    assert "This session: 0 pairs answered" in text(0)
    assert "This session: 2 pairs answered" in text(2)
