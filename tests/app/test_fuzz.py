"""Fuzz /openapi.json with schemathesis (bounded): every operation as an admin and as an
annotator, then a stateful run that follows links between the endpoints (upload a dataset ->
its prompts -> a job -> rollouts -> votes). Never a 500, and every job the API accepted (201)
is one the worker can run: its config passes the worker's own loading (issue 14)."""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Flaky
from schemathesis.generation.modes import GenerationMode

MAX_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
# an annotator reaches fewer handlers (admin operations answer 403 before anything else)
ANNOTATOR_EXAMPLES = int(os.environ.get("FUZZ_ANNOTATOR_EXAMPLES", "10"))
STATEFUL_EXAMPLES = int(os.environ.get("FUZZ_STATEFUL_EXAMPLES", "30"))
STATEFUL_STEPS = int(os.environ.get("FUZZ_STATEFUL_STEPS", "8"))
PROMPTS = b"two red circles\none blue square\nthree green triangles\n"
HYPOTHESIS = {"deadline": None, "derandomize": True, "database": None,
              "suppress_health_check": list(HealthCheck)}


@pytest.fixture
def fuzz_app(settings, admin, annotator, make_group):
    """The app with some real rows (ids 1 and 2 exist: a dataset, a job, rollout groups) and
    this process reported as the one live worker, with the devices it really has (as
    worker/tasks.py `report_worker` does), so a submission is judged against it."""
    import torch
    from fastapi.testclient import TestClient

    from app.db import session_scope
    from app.main import create_app
    from app.services import storage, workers
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE

    app = create_app(settings, enqueuer=lambda job_id, kind: None, mount_ui=False)
    with session_scope() as s:
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        workers.report(s, "fuzz-worker", _queues(), cuda,
                       [torch.cuda.get_device_name(i) for i in range(cuda)])
    with TestClient(app) as c:
        r = c.post("/api/datasets", files={"file": ("p.txt", PROMPTS, "text/plain")},
                   data={"eval_fraction": "0.34"}, headers=admin)
        assert r.status_code == 201, r.text
        r = c.post("/api/jobs", json={"kind": "train", "preset": "tiny"}, headers=admin)
        assert r.status_code == 201, r.text
        for iteration in (1, 2):  # checkpoints 1 and 2 (the shipped base model), to compare
            rel = f"checkpoints/job-1/iter-{iteration:06d}/model.safetensors"
            storage.write_bytes(rel, SHAPES_BASE.read_bytes())
            with session_scope() as s:
                record_checkpoint(s, 1, iteration, rel)
        app.state.config_schema = c.get("/api/jobs/config-schema", headers=admin).json()
        make_group(1, g=3)
        make_group(1, g=4, seed=1, prompt="one blue square")
    app.state.fuzz_headers = {"admin": admin, "annotator": annotator}
    return app


def _queues() -> list[str]:
    from app.job_kinds import QUEUE_NAMES

    return list(QUEUE_NAMES)


def _kind_config(kind: str):
    """The pydantic config model of a non-train kind (the job registry declares it)."""
    from app.job_kinds import KINDS

    return KINDS[kind].config


# --- what the worker does with a job's config, minus the GPU work --------------------------------
_LOADED: dict[tuple, Exception | None] = {}


def base_model(base_checkpoint: str) -> None:
    """trainer.loop.load_model, once per file."""
    from trainer.config import TrainConfig
    from trainer.loop import load_model

    key = ("base", base_checkpoint)
    if key not in _LOADED:
        try:
            load_model(TrainConfig(base_checkpoint=base_checkpoint))
            _LOADED[key] = None
        except Exception as exc:
            _LOADED[key] = exc
    if _LOADED[key] is not None:
        raise _LOADED[key]


def worker_rejects(job) -> list[str]:
    """Why the worker would fail this job before doing any work: the same loading, resolving
    and lookups as worker/training.py, worker/sampling.py and worker/preference.py."""
    from trainer.loop import ITERATIONS, resolve_device
    from trainer.rewards import get_reward
    from trainer.shapes.world import tokenize
    from worker.sampling import reward_names

    cfg: dict[str, Any] = dict(job.config or {})
    problems: list[str] = []

    def attempt(what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # the worker would mark the job failed with this
            problems.append(f"{what}: {type(exc).__name__}: {exc}"[:300])
            return None

    def rewards(names):
        for name in names:
            attempt(f"reward {name!r}", get_reward, name)

    def checkpoint_model(ckpt_id, parsed):
        from worker.sampling import load_sampling_model

        sampled = parsed.model_dump(include={"model", "model_path", "resolution",
                                             "guidance_scale"})
        key = ("checkpoint", ckpt_id, *sampled.values())
        if key not in _LOADED:  # (a checkpoint's file never changes: load each once)
            try:
                load_sampling_model(parsed, ckpt_id)
                _LOADED[key] = None
            except Exception as exc:
                _LOADED[key] = exc
        if _LOADED[key] is not None:
            raise _LOADED[key]

    def drawable(model: str | None, prompts: list[str]) -> None:
        if (model or "shapes") == "shapes":  # the shapes model tokenizes every prompt
            attempt("shapes prompts", tokenize, prompts)

    if job.kind == "train":
        from app.db import session_scope
        from worker.preference import resolve_preference
        from worker.training import train_config_of

        # TrainConfig.from_dict (the dataset's prompts in), the base checkpoint resolved
        with session_scope() as s:
            config = attempt("train_config_of", train_config_of, s, job)
        if config is None:
            return problems
        drawable(config.model, config.prompts)
        rewards([n for n in config.reward_weights if n != "preference"])
        # what Trainer(config) does first: the device ('cuda' needs torch.cuda here), the
        # base model (the shipped one, or base_checkpoint), the method's iteration
        attempt("device", resolve_device, config.device)
        attempt("base model", base_model, config.base_checkpoint)
        attempt("method", ITERATIONS.__getitem__, config.method)
        attempt("preference model", resolve_preference, config)  # when weights name it
        return problems

    model = _kind_config(job.kind)
    parsed = attempt(f"{model.__name__}", model.model_validate, cfg)
    if parsed is None:
        return problems
    if job.kind == "rollout":
        from worker.sampling import dataset_prompts

        prompts = attempt("prompts", dataset_prompts, parsed.dataset_id, parsed.split,
                          parsed.max_prompts)
        if prompts == []:
            problems.append(f"dataset {parsed.dataset_id} has no {parsed.split} prompts")
        drawable(parsed.model, [t for _, t in prompts or []])
        attempt("model", checkpoint_model, parsed.checkpoint_id, parsed)
        rewards(reward_names("rollout", parsed))
    elif job.kind == "evaluate":
        from trainer.shapes.world import all_prompts
        from worker.sampling import dataset_prompts

        for ckpt_id in parsed.checkpoint_ids:
            attempt(f"checkpoint {ckpt_id}", checkpoint_model, ckpt_id, parsed)
        if parsed.prompts:
            prompts = list(parsed.prompts)
        elif parsed.dataset_id:
            prompts = [t for _, t in attempt("prompts", dataset_prompts, parsed.dataset_id,
                                             parsed.split, None) or []]
        else:
            prompts = all_prompts()
        if parsed.max_prompts:
            prompts = prompts[:parsed.max_prompts]
        if not prompts:
            problems.append("no prompts to evaluate")
        drawable(parsed.model, prompts)
        rewards(reward_names("evaluate", parsed))
    elif job.kind == "fit_preference":
        from worker.preference import fit_config_for_job

        # the device resolved (cuda needs torch.cuda), clip_path inside STORAGE/MODELS_DIR
        parsed = attempt("FitPreferenceConfig", _kind_config(job.kind).model_validate, cfg)
        fit = attempt("fit_config_for_job", fit_config_for_job, parsed) if parsed else None
        if fit is not None and fit.features == "clip" and not fit.clip_path:
            problems.append("features 'clip' without clip_path")
        # (min_votes is checked when the job runs: votes may still arrive while it waits)
    return problems


def may_run_again(session, job) -> bool:
    """Whether a worker may still get this job: it is queued or running, or it ended and the
    app would resume it (what it names, a dataset say, may have been deleted since; then
    resume answers 409 and the worker never sees it)."""
    from app.errors import Conflict
    from app.models import FINISHED_JOB_STATUSES
    from app.services import jobs

    if job.status not in FINISHED_JOB_STATUSES:
        return True
    try:
        jobs.check_still_valid(session, job)
    except Conflict:
        return False
    return True


def assert_worker_accepts_every_job() -> None:
    from sqlalchemy import select

    from app.db import session_scope
    from app.models import Job

    with session_scope() as s:
        jobs = list(s.scalars(select(Job).order_by(Job.id)))
        rejected = [f"job {job.id} ({job.kind}) {problems}: {str(job.config)[:300]}"
                    for job in jobs
                    if may_run_again(s, job) and (problems := worker_rejects(job))]
    assert jobs, "no job was created"
    assert not rejected, "accepted (201) but the worker would fail:\n" + "\n".join(rejected)


# --- every operation, as each role ---------------------------------------------------------------
@pytest.mark.parametrize("role", ["admin", "annotator"])
def test_api_never_500s(fuzz_app, role):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    headers = fuzz_app.state.fuzz_headers[role]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 18
    failures: list[str] = []
    statuses: dict[int, int] = {}

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES if role == "admin" else ANNOTATOR_EXAMPLES,
                  **HYPOTHESIS)
        def run(case):
            response = case.call(headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{role}: {case.method} {case.formatted_path} {case.query} "
                                f"{str(case.body)[:200]} -> {response.status_code}")

        run()
    print(role, "status codes seen:", dict(sorted(statuses.items())))
    assert not failures, "\n".join(failures)
    assert statuses.get(200, 0) + statuses.get(201, 0) > 40  # it reached the real handlers
    if role == "annotator":
        assert statuses.get(403, 0) > 0  # the admin-only operations refused it
    assert_worker_accepts_every_job()


# --- stateful: links between the endpoints ------------------------------------------------------
def _links(spec: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """(method, path, status) of a source operation -> its OpenAPI links, by name."""
    def op(method: str, path: str) -> str:
        return spec["paths"][path][method]["operationId"]

    def vote(a: str, b: str) -> dict[str, Any]:
        return {"operationId": op("post", "/api/votes"),
                "requestBody": {"sample_a_id": a, "sample_b_id": b, "outcome": "a"}}

    def launch(body: dict[str, Any]) -> dict[str, Any]:
        # exactly this body: merged into a generated one of another kind it is only a 422
        return {"operationId": op("post", "/api/jobs"), "requestBody": body,
                "x-schemathesis": {"merge_body": False}}

    dataset = {"parameters": {"path.dataset_id": "$response.body#/id"}}
    job = {"parameters": {"path.job_id": "$response.body#/id"}}
    return {
        ("post", "/api/datasets", "201"): {
            "Prompts": {"operationId": op("get", "/api/prompts"),
                        "parameters": {"query.dataset_id": "$response.body#/id"}},
            "Get": {"operationId": op("get", "/api/datasets/{dataset_id}"), **dataset},
            "Export": {"operationId": op("get", "/api/datasets/{dataset_id}/export"), **dataset},
            "Delete": {"operationId": op("delete", "/api/datasets/{dataset_id}"), **dataset},
            "Rollout": launch({"kind": "rollout", "config": {"dataset_id": "$response.body#/id"}}),
            "RolloutEval": launch({"kind": "rollout", "config": {
                "dataset_id": "$response.body#/id", "split": "eval"}}),
            "Evaluate": launch({"kind": "evaluate", "config": {
                "dataset_id": "$response.body#/id", "checkpoint_ids": [1, 2]}}),
        },
        ("get", "/api/prompts", "200"): {
            "TrainOnPrompt": launch({"kind": "train", "preset": "tiny", "config": {
                "prompts": ["$response.body#/items/0/text"]}}),
            "RolloutOfDataset": launch({"kind": "rollout", "config": {
                "dataset_id": "$response.body#/items/0/dataset_id"}}),
            "EvaluateOnPrompt": launch({"kind": "evaluate", "config": {
                "prompts": ["$response.body#/items/0/text"], "checkpoint_ids": [1, 2]}}),
        },
        ("post", "/api/jobs", "201"): {
            "Get": {"operationId": op("get", "/api/jobs/{job_id}"), **job},
            "Cancel": {"operationId": op("post", "/api/jobs/{job_id}/cancel"), **job},
            "Resume": {"operationId": op("post", "/api/jobs/{job_id}/resume"), **job},
            "Rollouts": {"operationId": op("get", "/api/rollouts"),
                         "parameters": {"query.job_id": "$response.body#/id"}},
            "Checkpoints": {"operationId": op("get", "/api/checkpoints"),
                            "parameters": {"query.job_id": "$response.body#/id"}},
        },
        ("post", "/api/jobs/{job_id}/cancel", "200"): {
            "Resume": {"operationId": op("post", "/api/jobs/{job_id}/resume"), **job}},
        ("get", "/api/rollouts", "200"): {
            "Group": {"operationId": op("get", "/api/rollouts/{group_id}"),
                      "parameters": {"path.group_id": "$response.body#/items/0/id"}},
            "Vote": vote("$response.body#/items/0/samples/0/id",
                         "$response.body#/items/0/samples/1/id"),
        },
        ("get", "/api/rollouts/{group_id}", "200"): {
            "Vote": vote("$response.body#/samples/0/id", "$response.body#/samples/1/id")},
        ("get", "/api/votes/next", "200"): {
            "Vote": vote("$response.body#/a/sample_id", "$response.body#/b/sample_id")},
        ("post", "/api/votes", "201"): {
            "Next": {"operationId": op("get", "/api/votes/next")},
            "Export": {"operationId": op("get", "/api/votes/export")}},
    }


# the values a generated job config draws from where the API's schema says only "a string" or
# "an integer": real rows and files (ids 1-2, checkpoints/job-1/...), and a few that are not
CKPT = "checkpoints/job-1/iter-000001/model.safetensors"
IMAGE = "rollouts/0000/1/000.png"  # a stored file, but no model
NARROWED: dict[str, dict[str, Any]] = {
    "dataset_id": {"type": "integer", "minimum": 1, "maximum": 4},
    "checkpoint_id": {"type": "integer", "minimum": 1, "maximum": 3},
    "checkpoint_ids": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3},
                       "minItems": 2, "maxItems": 3},
    "prompts": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    "seeds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 1, "maxItems": 3},
    "max_prompts": {"type": "integer", "minimum": 1, "maximum": 5},
    "base_checkpoint": {"enum": ["", CKPT, f"data/storage/{CKPT}", IMAGE, "/etc/hostname",
                                 "missing.safetensors"]},
    "preference_model": {"enum": ["", "latest", "v1", "preference/v1.safetensors"]},
    "clip_path": {"enum": ["", "clip", "checkpoints", "/etc"]},
}


def typed_job_in(published: dict[str, Any]) -> dict[str, Any]:
    """JobIn with each kind's config typed, from what GET /api/jobs/config-schema publishes
    (the train fields' types, ranges and choices; the other kinds' JSON schemas), so that the
    fuzzer sends configs the API documents as valid and the worker's checks are reached."""
    from trainer.rewards import reward_names

    names = {"enum": [*reward_names(), "preference", "no_such_reward"]}
    narrowed = {**NARROWED, "reward_names": {"type": "array", "items": names, "maxItems": 3},
                "reward_weights": {"type": "object", "propertyNames": names, "maxProperties": 3,
                                   "additionalProperties": {"type": "number", "minimum": -2,
                                                            "maximum": 2}}}

    def field(name: str, original: dict[str, Any]) -> dict[str, Any]:
        if name not in narrowed:
            return original
        nullable = any(o.get("type") == "null" for o in original.get("anyOf", []))
        return {"anyOf": [narrowed[name], {"type": "null"}]} if nullable else narrowed[name]

    types = {"int": "integer", "float": "number", "bool": "boolean", "str": "string",
             "list": "array", "dict": "object"}
    train = {}
    for f in published["train"]:
        one: dict[str, Any] = {"enum": f["choices"]} if f["choices"] else {
            "type": types.get(f["type"], "string")}
        if f["min"] is not None:
            one["minimum"] = f["min"]
        if f["max"] is not None:
            one["maximum"] = f["max"]
        train[f["name"]] = field(f["name"], one)
    variants = [{"type": "object", "additionalProperties": False, "required": ["kind"],
                 "properties": {"kind": {"enum": ["train"]},
                                "preset": {"enum": [None, *published["presets"]]},
                                "config": {"type": "object", "properties": train,
                                           "additionalProperties": False}}}]
    for kind, model in published.items():
        if kind in ("train", "presets"):
            continue
        config = copy.deepcopy(model)
        config["properties"] = {k: field(k, v) for k, v in config["properties"].items()}
        variants.append({"type": "object", "additionalProperties": False,
                         "required": ["kind", "config"],
                         "properties": {"kind": {"enum": [kind]}, "config": config}})
    return {"oneOf": variants}


def linked_schema(app):
    """The app's OpenAPI document with the links above added to its responses, and JobIn
    typed (`typed_job_in`)."""
    spec = copy.deepcopy(app.openapi())
    spec["components"]["schemas"]["JobIn"] = typed_job_in(app.state.config_schema)
    for (method, path, status), links in _links(spec).items():
        response = spec["paths"][path][method]["responses"].setdefault(
            status, {"description": "linked"})
        response.setdefault("links", {}).update(links)
    schema = schemathesis.openapi.from_dict(spec)
    schema.app = app
    # valid requests only: a workflow, not a negative test (those drop the token header)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE])
    return schema


GOALS = [("POST /api/datasets", (201,)), ("POST /api/jobs", (201,)), ("GET /api/rollouts", (200,)),
         ("POST /api/votes", (200, 201))]


def test_stateful_links_never_500(fuzz_app, make_group):
    schema = linked_schema(fuzz_app)
    headers = fuzz_app.state.fuzz_headers
    failures: list[str] = []
    seen: dict[str, int] = {}

    class Links(schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case):
            # annotators vote; admins upload, launch and manage
            role = "annotator" if case.path.startswith("/api/votes") else "admin"
            kwargs: dict[str, Any] = {"headers": headers[role]}
            if case.method == "POST" and case.path == "/api/datasets":
                # a real prompts file (random bytes are only ever a 400: test_api_never_500s
                # has those), split as generated, so that the links have prompts to follow
                body = case.body if isinstance(case.body, dict) else {}
                fraction = body.get("eval_fraction", 0.0)
                kwargs["files"] = {"file": ("prompts.txt", PROMPTS, "text/plain")}
                kwargs["data"] = {"name": f"fuzz-{uuid.uuid4().hex[:8]}", "eval_fraction":
                                  str(fraction if isinstance(fraction, float) else 0.0)}
            return kwargs

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            key = f"{case.method} {case.path} {response.status_code}"
            seen[key] = seen.get(key, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} {case.query} "
                                f"{str(case.body)[:300]} -> {response.status_code}")

    def reached() -> bool:  # the chain was followed: uploaded, launched, listed, voted
        return all(any(seen.get(f"{op} {code}") for code in codes) for op, codes in GOALS)

    # The chain once by hand, every run: upload -> prompts -> launch -> its rollouts -> vote on
    # them -> pair -> vote (the links below are followed at random by schemathesis, a
    # true-random coin, so they may not be).
    from fastapi.testclient import TestClient

    with TestClient(schema.app) as c:
        def call(method: str, path: str, role: str, **kw: Any) -> Any:
            r = c.request(method, path, headers=headers[role], **kw)
            seen[f"{method} {path} {r.status_code}"] = seen.get(
                f"{method} {path} {r.status_code}", 0) + 1
            assert r.status_code < 500, r.text
            return r

        ds = call("POST", "/api/datasets", "admin", data={"name": "chain"},
                  files={"file": ("chain.txt", PROMPTS, "text/plain")}).json()
        call("GET", "/api/prompts", "admin", params={"dataset_id": ds["id"]})
        job = call("POST", "/api/jobs", "admin", json={"kind": "train", "preset": "tiny",
                                                       "dataset_id": ds["id"]}).json()
        # no worker runs here: its first iteration's group is recorded as the worker would
        make_group(job["id"], g=3)
        groups = call("GET", "/api/rollouts", "admin", params={"job_id": job["id"]}).json()
        samples = groups["items"][0]["samples"]  # a pair of one group, as the UI's grid votes
        # 201 itself: GOALS' vote is also met by the pair's vote below
        assert call("POST", "/api/votes", "annotator", json={
            "client_vote_id": "chain-rollouts", "sample_a_id": samples[0]["id"],
            "sample_b_id": samples[1]["id"], "outcome": "b"}).status_code == 201
        pair = call("GET", "/api/votes/next", "annotator").json()
        call("POST", "/api/votes", "annotator", json={
            "client_vote_id": "chain", "sample_a_id": pair["a"]["sample_id"],
            "sample_b_id": pair["b"]["sample_id"], "outcome": "a"})
    assert reached(), f"the chain by hand did not get through: {sorted(seen)}"

    # Then the links, as schemathesis' own runner does: generation only, and a run that the
    # API's state (rows made by earlier scenarios) makes replay differently ends early instead
    # of failing.
    run_settings = settings(max_examples=STATEFUL_EXAMPLES, stateful_step_count=STATEFUL_STEPS,
                            phases=[Phase.generate], **{**HYPOTHESIS, "derandomize": False})
    for _attempt in range(2):
        with contextlib.suppress(Flaky):
            Links.run(settings=run_settings)
    print("stateful responses:", dict(sorted(seen.items())))
    assert not failures, "\n".join(failures)
    assert_worker_accepts_every_job()
