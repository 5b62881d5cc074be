"""A job that names a reward server (issue 17): submission does not ask for reward weights on
this host (the server holds them) and does not call the server (it may be down now; the worker
asks it when the job starts), but reward names must still be known and the URL well formed.
Train, rollout and evaluate jobs alike; the sampling jobs run here through the worker's own
task body (`worker.tasks.run_job`) against a real server (uvicorn on a free port)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from reward_server_helpers import ServerThread, free_port_url, held_reward
from sqlalchemy import select

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
    # the HTTP client would refuse these only when the job first calls the server
    for url in ("http://127.0.0.1:1/\nx", "http://127.0.0.1:1/ x", "http://reward\tserver:81"):
        r = _post(client, admin, {**TRAIN, "reward_server_url": url})
        assert r.status_code == 422, url
        assert "spaces or control characters" in _errors(r)["reward_server_url"]
        r = client.post("/api/jobs", json={"kind": "rollout", "config": {
            "dataset_id": 1, "reward_server_url": url}}, headers=admin)
        assert r.status_code == 422, url
        assert "spaces or control characters" in _errors(r)["reward_server_url"]


def test_a_stopped_job_resumes_on_a_moved_reward_server(client, admin):
    """Where the rewards are scored may change on resume (the same models: a server moved,
    or reward models taken off the training card onto a server); checked as at submission."""
    job_id = _post(client, admin, TRAIN).json()["id"]
    assert client.post(f"/api/jobs/{job_id}/cancel", headers=admin).status_code == 200
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"reward_server_url": "reward-server:8101"}})
    assert r.status_code == 422 and "http" in _errors(r)["config.reward_server_url"], r.text
    moved = "http://rewards.internal:8101"
    r = client.post(f"/api/jobs/{job_id}/resume", headers=admin,
                    json={"config": {"reward_server_url": moved}})
    assert r.status_code == 200, r.text
    assert r.json()["config"]["reward_server_url"] == moved
    assert r.json()["config"]["reward_weights"] == TRAIN["reward_weights"]


def test_the_worker_passes_no_local_weight_paths_with_a_server(settings):
    config = job_train_config(TRAIN)
    assert config.reward_model_paths == {}
    assert config.reward_server_url == "http://reward-server:8100"


def test_the_worker_fails_the_job_at_start_naming_a_server_that_is_down(client, admin):
    url = free_port_url()  # a port nobody listens on
    r = _post(client, admin, {**TRAIN, "reward_server_url": url})
    assert r.status_code == 201, r.text
    with pytest.raises(JobError, match=f"reward server at {url} cannot be reached"):
        prepare_trainer(r.json()["id"])


def test_weights_gone_after_submission_fail_the_job_naming_them(client, admin, settings):
    """Weights present at submission and gone when the job starts: a JobError (the job's error
    is the message alone) naming the reward, its setting and the files expected."""
    import shutil

    weights = settings.resolved_reward_models_dir / "pickscore"
    weights.mkdir(parents=True)
    from safetensors.torch import save_file

    for name in ("config.json", "preprocessor_config.json", "tokenizer.json"):
        (weights / name).write_text("{}")
    save_file({}, str(weights / "model.safetensors"))  # whole, if empty: submission reads headers
    local = {k: v for k, v in TRAIN.items() if k != "reward_server_url"}
    r = _post(client, admin, local)
    assert r.status_code == 201, r.text
    shutil.rmtree(weights)
    with pytest.raises(JobError, match=r"'pickscore'.*reward_model_paths\['pickscore'\].*config\.json"):
        prepare_trainer(r.json()["id"])


# --- rollout and evaluate jobs ---------------------------------------------------------------
SERVED = ["count", "jpeg_compressibility"]  # weight-free rewards: scored alike anywhere


@pytest.fixture
def checkpoint(session) -> int:
    """A recorded shapes checkpoint (the shipped base model, copied into storage)."""
    from app.services import storage
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE

    storage.write_bytes("checkpoints/base/model.safetensors", SHAPES_BASE.read_bytes())
    ckpt = record_checkpoint(session, None, 0, "checkpoints/base/model.safetensors",
                             name="base")
    session.commit()
    return ckpt


@pytest.fixture
def dataset(session) -> int:
    from app.services import datasets
    from trainer.shapes.world import all_prompts

    data = ("\n".join(all_prompts()[:2]) + "\n").encode()
    ds = datasets.import_dataset(session, filename="p.txt", data=data).dataset.id
    session.commit()
    return ds


def _post_kind(client, headers, kind: str, config: dict):
    return client.post("/api/jobs", json={"kind": kind, "config": config}, headers=headers)


def _run(job_id: int, kind: str) -> str:
    """The job run as a worker runs it: claimed, heartbeat kept, failure recorded."""
    from worker.sampling import run_evaluate, run_rollout
    from worker.tasks import run_job

    return run_job(job_id, {"evaluate": run_evaluate, "rollout": run_rollout}[kind])


def _sample_rewards(job_id: int) -> dict[tuple, dict[str, float]]:
    """{(prompt, seed, member): rewards} of the samples a job stored."""
    from app.db import session_scope
    from app.services import rollouts

    with session_scope() as s:
        groups, _ = rollouts.list_groups(s, job_id=job_id)
        return {(g.prompt_text, g.seed, m.member_index): dict(m.rewards, advantage=m.advantage)
                for g in groups for m in g.samples}


def test_sampling_jobs_with_a_reward_server_need_no_local_weights(client, admin, settings,
                                                                  checkpoint, dataset):
    assert not (settings.resolved_reward_models_dir / "pickscore").exists()
    url = "http://reward-server:8100"  # nothing listens there: not asked at submission
    configs = {"evaluate": {"checkpoint_ids": [checkpoint], "reward_names": ["pickscore", "count"]},
               "rollout": {"dataset_id": dataset, "reward_names": ["pickscore", "count"]}}
    for kind, config in configs.items():
        r = _post_kind(client, admin, kind, {**config, "reward_server_url": url})
        assert r.status_code == 201, (kind, r.text)
        assert r.json()["config"]["reward_server_url"] == url
        r = _post_kind(client, admin, kind, config)  # in process: the weights must be here
        assert r.status_code == 422 and "'pickscore'" in _errors(r)["reward_names"], kind
        # names and the URL are still checked, as for a train job
        r = _post_kind(client, admin, kind, {**config, "reward_names": ["beauty"],
                                             "reward_server_url": url})
        assert r.status_code == 422 and "unknown reward 'beauty'" in _errors(r)["reward_names"]
        r = _post_kind(client, admin, kind, {**config, "reward_server_url": "reward-server:8100"})
        assert r.status_code == 422 and list(_errors(r)) == ["reward_server_url"], kind
        assert "http" in _errors(r)["reward_server_url"]
    # the server holds the weights: a path for one here would do nothing (TrainConfig's rule)
    r = _post_kind(client, admin, "evaluate", {**configs["evaluate"], "reward_server_url": url,
                                               "reward_model_paths": {"pickscore": "pick"}})
    assert r.status_code == 422 and list(_errors(r)) == ["reward_model_paths"]
    assert "must be empty with reward_server_url" in _errors(r)["reward_model_paths"]


def test_sampling_jobs_scored_on_a_reward_server_store_what_in_process_scoring_does(
        session, checkpoint, dataset):
    """An evaluate job scored on a real server stores the same per-checkpoint scores (and
    per-image rewards) as one scored in process; a rollout the same rewards and advantages.
    A server that lacks a reward the job names fails it at its start, naming both."""
    from app.db import session_scope
    from app.services import checkpoints, jobs
    from trainer.rewards.remote import RewardClient
    from trainer.rewards.serve import create_app

    evaluate = {"checkpoint_ids": [checkpoint], "max_prompts": 2, "seeds": [0, 1], "steps": 2,
                "reward_names": SERVED}
    rollout = {"dataset_id": dataset, "checkpoint_id": checkpoint, "group_size": 2,
               "steps": 2, "reward_names": SERVED}

    def launch(kind: str, config: dict) -> int:
        with session_scope() as s:
            return jobs.create_job(s, kind, config).id

    def scores() -> dict[str, dict]:
        with session_scope() as s:
            return dict(checkpoints.get_checkpoint(s, checkpoint).scores)

    local = {kind: launch(kind, config) for kind, config in
             (("evaluate", evaluate), ("rollout", rollout))}
    for kind, job_id in local.items():
        assert _run(job_id, kind) == "succeeded", kind
    in_process = scores()
    with ServerThread(create_app(SERVED, device="cpu")) as server:
        remote = {kind: launch(kind, {**config, "reward_server_url": server.url})
                  for kind, config in (("evaluate", evaluate), ("rollout", rollout))}
        lacking = launch("rollout", {**rollout, "reward_names": ["count", "color"],
                                     "reward_server_url": server.url})
        before = RewardClient(server.url, timeout=10).health()["requests"]
        for kind, job_id in remote.items():
            assert _run(job_id, kind) == "succeeded", kind
        # scored there: one request per checkpoint (evaluate), per chunk of prompts (rollout)
        assert RewardClient(server.url, timeout=10).health()["requests"] - before == 2
        assert _run(lacking, "rollout") == "failed"
    served = scores()
    assert set(served) == set(SERVED)
    for name in SERVED:
        assert served[name]["job_id"] == remote["evaluate"]  # this evaluation's, not the first's
        assert in_process[name]["job_id"] == local["evaluate"]
        for key in ("mean", "std", "n", "prompts", "seeds"):
            assert served[name][key] == in_process[name][key], (name, key)
    for kind in ("evaluate", "rollout"):
        rewards = _sample_rewards(remote[kind])
        assert rewards and rewards == _sample_rewards(local[kind]), kind
    with session_scope() as s:
        job = jobs.get_job(s, lacking)
        assert job.error == (f"reward server at {server.url} does not serve ['color']; it "
                             f"serves {SERVED}. Start it with --rewards naming them, or score "
                             "them in process (empty reward_server_url)")
        assert job.total_iterations is None  # failed before its first progress report


def test_a_sampling_job_fails_at_start_naming_a_server_that_is_down(session, checkpoint,
                                                                    dataset):
    from app.db import session_scope
    from app.services import jobs, rollouts

    url = free_port_url()
    configs = {"evaluate": {"checkpoint_ids": [checkpoint], "max_prompts": 1, "seeds": [0],
                            "steps": 2, "reward_server_url": url},
               "rollout": {"dataset_id": dataset, "group_size": 2, "steps": 2,
                           "reward_server_url": url}}
    for kind, config in configs.items():
        with session_scope() as s:
            job_id = jobs.create_job(s, kind, config).id
        assert _run(job_id, kind) == "failed", kind
        with session_scope() as s:
            job = jobs.get_job(s, job_id)
            # the client's message alone (a JobError), no traceback
            assert job.error.startswith(f"reward server at {url} cannot be reached"), job.error
            assert "Traceback" not in job.error
            # before any sampling: no progress reported, nothing stored
            assert job.total_iterations is None and rollouts.list_groups(s, job_id=job_id)[1] == 0


def test_reward_server_timeout_is_a_setting_a_worker_hands_its_jobs(tmp_path, monkeypatch):
    """REWARD_SERVER_TIMEOUT was read by the trainer from the environment alone: a value in
    .env did nothing, and a malformed one passed the worker's start to fail a job at run
    time. It is a setting now, checked with the others, and a worker at start hands it (from
    .env too) to the trainer's reward client, in this process and torchrun's."""
    from pydantic import ValidationError

    from app.config import Settings, get_settings, settings_problem
    from trainer.rewards.remote import ENV_TIMEOUT, RewardClient
    from worker.tasks import hand_settings_to_trainer

    monkeypatch.setenv(ENV_TIMEOUT, "abc")
    with pytest.raises(ValidationError) as exc:
        Settings()
    assert settings_problem(exc.value).startswith("REWARD_SERVER_TIMEOUT: ")
    monkeypatch.setenv(ENV_TIMEOUT, "0")
    with pytest.raises(ValidationError, match="greater than 0"):
        Settings()
    monkeypatch.delenv(ENV_TIMEOUT)  # restored (to unset or as it was) by monkeypatch
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("REWARD_SERVER_TIMEOUT=7.5\n")
    get_settings.cache_clear()
    try:
        assert get_settings().reward_server_timeout == 7.5
        hand_settings_to_trainer()
        assert RewardClient(free_port_url()).timeout == 7.5
    finally:
        get_settings.cache_clear()


# --- a train job stopped while it waits for the reward server --------------------------------
@pytest.mark.parametrize("stop", ["cancel", "shutdown"])
def test_a_train_job_stopped_while_the_server_scores_stops_within_seconds(settings, monkeypatch,
                                                                          stop):
    """A cancel asked while the job waited for the reward server's scores was seen only once
    the request timed out (REWARD_SERVER_TIMEOUT: 300 s by default, 60 here), and the job then
    failed with the RewardServerError. Now the wait is given up within a second or two: the
    iteration in progress is dropped, the job keeps a checkpoint of its last whole one and ends
    cancelled, with no error; a warm shutdown requeues it the same way. The server sees its
    client leave and drops the rest of the request."""
    import threading

    from app.db import session_scope
    from app.models import Checkpoint, JobMetric
    from app.services import jobs
    from trainer.config import PRESETS
    from trainer.rewards.remote import ENV_TIMEOUT
    from trainer.rewards.serve import create_app
    from worker.tasks import run_job
    from worker.training import run_training

    per_iteration = PRESETS["tiny"]["prompts_per_iteration"] * PRESETS["tiny"]["group_size"]
    monkeypatch.setenv(ENV_TIMEOUT, "60")  # the client's wait, which the stop must cut short
    requeued: list[int] = []
    monkeypatch.setattr("worker.training.send_requeued", lambda job_id, *_: requeued.append(job_id))
    shutdown = threading.Event()
    outcome: list[str] = []
    # iteration 1 is scored at once; iteration 2's first chunk is held until released
    with held_reward(per_iteration) as (scored, holding, release):
        # two chunks a request: the server notices the client gone before the second
        app = create_app(["test_held"], device="cpu", max_batch=per_iteration // 2)
        with ServerThread(app) as server:
            with session_scope() as s:
                job_id = jobs.create_job(s, "train", {
                    "device": "cpu", "iterations": 3, "checkpoint_every": 1000,
                    "reward_weights": {"test_held": 1.0}, "reward_server_url": server.url},
                    preset="tiny").id

            def cancel_or_shut_down() -> None:
                if stop == "cancel":
                    with session_scope() as s:
                        jobs.request_cancel(s, job_id)
                else:
                    shutdown.set()

            _stopped_while_the_server_holds(
                server, holding, release, outcome, cancel_or_shut_down,
                lambda: run_job(job_id, lambda job, worker: run_training(job, worker, shutdown)))
            assert scored == [per_iteration // 2] * 3
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        status, error, iteration = job.status, job.error, job.iteration
        checkpoints_at = list(s.scalars(select(Checkpoint.iteration)
                                        .where(Checkpoint.job_id == job_id)))
        metrics_at = list(s.scalars(select(JobMetric.iteration)
                                    .where(JobMetric.job_id == job_id)))
    # iteration 2 is dropped: the job stands at iteration 1, checkpointed as a stop keeps it
    assert iteration == 1 and checkpoints_at == [1] and metrics_at == [1]
    if stop == "cancel":
        assert outcome == ["cancelled"] and status == "cancelled", (outcome, status, error)
        assert error is None
    else:
        assert outcome == ["queued"] and status == "queued", (outcome, status, error)
        assert "shut down at iteration 1" in error and requeued == [job_id]


def _stopped_while_the_server_holds(server, holding, release, outcome: list,
                                    stop: Callable[[], None], run: Callable[[], str]) -> None:
    """Runs a job (`run`, its outcome appended to `outcome`) on a thread until the server
    holds its request (`holding`), then `stop`s it (a cancel or a warm shutdown): the job
    must end within seconds, well before its 60 s timeout, and the server see its client leave
    and drop the rest of the request (its `cancelled` count), before `release` lets the held
    reward go."""
    import threading
    import time

    from trainer.rewards.remote import RewardClient

    try:
        runner = threading.Thread(target=lambda: outcome.append(run()), daemon=True)
        runner.start()
        assert holding.wait(120), "the held request never reached the server"
        asked = time.monotonic()
        stop()
        runner.join(timeout=30)
        took = time.monotonic() - asked
        assert not runner.is_alive(), "the job still waits for the reward server"
        assert took < 10, took  # a cancel is read once a second; the timeout is 60 s
        # the request's connection was cut: its handler notices and returns (uvicorn's tasks
        # in flight) while its first chunk is still held
        deadline = time.monotonic() + 10
        while server.server.server_state.tasks:
            assert time.monotonic() < deadline, "the server never saw its client leave"
            time.sleep(0.05)
    finally:
        release.set()  # before the server stops: it waits for the held request
    # so the request's second chunk is never scored
    deadline = time.monotonic() + 10
    while RewardClient(server.url, timeout=10).health()["cancelled"] < 1:
        assert time.monotonic() < deadline, "the request was scored to its end"
        time.sleep(0.1)


# --- a rollout or evaluate job cancelled while it waits for the reward server ---------------
@pytest.mark.parametrize("kind", ["rollout", "evaluate"])
def test_a_sampling_job_cancelled_while_the_server_scores_stops_within_seconds(
        settings, monkeypatch, session, checkpoint, dataset, kind):
    """A rollout or evaluate job saw a cancel between solver steps, but not while it waited
    for the reward server's scores: it waited for the answer or REWARD_SERVER_TIMEOUT (300 s
    by default, 60 here), and then failed with the RewardServerError. Now the same cancel poll
    reaches the wait: the job ends cancelled within a second or two, with no error, as a cancel
    seen before a solver step ends it. The chunk (rollout) or checkpoint (evaluate) being
    scored is dropped whole: what was stored before stays, nothing of it is. The server sees
    its client leave and drops the rest of the request."""

    from app.db import session_scope
    from app.services import checkpoints, jobs, rollouts
    from app.services.checkpoints import record_checkpoint
    from trainer.rewards.remote import ENV_TIMEOUT
    from trainer.rewards.serve import create_app
    from worker.sampling import run_evaluate, run_rollout
    from worker.tasks import run_job

    # a request a chunk of one prompt's group of 2 (rollout), a checkpoint's 2 images
    # (evaluate); the first is scored at once, the second held until released
    per_request = 2
    monkeypatch.setattr("worker.sampling.CHUNK_SAMPLES", per_request)
    second = record_checkpoint(session, None, 0, "checkpoints/base/model.safetensors",
                               name="base again")
    session.commit()
    monkeypatch.setenv(ENV_TIMEOUT, "60")  # the client's wait, which the cancel must cut short
    outcome: list[str] = []
    with held_reward(per_request) as (scored, holding, release):
        # two chunks a request: the server notices the client gone before the second
        app = create_app(["test_held"], device="cpu", max_batch=per_request // 2)
        with ServerThread(app) as server:
            config = {"rollout": {"dataset_id": dataset, "checkpoint_id": checkpoint,
                                  "group_size": per_request, "steps": 2},
                      "evaluate": {"checkpoint_ids": [checkpoint, second], "max_prompts": 1,
                                   "seeds": [0, 1], "steps": 2}}[kind]
            with session_scope() as s:
                job_id = jobs.create_job(s, kind, {
                    **config, "reward_names": ["test_held"], "reward_server_url": server.url}).id

            def cancel() -> None:
                with session_scope() as s:
                    jobs.request_cancel(s, job_id)

            body = {"rollout": run_rollout, "evaluate": run_evaluate}[kind]
            _stopped_while_the_server_holds(server, holding, release, outcome, cancel,
                                            lambda: run_job(job_id, body))
            assert scored == [1, 1, 1]
    with session_scope() as s:
        job = jobs.get_job(s, job_id)
        status, error, done = job.status, job.error, job.iteration
        history = [m.iteration for m in jobs.metric_history(s, job_id)]
        groups, _ = rollouts.list_groups(s, job_id=job_id)
        stored = [(g.checkpoint_id, sorted(m.member_index for m in g.samples),
                   [m.rewards for m in g.samples]) for g in groups]
        samples = sum(len(g.samples) for g in groups)
        scores = {c: dict(checkpoints.get_checkpoint(s, c).scores or {})
                  for c in (checkpoint, second)}
    assert outcome == ["cancelled"] and status == "cancelled", (outcome, status, error)
    assert error is None
    if kind == "rollout":
        # the first prompt's group, whole; the second's, being scored, not at all
        assert done == 1 and history == [1], (done, history)
        assert len(stored) == 1 and samples == per_request
        assert stored[0][1] == [0, 1] and all(isinstance(r["test_held"], float)
                                              for r in stored[0][2])
    else:
        # the first checkpoint's images and scores; the second's, being scored, not at all
        # (its progress may count the images it sampled, as on a cancel between steps)
        assert done in (per_request, 2 * per_request) and history == [1], (done, history)
        assert [c for c, *_ in stored] == [checkpoint] * per_request
        assert samples == per_request
        assert scores[checkpoint]["test_held"]["job_id"] == job_id
        assert "test_held" not in scores[second]
