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


def test_launch_form_compares_nothing_with_an_emptied_fields_default(settings, admin,
                                                                     enqueuer):
    """group_size emptied and num_anchors 100: num_anchors said "must be <= group_size (12)",
    a number the user never entered (the default that stood in for the empty field)."""
    from app.ui import jobs

    names = [d["name"] for d in jobs.describe()]
    values = jobs.form_values("tiny")
    values[names.index("group_size")] = None
    values[names.index("num_anchors")] = 100
    values[names.index("learning_rate")] = -1  # a problem of its own is still said
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    errors = dict(zip(names, out[1:], strict=True))
    assert job_id is None and errors["group_size"] and errors["learning_rate"], errors
    assert not errors["num_anchors"], errors["num_anchors"]
    values[names.index("group_size")] = 4  # read now: the comparison is said, with its value
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    errors = dict(zip(names, out[1:], strict=True))
    assert "group_size (4)" in errors["num_anchors"], errors["num_anchors"]


def test_job_page_says_what_a_queued_job_waits_for(settings, admin, enqueuer):
    from app.ui import jobs

    values = jobs.form_values("tiny")
    values[[d["name"] for d in jobs.describe()].index("device")] = "cuda"
    job_id, _ = jobs.launch(enqueuer, _token(admin), None, *values)
    _, header, *_ = jobs.job_view(_token(admin), job_id, None)
    assert "waiting for a worker with a CUDA device on queue &#x27;gpu&#x27;" in header


def test_job_page_plots_each_rewards_raw_mean(settings, admin, enqueuer):
    """A job blending two rewards: the job page's plots show the blend and one plot per
    reward from its logged `reward/<name>` means, every iteration's point, each on its own
    scale (one axis would flatten the reward of the smaller range)."""
    import re

    from app.db import session_scope
    from app.services import jobs as svc
    from app.ui import jobs

    values = jobs.form_values("tiny")
    job_id, _ = jobs.launch(enqueuer, _token(admin), None, *values)
    with session_scope() as s:
        for it in (1, 2, 3):
            svc.update_progress(s, job_id, it, 3, {
                "reward_mean": 0.5, "reward_std": 0.1, "reward/count": 0.1 * it,
                "reward/jpeg_compressibility": 1.0 - 0.2 * it})
    _, _, plots, *_ = jobs.job_view(_token(admin), job_id, None)
    for name, lo, hi in (("count", "0.1", "0.3"), ("jpeg_compressibility", "0.4", "0.8")):
        plot = re.search(rf'<svg[^>]*id="plot-reward-{name}".*?</svg>', plots).group(0)
        assert 'data-points="3"' in plot
        lines = re.findall(r'<polyline points="([^"]*)"[^>]*data-series="([^"]*)"', plot)
        assert [n for _, n in lines] == [name] and len(lines[0][0].split()) == 3
        ticks = re.findall(r'text-anchor="end" class="ngs-tick">([^<]*)<', plot)
        assert ticks[:2] == [hi, lo], ticks  # its own range on its own axis
    assert 'id="plot-reward"' in plots  # the blend stays


def test_a_plot_of_one_iteration_shows_its_point_at_its_own_step():
    """A polyline through one point draws nothing: the first iteration of a job showed an
    empty plot on a made-up axis (16 to 17)."""
    import re

    from app.ui.common import line_plot

    plot = line_plot("reward", [16], {"reward mean": [0.5]}, elem_id="p")
    assert re.search(r'<circle [^>]*class="ngs-point" data-series="reward mean"', plot)
    ticks = re.findall(r'class="ngs-tick">([^<]*)<', plot)
    assert "16" in ticks and "17" not in ticks and "15" not in ticks, ticks
    two = line_plot("reward", [16, 17], {"reward mean": [0.5, 0.6]}, elem_id="p")
    assert "<circle" not in two and {"16", "17"} <= set(
        re.findall(r'class="ngs-tick">([^<]*)<', two))


def test_other_kinds_show_their_results_not_training_curves(settings, admin, enqueuer):
    """An evaluate job's page shows its reward means per checkpoint, a fit_preference job's
    its report; neither draws a train job's loss or clipped-fraction curves, which they never
    log."""
    import re

    from app.db import session_scope
    from app.models import Job, JobStatus
    from app.ui import jobs

    # rows as the worker leaves them (the checkpoints themselves are not needed to show them)
    with session_scope() as s:
        made = [Job(kind="evaluate", config={"checkpoint_ids": [3, 5]}),
                Job(kind="fit_preference", config={}), Job(kind="train", config={})]
        s.add_all(made)
        s.flush()
        ids = [job.id for job in made]
    _, _, plots, *_ = jobs.job_view(_token(admin), ids[0], None)
    assert "Results appear here" in plots and "plot-loss" not in plots
    with session_scope() as s:
        for job_id, metrics in ((ids[0], {
                "checkpoint/3/count": 0.61, "checkpoint/5/count": 0.72,
                "checkpoint/3/exact_count": 0.4, "checkpoint/5/exact_count": 0.5}),
                (ids[1], {"preference_model_version": 2, "votes_used": 40,
                          "holdout_accuracy": 0.81, "heldout_log_loss": None,
                          "votes_ignored": {}, "extra": {"split": "none", "epochs": 10}})):
            job = s.get(Job, job_id)
            job.status, job.metrics = JobStatus.SUCCEEDED, metrics
    _, _, plots, *_ = jobs.job_view(_token(admin), ids[0], None)
    assert "Reward means per checkpoint" in plots and "plot-loss" not in plots
    rows = re.findall(r"<tr><td>(#\d+)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", plots)
    assert rows == [("#3", "0.610", "0.400"), ("#5", "0.720", "0.500")], plots
    _, _, plots, *_ = jobs.job_view(_token(admin), ids[1], None)
    assert "holdout_accuracy" in plots and "0.810" in plots and "plot-clip" not in plots
    # a report read as a person reads it: no JSON null or {}, a nested value one row each
    rows = dict(re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td></tr>", plots))
    assert (rows["heldout_log_loss"], rows["votes_ignored"]) == ("–", "none"), rows
    assert (rows["extra.split"], rows["extra.epochs"]) == ("none", "10"), rows
    assert "null" not in plots and "{" not in plots
    _, _, plots, *_ = jobs.job_view(_token(admin), ids[2], None)  # a train job: its curves
    assert 'id="plot-loss"' in plots and 'id="plot-reward"' in plots


def test_arena_vote_prefetch_and_dedupe(settings, annotator, make_group):
    import json

    from app.db import session_scope
    from app.services import votes
    from app.ui import arena

    make_group(g=4)
    user = _token(annotator)
    state = arena.load(user, None)[3]
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


def _form_components():
    """The launch form as the page builds it: each field's component, in describe() order."""
    import gradio as gr

    from app.ui import jobs

    with gr.Blocks() as page:
        jobs.build_jobs(gr.State(None))
    by_id = {b.elem_id: b for b in page.blocks.values() if getattr(b, "elem_id", None)}
    return [by_id[f"cfg-{d['name']}"] for d in jobs.describe()], by_id


def test_the_forms_own_defaults_launch(settings, admin, enqueuer):
    """What the page shows on first load launches as it is (list and dict fields were JSON
    encoded twice: prompts showed "[]" and the launch failed)."""
    import json

    from app.ui import jobs

    comps, _ = _form_components()
    values = [c.value for c in comps]
    names = [d["name"] for d in jobs.describe()]
    assert values[names.index("prompts")] == "[]"
    assert json.loads(values[names.index("reward_weights")]) == {"count": 1.0}
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    assert job_id is not None, out[0]
    assert enqueuer.calls == [(job_id, "train")]


def test_launch_form_sections_hold_every_field_once(settings):
    from app.ui import jobs

    comps, by_id = _form_components()
    placed = [d["name"] for _, shown, folded in jobs.sections() for d in shown + folded]
    assert sorted(placed) == sorted(d["name"] for d in jobs.describe())
    for title, _, folded in jobs.sections():
        slug = jobs._slug(title)
        assert by_id[f"jobs-section-{slug}"].open
        if folded:
            assert not by_id[f"jobs-more-{slug}"].open  # rarely changed: folded away
    assert "jobs-more-optimisation" in by_id and "jobs-section-rewards" in by_id
    # labels read as sentences, names in capitals kept
    assert by_id["jobs-more-neighbor-grpo"].label == "More neighbor GRPO settings"
    assert by_id["jobs-more-optimisation"].label == "More optimisation settings"


def test_parse_and_server_errors_show_together(settings, admin, enqueuer):
    from app.ui import jobs

    names = [d["name"] for d in jobs.describe()]
    values = jobs.form_values("tiny")
    values[names.index("reward_weights")] = "{not json"
    values[names.index("num_anchors")] = 99
    values[names.index("sigma")] = 7.0
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    errors = dict(zip(names, out[1:], strict=True))
    assert job_id is None and "3 field(s) need fixing" in out[0]
    assert "not valid JSON" in errors["reward_weights"]
    assert "write a JSON object such as {&quot;count&quot;: 1.0}" in errors["reward_weights"]
    assert "group_size" in errors["num_anchors"] and "[0.0, 1.0]" in errors["sigma"]
    assert enqueuer.calls == []


def test_annotators_page_creates_lists_and_revokes(settings, admin, annotator):
    import re

    from app.ui import annotators

    assert "needs role admin" in annotators.create_from_form(_token(annotator), "eve", "annotator")[0]
    msg, name_field = annotators.create_from_form(_token(admin), "eve", "annotator")
    assert name_field == ""  # cleared once the user exists
    token = re.search(r'<code id="new-token">([^<]+)</code>', msg).group(1)
    eve = {"token": token}
    assert 'data-user="eve">active' in annotators.users_html(_token(admin))
    assert "eve" in annotators.stats_html(eve)
    eve_id = next(i for label, i in annotators.account_choices(_token(admin)) if "eve" in label)
    assert "already exists" in annotators.create_from_form(_token(admin), "eve", "annotator")[0]
    assert "can no longer log in" in annotators.revoke_account(_token(admin), eve_id, True)
    assert 'data-user="eve">revoked' in annotators.users_html(_token(admin))
    assert "invalid or revoked" in annotators.stats_html(eve)
    assert all("eve" not in label for label, _ in annotators.account_choices(_token(admin)))
    # her votes still count, so her row stays in the admin's stats, marked
    assert "<td>annotator (revoked)</td>" in annotators.stats_html(_token(admin))
    assert "pick a user" in annotators.revoke_account(_token(admin), None, True)


def test_annotators_page_lists_preference_models_and_launches_a_fit(settings, admin, annotator,
                                                                    enqueuer, vote_seeder):
    """An admin fits the preference model from the page (a fit_preference job with the
    defaults, enqueued) and sees every version with its held-out numbers and where it started;
    an annotator can do neither."""
    from app.db import session_scope
    from app.services import jobs
    from app.services import preference as pref_svc
    from app.ui import annotators

    # too few votes: said in the page's words, not with the config field's name
    short = annotators.fit_now(enqueuer, _token(admin))
    assert "the studio has 0 clean vote(s)" in short and "config." not in short, short
    assert "min_votes" not in short.split("clean vote(s)")[0], short
    vote_seeder(4)  # a fit_preference job is accepted only with votes to fit
    assert annotators.models_html(_token(annotator)) == ""
    assert "needs role admin" in annotators.fit_now(enqueuer, _token(annotator))
    assert enqueuer.calls == []
    assert "No preference model yet" in annotators.models_html(_token(admin))
    launched = annotators.fit_now(enqueuer, _token(admin))
    job_id = int(launched.split('data-job="')[1].split('"')[0])
    assert enqueuer.calls == [(job_id, "fit_preference")]
    with session_scope() as s:
        assert jobs.get_job(s, job_id).kind == "fit_preference"
        pref_svc.record_model(s, version=1, path="preference/v1.safetensors", job_id=job_id,
                              votes_used=1000, report={"heldout_accuracy": 0.91,
                                                       "heldout_log_loss": 0.33,
                                                       "extra": {"warm_start": False}})
        pref_svc.record_model(s, version=2, path="preference/v2.safetensors", votes_used=1150,
                              report={"heldout_accuracy": 0.905, "heldout_log_loss": 0.32,
                                      "heldout_calibration_error": 0.0417,
                                      "extra": {"warm_start": True, "warm_start_version": 1}})
    page = annotators.models_html(_token(admin))
    rows = page.split("<tbody>")[1].split("</tr>")
    assert "v2" in rows[0] and "1150" in rows[0] and "0.905" in rows[0] and ">v1<" in rows[0]
    assert "held-out calibration error" in page and "<td>0.042</td>" in rows[0]
    assert "v1" in rows[1] and "0.910" in rows[1] and "scratch" in rows[1]


def test_demo_queues_arena_rollouts_before_the_training_job(settings, enqueuer):
    from app.db import session_scope
    from app.serve import DEMO_ARENA_ROLLOUT, bootstrap
    from app.services import jobs

    info = bootstrap(enqueuer=enqueuer)
    assert enqueuer.calls == [(info.arena_job_id, "rollout"), (info.demo_job_id, "train")]
    assert info.arena_job_id < info.demo_job_id
    with session_scope() as s:
        job = jobs.get_job(s, info.arena_job_id)
        assert job.config["checkpoint_id"] is None and job.config["model"] == "shapes"
        assert job.config["dataset_id"] == info.dataset_id
        assert job.config["max_prompts"] == DEMO_ARENA_ROLLOUT["max_prompts"]
    assert bootstrap(enqueuer=enqueuer).arena_job_id is None  # once, on the first start


def test_opening_the_arena_tab_before_the_login_sets_it_up_draws_no_pair(settings, annotator,
                                                                          make_group):
    """The login's selection of the arena tab fires `poll` beside the login's `load`: only
    `load` sets the arena up, so the page and the session cannot end up holding two pairs.
    And `poll` leaves the state alone (a skip, which Gradio does not store): its None, landing
    after `load`'s arena on a loaded server, dropped the arena and lost the first vote."""
    from app.ui import arena

    make_group(g=4)
    user = _token(annotator)
    pair, _, _, state, _ = arena.poll(user, None)
    assert not isinstance(pair, str)  # skipped: no pair drawn
    assert state == {"__type__": "update"}, state  # gr.skip(): not written back
    state = arena.load(user, None)[3]
    assert state["current"] is not None


def test_a_vote_from_a_page_showing_a_pair_the_session_lost_says_it_did_not_count(
        settings, annotator, make_group):
    """The page shows a pair but the session holds none (its arena state was dropped or set up
    again): the vote is not recorded and the notice says so, instead of a new pair appearing
    as if the vote had counted; the pair then shown takes the next vote."""
    import json

    from app.db import session_scope
    from app.services import votes
    from app.ui import arena

    make_group(g=4)
    user = _token(annotator)
    meta = json.dumps({"client_vote_id": "v1", "nonce": "shown", "shown": "shown",
                       "outcome": "a"})
    steps = list(arena.dispatch(meta, user, None))
    assert len(steps) == 1
    pair, said, _, state, _ = steps[0]
    assert arena.STALE_PAIR in said.replace("&#x27;", "'"), said
    held = state["current"]["nonce"]
    assert f'data-nonce="{held}"' in pair
    with session_scope() as s:
        assert votes.count_votes(s) == 0
    meta = json.dumps({"client_vote_id": "v2", "nonce": held, "shown": held, "outcome": "a"})
    steps = list(arena.dispatch(meta, user, state))
    assert steps[-1][3]["session_votes"] == 1
    with session_scope() as s:
        assert votes.count_votes(s) == 1


def test_a_vote_on_a_pair_the_session_does_not_hold_shows_the_one_it_holds(settings, annotator,
                                                                           make_group):
    """A page out of step with its session (it shows a pair the session does not hold) gets
    the held pair and a notice, and its next vote counts; a repeat of a vote on a pair since
    replaced, from a page that shows the current pair, changes nothing."""
    import json

    from app.db import session_scope
    from app.services import votes
    from app.ui import arena

    make_group(g=4)
    user = _token(annotator)
    state = arena.load(user, None)[3]
    held = state["current"]["nonce"]
    a_id, b_id = state["current"]["a_id"], state["current"]["b_id"]

    def meta(nonce: str, shown: str, vote_id: str) -> str:
        return json.dumps({"client_vote_id": vote_id, "nonce": nonce, "shown": shown,
                           "outcome": "a"})

    # a repeat: the click was on an older pair, the page already shows the held one
    steps = list(arena.dispatch(meta("older", held, "v0"), user, state))
    assert len(steps) == 1 and not isinstance(steps[0][0], str)
    # out of step: the page shows a pair the session never held
    steps = list(arena.dispatch(meta("other", "other", "v1"), user, state))
    assert len(steps) == 1
    pair, reveal, _, state, _ = steps[0]
    assert arena.STALE_PAIR in reveal.replace("&#x27;", "'")
    # the held pair, under a new nonce (the page renders only a changed value)
    assert (state["current"]["a_id"], state["current"]["b_id"]) == (a_id, b_id)
    held = state["current"]["nonce"]
    assert f'data-nonce="{held}"' in pair and state["current"]["a_src"] in pair
    with session_scope() as s:
        assert votes.count_votes(s) == 0
    # the pair it now shows takes the vote
    steps = list(arena.dispatch(meta(held, held, "v2"), user, steps[-1][3]))
    assert steps[-1][3]["session_votes"] == 1
    with session_scope() as s:
        assert votes.count_votes(s) == 1


# --- the form's number fields, a page below one, the preview picker, Resume, a dataset's error --
def _run_event(page, fn, inputs: list, user: dict[str, str]) -> list:
    """What clicking runs on the server: `fn`'s event through Gradio's preprocessing (where a
    gr.Number's own range check raised), the handler and postprocessing; its outputs."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from gradio.state_holder import SessionState

    state = SessionState(page)
    state[fn.inputs[0]._id] = user  # the logged-in user's gr.State
    # in a thread of its own, as in tests/app/test_ui_security.py (the browser tests'
    # Playwright keeps an event loop running in this one)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, page.process_api(fn, inputs, state=state)).result()["data"]


def test_launch_form_numbers_take_the_fields_range_and_floats_any_step(settings):
    """A float field stepped by 1: arrows moved sigma 0.3 -> 1.3 and the browser took 0.3 for
    off-step. Each number field now has its description's range as the input's min and max and
    floats step by "any"; a value out of range still reaches the handler, whose error names
    the field (Gradio's own check would answer with a toast naming none)."""
    from app.ui import jobs

    comps, _ = _form_components()
    numbers = [(d, c) for d, c in zip(jobs.describe(), comps, strict=True)
               if d["type"] in ("int", "float")]
    assert {d["name"] for d, _ in numbers} >= {"sigma", "learning_rate", "clip_range"}
    for d, c in numbers:
        config = c.get_config()  # what the browser gets
        assert (config["minimum"], config["maximum"]) == (d["min"], d["max"]), d["name"]
        assert config["step"] == ("any" if d["type"] == "float" else 1), d["name"]
        outside = (d["max"] if d["max"] is not None else d["min"]) * 2 + 1
        assert c.preprocess(outside) == outside, d["name"]
    sigma = next(c for d, c in numbers if d["name"] == "sigma")
    assert (sigma.minimum, sigma.maximum, sigma.step, sigma.value) == (0.0, 1.0, "any", 0.3)


@pytest.mark.parametrize("typed", [0, -3])
def test_rollouts_page_below_one_says_what_page_allows(settings, admin, make_group, typed):
    """Page 0 or -3: Gradio's range check answered with a toast naming no field ("Value 0 is
    less than minimum value 1.") and the old results stayed; now the page's own message names
    the field, as for 2.5, and replaces them."""
    import gradio as gr

    from app.ui import rollouts

    make_group(g=2)
    with gr.Blocks() as page:
        rollouts.build_rollouts(gr.State(None))
    fn = next(f for f in page.fns.values() if f.fn is rollouts.show)
    out, = _run_event(page, fn, [None, None, "", "", typed], _token(admin))
    assert "Page: a whole number from 1 to" in out and f"got {typed}" in out
    assert "ngs-error" in out and 'class="ngs-group"' not in out
    out, = _run_event(page, fn, [None, None, "", "", 2.5], _token(admin))
    assert "Page: a whole number from 1 to" in out and "got 2.5" in out
    out, = _run_event(page, fn, [None, None, "", "", 1], _token(admin))
    assert 'class="ngs-group"' in out
    assert fn.inputs[-1].minimum == 1  # still the browser's: its arrows stop at 1


def test_preview_picker_starts_at_the_newest_dataset_or_empty(settings, admin, annotator,
                                                            session):
    """"Preview dataset #" showed 0, below its own minimum of 1. The login sets it: empty
    without datasets, else the first dataset of the list, which previews as it is."""
    import gradio as gr

    from app.services.datasets import import_dataset
    from app.ui import datasets

    with gr.Blocks() as page:
        datasets.build_datasets(gr.State(None))
    fn = next(f for f in page.fns.values() if f.fn is datasets.listing_for)
    pick = fn.outputs[1]
    assert pick.elem_id == "dataset-pick" and pick.minimum == 1
    listing, first = datasets.listing_for(_token(admin))
    assert "0 dataset(s)" in listing and first is None
    ids = [import_dataset(session, filename=f"{name}.txt", data=b"one red circle\n").dataset.id
           for name in ("older", "newer")]
    session.commit()
    listing, first = datasets.listing_for(_token(admin))
    assert "2 dataset(s)" in listing and first == max(ids)
    assert f'data-dataset="{first}"' in datasets.show(_token(admin), first)
    assert datasets.listing_for(_token(annotator)) == ("", None)
    assert datasets.listing_for(None) == ("", None)


def test_resume_says_a_job_without_a_checkpoint_restarts(settings, admin, enqueuer, session):
    """Resume on a job that never saved a checkpoint said it would "resume from its newest
    checkpoint": it starts over, and says so; with one, it names the checkpoint the worker
    loads (checkpoints.latest_checkpoint)."""
    from stored_checkpoints import stored_checkpoint

    from app.services import jobs as svc
    from app.ui import jobs

    job_id, _ = jobs.launch(enqueuer, _token(admin), None, *jobs.form_values("tiny"))
    # still queued: Resume sends its message again (one a broker lost), and says so
    text = jobs.act(enqueuer, "resume", _token(admin), job_id)
    assert f"Job {job_id} was still queued: its message was sent to the queue again" in text
    svc.request_cancel(session, job_id)
    session.commit()
    text = jobs.act(enqueuer, "resume", _token(admin), job_id)
    assert f"Job {job_id} queued to restart from the beginning" in text, text
    assert "checkpoint to resume from" in text and "newest checkpoint" not in text
    for it in (2, 4):
        stored_checkpoint(session, job_id, it, f"ck/job-{job_id}-{it}.safetensors",
                          name=f"job-{job_id}-it{it}")
    svc.request_cancel(session, job_id)
    session.commit()
    text = jobs.act(enqueuer, "resume", _token(admin), job_id)
    assert (f"Job {job_id} queued to resume from its newest checkpoint, job-{job_id}-it4 "
            "(iteration 4)") in text, text
    assert enqueuer.calls == [(job_id, "train")] * 4


def test_a_dataset_error_shows_beside_the_dataset_picker(settings, admin, enqueuer, session):
    """A dataset with no train prompts: the service's 422 names dataset_id, and its message
    showed only in the status line; it goes beside the Dataset picker, as every field's does,
    with the form's other errors at once."""
    import gradio as gr

    from app.services.datasets import import_dataset
    from app.ui import jobs

    ds = import_dataset(session, filename="evals.txt", data=b"one red circle\n",
                        eval_fraction=0.99).dataset.id
    session.commit()
    with gr.Blocks() as page:
        jobs.build_jobs(gr.State(None), enqueuer=enqueuer)
    page_fn = next(f for f in page.fns.values()
                   if f.outputs and f.outputs[0].elem_id == "jobs-launch-status")
    names = [d["name"] for d in jobs.describe()]
    assert [o.elem_id for o in page_fn.outputs[:2 + len(names)]] == [
        "jobs-launch-status", "err-dataset_id", *[f"err-{n}" for n in names]]
    values = jobs.form_values("tiny")
    out = page_fn.fn(_token(admin), ds, *values)  # what the Launch button runs
    assert "1 field(s) need fixing" in out[0] and "no &#x27;train&#x27; prompts" in out[1]
    assert not any(out[2:2 + len(names)]) and enqueuer.calls == []
    # with a field that does not parse, both show at once
    values[names.index("reward_weights")] = "{not json"
    out = page_fn.fn(_token(admin), ds, *values)
    errors = dict(zip(names, out[2:2 + len(names)], strict=True))
    assert "2 field(s) need fixing" in out[0] and "no &#x27;train&#x27; prompts" in out[1]
    assert "not valid JSON" in errors["reward_weights"]
    # without a box for it (launch's default outputs) the status line names it
    _, out = jobs.launch(enqueuer, _token(admin), ds, *jobs.form_values("tiny"))
    assert "dataset_id" in out[0] and "train" in out[0] and len(out) == 1 + len(names)
    assert enqueuer.calls == []


def test_the_reward_under_an_image_says_which_reward_it_is():
    """Under each image: the only reward by name, the shapes world's `combined` when scored
    (not a sum that counts its parts twice), else a sum called that; members by advantage."""
    from types import SimpleNamespace

    from app.ui.rollouts import group_html, headline_reward

    assert headline_reward({"count": 0.8}) == ("count", 0.8)
    assert headline_reward({"count": 1.0, "exact_count": 1.0, "color": 0.5, "shape": 0.5,
                            "combined": 0.75}) == ("combined", 0.75)
    assert headline_reward({"count": 1.0, "jpeg_compressibility": 0.5}) == ("sum", 1.5)

    def member(i: int, rewards: dict, advantage: float | None) -> SimpleNamespace:
        return SimpleNamespace(id=i, member_index=i, image_path=f"x/{i}.png", rewards=rewards,
                               advantage=advantage, is_anchor=False)

    group = SimpleNamespace(id=1, prompt_text="two red circles", job_id=1, iteration=3,
                            purpose="rollout", seed=0, sigma=0.3, solver="dpm++", steps=8,
                            samples=[member(1, {"count": 1.0, "jpeg_compressibility": 0.1}, -1.0),
                                     member(2, {"count": 0.0, "jpeg_compressibility": 0.2}, 1.0)])
    html = group_html(group, {})
    assert html.index('data-sample="2"') < html.index('data-sample="1"')  # by advantage
    assert 'title="the sum of count, jpeg_compressibility">sum</span> 1.10' in html
    assert "r 1.10" not in html


def test_the_annotators_table_says_what_its_columns_count(settings, admin):
    """"clean votes" was never explained: the table says which answers count, from the one
    Outcome definition (a label renamed there is renamed here)."""
    from app.ui.annotators import stats_html
    from trainer.rewards.outcomes import Outcome

    html = stats_html(_token(admin))
    note = html[html.index('id="annotators-columns"'):]
    for outcome in Outcome:
        assert f"“{outcome.label}”" in note
    clean, rest = note.split(" answers, which fits")
    assert "Skip" not in clean and "A is better" in clean and "Skip" in rest


def test_an_upload_whose_prompts_all_went_to_eval_says_a_train_job_cannot_use_it(
        settings, admin, tmp_path, monkeypatch):
    """Three prompts at eval fraction 0.95 are all eval: the upload said only "imported",
    and the trouble showed at a train job's launch, beside the Dataset field."""
    from app.ui import datasets

    folder = tmp_path / "gradio-uploads"  # Gradio's upload folder, as Gradio reads it
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    for name, fraction, warned in (("all-eval", 0.95, True), ("split", 0.5, False)):
        made = folder / name / f"{name}.txt"
        made.parent.mkdir(parents=True)
        made.write_text("a red fox\nan owl at night\na grey whale\n")
        status, *_ = datasets.upload(_token(admin), str(made), "", fraction, 0)
        assert 'id="dataset-ok"' in status, status
        assert ("a train job cannot train on this dataset" in status) is warned, status


def test_a_bad_split_seed_is_named_beside_the_files_own_problems(settings, admin, tmp_path,
                                                                monkeypatch):
    """Split seed 1.5 was the whole message, and a NUL in the file came up only once the
    seed was fixed; the API's 422 lists both, and so does the page. Nothing is imported."""
    from app.db import session_scope
    from app.services import datasets as svc
    from app.ui import datasets

    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    made = folder / "nul" / "nul.txt"
    made.parent.mkdir(parents=True)
    made.write_bytes(b"a red fox\nan \x00owl\n")
    status, *_ = datasets.upload(_token(admin), str(made), "", 0.0, 1.5)
    assert 'id="dataset-error"' in status
    assert "Split seed: a whole number" in status and "nul.txt: line 2" in status, status
    made.parent.mkdir(parents=True)
    made.write_bytes(b"a red fox\n")  # a good file: the seed's problem alone
    status, *_ = datasets.upload(_token(admin), str(made), "", 0.0, 1.5)
    assert "Split seed: a whole number" in status and "nul.txt" not in status, status
    with session_scope() as s:
        assert svc.list_datasets(s, limit=5)[1] == 0


def test_a_bad_field_is_named_beside_a_taken_dataset_name(settings, admin, tmp_path,
                                                         monkeypatch):
    """With a bad Split seed, the file's problems were listed but a dataset name another
    dataset has came up only once the seed was fixed. All three are in one message now, as
    in the API's 422, and nothing is imported."""
    from app.db import session_scope
    from app.services import datasets as svc
    from app.ui import datasets

    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    made = folder / "first" / "taken.txt"
    made.parent.mkdir(parents=True)
    made.write_text("a red fox\n")
    status, *_ = datasets.upload(_token(admin), str(made), "", 0.0, 0)
    assert 'id="dataset-ok"' in status, status
    made = folder / "second" / "taken.txt"
    made.parent.mkdir(parents=True)
    made.write_bytes(b"a red fox\nan \x00owl\n")
    status, *_ = datasets.upload(_token(admin), str(made), "", 0.0, 1.5)
    assert "Split seed: a whole number" in status, status
    assert "taken.txt: line 2" in status, status
    assert "Name: a dataset named &#x27;taken&#x27; already exists" in status, status
    with session_scope() as s:
        assert svc.list_datasets(s, limit=5)[1] == 1


def test_the_rollouts_job_picker_lists_only_jobs_that_sample(settings, admin):
    """A fit_preference job has no rollout groups: picking it could only show nothing."""
    from app.db import session_scope
    from app.models import Job
    from app.ui import rollouts

    with session_scope() as s:
        made = [Job(kind=kind, config={}) for kind in
                ("train", "fit_preference", "rollout", "evaluate")]
        s.add_all(made)
        s.flush()
        ids = {job.kind: job.id for job in made}
    listed = [value for _, value in rollouts.job_choices()[1:]]
    assert sorted(listed) == sorted(ids[k] for k in ("train", "rollout", "evaluate"))


def test_an_evaluate_jobs_results_name_checkpoints_as_the_leaderboard_does(settings, admin):
    """The job page labelled checkpoints "#2", "#17" where the leaderboard says
    "job2-it21 (#2)": the same label now; a deleted checkpoint keeps its id alone."""
    import re

    from app.db import session_scope
    from app.models import Job, JobStatus
    from app.services.checkpoints import record_checkpoint
    from app.ui import jobs

    with session_scope() as s:
        ckpt_id = record_checkpoint(s, None, 21, "checkpoints/x/model.safetensors",
                                    name="job2-it21")
        job = Job(kind="evaluate", config={"checkpoint_ids": [ckpt_id, ckpt_id + 100]},
                  status=JobStatus.SUCCEEDED,
                  metrics={f"checkpoint/{ckpt_id}/count": 0.5,
                           f"checkpoint/{ckpt_id + 100}/count": 0.25})
        s.add(job)
        s.flush()
        job_id = job.id
    _, _, plots, *_ = jobs.job_view(_token(admin), job_id, None)
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]*)</td></tr>", plots)
    assert rows == [(f"job2-it21 (#{ckpt_id})", "0.500"), (f"#{ckpt_id + 100}", "0.250")], plots


def test_annotators_page_gives_a_revoked_user_a_new_token(settings, admin, annotator):
    """An admin could not replace a token once it was off the screen, nor let a revoked user
    back in: "already exists" for the name, and only a new account under another name. New
    token (its picker lists revoked users too) shows a new one once."""
    import re

    import gradio as gr

    from app.ui import annotators

    msg, _ = annotators.create_from_form(_token(admin), "dave", "annotator")
    first = {"token": re.search(r'<code id="new-token">([^<]+)</code>', msg).group(1)}
    dave_id = next(i for label, i in annotators.account_choices(_token(admin)) if "dave" in label)
    assert "can no longer log in" in annotators.revoke_account(_token(admin), dave_id, True)
    picker = annotators.token_choices(_token(admin))
    assert (f"dave (#{dave_id}, annotator, revoked)", dave_id) in picker.choices
    assert picker.value is None
    assert annotators.token_choices(_token(annotator)) == gr.skip()
    assert "needs role admin" in annotators.replace_account_token(_token(annotator), dave_id)
    assert "pick a user" in annotators.replace_account_token(_token(admin), None)
    msg = annotators.replace_account_token(_token(admin), dave_id)
    assert 'id="user-token-replaced"' in msg and "dave" in msg
    second = {"token": re.search(r'<code id="new-token">([^<]+)</code>', msg).group(1)}
    assert second != first
    assert "invalid or revoked" in annotators.stats_html(first)
    assert "dave" in annotators.stats_html(second)  # back in, under the same name
    assert 'data-user="dave">active' in annotators.users_html(_token(admin))


def test_dataset_preview_pages_past_the_first_ten_rows(settings, admin, session):
    """The preview showed a dataset's first 10 rows and no more: row 11 of a dataset could
    not be seen on the page. It pages now (Page, Previous, Next), saying which rows show."""
    import re

    import gradio as gr

    from app.services.datasets import import_dataset
    from app.ui import datasets
    from app.ui.common import notice

    data = "".join(f"prompt number {k}\n" for k in range(1, 26)).encode()
    ds_id = import_dataset(session, filename="many.txt", data=data).dataset.id
    session.commit()

    def rows(html: str) -> list[str]:
        return re.findall(r"<td>(prompt number \d+)</td>", html)

    first = datasets.show(_token(admin), ds_id, 1)
    assert "Rows 1–10 of 25, page 1 of 3" in first
    second = datasets.show(_token(admin), ds_id, 2)
    assert "Rows 11–20 of 25, page 2 of 3" in second
    assert rows(second) == [f"prompt number {k}" for k in range(11, 21)]
    # past the end: the last page, saying so
    past = datasets.show(_token(admin), ds_id, 9)
    assert "Rows 21–25 of 25, page 3 of 3 (page 9 is past the end)" in past
    assert rows(past) == [f"prompt number {k}" for k in range(21, 26)]
    assert "Page: a whole number from 1" in datasets.show(_token(admin), ds_id, 0)
    # Next and Previous turn the preview on screen, and the Page field follows
    html, page = datasets.turn(_token(admin), first, 1)
    assert rows(html) == rows(second) and page == 2
    html, page = datasets.turn(_token(admin), past, 1)  # the last page stays
    assert rows(html) == rows(past) and page == 3
    html, page = datasets.turn(_token(admin), second, -1)
    assert rows(html) == rows(first) and page == 1
    html, page = datasets.turn(_token(admin), first, -1)  # so does the first
    assert rows(html) == rows(first) and page == 1
    assert "preview a dataset first" in datasets.turn(_token(admin), "", 1)[0]
    assert datasets.shown_page(second) == 2 and datasets.shown_page("") == 1
    # after Preview the Page field says the page shown, and keeps what was typed on an error
    assert datasets.page_of_preview(past) == 3 and datasets.page_of_preview(second) == 2
    assert isinstance(datasets.page_of_preview(notice("Page: bad", "error")), type(gr.skip()))
