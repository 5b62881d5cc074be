"""The job-kind registry (app/job_kinds.py) is the one list of kinds: the API's enum, the
worker's tasks and routes, and the launch use case all follow it."""

from __future__ import annotations

import pytest


def test_every_kind_has_a_worker_task_routed_to_its_queue(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_DIR", str(tmp_path))  # the embedded broker's folders go here
    import worker.tasks  # noqa: F401  (registers the tasks)
    from app.job_kinds import KINDS, QUEUE_NAMES
    from worker.celery_app import celery_app, make_celery

    app = make_celery()
    for kind in KINDS.values():
        assert kind.task in celery_app.tasks, f"no task for kind {kind.name}"
        assert app.conf.task_routes[kind.task] == {"queue": kind.queue}
        assert kind.queue in QUEUE_NAMES
    assert {q.name for q in app.conf.task_queues} == set(QUEUE_NAMES)


def test_api_enum_and_config_schemas_follow_the_registry(client, admin):
    from app.job_kinds import KINDS

    spec = client.get("/openapi.json").json()
    enum = spec["components"]["schemas"]["JobIn"]["properties"]["kind"]["enum"]
    assert enum == list(KINDS)
    schema = client.get("/api/jobs/config-schema", headers=admin).json()
    assert {k for k in KINDS if KINDS[k].config} <= set(schema) and "train" in schema


def test_launch_job_checks_the_kinds_role_commits_then_enqueues(settings, session, enqueuer):
    from app.db import session_scope
    from app.errors import Forbidden
    from app.models import Job, User
    from app.services import auth, jobs

    with session_scope() as s:
        annotator, _ = auth.create_user(s, "ann", "annotator")
        admin, _ = auth.create_user(s, "adm", "admin")
        s.expunge_all()

    seen = []

    def check_committed(job_id: int, kind: str) -> None:
        with session_scope() as s:  # another session sees the row: committed before enqueue
            seen.append(s.get(Job, job_id).status)
        enqueuer(job_id, kind)

    with pytest.raises(Forbidden):
        jobs.launch_job(session, check_committed, "train", preset="tiny", user=annotator)
    job = jobs.launch_job(session, check_committed, "train", preset="tiny", user=admin)
    assert seen == ["queued"] and enqueuer.calls == [(job.id, "train")]
    assert isinstance(session.get(User, admin.id), User)


def test_the_api_launches_by_the_registrys_role_alone(client, admin, annotator, monkeypatch):
    """POST /api/jobs has no role rule of its own: a kind the registry opens to annotators
    launches for them, the rest answer 403 naming the role."""
    import dataclasses

    from app import job_kinds

    r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=annotator)
    assert r.status_code == 403 and "needs role admin" in r.text
    opened = dataclasses.replace(job_kinds.KINDS["train"], launch_role="annotator")
    monkeypatch.setitem(job_kinds.KINDS, "train", opened)
    for who in (annotator, admin):  # open to annotators: to admins too
        r = client.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=who)
        assert r.status_code == 201, r.text


def test_send_to_arena_uses_the_jobs_group_size_capped(settings, session, enqueuer):
    from app.services import datasets, jobs

    datasets.import_dataset(session, filename="shapes.txt", data=b"one red circle\n",
                            name=jobs.SHAPES_DATASET)
    src = jobs.launch_job(session, enqueuer, "train", {"group_size": 40, "num_anchors": 2},
                          preset="tiny")
    job, ckpt = jobs.send_to_arena(session, enqueuer, src.id)
    assert ckpt is None and job.kind == "rollout"
    assert job.config["group_size"] == jobs.ARENA_ROLLOUT_MAX_GROUP
    assert job.config["max_prompts"] == jobs.ARENA_ROLLOUT_PROMPTS
    assert enqueuer.calls[-1] == (job.id, "rollout")
    # each send draws new noises: the same seed sampled the same images again, and the arena
    # offered each pair twice; a rollout job launched by hand counts, another checkpoint not
    assert job.config["seed"] == 0
    assert jobs.send_to_arena(session, enqueuer, src.id)[0].config["seed"] == 1
    jobs.launch_job(session, enqueuer, "rollout", {**job.config, "seed": 7})
    assert jobs.send_to_arena(session, enqueuer, src.id)[0].config["seed"] == 8
    other = datasets.import_dataset(session, filename="o.txt", data=b"two blue squares\n",
                                    name="other").dataset.id
    jobs.launch_job(session, enqueuer, "rollout", {**job.config, "seed": 20, "dataset_id": other})
    assert jobs.send_to_arena(session, enqueuer, src.id)[0].config["seed"] == 9


def test_send_to_arena_samples_only_the_prompts_the_job_trained_on(settings, session, enqueuer):
    """Never another dataset's prompts: with the built-in one deleted it picked the newest
    upload, and a job trained on its config's prompts got the built-in ones."""
    import pytest

    from app.errors import Invalid
    from app.services import datasets, jobs

    other = datasets.import_dataset(session, filename="o.txt", data=b"two blue squares\n",
                                    name="other").dataset.id
    from trainer.shapes.world import all_prompts

    builtin = jobs.launch_job(session, enqueuer, "train", {"num_anchors": 2}, preset="tiny")
    # the built-in prompts' dataset missing (a compose deployment runs `migrate`, never
    # `serve`, which loads it): loaded now, not "deleted: restart the server"
    assert jobs.shapes_dataset_id(session) is None
    job, _ = jobs.send_to_arena(session, enqueuer, builtin.id)
    shapes = jobs.shapes_dataset_id(session)
    assert job.config["dataset_id"] == shapes != other
    assert datasets.prompt_texts(session, shapes, "all") == all_prompts()
    own = jobs.launch_job(session, enqueuer, "train", {"num_anchors": 2,
                                                       "prompts": ["one red circle"]},
                          preset="tiny")
    with pytest.raises(Invalid, match="trained on the 1 prompts of its config"):
        jobs.send_to_arena(session, enqueuer, own.id)
    job, _ = jobs.send_to_arena(session, enqueuer, builtin.id)
    assert job.config["dataset_id"] == shapes
    on_other = jobs.launch_job(session, enqueuer, "train", {"num_anchors": 2}, preset="tiny",
                               dataset_id=other)
    job, _ = jobs.send_to_arena(session, enqueuer, on_other.id)
    assert job.config["dataset_id"] == other
    # a rollout job's own groups (and any kind but train) have no checkpoint of their own to
    # sample: it failed with the train config's errors (ConfigErrors) in the UI
    sent = len(enqueuer.calls)
    with pytest.raises(Invalid, match=f"job {job.id} is a rollout job .*in the arena already"):
        jobs.send_to_arena(session, enqueuer, job.id)
    assert len(enqueuer.calls) == sent


def test_fit_preference_job_config_is_fitconfig_plus_job_settings():
    """The job's config is built from FitConfig's fields: same names, defaults, help texts and
    bounds, so the two cannot drift apart; the job adds only its own three settings."""
    import dataclasses

    from pydantic import ValidationError

    from app.job_kinds import FitPreferenceConfig
    from trainer.rewards.fit_config import FitConfig
    from worker.preference import FIT_FIELDS

    job_fields = FitPreferenceConfig.model_fields
    assert set(job_fields) - set(FIT_FIELDS) == {"min_votes", "score_samples", "device"}
    assert set(FIT_FIELDS) <= set(job_fields)
    for f in dataclasses.fields(FitConfig):
        if f.name == "device":
            continue
        assert job_fields[f.name].default == f.default, f.name
        assert job_fields[f.name].description == f.metadata["help"], f.name
    # FitConfig's bounds are the job's: every one refused at once, each naming its field
    with pytest.raises(ValidationError) as caught:
        FitPreferenceConfig(epochs=0, holdout_fraction=1.0, features="pixels", width=2,
                            learning_rate=0.0)
    assert {e["loc"][0] for e in caught.value.errors()} == {
        "epochs", "holdout_fraction", "features", "width", "learning_rate"}
    assert FitPreferenceConfig(width=64, epochs=3).width == 64


def test_the_worker_reads_a_stored_config_as_stored_without_checking_it_again():
    """Submission validates a kind's config once and stores model_dump(); the worker rebuilds
    that typed form with from_stored (as TrainConfig.from_stored does for train jobs): the same
    values, no validator run again, and a key this version does not know named as an error."""
    from app.job_kinds import EvaluateConfig, FitPreferenceConfig, RolloutConfig
    from trainer.config import ConfigErrors

    given = {RolloutConfig: {"dataset_id": 3, "group_size": 4, "checkpoint_id": 7},
             EvaluateConfig: {"checkpoint_ids": [1, 2], "seeds": [5], "prompts": ["one red circle"]},
             FitPreferenceConfig: {"epochs": 3, "min_votes": 10}}
    for kind, config in given.items():
        stored = kind.model_validate(config).model_dump()
        rebuilt = kind.from_stored(stored)
        assert type(rebuilt) is kind and rebuilt == kind.model_validate(stored)
        assert rebuilt.model_dump() == stored
    # a model registered in the process that accepted the job but not in this one: read as
    # stored (model_validate would refuse it), the sampling code then says what it lacks
    stored = RolloutConfig.model_validate({"dataset_id": 3}).model_dump()
    assert RolloutConfig.from_stored({**stored, "model": "my-model"}).model == "my-model"
    with pytest.raises(ValueError, match="model"):
        RolloutConfig.model_validate({**stored, "model": "my-model"})
    with pytest.raises(ConfigErrors) as err:
        RolloutConfig.from_stored({**stored, "temperature": 1.0, "cfg": 2})
    assert [e.field for e in err.value.errors] == ["temperature", "cfg"]


def test_purposes_and_splits_are_declared_once(client, admin):
    """A rollout group's purposes were listed twice (the service's tuple, the API's Literal)
    and a dataset's splits in four places: the registry now holds each, and the API's enums
    and the service read it."""
    from app import job_kinds
    from app.services import rollouts

    assert job_kinds.PURPOSES == tuple(k.name for k in job_kinds.KINDS.values()
                                       if k.stores_samples) == ("train", "rollout", "evaluate")
    assert rollouts.PURPOSES is job_kinds.PURPOSES
    assert job_kinds.SPLITS == ("train", "eval")
    params = {(path, p["name"]): p["schema"]
              for path in ("/api/rollouts", "/api/prompts")
              for p in client.get("/openapi.json").json()["paths"][path]["get"]["parameters"]}
    enum = {key: next(s["enum"] for s in schema.get("anyOf", [schema]) if "enum" in s)
            for key, schema in params.items() if key[1] in ("purpose", "split")}
    assert enum == {("/api/rollouts", "purpose"): list(job_kinds.PURPOSES),
                    ("/api/prompts", "split"): list(job_kinds.SPLITS)}


def test_the_ui_sends_to_the_arena_by_the_rollout_kinds_role(settings, annotator,
                                                             monkeypatch):
    """"Send newest rollouts to the arena" launches a rollout job: it asked for an admin
    whatever the registry said of the rollout kind; cancel stays an admin's."""
    import dataclasses

    from app import job_kinds
    from app.ui import jobs

    user = {"token": annotator["Authorization"].split(" ", 1)[1]}
    opened = dataclasses.replace(job_kinds.KINDS["rollout"], launch_role="annotator")
    monkeypatch.setitem(job_kinds.KINDS, "rollout", opened)
    assert "needs role admin" in jobs.act(None, "cancel", user, 999_999)
    text = jobs.act(None, "send", user, 999_999)
    assert "needs role" not in text and "999999" in text, text
