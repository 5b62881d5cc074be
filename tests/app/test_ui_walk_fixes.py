"""Found walking the UI in chromium as annotators and a project lead do, checked at the handlers
(Gradio's event processing where it matters): a number field checked by its handler, and the
Datasets picker that deletes a refused file, stay so after an update; the arena's totals count
the other annotators' votes."""

from __future__ import annotations

import pytest
from arena_helpers import arena_vote

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, as in
# tests/app/test_ui_handlers.py


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _events(page, user_state, user: dict[str, str]):
    """Run events of `page` as one browser session does, one after another on the same
    Gradio session state, logged in as `user` (`user_state`: the login's gr.State):
    `run(fn, inputs)` answers the outputs' data, or raises what Gradio would show as its
    error toast."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from gradio.state_holder import SessionState

    state = SessionState(page)
    state[user_state._id] = user

    def run(fn, inputs: list) -> list:
        # in a thread of its own: the browser tests' Playwright keeps an event loop running
        # in this one (tests/app/test_ui_handlers.py)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run,
                               page.process_api(fn, inputs, state=state)).result()["data"]

    return run


def _studio_page(build) -> tuple:
    """`build(user)` inside the UI's root Blocks (app.ui.StudioBlocks), with the login's
    gr.State first; the page and that state."""
    import gradio as gr

    from app.ui import StudioBlocks

    with StudioBlocks() as page:
        user = gr.State(None)
        build(user)
    return page, user


def _fn(page, handler=None, first_output: str | None = None):
    """The event of `page` that runs `handler`, or whose first output is `first_output`."""
    return next(f for f in page.fns.values()
                if (f.fn is handler if first_output is None
                    else f.outputs and f.outputs[0].elem_id == first_output))


# --- a number field's range, checked by its handler, after the field got an update ----------
@pytest.mark.parametrize("typed", [-3, 0])
def test_preview_field_names_itself_after_a_failed_upload(settings, admin, typed):
    """A refused upload sends "Preview dataset #" a gr.skip(); Gradio then builds the
    session's own copy of the field, with gr.Number's range check back, and a preview of -3
    answered with Gradio's toast "Value -3 is less than minimum value 1." (the old preview
    left on screen, a traceback in the log) instead of the field's own message."""
    from app.ui import datasets

    page, user = _studio_page(lambda user: datasets.build_datasets(user))
    run = _events(page, user, _token(admin))
    upload, show = _fn(page, datasets.upload_form), _fn(page, datasets.show)
    out = run(upload, [None, None, "", 0.0, 0])  # Upload with no file chosen
    assert "choose a file first" in out[0]
    assert out[4] == {"__type__": "update"}  # the preview field was skipped: an update
    shown, = run(show, [None, typed, 1])
    assert "Preview dataset #: a whole number from 1 to" in shown and f"got {typed}" in shown
    run(_fn(page, datasets.shown_page), [""])  # the Page field follows the preview: an update
    shown, = run(show, [None, 1, typed])
    assert "Page: a whole number from 1 to" in shown and f"got {typed}" in shown


def test_launch_form_names_a_field_out_of_range_after_a_finetune_change(settings, admin,
                                                                       enqueuer):
    """Changing finetune sends the LoRA, resolution and guidance fields a gr.skip() (those it
    does not reset); a launch with resolution -5 then answered with Gradio's toast "Value -5
    is less than minimum value 0." naming no field, instead of the error beside the field."""
    from app.ui import jobs

    page, user = _studio_page(lambda user: jobs.build_jobs(user, enqueuer=enqueuer))
    run = _events(page, user, _token(admin))
    names = [d["name"] for d in jobs.describe()]
    values = jobs.form_values(None)
    values[names.index("finetune")] = "lora"
    out = run(_fn(page, jobs.fields_for_model), values)
    assert {"__type__": "update"} in out  # some fields were skipped: updates
    values[names.index("finetune")] = "full"
    run(_fn(page, jobs.fields_for_model), values)
    values[names.index("resolution")] = -5
    launch = _fn(page, first_output="jobs-launch-status")
    out = run(launch, [None, None, *values])
    errors = dict(zip(names, out[2:2 + len(names)], strict=True))
    assert "1 field(s) need fixing" in out[0]
    assert "resolution" not in out[0] and "-5" in errors["resolution"], errors["resolution"]
    assert enqueuer.calls == []


def test_a_refused_file_is_deleted_after_an_upload_without_a_file(settings, admin, tmp_path,
                                                                  monkeypatch):
    """Upload with no file chosen sends the picker a gr.skip(); the session's copy of the
    picker lost the page's wrapper (`discard_refused_types`), and a file of a type the picker
    refuses, dropped on it next, stayed in the upload folder."""
    folder = tmp_path / "gradio-uploads"
    folder.mkdir()
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))  # as Gradio reads it
    from app.ui import datasets

    page, user = _studio_page(lambda user: datasets.build_datasets(user))
    run = _events(page, user, _token(admin))
    upload = _fn(page, datasets.upload_form)
    out = run(upload, [None, None, "", 0.0, 0])
    assert "choose a file first" in out[0] and out[3] == {"__type__": "update"}
    refused = folder / "89abcdef" / "tool.exe"
    refused.parent.mkdir()
    refused.write_bytes(b"MZ not prompts")
    payload = {"path": str(refused), "orig_name": "tool.exe",
               "meta": {"_type": "gradio.FileData"}}
    with pytest.raises(Exception, match="Invalid file type"):
        run(upload, [None, payload, "", 0.0, 0])
    assert not refused.exists() and not refused.parent.exists()


# --- the arena's totals ------------------------------------------------------------------------
def test_arena_totals_count_the_votes_of_others_and_of_other_tabs(settings, annotator,
                                                                  make_user, make_group):
    """Two annotators voting at once: each page's "all annotators" stayed at its load's count
    plus its own votes (42 on both pages with 62 votes stored), and "yours in total" missed
    the same user's votes from another tab. After each vote both are the database's."""
    from app.db import session_scope
    from app.services import votes
    from app.ui import arena

    make_group(g=4)
    make_group(g=4, prompt="one blue square")
    bob, alice = _token(annotator), _token(make_user("alice", "annotator"))
    bob_tab, alice_tab = arena.load(bob, None)[3], arena.load(alice, None)[3]
    bob_other_tab = arena.load(bob, None)[3]

    def pair(tab: dict) -> set[int]:
        return {tab["current"]["a_id"], tab["current"]["b_id"]}

    for _ in range(50):  # bob's two tabs on two pairs: one pair twice would refuse the second
        if pair(bob_other_tab) != pair(bob_tab):
            break
        bob_other_tab = arena.load(bob, None)[3]
    assert pair(bob_other_tab) != pair(bob_tab)
    for k in range(3):
        alice_tab = arena_vote(arena, alice, alice_tab, "a", f"alice-{k}")[-1][3]
    bob_other_tab = arena_vote(arena, bob, bob_other_tab, "b", "bob-other")[-1][3]
    steps = arena_vote(arena, bob, bob_tab, "a", "bob-0")
    counters = steps[-1][2]
    with session_scope() as s:
        mine, everyone = votes.count_votes(s, bob_tab["user_id"]), votes.count_votes(s)
    assert (mine, everyone) == (2, 5)
    assert f'data-session="1" data-total="{mine}"' in counters, counters
    assert f"all annotators: <b>{everyone}</b>" in counters, counters
    # the pair on screen came first, with this session's count; the totals then
    assert "This session: <b>1</b> pair answered" in steps[0][2]


# --- number fields that clamped what was typed -------------------------------------------------
def _prompt_file(folder, name: str = "p.txt") -> dict:
    """A prompt file in Gradio's upload folder, as the Datasets picker sends it."""
    made = folder / name.replace(".", "-") / name
    made.parent.mkdir(parents=True)
    made.write_bytes(b"a red fox\nan owl\na blue square\nthree dots\n")
    return {"path": str(made), "orig_name": name, "meta": {"_type": "gradio.FileData"}}


def _datasets_stored() -> list:
    from app.db import session_scope
    from app.services import datasets as svc

    with session_scope() as s:
        return [(d.name, d.eval_fraction) for d in svc.list_datasets(s, limit=10)[0]]


@pytest.mark.parametrize(("fraction", "seed", "boxes"), [
    (5, 0, ["a number from 0 to under 1, got 5", ""]),
    (-0.1, 0, ["a number from 0 to under 1, got -0.1", ""]),
    (1, 0, ["a number from 0 to under 1, got 1", ""]),
    (None, 0, ["a number from 0 to under 1", ""]),  # emptied: it was 0 without a word
    (5, -1, ["a number from 0 to under 1, got 5", "a whole number from 0 to"]),
    (0.2, 1.5, ["", "a whole number from 0 to"]),
])
def test_upload_names_a_bad_eval_fraction_or_seed_beside_its_field(
        settings, admin, tmp_path, monkeypatch, fraction, seed, boxes):
    """Eval fraction was a slider (0 to 0.95): 5 typed into its box uploaded with 0.95 while
    the box still showed 5 (the browser clamps the value it sends; sent as typed, Gradio's
    range check answered with a toast naming no field), and an emptied box was 0. It is a
    number field now: each problem is named in the status and beside its field (as the
    launch form's), under the API's rule ([0, 1)), and nothing is imported."""
    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    from app.ui import datasets

    page, user = _studio_page(lambda user: datasets.build_datasets(user))
    run = _events(page, user, _token(admin))
    upload = _fn(page, first_output="dataset-status")
    # the fields' boxes, then the Name box (emptied after an import)
    assert [b.elem_id for b in upload.outputs[-3:]] == ["dataset-err-eval_fraction",
                                                       "dataset-err-seed", "dataset-name"]
    out = run(upload, [None, _prompt_file(folder), "", fraction, seed])
    assert 'id="dataset-error"' in out[0], out[0]
    for label, box, want in zip(("Eval fraction", "Split seed"), out[-3:-1], boxes,
                                strict=True):
        if want:
            assert "ngs-field-error" in box and want in box, box
            assert f"{label}: {want}" in out[0], out[0]
        else:
            assert box == "" and label not in out[0], (box, out[0])
    assert _datasets_stored() == []


def test_a_taken_dataset_name_is_said_beside_the_name_field(settings, admin, tmp_path,
                                                            monkeypatch):
    """A name another dataset has was said in the status alone, as "name: ...", with no box
    beside the Name field; alone (the 409) and beside a bad field, it is in that box now,
    by the field's label in the status, and a good upload clears it."""
    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    from app.ui import datasets

    page, user = _studio_page(lambda user: datasets.build_datasets(user))
    run = _events(page, user, _token(admin))
    upload = _fn(page, first_output="dataset-status")
    assert [b.elem_id for b in upload.outputs[-4:]] == [
        "dataset-err-name", "dataset-err-eval_fraction", "dataset-err-seed", "dataset-name"]
    assert 'id="dataset-ok"' in run(upload, [None, _prompt_file(folder), "taken", 0, 0])[0]
    for fraction, seed in ((0, 0), (0.5, 1.5)):  # alone, and beside a bad split seed
        out = run(upload, [None, _prompt_file(folder), "taken", fraction, seed])
        assert 'id="dataset-error"' in out[0], out[0]
        assert "a dataset named &#x27;taken&#x27; already exists" in out[-4], out[-4]
        assert "Name: a dataset named" in out[0] and "name: " not in out[0], out[0]
        assert (out[-2] != "") is (seed == 1.5)
        assert out[-1] == {"__type__": "update"}  # the name kept, to be fixed
    out = run(upload, [None, _prompt_file(folder), "fresh", 0, 0])
    assert 'id="dataset-ok"' in out[0] and out[-4:] == ["", "", "", ""], out


def test_upload_takes_any_eval_fraction_the_api_takes(settings, admin, tmp_path, monkeypatch):
    """The API takes an eval fraction up to (not including) 1; the slider refused 0.97 (its
    maximum was 0.95). A good upload clears the fields' error boxes."""
    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    from app.ui import datasets

    page, user = _studio_page(lambda user: datasets.build_datasets(user))
    run = _events(page, user, _token(admin))
    out = run(_fn(page, first_output="dataset-status"),
              [None, _prompt_file(folder), "", 0.97, 3])
    assert 'id="dataset-ok"' in out[0] and out[-3:] == ["", "", ""], out
    assert _datasets_stored() == [("p", 0.97)]


def test_upload_handler_refuses_an_empty_eval_fraction(settings, admin, tmp_path,
                                                       monkeypatch):
    """`upload` itself (what the page's event wraps): an empty Eval fraction was taken as 0
    (`eval_fraction or 0.0`) and the dataset imported."""
    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    from app.ui import datasets

    status, *_ = datasets.upload(_token(admin), _prompt_file(folder)["path"], "", None, 0)
    assert "Eval fraction: a number from 0 to under 1" in status, status
    assert _datasets_stored() == []


@pytest.mark.parametrize(("typed", "shown"), [(-5, "got -5"), (1.5, "got 1.5"),
                                              (2001, "got 2001"), (None, "")])
def test_a_bad_bootstrap_count_is_named_beside_its_field(settings, admin, typed, shown):
    """Bootstrap resamples was a slider: -5 typed into its box was used as 0 (the box still
    showing -5), 1.5 became 1 (`int()`) and an emptied box 0 (`or 0`). The board and the box
    beside the field now say what the field takes (GET /api/leaderboard's 0 to
    MAX_BOOTSTRAP)."""
    from app.limits import MAX_BOOTSTRAP
    from app.ui import leaderboard

    allowed = f"a whole number from 0 to {MAX_BOOTSTRAP}"
    board = leaderboard.show(_token(admin), typed)
    assert f"Bootstrap resamples: {allowed}" in board and shown in board, board

    page, user = _studio_page(lambda user: leaderboard.build_leaderboard(user))
    run = _events(page, user, _token(admin))
    refresh = _fn(page, first_output="leaderboard-box")
    assert refresh.outputs[-1].elem_id == "leaderboard-err-bootstrap"
    out = run(refresh, [None, typed])
    assert f"Bootstrap resamples: {allowed}" in out[0], out[0]
    assert "ngs-field-error" in out[-1] and allowed in out[-1] and shown in out[-1], out[-1]
    out = run(refresh, [None, 0])  # fixed: the board, and the box empty again
    assert "Bootstrap resamples" not in out[0] and out[-1] == "", out
