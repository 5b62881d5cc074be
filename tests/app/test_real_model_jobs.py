"""Issue 16, end to end through the product: jobs on real (diffusers) models are checked at
submission like every other job. A train job's model_path must be a complete diffusers
directory under MODELS_DIR (never STORAGE_DIR); rollout and evaluate jobs sample their
checkpoints' model (filled in, or refused when another is named) or a base model whose
directory they name, with image rewards by default; the launch form carries the new fields and
presets; large rollout images get thumbnails for the grids. The tiny FLUX directory comes from
tests/tiny_diffusers.py (the `tiny_flux_path` fixture of tests/conftest.py)."""

from __future__ import annotations

import io
import json
import shutil

import pytest

# a real model trains on prompts it is given (the shapes prompts are the shapes model's)
FLUX = {"model": "flux", "model_path": "tiny-flux", "prompts": ["a red apple", "a blue car"],
        "finetune": "lora", "lora_rank": 4,
        "resolution": 32, "reward_weights": {"jpeg_compressibility": 1.0}, "device": "cpu"}


def _post(client, headers, kind, config, preset=None):
    body = {"kind": kind, "config": config}
    if preset:
        body["preset"] = preset
    return client.post("/api/jobs", json=body, headers=headers)


def _errors(response) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in response.json()["errors"]:
        out[e["field"]] = f"{out.get(e['field'], '')} {e['message']}".strip()
    return out


def test_a_tiny_flux_train_job_under_models_dir_is_accepted(client, admin, models):
    r = _post(client, admin, "train", FLUX, "tiny")
    assert r.status_code == 201, r.text
    assert r.json()["config"]["model_path"] == "tiny-flux"  # stored as given
    r = _post(client, admin, "train", {**FLUX, "model_path": str(models / "tiny-flux")}, "tiny")
    assert r.status_code == 201, r.text


def test_model_path_must_lie_under_models_dir_only(client, admin, models, settings,
                                                   tiny_flux_path):
    storage = settings.resolved_storage_dir
    storage.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_flux_path, storage / "flux-in-storage")
    (models / "escape").symlink_to(storage / "flux-in-storage")
    for bad in (str(storage / "flux-in-storage"),  # a complete directory, but in STORAGE_DIR
                "../storage/flux-in-storage", "escape",  # relative and symlinked ways out
                str(tiny_flux_path), "/etc"):
        r = _post(client, admin, "train", {**FLUX, "model_path": bad}, "tiny")
        assert r.status_code == 422, (bad, r.text)
        assert list(_errors(r)) == ["model_path"], bad
        assert "MODELS_DIR" in _errors(r)["model_path"] and "STORAGE_DIR" not in r.text


def test_a_missing_or_incomplete_model_directory_is_422_naming_what_is_missing(
        client, admin, models):
    r = _post(client, admin, "train", {**FLUX, "model_path": "nope"}, "tiny")
    assert r.status_code == 422 and list(_errors(r)) == ["model_path"]
    message = _errors(r)["model_path"]
    assert "does not exist" in message and str(models / "nope") in message
    assert "model_index.json" in message and "transformer/config.json" in message

    shutil.copytree(models / "tiny-flux", models / "broken")
    (models / "broken" / "vae" / "config.json").unlink()
    r = _post(client, admin, "train", {**FLUX, "model_path": "broken"}, "tiny")
    assert r.status_code == 422 and list(_errors(r)) == ["model_path"]
    assert "incomplete" in _errors(r)["model_path"]
    assert "missing vae/config.json" in _errors(r)["model_path"]
    r = _post(client, admin, "train", {**FLUX, "model_path": ""}, "tiny")
    assert r.status_code == 422 and list(_errors(r)) == ["model_path"]


def test_a_flux_job_without_a_preset_starts_from_flux_lora_as_the_cli_does(client, admin,
                                                                          models):
    """No preset: the model's preset (LoRA, its batch sizes), not the shapes defaults, which
    would fine-tune every weight of a 12B model; given fields still win over it."""
    from trainer.config import PRESETS

    r = _post(client, admin, "train", {"model": "flux", "model_path": "tiny-flux",
                                       "resolution": 32, "device": "cpu",
                                       "prompts": ["a red apple"]})
    assert r.status_code == 201, r.text
    config = r.json()["config"]
    for name in ("finetune", "lora_rank", "lora_alpha", "group_size", "rollout_batch_size"):
        assert config[name] == PRESETS["flux-lora"][name], name
    assert config["finetune"] == "lora" and config["resolution"] == 32
    r = _post(client, admin, "train", {"model": "flux", "model_path": "tiny-flux",
                                       "resolution": 32, "device": "cpu", "lora_rank": 8,
                                       "prompts": ["a red apple"]})
    assert r.status_code == 201 and r.json()["config"]["lora_rank"] == 8, r.text


def test_a_flux_train_job_needs_a_dataset_or_prompts(client, admin, models):
    """Left out, FLUX trained on the shapes world's 48 prompts without a word."""
    trained = {k: v for k, v in FLUX.items() if k != "prompts"}
    r = _post(client, admin, "train", trained, "tiny")
    assert r.status_code == 422, r.text
    assert _errors(r) == {"prompts": "model 'flux' trains on prompts you give: a dataset "
                          "(dataset_id: its train split) or config.prompts; the 48 shapes "
                          "prompts are the shapes model's"}
    upload = client.post("/api/datasets", files={"file": ("p.txt", b"a red apple\n")},
                         headers=admin)
    assert upload.status_code == 201, upload.text
    r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny", "config": trained,
                                       "dataset_id": upload.json()["id"]}, headers=admin)
    assert r.status_code == 201, r.text


def test_a_stored_flux_job_without_prompts_fails_in_one_line(client, admin, models):
    """A job stored before the rule above (no prompts, no dataset) fails at its start
    naming the field, not with the trainer's traceback."""
    from sqlalchemy.orm.attributes import flag_modified

    from app.db import session_scope
    from app.models import Job
    from worker.lease import JobError
    from worker.training import prepare_trainer

    r = _post(client, admin, "train", FLUX, "tiny")
    assert r.status_code == 201, r.text
    with session_scope() as s:
        job = s.get(Job, r.json()["id"])
        job.config["prompts"] = []
        flag_modified(job, "config")
    with pytest.raises(JobError, match="^prompts: model 'flux' trains on prompts you give"):
        prepare_trainer(r.json()["id"])


def test_lora_fields_on_a_full_fine_tune_are_422_not_ignored(client, admin, models):
    """A LoRA field the user sets on a run that trains in full would be ignored: refused,
    each field named; the preset's own LoRA fields (or a value equal to them) are not."""
    full = {**FLUX, "finetune": "full"}
    r = _post(client, admin, "train", {**full, "lora_alpha": 3.0,
                                       "lora_target_modules": ["to_q"]}, "tiny")
    assert r.status_code == 422, r.text
    assert set(_errors(r)) == {"lora_rank", "lora_alpha", "lora_target_modules"}
    assert "applies only to finetune='lora'" in _errors(r)["lora_rank"]
    r = _post(client, admin, "train", {k: v for k, v in full.items() if k != "lora_rank"},
              "tiny")
    assert r.status_code == 201, r.text
    r = _post(client, admin, "train", {"model": "flux", "model_path": "tiny-flux",
                                       "resolution": 32, "device": "cpu", "finetune": "full",
                                       "prompts": ["a red apple"]}, "flux-lora")
    assert r.status_code == 201, r.text  # flux-lora's own rank is not the user's


def test_gradient_checkpointing_off_takes_the_presets_share_of_blocks_with_it(
        client, admin, models):
    """flux-lora recomputes a quarter of the blocks; `gradient_checkpointing: false` on it
    was a 422 on gradient_checkpointing_fraction 0.25, a value the user never gave. A share
    the user gives beside it is still theirs to have refused."""
    off = {"model": "flux", "model_path": "tiny-flux", "resolution": 32, "device": "cpu",
           "prompts": ["a red apple"], "gradient_checkpointing": False}
    for preset in (None, "flux-lora"):
        r = _post(client, admin, "train", off, preset)
        assert r.status_code == 201, (preset, r.text)
        config = r.json()["config"]
        assert config["gradient_checkpointing"] is False
        assert config["gradient_checkpointing_fraction"] == 1.0
    r = _post(client, admin, "train", {**off, "gradient_checkpointing_fraction": 0.5})
    assert r.status_code == 422 and list(_errors(r)) == ["gradient_checkpointing_fraction"]


def test_lora_targets_that_name_no_layer_are_422(client, admin, models):
    """peft refuses a run whose targets name no layer (after the model loaded, in the
    worker); a target outside the default list that names none is a typo whose adapters
    would be missing. Both are read from the transformer's weight names at submission."""
    for targets, why in ((["nonexistent_module"], "none of ['nonexistent_module'] names a "
                                                  "layer of the transformer"),
                         (["to_q", "to_qq"], "['to_qq'] name no layer of the transformer")):
        r = _post(client, admin, "train", {**FLUX, "lora_target_modules": targets}, "tiny")
        assert r.status_code == 422 and list(_errors(r)) == ["lora_target_modules"], r.text
        assert why in _errors(r)["lora_target_modules"], r.text
    for targets in (["to_q", "attn.to_k", "proj_mlp"], ["to_q", "add_q_proj"]):
        r = _post(client, admin, "train", {**FLUX, "lora_target_modules": targets}, "tiny")
        assert r.status_code == 201, (targets, r.text)


def test_lora_rank_0_and_every_other_problem_at_once(client, admin, models):
    r = _post(client, admin, "train", {**FLUX, "lora_rank": 0}, "tiny")
    assert r.status_code == 422 and list(_errors(r)) == ["lora_rank"]
    assert "[1, 1024]" in _errors(r)["lora_rank"]
    r = _post(client, admin, "train", {**FLUX, "lora_rank": 0, "model_path": "nope",
                                       "resolution": 40, "lora_target_modules": []}, "tiny")
    assert set(_errors(r)) == {"lora_rank", "model_path", "resolution", "lora_target_modules"}


def test_a_flux_base_checkpoint_must_be_a_checkpoint_directory(client, admin, models):
    (models / "empty-run").mkdir()
    (models / "weights.safetensors").write_bytes(b"\0" * 16)
    for bad, why in (("empty-run", "not a checkpoint directory"),
                     ("weights.safetensors", "is a file, not a dir"),
                     ("run-9/iter-000001", "does not exist"),  # a checkpoint deleted since
                     ("/etc", "is not a dir under STORAGE_DIR")):  # outside: nothing said
        r = _post(client, admin, "train", {**FLUX, "base_checkpoint": bad}, "tiny")
        assert r.status_code == 422 and list(_errors(r)) == ["base_checkpoint"], r.text
        assert why in _errors(r)["base_checkpoint"]


def test_a_base_checkpoint_that_does_not_fit_the_run_is_422_not_a_worker_failure(
        client, admin, models):
    """The worker's loader refuses a LoRA of another rank, a checkpoint of the other finetune
    mode, adapters on layers the run does not target, and another model's checkpoint: so
    does submission, from the files' headers, naming base_checkpoint."""
    from safetensors.torch import load_file, save_file

    from trainer.config import PRESETS, TrainConfig
    from trainer.loop import Trainer
    from trainer.models import safetensors_metadata

    def run_config(**overrides):
        return TrainConfig.from_dict({**PRESETS["tiny"], **FLUX, "prompts": ["a red apple"],
                                      "model_path": str(models / "tiny-flux"), **overrides})

    ours = str(Trainer(run_config()).save_checkpoint(models / "run-r4").relative_to(models))
    # another model's run: its recorded config names sd3 (the check reads the trainer state)
    theirs = Trainer(run_config()).save_checkpoint(models / "run-sd3")
    state = theirs / "trainer_state.safetensors"
    meta = safetensors_metadata(state)
    meta["train_config"] = meta["train_config"].replace('"model": "flux"', '"model": "sd3"')
    assert '"model": "sd3"' in meta["train_config"]
    save_file(load_file(str(state)), str(state), metadata=meta)

    r = _post(client, admin, "train", {**FLUX, "base_checkpoint": ours}, "tiny")
    assert r.status_code == 201, r.text
    lora = models / ours / "pytorch_lora_weights.safetensors"
    for change, field, why in (
            ({"lora_rank": 8}, "base_checkpoint",
             f"{lora} holds a LoRA of rank 4; this run's adapters have rank 8 (lora_rank)"),
            ({"finetune": "full", "lora_rank": 32}, "base_checkpoint",
             "holds no transformer/diffusion_pytorch_model.safetensors (a full fine-tune's"),
            ({"lora_target_modules": ["to_q", "to_k"]}, "base_checkpoint",
             "holds adapters on layers this run's lora_target_modules do not train"),
            ({"base_checkpoint": str(theirs)}, "base_checkpoint",
             "is a checkpoint of model 'sd3'; this run trains 'flux'")):
        r = _post(client, admin, "train", {**FLUX, "base_checkpoint": ours, **change},
                  "tiny")
        assert r.status_code == 422 and list(_errors(r)) == [field], (change, r.text)
        assert why in _errors(r)[field], (change, r.text)
    # a malformed lora_rank is reported alone, not again as a mismatch
    r = _post(client, admin, "train", {**FLUX, "base_checkpoint": ours, "lora_rank": 0},
              "tiny")
    assert r.status_code == 422 and list(_errors(r)) == ["lora_rank"], r.text


def _dataset(client, admin) -> int:
    r = client.post("/api/datasets", headers=admin,
                    files={"file": ("p.txt", b"a red apple\na blue car\n", "text/plain")})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_rollout_of_a_base_model_names_its_directory_and_scores_image_rewards(
        client, admin, models):
    ds = _dataset(client, admin)
    r = _post(client, admin, "rollout", {"dataset_id": ds, "model": "flux"})
    assert r.status_code == 422 and list(_errors(r)) == ["model_path"]
    assert "needs model_path" in _errors(r)["model_path"]
    r = _post(client, admin, "rollout", {"dataset_id": ds, "model": "flux",
                                         "model_path": "../storage"})
    assert r.status_code == 422 and "MODELS_DIR" in _errors(r)["model_path"]
    r = _post(client, admin, "rollout", {"dataset_id": ds, "model": "flux", "model_path": "x",
                                         "resolution": 40})
    assert set(_errors(r)) == {"model_path", "resolution"}
    r = _post(client, admin, "rollout", {"dataset_id": ds, "model": "flux",
                                         "model_path": "tiny-flux", "resolution": 32,
                                         "guidance_scale": 2.0, "batch_size": 4})
    assert r.status_code == 201, r.text
    config = r.json()["config"]
    assert config["model"] == "flux" and config["reward_names"] == ["jpeg_compressibility"]
    assert (config["resolution"], config["guidance_scale"], config["batch_size"]) == (32, 2.0, 4)
    # the shapes rewards read only the shapes world's canvases: refused for flux, naming them
    r = _post(client, admin, "rollout", {"dataset_id": ds, "model": "flux",
                                         "model_path": "tiny-flux", "resolution": 32,
                                         "reward_names": ["jpeg_compressibility", "count"]})
    assert set(_errors(r)) == {"reward_names"}, r.text
    assert "['count'] score only the shapes model's" in r.text
    # beside an unknown name and a repeated one, all three said (the shapes-only check ran
    # first and marked the field, and the other two went unsaid: the API audit, 2026-12-07)
    r = _post(client, admin, "rollout", {"dataset_id": ds, "model": "flux",
                                         "model_path": "tiny-flux", "resolution": 32,
                                         "reward_names": ["count", "zzz", "count"]})
    said = [e["message"] for e in r.json()["errors"] if e["field"] == "reward_names"]
    assert len(said) == 3, r.text
    assert "unknown reward 'zzz'" in said[0] and "must not repeat a reward: ['count']" in said[1]
    assert "['count'] score only the shapes model's" in said[2]
    r = _post(client, admin, "train", {**FLUX, "reward_weights": {"color": 1.0}})
    assert set(_errors(r)) == {"reward_weights"}, r.text
    # the shapes world is unchanged: its base model and its rewards, on prompts it can draw
    r = _post(client, admin, "rollout", {"dataset_id": ds})
    assert _errors(r) == {"dataset_id": r.json()["errors"][0]["message"]}
    assert "'a red apple'" in r.text
    shapes = client.post("/api/datasets", headers=admin, files={
        "file": ("s.txt", b"one red circle\n", "text/plain")}).json()["id"]
    r = _post(client, admin, "rollout", {"dataset_id": shapes})
    assert r.status_code == 201, r.text
    assert r.json()["config"]["model"] == "shapes"
    assert r.json()["config"]["reward_names"] == ["count", "color", "shape"]
    r = _post(client, admin, "rollout", {"dataset_id": shapes, "model_path": "tiny-flux",
                                         "resolution": 64})
    assert set(_errors(r)) == {"model_path", "resolution"}


def test_sampling_jobs_take_their_checkpoints_model(client, admin, models, session):
    """A flux checkpoint (saved by the trainer, recorded as the worker records it) samples as
    flux: the model is filled in, another is refused, mixing models in an evaluation is
    refused, and a model directory that has gone since training must be given anew."""
    from app.services import storage
    from app.services.checkpoints import record_checkpoint
    from trainer import PRESETS, TrainConfig, Trainer
    from trainer.models import SHAPES_BASE, checkpoint_weights_file

    trained = TrainConfig.from_dict({**PRESETS["tiny"], **FLUX,
                                     "model_path": str(models / "tiny-flux")})
    root = storage.storage_root() / "checkpoints" / "job-x"
    flux_ids = []
    for name in ("a", "b"):
        directory = Trainer(trained).save_checkpoint(root / name)
        flux_ids.append(record_checkpoint(session, None, 0, str(checkpoint_weights_file(
            directory)), name=f"flux-{name}"))
    storage.write_bytes("checkpoints/shapes/model.safetensors", SHAPES_BASE.read_bytes())
    shapes_id = record_checkpoint(session, None, 0, "checkpoints/shapes/model.safetensors",
                                  name="shapes")
    session.commit()
    ds = _dataset(client, admin)

    r = _post(client, admin, "rollout", {"dataset_id": ds, "checkpoint_id": flux_ids[0]})
    assert r.status_code == 201, r.text
    assert r.json()["config"]["model"] == "flux"
    assert r.json()["config"]["reward_names"] == ["jpeg_compressibility"]
    r = _post(client, admin, "rollout", {"dataset_id": ds, "checkpoint_id": flux_ids[0],
                                         "model": "shapes"})
    assert r.status_code == 422 and list(_errors(r)) == ["model"]
    assert "'flux'" in _errors(r)["model"]
    # flux is evaluated on prompts it is given, or a dataset's: the 48 shapes prompts (the
    # worker's fallback) are the shapes model's
    r = _post(client, admin, "evaluate", {"checkpoint_ids": flux_ids})
    assert r.status_code == 422 and _errors(r) == {"prompts": (
        "model 'flux' is evaluated on prompts you give: config.prompts or a dataset "
        "(config.dataset_id: its split); the 48 shapes prompts are the shapes model's")}
    r = _post(client, admin, "evaluate", {"checkpoint_ids": flux_ids, "dataset_id": ds,
                                          "split": "all"})
    assert r.status_code == 201 and r.json()["config"]["model"] == "flux", r.text
    r = client.post("/api/jobs", json={"kind": "evaluate", "dataset_id": ds,
                                       "config": {"checkpoint_ids": flux_ids, "split": "all"}},
                    headers=admin)
    assert r.status_code == 201, r.text
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [shapes_id]})  # its own prompts
    assert r.status_code == 201, r.text
    r = _post(client, admin, "evaluate", {"checkpoint_ids": flux_ids, "prompts": ["a cat"]})
    assert r.status_code == 201 and r.json()["config"]["model"] == "flux", r.text
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [flux_ids[0], shapes_id]})
    assert r.status_code == 422 and list(_errors(r)) == ["checkpoint_ids"]
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [shapes_id, shapes_id + 99]})
    assert list(_errors(r)) == ["checkpoint_ids"]  # (unknown: said once, by the usual check)

    # the directory the checkpoints were trained from moves: model_path must name it anew
    (models / "tiny-flux").rename(models / "moved")
    r = _post(client, admin, "evaluate", {"checkpoint_ids": flux_ids, "prompts": ["a cat"]})
    assert r.status_code == 422 and list(_errors(r)) == ["model_path"]
    assert "does not exist" in _errors(r)["model_path"]
    r = _post(client, admin, "evaluate", {"checkpoint_ids": flux_ids, "model_path": "moved",
                                          "prompts": ["a cat"]})
    assert r.status_code == 201, r.text


def test_send_to_arena_from_a_real_model_job_before_its_first_checkpoint(
        settings, session, enqueuer, models):
    from app.services import datasets, jobs

    shapes = datasets.import_dataset(session, filename="shapes.txt", data=b"a red apple\n",
                                     name=jobs.SHAPES_DATASET).dataset
    # trained on a dataset (its prompts), which the arena's rollouts then sample
    trained = {k: v for k, v in FLUX.items() if k != "prompts"}
    src = jobs.launch_job(session, enqueuer, "train", {**trained, "rollout_batch_size": 2},
                          preset="tiny", dataset_id=shapes.id)
    job, ckpt = jobs.send_to_arena(session, enqueuer, src.id)
    assert ckpt is None
    assert {k: job.config[k] for k in ("model", "model_path", "resolution", "batch_size",
                                       "reward_names")} == {
        "model": "flux", "model_path": "tiny-flux", "resolution": 32, "batch_size": 2,
        "reward_names": ["jpeg_compressibility"]}


def test_the_launch_form_renders_and_submits_the_real_model_fields(settings, admin, enqueuer,
                                                                   models):
    import gradio as gr

    from app.ui import jobs

    fields = {d["name"]: d for d in jobs.describe()}
    names = list(fields)
    assert {"flux-lora", "sd3-lora"} <= set(jobs.presets())
    kinds = {n: type(jobs.field_component(fields[n], fields[n]["default"]))
             for n in ("model", "finetune", "mixed_precision", "gradient_checkpointing",
                       "lora_target_modules", "lora_rank", "guidance_scale", "model_path")}
    assert kinds == {"model": gr.Dropdown, "finetune": gr.Dropdown,
                     "mixed_precision": gr.Dropdown, "gradient_checkpointing": gr.Checkbox,
                     "lora_target_modules": gr.Textbox, "lora_rank": gr.Number,
                     "guidance_scale": gr.Number, "model_path": gr.Dropdown}
    assert jobs.field_component(fields["model"], "flux").choices == [
        (c, c) for c in ("shapes", "flux", "sd3")]

    values = jobs.form_values("flux-lora")
    form = dict(zip(names, values, strict=True))
    assert form["model"] == "flux" and form["finetune"] == "lora" and form["lora_rank"] == 64
    token = {"token": admin["Authorization"].split(" ", 1)[1]}
    job_id, out = jobs.launch(enqueuer, token, None, *values)  # no model_path yet
    errors = dict(zip(names, out[1:], strict=True))
    assert job_id is None and "diffusers-format directory" in errors["model_path"]
    # nor prompts: FLUX does not train on the shapes world's
    assert "trains on prompts you give: a dataset" in errors["prompts"]
    assert sum(bool(v) for v in errors.values()) == 2

    # as the browser sends them back: numbers as floats, the list as JSON text, a checkbox
    form.update(model_path="tiny-flux", resolution=32.0, lora_rank=4.0, iterations=2.0,
                group_size=4.0, num_anchors=2.0, device="cpu", gradient_checkpointing=True,
                lora_target_modules='["to_q", "to_v"]', prompts='["a red apple"]')
    job_id, out = jobs.launch(enqueuer, token, None, *form.values())
    assert job_id is not None, out
    from app.db import session_scope
    from app.models import Job

    with session_scope() as s:
        config = s.get(Job, job_id).config
    assert config["lora_target_modules"] == ["to_q", "to_v"]
    assert config["gradient_checkpointing"] is True and config["lora_rank"] == 4
    assert config["model"] == "flux" and config["model_path"] == "tiny-flux"


def test_choosing_flux_in_the_form_launches_what_the_api_does(client, settings, admin,
                                                               enqueuer, models):
    """The form moved only the reward and finetune with the model: flux launched with the
    shapes defaults' batch sizes (0), learning rate, LoRA rank, resolution and checkpointing,
    where the API and the CLI start from flux-lora. Back to shapes, the defaults return; a
    value someone typed stays."""
    from app.db import session_scope
    from app.models import Job
    from app.ui import jobs

    names = [d["name"] for d in jobs.describe()]
    given = {"model_path": "tiny-flux", "prompts": ["a"], "iterations": 1, "device": "cpu"}
    form = dict(zip(names, jobs.form_values(None), strict=True))
    form["model"] = "flux"  # as the page runs the model's change handler
    form = dict(zip(names, jobs.form_for_model(*form.values()), strict=True))
    form.update(given, prompts=json.dumps(given["prompts"]))
    token = {"token": admin["Authorization"].split(" ", 1)[1]}
    job_id, out = jobs.launch(enqueuer, token, None, *form.values())
    assert job_id is not None, [e for e in out if e]
    r = _post(client, admin, "train", {"model": "flux", **given})
    assert r.status_code == 201, r.text
    with session_scope() as s:
        assert s.get(Job, job_id).config == r.json()["config"]

    # back to shapes: the defaults again, the fields given kept
    form["model"] = "shapes"
    back = dict(zip(names, jobs.form_for_model(*form.values()), strict=True))
    defaults = dict(zip(names, jobs.form_values(None), strict=True))
    assert {n for n in names if back[n] != defaults[n]} == set(given)
    # a learning rate typed before the model is chosen stays as typed
    defaults.update(model="flux", learning_rate=3e-6)
    typed = dict(zip(names, jobs.form_for_model(*defaults.values()), strict=True))
    assert typed["learning_rate"] == 3e-6 and typed["lora_rank"] == 64


def _png(side: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(side).random((side, side, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_large_rollout_images_get_webp_thumbnails_in_the_grids(client, admin, settings):
    """A real model's 512 px images: a WebP thumbnail beside each PNG, shown in the grids and
    served through the authenticated media route; the 32x32 shapes images stay as they are."""
    from PIL import Image

    from app.db import session_scope
    from app.services import rollouts, storage

    with session_scope() as s:
        ids = [rollouts.record_rollout_group(
            s, job_id=None, iteration=0, solver="euler", steps=4, sigma=0.3, seed=seed,
            prompt_text="a red apple", samples=[
                {"png": _png(side), "member_index": m, "rewards": {"r": float(m)},
                 "advantage": 0.0} for m in range(2)]) for seed, side in ((0, 512), (1, 32))]
    with session_scope() as s:
        big, small = (rollouts.get_group(s, i) for i in ids)
        big_path, small_path = big.samples[0].image_path, small.samples[0].image_path
        thumb = rollouts.thumbnail_of(big_path)
        assert thumb == big_path.replace(".png", ".thumb.webp")
        assert rollouts.thumbnail_of(small_path) is None
        with Image.open(storage.resolve(thumb)) as image:
            assert image.format == "WEBP" and image.size == (160, 160)
        assert storage.resolve(thumb).stat().st_size < storage.resolve(big_path).stat().st_size

        from app.ui.rollouts import groups_html

        page = groups_html([big, small], s)
    assert page.count("data:image/webp;base64,") == 2  # the big group's two members
    assert page.count("data:image/png;base64,") == 2  # the shapes-sized ones, inlined
    assert page.count(">full image</a>") == 2 and f"/api/media/{big_path}" in page

    listed = {g["id"]: g for g in client.get("/api/rollouts", headers=admin).json()["items"]}
    url = listed[ids[0]]["samples"][0]["thumbnail_url"]
    assert url == f"/api/media/{thumb}"
    assert listed[ids[1]]["samples"][0]["thumbnail_url"] is None
    assert client.get(url).status_code == 401
    r = client.get(url, headers=admin)
    assert r.status_code == 200 and r.headers["content-type"] == "image/webp"


def test_a_base_model_rollout_samples_the_base_model_itself(settings, models):
    """What a rollout of the base FLUX (no checkpoint) loads: the model directory under
    MODELS_DIR at the job's resolution and guidance, giving the base model's velocities,
    loaded for sampling only (no adapters, nothing takes gradients); a directory broken since
    submission is a JobError naming the missing file."""
    import torch

    from app.job_kinds import RolloutConfig
    from trainer.models import ModelSpec, load_flow_model
    from worker.sampling import load_sampling_model, sampling_spec

    cfg = RolloutConfig(dataset_id=1, model="flux", model_path="tiny-flux", resolution=32,
                        guidance_scale=2.0)
    spec = sampling_spec(cfg, None)
    assert (spec.name, spec.path, spec.resolution, spec.guidance_scale) == (
        "flux", str(models / "tiny-flux"), 32, 2.0)
    sampled = load_sampling_model(cfg, None)
    assert spec.inference_only and not any(
        p.requires_grad or "lora" in n for n, p in sampled.transformer.named_parameters())
    base = load_flow_model(ModelSpec(name="flux", path=spec.path, resolution=32,
                                     guidance_scale=2.0))
    x = torch.randn(2, *base.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        want = base(x, t, base.encode_prompts(["a red apple", "a blue car"]))
        got = sampled(x, t, sampled.encode_prompts(["a red apple", "a blue car"]))
    torch.testing.assert_close(got, want)

    from worker.lease import JobError

    (models / "tiny-flux" / "vae" / "config.json").unlink()
    with pytest.raises(JobError, match="missing vae/config.json"):
        sampling_spec(cfg, None)


def test_a_shapes_features_preference_model_cannot_blend_into_a_flux_run(client, admin,
                                                                         models, settings):
    """A preference model fitted on the shapes features reads the shapes world's 32x32
    images and prompts: blended into a FLUX run it would fail at the first scoring, so the
    job is refused naming preference_model; one on CLIP features is the way."""
    from app.db import session_scope
    from app.services import preference as pref_svc
    from trainer.rewards.preference import FitConfig, PreferenceModel

    path = settings.resolved_storage_dir / pref_svc.model_path(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    PreferenceModel(FitConfig(width=8, ensemble=1)).save(path)
    with session_scope() as s:
        pref_svc.record_model(s, version=1, path=pref_svc.model_path(1), report={})
    blend = {**FLUX, "reward_weights": {"jpeg_compressibility": 1.0, "preference": 1.0}}
    r = _post(client, admin, "train", blend, "tiny")
    assert r.status_code == 422 and list(_errors(r)) == ["preference_model"], r.text
    assert ("preference model v1 reads the shapes world's images and prompts (features "
            "'shapes'): it cannot score model 'flux'; fit one with features 'clip'") in r.text
    # a job accepted before that fit was recorded ("latest" resolves again at its start)
    from trainer.config import TrainConfig
    from worker.lease import JobError
    from worker.training import attach_preference

    stored = TrainConfig.from_dict({**blend, "model_path": str(models / "tiny-flux")})
    with pytest.raises(JobError, match="preference_model: preference model v1 reads the "
                                       "shapes world's images"):
        attach_preference(None, stored)


def test_an_sd3_resolution_its_transformer_cannot_draw_is_422(client, admin, settings):
    """Train and base-model rollout jobs on an SD3 directory whose position embedding stops
    short of the resolution asked (the tiny model's 128 px, below the default 512) are refused
    naming resolution, not failed by diffusers on a worker."""
    from tiny_diffusers import write_tiny_sd3

    root = settings.resolved_models_dir
    root.mkdir(parents=True, exist_ok=True)
    write_tiny_sd3(root / "tiny-sd3")
    sd3 = {**FLUX, "model": "sd3", "model_path": "tiny-sd3"}
    for resolution in (0, 256):
        r = _post(client, admin, "train", {**sd3, "resolution": resolution}, "tiny")
        assert r.status_code == 422 and list(_errors(r)) == ["resolution"], r.text
        assert "this sd3 model draws at most 128x128 images" in r.text
    assert _post(client, admin, "train", {**sd3, "resolution": 128}, "tiny").status_code == 201
    dataset = _dataset(client, admin)
    rollout = {"dataset_id": dataset, "model": "sd3", "model_path": "tiny-sd3"}
    r = _post(client, admin, "rollout", rollout)
    assert r.status_code == 422 and list(_errors(r)) == ["resolution"], r.text
    r = _post(client, admin, "rollout", {**rollout, "resolution": 96})
    assert r.status_code == 201, r.text
    # a job stored before the rule (or whose directory changed since) fails in one line on
    # the worker, before anything loads
    from app.job_kinds import RolloutConfig
    from worker.lease import JobError
    from worker.sampling import sampling_spec

    stored = RolloutConfig.from_stored({**r.json()["config"], "resolution": 256})
    with pytest.raises(JobError, match="resolution: this sd3 model draws at most 128x128"):
        sampling_spec(stored, None)


def test_guidance_on_the_shapes_model_is_422_not_ignored(client, admin):
    """The shapes model has no guidance: a guidance_scale the user sets on a shapes train,
    rollout or evaluate job would be ignored, so it is refused naming the field; a flux
    run takes it, and a shapes config carrying the default (forms send every field) passes."""
    r = _post(client, admin, "train", {"guidance_scale": 7.0}, "tiny")
    assert r.status_code == 422 and list(_errors(r)) == ["guidance_scale"], r.text
    assert "applies only to flux and sd3" in r.text
    assert _post(client, admin, "train", {"guidance_scale": 3.5}, "tiny").status_code == 201
    up = client.post("/api/datasets", headers=admin, files={
        "file": ("shapes.txt", b"one red circle\ntwo blue squares\n", "text/plain")})
    dataset = up.json()["id"]
    r = _post(client, admin, "rollout", {"dataset_id": dataset, "guidance_scale": 7.0})
    assert r.status_code == 422 and list(_errors(r)) == ["guidance_scale"], r.text
    assert _post(client, admin, "rollout", {"dataset_id": dataset}).status_code == 201
