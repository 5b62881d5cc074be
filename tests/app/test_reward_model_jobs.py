"""Issue 17 at submission: a train job naming a model-backed reward (hpsv2, pickscore, ...)
is refused with a 422 while its weights directory is missing or incomplete, naming the reward,
the setting (REWARD_MODELS_DIR or reward_model_paths) and the files expected; the paths in
reward_model_paths must lie under REWARD_MODELS_DIR or MODELS_DIR. The worker hands the trainer
every directory resolved from the studio's settings."""

from __future__ import annotations

import shutil

import pytest

TRAIN = {"reward_weights": {"pickscore": 1.0, "count": 1.0}, "device": "cpu"}


def _post(client, headers, config):
    return client.post("/api/jobs", json={"kind": "train", "config": config, "preset": "tiny"},
                       headers=headers)


def _errors(response) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in response.json()["errors"]:
        out[e["field"]] = f"{out.get(e['field'], '')} {e['message']}".strip()
    return out


@pytest.fixture
def reward_root(settings):
    root = settings.resolved_reward_models_dir
    root.mkdir(parents=True, exist_ok=True)
    return root


def test_missing_reward_weights_are_422_naming_reward_setting_and_files(client, admin,
                                                                        reward_root):
    r = _post(client, admin, TRAIN)
    assert r.status_code == 422, r.text
    assert list(_errors(r)) == ["reward_weights"]
    message = _errors(r)["reward_weights"]
    assert "'pickscore'" in message and "REWARD_MODELS_DIR" in message
    assert str(reward_root / "pickscore") in message and "config.json" in message


def test_weights_under_reward_models_dir_are_accepted(client, admin, reward_root,
                                                      tiny_clip_path):
    shutil.copytree(tiny_clip_path, reward_root / "pickscore")
    r = _post(client, admin, TRAIN)
    assert r.status_code == 201, r.text
    (reward_root / "pickscore" / "model.safetensors").unlink()  # incomplete
    r = _post(client, admin, TRAIN)
    assert r.status_code == 422 and "model.safetensors" in _errors(r)["reward_weights"]


def test_damaged_reward_weights_are_422_at_submission(client, admin, reward_root,
                                                     tiny_clip_path):
    """A truncated copy (the usual way a large download goes wrong) or a config that is not
    JSON: refused at the door, naming the reward and the file, not at the job's start."""
    shutil.copytree(tiny_clip_path, reward_root / "pickscore")
    weights = reward_root / "pickscore" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    r = _post(client, admin, TRAIN)
    assert r.status_code == 422 and list(_errors(r)) == ["reward_weights"], r.text
    message = _errors(r)["reward_weights"]
    assert "'pickscore'" in message and "damaged" in message and str(weights) in message
    assert "is truncated" in message
    weights.write_bytes(whole)
    (reward_root / "pickscore" / "config.json").write_text("{not json")
    r = _post(client, admin, TRAIN)
    assert r.status_code == 422 and "config.json" in _errors(r)["reward_weights"], r.text


def test_reward_model_paths_under_models_dir_or_reward_models_dir(client, admin, settings,
                                                                  reward_root, tiny_clip_path):
    models = settings.resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_clip_path, models / "pick-v1")
    shutil.copytree(tiny_clip_path, reward_root / "pick-v2")
    for good in ("pick-v1", str(models / "pick-v1"), "pick-v2", str(reward_root / "pick-v2")):
        r = _post(client, admin, {**TRAIN, "reward_model_paths": {"pickscore": good}})
        assert r.status_code == 201, (good, r.text)

    storage = settings.resolved_storage_dir
    storage.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_clip_path, storage / "pick-in-storage")
    for bad in (str(storage / "pick-in-storage"), "../storage/pick-in-storage",
                str(tiny_clip_path), "/etc"):
        r = _post(client, admin, {**TRAIN, "reward_model_paths": {"pickscore": bad}})
        assert r.status_code == 422, (bad, r.text)
        assert list(_errors(r)) == ["reward_model_paths"], bad
        assert "REWARD_MODELS_DIR" in _errors(r)["reward_model_paths"]

    r = _post(client, admin, {**TRAIN, "reward_model_paths": {"pickscore": "nope"}})
    assert r.status_code == 422 and list(_errors(r)) == ["reward_model_paths"]
    message = _errors(r)["reward_model_paths"]
    assert "reward_model_paths['pickscore']" in message and "does not exist" in message
    assert "preprocessor_config.json" in message

    r = _post(client, admin, {**TRAIN, "reward_model_paths": {"count": "pick-v1"}})
    assert r.status_code == 422 and "not a model-backed reward" in \
        _errors(r)["reward_model_paths"]


def test_worker_hands_the_trainer_resolved_reward_directories(settings, reward_root):
    from worker.training import job_train_config

    config = job_train_config({**TRAIN, "reward_weights": {"pickscore": 1.0, "hpsv2": 1.0},
                               "reward_model_paths": {"hpsv2": "hps-v21"}})
    assert config.reward_model_paths == {"hpsv2": str(reward_root / "hps-v21"),
                                         "pickscore": str(reward_root / "pickscore")}


def test_a_reward_path_the_settings_no_longer_allow_fails_the_job_naming_the_field(
        settings, reward_root, tmp_path, monkeypatch):
    """Submission accepted the path; if REWARD_MODELS_DIR / MODELS_DIR moved before the job
    started, the worker's one resolver refuses it as a JobError naming reward_model_paths
    (a job failure with that message), for a train job and for a sampling job alike."""
    from worker.lease import JobError
    from worker.sampling import prepare_rewards
    from worker.training import job_train_config

    given = {"pickscore": str(reward_root / "pick-v1")}
    monkeypatch.setenv("REWARD_MODELS_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MODELS_DIR", str(tmp_path / "models-elsewhere"))
    from app.config import get_settings

    get_settings.cache_clear()
    try:
        with pytest.raises(JobError, match=r"^reward_model_paths: .*REWARD_MODELS_DIR"):
            job_train_config({**TRAIN, "reward_model_paths": given})
        with pytest.raises(JobError, match=r"^reward_model_paths: .*REWARD_MODELS_DIR"):
            prepare_rewards(["pickscore"], given)
    finally:
        get_settings.cache_clear()


def test_submission_checks_files_not_the_api_servers_packages(client, admin, reward_root,
                                                              monkeypatch):
    """hpsv2 needs open_clip on the worker, not in the API's environment: a complete
    directory is accepted either way (the worker's Trainer checks the package at start)."""
    import dataclasses

    from trainer.rewards import models

    (reward_root / "hpsv2").mkdir()
    (reward_root / "hpsv2" / models.HPS_CHECKPOINT).write_bytes(b"weights")
    monkeypatch.setitem(models.MODEL_REWARDS, "hpsv2", dataclasses.replace(
        models.MODEL_REWARDS["hpsv2"], unavailable=lambda: "open_clip is not installed"))
    r = _post(client, admin, {**TRAIN, "reward_weights": {"hpsv2": 1.0}})
    assert r.status_code == 201, r.text
    r = _post(client, admin, {**TRAIN, "reward_weights": {"imagereward": 1.0}})
    assert r.status_code == 422 and "ImageReward.pt" in _errors(r)["reward_weights"]


def test_evaluate_takes_any_registered_reward_and_checks_model_weights(
        client, admin, session, reward_root, settings, tiny_clip_path):
    """An evaluate job names any registry reward; a model-backed one is refused while its
    weights are missing (naming the reward and the files), accepted once they are under
    REWARD_MODELS_DIR or where its reward_model_paths entry points."""
    from stored_checkpoints import stored_checkpoint

    ids = [stored_checkpoint(session, None, i, f"ck/{i}.safetensors") for i in (1, 2)]
    session.commit()

    def post(config):
        return client.post("/api/jobs", json={"kind": "evaluate", "config": {
            "checkpoint_ids": ids, **config}}, headers=admin)

    r = post({"reward_names": ["count", "jpeg_compressibility", "attr_size"]})
    assert r.status_code == 201, r.text
    r = post({"reward_names": ["clip_score", "beauty"]})
    assert r.status_code == 422 and list(_errors(r)) == ["reward_names"]
    message = _errors(r)["reward_names"]
    assert "'beauty'" in message and "'clip_score'" in message
    assert str(reward_root / "clip_score") in message and "config.json" in message
    r = post({"reward_names": ["clip_score"], "reward_model_paths": {"count": "x"}})
    assert r.status_code == 422 and "not a model-backed reward" in \
        _errors(r)["reward_model_paths"]

    models = settings.resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_clip_path, models / "clip-l14")
    r = post({"reward_names": ["clip_score"], "reward_model_paths": {"clip_score": "clip-l14"}})
    assert r.status_code == 201, r.text
    assert r.json()["config"]["reward_model_paths"] == {"clip_score": "clip-l14"}
    # a path for a reward the job does not score was taken and never read
    r = post({"reward_names": ["count"], "reward_model_paths": {"clip_score": "clip-l14"}})
    assert r.status_code == 422 and _errors(r) == {"reward_model_paths": (
        "'clip_score' is not among the rewards the job scores (count): its weights would "
        "never load; add it to reward_names or take its path out")}, r.text
    shutil.copytree(tiny_clip_path, reward_root / "clip_score")
    assert post({"reward_names": ["clip_score", "count"]}).status_code == 201


def test_rollout_takes_reward_model_paths_and_its_worker_scores_with_them(
        client, admin, session, settings, reward_root, tiny_clip_path):
    """A rollout names model-backed rewards as an evaluate job does, so it places their
    weights alike: reward_model_paths is checked at submission (it was an unknown field, 422)
    and the worker loads the reward from there, not from REWARD_MODELS_DIR/<name>."""
    from app.db import session_scope
    from app.services import datasets, rollouts
    from trainer.shapes.world import all_prompts
    from worker.sampling import run_rollout
    from worker.tasks import run_job

    data = (all_prompts()[0] + "\n").encode()
    dataset = datasets.import_dataset(session, filename="p.txt", data=data).dataset.id
    session.commit()

    def post(config):
        return client.post("/api/jobs", json={"kind": "rollout", "config": {
            "dataset_id": dataset, "group_size": 2, "steps": 2, "reward_names": ["clip_score"],
            **config}}, headers=admin)

    r = post({"reward_model_paths": {"clip_score": "nope"}})
    assert r.status_code == 422 and list(_errors(r)) == ["reward_model_paths"], r.text
    assert "does not exist" in _errors(r)["reward_model_paths"]
    r = post({"reward_model_paths": {"count": "x"}})
    assert r.status_code == 422 and "not a model-backed reward" in \
        _errors(r)["reward_model_paths"]
    # left out, reward_names are the model's defaults (shapes: no model-backed reward)
    r = post({"reward_names": [], "reward_model_paths": {"clip_score": "clip-l14"}})
    assert r.status_code == 422 and "is not among the rewards the job scores (count, " in \
        _errors(r)["reward_model_paths"], r.text
    r = post({"reward_model_paths": {"clip_score": "clip"},
              "reward_server_url": "http://reward-server:8100"})
    assert r.status_code == 422 and list(_errors(r)) == ["reward_model_paths"]

    models = settings.resolved_models_dir
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_clip_path, models / "clip-l14")
    assert not (reward_root / "clip_score").exists()
    r = post({"reward_model_paths": {"clip_score": "clip-l14"}})
    assert r.status_code == 201, r.text
    assert r.json()["config"]["reward_model_paths"] == {"clip_score": "clip-l14"}
    job_id = r.json()["id"]
    assert run_job(job_id, run_rollout) == "succeeded"
    with session_scope() as s:
        groups, _ = rollouts.list_groups(s, job_id=job_id)
        assert [set(m.rewards) for g in groups for m in g.samples] == [{"clip_score"}] * 2
