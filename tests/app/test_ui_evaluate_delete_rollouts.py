"""Handler-level checks of three pages' fixes: the leaderboard's evaluate form shows every
problem at once beside its field, by the field's label; the Datasets page deletes a dataset
(confirmed first, refused while an active job uses it); the Rollouts page's Job filter has an
"(all jobs)" choice and says that its filters combine."""

from __future__ import annotations

import re

# app.ui imports gradio (about 4 s): each test imports the handlers it needs


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html).replace("&#x27;", "'").replace("&quot;", '"')


# --- 1: the evaluate form ------------------------------------------------------------------------
def _evaluate_button(enqueuer):
    """The leaderboard page and what its "Evaluate these checkpoints" button runs."""
    import gradio as gr

    from app.ui import leaderboard

    with gr.Blocks() as page:
        leaderboard.build_leaderboard(gr.State(None), enqueuer=enqueuer)
    return next(f for f in page.fns.values()
                if f.outputs and f.outputs[0].elem_id == "leaderboard-status")


def test_evaluate_form_shows_every_error_at_once_beside_its_field(admin, enqueuer, session):
    """Seeds 0, an unknown reward beside one without weights, and a dataset without an eval
    split: the page showed the first problem only, in the status line, by the config's
    names ("config.reward_names: ..."). Each now shows beside its field at once, and the
    status line names the fields by their labels."""
    from stored_checkpoints import stored_checkpoint

    from app.services.datasets import import_dataset
    from app.ui.leaderboard import EVALUATE_FIELDS

    ck = stored_checkpoint(session, None, 0, "ck/a.safetensors", name="a")
    ds = import_dataset(session, filename="all-train.txt", data=b"one red circle\n").dataset.id
    session.commit()
    button = _evaluate_button(enqueuer)
    assert [o.elem_id for o in button.outputs] == [
        "leaderboard-status", *[f"leaderboard-err-{f}" for f in EVALUATE_FIELDS]]
    out = button.fn(_token(admin), [ck], 0, "nope, hpsv2", ds, "eval")
    status, boxes = _text(out[0]), dict(zip(EVALUATE_FIELDS, map(_text, out[1:]), strict=True))
    assert "a whole number from 1 to" in boxes["seeds"] and "got 0" in boxes["seeds"]
    assert "unknown reward 'nope'" in boxes["reward_names"]
    assert "reward 'hpsv2'" in boxes["reward_names"]  # the second reward's own problem
    assert f"dataset {ds} has no 'eval' prompts" in boxes["split"]
    assert not boxes["checkpoint_ids"] and not boxes["dataset_id"]
    assert status == "3 field(s) need fixing: Seeds per prompt, Rewards, Split", status
    assert "config." not in "".join(out) and enqueuer.calls == []

    # nothing picked: the form's own words once (not the config's "at least 1 item" too)
    out = button.fn(_token(admin), [], 2, "nope", 0, "eval")
    boxes = dict(zip(EVALUATE_FIELDS, map(_text, out[1:]), strict=True))
    assert boxes["checkpoint_ids"] == "pick one checkpoint to score, or two or more to compare"
    assert "unknown reward 'nope'" in boxes["reward_names"]
    assert _text(out[0]) == "2 field(s) need fixing: Checkpoints, Rewards"

    # 'preference' with no model fitted: said beside Rewards in the page's words (it named
    # preference_model and reward_names, fields the form does not have, in the status alone)
    out = button.fn(_token(admin), [ck], 2, "preference", 0, "eval")
    boxes = dict(zip(EVALUATE_FIELDS, map(_text, out[1:]), strict=True))
    assert boxes["reward_names"] == (
        "'preference' is among the rewards but no preference model has been fitted yet: fit "
        "one on the Annotators page (\"Fit preference model from the votes\"), or leave "
        "'preference' out"), boxes
    assert _text(out[0]) == "1 field(s) need fixing: Rewards", out[0]

    # fixed: the job launches and every box clears
    out = button.fn(_token(admin), [ck], 2, "count", ds, "all")
    assert 'id="evaluate-launched"' in out[0] and not any(out[1:])
    assert [kind for _, kind in enqueuer.calls] == ["evaluate"]
    # "Include the base model" ticked: the base's row joins the job's checkpoints
    assert [i.elem_id for i in button.inputs][-1] == "leaderboard-include-base"
    out = button.fn(_token(admin), [ck], 2, "count", ds, "all", True)
    assert "for 2 checkpoint(s)" in out[0] and not any(out[1:])
    from app.models import Checkpoint, Job

    session.expire_all()
    job = session.get(Job, int(out[0].split('data-job="')[1].split('"')[0]))
    assert job.config["include_base"] and job.config["checkpoint_ids"][1] == ck
    assert session.get(Checkpoint, job.config["checkpoint_ids"][0]).format == "base:shapes"


def test_evaluate_notice_names_fields_by_their_labels(admin, enqueuer, session):
    """`evaluate` (one notice, for callers without the boxes) lists every problem too, each
    after its field's label; the config field stays in `data-field`."""
    from stored_checkpoints import stored_checkpoint

    from app.ui.leaderboard import evaluate

    ck = stored_checkpoint(session, None, 0, "ck/a.safetensors", name="a")
    session.commit()
    out = evaluate(enqueuer, _token(admin), [ck], 0, "nope", 999_999, "eval")
    text = _text(out)
    assert text.startswith("Seeds per prompt: a whole number from 1 to"), text
    assert "Rewards: unknown reward 'nope'" in text
    assert "Held-out prompts: dataset 999999 not found" in text
    assert 'data-field="dataset_id"' in out and "config." not in text


def test_a_non_admin_gets_the_refusal_in_the_status_line(annotator, enqueuer):
    button = _evaluate_button(enqueuer)
    out = button.fn(_token(annotator), [1], 2, "", 0, "eval")
    assert "needs role admin" in out[0] and not any(out[1:]) and enqueuer.calls == []


# --- 2: deleting a dataset -----------------------------------------------------------------------
def _datasets_page():
    import gradio as gr

    from app.ui import datasets

    with gr.Blocks() as page:
        datasets.build_datasets(gr.State(None))
    return page


def test_datasets_page_deletes_a_dataset_once_confirmed(settings, admin, annotator, session):
    """The duplicate-name error says "delete that dataset", and the page could not: Delete
    takes the picked dataset once the confirmation is ticked (one click deletes nothing),
    through the API's service; the list, the pickers and a preview of it follow."""
    import gradio as gr

    from app.services import datasets as svc
    from app.ui import datasets

    keep = svc.import_dataset(session, filename="keep.txt", data=b"one red circle\n").dataset.id
    gone = svc.import_dataset(session, filename="gone.txt",
                              data=b"one red circle\ntwo blue squares\n").dataset.id
    session.commit()
    page = _datasets_page()
    button = next(f for f in page.fns.values() if f.fn is datasets.delete)
    assert [c.elem_id for c in button.inputs[1:]] == [
        "dataset-delete-pick", "dataset-delete-confirm", "dataset-pick", "dataset-preview-box",
        "dataset-status"]
    assert [c.elem_id for c in button.outputs] == [
        "dataset-delete-status", "dataset-preview-box", "dataset-list", "dataset-pick",
        "dataset-delete-pick", "dataset-delete-confirm", "dataset-status"]
    # a new pick takes a new confirmation
    untick = next(f for f in page.fns.values()
                  if [o.elem_id for o in f.outputs] == ["dataset-delete-confirm"])
    (picker_id, event), = untick.targets
    assert (page.blocks[picker_id].elem_id, event) == ("dataset-delete-pick", "change")
    assert untick.fn() is False

    # the picker lists every dataset for an admin, nothing for anyone else
    choices = datasets.delete_choices(_token(admin)).choices
    assert {value for _, value in choices} == {keep, gone}
    assert datasets.delete_choices(_token(annotator)) == gr.skip()

    status, *rest = datasets.delete(_token(admin), gone, False, gone)
    assert "tick" in _text(status) and rest == [gr.skip()] * 6
    assert "needs role admin" in datasets.delete(_token(annotator), gone, True, gone)[0]
    status, *rest = datasets.delete(_token(admin), None, True, gone)
    assert "pick the dataset to delete" in status and rest == [gr.skip()] * 6
    assert svc.get_dataset(session, gone).num_prompts == 2

    status, preview, listing, preview_pick, picker, confirm, _ = datasets.delete(
        _token(admin), gone, True, gone)
    assert f'id="dataset-deleted" data-dataset="{gone}"' in status
    assert "Deleted dataset" in status and "2 prompt(s)" in status
    assert preview == "" and preview_pick == keep  # its preview went with it
    assert "1 dataset(s)" in listing and "gone.txt" not in listing
    assert [value for _, value in picker.choices] == [keep] and picker.value is None
    assert confirm is False
    session.expire_all()
    assert [d.id for d in svc.list_datasets(session)[0]] == [keep]
    # a preview of another dataset stays as it is
    other = svc.import_dataset(session, filename="other.txt", data=b"one red circle\n")
    session.commit()
    _, preview, _, preview_pick, _, _, _ = datasets.delete(_token(admin), other.dataset.id,
                                                            True, keep)
    assert preview == gr.skip() and preview_pick == gr.skip()


def test_deleting_a_dataset_an_active_job_uses_names_the_job(settings, admin, enqueuer,
                                                             session):
    from app.services import datasets as svc
    from app.services import jobs as jobs_svc
    from app.ui import datasets

    ds = svc.import_dataset(session, filename="busy.txt", data=b"one red circle\n").dataset.id
    job = jobs_svc.create_job(session, "rollout", {"dataset_id": ds, "max_prompts": 1})
    session.commit()
    status, *rest = datasets.delete(_token(admin), ds, True, None)
    assert 'id="dataset-delete-error"' in status
    assert f"dataset {ds} is used by active job(s) {job.id}; cancel them first" in status
    assert svc.get_dataset(session, ds).id == ds
    jobs_svc.request_cancel(session, job.id)
    session.commit()
    assert 'id="dataset-deleted"' in datasets.delete(_token(admin), ds, True, None)[0]


# --- 3: the Rollouts filters ---------------------------------------------------------------------
def test_rollouts_job_filter_has_all_jobs_and_the_filters_combine(settings, admin, make_group,
                                                                  session):
    """The Job picker could not be cleared (its box snapped back to the job): "(all jobs)"
    is its first choice and its starting value; the prompt filter's label said "or a prompt"
    while the filters combine: the label says so, and so does the count line."""
    import gradio as gr

    from app.services import jobs as jobs_svc
    from app.ui import rollouts

    job = jobs_svc.create_job(session, "train", None, preset="tiny").id
    session.commit()
    make_group(job, prompt="two red circles")
    make_group(job, prompt="one blue square")
    make_group(None, prompt="two red circles")
    with gr.Blocks() as page:
        rollouts.build_rollouts(gr.State(None))
    show = next(f for f in page.fns.values() if f.fn is rollouts.show)
    picker, prompt = show.inputs[1], show.inputs[3]
    assert picker.elem_id == "rollouts-job" and picker.value == rollouts.ALL_JOBS
    assert ("(all jobs)", rollouts.ALL_JOBS) in picker.choices
    assert "combines with Job" in prompt.label and "or a prompt" not in prompt.label
    choices = rollouts.refresh_jobs(_token(admin)).choices
    assert choices[0] == ("(all jobs)", rollouts.ALL_JOBS) and choices[1][1] == job

    def count(job_id, prompt_text: str = "") -> str:
        page_html = rollouts.show(_token(admin), job_id, "", prompt_text, 1)
        return _text(re.search(r'<div id="rollouts-count".*?</div>', page_html).group(0))

    assert count(job) == f"2 group(s) of job {job}; page 1 of 1"
    assert count(rollouts.ALL_JOBS) == "3 group(s); page 1 of 1"
    assert count(job, "two red circles") == \
        f"1 group(s) of job {job}, prompt “two red circles”; page 1 of 1"
    assert count(rollouts.ALL_JOBS, "two red circles") == \
        "2 group(s) of prompt “two red circles”; page 1 of 1"
