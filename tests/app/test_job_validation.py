"""Issue 14: a job config the worker would reject is rejected at submission, every problem at
once, each naming its field; and what is accepted is what the worker then loads."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select


def _post(client, headers, kind, config, preset=None):
    body = {"kind": kind, "config": config}
    if preset:
        body["preset"] = preset
    return client.post("/api/jobs", json=body, headers=headers)


def _fields(response) -> list[str]:
    return [e["field"] for e in response.json()["errors"]]


def _errors(response) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json()["errors"]}


def _job_count(session) -> int:
    from app.models import Job

    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job))


def _report_worker(name: str, queues: list[str], cuda: int) -> None:
    from app.db import session_scope
    from app.services import workers

    with session_scope() as s:
        workers.report(s, name, queues, cuda, ["NVIDIA H100"] * cuda)


def test_unknown_reward_is_422_naming_it_and_the_known_ones(client, admin, session, enqueuer):
    r = _post(client, admin, "train", {"reward_weights": {"beauty": 1}}, "tiny")
    assert r.status_code == 422, r.text
    assert _fields(r) == ["reward_weights"]
    message = r.json()["errors"][0]["message"]
    assert "'beauty'" in message and "count" in message
    assert _job_count(session) == 0 and enqueuer.calls == []
    r = _post(client, admin, "rollout", {"dataset_id": 1, "reward_names": ["beauty"]})
    assert "reward_names" in _fields(r) and "'beauty'" in r.text


def test_every_problem_is_reported_at_once(client, admin, session):
    r = _post(client, admin, "train", {"group_size": 1, "learning_rate": 5.0,
                                       "lerning_rate": 1e-5, "reward_weights": {"beauty": 1},
                                       "base_checkpoint": "/etc/passwd"})
    assert r.status_code == 422
    assert set(_fields(r)) == {"group_size", "learning_rate", "lerning_rate",
                               "reward_weights", "base_checkpoint"}
    assert r.json()["field"] in set(_fields(r))
    for name in _fields(r):
        assert f"config.{name}" in r.json()["detail"]
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [1], "seeds": [], "steps": 1,
                                          "model": "unet"})
    assert {"checkpoint_ids", "seeds", "steps", "model"} <= set(_fields(r))
    assert _job_count(session) == 0


@pytest.mark.parametrize("path", ["/etc/passwd", "../../../../../etc/passwd", "nope.safetensors"])
def test_base_checkpoint_outside_storage_and_models_is_422(client, admin, path):
    r = _post(client, admin, "train", {"base_checkpoint": path}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["base_checkpoint"]
    assert "STORAGE_DIR" in r.text and "MODELS_DIR" in r.text


def test_symlink_out_of_the_models_dir_is_refused(client, admin, settings):
    models = settings.resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    (models / "escape.safetensors").symlink_to("/etc/passwd")
    r = _post(client, admin, "train", {"base_checkpoint": "escape.safetensors"}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["base_checkpoint"]


def test_base_checkpoint_under_models_dir_is_accepted_and_the_worker_loads_it(
        client, admin, settings):
    from app.db import session_scope
    from app.models import Job
    from trainer.loop import load_model
    from trainer.models import SHAPES_BASE
    from worker.training import job_train_config

    models = settings.resolved_models_dir
    (models / "shapes").mkdir(parents=True)
    (models / "shapes" / "base.safetensors").write_bytes(SHAPES_BASE.read_bytes())
    for given in ("shapes/base.safetensors", str(models / "shapes" / "base.safetensors")):
        r = _post(client, admin, "train", {"base_checkpoint": given, "device": "cpu"}, "tiny")
        assert r.status_code == 201, r.text
        with session_scope() as s:
            config = job_train_config(s.get(Job, r.json()["id"]).config)
        assert config.base_checkpoint == str(models / "shapes" / "base.safetensors")
        assert load_model(config) is not None  # what the worker builds the trainer from


def test_a_base_checkpoint_replaced_after_submission_fails_the_job_naming_the_field(
        client, admin, settings):
    """Submission checked the base's headers; a file replaced before the job starts (another
    kind of weights, a truncated copy, a deleted one) failed later in the loader with an
    error that named no field. The worker asks submission's question again."""
    from app.db import session_scope
    from app.models import Job
    from trainer.models import SHAPES_BASE
    from trainer.rewards.preference import FitConfig, PreferenceModel
    from worker.lease import JobError
    from worker.training import job_train_config

    base = settings.resolved_models_dir / "shapes" / "base.safetensors"
    base.parent.mkdir(parents=True)
    base.write_bytes(SHAPES_BASE.read_bytes())
    r = _post(client, admin, "train", {"base_checkpoint": "shapes/base.safetensors",
                                       "device": "cpu"}, "tiny")
    assert r.status_code == 201, r.text
    with session_scope() as s:
        stored = s.get(Job, r.json()["id"]).config
    assert job_train_config(stored).base_checkpoint == str(base)
    PreferenceModel(FitConfig(width=8, ensemble=1)).save(base)
    with pytest.raises(JobError, match="^base_checkpoint: .*not a 'shapes-dit' weights file.*"
                                       "changed after the job was submitted"):
        job_train_config(stored)
    base.write_bytes(SHAPES_BASE.read_bytes()[:SHAPES_BASE.stat().st_size // 2])
    with pytest.raises(JobError, match="^base_checkpoint: .*truncated"):
        job_train_config(stored)
    base.unlink()
    with pytest.raises(JobError, match="^base_checkpoint: .*does not exist"):
        job_train_config(stored)


def test_a_jobs_config_is_checked_once_from_submission_to_the_trainer(client, admin,
                                                                      monkeypatch):
    """One config path (issue 15): submission validates the config into its typed form and
    stores it; the worker rebuilds that form and the Trainer takes it, neither checking it
    again. A config changed after its check (a field set, or a dict edited in place) is
    checked again at the Trainer's door."""
    from app.db import session_scope
    from app.models import Job
    from trainer.config import ConfigErrors, TrainConfig
    from trainer.loop import Trainer
    from worker.training import job_train_config

    checks = []
    problems = TrainConfig.problems
    monkeypatch.setattr(TrainConfig, "problems", lambda self: checks.append(1) or problems(self))
    r = _post(client, admin, "train", {"device": "cpu", "iterations": 1}, "tiny")
    assert r.status_code == 201, r.text
    assert len(checks) == 1
    with session_scope() as s:
        config = job_train_config(s.get(Job, r.json()["id"]).config)
    trainer = Trainer(config)
    assert len(checks) == 1 and config.checked
    trainer.step()

    config.learning_rate = -1.0
    assert not config.checked
    with pytest.raises(ConfigErrors, match="learning_rate"):
        Trainer(config)
    config.learning_rate = 1e-4
    config.reward_weights["beauty"] = 1.0  # in place: the fingerprint still sees it
    with pytest.raises(ConfigErrors, match="beauty"):
        Trainer(config)
    with pytest.raises(ConfigErrors, match="no_such_field"):  # a job stored by another version
        TrainConfig.from_stored({**TrainConfig().to_dict(), "no_such_field": 1})


def test_base_checkpoint_must_be_weights_of_the_model(client, admin, settings):
    from trainer.rewards.preference import FitConfig, PreferenceModel

    models = settings.resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    (models / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    PreferenceModel(FitConfig(width=8, ensemble=1)).save(models / "pref.safetensors")
    for name, why in (("image.png", "not a safetensors file"),
                      ("pref.safetensors", "not a 'shapes-dit' weights file")):
        r = _post(client, admin, "train", {"base_checkpoint": name}, "tiny")
        assert r.status_code == 422 and _fields(r) == ["base_checkpoint"] and why in r.text
    # and a preference model given by path must be one
    r = _post(client, admin, "train", {"reward_weights": {"count": 1, "preference": 1},
                                       "preference_model": "image.png"}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["preference_model"]
    r = _post(client, admin, "train", {"reward_weights": {"count": 1, "preference": 1},
                                       "preference_model": "pref.safetensors"}, "tiny")
    assert r.status_code == 201, r.text
    # one damaged inside (NaN weights; its header reads) was a 201 and a job that failed
    import json

    from safetensors.torch import load_file, save_file

    from trainer.rewards.preference import saved_fit_fields

    state = {k: v.fill_(float("nan")) for k, v in
             load_file(str(models / "pref.safetensors")).items()}
    meta = {"format": "preference-model", "report": "null",
            "fit_config": json.dumps(saved_fit_fields(models / "pref.safetensors"))}
    save_file(state, str(models / "nan.safetensors"), metadata=meta)
    r = _post(client, admin, "train", {"reward_weights": {"count": 1, "preference": 1},
                                       "preference_model": "nan.safetensors"}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["preference_model"], r.text
    assert "is a damaged preference model: NaN or infinite weights" in r.text



def test_a_recorded_preference_model_whose_file_is_gone_is_422(client, admin, settings):
    """The newest (or a named) preference model is checked like one given by path: a row
    whose file is gone is a 422, not a job that fails at its first scoring."""
    from app.db import session_scope
    from app.services import preference as pref_svc
    from trainer.rewards.preference import FitConfig, PreferenceModel

    path = settings.resolved_storage_dir / pref_svc.model_path(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    PreferenceModel(FitConfig(width=8, ensemble=1)).save(path)
    with session_scope() as s:
        pref_svc.record_model(s, version=1, path=pref_svc.model_path(1), report={})
    weights = {"count": 1, "preference": 1}
    assert _post(client, admin, "train", {"reward_weights": weights}, "tiny").status_code == 201
    path.unlink()
    for spec in ("", "latest", "v1"):
        r = _post(client, admin, "train", {"reward_weights": weights,
                                           "preference_model": spec}, "tiny")
        assert r.status_code == 422 and _fields(r) == ["preference_model"], (spec, r.text)
        assert "preference model v1's file is gone" in r.text and "does not exist" in r.text

def test_a_split_without_prompts_is_422(client, admin):
    up = client.post("/api/datasets", files={"file": ("p.txt", b"one red circle\ntwo red circles\n",
                                                "text/plain")},
                     headers=admin).json()
    ds = up["dataset"]["id"] if "dataset" in up else up["id"]
    r = _post(client, admin, "rollout", {"dataset_id": ds, "split": "eval"})
    assert r.status_code == 422 and _fields(r) == ["split"] and "no 'eval' prompts" in r.text
    assert _post(client, admin, "rollout", {"dataset_id": ds}).status_code == 201
    assert _post(client, admin, "rollout", {"dataset_id": ds, "split": "all"}).status_code == 201
    # a split that is no split: one error, not a second one about its prompts
    r = _post(client, admin, "rollout", {"dataset_id": ds, "split": "x"})
    assert r.status_code == 422 and _fields(r) == ["split"] and "'train', 'eval' or 'all'" in r.text


def test_a_job_whose_dataset_was_deleted_does_not_resume(client, admin):
    up = client.post("/api/datasets", files={"file": ("p.txt", b"one red circle\ntwo red circles\n",
                                                "text/plain")},
                     headers=admin).json()
    ds = up["dataset"]["id"] if "dataset" in up else up["id"]
    job = _post(client, admin, "rollout", {"dataset_id": ds}).json()["id"]
    # an active job holds its dataset; once cancelled, the dataset may go
    assert client.delete(f"/api/datasets/{ds}", headers=admin).status_code == 409
    assert client.post(f"/api/jobs/{job}/cancel", headers=admin).status_code == 200
    assert client.delete(f"/api/datasets/{ds}", headers=admin).status_code == 204
    r = client.post(f"/api/jobs/{job}/resume", headers=admin)
    assert r.status_code == 409, r.text
    assert f"dataset {ds} was deleted" in r.text and _fields(r) == ["dataset_id"]
    assert r.json()["field"] == "dataset_id"  # the documented shape: field, detail, errors
    assert client.get(f"/api/jobs/{job}", headers=admin).json()["status"] == "cancelled"


def _cancelled_train_job_on_a_dataset(client, admin) -> tuple[int, int]:
    """(dataset id, job id): a train job on an uploaded dataset, cancelled while queued."""
    ds = _upload(client, admin, "reds", "one red circle\ntwo red squares\n")
    job = client.post("/api/jobs", json={"kind": "train", "preset": "tiny", "dataset_id": ds,
                                         "config": {}}, headers=admin).json()["id"]
    assert client.post(f"/api/jobs/{job}/cancel", headers=admin).status_code == 200
    return ds, job


def test_a_train_job_whose_dataset_was_deleted_does_not_resume_on_other_prompts(client, admin):
    """A train job's dataset is not in its config (the worker reads the prompts when it
    starts), and deleting the dataset sets the job's dataset_id null: without the dataset kept
    as submitted, the resume ran on the built-in shapes prompts as if it had had none."""
    ds, job = _cancelled_train_job_on_a_dataset(client, admin)
    assert client.delete(f"/api/datasets/{ds}", headers=admin).status_code == 204
    # the next upload does not get the deleted (newest) dataset's id: on SQLite it did, and
    # the job then resumed on the new dataset's prompts
    assert _upload(client, admin, "blues", "one blue circle\n") != ds
    r = client.post(f"/api/jobs/{job}/resume", headers=admin)
    assert r.status_code == 409, r.text
    assert f"dataset {ds} was deleted" in r.text and _fields(r) == ["dataset_id"]
    assert client.get(f"/api/jobs/{job}", headers=admin).json()["status"] == "cancelled"


def test_a_train_job_resumes_only_while_its_dataset_still_has_train_prompts(client, admin,
                                                                          session):
    """Resuming re-checks the train job's dataset as submission did."""
    from app.models import Prompt

    ds, job = _cancelled_train_job_on_a_dataset(client, admin)
    for prompt in session.scalars(select(Prompt).where(Prompt.dataset_id == ds)):
        prompt.split = "eval"
    session.commit()
    r = client.post(f"/api/jobs/{job}/resume", headers=admin)
    assert r.status_code == 409 and "no 'train' prompts" in r.text, r.text


def test_clip_path_is_checked_whenever_given(client, admin, vote_seeder):
    vote_seeder(4)  # a fit_preference job is accepted only with votes to fit
    r = _post(client, admin, "fit_preference", {"features": "shapes", "clip_path": "/etc"})
    assert r.status_code == 422 and _fields(r) == ["clip_path"]


def test_long_and_blank_prompts_are_422_with_the_upload_limit(client, admin, settings):
    limit = settings.max_prompt_length
    r = _post(client, admin, "train", {"prompts": ["x" * 100_000, "ok"]}, "tiny")
    assert r.status_code == 422 and set(_fields(r)) == {"prompts"}
    assert str(limit) in r.text and "prompt 1 has" in r.text  # numbered from 1, as uploads
    at_limit = "one" + " " * (limit - len("one") - len("red circle")) + "red circle"
    r = _post(client, admin, "train", {"prompts": [at_limit]}, "tiny")
    assert r.status_code == 201, r.text
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [1, 2], "prompts": ["y" * (limit + 1)]})
    assert "prompts" in _fields(r)


def test_a_config_lists_at_most_max_config_prompts(client, admin, session):
    """400,000 prompts in a train config were taken (6.8 MB stored on the job, returned in
    every job listing)."""
    from app.limits import MAX_CONFIG_PROMPTS

    before = _job_count(session)
    many = ["one red circle"] * (MAX_CONFIG_PROMPTS + 1)
    r = _post(client, admin, "train", {"prompts": many}, "tiny")
    # (the list repeats one prompt, which is named too: every problem at once)
    assert r.status_code == 422 and set(_fields(r)) == {"prompts"} and "upload" in r.text
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [1], "prompts": many})
    assert r.status_code == 422 and "prompts" in _fields(r)
    assert _job_count(session) == before


def test_a_checkpoint_whose_files_are_gone_is_named_at_submission_resume_and_download(
        client, admin, session, enqueuer):
    """A checkpoint directory moved aside: an evaluate or rollout job on it was accepted and
    failed in the worker with "NotFound: no such file" and a traceback; a train job resuming
    from it the same; its download said "no such file". Each now names the checkpoint, its
    path and what to do, and a worker that finds the files gone says so in one line."""
    import shutil

    from app.models import Checkpoint, Job
    from app.services import checkpoints, storage
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE
    from worker.lease import JobError
    from worker.sampling import sampling_spec

    directory = storage.storage_root() / "checkpoints" / "job-1" / "iter-000002"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(SHAPES_BASE.read_bytes())
    train = _post(client, admin, "train", {"device": "cpu"}, "tiny").json()["id"]
    ckpt = session.get(Checkpoint, record_checkpoint(
        session, train, 2, "checkpoints/job-1/iter-000002/model.safetensors"))
    session.get(Job, train).status = "cancelled"
    session.commit()
    assert _post(client, admin, "evaluate", {"checkpoint_ids": [ckpt.id]}).status_code == 201
    shutil.move(directory, directory.with_name("aside"))

    gone = (f"checkpoint {ckpt.id} ({ckpt.name}) has lost its files: "
            "checkpoints/job-1/iter-000002/model.safetensors is not in the storage directory "
            "(moved or deleted); put it back, or use another checkpoint")
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [ckpt.id]})
    assert r.status_code == 422 and _errors(r) == {"checkpoint_ids": gone}, r.text
    r = _post(client, admin, "rollout", {"checkpoint_id": ckpt.id})
    assert r.status_code == 422 and _errors(r)["checkpoint_id"] == gone, r.text
    r = client.post(f"/api/jobs/{train}/resume", headers=admin)
    assert r.status_code == 409 and r.json()["field"] == "checkpoint_id", r.text
    assert r.json()["errors"] == [{"field": "checkpoint_id", "message": gone}]
    for suffix in ("", "?format=zip"):
        r = client.get(f"/api/checkpoints/{ckpt.id}/download{suffix}", headers=admin)
        assert r.status_code == 404 and r.json()["detail"] == gone, r.text
    # what a worker meets when the files go after the check
    from app.job_kinds import RolloutConfig

    with pytest.raises(JobError, match="has lost its files"):
        sampling_spec(RolloutConfig(dataset_id=1, checkpoint_id=ckpt.id), ckpt.id)
    shutil.move(directory.with_name("aside"), directory)
    assert checkpoints.files_problem(ckpt) is None
    assert client.post(f"/api/jobs/{train}/resume", headers=admin).status_code == 200


def test_evaluate_needs_distinct_existing_checkpoints(client, admin, session):
    """One checkpoint may be evaluated alone (its reward scores; issue 17), two or more also
    give cross-checkpoint pairs; none, a repeat or a missing one is refused."""
    from app.services import storage
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE

    (storage.storage_root() / "ck").mkdir(parents=True)
    for i in range(2):
        (storage.storage_root() / f"ck/{i}.safetensors").write_bytes(SHAPES_BASE.read_bytes())
    ck = [record_checkpoint(session, None, 0, f"ck/{i}.safetensors", name=f"c{i}")
          for i in range(2)]
    session.commit()
    r = _post(client, admin, "evaluate", {"checkpoint_ids": []})
    assert r.status_code == 422 and _fields(r) == ["checkpoint_ids"] and "at least 1" in r.text
    assert _post(client, admin, "evaluate", {"checkpoint_ids": [ck[0]]}).status_code == 201
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [ck[0], ck[0]]})
    assert r.status_code == 422 and "repeat" in r.text
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [ck[0], 999]})
    assert r.status_code == 422 and "[999] not found" in r.text
    # beside a malformed id, the well-formed ones are still looked up: every problem at once
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [ck[0], 999, -3]})
    assert r.status_code == 422 and "[999] not found" in r.text and "greater than or equal to 1" \
        in r.text, r.text
    assert _post(client, admin, "evaluate", {"checkpoint_ids": ck}).status_code == 201
    r = _post(client, admin, "evaluate", {"checkpoint_ids": ck, "reward_names": ["count", "count"]})
    assert r.status_code == 422 and "must not repeat a reward: ['count']" in r.text
    # a repeated seed or prompt is the same image again, counted twice in the stored means
    r = _post(client, admin, "evaluate", {"checkpoint_ids": ck, "seeds": [0, 1, 0],
                                          "prompts": ["one red circle", "one red circle"]})
    assert r.status_code == 422 and _errors(r) == {
        "seeds": "must not repeat a seed: [0]",
        "prompts": "must not repeat a prompt: 'one red circle' (prompts 1 and 2)"}, r.text


def test_cuda_is_checked_against_what_live_workers_report(client, admin, session):
    # no worker has reported yet: accepted, and the job says what it waits for
    r = _post(client, admin, "train", {"device": "cuda"}, "tiny")
    assert r.status_code == 201, r.text
    waiting = r.json()["waiting_for"]
    assert "CUDA" in waiting and "'gpu'" in waiting
    job_id = r.json()["id"]
    # a CPU-only worker serves the gpu queue: a cuda config is refused, naming the worker
    _report_worker("cpu-box", ["gpu", "cpu"], cuda=0)
    r = _post(client, admin, "train", {"device": "cuda"}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["device"] and "cpu-box" in r.text
    assert _post(client, admin, "train", {"device": "auto"}, "tiny").status_code == 201
    page = client.get(f"/api/jobs/{job_id}", headers=admin).json()
    assert "CUDA" in page["waiting_for"]  # the earlier job still waits for a GPU worker
    # a GPU worker reports in: accepted, and nothing waits
    _report_worker("gpu-box", ["gpu"], cuda=2)
    r = _post(client, admin, "train", {"device": "cuda"}, "tiny")
    assert r.status_code == 201 and r.json()["waiting_for"] is None
    assert client.get(f"/api/jobs/{job_id}", headers=admin).json()["waiting_for"] is None
    listed = client.get("/api/jobs", headers=admin).json()["items"]
    assert all(j["waiting_for"] is None for j in listed)


def test_a_queue_without_a_live_worker_is_waited_for(client, admin, settings, vote_seeder):
    from datetime import timedelta

    from app.db import session_scope
    from app.models import WorkerRow, utcnow

    vote_seeder(4)  # a fit_preference job is accepted only with votes to fit
    _report_worker("old-gpu", ["gpu"], cuda=1)
    with session_scope() as s:  # it stopped reporting long ago
        s.get(WorkerRow, "old-gpu").last_seen_at = utcnow() - timedelta(hours=1)
    r = _post(client, admin, "train", {}, "tiny")
    assert r.status_code == 201 and "waiting for a worker on queue 'gpu'" in r.json()["waiting_for"]
    r = _post(client, admin, "fit_preference", {"device": "cuda"})
    assert r.status_code == 201 and "'cpu'" in r.json()["waiting_for"]


def test_a_running_job_whose_worker_stopped_heartbeating_says_so(client, admin, session,
                                                                  settings):
    """kill -9 of the only worker: until a worker's reaper requeues the job, its page says
    the worker is lost, and that none is live to requeue it."""
    from datetime import timedelta

    from app.models import Job, utcnow

    r = _post(client, admin, "train", {}, "tiny")
    job = session.get(Job, r.json()["id"])
    job.status, job.worker = "running", "gone-gpu"
    job.heartbeat_at = utcnow() - timedelta(seconds=settings.job_stale_seconds / 2)
    session.commit()
    assert client.get(f"/api/jobs/{job.id}", headers=admin).json()["waiting_for"] is None
    job.heartbeat_at = utcnow() - timedelta(seconds=settings.job_stale_seconds + 30)
    session.commit()
    waiting = client.get(f"/api/jobs/{job.id}", headers=admin).json()["waiting_for"]
    assert "its worker gone-gpu has not heartbeated for" in waiting, waiting
    assert "no worker is live now: start one" in waiting
    _report_worker("fresh-gpu", ["gpu"], cuda=1)
    waiting = client.get("/api/jobs", headers=admin).json()["items"][0]["waiting_for"]
    assert "reaper requeues the job" in waiting and "start one" not in waiting


def test_a_job_for_more_hosts_than_live_workers_says_it_waits_for_them(client, admin, session):
    """One worker cannot start a train_nnodes=2 job (its rendezvous waits for another host):
    the job is accepted, since a host may come later, but its page says so, while queued and
    while its holder waits."""
    from app.models import Job

    _report_worker("host-a", ["gpu"], cuda=1)
    r = _post(client, admin, "train", {"train_nnodes": 2, "prompts_per_iteration": 4}, "tiny")
    assert r.status_code == 201, r.text
    assert r.json()["waiting_for"] == ("waiting for 2 hosts (train_nnodes): 1 live worker(s) on "
                                       "queue 'gpu'; start one on each other host")
    job = session.get(Job, r.json()["id"])
    job.status, job.worker = "running", "host-a"
    session.commit()
    assert "waiting for 2 hosts" in client.get(f"/api/jobs/{job.id}", headers=admin).json()[
        "waiting_for"]
    _report_worker("host-b", ["gpu"], cuda=1)
    assert client.get(f"/api/jobs/{job.id}", headers=admin).json()["waiting_for"] is None
    single = _post(client, admin, "train", {}, "tiny").json()
    assert single["waiting_for"] is None


def test_a_resumed_multi_host_job_waiting_in_its_rendezvous_says_so(client, admin, session,
                                                                    settings):
    """A train_nnodes=2 job requeued at iteration 3 (a host's warm shutdown) and claimed again
    by its holder waits in a fresh rendezvous for the other host: its page says so, as on a
    fresh start (it said nothing once the job had iterations), until this run records one."""
    from datetime import timedelta

    from app.services import jobs, workers

    def waiting_for() -> str | None:
        return client.get(f"/api/jobs/{job_id}", headers=admin).json()["waiting_for"]

    stale = timedelta(seconds=settings.job_stale_seconds)
    wait = "waiting for 2 hosts (train_nnodes): 1 live worker(s) on queue 'gpu'; start one "\
           "on each other host"
    _report_worker("host-a", ["gpu"], cuda=1)
    job_id = _post(client, admin, "train", {"train_nnodes": 2, "prompts_per_iteration": 4},
                   "tiny").json()["id"]
    assert jobs.claim(session, job_id, workers.lease_name("host-a"), stale)
    session.commit()
    assert waiting_for() == wait  # a fresh start's rendezvous
    for it in (1, 2, 3):  # every host joined (host-b's worker has stopped reporting since)
        jobs.update_progress(session, job_id, it, 10, {"reward_mean": 0.5})
    session.commit()
    assert waiting_for() is None  # past its rendezvous: it trains
    jobs.requeue(session, job_id, reason="worker host-b shut down at iteration 3")
    session.commit()
    assert waiting_for() == wait
    assert jobs.claim(session, job_id, workers.lease_name("host-a"), stale)
    session.commit()
    assert client.get(f"/api/jobs/{job_id}", headers=admin).json()["iteration"] == 3
    assert waiting_for() == wait  # the resume's rendezvous
    jobs.update_progress(session, job_id, 4, 10, {"reward_mean": 0.5})
    session.commit()
    assert waiting_for() is None


def test_a_job_only_busy_workers_could_take_says_what_it_waits_behind(client, admin, session,
                                                                     vote_seeder):
    """The demo's one embedded worker runs a train job: a fit queued after it waits behind it,
    and its page says so (it said nothing and looked stuck); a free worker ends the wait.
    (tests/worker/test_worker_waiting.py: the same with a real worker's names.)"""
    from datetime import timedelta

    from app.services import jobs, workers

    vote_seeder(4)
    _report_worker("solo", ["gpu", "cpu"], cuda=0)
    train = _post(client, admin, "train", {}, "tiny").json()
    # the job names its worker as worker.lease does: node name, pid, nonce
    assert jobs.claim(session, train["id"], workers.lease_name("solo"), timedelta(seconds=60))
    session.commit()
    fit = _post(client, admin, "fit_preference", {}).json()
    assert fit["waiting_for"] == (f"queued behind job #{train['id']}: every live worker on "
                                  "queue 'cpu' is running one; it starts when one is free (or "
                                  "start another worker)")
    assert client.get(f"/api/jobs/{train['id']}", headers=admin).json()["waiting_for"] is None
    _report_worker("spare", ["cpu"], cuda=0)
    assert client.get(f"/api/jobs/{fit['id']}", headers=admin).json()["waiting_for"] is None


def test_worker_reports_its_real_devices_and_queues(settings):
    import torch

    from app.db import session_scope
    from app.models import WorkerRow
    from worker.tasks import report_worker

    report_worker("celery@here", ["cpu"])
    with session_scope() as s:
        row = s.get(WorkerRow, "celery@here")
        assert row.queues == ["cpu"] and row.cuda_devices == torch.cuda.device_count()


def test_preference_reward_needs_a_fitted_model_or_an_allowed_path(client, admin, settings):
    weights = {"count": 1, "preference": 1}
    r = _post(client, admin, "train", {"reward_weights": weights}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["preference_model"]
    assert "fit_preference" in r.text
    r = _post(client, admin, "train", {"reward_weights": weights, "preference_model": "v7"}, "tiny")
    assert r.status_code == 422 and "v7" in r.text
    r = _post(client, admin, "train", {"reward_weights": weights,
                                       "preference_model": "/etc/passwd"}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["preference_model"]
    # without a preference weight the worker never reads the model: it was stored unchecked
    for spec in ("/etc/passwd", "v999", "latest"):
        r = _post(client, admin, "train", {"preference_model": spec}, "tiny")
        assert r.status_code == 422 and _fields(r) == ["preference_model"], (spec, r.text)
        assert "no 'preference' weight" in r.text
    assert "not a file under STORAGE_DIR" in _post(client, admin, "train",
                                                  {"preference_model": "/etc/passwd"},
                              "tiny").text
    # nor would it refit one: preference_refit_every ran the job with no refit, without a word
    r = _post(client, admin, "train", {"preference_refit_every": 1}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["preference_refit_every"], r.text
    assert "no 'preference' weight" in r.text
    r = _post(client, admin, "train", {"preference_refit_every": 0}, "tiny")
    assert r.status_code == 201, r.text


def test_reward_weights_that_are_all_zero_are_422(client, admin):
    """Every advantage would be 0: the job ran to the end and changed nothing."""
    r = _post(client, admin, "train", {"reward_weights": {"count": 0}}, "tiny")
    assert r.status_code == 422 and _fields(r) == ["reward_weights"] and "non-zero" in r.text
    # a zero weight beside a non-zero one is allowed (a reward can sit at 0 in a blend)
    assert _post(client, admin, "train", {"reward_weights": {"count": 1, "color": 0}},
                 "tiny").status_code == 201


def test_a_request_dataset_a_kind_cannot_use_or_that_contradicts_its_config_is_422(
        client, admin, session, vote_seeder):
    """Both were accepted silently: the config's dataset was sampled, and a fit job recorded
    a dataset it never reads (which then could not be deleted while the job ran)."""
    vote_seeder(4)  # a fit_preference job is accepted only with votes to fit
    one = _upload(client, admin, "one", "one red circle\n")
    two = _upload(client, admin, "two", "two red circles\n")
    before = _job_count(session)
    r = client.post("/api/jobs", json={"kind": "rollout", "config": {"dataset_id": one},
                                       "dataset_id": two}, headers=admin)
    assert r.status_code == 422 and _fields(r) == ["dataset_id"] and "give the dataset once" in \
        r.text, r.text
    r = client.post("/api/jobs", json={"kind": "fit_preference", "config": {},
                                       "dataset_id": one}, headers=admin)
    assert r.status_code == 422 and _fields(r) == ["dataset_id"] and "take no dataset" in r.text
    assert _job_count(session) == before
    r = client.post("/api/jobs", json={"kind": "rollout", "config": {"dataset_id": one},
                                       "dataset_id": one}, headers=admin)
    assert r.status_code == 201, r.text
    r = client.post("/api/jobs", json={"kind": "rollout", "config": {}, "dataset_id": two},
                    headers=admin)
    assert r.status_code == 201 and r.json()["config"]["dataset_id"] == two
    # an id is a JSON integer: true, "1" and 1.0 were taken as dataset 1
    before = _job_count(session)
    for given in (True, str(one), float(one)):
        r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny",
                                           "dataset_id": given}, headers=admin)
        assert r.status_code == 422 and _fields(r) == ["dataset_id"], (given, r.text)
    assert _job_count(session) == before


def test_clip_path_must_be_a_complete_clip_directory_under_models_dir(client, admin, settings,
                                                                     tiny_clip_path, vote_seeder):
    vote_seeder(4)  # a fit_preference job is accepted only with votes to fit
    import shutil

    r = _post(client, admin, "fit_preference", {"features": "clip", "clip_path": "/etc"})
    assert r.status_code == 422 and _fields(r) == ["clip_path"]
    # a directory without CLIP's files: the worker failed on it with transformers' traceback
    (settings.resolved_models_dir / "clip").mkdir(parents=True)
    r = _post(client, admin, "fit_preference", {"features": "clip", "clip_path": "clip"})
    assert r.status_code == 422 and _fields(r) == ["clip_path"], r.text
    for name in ("config.json", "model.safetensors", "processor_config.json", "tokenizer.json"):
        assert name in r.text
    shutil.copytree(tiny_clip_path, settings.resolved_models_dir / "clip", dirs_exist_ok=True)
    (settings.resolved_models_dir / "clip" / "model.safetensors").unlink()
    r = _post(client, admin, "fit_preference", {"features": "clip", "clip_path": "clip"})
    assert r.status_code == 422 and "missing model.safetensors" in r.text, r.text
    shutil.copy(tiny_clip_path / "model.safetensors", settings.resolved_models_dir / "clip")
    r = _post(client, admin, "fit_preference", {"features": "clip", "clip_path": "clip"})
    assert r.status_code == 201, r.text


def test_trainer_cli_config_reports_every_bad_field():
    from trainer.config import ConfigErrors, TrainConfig

    with pytest.raises(ConfigErrors) as err:
        TrainConfig.from_dict({"group_size": 1, "sigma": 2.0, "typo": 1,
                               "reward_weights": {"beauty": 1}})
    assert [e.field for e in err.value.errors] == ["typo", "group_size", "sigma",
                                                   "reward_weights"]
    assert "typo: unknown field" in str(err.value) and "'beauty'" in str(err.value)


def test_a_misspelt_field_is_named_with_the_field_meant(client, admin):
    """Every kind says "unknown field" for a typo and names the nearest field; a name near
    none gets no guess."""
    cases = [("train", {"learnin_rate": 1e-5}, "learning_rate"),
             ("rollout", {"dataset_id": 1, "grop_size": 4}, "group_size"),
             ("fit_preference", {"epoch": 3}, "epochs")]
    for kind, config, meant in cases:
        r = _post(client, admin, kind, config)
        assert r.status_code == 422, r.text
        (typo,) = set(config) - {"dataset_id"}
        errors = {e["field"]: e["message"] for e in r.json()["errors"]}
        assert errors[typo] == f"unknown field (did you mean {meant!r}?)", errors
    r = _post(client, admin, "train", {"zzz": 1})
    assert r.json()["errors"] == [{"field": "zzz", "message": "unknown field"}]


def test_a_cuda_job_that_no_worker_can_run_waits_queued_not_failed(settings, session,
                                                                   monkeypatch):
    """A cuda job accepted before any worker reported (its page says it waits for a GPU
    worker): a CPU worker that receives it offers it again later, the job untouched and
    still queued, its page still saying what it waits for, rather than failing it."""
    import torch

    import worker.tasks
    from app.models import Job
    from app.services import jobs, workers
    from worker.tasks import WAIT_FOR_DEVICE_SECONDS, run_job

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the job would run")
    job = jobs.create_job(session, "train", {"device": "cuda"}, preset="tiny")
    session.commit()
    workers.report(session, "cpu-box", ["gpu", "cpu"], 0, [])  # started after the job
    session.commit()
    sent, ran = [], []
    monkeypatch.setattr(worker.tasks, "enqueue", lambda *a, **kw: sent.append((a, kw)))
    for _ in range(2):
        assert run_job(job.id, lambda jid, name: ran.append(jid) or "succeeded") == "passed on"
    assert sent == [((job.id, "train"), {"countdown": WAIT_FOR_DEVICE_SECONDS})] * 2
    session.expire_all()
    row = session.get(Job, job.id)
    assert ran == [] and row.status == "queued" and row.worker is None
    assert row.attempts == 0 and not row.error
    assert "waiting for a worker with a CUDA device" in workers.waiting_for(session, [row])[job.id]


def test_a_cuda_job_is_passed_on_to_a_gpu_worker_of_its_queue_not_failed(settings, session,
                                                                         monkeypatch):
    """CPU and GPU workers sharing the `gpu` queue (the demo's worker beside a GPU box): the
    CPU worker that receives a cuda job sends it back to the queue for the GPU worker at once,
    leaving the job untouched; with no able worker left it waits for one, as above."""
    import torch

    import worker.tasks
    from app.models import Job
    from app.services import jobs, workers
    from worker.tasks import PASS_ON_SECONDS, WAIT_FOR_DEVICE_SECONDS, run_job

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the job would run")
    workers.report(session, "cpu-box", ["gpu", "cpu"], 0, [])
    workers.report(session, "gpu-box", ["gpu"], 1, ["NVIDIA H200"])
    job = jobs.create_job(session, "train", {"device": "cuda"}, preset="tiny")
    session.commit()
    sent = []
    monkeypatch.setattr(worker.tasks, "enqueue", lambda *a, **kw: sent.append((a, kw)))
    ran = []
    assert run_job(job.id, lambda jid, name: ran.append(jid) or "succeeded") == "passed on"
    assert sent == [((job.id, "train"), {"countdown": PASS_ON_SECONDS})] and ran == []
    session.expire_all()
    row = session.get(Job, job.id)
    assert row.status == "queued" and row.worker is None and row.attempts == 0 and not row.error
    session.delete(session.get(workers.WorkerRow, "gpu-box"))  # the GPU box went away
    session.commit()
    assert run_job(job.id, lambda jid, name: ran.append(jid) or "succeeded") == "passed on"
    assert sent[1] == ((job.id, "train"), {"countdown": WAIT_FOR_DEVICE_SECONDS}) and ran == []
    session.expire_all()
    assert session.get(Job, job.id).status == "queued"


def test_a_task_says_what_it_did_with_a_message_it_does_not_run(settings, session, monkeypatch):
    """The task's result (Celery's, and the log's) for a message it does not run: a finished
    job's is skipped, and a leaving worker hands the message back untouched; a job it runs
    returns the body's status."""
    import worker.tasks
    from app.models import Job
    from app.services import jobs
    from worker.lease import TaskOutcome
    from worker.tasks import SHUTDOWN, run_job

    job = jobs.create_job(session, "train", {}, preset="tiny")
    session.commit()
    sent, ran = [], []
    monkeypatch.setattr(worker.tasks, "enqueue", lambda *a, **kw: sent.append((a, kw)))
    body = lambda jid, name: ran.append(jid) or "succeeded"  # noqa: E731
    SHUTDOWN.set()
    try:
        assert run_job(job.id, body) == TaskOutcome.DEFERRED == "deferred"
    finally:
        SHUTDOWN.clear()
    assert sent == [((job.id, "train"), {})] and ran == []
    assert run_job(job.id, body) == "succeeded" and ran == [job.id]
    session.expire_all()
    row = session.get(Job, job.id)
    row.status = "succeeded"
    session.commit()
    assert run_job(job.id, body) == TaskOutcome.SKIPPED == "skipped" and ran == [job.id]


def test_train_nnodes_is_at_least_one_and_divides_the_prompts(client, admin, session, enqueuer):
    # several hosts (README "Workers"): each trains an equal share of every iteration's prompts
    for nnodes, prompts in ((0, 4), (3, 4), (1.5, 3)):
        r = _post(client, admin, "train", {"train_nnodes": nnodes,
                                           "prompts_per_iteration": prompts}, "tiny")
        assert r.status_code == 422, r.text
        assert _fields(r) == ["train_nnodes"], r.text
    assert "multiple of train_nnodes (3)" in _post(
        client, admin, "train", {"train_nnodes": 3, "prompts_per_iteration": 4}).text
    assert _job_count(session) == 0 and enqueuer.calls == []
    r = _post(client, admin, "train", {"train_nnodes": 2, "prompts_per_iteration": 4}, "tiny")
    assert r.status_code in (200, 201), r.text
    assert r.json()["config"]["train_nnodes"] == 2 and len(enqueuer.calls) == 1


def _upload(client, admin, name: str, text: str, **form) -> int:
    r = client.post("/api/datasets", files={"file": (f"{name}.txt", text.encode(), "text/plain")},
                    data={"name": name, **form}, headers=admin)
    assert r.status_code == 201, r.text
    body = r.json()
    return body["dataset"]["id"] if "dataset" in body else body["id"]


def test_a_train_job_trains_on_its_dataset(client, admin):
    """The dataset picked for a train job gives its prompts (the train split): the trainer
    the worker builds samples only those."""
    from app.db import session_scope
    from app.models import Job
    from trainer.loop import Trainer
    from worker.training import train_config_of

    ds = _upload(client, admin, "reds", "one red circle\ntwo red squares\nthree red triangles\n")
    r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny", "dataset_id": ds,
                                       "config": {"device": "cpu"}}, headers=admin)
    assert r.status_code == 201, r.text
    with session_scope() as s:
        config = train_config_of(s, s.get(Job, r.json()["id"]))
    assert config.prompts == ["one red circle", "two red squares", "three red triangles"]
    trainer = Trainer(config)
    drawn = {p for _ in range(10) for p in trainer.sample_prompts()}
    assert drawn <= set(config.prompts) and len(drawn) > 1


def test_a_train_dataset_is_checked_at_submission(client, admin):
    """Every problem with a train job's dataset is a 422 naming dataset_id: prompts given
    twice, no train split, prompts the shapes model cannot draw."""
    words = _upload(client, admin, "words", "a cat\na dog\none red circle\n")
    reds = _upload(client, admin, "reds", "one red circle\n")
    evals = _upload(client, admin, "evals", "one red circle\n", eval_fraction="0.99")
    cases = [(words, {}, "2 of 3 are not: 'a cat', 'a dog'"),
             (reds, {"prompts": ["two red squares"]}, "both give training prompts"),
             (evals, {}, "no 'train' prompts")]
    for ds, config, message in cases:
        r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny", "dataset_id": ds,
                                           "config": config}, headers=admin)
        assert r.status_code == 422, r.text
        assert _fields(r) == ["dataset_id"] and message in r.text, r.text
    # the config's own prompts are held to the same rule, beside every other problem
    r = _post(client, admin, "train", {"prompts": ["a cat"], "group_size": 1}, "tiny")
    assert r.status_code == 422 and sorted(_fields(r)) == ["group_size", "prompts"]
    # a rollout of the shapes base model over prompts it cannot draw fails here, not later
    r = _post(client, admin, "rollout", {"dataset_id": words, "split": "all"})
    assert r.status_code == 422 and _fields(r) == ["dataset_id"] and "'a cat'" in r.text


def test_the_requests_dataset_is_the_one_a_sampling_job_samples(client, admin):
    """`dataset_id` beside the config is the job's dataset for every kind: a rollout or
    evaluate job whose config names none samples it (the worker reads the config)."""
    ds = _upload(client, admin, "reds", "one red circle\ntwo red squares\n")
    r = client.post("/api/jobs", json={"kind": "rollout", "dataset_id": ds, "config": {}},
                    headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["config"]["dataset_id"] == ds == r.json()["dataset_id"]
    other = _upload(client, admin, "blues", "one blue circle\n")
    r = client.post("/api/jobs", json={"kind": "rollout", "dataset_id": other,
                                       "config": {"dataset_id": ds}}, headers=admin)
    assert r.status_code == 422 and _fields(r) == ["dataset_id"]  # two datasets: which one?


def test_the_preference_preset_asks_for_votes_first_then_trains_on_them(client, admin, settings):
    """`shapes-preference` (the measured human-in-the-loop setting) names the preference
    reward: without a fitted model it is a 422 pointing at fit_preference; with one it is
    accepted with the preset's blend, refit interval and KL penalty."""
    from trainer.rewards.preference import FitConfig, PreferenceModel

    r = _post(client, admin, "train", {}, "shapes-preference")
    assert r.status_code == 422 and _fields(r) == ["preference_model"]
    assert "fit_preference" in r.text
    models = settings.resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    PreferenceModel(FitConfig(width=8, ensemble=1)).save(models / "pref.safetensors")
    r = _post(client, admin, "train", {"preference_model": "pref.safetensors"},
              "shapes-preference")
    assert r.status_code == 201, r.text
    config = r.json()["config"]
    assert config["reward_weights"] == {"count": 1.5, "preference": 1.0}
    assert (config["preference_refit_every"], config["kl_coefficient"]) == (50, 0.1)


def test_sampling_configs_take_numbers_as_train_configs_do(client, admin, session):
    """`true`, "1" and 1.0 were converted to ids and seeds (dataset 1, seed 1) where a train
    config refuses them: one rule for every kind."""
    ds = _upload(client, admin, "strict", "one red circle\n")
    before = _job_count(session)
    for config in ({"dataset_id": True}, {"dataset_id": str(ds)}, {"dataset_id": float(ds)},
                   {"dataset_id": ds, "seed": True}, {"dataset_id": ds, "group_size": "4"}):
        r = _post(client, admin, "rollout", config)
        assert r.status_code == 422, (config, r.text)
        assert _fields(r) == [next(k for k, v in config.items() if type(v) is not int)]
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [True, 2]})
    assert r.status_code == 422 and "checkpoint_ids" in _fields(r)
    assert _job_count(session) == before
    # floats take whole numbers, as JSON writes them
    assert _post(client, admin, "rollout", {"dataset_id": ds, "sigma": 1}).status_code == 201


@pytest.mark.parametrize("config", [[1, 2], "tiny"])  # (null is a config left out)
def test_a_config_that_is_not_an_object_is_reported_with_the_bad_preset(client, admin, session,
                                                                         config):
    """The envelope's problem (config not an object) does not hide the request's other one."""
    r = client.post("/api/jobs", json={"kind": "train", "config": config, "preset": "nope"},
                    headers=admin)
    assert r.status_code == 422, r.text
    fields = _fields(r)
    assert "config" in fields and "preset" in fields, r.json()
    assert "unknown preset 'nope'" in r.text
    assert _job_count(session) == 0


def test_a_refused_request_dataset_id_is_named_once(client, admin, session):
    """A rollout's config takes the request's dataset_id when it names none; with the
    request's refused ("2", a string), the config's own check added "dataset_id: Field
    required", the one field named twice, the second time wrongly."""
    r = client.post("/api/jobs", json={"kind": "rollout", "dataset_id": "2"}, headers=admin)
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [{"field": "dataset_id",
                                   "message": "Input should be a valid integer"}]
    # the config's own dataset_id, when it names one, is still checked beside the request's
    r = client.post("/api/jobs", json={"kind": "rollout", "dataset_id": "2",
                                       "config": {"dataset_id": 999_999}}, headers=admin)
    assert r.status_code == 422 and "dataset 999999 not found" in r.text, r.text
    assert _job_count(session) == 0


def test_a_prompt_with_a_nul_does_not_hide_another_the_shapes_model_cannot_draw(client, admin):
    """Prompt 0's NUL was the only problem reported; prompt 1 (a zero-width space between
    words: no shapes prompt) came out only on the next try. Both come in one 422."""
    r = _post(client, admin, "train", {"prompts": ["one red circle\u0000",
                                                   "one red\u200bcircle"]})
    assert r.status_code == 422, r.text
    messages = [e["message"] for e in r.json()["errors"] if e["field"] == "prompts"]
    assert len(messages) == 2, r.text
    assert messages[0] == "prompt 1: prompt contains NUL (U+0000)", r.text
    assert "draws only shapes prompts" in messages[1], r.text
    # (the zero-width space dropped as the prompts are normalised: what the prompt shows)
    assert "'one redcircle'" in messages[1] and "circle\\x00" not in messages[1], r.text


@pytest.mark.parametrize("kind", ["evaluate", "rollout"])
def test_a_repeated_prompt_does_not_hide_one_the_shapes_model_cannot_draw(client, admin, kind):
    """The repeat was the only problem reported ("a cat" twice): that the shapes model cannot
    draw it came out only on the next try. Both come in one 422."""
    config = {"checkpoint_ids": [1], "seeds": [0], "prompts": ["a cat", "a cat"]}
    if kind == "rollout":  # a rollout takes no prompts: an unknown field, no drawable check
        config = {"dataset_id": 1, "prompts": ["a cat", "a cat"]}
    r = _post(client, admin, kind, config)
    assert r.status_code == 422, r.text
    messages = [e["message"] for e in r.json()["errors"] if e["field"] == "prompts"]
    if kind == "rollout":
        assert len(messages) == 1 and "draws only" not in messages[0], r.text
        return
    assert len(messages) == 2, r.text
    assert messages[0] == "must not repeat a prompt: 'a cat' (prompts 1 and 2)", r.text
    assert "draws only shapes prompts" in messages[1] and "2 of 2" in messages[1], r.text


def test_the_config_s_dataset_id_is_named_apart_from_the_request_s(client, admin, session):
    """Both errors said field "dataset_id": the request's (it differs from the config's) and
    the config's own (not found). The config's is config.dataset_id beside a request's."""
    r = client.post("/api/jobs", json={"kind": "rollout", "dataset_id": 1,
                                       "config": {"dataset_id": 999_999, "checkpoint_id": 1}},
                    headers=admin)
    assert r.status_code == 422, r.text
    fields = [e["field"] for e in r.json()["errors"]]
    assert fields.count("dataset_id") == 1 and "config.dataset_id" in fields, r.text
    assert _errors(r)["config.dataset_id"] == "dataset 999999 not found", r.text
    assert "differs from config.dataset_id" in _errors(r)["dataset_id"], r.text
    # beside a request dataset_id the envelope refused, too
    r = client.post("/api/jobs", json={"kind": "rollout", "dataset_id": "2",
                                       "config": {"dataset_id": 999_999}}, headers=admin)
    assert r.status_code == 422, r.text
    assert _errors(r) == {"dataset_id": "Input should be a valid integer",
                          "config.dataset_id": "dataset 999999 not found"}, r.text
    # no request dataset_id: the config's keeps its bare name (the leaderboard places it so)
    r = _post(client, admin, "rollout", {"dataset_id": 999_999})
    assert _errors(r) == {"dataset_id": "dataset 999999 not found"}, r.text
    # and a train config's unknown "preset" beside a request's unknown preset
    r = _post(client, admin, "train", {"preset": "tiny"}, preset="nope")
    assert [e["field"] for e in r.json()["errors"]] == ["preset", "config.preset"], r.text
    assert _job_count(session) == 0


def test_clip_features_without_a_path_name_both_places_it_may_be(client, admin):
    """The message said MODELS_DIR alone; a path under STORAGE_DIR is taken as well."""
    r = _post(client, admin, "fit_preference", {"features": "clip"})
    assert r.status_code == 422, r.text
    assert _errors(r)["clip_path"].endswith("under STORAGE_DIR or MODELS_DIR"), r.text


def test_fsdp_prompts_are_checked_against_the_train_nproc_live_workers_report(client, admin,
                                                                              session):
    from app.db import session_scope
    from app.services import workers

    fsdp = {"parallelism": "fsdp", "finetune": "full", "prompts_per_iteration": 3}
    # no worker has reported yet: accepted (it waits; a worker may start with any TRAIN_NPROC)
    assert _post(client, admin, "train", fsdp, "tiny").status_code == 201
    with session_scope() as s:
        workers.report(s, "two-gpus", ["gpu"], 2, ["NVIDIA H100"] * 2, train_nproc=2)
        workers.report(s, "cpu-only", ["cpu"], 0, [], train_nproc=1)  # not the train queue
    r = _post(client, admin, "train", fsdp, "tiny")
    assert r.status_code == 422 and _fields(r) == ["prompts_per_iteration"], r.text
    message = _errors(r)["prompts_per_iteration"]
    assert "two-gpus (2)" in message and "cpu-only" not in message and "'ddp'" in message
    # every error at once: a second host doubles the world to 4, which 3 does not fit either
    r = _post(client, admin, "train", {**fsdp, "train_nnodes": 2, "learning_rate": -1}, "tiny")
    assert r.status_code == 422 and set(_fields(r)) >= {"learning_rate", "prompts_per_iteration"}
    # what fits 2 processes is taken, and so is 'ddp' (it uses as many processes as fit)
    assert _post(client, admin, "train", {**fsdp, "prompts_per_iteration": 4},
                 "tiny").status_code == 201
    assert _post(client, admin, "train", {**fsdp, "parallelism": "ddp"}, "tiny").status_code == 201
    # one live worker that fits is enough
    with session_scope() as s:
        workers.report(s, "one-gpu", ["gpu"], 1, ["NVIDIA H100"], train_nproc=1)
    assert _post(client, admin, "train", fsdp, "tiny").status_code == 201
    # the worker process reports its own TRAIN_NPROC
    from worker.tasks import report_worker

    report_worker("reporting", ["gpu"])
    session.expire_all()
    from app.config import get_settings
    from app.models import WorkerRow

    assert session.get(WorkerRow, "reporting").train_nproc == get_settings().train_nproc


def test_a_config_value_nested_hundreds_deep_is_a_422_naming_its_field(client, admin, session,
                                                                       enqueuer):
    # 500 levels parse, then overflowed Python's stack in the train config's copy: a 500
    deep = _nested_list(500)
    before = _job_count(session)
    for kind in ("train", "evaluate"):
        r = _post(client, admin, kind, {"prompts": deep, "learning_rate": -1})
        assert r.status_code == 422, r.text
        assert "prompts" in _fields(r) and "nests more than 16 levels deep" in \
            _errors(r)["prompts"], r.text
    assert "learning_rate" in _fields(r := _post(client, admin, "train",
                                                 {"prompts": deep, "learning_rate": -1})), r.text
    assert _job_count(session) == before
    job_id = _post(client, admin, "train", {"device": "cpu"}, preset="tiny").json()["id"]
    assert client.post(f"/api/jobs/{job_id}/cancel", headers=admin).status_code == 200
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"reward_model_paths": deep, "train_batch_size": -1}})
    assert r.status_code == 422, r.text
    assert set(_fields(r)) == {"config.reward_model_paths", "config.train_batch_size"}, r.text


def _nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_an_unknown_reward_model_key_leaves_the_known_keys_paths_judged(client, admin, enqueuer):
    # the unknown key marked the whole field malformed, and '/etc' went unsaid until it was
    # taken out
    r = _post(client, admin, "train", {"reward_model_paths": {"hpsv2": "/etc", "nope": "x"}})
    assert r.status_code == 422, r.text
    messages = [e["message"] for e in r.json()["errors"] if e["field"] == "reward_model_paths"]
    assert any("'nope' is not a model-backed reward" in m for m in messages), messages
    assert any("'/etc' is not a directory under REWARD_MODELS_DIR" in m for m in messages), \
        messages


def test_resumes_sent_at_once_resume_the_job_once(client, admin, enqueuer, monkeypatch):
    import contextlib
    import threading

    from app.db import session_scope
    from app.errors import Conflict
    from app.services import jobs

    job_id = _post(client, admin, "train", {"device": "cpu"}, preset="tiny").json()["id"]
    assert client.post(f"/api/jobs/{job_id}/cancel", headers=admin).status_code == 200
    # each resume waits after its checks until the other has made its own (they passed them
    # both, then both wrote; when the second is held back, the first's wait times out)
    both_checked = threading.Barrier(2)
    still_valid = jobs.check_still_valid

    def check_then_meet(session, job):
        still_valid(session, job)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_checked.wait(timeout=3)

    monkeypatch.setattr(jobs, "check_still_valid", check_then_meet)
    answers: dict[int, object] = {}

    def resume(size: int) -> None:
        try:  # as the route: a refusal rolls back what its session wrote
            with session_scope() as s:
                job = jobs.relaunch_job(s, enqueuer, job_id, {"train_batch_size": size})
                answers[size] = job.config["train_batch_size"]
        except Conflict as exc:
            answers[size] = exc

    threads = [threading.Thread(target=resume, args=(size,)) for size in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    resumed = [size for size, answer in answers.items() if answer == size]
    refused = [answer for answer in answers.values() if isinstance(answer, Conflict)]
    assert len(resumed) == 1 and len(refused) == 1, answers
    job = client.get(f"/api/jobs/{job_id}", headers=admin).json()
    assert (job["status"], job["config"]["train_batch_size"]) == ("queued", resumed[0])
    assert enqueuer.calls.count((job_id, "train")) == 2  # at submission and the one resume


def test_a_whole_number_written_with_a_decimal_point_is_told_how_to_write_it(client, admin,
                                                                             enqueuer):
    # "must be a whole number, got 5.0" read as a contradiction
    r = _post(client, admin, "train", {"iterations": 5.0, "group_size": 2.5})
    assert r.status_code == 422, r.text
    errors = _errors(r)
    assert errors["iterations"] == "must be a whole number written without a decimal point " \
                                   "(5, not 5.0)", errors
    assert errors["group_size"].startswith("must be a whole number, got 2.5"), errors
    r = _post(client, admin, "evaluate", {"checkpoint_ids": [1, 2], "seeds": [3.0]})
    assert _errors(r)["seeds"] == "0: must be a whole number written without a decimal " \
                                  "point (3, not 3.0)", r.text
