"""report_to in studio jobs: checked at submission (a 422 naming the field, and the package to
install), and a job's iterations logged under STORAGE_DIR/tracking as run job-<id>, the same
values the job page's metric history holds."""

from __future__ import annotations

import sys

import pytest

from app.db import session_scope
from app.services import jobs
from worker.training import run_training


def _post(client, headers, config):
    return client.post("/api/jobs", json={"kind": "train", "config": config, "preset": "tiny"},
                       headers=headers)


def _errors(response) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json()["errors"]}


def test_an_unknown_or_uninstalled_tracker_is_422_naming_report_to(client, admin, monkeypatch):
    r = _post(client, admin, {"report_to": "tensorbord"})
    assert r.status_code == 422 and "'tensorboard'" in _errors(r)["report_to"]
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python marks it not importable
    r = _post(client, admin, {"report_to": ["tensorboard", "mlflow"]})
    assert r.status_code == 422
    assert "mlflow-skinny" in _errors(r)["report_to"]
    assert "neighbor-grpo-studio[tracking]" in _errors(r)["report_to"]


def test_a_job_logs_its_metric_history_to_storage_tracking(client, admin, settings,
                                                           monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = _post(client, admin, {"device": "cpu", "iterations": 2, "report_to": "tensorboard"})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    with session_scope() as s:
        jobs.mark_running(s, job_id, "w1")
    assert run_training(job_id, "w1") == "succeeded"
    with session_scope() as s:
        history = {m.iteration: m.metrics["reward_mean"] for m in jobs.metric_history(s, job_id)}
    logdir = settings.resolved_storage_dir / "tracking" / "tensorboard" / f"job-{job_id}"
    acc = EventAccumulator(str(logdir)).Reload()
    # TensorBoard keeps float32
    assert {e.step: e.value for e in acc.Scalars("reward_mean")} == pytest.approx(history)
    assert [e.step for e in acc.Images("samples")] == [1, 2]
