"""Found walking the UI as a new user, checked at the handlers (Gradio's event processing where
the page's wiring matters): the Rollouts filter names every problem at once, each beside its
field; a refused number is echoed as typed; the Datasets upload's messages read as sentences
and a missing file is marked at the picker; a long prompt filter is shortened in the count
line. The page's look (wrapping, the progress bar's label) is checked in chromium:
tests/e2e/test_ui_new_user_walk_browser.py."""

from __future__ import annotations

import re

import pytest

# app.ui imports gradio (about 4 s): each test imports the handlers it needs, as in
# tests/app/test_ui_handlers.py


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _text(html_text: str) -> str:
    return re.sub(r"<[^>]+>", "", html_text)


def _run(page, fn, inputs: list, user: dict[str, str] | None = None) -> list:
    """`fn`'s event of `page` as a click runs it (Gradio's preprocessing, the handler,
    postprocessing), with the login's gr.State first in `inputs` when `user` is given."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from gradio.state_holder import SessionState

    state = SessionState(page)
    if user is not None:
        state[fn.inputs[0]._id] = user
    # in a thread of its own: the browser tests' Playwright keeps an event loop running here
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, page.process_api(fn, inputs, state=state)).result()["data"]


def _rollouts_page():
    import gradio as gr

    from app.ui import rollouts

    with gr.Blocks() as page:
        rollouts.build_rollouts(gr.State(None))
    show = next(f for f in page.fns.values() if f.fn is rollouts.show)
    boxes = next(f for f in page.fns.values() if f.fn is rollouts.filter_errors)
    return page, show, boxes


# --- 1: the Rollouts filter: every problem at once, each beside its field ---------------------
def test_rollouts_filter_names_every_problem_beside_its_field(settings, admin, make_group):
    """Iteration -1 with Page 0 said only "Page: ..., got 0" (the first problem hid the
    other), in a banner, and neither field was marked. Now the banner lists both, each after
    its label, and each field's own box says its problem; fixed values clear the boxes."""
    from app.ui import rollouts

    make_group(g=2)
    page, show, boxes = _rollouts_page()
    assert [b.elem_id for b in boxes.outputs] == ["rollouts-err-iteration", "rollouts-err-page"]
    assert [c.elem_id for c in boxes.inputs] == ["rollouts-iteration", "rollouts-page"]
    out, = _run(page, show, [None, None, "-1", "", 0], _token(admin))
    text = _text(out)
    assert "ngs-error" in out and 'class="ngs-group"' not in out
    assert "Iteration (empty: all): a whole number from 0 to" in text and "got -1" in text
    assert "Page: a whole number from 1 to" in text and "got 0" in text
    iteration_box, page_box = _run(page, boxes, ["-1", 0])
    assert "ngs-field-error" in iteration_box and "got -1" in iteration_box
    assert "Iteration" not in iteration_box  # the box is beside its field: no label
    assert "ngs-field-error" in page_box and "got 0" in page_box
    # one problem: beside its field too, not only in the banner
    assert _run(page, boxes, ["-1", 1]) == [rollouts.field_error(
        "a whole number from 0 to 2147483647, got -1"), ""]
    out, = _run(page, show, [None, None, "0", "", 1], _token(admin))
    assert 'class="ngs-group"' in out
    assert _run(page, boxes, ["0", 1]) == ["", ""]


def test_rollouts_empty_page_box_is_refused(settings, admin, make_group):
    """An emptied Page box was taken for page 1 without a word; the other number fields (the
    upload form's, Bootstrap resamples) refuse an empty box and say what they take."""
    make_group(g=2)
    page, show, boxes = _rollouts_page()
    out, = _run(page, show, [None, None, "", "", None], _token(admin))
    assert "ngs-error" in out and 'class="ngs-group"' not in out
    assert _text(out) == "Page: a whole number from 1 to 2147483647"
    iteration_box, page_box = _run(page, boxes, ["", None])
    assert iteration_box == "" and "a whole number from 1 to 2147483647" in page_box


# --- 2: a refused number as the user typed it --------------------------------------------------
@pytest.mark.parametrize(("typed", "echoed"), [
    (99999999, "99999999"),  # a number field's whole number arrives as a JSON int
    (99999999.0, "99999999"),
    (2.5, "2.5"),
    (1e-7, "0.0000001"),
    ("99999999999999999999999", "99999999999999999999999"),  # a text box: its text
    (" -1 ", "-1"),
    # JavaScript wrote this one so; beyond 2**53 the browser may have rounded what was typed
    (1e23, "about 100000000000000000000000"),
    (100000000000000000, "about 100000000000000000"),
])
def test_a_refused_number_is_echoed_as_typed(typed, echoed):
    """`{x:g}` wrote 99999999 as "1e+08" and 99999999999999999999999 as "1e+23"."""
    from app.errors import BadRequest
    from app.ui.common import number_below, whole_number

    with pytest.raises(BadRequest) as refused:
        whole_number(typed, "Field", 0, 10)
    assert refused.value.message == f"Field: a whole number from 0 to 10, got {echoed}"
    with pytest.raises(BadRequest) as refused:
        number_below(typed, "Field", 0.0, 1e-9)
    assert refused.value.message.endswith(f", got {echoed}")


def test_bootstrap_and_iteration_errors_echo_the_typed_number(settings, admin):
    from app.ui import leaderboard, rollouts

    assert "got 99999999<" in leaderboard.bootstrap_error(99999999)
    assert "1e+" not in leaderboard.show(_token(admin), 99999999)
    text = _text(rollouts.show(_token(admin), None, "99999999999999999999999", "", 1))
    assert text.endswith("got 99999999999999999999999"), text


# --- 4: a long prompt filter in the count line -------------------------------------------------
def test_rollouts_count_line_shortens_a_long_prompt(settings, admin):
    from app.ui import rollouts

    long_prompt = "x" * 20_000
    out = rollouts.show(_token(admin), None, "", long_prompt, 1)
    count = _text(re.search(r'<div id="rollouts-count".*?</div>', out).group(0))
    shown = "x" * rollouts.PROMPT_ECHO_CHARS
    assert f"of prompt “{shown}…”; page 1 of 1" in count and len(count) < 300, count[:300]
    short = _text(rollouts.show(_token(admin), None, "", "two red circles", 1))
    assert "prompt “two red circles”;" in short  # a short one as it is, no ellipsis


# --- 3: the Datasets upload's messages -----------------------------------------------------------
def test_a_refused_upload_says_its_problem_then_how_to_retry_in_sentences(
        settings, admin, tmp_path, monkeypatch):
    """A CSV with an empty prompt cell: "...: empty prompt Choose the file again to upload it
    once this is fixed." ran the retry on as part of the service's message."""
    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    from app.ui import datasets

    made = folder / "prompts-csv" / "prompts.csv"
    made.parent.mkdir(parents=True)
    made.write_text("prompt,k\na red fox,1\nan owl,2\nthree dots,3\n,4\n")
    status = datasets.upload(_token(admin), str(made), "", 0.0, 0)[0]
    text = _text(status)
    assert re.search(r"empty prompt\. Choose the file again to upload it once this is fixed\.$",
                     text), text
    assert ".. Choose" not in datasets.with_retry("already a sentence.")


def test_upload_without_a_file_marks_the_file_picker(settings, admin):
    """Upload with no file chosen said "choose a file first" only in the status above the
    list; the picker has its own error box now, as the number fields beside it do."""
    import gradio as gr

    from app.ui import datasets

    with gr.Blocks() as page:
        datasets.build_datasets(gr.State(None))
    upload = next(f for f in page.fns.values() if f.fn is datasets.upload_form)
    assert [b.elem_id for b in upload.outputs[5:]] == [
        "dataset-err-file", "dataset-err-name", "dataset-err-eval_fraction", "dataset-err-seed",
        "dataset-name"]
    out = _run(page, upload, [None, None, "", 0.5, 0], _token(admin))
    assert "choose a file first" in out[0]
    assert out[5] == datasets.field_error("choose a file first")
    assert out[6] == out[7] == out[8] == ""
    # a bad field too: both in the status, each beside its own field
    out = _run(page, upload, [None, None, "", 5, 0], _token(admin))
    assert "Eval fraction: a number from 0 to under 1, got 5; choose a file first" in out[0]
    assert "choose a file first" in out[5] and "got 5" in out[7] and out[6] == out[8] == ""


def test_a_successful_upload_empties_the_name_box_and_a_refused_one_keeps_it(
        settings, admin, tmp_path, monkeypatch):
    """The Name box kept the last import's name, so the next file's upload met "a dataset
    named ... already exists" and lost its chosen file; it is emptied after an import now
    (its label says "default: the file name"), and kept for a fix when the upload is refused."""
    import gradio as gr

    folder = tmp_path / "gradio-uploads"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    from app.ui import datasets

    def made(name: str, text: str) -> str:
        path = folder / name.replace(".", "-") / name
        path.parent.mkdir(parents=True)
        path.write_text(text)
        return str(path)

    out = datasets.upload_form(_token(admin), made("a.txt", "one red circle\n"), "my set",
                               0.0, 0)
    assert 'id="dataset-ok"' in out[0] and out[-1] == ""
    out = datasets.upload_form(_token(admin), made("b.txt", "two red circles\n"), "my set",
                               0.0, 0)
    assert "already exists" in out[0] and out[-1] == gr.skip()
