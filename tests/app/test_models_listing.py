"""GET /api/models and the launch form's model_path picker: the directories under MODELS_DIR a
flux / sd3 job's model_path may name, each with its model (model_index.json's _class_name)
and, when a job could not load it, the message submission gives. The tiny FLUX directory is
the `models` fixture's (tests/app/conftest.py)."""

from __future__ import annotations

import json
import shutil

FLUX = {"model": "flux", "model_path": "broken", "prompts": ["a red apple", "a blue car"],
        "finetune": "lora", "lora_rank": 4, "resolution": 32,
        "reward_weights": {"jpeg_compressibility": 1.0}, "device": "cpu"}


def _token(headers: dict[str, str]) -> dict[str, str]:
    return {"token": headers["Authorization"].split(" ", 1)[1]}


def _listed(client, headers) -> dict[str, dict]:
    r = client.get("/api/models", headers=headers)
    assert r.status_code == 200, r.text
    return {d["path"]: d for d in r.json()}


def test_a_complete_flux_directory_is_listed_with_its_model(client, annotator, models):
    (models / "notes.txt").write_text("not a directory")  # files are not listed
    (models / ".cache").mkdir()  # nor hidden directories
    assert _listed(client, annotator) == {
        "tiny-flux": {"path": "tiny-flux", "model": "flux", "problem": None}}


def test_an_incomplete_directory_is_listed_with_the_message_submission_gives(
        client, admin, models):
    shutil.copytree(models / "tiny-flux", models / "broken")
    (models / "broken" / "vae" / "config.json").unlink()
    listed = _listed(client, admin)
    assert listed["tiny-flux"]["problem"] is None
    broken = listed["broken"]
    assert broken["model"] == "flux" and "missing vae/config.json" in broken["problem"]
    r = client.post("/api/jobs", json={"kind": "train", "config": FLUX, "preset": "tiny"},
                    headers=admin)
    assert r.status_code == 422
    assert [e["message"] for e in r.json()["errors"]
            if e["field"] == "model_path"] == [broken["problem"]]


def test_a_directory_of_no_known_model_is_listed_with_why(client, admin, models):
    (models / "empty").mkdir()
    other = models / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    listed = _listed(client, admin)
    assert listed["empty"]["model"] is None and "no model_index.json" in listed["empty"][
        "problem"]
    assert listed["other"]["model"] is None and "KandinskyPipeline" in listed["other"][
        "problem"]


def test_a_link_leaving_models_dir_is_refused_as_submission_would(client, admin, models,
                                                                 tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.copytree(models / "tiny-flux", outside)
    (models / "linked").symlink_to(outside, target_is_directory=True)
    linked = _listed(client, admin)["linked"]
    assert linked["model"] is None and "MODELS_DIR" in linked["problem"]


def test_no_models_dir_is_an_empty_list(client, annotator, settings):
    assert not settings.resolved_models_dir.exists()
    assert client.get("/api/models", headers=annotator).json() == []


def test_listing_models_needs_a_token(client, models):
    assert client.get("/api/models").status_code == 401


def test_the_model_path_picker_offers_the_models_complete_directories(settings, admin,
                                                                      annotator, models):
    import gradio as gr

    from app.ui import jobs

    shutil.copytree(models / "tiny-flux", models / "broken")
    (models / "broken" / "vae" / "config.json").unlink()
    update = jobs.model_path_choices(_token(admin), "flux")
    assert [c[0] for c in update.choices] == ["tiny-flux"]  # the incomplete one left out
    assert jobs.model_path_choices(_token(admin), "sd3").choices == []
    assert jobs.model_path_choices(_token(admin), "shapes").choices == []
    assert jobs.model_path_choices(_token(annotator), "flux") == gr.skip()
    assert jobs.model_path_choices(None, "flux") == gr.skip()

    # the form's field is that picker, a typed path allowed, its error box beside it
    names = [d["name"] for d in jobs.describe()]
    d = jobs.describe()[names.index("model_path")]
    field = jobs.field_component(d, "")
    assert isinstance(field, gr.Dropdown) and field.allow_custom_value
    with gr.Blocks() as page:
        user = gr.State(None)
        with gr.Tab("Jobs", elem_id="tab-jobs") as tab:
            jobs.build_jobs(user, tab)
    events = {(page.blocks[block].elem_id or page.blocks[block] is user, name)
              for f in page.fns.values() if f.fn is jobs.model_path_choices
              for block, name in f.targets}
    # the model's change, the tab shown, a login (the user state's change)
    assert events == {("cfg-model", "change"), ("tab-jobs", "select"), (True, "change")}
