"""A train job whose iteration runs out of accelerator memory fails with a message that names
the settings sizing an iteration (trainer.loop.TrainingOutOfMemory), not a traceback, and
resumes from its last checkpoint once the memory is there."""

from __future__ import annotations

import numpy as np
import torch

from app.db import session_scope
from app.services import jobs
from trainer.rewards import register_reward
from worker.tasks import run_job
from worker.training import run_training

# when set, the reward raises what torch raises on a full card (a CPU cannot run out of CUDA
# memory; the error is injected where a job meets it: inside an iteration)
CARD_FULL = {"from_call": None, "calls": 0}


def _scored(images, prompts):
    CARD_FULL["calls"] += 1
    if CARD_FULL["from_call"] is not None and CARD_FULL["calls"] >= CARD_FULL["from_call"]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
    return np.linspace(0.0, 1.0, len(prompts))


def test_a_train_job_out_of_memory_fails_saying_what_to_change(client, admin):
    register_reward("test_job_out_of_memory", _scored)
    CARD_FULL.update(from_call=3, calls=0)  # the third iteration's scoring
    r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny", "config": {
        "device": "cpu", "iterations": 4, "checkpoint_every": 2,
        "reward_weights": {"test_job_out_of_memory": 1.0}}}, headers=admin)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert run_job(job_id, run_training) == "failed"
    job = client.get(f"/api/jobs/{job_id}", headers=admin).json()
    assert job["error"].startswith("iteration 3: out of memory on cpu in "
                                   "neighbor_grpo_iteration:"), job["error"]
    assert ("(CUDA out of memory. Tried to allocate 9.00 GiB). What an iteration holds at "
            "once: train_batch_size") in job["error"], job["error"]
    assert "Traceback" not in job["error"] and job["iteration"] == 2
    assert f"POST /api/jobs/{job_id}/resume" in job["error"]
    # a resume may change how much runs at once, not what the run computes; every problem
    # of the body is named in one 422, and the job is left as it was
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin, json={"config": {
        "train_batch_size": -1, "learning_rate": 1e-3, "group_size": 8, "bogus": 1}})
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert set(errors) == {"config.learning_rate", "config.group_size", "config.bogus",
                           "config.train_batch_size"}, r.json()
    assert errors["config.bogus"].startswith("unknown field; these can change on resume: ")
    assert errors["config.group_size"].startswith("cannot change on resume")
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"train_batch_size": -1}})
    assert r.status_code == 422 and r.json()["field"] == "config.train_batch_size", r.text
    assert client.get(f"/api/jobs/{job_id}", headers=admin).json()["status"] == "failed"
    CARD_FULL["from_call"] = None  # room on the card again: resume goes on from iteration 2
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"train_batch_size": 1, "rollout_batch_size": 2}})
    assert r.status_code == 200, r.text
    assert (r.json()["config"]["train_batch_size"], r.json()["config"]["rollout_batch_size"],
            r.json()["config"]["learning_rate"]) == (1, 2, job["config"]["learning_rate"])
    with session_scope() as s:
        jobs.mark_running(s, job_id, "w1")
    assert run_training(job_id, "w1") == "succeeded"
    assert client.get(f"/api/jobs/{job_id}", headers=admin).json()["iteration"] == 4


def test_only_a_stopped_train_job_changes_its_config_on_resume(client, admin, enqueuer):
    r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny",
                                       "config": {"device": "cpu"}}, headers=admin)
    job_id = r.json()["id"]
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"train_batch_size": 1}})
    assert r.status_code == 409 and "queued" in r.json()["detail"], r.text
    assert client.post(f"/api/jobs/{job_id}/resume", headers=admin).status_code == 200
    assert client.post(f"/api/jobs/{job_id}/cancel", headers=admin).status_code == 200
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin, json={"cfg": {}})
    assert r.status_code == 422, r.text  # the body's own fields are checked too
    # a changed path the server refuses is the request's problem (422), said beside a bad
    # value: it was a 409 "can no longer run", and only once the value was fixed
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin, json={"config": {
        "train_batch_size": -1, "reward_model_paths": {"hpsv2": "/etc"}}})
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert set(errors) == {"config.train_batch_size", "config.reward_model_paths"}, errors
    # reward_weights stay as the run started (count): a path for hpsv2 would never be read
    assert "'hpsv2' is not among reward_weights (count)" in \
        errors["config.reward_model_paths"], errors
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"reward_model_paths": {"hpsv2": "/etc"}}})
    assert r.status_code == 422 and r.json()["field"] == "config.reward_model_paths", r.text
    assert client.get(f"/api/jobs/{job_id}", headers=admin).json()["status"] == "cancelled"
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"gradient_checkpointing": False}})
    assert r.status_code == 200 and r.json()["config"]["gradient_checkpointing"] is False
