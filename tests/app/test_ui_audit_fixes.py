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


# --- 2: the preview field and the messages follow an upload and a deletion -------------------
def _upload(folder, user: dict, name: str) -> tuple:
    from app.ui import datasets

    made = folder / name / f"{name}.txt"
    made.parent.mkdir(parents=True)
    made.write_text("a red fox\nan owl at night\n")
    return datasets.upload(user, str(made), "", 0.0, 0)


def test_an_upload_sets_the_preview_field_and_deleting_it_clears_its_messages(
        settings, admin, tmp_path, monkeypatch):
    """After an upload the field kept an older id; Delete of the new dataset then left its
    preview and "Imported dataset N" on screen while the list no longer had it."""
    import gradio as gr

    from app.ui import datasets

    folder = tmp_path / "gradio-uploads"  # Gradio's upload folder, as Gradio reads it
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(folder))
    user = _token(admin)
    older = _upload(folder, user, "older")[-1]
    status, preview, _, _, field = _upload(folder, user, "newer")
    assert f'data-dataset="{field}"' in status and f'data-dataset="{field}"' in preview
    assert field != older
    # an error leaves the field as it is
    assert datasets.upload(user, None, "", 0.0, 0)[-1] == gr.skip()

    # the field holds another id (typed, not previewed): the preview on screen still goes
    out = datasets.delete(user, field, True, older, preview, status)
    assert 'id="dataset-deleted"' in out[0]
    assert out[1] == "" and out[3] == older  # the preview, and the field on the newest left
    assert out[6] == ""  # "Imported dataset N" went with dataset N
    # messages about another dataset stay
    again = _upload(folder, user, "again")
    out = datasets.delete(user, older, True, again[-1], again[1], again[0])
    assert out[1] == gr.skip() and out[6] == gr.skip()

    with gr.Blocks() as page:
        datasets.build_datasets(gr.State(None))
    button = next(f for f in page.fns.values() if f.fn is datasets.upload_form)
    assert button.outputs[4].elem_id == "dataset-pick"  # then the fields' error boxes
    button = next(f for f in page.fns.values() if f.fn is datasets.delete)
    assert [c.elem_id for c in button.inputs[-2:]] == ["dataset-preview-box", "dataset-status"]
    assert button.outputs[-1].elem_id == "dataset-status"


# --- 3: the Datasets tab re-reads its list when shown -----------------------------------------
def test_the_datasets_tab_lists_a_dataset_uploaded_elsewhere_when_shown(settings, admin,
                                                                        annotator, session):
    import gradio as gr

    from app.services.datasets import import_dataset
    from app.ui import datasets

    keep = import_dataset(session, filename="keep.txt", data=b"one red circle\n").dataset.id
    picked = import_dataset(session, filename="api.txt", data=b"two blue squares\n").dataset.id
    session.commit()
    listing, picker = datasets.on_show(_token(admin), picked)
    assert "api.txt" in listing and "2 dataset(s)" in listing
    assert {value for _, value in picker.choices} == {keep, picked} and picker.value == picked
    # a picked dataset deleted elsewhere is no longer picked (a value outside the choices)
    _, picker = datasets.on_show(_token(admin), picked + 100)
    assert picker.value is None
    assert datasets.on_show(_token(annotator), None) == (gr.skip(), gr.skip())

    with gr.Blocks() as page, gr.Tabs(), gr.Tab("Datasets", elem_id="tab-datasets") as tab:
        datasets.build_datasets(gr.State(None), tab)
    event = _wired(page, datasets.on_show, "tab-datasets", "select")
    assert [c.elem_id for c in event.outputs] == ["dataset-list", "dataset-delete-pick"]


# --- 4: a sampling job's group header names where its images came from ------------------------
def test_a_sampling_jobs_group_header_names_the_checkpoint_not_its_iteration(
        settings, admin, make_group):
    """"job 6 iteration 18 · evaluate": 18 was the checkpoint's training iteration."""
    from app.db import session_scope
    from app.models import Job
    from app.services.checkpoints import record_checkpoint
    from app.ui import jobs, rollouts

    with session_scope() as s:
        train, evaluate = Job(kind="train", config={}), Job(kind="evaluate", config={})
        s.add_all([train, evaluate])
        s.flush()
        train_id, eval_id = train.id, evaluate.id
        ckpt = record_checkpoint(s, train_id, 18, "c.safetensors", name="iter-000018")
    make_group(train_id, iteration=10, purpose="train")
    make_group(eval_id, iteration=18, checkpoint_id=ckpt, purpose="evaluate")
    page = _text(rollouts.show(_token(admin), None, "", "", 1))
    assert (f"job {eval_id} (evaluate) · checkpoint iter-000018 (#{ckpt}) of job {train_id} · "
            "G=4") in page, page
    assert f"job {eval_id} iteration 18" not in page
    assert f"training job {train_id} iteration 10 · G=4" in page
    # the job page's "Newest samples" shows the same header
    samples = jobs.job_view(_token(admin), eval_id, None)[3]
    assert f"job {eval_id} (evaluate) · checkpoint iter-000018" in _text(samples)


# --- 5: an action's message goes once the page shows the new state ----------------------------
def test_a_cancel_message_is_replaced_once_the_job_is_cancelled(settings, admin):
    """"Cancel requested for job 2 (running)." stayed beside a header saying cancelled."""
    import gradio as gr

    from app.db import session_scope
    from app.models import Job
    from app.ui import jobs

    with session_scope() as s:
        job = Job(kind="train", status="running", config={})
        other = Job(kind="train", status="running", config={})
        s.add_all([job, other])
        s.flush()
        job_id, other_id = job.id, other.id
    message = jobs.act(None, "cancel", _token(admin), job_id, confirmed=True)
    assert "Cancel requested" in message
    assert jobs.job_view(_token(admin), job_id, None, message)[-1] == gr.skip()  # still true
    with session_scope() as s:
        s.get(Job, job_id).status = "cancelled"
    assert jobs.job_view(_token(admin), other_id, None, message)[-1] == gr.skip()
    _, header, *_, replaced = jobs.job_view(_token(admin), job_id, None, message)
    assert "cancelled" in header and "Cancel requested" not in replaced
    assert f"Job {job_id} is now cancelled." in _text(replaced)
    assert jobs.job_view(_token(admin), job_id, None, replaced)[-1] == gr.skip()

    with gr.Blocks() as page:
        jobs.build_jobs(gr.State(None))
    tick = next(f for f in page.fns.values() if f.fn is jobs.job_view)
    assert tick.inputs[-1].elem_id == tick.outputs[-1].elem_id == "job-action-status"


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


# --- 6: a model change resets the fields the new model refuses --------------------------------
def test_choosing_shapes_after_the_flux_lora_preset_launches(settings, admin, enqueuer):
    """Preset flux-lora, then model shapes: launch failed on lora_rank ("... or leave
    lora_rank out", which a form cannot do), then on resolution, compilation and
    checkpointing."""
    import gradio as gr

    from app.ui import jobs

    names = [d["name"] for d in jobs.describe()]
    values = jobs.form_values("flux-lora")
    values[names.index("model")] = "shapes"
    # the model's handler, as the page runs it on the change
    values = jobs.form_for_model(*values)
    defaults = dict(zip(names, jobs.form_values(None), strict=True))
    updates = dict(zip(names, values, strict=True))
    for name in jobs.MODEL_DEPENDENT_FIELDS:
        assert updates[name] == defaults[name], name
    job_id, out = jobs.launch(enqueuer, _token(admin), None, *values)
    assert job_id is not None, [e for e in out if e]
    # fields a model accepts stay as they are
    flux = jobs.form_values("flux-lora")
    assert all(u == gr.skip() for u in jobs.fields_for_model(*flux))

    with gr.Blocks() as page:
        jobs.build_jobs(gr.State(None))
    event = _wired(page, jobs.fields_for_model, "cfg-finetune", "change")
    assert [c.elem_id for c in event.outputs] == [
        f"cfg-{n}" for n in jobs.MODEL_DEPENDENT_FIELDS]
    event = _wired(page, jobs.model_changed, "cfg-model", "change")
    assert [c.elem_id for c in event.outputs] == [f"cfg-{n}" for n in names if n != "model"]
    assert jobs.model_changed(*values) == values[:names.index("model")] + values[
        names.index("model") + 1:]


def test_a_preference_fit_jobs_page_promises_no_samples(settings, admin):
    """A fit job's page said "No samples yet.": a fit samples nothing, ever."""
    from app.db import session_scope
    from app.models import Job
    from app.ui import jobs

    with session_scope() as s:
        fit, train = Job(kind="fit_preference", config={}), Job(kind="train", config={})
        s.add_all([fit, train])
        s.flush()
        fit_id, train_id = fit.id, train.id
    assert "No samples yet" not in _text(jobs.job_view(_token(admin), fit_id, None)[3])
    assert "No samples yet" in _text(jobs.job_view(_token(admin), train_id, None)[3])
