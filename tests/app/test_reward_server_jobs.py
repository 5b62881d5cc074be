"""A train job that names a reward server (issue 17): submission does not ask for reward
weights on this host (the server holds them) and does not call the server (it may be down
now; the worker asks it when the job starts), but reward names must still be known and the
URL well formed."""

from __future__ import annotations

import socket

import pytest

from worker.lease import JobError
from worker.training import job_train_config, prepare_trainer

TRAIN = {"reward_weights": {"pickscore": 1.0, "count": 1.0}, "device": "cpu",
         "reward_server_url": "http://reward-server:8100"}


def _post(client, headers, config):
    return client.post("/api/jobs", json={"kind": "train", "config": config, "preset": "tiny"},
                       headers=headers)


def _errors(response) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json()["errors"]}


def test_a_job_with_a_reward_server_needs_no_local_weights(client, admin, settings):
    assert not (settings.resolved_reward_models_dir / "pickscore").exists()
    r = _post(client, admin, TRAIN)  # nothing listens at that URL: not asked at submission
    assert r.status_code == 201, r.text
    assert r.json()["config"]["reward_server_url"] == TRAIN["reward_server_url"]
    without = {k: v for k, v in TRAIN.items() if k != "reward_server_url"}
    r = _post(client, admin, without)
    assert r.status_code == 422 and "pickscore" in _errors(r)["reward_weights"]


def test_reward_names_and_the_url_are_still_checked(client, admin):
    r = _post(client, admin, {**TRAIN, "reward_weights": {"beauty": 1.0}})
    assert r.status_code == 422 and "unknown reward 'beauty'" in _errors(r)["reward_weights"]
    r = _post(client, admin, {**TRAIN, "reward_server_url": "reward-server:8100"})
    assert r.status_code == 422 and "http" in _errors(r)["reward_server_url"]
    r = _post(client, admin, {**TRAIN, "reward_model_paths": {"pickscore": "pick"}})
    assert r.status_code == 422 and "reward_server_url" in _errors(r)["reward_model_paths"]


def test_the_worker_passes_no_local_weight_paths_with_a_server(settings):
    config = job_train_config(TRAIN)
    assert config.reward_model_paths == {}
    assert config.reward_server_url == "http://reward-server:8100"


def test_the_worker_fails_the_job_at_start_naming_a_server_that_is_down(client, admin):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    r = _post(client, admin, {**TRAIN, "reward_server_url": url})
    assert r.status_code == 201, r.text
    with pytest.raises(JobError, match=f"reward server at {url} cannot be reached"):
        prepare_trainer(r.json()["id"])
