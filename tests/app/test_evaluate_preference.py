"""An evaluate job scores the reward 'preference' with a fitted preference model: the newest
(or the version named) when the job starts, the same version on a resume, stored with the
checkpoints' scores; a job that could not score it is refused at submission."""

from __future__ import annotations

import pytest
from stored_checkpoints import stored_checkpoint

PROMPTS = ["one red circle", "two blue squares"]


def _preference_model(session, version: int, seed: int) -> None:
    """Preference model version `version`, fitted to nothing (its scores differ by seed)."""
    from app.services import preference as pref_svc
    from app.services import storage
    from trainer.rewards.fit_config import FitConfig
    from trainer.rewards.preference import PreferenceModel

    rel = pref_svc.model_path(version)
    (storage.storage_root() / rel).parent.mkdir(parents=True, exist_ok=True)
    PreferenceModel(FitConfig(ensemble=2, width=4, seed=seed)).save(storage.storage_root() / rel)
    pref_svc.record_model(session, version=version, path=rel, report={})
    session.commit()


def _evaluate(client, headers, **config):
    body = {"checkpoint_ids": config.pop("checkpoint_ids"), "prompts": PROMPTS,
            "seeds": [0, 1], "steps": 2, **config}
    return client.post("/api/jobs", json={"kind": "evaluate", "config": body}, headers=headers)


def test_an_evaluate_job_scores_the_newest_preference_model(client, admin, session):
    from app.db import session_scope
    from app.models import Checkpoint
    from app.services import checkpoints, jobs, rollouts, storage
    from trainer.rewards.preference import PreferenceModel
    from worker.sampling import run_evaluate
    from worker.tasks import run_job

    ckpt = stored_checkpoint(session, None, 0, "checkpoints/base/model.safetensors",
                             name="base")
    session.commit()
    _preference_model(session, 1, seed=1)
    _preference_model(session, 2, seed=2)
    r = _evaluate(client, admin, checkpoint_ids=[ckpt], reward_names=["count", "preference"])
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert run_job(job_id, run_evaluate) == "succeeded"

    with session_scope() as s:
        scores = s.get(Checkpoint, ckpt).scores
        assert scores["preference"]["preference_model"] == "v2"  # the newest at the start
        assert "preference_model" not in scores["count"]
        assert checkpoints.score_sources(s.get(Checkpoint, ckpt))["preference"].endswith(
            "n=4, preference model v2")
        assert jobs.get_job(s, job_id).metrics["preference_model"] == "v2"
        groups, _ = rollouts.list_groups(s, job_id=job_id)
        stored = sorted((g.prompt_text, g.seed, g.samples[0].rewards["preference"],
                         g.samples[0].image_path) for g in groups)
    assert len(stored) == 4
    # the stored scores are v2's on the stored images (PNG: lossless), and their mean the
    # checkpoint's
    import numpy as np
    from PIL import Image

    model = PreferenceModel.load(storage.storage_root() / "preference/v2.safetensors")
    images = np.stack([np.asarray(Image.open(storage.resolve(path)).convert("RGB"))
                       for *_, path in stored])
    expected = model.scores(images, [prompt for prompt, *_ in stored])
    assert [value for _, _, value, _ in stored] == pytest.approx(list(expected))
    assert scores["preference"]["mean"] == pytest.approx(float(expected.mean()))


def test_a_resumed_evaluate_job_keeps_the_version_it_began_with(settings, session):
    from app.job_kinds import EvaluateConfig
    from worker.sampling import EvaluationPreference

    _preference_model(session, 1, seed=1)
    _preference_model(session, 2, seed=2)
    cfg = EvaluateConfig(checkpoint_ids=[1], reward_names=["preference"])
    assert EvaluationPreference.load(cfg, []).label == "v2"
    begun = [{"checkpoint_id": 1, "preference_model": "v1"}]
    assert EvaluationPreference.load(cfg, begun).label == "v1"


def test_an_evaluate_job_that_cannot_score_preference_is_refused(client, admin, session,
                                                                  monkeypatch):
    ckpt = stored_checkpoint(session, None, 0, "checkpoints/base/model.safetensors",
                             name="base")
    session.commit()
    r = _evaluate(client, admin, checkpoint_ids=[ckpt], reward_names=["count", "preference"])
    assert r.status_code == 422, r.text
    assert {"field": "preference_model", "message": "reward_names has 'preference' but no "
            "preference model has been fitted yet: run a fit_preference job first"} \
        in r.json()["errors"]
    _preference_model(session, 1, seed=1)
    r = _evaluate(client, admin, checkpoint_ids=[ckpt], reward_names=["count"],
                  preference_model="v1")
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [{"field": "preference_model", "message": "names a "
                                   "preference model, but reward_names has no 'preference' "
                                   "for it to score: add it, or leave preference_model empty"}]
    r = _evaluate(client, admin, checkpoint_ids=[ckpt], reward_names=["preference"],
                  preference_model="v7")
    assert r.status_code == 422 and r.json()["field"] == "preference_model", r.text
    assert "v7" in r.json()["detail"]
    # a rollout job does not score it (its rewards feed the arena's reveal, not a model's)
    from app.services import datasets

    dataset = datasets.import_dataset(session, filename="p.txt",
                                      data=("\n".join(PROMPTS) + "\n").encode()).dataset.id
    session.commit()
    r = client.post("/api/jobs", json={"kind": "rollout", "config": {
        "dataset_id": dataset, "reward_names": ["preference"]}}, headers=admin)
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [{"field": "reward_names", "message": "'preference' is a "
                                   "fitted preference model's score: a train job blends it in "
                                   "(reward_weights) and an evaluate job scores it; a rollout "
                                   "job does not"}]
    # so also in a process where a trainer registered a preference model under that name (the
    # embedded worker's): the registry's 'preference' is not taken for a rollout's
    from trainer.rewards import registry, reward_names

    reward_names()  # the built-ins loaded first, as register_reward does
    monkeypatch.setitem(registry._REWARDS, "preference",
                        lambda images, prompts: [0.0] * len(prompts))
    assert "preference" in reward_names()
    r = client.post("/api/jobs", json={"kind": "rollout", "config": {
        "dataset_id": dataset, "reward_names": ["preference"]}}, headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "reward_names", r.text
