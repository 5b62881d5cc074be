"""Input the API must answer with a 4xx naming the field, never a 500: NaN and infinity in a
JSON body, dates out of range, over-long paths, odd preference specs, deep or broken uploads,
NUL characters; and what it must not take (unknown fields, unbounded weights)."""

from __future__ import annotations

import gzip
import json

from sqlalchemy import func, select


def _raw(client, path, text, headers):
    """POST `text` as JSON as is: NaN and Infinity are tokens Python's json reads (and FastAPI
    accepts), which a client library would refuse to write."""
    return client.post(path, content=text.encode(),
                       headers={**headers, "Content-Type": "application/json"})


def _errors(response) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json()["errors"]}


# --- 1. NaN / Infinity in a field that fails validation ----------------------------------------
def test_nan_in_a_refused_body_field_is_a_422_naming_it(client, admin, annotator):
    r = _raw(client, "/api/votes", '{"client_vote_id": "v1", "sample_a_id": 1, "sample_b_id": 2,'
             ' "outcome": "a", "latency_ms": NaN}', annotator)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "latency_ms"
    # and the pair's own problem beside it (no samples exist here)
    assert _errors(r) == {"latency_ms": "must be a finite number",
                          "sample_a_id": "sample 1 not found",
                          "sample_b_id": "sample 2 not found"}
    assert r.json()["detail"].startswith("latency_ms: must be a finite number; ")

    r = _raw(client, "/api/jobs", '{"kind": "train", "dataset_id": NaN}', admin)
    assert r.status_code == 422, r.text
    assert _errors(r) == {"dataset_id": "must be a finite number"}
    r = _raw(client, "/api/jobs", '{"kind": "train", "dataset_id": -Infinity, "preset": 5}',
             admin)
    assert r.status_code == 422 and set(_errors(r)) == {"dataset_id", "preset"}  # every one


def test_a_request_validation_error_has_the_projects_shape(client, admin):
    r = client.post("/api/jobs", json={"kind": "nope", "config": [], "extra": 1}, headers=admin)
    assert r.status_code == 422
    body = r.json()
    assert set(body) == {"detail", "field", "errors"}
    assert set(_errors(r)) == {"kind", "config", "extra"}
    assert all(f"{e['field']}: {e['message']}" in body["detail"] for e in body["errors"])
    r = _raw(client, "/api/jobs", '{"kind": "train",', admin)
    assert r.status_code == 422 and r.json()["field"] == "body"
    assert r.json()["errors"][0]["message"].startswith("malformed JSON")
    r = client.get("/api/jobs", params={"limit": "x"}, headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "limit"
    # JSON sent as a form (curl -d without -H), as text/plain or without a type: the header
    # is what to fix (a form was answered "Input should be a valid dictionary")
    for content_type in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "text/plain", None):
        headers = {**admin, **({"Content-Type": content_type} if content_type else {})}
        r = client.post("/api/jobs", content=b'{"kind": "train", "config": {}}', headers=headers)
        assert r.status_code == 422 and "Content-Type: application/json" in r.text, r.text


def test_a_job_request_with_a_bad_envelope_lists_its_configs_problems_too(client, admin,
                                                                          annotator):
    """An unknown top-level field hid the config's problems until it was removed."""
    body = {"kind": "train", "config": {"bogus": 1, "iterations": "x"}, "extra": 5}
    r = client.post("/api/jobs", json=body, headers=admin)
    assert r.status_code == 422
    assert set(_errors(r)) == {"extra", "bogus", "iterations"}, r.text
    # the config's checks are for those who may launch the kind
    r = client.post("/api/jobs", json=body, headers=annotator)
    assert r.status_code in (403, 422) and "bogus" not in r.text


def test_json_nested_too_deep_to_parse_is_a_422_like_other_malformed_json(client, admin):
    """It was FastAPI's 400 "There was an error parsing the body", in another shape."""
    deep = "[" * 100_000 + "]" * 100_000
    r = _raw(client, "/api/jobs", deep, admin)
    assert r.status_code == 422, r.text
    assert r.json() == {"detail": "body: malformed JSON (nested too deeply)", "field": "body",
                        "errors": [{"field": "body", "message": "malformed JSON (nested too "
                                                               "deeply)"}]}
    # a body that is not UTF-8, and one compressed, say which (both were "unreadable")
    r = client.post("/api/jobs", content=b'{"kind": "\xff"}',
                    headers={**admin, "content-type": "application/json"})
    assert r.status_code == 422 and _errors(r) == {"body": "malformed JSON (not UTF-8 text)"}
    r = client.post("/api/jobs", content=gzip.compress(b'{"kind": "train"}'), headers={
        **admin, "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 422, r.text
    assert _errors(r) == {"body": "malformed JSON (Content-Encoding 'gzip' is not accepted: "
                                  "send it uncompressed)"}, r.text
    # other HTTP errors keep FastAPI's answer
    assert client.get("/api/no-such-route", headers=admin).status_code == 404
    assert client.put("/api/jobs", headers=admin).status_code == 405


def test_every_422_the_services_raise_has_the_projects_shape(client, admin, annotator):
    """Not only validation errors: an upload's content, a vote's pair, a user's name."""
    cases = [
        client.post("/api/datasets", files={"file": ("empty.txt", b"\n", "text/plain")},
                    headers=admin),
        client.post("/api/datasets", files={"file": ("bin.txt", b"\xff\xfe\x00x", "text/plain")},
                    headers=admin),
        client.post("/api/votes", json={"client_vote_id": "v", "sample_a_id": 1,
                                        "sample_b_id": 1, "outcome": "a"}, headers=annotator),
        client.post("/api/users", json={"name": "   "}, headers=admin),
    ]
    for r in cases:
        assert r.status_code == 422, r.text
        body = r.json()
        assert {"detail", "field", "errors"} <= set(body), body
        assert [e["field"] for e in body["errors"]] == [body["field"]]
        assert body["errors"][0]["message"] in body["detail"]


def test_openapi_documents_the_422_that_is_sent(client):
    schema = client.get("/openapi.json").json()
    problems = schema["components"]["schemas"]["HTTPValidationError"]
    assert set(problems["properties"]) == {"detail", "field", "errors"}
    assert problems["properties"]["errors"]["items"] == {"$ref": "#/components/schemas/FieldProblem"}
    assert "FieldProblem" in schema["components"]["schemas"]
    assert "#/components/schemas/ValidationError\"" not in json.dumps(schema)


def test_nan_in_a_job_config_says_finite(client, admin, session):
    from app.models import Job

    r = _raw(client, "/api/jobs", '{"kind": "rollout", "config": {"dataset_id": 1, "sigma": NaN,'
             ' "guidance_scale": Infinity}}', admin)
    assert r.status_code == 422, r.text
    errors = _errors(r)
    assert errors["sigma"] == "must be a finite number"
    assert errors["guidance_scale"] == "must be a finite number"
    r = _raw(client, "/api/jobs", '{"kind": "train", "preset": "tiny", "config": '
             '{"sigma": NaN}}', admin)
    assert r.status_code == 422 and "must be a finite number" in _errors(r)["sigma"]
    assert session.scalar(select(func.count()).select_from(Job)) == 0


# --- 2. a datetime that leaves Python's range in UTC --------------------------------------------
def test_shown_at_out_of_range_in_utc_is_a_422_on_that_field(client, annotator):
    for shown_at in ("9999-12-31T23:00:00-05:00", "0001-01-01T01:00:00+05:00"):
        r = client.post("/api/votes", json={"client_vote_id": "v1", "sample_a_id": 1,
                                            "sample_b_id": 2, "outcome": "a",
                                            "shown_at": shown_at}, headers=annotator)
        assert r.status_code == 422, r.text
        assert "between 0001-01-01 and 9999-12-31" in _errors(r)["shown_at"]


# --- 3. paths the file system cannot take -------------------------------------------------------
LONG_PART = "a" * 300  # over NAME_MAX (255)
DEEP = "/".join(["b" * 200] * 20)  # each part fine, 4019 characters: over PATH_MAX under a root


def _post_job(client, headers, kind, config, preset=None):
    body = {"kind": kind, "config": config, **({"preset": preset} if preset else {})}
    return client.post("/api/jobs", json=body, headers=headers)


def test_over_long_job_paths_are_422_naming_the_field(client, admin, vote_seeder):
    vote_seeder(4)  # a fit_preference job is accepted only with votes to fit
    for value in (LONG_PART, DEEP, "/" + DEEP, f"x/{LONG_PART}/y"):
        r = _post_job(client, admin, "train", {"base_checkpoint": value}, "tiny")
        assert r.status_code == 422, r.text
        assert set(_errors(r)) == {"base_checkpoint"}, r.text
        r = _post_job(client, admin, "train", {"model": "flux", "model_path": value}, "tiny")
        assert r.status_code == 422 and "model_path" in _errors(r), r.text
        r = _post_job(client, admin, "train", {"reward_weights": {"count": 1, "preference": 1},
                                               "preference_model": value}, "tiny")
        assert r.status_code == 422 and set(_errors(r)) == {"preference_model"}, r.text
        r = _post_job(client, admin, "train", {"reward_weights": {"hpsv2": 1},
                                               "reward_model_paths": {"hpsv2": value}}, "tiny")
        assert r.status_code == 422 and set(_errors(r)) == {"reward_model_paths"}, r.text
        r = _post_job(client, admin, "fit_preference", {"features": "clip", "clip_path": value})
        assert r.status_code == 422 and set(_errors(r)) == {"clip_path"}, r.text
        r = _post_job(client, admin, "evaluate", {"checkpoint_ids": [1], "model": "flux",
                                                  "model_path": value})
        assert r.status_code == 422 and "model_path" in _errors(r), r.text
    r = _post_job(client, admin, "train", {"base_checkpoint": LONG_PART})
    assert "name part too long" in _errors(r)["base_checkpoint"]


def test_train_config_text_fields_are_capped(client, admin):
    from trainer.config import MAX_TEXT, TrainConfig

    long = "c" * (MAX_TEXT + 1)
    problems = TrainConfig(
        model="flux", base_checkpoint=long, model_path=long, preference_model=long,
        reward_server_url=long, report_to=long, reward_model_paths={"hpsv2": long}).problems()
    for name in ("base_checkpoint", "model_path", "preference_model", "reward_server_url",
                 "report_to", "reward_model_paths"):
        assert any(e.field == name and f"at most {MAX_TEXT} characters" in e.message
                   for e in problems), (name, problems)
    r = _post_job(client, admin, "train", {"base_checkpoint": long}, "tiny")
    assert r.status_code == 422 and "at most 4096 characters" in _errors(r)["base_checkpoint"]
    r = _post_job(client, admin, "fit_preference", {"clip_path": long})
    # (no votes here: the shortage is reported beside the bad field, every problem at once)
    assert r.status_code == 422 and set(_errors(r)) == {"clip_path", "min_votes"}


def test_model_dir_problem_says_why_an_unreadable_path_is_no_model(tmp_path):
    from trainer.models import model_dir_problem

    problem = model_dir_problem("flux", tmp_path / LONG_PART)
    assert problem is not None and "cannot be read" in problem


# --- 4. the preference_model spec, read one way ------------------------------------------------
def test_preference_spec_digits_are_ascii_only():
    from app.services.preference import PreferenceSpec, parse_spec

    assert parse_spec(" latest ") == parse_spec("") == PreferenceSpec("latest")
    assert parse_spec("v12") == parse_spec("12") == PreferenceSpec("version", version=12)
    for spec in ("²", "v²", "v٣", "v1²", "vv1", "v", "v-1", "preference/v1.safetensors"):
        assert parse_spec(spec) == PreferenceSpec("path", path=spec), spec


def test_superscript_preference_versions_are_a_422_not_a_500(client, admin):
    for spec in ("²", "v²", "v٣", f"v{2**40}"):
        r = _post_job(client, admin, "train", {"reward_weights": {"count": 1, "preference": 1},
                                               "preference_model": spec}, "tiny")
        assert r.status_code == 422, (spec, r.text)
        assert set(_errors(r)) == {"preference_model"}, r.text


def test_the_worker_reads_the_spec_as_submission_does(settings):
    import pytest

    from trainer.config import TrainConfig
    from worker.lease import JobError
    from worker.preference import resolve_preference

    def config(spec: str) -> TrainConfig:
        return TrainConfig(reward_weights={"count": 1.0, "preference": 1.0},
                           preference_model=spec)

    for spec in ("²", "v²"):
        with pytest.raises(FileNotFoundError, match="preference_model"):
            resolve_preference(config(spec))
    for spec in ("v3", f"v{2**40}"):  # gone while the job waited: said, not traced back
        with pytest.raises(JobError, match=r"^preference_model: preference model v\d+ not "
                           "found"):
            resolve_preference(config(spec))


# --- 5-8. uploads: deep metadata, unreadable parquet columns, .txt lines, every bad row ----------
def _upload(client, headers, filename, data, **form):
    return client.post("/api/datasets", files={"file": (filename, data, "application/octet-stream")},
                       data={k: str(v) for k, v in form.items()}, headers=headers)


def _counts(session):
    from app.models import Dataset, Prompt

    session.expire_all()
    return (session.scalar(select(func.count()).select_from(Dataset)),
            session.scalar(select(func.count()).select_from(Prompt)))


def _parquet(table) -> bytes:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def test_deeply_nested_metadata_is_refused_by_line(client, admin, session):
    from app.services.datasets import MAX_META_DEPTH

    deep = '{"prompt": "x", "m": ' + "[" * 600 + "1" + "]" * 600 + "}"
    r = _upload(client, admin, "deep.jsonl", f'{{"prompt": "ok"}}\n{deep}\n'.encode())
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == (f"deep.jsonl: line 2: metadata nested deeper than "
                                  f"{MAX_META_DEPTH} levels")
    assert r.json()["line"] == 2
    r = _upload(client, admin, "deep.json", f'["ok", {deep}]'.encode())
    assert r.status_code == 422 and r.json()["detail"].startswith("deep.json: item 2: metadata")
    # as deep as allowed: stored, and exported as it came
    fine = '{"prompt": "y", "m": ' + "[" * (MAX_META_DEPTH - 1) + "]" * (MAX_META_DEPTH - 1) + "}"
    r = _upload(client, admin, "fine.jsonl", fine.encode())
    assert r.status_code == 201, r.text
    exported = client.get(f"/api/datasets/{r.json()['id']}/export", headers=admin).text
    assert json.loads(exported)["metadata"] == {"m": json.loads(fine)["m"]}
    assert _counts(session) == (1, 1)


def test_json_safe_and_nesting_depth_need_no_recursion():
    from app.json_values import json_safe
    from app.services.datasets import nesting_depth

    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    node.append(float("nan"))
    assert nesting_depth(deep, limit=10) == 11
    assert nesting_depth(deep, limit=10_000) == 5001
    safe = json_safe({"a": (1.0, float("inf"), {"b": deep})})
    assert safe["a"][:2] == [1.0, None]
    node = safe["a"][2]["b"]
    for _ in range(5000):
        node = node[0]
    assert node == [None]


def test_parquet_dates_out_of_pythons_range_name_the_column(client, admin, session):
    import pyarrow as pa

    table = pa.table({"prompt": ["a", "b"],
                      "shot_at": pa.array([0, 300_000_000_000_000], type=pa.timestamp("ms")),
                      "day": pa.array([0, 1], type=pa.date32())})
    r = _upload(client, admin, "t.parquet", _parquet(table))
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("t.parquet: column 'shot_at' holds values that cannot "
                                         "be read")
    assert r.json()["column"] == "shot_at"
    table = pa.table({"prompt": ["a"], "day": pa.array([2**31 - 1], type=pa.date32())})
    r = _upload(client, admin, "d.parquet", _parquet(table))
    assert r.status_code == 422 and "column 'day'" in r.json()["detail"]
    two = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["prompt", "prompt"])
    r = _upload(client, admin, "two.parquet", _parquet(two))
    assert r.status_code == 422 and "prompt" in r.json()["detail"]  # pyarrow refuses it
    assert _counts(session) == (0, 0)


def test_txt_lines_end_at_newlines_only(client, admin):
    data = "red circle\u2028blue square\nform\x0cfeed\x1cand\x1dseparators\r\nthird\n".encode()
    r = _upload(client, admin, "u.txt", data)
    assert r.status_code == 201, r.text
    assert r.json()["num_prompts"] == 3
    texts = [p["text"] for p in client.get("/api/prompts", params={
        "dataset_id": r.json()["id"]}, headers=admin).json()["items"]]
    assert texts == ["red circle blue square", "form feed and separators", "third"]
    # line numbers count "\n" alone, as an editor does
    r = _upload(client, admin, "n.txt", "a\u2028b\nc\x0bd\n".encode() + b"x" * 2001 + b"\n")
    assert r.status_code == 422 and r.json()["detail"].startswith("n.txt: line 3: prompt too long")


def test_every_bad_row_is_reported_at_once(client, admin, session):
    r = _upload(client, admin, "m.jsonl", b'{"prompt": "ok"}\n{"prompt": oops}\n[1]\n\n'
                b'{"text": "x"}\n{"prompt": "  "}\n{"prompt": 3}\n{"prompt": "fine"}\n')
    assert r.status_code == 422, r.text
    body = r.json()
    assert [(e["line"], e["message"].split(" (")[0]) for e in body["errors"]] == [
        (2, "malformed JSON"), (3, "expected a JSON object"), (5, "missing key 'prompt'"),
        (6, "empty prompt"), (7, "'prompt' must be a string")]
    assert body["detail"].startswith("m.jsonl: line 2: malformed JSON")
    assert "; m.jsonl: line 7: 'prompt' must be a string" in body["detail"]
    assert (body["line"], body["field"], body["error_count"]) == (2, "file", 5)

    r = _upload(client, admin, "r.csv", b"prompt,a\nok,1\nbad,1,2\n  ,2\nfine,3\nx\n")
    assert [e["where"] for e in r.json()["errors"]] == [
        "line 3 (row 2)", "line 4 (row 3)", "line 6 (row 5)"]

    # many: the first MAX_REPORTED in full, the rest counted
    from app.services.datasets import MAX_REPORTED

    lines = b"".join(b"x" * 2001 + b"\n" if i % 2 else b"ok %d\n" % i for i in range(100))
    r = _upload(client, admin, "many.txt", lines)
    assert r.status_code == 422
    body = r.json()
    assert len(body["errors"]) == MAX_REPORTED and body["error_count"] == 50
    assert [e["line"] for e in body["errors"]] == list(range(2, 2 * MAX_REPORTED + 1, 2))
    assert body["detail"].endswith(f"and {50 - MAX_REPORTED} more bad record(s)")
    assert _counts(session) == (0, 0)


def test_a_train_jobs_dataset_is_checked_with_its_config(client, admin, session):
    from app.models import Job

    r = client.post("/api/jobs", json={"kind": "train", "preset": "nope",
                                       "dataset_id": 999999}, headers=admin)
    assert r.status_code == 422
    assert [e["field"] for e in r.json()["errors"]] == ["preset", "dataset_id"]
    assert r.json()["detail"].startswith("preset: unknown preset 'nope'")
    assert "; dataset_id: dataset 999999 not found" in r.json()["detail"]
    r = client.post("/api/jobs", json={"kind": "train", "config": {"group_size": 1},
                                       "dataset_id": 999999}, headers=admin)
    assert [e["field"] for e in r.json()["errors"]] == ["dataset_id", "group_size"]
    assert "config.group_size" in r.json()["detail"]
    assert session.scalar(select(func.count()).select_from(Job)) == 0


# --- 9. reward weights are bounded --------------------------------------------------------------
def test_reward_weights_are_bounded(client, admin, session):
    from app.models import Job
    from trainer.config import MAX_REWARD_WEIGHT, TrainConfig

    for weight in (1e308, -1e7, 10**400, MAX_REWARD_WEIGHT * 1.01):
        r = _post_job(client, admin, "train", {"reward_weights": {"count": weight}}, "tiny")
        assert r.status_code == 422, (weight, r.text)
        assert "'count': the weight must be in [-1e+06, 1e+06]" in _errors(r)["reward_weights"]
    r = _raw(client, "/api/jobs", '{"kind": "train", "preset": "tiny", "config": '
             '{"reward_weights": {"count": Infinity}}}', admin)
    assert r.status_code == 422 and "finite numbers" in _errors(r)["reward_weights"]
    assert session.scalar(select(func.count()).select_from(Job)) == 0
    assert not TrainConfig(reward_weights={"count": MAX_REWARD_WEIGHT,
                                           "color": -MAX_REWARD_WEIGHT}).problems()


# --- 10. a registered model can be configured ---------------------------------------------------
def _register_custom(monkeypatch, name: str = "custom", directory: list[str] | None = None):
    import trainer.models as models

    for table in ("_MODELS", "_WEIGHT_FORMATS", "_DIRECTORY_FILES"):  # restored after the test
        monkeypatch.setattr(models, table, dict(getattr(models, table)))
    models.register_model(name, lambda spec, device: None, directory_files=directory)


def test_a_registered_model_is_a_configurable_model(client, admin, monkeypatch):
    from app.job_kinds import RolloutConfig
    from trainer.config import TrainConfig

    assert "must be one of ['shapes', 'flux', 'sd3'], got 'custom'" in _errors(_post_job(
        client, admin, "train", {"model": "custom"}, "tiny"))["model"]
    _register_custom(monkeypatch)
    config = {"model": "custom", "reward_weights": {"jpeg_compressibility": 1.0}}
    assert TrainConfig.from_dict(config).model == "custom"
    r = _post_job(client, admin, "train", config, "tiny")
    assert r.status_code == 201, r.text
    assert r.json()["config"]["model"] == "custom"
    assert RolloutConfig(dataset_id=1, model="custom").model == "custom"
    r = _post_job(client, admin, "rollout", {"dataset_id": 1, "model": "unet"})
    assert "must be one of ['shapes', 'custom', 'flux', 'sd3'], got 'unet'" in _errors(r)["model"]
    # the forms and the schema list it (the built-in default first)
    schema = client.get("/api/jobs/config-schema", headers=admin).json()
    train = {f["name"]: f for f in schema["train"]}
    assert train["model"]["choices"] == ["shapes", "custom", "flux", "sd3"]
    assert schema["rollout"]["properties"]["model"]["anyOf"][0]["enum"] == [
        "shapes", "custom", "flux", "sd3"]


def test_one_resolution_rule_for_a_train_config_a_rollout_and_the_cli(client, admin,
                                                                      monkeypatch):
    """trainer.config.resolution_problem is the rule everywhere: a registered model checks
    its own sides (neither a train config nor a rollout refuses 100 px for it), flux takes
    multiples of 16 and shapes its 32 px, with the same words at each door."""
    import argparse

    from trainer.cli import _model_spec
    from trainer.config import ConfigError, TrainConfig

    def train_problems(model: str, resolution: int) -> dict[str, str]:
        return {e.field: e.message for e in TrainConfig(
            model=model, resolution=resolution,
            reward_weights={"jpeg_compressibility": 1.0}).problems()}

    def rollout_problems(model: str, resolution: int) -> dict[str, str]:
        r = _post_job(client, admin, "rollout", {"model": model, "resolution": resolution})
        return _errors(r) if r.status_code == 422 else {}

    def cli_problem(model: str, resolution: int) -> str | None:
        args = argparse.Namespace(checkpoint=None, model=model, model_path="/m",
                                  resolution=resolution, guidance_scale=None)
        try:
            _model_spec(args)
        except ConfigError as exc:
            return exc.message if exc.field == "--resolution" else None
        return None

    _register_custom(monkeypatch)
    assert "resolution" not in train_problems("custom", 100)
    assert "resolution" not in rollout_problems("custom", 100)
    for model, resolution, words in (("flux", 520, "multiple of 16"), ("shapes", 64, "32x32")):
        message = train_problems(model, resolution)["resolution"]
        assert words in message and "got " + str(resolution) in message
        assert rollout_problems(model, resolution)["resolution"] == message
        # the same rule; the CLI (whose --resolution refuses 0) says "left out" for the default
        assert cli_problem(model, resolution) == message.replace("0", "--resolution left out", 1)
    for model, resolution in (("flux", 512), ("shapes", 32), ("shapes", 0)):
        assert "resolution" not in train_problems(model, resolution)
        assert cli_problem(model, resolution) is None


def test_a_registered_model_with_a_directory_needs_model_path(monkeypatch):
    from trainer.config import TrainConfig

    _register_custom(monkeypatch, "dirmodel", ["model_index.json"])
    problems = {e.field for e in TrainConfig(model="dirmodel", reward_weights={
        "jpeg_compressibility": 1.0}).problems()}
    assert problems == {"model_path"}


# --- 11-12. NUL characters; the users endpoints ------------------------------------------------
def test_nul_characters_are_refused_naming_the_field(client, admin, annotator, session):
    from app.models import User, Vote

    r = client.post("/api/users", json={"name": "a\u0000b"}, headers=admin)
    assert r.status_code == 422, r.text
    assert _errors(r)["name"].startswith("must not contain control or invisible characters")
    for field in ("session_id", "selection"):
        r = client.post("/api/votes", json={"client_vote_id": "v1", "sample_a_id": 1,
                                            "sample_b_id": 2, "outcome": "a",
                                            field: "x\u0000y"}, headers=annotator)
        assert r.status_code == 422, r.text
        assert _errors(r) == {field: "must not contain NUL characters",
                              "sample_a_id": "sample 1 not found",
                              "sample_b_id": "sample 2 not found"}
    r = client.get("/api/rollouts", params={"prompt": "a\x00b"}, headers=annotator)
    assert r.status_code == 422, r.text
    assert r.json() == {"detail": "prompt: must not contain NUL characters", "field": "prompt",
                        "errors": [{"field": "prompt",
                                    "message": "must not contain NUL characters"}]}
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(User).where(
        User.name.like("a%b"))) == 0
    assert session.scalar(select(func.count()).select_from(Vote)) == 0


def test_create_user_service_refuses_nul_too(session):
    import pytest

    from app.errors import Invalid
    from app.services.auth import create_user

    for name in ("eve\x00", "eve\u200b", "eve\r\nX: y"):
        with pytest.raises(Invalid, match="name: must not contain control or invisible"):
            create_user(session, name, "annotator")


def test_names_that_look_alike_or_hold_hidden_characters_are_refused(client, admin, session):
    """"ann1" and "ann1" + U+200B were two users who look like one; a NUL in a file name
    was stored (and fails PostgreSQL)."""
    for name in ("ann1\u200b", "\u202eevil", "tab\there", "a\r\nX: y"):
        r = client.post("/api/users", json={"name": name}, headers=admin)
        assert r.status_code == 422 and "U+" in _errors(r)["name"], r.text
    # a blank name and a bad role are reported together
    r = client.post("/api/users", json={"name": "  ", "role": "root"}, headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"name", "role"}, r.text
    assert _errors(r)["name"] == "must not be blank"
    for name in ("hdr\r\ninj", "\u202eevil\u200b"):
        r = _upload(client, admin, "r.txt", b"one red circle\n", name=name)
        assert r.status_code == 422 and "invisible" in _errors(r)["name"], r.text
    # a raw multipart body: clients such as requests send the NUL as it is (httpx escapes it)
    body = (b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="r\x00.txt"\r\n'
            b"Content-Type: text/plain\r\n\r\none red circle\n\r\n--xyz--\r\n")
    r = client.post("/api/datasets", content=body, headers={
        **admin, "Content-Type": "multipart/form-data; boundary=xyz"})
    assert r.status_code == 422 and "U+0000" in _errors(r)["file"], r.text
    assert _counts(session) == (0, 0)
    assert _upload(client, admin, "ok.txt", b"one\n", name="plain name").status_code == 201


def test_an_upload_takes_one_file_and_names_the_file_for_its_content(client, admin, session):
    """A second file part was dropped without a word (the last one was imported); what is
    wrong inside a file was reported against "body"."""
    files = [("file", ("r.txt", b"one\n", "text/plain")), ("file", ("s.txt", b"two\n", "text/plain"))]
    r = client.post("/api/datasets", files=files, headers=admin)
    assert r.status_code == 422 and _errors(r) == {"file": "given 2 times; the upload takes one"}
    for filename, data in (("bin.txt", b"\xff\xfe\x00b"), ("e.txt", b"\n\n"),
                           ("c.csv", b"text\nx\n"), ("j.json", b'{"a": 1}'),
                           ("deep.json", b"[" * 100_000 + b"]" * 100_000)):
        r = _upload(client, admin, filename, data)
        assert r.status_code == 422 and list(_errors(r)) == ["file"], (filename, r.text)
    assert "nested too deeply" in _upload(client, admin, "deep.json",
                                          b"[" * 100_000 + b"]" * 100_000).text
    assert _counts(session) == (0, 0)


def test_an_upload_answers_every_problem_of_its_form_at_once(client, admin, session):
    """A bad eval_fraction hid an unsupported file type (and a misspelt field hid a bad
    value): the user fixed one, sent again and met the next. All of them come in one 422."""
    pdf = "p.pdf: unsupported file type .pdf; use one of .txt, .csv, .jsonl, .json, .parquet"
    r = _upload(client, admin, "p.pdf", b"%PDF", eval_fraction=2)
    assert r.status_code == 422, r.text
    assert _errors(r) == {"eval_fraction": "Input should be less than 1", "file": pdf}, r.text
    r = _upload(client, admin, "p.pdf", b"%PDF", eval_fracton=0.1, seed=-1)
    assert r.status_code == 422, r.text
    assert _errors(r) == {"seed": "Input should be greater than or equal to 0", "file": pdf,
                          "eval_fracton": "unknown field; the upload takes file, name, "
                          "eval_fraction, seed"}, r.text
    # its form valid, a file without a name and an unknown field come together too
    r = client.post("/api/datasets", files={"file": ("", b"one\n", "text/plain")},
                    data={"nmae": "x"}, headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"file", "nmae"}, r.text
    # a wrong file type alone stays the 400 it always was
    r = _upload(client, admin, "p.pdf", b"%PDF")
    assert r.status_code == 400 and r.json()["detail"] == pdf, r.text
    assert _counts(session) == (0, 0)
    # ... but with a name another dataset has, both come in one 422 (the name given, or the
    # file's stem)
    assert _upload(client, admin, "taken.txt", b"one red circle\n").status_code == 201
    for form in ({"name": "taken"}, {}):
        r = _upload(client, admin, "taken.pdf", b"%PDF", **form)
        assert r.status_code == 422, r.text
        errors = _errors(r)
        assert set(errors) == {"file", "name"}, r.text
        assert "unsupported file type .pdf" in errors["file"], r.text
        assert "a dataset named 'taken' already exists" in errors["name"], r.text
    # ... whatever else is wrong beside the file: a bad eval_fraction hid the taken name, as
    # did a file without a name
    for filename, form in (("x.pdf", {"eval_fraction": 2}), ("", {"eval_fraction": 2}),
                           ("", {})):
        r = client.post("/api/datasets", files={"file": (filename, b"one\n", "text/plain")},
                        data={"name": "taken", **form}, headers=admin)
        assert r.status_code == 422, r.text
        errors = _errors(r)
        assert set(errors) == {"file", "name", *form}, r.text
        assert "a dataset named 'taken' already exists" in errors["name"], r.text
    assert _counts(session) == (1, 1)


def test_a_multipart_body_its_parser_refuses_answers_in_the_usual_shape(client, admin, session):
    """Starlette's parser gives up on a file name of 5,000 characters ("Invalid multipart
    data.") and on a multipart type without a boundary: 400s that said only `detail`, where
    every other answer about the request names its field and lists its problems."""
    r = _upload(client, admin, "p" * 5000 + ".txt", b"one red circle\n")
    assert r.status_code == 400, r.text
    assert r.json() == {"detail": "body: Invalid multipart data", "field": "body",
                        "errors": [{"field": "body", "message": "Invalid multipart data"}]}
    r = client.post("/api/datasets", content=b"x", headers={
        **admin, "content-type": "multipart/form-data"})
    assert r.status_code == 400 and r.json()["field"] == "body", r.text
    assert r.json()["errors"] == [{"field": "body", "message": "Missing boundary in multipart"}]
    assert _counts(session) == (0, 0)


def test_users_refuse_unknown_fields_and_answer_utc(client, admin):
    r = client.post("/api/users", json={"name": "eve", "rolle": "admin"}, headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"rolle"}
    r = client.post("/api/users", json={"name": "eve"}, headers=admin)
    assert r.status_code == 201, r.text
    users = client.get("/api/users", headers=admin).json()
    assert users and all(u["created_at"].endswith("Z") for u in users), users


# --- 13. an upload's caller, role and size are checked before its body is read ------------------
def _upload_reads(app, headers: dict[str, str], size: int) -> tuple[int, dict, int]:
    """(status, body, chunks of the body read) of a multipart upload declaring `size` bytes,
    sent to the ASGI app directly, so that what it reads is counted."""
    import asyncio

    boundary = "xyz"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="p.txt"\r\n'
            "Content-Type: text/plain\r\n\r\n").encode()
    chunks = [head] + [b"a prompt\n" * 1000] * 20 + [f"\r\n--{boundary}--\r\n".encode()]
    read = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1],
                    "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in {
        **headers, "content-type": f"multipart/form-data; boundary={boundary}",
        "content-length": str(size)}.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/api/datasets", "raw_path":
             b"/api/datasets", "root_path": "", "query_string": b"", "headers": raw,
             "client": ("test", 1), "server": ("test", 80)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), read


def test_upload_checks_token_role_and_size_before_reading(settings, admin, annotator, session):
    from app.main import create_app

    app = create_app(settings, enqueuer=lambda job_id, kind: None, mount_ui=False)
    huge = 300 * 1024 * 1024
    status, body, read = _upload_reads(app, {}, huge)
    assert (status, body["detail"], read) == (401, "missing bearer token", 0)
    status, body, read = _upload_reads(app, {"authorization": "Bearer nope"}, huge)
    assert (status, read) == (401, 0)
    status, body, read = _upload_reads(app, annotator, huge)
    assert (status, read) == (403, 0) and "needs role admin" in body["detail"]
    status, body, read = _upload_reads(app, admin, huge)
    assert (status, body["field"], read) == (413, "file", 0), body
    assert f"larger than the limit of {settings.max_upload_bytes} bytes" in body["detail"]
    assert _counts(session) == (0, 0)
    # an admin's upload of the size it declares is read and imported
    status, body, read = _upload_reads(app, admin, 182_000)
    assert (status, body["num_prompts"]) == (201, 1), body


def test_upload_form_fields_are_validated_as_documented(client, admin, session):
    for value in ("nan", "inf", "-Infinity"):
        r = _upload(client, admin, "p.txt", b"one\n", eval_fraction=value)
        assert r.status_code == 422, r.text
        assert _errors(r) == {"eval_fraction": "must be a finite number"}
    r = _upload(client, admin, "p.txt", b"one\n", eval_fraction=1, seed=-1)
    assert set(_errors(r)) == {"eval_fraction", "seed"}
    assert _counts(session) == (0, 0)
    schema = client.get("/openapi.json").json()["paths"]["/api/datasets"]["post"]
    assert schema["operationId"] == "upload_dataset_api_datasets_post"
    assert {"201", "401", "403", "413", "422"} <= set(schema["responses"])
    assert "multipart/form-data" in schema["requestBody"]["content"]
    assert schema["security"] == [{"HTTPBearer": []}]


def test_the_refit_image_cache_decodes_once_and_keeps_to_its_byte_budget(settings, monkeypatch):
    """A training job's online refits share one ImageCache: an image read again is not
    decoded again, and beyond max_bytes the least recently used ones go."""
    import io

    import numpy as np
    from PIL import Image

    from app.services import storage
    from worker.preference import ImageCache

    paths = []
    for k in range(4):
        buf = io.BytesIO()
        Image.fromarray(np.full((32, 32, 3), k * 60, dtype=np.uint8)).save(buf, format="PNG")
        paths.append(f"rollouts/test/{k}.png")
        storage.write_bytes(paths[-1], buf.getvalue())
    reads = []
    real_resolve = storage.resolve
    monkeypatch.setattr(storage, "resolve", lambda rel: reads.append(rel) or real_resolve(rel))
    cache = ImageCache(max_bytes=2 * 32 * 32 * 3)  # room for two
    assert int(cache.get(paths[0])[0, 0, 0]) == 0 and int(cache.get(paths[1])[0, 0, 0]) == 60
    cache.get(paths[0])  # a hit, and now the most recently used
    assert reads == paths[:2]
    cache.get(paths[2])  # over budget: paths[1], the least recently used, goes
    assert cache.nbytes == 2 * 32 * 32 * 3
    cache.get(paths[0])
    cache.get(paths[1])
    assert reads == [*paths[:3], paths[1]]


def test_prompts_with_controls_or_direction_overrides_are_refused_everywhere(client, admin,
                                                                              session):
    """An escape sequence in a prompt rewrites the terminal of whoever reads the worker's log,
    and a right-to-left override shows the UI's reviewer other text than the encoder gets:
    refused in uploads, job configs and the trainer's config alike (one rule), while an
    emoji's joiner and a Hebrew prompt's direction mark are ordinary text."""
    from app.models import Dataset
    from trainer.config import TrainConfig

    before = session.scalar(select(func.count()).select_from(Dataset))
    data = "one red circle\nred \x1b[2Jcircle\nsafe \u202etxt.exe\n".encode()
    r = client.post("/api/datasets", files={"file": ("p.txt", data, "text/plain")},
                    headers=admin)
    assert r.status_code == 422, r.text
    messages = [(e["where"], e["message"]) for e in r.json()["errors"]]
    assert messages == [("line 2", "prompt contains control or text-direction characters "
                                   "(U+001B)"),
                        ("line 3", "prompt contains control or text-direction characters "
                                   "(U+202E)")]
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(Dataset)) == before  # nothing kept

    r = client.post("/api/jobs", json={"kind": "train", "config": {
        "prompts": ["two blue squares", "x\x07y", "\u2066three\u2069"]}}, headers=admin)
    assert r.status_code == 422, r.text
    message = _errors(r)["prompts"]
    # numbered from 1, as an upload's lines and items are
    assert "prompt 2: prompt contains control" in message and "U+0007" in message
    assert "prompt 3:" in message and "U+2066" in message and "prompt 1" not in message

    problems = TrainConfig(prompts=["a\x1bb"]).problems()
    assert [p.field for p in problems] == ["prompts"] and "U+001B" in problems[0].message

    ok = "👨\u200d👩 family\nשלום\u200f עולם\n".encode()
    r = client.post("/api/datasets", files={"file": ("ok.txt", ok, "text/plain")},
                    headers=admin)
    assert r.status_code == 201, r.text


def test_a_malformed_body_without_a_valid_token_is_401_before_422(client, admin, annotator):
    """FastAPI parses a JSON body before the route's dependencies run: the caller's own
    refusal (401 without a valid token, 403 without the role) still comes first, so an
    unauthenticated client learns nothing of how a route reads its body."""
    bad = {"Content-Type": "application/json"}
    for body in (b"{bad", b"[" * 100_000):  # unparseable; nested past the parser's stack
        for path in ("/api/votes", "/api/users"):
            for headers in ({}, {"Authorization": "Bearer nope"}):
                r = client.post(path, content=body, headers={**bad, **headers})
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
        # an annotator may launch no kind of job: 403 on /api/jobs too, whatever the body
        for path in ("/api/users", "/api/jobs"):
            r = client.post(path, content=body, headers={**bad, **annotator})
            assert r.status_code == 403 and "needs role admin" in r.text, (path, r.text)
        for path in ("/api/votes", "/api/users", "/api/jobs"):
            r = client.post(path, content=body, headers={**bad, **admin})
            assert r.status_code == 422 and r.json()["field"] == "body", (path, r.text)


def test_a_key_given_twice_in_a_json_body_is_422_naming_it(client, admin, annotator):
    """Python's json keeps the last of two equal keys without a word: the job below was judged
    on "x" alone. Refused, naming the key and where it repeats, and nothing is written."""
    from app.db import session_scope
    from app.services import jobs

    with session_scope() as s:
        before = jobs.list_jobs(s)[1]
    body = '{"kind": "train", "preset": "tiny", "config": {"iterations": 2, "iterations": 3}}'
    r = _raw(client, "/api/jobs", body, admin)
    assert r.status_code == 422, r.text
    message = _errors(r)["body"]
    assert "key 'iterations' given twice in one object" in message
    second = body.index('"iterations": 3')
    assert f"at character {second}" in message
    r = _raw(client, "/api/votes", '{"client_vote_id": "v1", "client_vote_id": "v2", '
             '"sample_a_id": 1, "sample_b_id": 2, "outcome": "a"}', annotator)
    assert r.status_code == 422 and "'client_vote_id' given twice" in _errors(r)["body"]
    with session_scope() as s:
        assert jobs.list_jobs(s)[1] == before
    # one key in each of two objects is no repeat; without a token it is still a 401 first
    r = _raw(client, "/api/jobs", '{"kind": "train", "preset": "tiny", "config": '
             '{"iterations": 1, "reward_weights": {"count": 1}}}', admin)
    assert r.status_code == 201, r.text
    assert _raw(client, "/api/jobs", body, {}).status_code == 401
    # a well-formed body the schema refuses is still the annotator's 403 first
    r = client.post("/api/jobs", json={"kind": "train", "extra": 1}, headers=annotator)
    assert r.status_code == 403 and "needs role admin" in r.text, r.text


def test_every_api_route_reads_its_body_strictly(settings):
    """Each router names StrictJSONRoute itself: a router added without it would take a
    repeated key silently again. Every API route the app mounts that could take a JSON body
    reads through it."""
    from fastapi import params
    from fastapi.routing import APIRoute, iter_route_contexts

    from app.api.strict_json import StrictJSONRoute
    from app.main import create_app

    # FastAPI 0.165 mounts an included router as a whole; its contexts give each route (the
    # one the router made, with its route class, as `original_route`)
    api = [(ctx.path, getattr(ctx._effective_route, "original_route", ctx._effective_route))
           for ctx in iter_route_contexts(create_app(settings).routes)
           if ctx.path.startswith("/api")]
    assert len(api) > 20 and all(isinstance(route, APIRoute) for _, route in api)
    # a multipart upload (the dataset route) has no JSON body to read strictly
    loose = [path for path, route in api if not isinstance(route, StrictJSONRoute)
             and not (route.body_field and isinstance(route.body_field.field_info, params.Form))]
    assert loose == []


def test_text_utf8_cannot_hold_is_named_not_a_500(client, admin, annotator):
    """JSON may escape a lone surrogate ("\\ud800"), which no UTF-8 text holds: an error
    naming it could not be written and the caller got a 500. Each is a 422 naming the field,
    the offending text written back as a JSON escape."""
    for kind in ("train", "rollout", "fit_preference"):
        body = '{"kind": "KIND", "config": {"\\ud800x": 1}}'.replace("KIND", kind)
        r = _raw(client, "/api/jobs", body, admin)
        assert r.status_code == 422, (kind, r.text)
        assert r.content.decode("utf-8")  # valid UTF-8 throughout
        assert r.json()["errors"][0] == {"field": "\ud800x", "message": "unknown field"}, kind
        assert "config.\ud800x: unknown field" in r.json()["detail"]
    r = _raw(client, "/api/jobs", '{"kind": "train", "preset": "\\ud800"}', admin)
    assert r.status_code == 422 and r.json()["field"] == "preset", r.text
    r = _raw(client, "/api/votes", '{"client_vote_id": "\\ud800", "sample_a_id": 1, '
             '"sample_b_id": 2, "outcome": "a"}', annotator)
    assert r.status_code == 422 and r.json()["field"] == "client_vote_id", r.text
    # in a config's values: refused, not stored for GET /api/jobs to fail on
    r = _raw(client, "/api/jobs", '{"kind": "train", "preset": "tiny", "config": {"prompts": '
             '["one red circle\\ud800"], "reward_weights": {"count\\udc00": 1}}}', admin)
    assert r.status_code == 422, r.text
    assert "prompt 1: prompt contains lone surrogate escapes (U+D800)" in _errors(r)["prompts"]
    assert "holds a lone surrogate escape (U+DC00)" in r.text
    assert client.get("/api/jobs", headers=admin).json()["total"] == 0
    # in an upload's prompts or metadata: the line named, nothing stored (an upload's
    # prompts failed to insert after its dataset row, a 500 that left the row behind)
    for body, expected in ((b'{"prompt": "a\\ud800b"}\n', "prompt contains lone surrogate"),
                           (b'{"prompt": "ok", "note": ["\\udfff"]}\n',
                            "metadata holds a lone surrogate escape (U+DFFF)")):
        r = client.post("/api/datasets", files={"file": ("s.jsonl", body, "text/plain")},
                        headers=admin)
        assert r.status_code == 422 and "line 1: " + expected in r.json()["detail"], r.text
    assert client.get("/api/datasets", headers=admin).json()["total"] == 0


def test_a_query_parameter_given_twice_is_refused_unless_it_takes_a_list(client, admin,
                                                                         annotator):
    """`?dataset_id=1&dataset_id=2` answered with dataset 2's prompts: FastAPI keeps the last
    value without a word. Refused as a repeated JSON key or form field is, after the caller's
    own 401; a list parameter (votes/next's `exclude`) still takes several."""
    r = client.get("/api/prompts?dataset_id=1&dataset_id=2&limit=5", headers=admin)
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [{"field": "dataset_id", "message": "given 2 times; this "
                                   "parameter takes one value"}]
    assert client.get("/api/prompts?dataset_id=1&dataset_id=2").status_code == 401
    r = client.get("/api/votes/next?exclude=1&exclude=2", headers=annotator)
    assert r.status_code != 422, r.text
    assert client.get("/api/prompts?limit=5&offset=0", headers=admin).status_code == 200


def test_a_bad_query_string_is_named_beside_the_requests_other_problems(client, admin,
                                                                         annotator):
    """An unknown or repeated query parameter was the whole 422, hiding a bad limit or a
    body missing its fields; one answer names all of them, and a request whose only problem
    is its query string is still refused before the route does anything."""
    r = client.get("/api/prompts?dataset_id=abc&limit=-1&foo=1", headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"foo", "dataset_id", "limit"}, r.text
    assert r.json()["field"] == "foo"
    r = client.get("/api/prompts?limit=1&limit=2&offset=-1", headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"limit", "offset"}, r.text
    r = client.post("/api/votes?x=1", json={}, headers=annotator)
    assert r.status_code == 422, r.text
    assert {"x", "sample_a_id", "sample_b_id", "outcome"} <= set(_errors(r)), r.text
    # a valid body under a bad query string: refused, and nothing done
    r = client.post("/api/users?x=1", json={"name": "dora", "role": "annotator"},
                    headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"x"}, r.text
    names = [u["name"] for u in client.get("/api/users", headers=admin).json()]
    assert "dora" not in names
    assert client.post("/api/users?x=1", json={}).status_code == 401  # the caller's first


def test_a_query_value_that_is_not_utf8_is_refused_not_replaced(client, admin, make_group):
    """`?q=caf%E9` (Latin-1) was decoded to 'caf\ufffd' and matched a prompt holding that
    character; `?prompt=%ff` answered an empty list as if it were a search."""
    make_group()
    r = client.post("/api/datasets", headers=admin, files={
        "file": ("p.txt", "caf\ufffd menu\none red circle\n".encode(), "text/plain")})
    assert r.status_code == 201, r.text
    for url, field in (("/api/prompts?q=caf%E9", "q"), ("/api/rollouts?prompt=%ff", "prompt")):
        r = client.get(url, headers=admin)
        assert r.status_code == 422, (url, r.text)
        assert set(_errors(r)) == {field}, r.text
        assert "must be UTF-8 text" in _errors(r)[field]
    assert client.get("/api/prompts?q=caf%E9").status_code == 401  # the caller's first
    # UTF-8 still searches: 'é' is %C3%A9, and the replacement character is a character too
    assert client.get("/api/prompts?q=caf%C3%A9", headers=admin).json()["total"] == 0
    r = client.get("/api/prompts?q=caf%EF%BF%BD", headers=admin)
    assert r.status_code == 200 and r.json()["total"] == 1, r.text


def test_a_query_parameter_the_route_does_not_take_is_refused(client, admin, annotator,
                                                              make_group):
    """`?jobid=1` (job_id misspelt) answered with every rollout, `?fmt=csv` with JSONL:
    FastAPI drops a name the route does not declare without a word. Every unknown name is
    refused at once, naming the ones the route takes, after the caller's own 401 or 403."""
    make_group()
    r = client.get("/api/rollouts?jobid=1&iteratoin=2&job_id=1", headers=admin)
    assert r.status_code == 422, r.text
    takes = ("unknown query parameter; this route takes checkpoint_id, iteration, job_id, "
             "limit, offset, prompt, prompt_id, purpose")
    assert r.json()["errors"] == [{"field": "jobid", "message": takes},
                                  {"field": "iteratoin", "message": takes}]
    assert r.json()["field"] == "jobid"
    assert client.get("/api/rollouts?jobid=1").status_code == 401
    r = client.get("/api/datasets/1/export?fmt=csv", headers=admin)
    assert r.status_code == 422 and _errors(r) == {
        "fmt": "unknown query parameter; this route takes format"}, r.text
    r = client.get("/api/votes/next?exclud=1", headers=annotator)
    assert r.status_code == 422 and set(_errors(r)) == {"exclud"}, r.text
    r = client.get("/api/prompts?foo=1&dataset_id=1&dataset_id=2", headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"foo", "dataset_id"}, r.text
    r = client.get("/api/jobs/config-schema?x=", headers=admin)
    assert r.status_code == 422 and _errors(r) == {
        "x": "unknown query parameter; this route takes none"}, r.text
    assert client.get("/api/users?x=1", headers=annotator).status_code == 403  # role first
    r = client.post("/api/datasets?nam=x", files={"file": ("p.txt", b"one red circle\n")},
                    headers=admin)
    assert r.status_code == 422 and set(_errors(r)) == {"nam"}, r.text
    # what the app itself links to still answers: declared parameters, media URLs
    assert client.get("/api/rollouts?iteration=0&limit=5", headers=admin).status_code == 200
    group = client.get("/api/rollouts", headers=admin).json()["items"][0]
    assert client.get(group["samples"][0]["image_url"], headers=admin).status_code == 200
    assert client.get("/api/votes/next?exclude=1&exclude=2", headers=annotator).status_code in (
        200, 204)


def test_a_body_sent_to_a_route_that_takes_none_is_refused(client, admin, session):
    """`POST /api/jobs/1/cancel` with `{"force": true}` was answered as if the option had been
    taken: FastAPI never reads the body of a route that declares none. Such a body is a 422
    naming it (beside the query string's problems), after the caller's own 401, and the
    route's work is not done; an empty body, `{}` or `null` (what some clients send with
    every POST) means none."""
    from app.models import Job
    from app.services import jobs

    job = jobs.create_job(session, "train", {}, preset="tiny")
    session.commit()
    url = f"/api/jobs/{job.id}/cancel"
    r = client.post(url, headers=admin, json={"force": True})
    assert r.status_code == 422, r.text
    assert _errors(r) == {"body": "this route takes no body (14 bytes sent); its options, "
                                  "where it has any, are query parameters"}
    session.expire_all()
    row = session.get(Job, job.id)
    assert row.status == "queued" and not row.cancel_requested
    r = client.post(url + "?now=1", headers=admin, content=b"force")
    assert r.status_code == 422 and set(_errors(r)) == {"now", "body"}, r.text
    assert client.post(url, json={"force": True}).status_code == 401  # the caller's first
    r = client.request("GET", "/api/jobs", headers=admin, content=b'{"status": "queued"}')
    assert r.status_code == 422 and set(_errors(r)) == {"body"}, r.text
    for nothing in (b"", b"{}", b"null", b" {} \n"):
        r = client.request("GET", "/api/jobs", headers=admin, content=nothing)
        assert r.status_code == 200, (nothing, r.text)
    assert client.post(url, headers=admin, json={}).status_code == 200
    session.expire_all()
    assert session.get(Job, job.id).status == "cancelled"


def test_a_body_with_thousands_of_problems_lists_the_first_hundred_and_counts_the_rest(
        client, admin, annotator):
    """A vote with 300,000 unknown keys answered after 30 s with a 31 MB list, built in the
    event loop while every other request waited (the API audit, 2026-12-07); an admin's job
    config with 100,000 unknown reward names gave 58 MB. Both list MAX_PROBLEMS_LISTED now,
    then one line with how many more."""
    from app.limits import MAX_PROBLEMS_LISTED

    extra = MAX_PROBLEMS_LISTED + 250
    vote = {"client_vote_id": "x", "sample_a_id": 1, "sample_b_id": 2, "outcome": "a",
            **{f"k{i}": 1 for i in range(extra)}}
    r = client.post("/api/votes", json=vote, headers=annotator)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert len(errors) == MAX_PROBLEMS_LISTED + 1, len(errors)
    assert errors[0]["field"] == "k0" and "not permitted" in errors[0]["message"], errors[0]
    # the unknown keys beyond the first hundred, and the two samples that do not exist
    assert errors[-1] == {"field": "body", "message": f"{extra + 2 - MAX_PROBLEMS_LISTED} "
                          f"more problem(s) not listed (the first {MAX_PROBLEMS_LISTED} are)"}
    assert r.json()["detail"].endswith(errors[-1]["message"])

    weights = {f"r{i}": 1.0 for i in range(extra)}
    r = client.post("/api/jobs", json={"kind": "train", "config": {
        "reward_weights": weights}}, headers=admin)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert len(errors) == MAX_PROBLEMS_LISTED + 1, len(errors)
    assert "more problem(s) not listed" in errors[-1]["message"]
    assert len(r.content) < 100_000, len(r.content)
    # a few problems: every one listed, no count line
    r = client.post("/api/votes", json={**{k: vote[k] for k in list(vote)[:4]}, "k1": 1,
                                        "k2": 2}, headers=annotator)
    assert [e["field"] for e in r.json()["errors"]] == ["k1", "k2", "sample_a_id",
                                                        "sample_b_id"], r.text
