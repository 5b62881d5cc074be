"""A message is about what was picked when it was given: picking another file, dataset or
user takes it off the screen, and the rollouts filters apply on Enter in any box or on a job
picked, as Show does. Found walking the UI in chromium (2026-12-07): "choose a file first"
stayed beside a file just chosen, "you cannot revoke your own access" beside another user."""

from __future__ import annotations

import gradio as gr
import pytest


def _page(build):
    from app.ui import StudioBlocks

    with StudioBlocks() as page:
        build(gr.State(None))
    return page


def _triggers(page, fn) -> set[tuple[str, str]]:
    """(elem_id of the component, event name) of every event of `page` that runs `fn`."""
    return {(page.blocks[block_id].elem_id, event) for f in page.fns.values() if f.fn is fn
            for block_id, event in f.targets if block_id is not None}


def _event(page, elem_id: str, event: str):
    """The one event of `page` that the component `elem_id` triggers on `event`."""
    found = [f for f in page.fns.values()
             if any(b is not None and page.blocks[b].elem_id == elem_id and e == event
                    for b, e in f.targets)]
    assert len(found) == 1, (elem_id, event, found)
    return found[0]


def test_rollouts_filters_apply_on_enter_in_any_box_and_on_a_job_picked():
    from app.ui import rollouts

    page = _page(rollouts.build_rollouts)
    assert _triggers(page, rollouts.show) >= {
        ("rollouts-show", "click"), ("rollouts-prompt", "submit"),
        ("rollouts-iteration", "submit"), ("rollouts-page", "submit"),
        ("rollouts-job", "input")}
    # the list's own refreshes (focus, login) change its choices, never show groups
    assert ("rollouts-job", "change") not in _triggers(page, rollouts.show)


def test_a_new_file_takes_the_last_refusal_off_the_datasets_page():
    from app.ui import datasets

    page = _page(datasets.build_datasets)
    picked = _event(page, "dataset-file", "upload")
    assert [o.elem_id for o in picked.outputs] == ["dataset-status", f"dataset-err-{datasets.FILE_FIELD}"]
    refused = '<div class="ngs-notice ngs-error" id="dataset-error">choose a file first</div>'
    assert picked.fn(refused) == ("", "")
    imported = '<div class="ngs-notice ngs-ok" id="dataset-ok" data-dataset="3">Imported</div>'
    status, file_error = picked.fn(imported)
    assert status == gr.skip() and file_error == ""  # an import's message stays


@pytest.mark.parametrize(("build", "picker", "message"), [
    ("datasets", "dataset-delete-pick", "dataset-delete-status"),
    ("annotators", "users-revoke-pick", "users-revoked"),
    ("annotators", "annotators-pick", "annotators-status"),
])
def test_another_pick_takes_the_last_message_about_the_one_before(build, picker, message):
    from app.ui import annotators, datasets

    page = _page({"datasets": datasets.build_datasets,
                  "annotators": annotators.build_annotators}[build])
    picked = _event(page, picker, "input")  # the user's pick only: an answer's own update
    assert [o.elem_id for o in picked.outputs] == [message]  # of the list keeps the answer
    assert picked.fn() == ""
    assert not any(page.blocks[b].elem_id == picker and e == "change" and
                   message in [o.elem_id for o in f.outputs]
                   for f in page.fns.values() for b, e in f.targets if b is not None)
