"""A job config's prompts follow the upload's rule (whitespace normalised, no repeats, items
numbered from 1); an evaluate job takes prompts or a dataset, not both, as a train job does;
report_to names a tracker once; and a number too long to read is said to be one."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

REPEATED = "must not repeat a prompt: 'one red circle' (prompts 1 and 2)"
BOTH = "a dataset and config.prompts both give"


def _post(client, headers, kind: str, config: dict[str, Any], **request: Any):
    body = {"kind": kind, "config": config, **request}
    if kind == "train":
        body.setdefault("preset", "tiny")
    return client.post("/api/jobs", json=body, headers=headers)


def _messages(response, field: str) -> list[str]:
    return [e["message"] for e in response.json()["errors"] if e["field"] == field]


def _job_count(session) -> int:
    from app.models import Job

    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job))


def _upload(client, admin, name: str, text: str) -> dict[str, Any]:
    r = client.post("/api/datasets", files={"file": (f"{name}.txt", text.encode(), "text/plain")},
                    data={"name": name}, headers=admin)
    assert r.status_code == 201, r.text
    body = r.json()
    return body.get("dataset", body)


def _stored_prompts(client, admin, dataset_id: int) -> list[str]:
    r = client.get("/api/prompts", params={"dataset_id": dataset_id}, headers=admin)
    assert r.status_code == 200, r.text
    return [item["text"] for item in r.json()["items"]]


@pytest.fixture
def checkpoint(session) -> int:
    """A recorded checkpoint of the shapes model, with its file: an evaluate job's."""
    from app.services import storage
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE

    (storage.storage_root() / "ck").mkdir(parents=True, exist_ok=True)
    (storage.storage_root() / "ck/0.safetensors").write_bytes(SHAPES_BASE.read_bytes())
    ckpt = record_checkpoint(session, None, 0, "ck/0.safetensors", name="c0")
    session.commit()
    return ckpt


def _evaluate(checkpoint: int, **config: Any) -> dict[str, Any]:
    return {"checkpoint_ids": [checkpoint], "seeds": [0], **config}


# --- 1. whitespace normalised as an upload's, and no repeats, for every kind with prompts ----
def test_a_config_s_prompts_are_stored_as_an_upload_stores_them(client, admin, checkpoint):
    upload = _upload(client, admin, "spaced", "  one   red circle \n")
    assert _stored_prompts(client, admin, upload["id"]) == ["one red circle"]
    r = _post(client, admin, "train", {"prompts": ["  one   red circle ", "two\tblue\nsquares"]})
    assert r.status_code == 201, r.text
    assert r.json()["config"]["prompts"] == ["one red circle", "two blue squares"]
    r = _post(client, admin, "evaluate", _evaluate(checkpoint, prompts=["  one   red circle "]))
    assert r.status_code == 201, r.text
    assert r.json()["config"]["prompts"] == ["one red circle"]


@pytest.mark.parametrize("kind", ["train", "evaluate"])
@pytest.mark.parametrize("prompts", [["one red circle", "one red circle"],
                                     ["one red circle", " one  red\tcircle"]])
def test_a_repeated_prompt_is_422_naming_its_positions(client, admin, session, checkpoint,
                                                       kind, prompts):
    """A train config kept a repeat (an upload drops it; evaluate refused only an exact one):
    the one rule for both kinds, after normalising, its positions numbered from 1."""
    config = {"prompts": prompts} if kind == "train" else _evaluate(checkpoint, prompts=prompts)
    r = _post(client, admin, kind, config)
    assert r.status_code == 422, r.text
    assert _messages(r, "prompts") == [REPEATED], r.text
    assert r.json()["field"] == "prompts" and f"config.prompts: {REPEATED}" in r.json()["detail"]
    assert _job_count(session) == 0


def test_every_repeat_is_named_beside_the_config_s_other_problems(client, admin, checkpoint):
    prompts = ["one red circle", "two blue squares", "one red circle", "\u0000x",
               "two blue squares", "one red circle"]
    expected = ("must not repeat a prompt: 'one red circle' (prompts 1, 3 and 6); "
                "'two blue squares' (prompts 2 and 5)")
    for kind, config in (("train", {"prompts": prompts, "group_size": 1}),
                         ("evaluate", _evaluate(checkpoint, prompts=prompts, steps=1))):
        r = _post(client, admin, kind, config)
        assert r.status_code == 422, r.text
        assert expected in _messages(r, "prompts"), (kind, r.text)
        assert "prompt 4: prompt contains NUL (U+0000)" in _messages(r, "prompts"), r.text
        assert _messages(r, "group_size" if kind == "train" else "steps"), r.text


def test_a_zero_width_space_is_dropped_in_a_config_as_in_an_upload(client, admin, checkpoint):
    """An upload drops U+200B as it normalises whitespace (it shows nothing: the prompt is
    what it looks like), so a config does too: "one red\u200bcircle" is "one redcircle", in
    either, which is not "one red circle", and neither says the text is bad."""
    upload = _upload(client, admin, "zw", "one red\u200bcircle\none red circle\n")
    assert _stored_prompts(client, admin, upload["id"]) == ["one redcircle", "one red circle"]
    r = _post(client, admin, "evaluate",
              _evaluate(checkpoint, prompts=["one red\u200bcircle", "one red circle"]))
    assert r.status_code == 422, r.text  # the shapes model cannot draw it: no text problem
    assert len(_messages(r, "prompts")) == 1, r.text
    assert "draws only shapes prompts" in _messages(r, "prompts")[0], r.text


# --- 2. items numbered from 1, as an upload's; the field name unchanged ----------------------
def test_config_prompt_errors_count_from_one_as_an_upload_does(client, admin, checkpoint,
                                                               settings):
    r = client.post("/api/datasets", files={"file": ("p.json", b'["one red circle", " "]',
                                                     "application/json")}, headers=admin)
    assert r.status_code == 422 and r.json()["errors"][0]["where"] == "item 2", r.text
    r = _post(client, admin, "train", {"prompts": ["one red circle", " "]})
    assert r.status_code == 422, r.text
    assert _messages(r, "prompts") == ["prompt 2: empty prompt"], r.text
    r = _post(client, admin, "evaluate", _evaluate(checkpoint, prompts=["a\u0000b"]))
    assert r.status_code == 422, r.text
    assert "prompt 1: prompt contains NUL (U+0000)" in _messages(r, "prompts"), r.text
    limit = settings.max_prompt_length
    r = _post(client, admin, "evaluate", _evaluate(checkpoint, prompts=["one red circle",
                                                                       "y" * (limit + 1)]))
    assert r.status_code == 422, r.text
    assert f"prompt 2 has {limit + 1} characters" in " ".join(_messages(r, "prompts")), r.text


# --- 3. prompts and a dataset: refused for evaluate as for train --------------------------
@pytest.mark.parametrize("where", ["config", "request"])
def test_evaluate_with_prompts_and_a_dataset_is_422_as_train_is(client, admin, session,
                                                                checkpoint, where):
    """It was accepted with the dataset unused, yet the queued job held the dataset against
    deletion. Refused, naming dataset_id, as a train job's request is."""
    ds = _upload(client, admin, "reds", "one red circle\n")["id"]
    r = _post(client, admin, "train", {"prompts": ["one red circle"]}, dataset_id=ds)
    assert r.status_code == 422 and r.json()["field"] == "dataset_id", r.text
    train_message = _messages(r, "dataset_id")[0]
    config = _evaluate(checkpoint, prompts=["one red circle"])
    request = {"dataset_id": ds} if where == "request" else {}
    if where == "config":
        config["dataset_id"] = ds
    r = _post(client, admin, "evaluate", config, **request)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "dataset_id", r.text
    message = _messages(r, "dataset_id")[0]
    assert message == ("a dataset and config.prompts both give evaluation prompts; leave "
                       "config.prompts empty to evaluate the dataset, or give no dataset")
    assert message.startswith(BOTH) and train_message.startswith(BOTH)
    assert _job_count(session) == 0
    assert client.delete(f"/api/datasets/{ds}", headers=admin).status_code == 204
    # either alone is still a job
    assert _post(client, admin, "evaluate", _evaluate(
        checkpoint, prompts=["one red circle"])).status_code == 201
    ds = _upload(client, admin, "reds-again", "one red circle\n")["id"]
    assert _post(client, admin, "evaluate", _evaluate(
        checkpoint, dataset_id=ds, split="all")).status_code == 201


# --- 4. report_to names a tracker once -------------------------------------------------
@pytest.mark.parametrize("report_to", ["wandb,tensorboard,wandb", "tensorboard, TensorBoard",
                                       ["wandb", "wandb"]])
def test_a_repeated_tracker_is_422_naming_report_to(client, admin, session, report_to):
    r = _post(client, admin, "train", {"report_to": report_to})
    assert r.status_code == 422 and r.json()["field"] == "report_to", r.text
    assert any(m.startswith("must not repeat a tracker: ['") for m in _messages(r, "report_to"))
    assert _job_count(session) == 0
    assert _post(client, admin, "train", {"report_to": "wandb,tensorboard"}).status_code == 201


# --- 5. a number too long for Python to read -------------------------------------------
def test_a_5000_digit_number_is_said_to_be_too_large(client, admin, session):
    """json raises a bare ValueError at Python's int-string conversion limit (4300 digits),
    which the body reader called "malformed JSON (unreadable)"."""
    prefix = '{"kind": "train", "preset": "tiny", "config": {"note": "' + "9" * 5000 + '", '
    body = prefix + '"seed": 1' + "0" * 5000 + "}}"
    r = client.post("/api/jobs", content=body.encode(), headers={
        **admin, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    at = len(prefix) + len('"seed": ')  # the number's first digit; the string's do not count
    message = f"malformed JSON (number with more than 4300 digits at character {at})"
    assert r.json()["errors"] == [{"field": "body", "message": message}], r.text
    assert r.json()["detail"] == f"body: {message}"
    assert _job_count(session) == 0


# --- every problem in one 422 ----------------------------------------------------------
def test_all_of_these_problems_come_in_one_422(client, admin, session):
    ds = _upload(client, admin, "reds", "one red circle\n")["id"]
    r = _post(client, admin, "train", {"prompts": ["one red circle", "one  red circle", ""],
                                       "report_to": "wandb,wandb", "group_size": 1},
              dataset_id=ds)
    assert r.status_code == 422, r.text
    fields = [e["field"] for e in r.json()["errors"]]
    assert fields[0] == r.json()["field"] == "dataset_id", r.text
    assert {"dataset_id", "prompts", "report_to", "group_size"} <= set(fields), r.text
    assert REPEATED in _messages(r, "prompts") and "prompt 3: empty prompt" in r.text
    assert _job_count(session) == 0
