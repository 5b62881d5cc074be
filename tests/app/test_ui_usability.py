"""The UI's handlers doing what their pages say: the arena finds new pairs after "No pairs
left", number fields report what they allow instead of rounding or defaulting, the reveal
names the pair it is about, plots name their series and fit their labels, and a page past
the end of the rollouts says so."""

from __future__ import annotations

import json
import re

import pytest

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, as in
# tests/app/test_ui_handlers.py


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


# --- 4: "New rollouts will appear here" ------------------------------------------------------
def test_arena_finds_new_pairs_after_none_were_left(settings, annotator, make_group):
    from app.services import votes
    from app.ui import arena

    user = _token(annotator)
    pair, _, _, state, timer = arena.load(user, None)
    assert "No pairs left" in pair and state["current"] is None
    assert timer.active is True  # it keeps looking while nothing is on screen
    # a vote (a click, a key) with nothing on screen: no pair yet, nothing recorded
    meta = json.dumps({"client_vote_id": "v0", "nonce": "", "outcome": "skip"})
    (pair, _, _, state, timer), = list(arena.dispatch(meta, user, state))
    assert state["current"] is None and timer.active is True

    make_group(g=4)  # new rollouts arrive
    votes._id_range.clear()  # the group-id range is cached 2 s; the timer ticks every 5 s
    pair, reveal, _, state, timer = arena.poll(user, state)
    assert state["current"] is not None and f'data-nonce="{state["current"]["nonce"]}"' in pair
    assert timer.active is False and state["next"] is not None
    # with a pair on screen the tick keeps it (only the totals are read again)
    again = arena.poll(user, state)
    assert again[0] == again[1] == {"__type__": "update"}
    assert 'id="arena-counter-values"' in again[2]
    assert again[3]["current"] == state["current"] and again[4].active is False


def test_arena_vote_with_no_pair_shown_looks_again(settings, annotator, make_group):
    from app.services import votes
    from app.ui import arena

    user = _token(annotator)
    state = arena.load(user, None)[3]
    make_group(g=4)
    votes._id_range.clear()  # as the 2 s cache would have expired by the next click
    meta = json.dumps({"client_vote_id": "v0", "nonce": "", "outcome": "a"})
    (pair, _, _, state, timer), = list(arena.dispatch(meta, user, state))
    assert state["current"] is not None and "ngs-prompt" in pair and timer.active is False


def test_arena_page_wires_the_timer_and_the_tab(settings):
    import gradio as gr

    from app.ui import arena

    with gr.Blocks() as page:
        user = gr.State(None)
        with gr.Tabs(), gr.Tab("Arena") as tab:
            arena.build_arena(user, tab)
    timers = [b for b in page.blocks.values() if isinstance(b, gr.Timer)]
    assert len(timers) == 1 and timers[0].value == arena.POLL_SECONDS
    polls = {(page.blocks[block_id].__class__.__name__, event)
             for f in page.fns.values() if f.fn is arena.poll for block_id, event in f.targets}
    assert polls == {("Timer", "tick"), ("Tab", "select")}


# --- 9: the reveal is about the previous pair -------------------------------------------------
def test_reveal_names_the_previous_pair_and_its_prompt(settings, annotator, make_group):
    from app.ui import arena

    make_group(g=4, prompt="three green circles")
    user = _token(annotator)
    state = arena.load(user, None)[3]
    first = state["current"]
    meta = json.dumps({"client_vote_id": "v1", "nonce": first["nonce"], "outcome": "b"})
    _, reveal, *_ = next(iter(arena.dispatch(meta, user, state)))
    text = _text(reveal)
    assert text.startswith("Previous pair") and "three green circles" in text
    assert "you chose B is better" in text


# --- 5: whole numbers are checked, not rounded ------------------------------------------------
def test_launch_form_reports_a_fractional_whole_number(settings, admin, enqueuer):
    from app.ui import jobs

    fields = {d["name"]: d for d in jobs.describe()}
    comp = jobs.field_component(fields["iterations"], 3)
    assert comp.preprocess(1.5) == 1.5  # the handler sees what was typed (was rounded to 2)
    names = list(fields)
    values = jobs.form_values("tiny")
    values[names.index("iterations")] = comp.preprocess(1.5)
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    errors = dict(zip(names, out[1:], strict=True))
    assert job_id is None and "must be a whole number, got 1.5" in errors["iterations"]
    assert enqueuer.calls == []


def test_choosing_a_real_model_in_the_form_gives_it_a_reward_it_can_train_on(settings, admin,
                                                                               enqueuer):
    """The form's default count reward reads only shapes images: picking flux swaps a default
    left as it was for jpeg_compressibility (and back), never weights someone typed."""
    import gradio as gr

    from app.ui import jobs

    names = [d["name"] for d in jobs.describe()]
    rewards = names.index("reward_weights")

    def choose(model: str, values: list) -> list:  # as the page runs the model's change
        return jobs.form_for_model(*[model if n == "model" else v
                                     for n, v in zip(names, values, strict=True)])

    values = jobs.form_values(None)
    assert json.loads(values[rewards]) == {"count": 1.0}
    flux = choose("flux", values)
    assert json.loads(flux[rewards]) == {"jpeg_compressibility": 1.0}
    assert json.loads(choose("shapes", flux)[rewards]) == {"count": 1.0}
    typed = '{"count": 1, "color": 0.5}'
    assert choose("sd3", [typed if i == rewards else v for i, v in enumerate(values)]
                  )[rewards] == typed  # left as typed
    # finetune follows too: LoRA for a real model (not a 12B full fine-tune by default), and
    # shapes, which trains in full only, back to full
    assert values[names.index("finetune")] == "full"
    assert flux[names.index("finetune")] == "lora"
    assert choose("shapes", flux)[names.index("finetune")] == "full"
    assert jobs.finetune_for_model("flux", "full") == "lora"
    assert jobs.finetune_for_model("sd3", "lora") == gr.skip()
    assert jobs.finetune_for_model("shapes", "lora") == "full"
    # launched so, the complaints are the missing model directory and prompts (FLUX does not
    # train on the shapes world's), not the reward
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *flux)
    errors = {n: e for n, e in zip(names, out[1:], strict=True) if e}
    assert job_id is None and set(errors) == {"model_path", "prompts"}, errors


@pytest.mark.parametrize("typed", ["-1", "1.5", "abc"])
def test_rollouts_iteration_says_what_is_allowed(settings, admin, typed):
    from app.ui import rollouts

    text = _text(rollouts.show(_token(admin), None, typed, "", 1))
    assert "Iteration (empty: all): a whole number from 0" in text and "got" in text
    assert "must be a whole number" not in text


# --- 6: seeds per prompt ------------------------------------------------------------------------
@pytest.mark.parametrize("seeds", [0, -2, 1.5, None, 1001])
def test_evaluate_seeds_per_prompt_is_a_field_error(admin, enqueuer, session, seeds):
    from stored_checkpoints import stored_checkpoint

    from app.ui.leaderboard import evaluate, max_seeds

    ck = stored_checkpoint(session, None, 0, "ck/a.safetensors", name="a")
    session.commit()
    text = _text(evaluate(enqueuer, _token(admin), [ck], seeds, ""))
    assert text.startswith(f"Seeds per prompt: a whole number from 1 to {max_seeds()}"), text
    assert enqueuer.calls == []


def test_evaluate_takes_a_whole_number_of_seeds(admin, enqueuer, session):
    from sqlalchemy import select
    from stored_checkpoints import stored_checkpoint

    from app.models import Job
    from app.ui.leaderboard import evaluate

    ck = stored_checkpoint(session, None, 0, "ck/a.safetensors", name="a")
    session.commit()
    assert 'id="evaluate-launched"' in evaluate(enqueuer, _token(admin), [ck], 3.0, "")
    assert session.scalars(select(Job)).one().config["seeds"] == [0, 1, 2]


# --- 10: plots ------------------------------------------------------------------------------------
def test_line_plot_names_a_single_series_and_fits_its_tick_labels():
    from app.ui.common import TICK_CHAR_PX, line_plot

    svg = line_plot("loss", [0, 1, 2], {"loss": [-0.000123, 0.5, 12.25]})
    assert re.search(r'<g class="ngs-legend" data-series="loss">.*?>loss</text></g>', svg)
    ticks = re.findall(r'<text x="([\d.]+)"[^>]*text-anchor="end" class="ngs-tick">([^<]*)<', svg)
    labels = {label for _, label in ticks}
    assert "-0.000123" in labels
    for x, label in ticks:  # right-aligned at x: the label's left edge stays in the picture
        assert float(x) - TICK_CHAR_PX * len(label) >= 0, (x, label)


# --- 11: a page past the end ----------------------------------------------------------------------
def test_rollouts_page_past_the_end_shows_the_last_page(settings, admin, make_group):
    from app.ui import rollouts

    make_group(g=2)
    page = rollouts.show(_token(admin), None, "", "", 99)
    head = _text(re.search(r'<div id="rollouts-count".*?</div>', page).group(0))
    assert head == "1 group(s); page 1 of 1 (page 99 is past the end)"
    assert "No rollout groups match" not in page and 'class="ngs-group"' in page
    assert _text(re.search(r'<div id="rollouts-count".*?</div>',
                           rollouts.show(_token(admin), None, "", "", 1)).group(0)) == \
        "1 group(s); page 1 of 1"


def test_a_ui_vote_with_a_malformed_client_id_is_refused(settings, annotator, make_group):
    """The UI's vote id comes from the browser as it is: one the API would refuse (a NUL,
    too long) is refused the same way, and nothing is recorded."""
    from sqlalchemy import func, select

    from app.db import session_scope
    from app.models import Vote
    from app.ui import arena

    user = _token(annotator)
    make_group(g=4)
    state = arena.load(user, None)[3]
    for bad in ("v\x00", "x" * 65, "a b"):
        meta = json.dumps({"client_vote_id": bad, "nonce": state["current"]["nonce"],
                           "outcome": "a"})
        reveal = list(arena.dispatch(meta, user, state))[0][1]
        assert "client_vote_id" in _text(reveal["value"] if isinstance(reveal, dict)
                                         else reveal), bad
        with session_scope() as s:
            assert s.scalar(select(func.count()).select_from(Vote)) == 0
        state = arena.load(user, None)[3]
